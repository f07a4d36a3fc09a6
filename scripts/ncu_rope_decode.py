"""One decode-size RoPE call per provider, for ncu (not a benchmark): bf16 [1, 32, 128] with random positions,
cupyrope's direct kernel (with the fp32 cos/sin cache the benchmark passes, or in-kernel cos/sin) or
torch.compile of the cache formula (bf16 cos/sin tables, as in the benchmark). Each provider is warmed up,
then called 3 times; profile with e.g.
  ncu --clock-control none -k regex:"rope_direct|triton" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section InstructionStats \
      python3 scripts/ncu_rope_decode.py cache|theta|compile
"""

import sys

import torch

import cupyrope
from cupyrope import bench

which = sys.argv[1]
x = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
pos = torch.randint(0, 32768, (1,), device="cuda")
table = cupyrope.rope_cache(32768, 128, kind="torch")
cos, sin = table[:, :64].to(x.dtype), table[:, 64:].to(x.dtype)
out = torch.empty_like(x)
if which == "compile":
    compiled = torch.compile(lambda x, c, s, p: bench._torch_rope_cache_formula(torch, x, c, s, p))
    call = lambda: compiled(x, cos, sin, pos)  # noqa: E731
else:
    cache = table if which == "cache" else None
    call = lambda: cupyrope.rope(x, pos, out=out, cos_sin_cache=cache, impl="vector" if cache is not None else "auto")  # noqa: E731
for _ in range(6):
    call()
torch.cuda.synchronize()
