"""Per-call host overhead at decode size, against a bare CuPy RawKernel launch in the same run.

Eager time per call: a Python loop of calls, synchronized at the end (bench.eager_time_us). Each
row is measured three times, interleaved with the others, and the median is printed, with recall
(cupyrope/_runtime/plan_cache.py) off and on in alternate passes; host speed differs between machines, so
compare rows of one run only. A training step through autograd: tools/autograd_overhead.py.
Usage: python tools/overhead.py
"""

import statistics
import sys
import timeit

import cupy
import numpy
import torch

import cupyrope
import cupyrope.torch as ct
from cupyrope import bench
from cupyrope._runtime import launch as _launch
from cupyrope._runtime import plan_cache
from cupyrope._runtime.arrays import fingerprint
from cupyrope.ops import rmsnorm, rope

try:  # optional peer
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
except ImportError:
    LigerRMSNormFunction = None


def torch_inputs():
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    x1 = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    return q, k, pos, x1, w1


def calls():
    q, k, pos, x1, w1 = torch_inputs()
    y1, r1, dy1 = torch.empty_like(x1), torch.randn_like(x1), torch.randn_like(x1)
    _, rstd1 = cupyrope.rms_norm(x1, w1, return_rstd=True)
    cache = cupyrope.rope_cache(4096, 128, kind="torch")
    cq, ck, cpos, cx1, cw1 = (cupy.asarray(t) for t in (q.float(), k.float(), pos, x1.float(), w1.float()))
    cy1 = cupy.empty_like(cx1)
    raw = cupy.RawKernel(r'extern "C" __global__ void noop(float* x) {}', "noop")
    # What a hand-written RoPE kernel takes: q, k, positions and sizes (a fair floor for rope_qk).
    raw_qk = cupy.RawKernel(r'''extern "C" __global__ void noop_qk(float* q, float* k, long long* pos, long long tokens,
        long long q_stride, long long k_stride, int q_heads, int k_heads, float theta) {}''', "noop_qk")
    sizes = (numpy.int64(1), numpy.int64(4096), numpy.int64(1024), numpy.int32(32), numpy.int32(8), numpy.float32(1e4))
    noop = raw.kernel  # the same empty kernel through cupyrope's launcher: the floor of our path
    launcher = _launch.Launch(type("K", (), {"ptr": noop.ptr})(), 1, (32, 1), 1, b"", 0, "torch")
    rows = {
        "bare CuPy RawKernel launch (1 array)": lambda: raw((1,), (32,), (cx1,)),
        "bare CuPy RawKernel launch (3 arrays + 6 scalars)": lambda: raw_qk((1,), (32,), (cq, ck, cpos, *sizes)),
        "cupyrope launcher alone (same kernel)": lambda: launcher(cx1.data.ptr),
        "rope_qk, torch, in place": lambda: cupyrope.rope_qk(q, k, pos),
        "rope_qk, torch, in place, cache": lambda: cupyrope.rope_qk(q, k, pos, cos_sin_cache=cache),
        "rope_qk, CuPy fp32, in place": lambda: cupyrope.rope_qk(cq, ck, cpos),
        "rope_qk, torch, out=\"new\" (two new outputs)": lambda: cupyrope.rope_qk(q, k, pos, out="new"),
        "rope, torch, out=x": lambda: cupyrope.rope(q, pos, out=q),
        "rope, torch, new output": lambda: cupyrope.rope(q, pos),
        "rope, CuPy fp32, new output": lambda: cupyrope.rope(cq, cpos),
        "rms_norm, torch, out=": lambda: cupyrope.rms_norm(x1, w1, out=y1),
        "rms_norm, torch, new output": lambda: cupyrope.rms_norm(x1, w1),
        "rms_norm, CuPy fp32, out=": lambda: cupyrope.rms_norm(cx1, cw1, out=cy1),
        "fused_add_rms_norm, torch": lambda: cupyrope.fused_add_rms_norm(x1, r1, w1),
        "rms_norm_backward, torch (dx, dweight)": lambda: cupyrope.rms_norm_backward(dy1, x1, w1),
        "rms_norm_backward, torch, rstd given": lambda: cupyrope.rms_norm_backward(dy1, x1, w1, rstd1),
        "cupyrope.torch.rope (no grad)": lambda: ct.rope(q, pos),
        "cupyrope.torch.rope_qk (no grad)": lambda: ct.rope_qk(q, k, pos),
        "cupyrope.torch.rms_norm (no grad)": lambda: ct.rms_norm(x1, w1),
        "torch.ops.cupyrope.rope (dispatcher)": lambda: torch.ops.cupyrope.rope(q, pos, None, 1e4, "neox", None, False),
    }
    if LigerRMSNormFunction is not None:
        rows["Liger RMSNorm forward (peer)"] = lambda: LigerRMSNormFunction.apply(x1, w1, 1e-6)
    rows["torch F.rms_norm (peer)"] = lambda: torch.nn.functional.rms_norm(x1, (4096,), w1, 1e-6)
    return rows


