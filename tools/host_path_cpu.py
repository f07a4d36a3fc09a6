"""The Python side of a planned call, with no GPU: where a decode-size call's host time goes.

CPU torch tensors stand in for CUDA ones and the three driver calls (current device, current stream,
cuLaunchKernel) are no-ops (tests/fakes.py), so what is timed is exactly cupyrope's own per-call
code: fingerprints or recall, plan-cache lookup, overlap checks, parameter packing, output allocation. Run it on a machine with no GPU
to try host-path changes; tools/overhead.py measures the real thing on a GPU.
Host speed varies between machines and runs: compare rows of one run. Usage:
PYTHONPATH=. python tools/host_path_cpu.py
"""

import statistics
import sys
import timeit
import types
from pathlib import Path

import torch

import cupyrope
from cupyrope._runtime import launch
from cupyrope._runtime.arrays import fingerprint
from cupyrope.ops import rope

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fakes import stand_in_for_the_gpu  # noqa: E402


def rows():
    q = torch.randn(1, 32, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    pos = torch.zeros(1, dtype=torch.int64)
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    w, y, residual = torch.randn(4096, dtype=torch.bfloat16), torch.empty_like(x), torch.randn_like(x)
    dy, grad, rstd = torch.randn_like(x), torch.randn_like(x), torch.rand(1) + 0.5
    bias, mean = torch.randn_like(w), torch.randn(1)
    cache = torch.randn(4096, 128)
    cos, sin = torch.randn(1, 1, 128, dtype=torch.bfloat16), torch.randn(1, 1, 128, dtype=torch.bfloat16)
    outs = torch.empty_like(q), torch.empty_like(k)
    cupyrope.rope_qk(q, k, pos)  # remembered with its guard (cupyrope/_runtime/plan_cache.py)
    guard = rope._rope_qk_plans.recent._recent[0][2]
    launcher = launch.Launch(types.SimpleNamespace(ptr=0), 1, (32, 1), 1, b"", 0, "torch")
    key = (fingerprint(q, "q")[0], fingerprint(k, "k")[0], fingerprint(pos, "positions")[0])
    return {
        "rope_qk, in place": lambda: cupyrope.rope_qk(q, k, pos),
        "rope_qk, in place, cache": lambda: cupyrope.rope_qk(q, k, pos, cos_sin_cache=cache),
        "rope_qk, out=(q_out, k_out)": lambda: cupyrope.rope_qk(q, k, pos, out=outs),
        "rope_qk, out='new'": lambda: cupyrope.rope_qk(q, k, pos, out="new"),
        "rope_qk_cos_sin, in place": lambda: cupyrope.rope_qk_cos_sin(q, k, cos, sin),
        "rope_qk_cos_sin, out=(q_out, k_out)": lambda: cupyrope.rope_qk_cos_sin(q, k, cos, sin, out=outs),
        "rope_qk_cos_sin, out='new'": lambda: cupyrope.rope_qk_cos_sin(q, k, cos, sin, out="new"),
        "rope, out=x": lambda: cupyrope.rope(q, pos, out=q),
        "rope, new output": lambda: cupyrope.rope(q, pos),
        "rms_norm, out=": lambda: cupyrope.rms_norm(x, w, out=y),
        "rms_norm, new output": lambda: cupyrope.rms_norm(x, w),
        "fused_add_rms_norm": lambda: cupyrope.fused_add_rms_norm(x, residual, w),
        "add_rms_norm (y, s, rstd)": lambda: cupyrope.add_rms_norm(x, residual, w, return_rstd=True),
        "rms_norm_backward (dx, dweight, rstd given)": lambda: cupyrope.rms_norm_backward(dy, x, w, rstd),
        "rms_norm_backward, residual_grad": lambda: cupyrope.rms_norm_backward(dy, x, w, rstd, residual_grad=grad),
        "layer_norm, new output": lambda: cupyrope.layer_norm(x, w, bias),
        "layer_norm_backward (dx, dweight, dbias, stats given)":
            lambda: cupyrope.layer_norm_backward(dy, x, w, bias, mean, rstd),
        "  piece: launcher, 1 pointer (driver calls no-ops)": lambda: launcher(x.data_ptr()),
        "  piece: fingerprint of a tensor": lambda: fingerprint(q, "q"),
        "  piece: guard check of q, k, positions": lambda: guard.check(q, k, pos),
        "  piece: hash of a rope_qk key": lambda: hash(key),
        "  piece: torch.empty_like": lambda: torch.empty_like(q),
    }


def main() -> int:
    stand_in_for_the_gpu()
    calls = rows()
    for fn in calls.values():
        fn()  # plans them
    samples = {name: [] for name in calls}
    for _ in range(5):  # interleaved rounds
        for name, fn in calls.items():
            samples[name].append(timeit.timeit(fn, number=20000) / 20000 * 1e6)
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}; host µs per call, median of 5 rounds")
    for name, values in samples.items():
        print(f"{name:52s} {statistics.median(values):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
