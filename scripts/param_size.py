"""Does the size of a kernel's parameter block cost GPU time at decode size? (needs a CUDA GPU)

Kernels that take one struct of N bytes (two pointers, then padding) and copy 512 floats on 4 blocks of
128 threads (a decode call's launch shape), timed as the benchmark suite times calls (CUDA-graph
replay, per call), beside cupyrope's decode RoPE (RopeParams: 336 bytes) and torch.compile's kernel.
Then what reading the block costs: kernels that add K 8-byte fields, GAP bytes apart, into the same copy
(GAP 64: one constant-cache line each).
Usage: python scripts/param_size.py
"""

import cupy
import torch

import cupyrope
from cupyrope import _launch, bench

SIZES = (24, 64, 128, 192, 256, 336, 512, 1024)
SOURCE = r"""
template <int N> struct P { const float* in; float* out; char pad[N - 16]; };
template <int N> __global__ void copy(const P<N> p) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    p.out[i] = p.in[i] * 2.f;
}
struct Fields { const float* in; float* out; long long f[126]; };
template <int K, int GAP> __global__ void touch(const Fields p) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    long long sum = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) sum += p.f[k * (GAP / 8)];
    p.out[i] = p.in[i] * 2.f + (float)sum;
}
"""
FIELDS = ((1, 8), (2, 64), (4, 64), (8, 64), (4, 256), (16, 8))  # (K, GAP)


class _Kernel:  # what _launch.Launch needs of a kernel
    def __init__(self, function):
        self.ptr = function.kernel.ptr


def main():
    names = [f"copy<{n}>" for n in SIZES]
    touches = [f"touch<{k}, {gap}>" for k, gap in FIELDS]
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=names + touches)
    x = torch.randn(512, device="cuda")
    y = torch.empty_like(x)
    print(f"{torch.cuda.get_device_name()}: GPU us per call (graph replay), 4 x 128 threads")
    for _ in range(2):  # twice: the spread between rounds
        cells = []
        for n, name in zip(SIZES, names):
            launch = _launch.Launch(_Kernel(module.get_function(name)), 4, (128, 1), 2, bytes(n - 16), 0, "torch")
            fn = lambda launch=launch: launch(x.data_ptr(), y.data_ptr())  # noqa: E731
            cells.append(f"{n} B {bench.gpu_time_us(torch, [fn]):.3f}")
        print(" | ".join(cells), flush=True)
    for _ in range(2):
        cells = []
        for (k, gap), name in zip(FIELDS, touches):
            launch = _launch.Launch(_Kernel(module.get_function(name)), 4, (128, 1), 2, bytes(1008), 0, "torch")
            fn = lambda launch=launch: launch(x.data_ptr(), y.data_ptr())  # noqa: E731
            cells.append(f"{k} fields {gap} B apart {bench.gpu_time_us(torch, [fn]):.3f}")
        print(" | ".join(cells), flush=True)
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (1,), device="cuda")
    cache = cupyrope.rope_cache(4096, 128, dtype="bfloat16", kind="torch")
    out = torch.empty_like(q)
    rows = {"cupyrope in-kernel": lambda: cupyrope.rope(q, pos, out=out),
            "cupyrope bf16 cache": lambda: cupyrope.rope(q, pos, out=out, cos_sin_cache=cache)}
    cos, sin = (t.to(torch.bfloat16).contiguous() for t in torch.randn(2, 4096, 64, device="cuda"))
    compiled = torch.compile(lambda: bench._torch_rope_cache_formula(torch, q, cos, sin, pos))
    rows["torch.compile (cos/sin cache)"] = compiled
    for name, fn in [*rows.items()] * 2:
        print(f"decode bf16 [1, 32, 128] {name}: {bench.gpu_time_us(torch, [fn]):.3f} us")


if __name__ == "__main__":
    main()
