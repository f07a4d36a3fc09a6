"""python -m cupyrope {info,compile,check,bench}: environment report, compile-only build of every
kernel variant (no GPU needed), GPU self-check against the float64 references, quick benchmark."""

import argparse
import concurrent.futures
import os
import platform
import sys
import time


def _info(_args) -> int:
    import cupyrope

    print(f"cupyrope {cupyrope.__version__} on Python {platform.python_version()}")
    try:
        from ._cupy import import_cupy

        cupy = import_cupy()
        from ._compile import arch_unsupported, cuda_include_dir

        headers = cuda_include_dir()
        if headers and not os.path.isfile(os.path.join(headers, "cuda_bf16.h")):
            headers = f"{headers} (no cuda_bf16.h there: fp16/bf16 kernels will not compile)"
        print(f"CuPy {cupy.__version__}; NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}; "
              f"CUDA headers {headers or 'not found: pip install the cuda12 or cuda13 extra'}")
        print(f"CuPy cache: {os.environ.get('CUPY_CACHE_DIR', '~/.cupy/kernel_cache')}")
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError as error:
            print(f"no CUDA device: {error}")
            n = 0
        for d in range(n):
            props = cupy.cuda.runtime.getDeviceProperties(d)
            arch = f"sm_{props['major']}{props['minor']}"
            print(f"cuda:{d} {props['name'].decode()} {arch} "
                  f"{props['multiProcessorCount']} SMs {props['totalGlobalMem'] / 2**30:.0f} GiB")
            unsupported = arch_unsupported(arch)
            if unsupported:
                print(f"  {unsupported}")
    except ImportError as error:
        print(f"CuPy is not installed ({error}); pip install 'cupyrope[cuda12]' or 'cupyrope[cuda13]'")
    try:
        import torch

        print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, available: {torch.cuda.is_available()})")
    except ImportError:
        print("torch: not installed (optional)")
    return 0


def compile_variants(arch: str, jobs: int):
    from ._compile import compile_all
    from ._variants import all_variants

    variants = all_variants()
    chunks = [variants[i::jobs] for i in range(jobs)]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        results = [r for part in pool.map(lambda c: compile_all(arch, c), chunks) for r in part]
    return results


def _compile(args) -> int:
    from ._compile import KernelCompileError, checked_arch

    try:
        archs = [checked_arch(a) for a in args.arch.split(",")]  # all checked before the first compile
        for arch in archs:
            start = time.perf_counter()
            results = compile_variants(arch, args.jobs)
            if args.verbose:
                for source, name, size in results:
                    print(f"{source}: {name}: {size} bytes")
            print(f"compiled {len(results)} kernel variants for {arch} in {time.perf_counter() - start:.1f} s",
                  flush=True)
    except (KernelCompileError, ValueError) as error:
        print(f"cupyrope compile: {error}", file=sys.stderr)
        return 1
    return 0


def _check(_args) -> int:
    from .selfcheck import run_selfcheck

    return run_selfcheck()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _bench(args) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyrope", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, CUDA devices, cache location").set_defaults(func=_info)
    p = sub.add_parser("compile", help="compile every kernel variant with NVRTC alone (no GPU needed)")
    p.add_argument("--arch", default="sm_90", help="target architecture(s), e.g. sm_90 or sm_80,sm_90,sm_100")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=_compile)
    sub.add_parser("check", help="run every op on the GPU against the float64 references").set_defaults(func=_check)
    p = sub.add_parser("bench", help="compare cupyrope with the installed peers (tables + PNG plot)")
    p.add_argument("--full", action="store_true", help="the full grid of shapes (default: a short one)")
    p.add_argument("--plot", default="cupyrope-bench.png", help="where to write the GB/s plot")
    p.add_argument("--op", choices=("rope", "rmsnorm", "all"), default="all")
    p.add_argument("--rounds", type=_positive_int, default=3,
                   help="calls under 50 us: time the providers this many times, taking turns, and keep medians")
    p.add_argument("--json", help="also save the results (and environment) to this JSON file")
    p.add_argument("--from-json", help="re-render tables and plot from a saved --json file (no GPU needed)")
    p.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