def pieces():
    """Costs of the steps of a call (µs), to see where the time over a bare launch goes."""
    q, k, pos, _, _ = torch_inputs()
    key = (fingerprint(q, "q")[0], fingerprint(k, "k")[0], fingerprint(pos, "positions")[0])
    f32, dev = torch.float32, q.device
    template = torch.empty((1, 1), dtype=f32, device=dev).expand(264, 4096)
    steps = {
        "fingerprint(torch tensor)": lambda: fingerprint(q, "q"),
        "hash of a rope_qk key": lambda: hash(key),
        "torch current raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "torch.empty_like (1x4096 bf16)": lambda: torch.empty_like(q),
        "torch.empty(shape, dtype=, device=) (264x4096 fp32)": lambda: torch.empty((264, 4096), dtype=f32, device=dev),
        "x.new_empty(shape, dtype=) (264x4096 fp32)": lambda: q.new_empty((264, 4096), dtype=f32),
        "torch.empty_like(a one-element tensor expanded) (264x4096 fp32)": lambda: torch.empty_like(
            template, memory_format=torch.contiguous_format),
    }
    for name, fn in steps.items():
        n = 20000
        print(f"  {name}: {timeit.timeit(fn, number=n) / n * 1e6:.2f} µs")


OP_PLANS = ((rope, "_rope_plans"), (rope, "_rope_qk_plans"), (rope, "_rope_cos_sin_plans"),
            (rmsnorm, "_forward_plans"), (rmsnorm, "_fused_add_plans"), (rmsnorm, "_backward_plans"))


def set_recall(on: bool) -> None:
    """Recall (plan_cache.py) on or off in this process: both are timed in one run, round by round."""
    plan_cache._guard_class = None if on else False
    for module, name in OP_PLANS:
        getattr(module, name).recent = plan_cache.RecentCalls()


def main() -> int:
    rows = calls()
    modes = ("recall off", "recall on")
    eager = {(mode, name): [] for mode in modes for name in rows}
    host = {}
    with torch.no_grad():
        for fn in rows.values():  # compile, plan, warm the allocator
            fn()
        torch.cuda.synchronize()
        for mode in modes:
            set_recall(mode == "recall on")
            host.update({(mode, name): bench.host_only_us(fn, torch.cuda.synchronize) for name, fn in rows.items()})
        for _ in range(3):
            for mode in modes:
                set_recall(mode == "recall on")
                for name, fn in rows.items():
                    eager[mode, name].append(bench.eager_time_us(torch, [fn]))
    floor = statistics.median(eager["recall on", "bare CuPy RawKernel launch (1 array)"])
    print(f"{torch.cuda.get_device_name()}, Python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"CuPy {cupy.__version__}; µs per call, eager: medians of 3 interleaved rounds")
    print("| call (decode size) | eager, recall off | eager, recall on | on vs bare CuPy launch (1 array) "
          "| host only, off | host only, on |")
    print("|---|---|---|---|---|---|")
    for name in rows:
        off, on = (statistics.median(eager[mode, name]) for mode in modes)
        print(f"| {name} | {off:.2f} | {on:.2f} | {on - floor:+.2f} | {host['recall off', name]:.2f} "
              f"| {host['recall on', name]:.2f} |")
    pieces()
    return 0


if __name__ == "__main__":
    sys.exit(main())
