import dataclasses, sys
import numpy as np, torch
import cupyrope
from cupyrope import bench, reference
from cupyrope.ops import profiles
base = profiles.profile_for(0)
print("profile", profiles.describe_profile(0))
for tokens in (1, 16, 64):
    q = torch.randn(tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    for threads in (64, 128, 256):
        prof = dataclasses.replace(base, rope=dataclasses.replace(base.rope, direct_threads=threads, direct_max_tokens=64))
        with profiles.planning_with(prof):
            qo, ko = cupyrope.rope_qk(q, k, pos, out="new")
            ref = reference.rope(q.float().cpu().double().numpy(), pos.cpu().numpy())
            err = np.abs(qo.float().cpu().numpy() - ref).max()
            g = bench.gpu_time_us(torch, [lambda: cupyrope.rope_qk(q, k, pos)])
            e = bench.eager_time_us(torch, [lambda: cupyrope.rope_qk(q, k, pos)])
        print(f"tokens {tokens} threads {threads}: graph {g:.2f} us eager {e:.2f} us err {err:.3g}", flush=True)
