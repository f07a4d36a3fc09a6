"""Where the per-call time of small (decode-size) calls goes: host profile and GPU time per kernel."""

import cProfile
import pstats

import cupy
import torch

import cupyrope
from cupyrope import bench

dev = "cuda"
q = torch.randn(1, 32, 128, device=dev, dtype=torch.bfloat16)
k = torch.randn(1, 8, 128, device=dev, dtype=torch.bfloat16)
pos = torch.zeros(1, dtype=torch.int64, device=dev)
x1 = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
w1 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
cache = cupyrope.rope_cache(4096, 128, kind="torch")
calls = {
    "rope_qk theta": lambda: cupyrope.rope_qk(q, k, pos),
    "rope_qk cache": lambda: cupyrope.rope_qk(q, k, pos, cos_sin_cache=cache),
    "rms_norm": lambda: cupyrope.rms_norm(x1, w1),
}


def gpu_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * n)


def host_us(fn):
    return bench.eager_time_us(torch, [fn])  # host loop time per call, synchronized at the end


raw = cupy.RawKernel(r'extern "C" __global__ void noop(float* x, long long n) {}', "noop")
cx = cupy.zeros(4, dtype=cupy.float32)
print(f"bare CuPy launch: host {host_us(lambda: raw((1,), (32,), (cx, 1))):.2f} us")
for name, fn in calls.items():
    print(f"{name:15s} host {host_us(fn):6.2f} us/call   GPU {gpu_us(fn):6.2f} us/call (graph replay)")
profile = cProfile.Profile()
profile.enable()
for _ in range(3000):
    calls["rope_qk theta"]()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(14)

# Pieces of the launch path, and the torch layer (issue 4: eager must not pay the dispatcher).
import ctypes  # noqa: E402
import timeit  # noqa: E402

import cupyrope.torch as ct  # noqa: E402
from cupyrope import _arrays, _launch  # noqa: E402


def per_call(stmt, n=20000):
    return timeit.timeit(stmt, number=n) / n * 1e6


buf = ctypes.create_string_buffer(1024)
tail = bytes(256)
print(f"  describe(q)        {per_call(lambda: _arrays.describe(q, 'q')):.2f} us")
print(f"  signature          {per_call(lambda: _arrays.signature(_arrays.describe(q, 'q'))):.2f} us (with describe)")
print(f"  pack 6 pointers    {per_call(lambda: _launch._POINTER_PACKERS[6].pack_into(buf, 0, 1, 2, 3, 4, 5, 6)):.2f} us")
print(f"  memmove 256 B      {per_call(lambda: ctypes.memmove(ctypes.addressof(buf) + 48, tail, 256)):.2f} us")
print(f"  getDevice          {per_call(lambda: cupy.cuda.runtime.getDevice()):.2f} us")
print(f"  current stream     {per_call(lambda: torch._C._cuda_getCurrentRawStream(0)):.2f} us")
x = torch.randn(1, 32, 128, device=dev, dtype=torch.bfloat16)
with torch.no_grad():
    print(f"cupyrope.rope            host {host_us(lambda: cupyrope.rope(x, pos)):6.2f} us")
    print(f"cupyrope.torch.rope      host {host_us(lambda: ct.rope(x, pos)):6.2f} us")
    print(f"torch.ops.cupyrope.rope  host {host_us(lambda: torch.ops.cupyrope.rope(x, pos, None, 1e4, 'neox', None, False)):6.2f} us")
    print(f"cupyrope.torch.rms_norm  host {host_us(lambda: ct.rms_norm(x1, w1)):6.2f} us")
    print(f"torch.ops.cupyrope.rms_norm host {host_us(lambda: torch.ops.cupyrope.rms_norm(x1, w1, 1e-6, 0.0)):6.2f} us")
