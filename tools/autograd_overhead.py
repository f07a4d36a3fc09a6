"""Eager host time of a training step's RMSNorm through autograd (forward, then dx and dweight by
torch.autograd.grad) at decode size, against torch's F.rms_norm and against the floor of a Python
autograd.Function that launches nothing, plus the time spent inside cupyrope's Function (forward and
backward bodies) to separate our own work from autograd's. Each row: median of interleaved rounds of
bench.eager_time_us. --compile adds both norms under torch.compile (default mode: AOTAutograd's compiled
forward and backward, our kernels called as registered custom ops).
Usage: python tools/autograd_overhead.py [--compile] [ROWS HIDDEN]
"""

import statistics
import sys
import time

import torch

import cupyrope
import cupyrope.torch as ct
from cupyrope import bench

ROUNDS = 5


class NullNorm(torch.autograd.Function):
    """What any Python autograd.Function costs: one output and two gradients allocated, no kernel."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


class Inside:
    """Wraps a staticmethod of cupyrope's Function to add up the time spent in its body."""

    def __init__(self, cls, name):
        self.cls, self.name, self.fn = cls, name, getattr(cls, name)
        self.total, self.calls = 0.0, 0

    def __enter__(self):
        fn = self.fn

        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.total += time.perf_counter() - start
                self.calls += 1

        setattr(self.cls, self.name, staticmethod(timed))
        return self

    def __exit__(self, *exc):
        setattr(self.cls, self.name, staticmethod(self.fn))

    def us(self):
        return self.total / max(self.calls, 1) * 1e6


def main():
    sizes = [int(a) for a in sys.argv[1:] if a != "--compile"]
    rows, hidden = sizes if sizes else (1, 4096)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    _, rstd = cupyrope.rms_norm(x, w, return_rstd=True)

    def step(norm):
        return lambda: torch.autograd.grad(norm(xg, wg), (xg, wg), dy)

    rows_ = {
        "cupyrope.rms_norm (no autograd, new output)": lambda: cupyrope.rms_norm(x, w),
        "cupyrope.rms_norm(return_rstd=True) + rms_norm_backward (no autograd)":
            lambda: cupyrope.rms_norm_backward(dy, x, w, cupyrope.rms_norm(x, w, return_rstd=True)[1]),
        "NullNorm (Python autograd.Function, no kernel)": step(NullNorm.apply),
        "cupyrope.torch.rms_norm forward only (grad enabled)": lambda: ct.rms_norm(xg, wg),
        "cupyrope.torch.rms_norm forward + backward": step(ct.rms_norm),
        "F.rms_norm forward + backward": step(lambda a, b: torch.nn.functional.rms_norm(a, (hidden,), b, 1e-6)),
    }
    if "--compile" in sys.argv:
        torch_norm = torch.compile(lambda a, b: torch.nn.functional.rms_norm(a, (hidden,), b, 1e-6))
        rows_["cupyrope.torch.rms_norm forward + backward, torch.compile"] = step(torch.compile(ct.rms_norm))
        rows_["F.rms_norm forward + backward, torch.compile"] = step(torch_norm)
    times = {name: [] for name in rows_}
    for fn in rows_.values():
        fn()
    torch.cuda.synchronize()
    function = ct._RMSNormFunction
    with Inside(function, "forward") as fwd, Inside(function, "backward") as bwd:
        for _ in range(ROUNDS):
            for name, fn in rows_.items():
                times[name].append(bench.eager_time_us(torch, [fn]))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; [{rows}, {hidden}] bf16; eager µs per call, "
          f"median of {ROUNDS} interleaved rounds (range)")
    print("| call | eager µs |\n|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) |")
    print(f"inside cupyrope's Function: forward {fwd.us():.1f} µs, backward {bwd.us():.1f} µs a call "
          f"(their Python bodies, kernels' launches included; wrapped, so ~0.3 µs more than unwrapped)")


if __name__ == "__main__":
    main()
