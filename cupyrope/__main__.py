"""cupyrope's command line: ``python -m cupyrope`` (or ``cupyrope``) info | compile | check | bench | tune.

Exit codes: 0 done; 1 a failure (a check failed, a kernel did not compile, a missing dependency, a profile not
written); 2 bad arguments; 3 no CUDA GPU or no CUDA driver on this machine (check, bench, tune).
"""

import argparse
import concurrent.futures
import os
import platform
import sys
import time

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3


def _info(_args) -> int:
    import cupyrope

    print(f"cupyrope {cupyrope.__version__} on Python {platform.python_version()}")
    try:
        from ._runtime.compile import (NoGPUError, arch_unsupported, cache_dir, cuda_include_dir, device_count,
                                       import_cupy, nvrtc_version)
        from .ops.profiles import describe_profile

        cupy = import_cupy()
        headers = cuda_include_dir()
        if headers and not os.path.isfile(os.path.join(headers, "cuda_bf16.h")):
            headers = f"{headers} (no cuda_bf16.h there: fp16/bf16 kernels will not compile)"
        print(f"CuPy {cupy.__version__}; NVRTC {nvrtc_version()}; "
              f"CUDA headers {headers or 'not found: pip install the cuda12 or cuda13 extra'}")
        print(f"kernel cache: {cache_dir()}")
        try:
            count = device_count()
        except NoGPUError as error:
            print(f"GPU: {error}")
            count = 0
        for d in range(count):
            props = cupy.cuda.runtime.getDeviceProperties(d)
            arch = f"sm_{props['major']}{props['minor']}"
            print(f"cuda:{d} {props['name'].decode()} {arch} "
                  f"{props['multiProcessorCount']} SMs {props['totalGlobalMem'] / 2**30:.0f} GiB")
            unsupported = arch_unsupported(arch)
            if unsupported:
                print(f"  {unsupported}")
            print(f"  launch profile: {describe_profile(d)}")
    except ImportError as error:
        print(f"CuPy is not installed ({error}); pip install 'cupyrope[cuda12]' or 'cupyrope[cuda13]'")
    try:
        import torch

        print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, available: {torch.cuda.is_available()})")
    except ImportError:
        print("torch: not installed (optional)")
    return EXIT_OK


def compile_variants(arch: str, jobs: int, *, cache: bool = True, force: bool = False):
    """compile_all over every kernel variant in ``jobs`` threads (NVRTC releases the GIL)."""
    from ._runtime.compile import compile_all
    from .ops import all_variants

    variants = all_variants()
    chunks = [variants[i::jobs] for i in range(jobs)]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        parts = pool.map(lambda chunk: compile_all(arch, chunk, cache=cache, force=force), chunks)
        return [result for part in parts for result in part]


def _default_arch() -> str:
    """The architecture of the GPUs on this machine (comma-separated), for compile without --arch."""
    from ._runtime.compile import NoGPUError, device_count, import_cupy

    try:
        count = device_count()
    except NoGPUError as error:
        raise ValueError(f"arch: {error}; name the GPU's architecture, e.g. --arch sm_90") from None
    cupy = import_cupy()
    archs = []
    for d in range(count):
        arch = "sm_" + "".join(map(str, cupy.cuda.Device(d).compute_capability))
        if arch not in archs:
            archs.append(arch)
    return ",".join(archs)


