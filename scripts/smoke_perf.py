"""Quick GPU timing smoke test (not the benchmark suite): big-shape bandwidth and per-call overhead."""

import os
import sys

import torch
import triton.testing

import importlib

import cupyrope

dev = torch.device("cuda")
# Planner overrides for tuning sweeps: ROPE_ITEMS=2048 FWD_ELEMS=16 BWD_ELEMS=8 ...
for var, module, attr in [("ROPE_ITEMS", "cupyrope.rope", "ITEMS_PER_BLOCK"),
                          ("FWD_ELEMS", "cupyrope.rmsnorm", "FWD_ELEMS_PER_THREAD"),
                          ("BWD_ELEMS", "cupyrope.rmsnorm", "BWD_ELEMS_PER_THREAD")]:
    if var in os.environ:
        setattr(importlib.import_module(module), attr, int(os.environ[var]))
        print(f"{module}.{attr} = {os.environ[var]}")


def copy_bw():
    a = torch.empty(2**30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() / ms / 1e6  # GB/s


def bench(fn, nbytes, label, bw):
    fn()
    ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    gbs = nbytes / ms / 1e6
    print(f"{label:55s} {ms*1e3:9.1f} us {gbs:8.0f} GB/s {100*gbs/bw:5.1f}%")


bw = copy_bw()
print(f"copy bandwidth {bw:.0f} GB/s; options {os.environ.get('CUPYROPE_EXTRA_NVRTC_OPTIONS', '(default)')}")
T, H, D = 32768, 32, 128
x = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
out = torch.empty_like(x)
pos = torch.randint(0, 1 << 20, (T,), device=dev)
cache = cupyrope.rope_cache(1 << 20, D, kind="torch")
n = x.numel() * 2 * 2 + T * 8
ONLY_NORM = "--norm-only" in sys.argv
for impl in () if ONLY_NORM else ("vector", "scalar"):
    bench(lambda: cupyrope.rope(x, pos, out=out, impl=impl), n, f"rope bf16 {T}x{H}x{D} theta {impl}", bw)
    bench(lambda: cupyrope.rope(x, pos, out=out, impl=impl, cos_sin_cache=cache), n + T * D * 4,
          f"rope bf16 {T}x{H}x{D} cache {impl}", bw)
q = torch.randn(T, 32, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(T, 8, D, device=dev, dtype=torch.bfloat16)
if not ONLY_NORM:
    bench(lambda: cupyrope.rope_qk(q, k, pos), (q.numel() + k.numel()) * 4 + T * 8, "rope_qk bf16 32q+8k", bw)
    x16 = torch.randn(65536, 32, 128, device=dev, dtype=torch.float16)
    bench(lambda: cupyrope.rope_(x16, torch.arange(65536, device=dev)), x16.numel() * 4, "rope_ fp16 65536x32x128", bw)
    del x16
if "--rope-only" in sys.argv:
    sys.exit(0)

for (M, N, dt) in [(32768, 4096, torch.bfloat16), (8192, 16384, torch.float32), (8192, 1027, torch.float32),
                   (16384, 8192, torch.bfloat16), (8192, 4096, torch.float32)]:
    xx = torch.randn(M, N, device=dev, dtype=dt)
    w = torch.randn(N, device=dev, dtype=dt)
    yy = torch.empty_like(xx)
    es = xx.element_size()
    bench(lambda: cupyrope.rms_norm(xx, w, out=yy), 2 * M * N * es, f"rms_norm fwd {dt} {M}x{N}", bw)
    dy = torch.randn_like(xx)
    bench(lambda: cupyrope.rms_norm_backward(dy, xx, w), 3 * M * N * es, f"rms_norm bwd {dt} {M}x{N}", bw)
    bench(lambda: torch.nn.functional.rms_norm(xx, (N,), w), 2 * M * N * es, f"  F.rms_norm fwd {dt} {M}x{N}", bw)
# Per-call host overhead at decode size: scripts/overhead.py.
