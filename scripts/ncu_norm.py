"""One launch of each RMSNorm case named on the command line, for ncu (docs/perf-notes.md).

A case is op:dtype:rows:hidden[:SETTINGS], op fwd, bwd or liger (Liger's forward, the peer),
SETTINGS as in scripts/sweep_norm.py ("old" or NAME=VALUE,... of rmsnorm planner constants); the
weight has x's dtype, as in the benchmark suite. Example:
  ncu --clock-control none -k regex:rms_norm --section WarpStateStats \\
      python3 scripts/ncu_norm.py bwd:bfloat16:16384:8192:STAGED_LOOKAHEAD_BYTES=65536
"""
import sys

import torch

import cupyrope

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sweep_norm import apply  # noqa: E402

for case in sys.argv[1:]:
    op, dtype, rows, hidden, *settings = case.split(":")
    apply(settings[0] if settings else "")
    x = torch.randn(int(rows), int(hidden), device="cuda", dtype=getattr(torch, dtype))
    w = torch.randn(int(hidden), device="cuda", dtype=x.dtype)
    if op == "liger":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        LigerRMSNormFunction.apply(x, w, 1e-6)
    elif op == "fwd":
        cupyrope.rms_norm(x, w)
    else:
        cupyrope.rms_norm_backward(torch.randn_like(x), x, w)
torch.cuda.synchronize()
