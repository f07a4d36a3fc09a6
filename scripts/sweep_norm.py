"""RMSNorm tuning sweep on a GPU (not the benchmark suite): planner settings x shapes, with peers.

Usage: python scripts/sweep_norm.py [FWD_ELEMS,BWD_ELEMS ...]   (default: 8,8 16,16 32,16)
Each cupyrope setting is checked against torch in fp32 before it is timed; times are medians of
triton.testing.do_bench (L2 flushed between runs), as % of the copy bandwidth measured in the same run.
"""

import sys

import torch
import triton.testing

import cupyrope
from cupyrope import _arrays, rmsnorm

dev = torch.device("cuda")
SHAPES = [(32768, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16), (8192, 16384, torch.bfloat16),
          (8192, 16384, torch.float32), (8192, 1027, torch.float32), (8192, 4096, torch.float32)]
SHAPES += [(8192, h, torch.bfloat16) for h in (61, 130, 256, 512, 1024, 1027, 2048)]


def time_us(fn):
    fn()
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def copy_gbps():
    a = torch.empty(2**30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return 2 * a.numel() / time_us(lambda: b.copy_(a)) / 1e3


def peers(x, w, dy):
    out = {"F.rms_norm": (lambda: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6), None)}
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = torch.nn.functional.rms_norm(xg, (x.shape[-1],), wg, 1e-6)
    out["F.rms_norm"] = (out["F.rms_norm"][0], lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True))
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return out
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    yl = LigerRMSNormFunction.apply(xl, wl, 1e-6, 0.0, "llama", False)  # in_place=False: dy stays intact
    out["liger"] = (lambda: LigerRMSNormFunction.apply(x, w, 1e-6),
                    lambda: torch.autograd.grad(yl, (xl, wl), dy, retain_graph=True))
    return out


def check(x, w, dy, y, dx, dw):
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    ref = torch.nn.functional.rms_norm(xf, (x.shape[-1],), wf, 1e-6)
    gx, gw = torch.autograd.grad(ref, (xf, wf), dy.float())
    for name, got, exp in (("y", y, ref), ("dx", dx, gx), ("dw", dw, gw)):
        err = (got.float() - exp).abs().max().item() / max(exp.abs().max().item(), 1e-30)
        assert err < 2e-2, f"{name} relative error {err:.2e}"


def main():
    settings = [tuple(map(int, s.split(","))) for s in sys.argv[1:]] or [(8, 8), (16, 16), (32, 16)]
    bw = copy_gbps()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s; % of it below")
    header = ["shape", "op"] + [f"cupyrope {f},{b}" for f, b in settings] + ["F.rms_norm", "liger"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for rows, hidden, dt in SHAPES:
        x = torch.randn(rows, hidden, device=dev, dtype=dt)
        w = torch.randn(hidden, device=dev, dtype=dt)
        dy = torch.randn_like(x)
        item = x.element_size()
        results = {"fwd": [], "bwd": []}
        for f, b in settings:
            rmsnorm.FWD_ELEMS_PER_THREAD, rmsnorm.BWD_ELEMS_PER_THREAD = f, b
            rmsnorm._plans = _arrays.PlanCache()
            out = torch.empty_like(x)
            y = cupyrope.rms_norm(x, w, 1e-6, out=out)
            dx, dw = cupyrope.rms_norm_backward(dy, x, w)
            check(x, w, dy, y, dx, dw)
            results["fwd"].append(time_us(lambda: cupyrope.rms_norm(x, w, 1e-6, out=out)))
            results["bwd"].append(time_us(lambda: cupyrope.rms_norm_backward(dy, x, w)))
        for fwd, bwd in peers(x, w, dy).values():
            results["fwd"].append(time_us(fwd))
            results["bwd"].append(time_us(bwd))
        for op, times in results.items():
            nbytes = (2 if op == "fwd" else 3) * rows * hidden * item
            cells = [f"{t:.1f} us {100 * nbytes / t / 1e3 / bw:.0f}%" for t in times]
            print(f"| {rows}x{hidden} {str(dt)[6:]} | {op} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
