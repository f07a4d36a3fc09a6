"""Where the per-call time of small (decode-size) calls goes: host profile and GPU time per kernel."""

import cProfile
import pstats
import time

import cupy
import torch

import cupyrope

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


def host_us(fn, n=3000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


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
