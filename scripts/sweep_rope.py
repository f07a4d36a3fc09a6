"""RoPE small-call sweep on a GPU (not the benchmark suite): the block kernel against the direct
kernel (rope.DIRECT_MAX_TOKENS) over token counts, with torch.compile of the cos/sin-cache formula.

Usage: python scripts/sweep_rope.py [--tokens 1,2,4,...] [--threads 32,64,128] [--f32]
The last columns are floors: an empty CuPy kernel launched in the same kind of graph, and empty kernels
taking an 8-byte and a RopeParams-sized struct through cupyrope's launcher (does the size of the
parameter block cost launch time?).
Each cupyrope setting is checked against the float64 reference before it is timed. GPU time per call:
the benchmark suite's CUDA-graph replay over enough input copies to defeat the L2.
"""

import importlib
import sys
import warnings

import cupy
import numpy as np
import torch

import cupyrope
from cupyrope import _arrays, _launch, bench, reference

rope = importlib.import_module("cupyrope.rope")  # the module (cupyrope.rope is the function)

dev = torch.device("cuda")


def arg(name, default):
    return [int(v) for v in sys.argv[sys.argv.index(name) + 1].split(",")] if name in sys.argv else default


TOKENS = arg("--tokens", [1, 2, 4, 8, 16, 32, 64, 128, 256])
THREADS = arg("--threads", [64])
DTYPE = torch.float32 if "--f32" in sys.argv else torch.bfloat16
HEADS, D = 40, 128  # Llama-3-8B decode: 32 q heads + 8 k heads
CACHE = cupyrope.rope_cache(32768, D, kind="torch")
COS, SIN = CACHE[:, : D // 2].to(DTYPE), CACHE[:, D // 2 :].to(DTYPE)
compiled = torch.compile(lambda x, c, s, p: bench._torch_rope_cache_formula(torch, x, c, s, p))


def inputs(tokens, copies):
    made = []
    for _ in range(copies):
        x = torch.randn(tokens, HEADS, D, device=dev, dtype=DTYPE)
        made.append({"x": x, "out": torch.empty_like(x), "pos": torch.randint(0, 32768, (tokens,), device=dev)})
    return made


def cases(impl):
    """name -> call(d), returning what it wrote: q alone (32 heads) or q and k in one launch."""
    def q_only(cache):
        return lambda d: cupyrope.rope(d["x"][:, :32], d["pos"], out=d["out"][:, :32], cos_sin_cache=cache, impl=impl)

    def qk(cache):
        def run(d):
            x, out = d["x"], d["out"]
            cupyrope.rope_qk(x[:, :32], x[:, 32:], d["pos"], out=(out[:, :32], out[:, 32:]), cos_sin_cache=cache,
                             impl=impl)
            return out
        return run

    return {"q theta": q_only(None), "q cache": q_only(CACHE), "qk theta": qk(None), "qk cache": qk(CACHE)}


def check(name, d, result):
    heads = 32 if name.startswith("q ") else HEADS
    expected = reference.rope(bench._host(torch, d["x"][:, :heads]), d["pos"].cpu().numpy())
    got = bench._host(torch, result[:, :heads])
    tol = 1e-5 if DTYPE == torch.float32 else 2**-7
    err = np.abs(got - expected).max() / max(1.0, np.abs(expected).max())
    assert err <= tol, f"{name}: error {err:.3g}"


def time_us(fn, made):
    return bench.gpu_time_us(torch, [lambda d=d: fn(d) for d in made])


warnings.filterwarnings("ignore", "ExternalStream is deprecated", DeprecationWarning)
EMPTY = cupy.RawKernel('extern "C" __global__ void empty_kernel() {}', "empty_kernel")


def launch_empty(d):
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        EMPTY((1,), (32,), ())


def empty_launcher(n_bytes):
    """An empty kernel with an n_bytes struct parameter, launched like a RoPE plan (torch's stream)."""
    raw = cupy.RawKernel(f'struct P {{ unsigned long long v[{n_bytes // 8}]; }};\n'
                         f'extern "C" __global__ void empty_{n_bytes}(P p) {{}}', f"empty_{n_bytes}")
    launch = _launch.Launch(type("Kernel", (), {"ptr": raw.kernel.ptr})(), 1, (32, 1), 0, bytes(n_bytes), 0, "torch")
    return lambda d: launch()


PARAM_BYTES = 6 * 8 + rope._TAIL.size
EMPTY_SMALL, EMPTY_ROPE_SIZED = empty_launcher(8), empty_launcher(PARAM_BYTES)


print(f"{torch.cuda.get_device_name()}, {DTYPE}, [T, {HEADS} heads, {D}]; GPU us per call (graph replay)")
settings = [("block", 0, 256)] + [(f"direct {t}", 10**9, t) for t in THREADS]
IMPLS = ("auto", "vector", "scalar")
header = (["T", "case"] + [f"{s} {impl}" for s, _, _ in settings for impl in IMPLS]
          + ["compile", "empty kernel", "empty, 8 B param", f"empty, {PARAM_BYTES} B param"])
print(" | ".join(header))
for tokens in TOKENS:
    nbytes = 2 * tokens * HEADS * D * DTYPE.itemsize
    made = inputs(tokens, bench.copies_for(nbytes))
    compile_us = time_us(lambda d: compiled(d["x"][:, :32], COS, SIN, d["pos"]), made)
    empty_us = [time_us(fn, made) for fn in (launch_empty, EMPTY_SMALL, EMPTY_ROPE_SIZED)]
    for name in cases("auto"):
        row = [str(tokens), name]
        for label, max_tokens, threads in settings:
            rope.DIRECT_MAX_TOKENS, rope.DIRECT_THREADS = max_tokens, threads
            rope.DIRECT_WITH_CACHE = max_tokens > 0
            for impl in IMPLS:
                fn = cases(impl)[name]
                rope._plans = _arrays.PlanCache()
                d = made[0]
                d["out"].fill_(float("nan"))
                check(name, d, fn(d))
                row.append(f"{time_us(fn, made):.2f}")
        row += [f"{us:.2f}" for us in (compile_us, *empty_us)] if name == "q cache" else [""] * 4
        print(" | ".join(row), flush=True)