def _compile(args) -> int:
    from ._runtime.compile import KernelCompileError, cache_dir, checked_arch

    try:
        archs = [checked_arch(a) for a in (args.arch or _default_arch()).split(",")]  # all checked first
        for arch in archs:
            start = time.perf_counter()
            results = compile_variants(arch, args.jobs, cache=not args.check_only, force=args.force)
            if args.verbose:
                for source, name, size, compiled in results:
                    print(f"{source}: {name}: {size} bytes{'' if compiled else ' (cached)'}")
            compiled = sum(r[3] for r in results)
            where = "checked only, nothing kept" if args.check_only else (
                f"{compiled} compiled, {len(results) - compiled} already in the kernel cache {cache_dir()}")
            print(f"{arch}: {len(results)} kernel variants ({where}) in {time.perf_counter() - start:.1f} s",
                  flush=True)
    except (KernelCompileError, ValueError) as error:
        print(f"cupyrope compile: {error}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _check(_args) -> int:
    from ._runtime.compile import KernelCompileError
    from .check import run_checks

    try:
        return EXIT_OK if run_checks() else EXIT_FAILED
    except KernelCompileError as error:
        print(f"cupyrope check: FAIL: {error}", file=sys.stderr)
        return EXIT_FAILED


def _bench(args) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def _tune(args) -> int:
    from ._runtime.compile import device_count
    from ._runtime.device import gpu_model
    from .ops import profiles
    from .tune import tune

    if not 0 <= args.device < device_count():
        print(f"cupyrope tune: --device: expected 0 to {device_count() - 1}, got {args.device}", file=sys.stderr)
        return EXIT_USAGE
    start = time.perf_counter()
    profile, measured = tune(args.device, say=lambda line: print(line, flush=True))
    path = args.out or profiles.tuned_path(gpu_model(args.device))
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as file:
            file.write(profiles.profile_json(profile, made_by="python -m cupyrope tune", measured=measured))
    except OSError as error:
        print(f"cupyrope tune: cannot write the profile: {error}", file=sys.stderr)
        return EXIT_FAILED
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s"
          + ("" if args.out else "; processes on this GPU model now plan with it"))
    return EXIT_OK


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def main(argv=None) -> int:
    from . import model_bench  # its families and regimes (the standard library only)

    parser = argparse.ArgumentParser(prog="python -m cupyrope", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, CUDA devices, kernel cache location").set_defaults(func=_info)
    p = sub.add_parser("compile", help="build every kernel variant into the kernel cache ahead of time (no GPU "
                                       "needed), so that first calls load them instead of compiling")
    p.add_argument("--arch", help="target GPU architecture(s): sm_90, 90 or 9.0; several: sm_80,sm_90 (default: "
                                  "the GPUs of this machine)")
    p.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1)
    p.add_argument("--force", action="store_true", help="compile again what the cache already holds")
    p.add_argument("--check-only", action="store_true", help="only check that every variant compiles; keep nothing")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=_compile)
    sub.add_parser("check", help="run every op on the GPU against the float64 references").set_defaults(func=_check)
    p = sub.add_parser("bench", help="compare cupyrope with the installed peers (tables + PNG plot)")
    p.add_argument("--full", action="store_true", help="the full grid of shapes (default: a short one)")
    p.add_argument("--plot", default="cupyrope-bench.png", help="where to write the GB/s plot")
    p.add_argument("--op", choices=("rope", "rmsnorm", "add_rms_norm", "rms_norm_fp8", "layer_norm", "qk_norm_rope",
                                    "model", "all"),
                   default="all",
                   help="model: transformers Llama-3 and Qwen3 (~1B) unpatched, patched by cupyrope and by Liger, "
                        "each in a process of its own (needs transformers; not part of 'all')")
    p.add_argument("--rounds", type=_positive_int, default=3,
                   help="calls under 50 us: time the providers this many times, taking turns, and keep medians; "
                        "--op model: rounds of every variant (at least 2)")
    p.add_argument("--family", action="append", choices=tuple(model_bench.FAMILIES),
                   help="--op model: only this model family (repeat for more; default every one)")
    p.add_argument("--regime", action="append", choices=tuple(model_bench.REGIMES),
                   help="--op model: only this regime (repeat for more; default every one)")
    p.add_argument("--json", help="also save the results (and environment) to this JSON file")
    p.add_argument("--from-json", help="re-render tables and plot from a saved --json file (no GPU needed)")
    p.set_defaults(func=_bench)
    p = sub.add_parser("tune", help="time the planners' launch choices on this GPU (a few minutes) and write the "
                                    "launch profile later processes use")
    p.add_argument("--device", type=int, default=0, help="which CUDA device to tune (default 0)")
    p.add_argument("--out", help="write the profile here instead of beside the kernel cache (select it with "
                                 "CUPYROPE_PROFILE=path)")
    p.set_defaults(func=_tune)
    args = parser.parse_args(argv)
    from ._runtime.compile import NoGPUError

    try:
        return args.func(args)
    except NoGPUError as error:
        print(f"cupyrope {args.command}: {error}", file=sys.stderr)
        return EXIT_NO_GPU


if __name__ == "__main__":
    sys.exit(main())
