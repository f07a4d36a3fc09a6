"""One launch of each RMSNorm case named on the command line, for ncu (scripts/gpu notes)."""
import importlib
import sys

import torch

import cupyrope

rms = importlib.import_module("cupyrope.rmsnorm")
for case in sys.argv[1:]:
    op, dtype, rows, hidden, chunks = case.split(":")
    rms.FWD_CHUNKS_PER_THREAD = rms.BWD_CHUNKS_PER_THREAD = int(chunks)
    dt = getattr(torch, dtype)
    x = torch.randn(int(rows), int(hidden), device="cuda", dtype=dt)
    w = torch.randn(int(hidden), device="cuda", dtype=dt)
    if op == "fwd":
        cupyrope.rms_norm(x, w)
    else:
        cupyrope.rms_norm_backward(torch.randn_like(x), x, w)
torch.cuda.synchronize()
