"""Where the transformers drop-in's bandwidth goes (not the benchmark suite): q+k rotated in one launch
by a vLLM cos/sin cache (positions) or by per-token cos/sin tensors (rope_qk_cos_sin), in the (T, H, D)
layout and in transformers' (B, H, S, D), with the direct kernel and with the block kernel.

Usage on a GPU machine: PYTHONPATH=. python scripts/sweep_layouts.py [--tokens 4096,32768] [--decode]
Each row: GPU µs per call (CUDA-graph replay over input copies that defeat the L2) and GB/s of the
bytes every variant must move (q and k read and written, plus what it reads of cos/sin or the cache
rows). Variants of one shape are checked against each other before they are timed.
"""

import importlib
import sys

import torch

import cupyrope
from cupyrope import _arrays, bench

rope_module = importlib.import_module("cupyrope.rope")  # the module (cupyrope.rope is the function)
TOKENS = [int(v) for v in sys.argv[sys.argv.index("--tokens") + 1].split(",")] if "--tokens" in sys.argv else [
    4096, 32768]
CASES = [("bfloat16", 32, 8, 128), ("float32", 32, 8, 256)]  # dtype, q heads, k heads, head_dim
KERNELS = {  # planner settings (rope.py's module constants) per row
    "direct": dict(DIRECT_MAX_TOKENS=2**31, DIRECT_WITH_CACHE=True),
    "block": dict(DIRECT_MAX_TOKENS=0, DIRECT_WITH_CACHE=False),
}
DEFAULTS = {name: getattr(rope_module, name) for name in ("DIRECT_MAX_TOKENS", "DIRECT_WITH_CACHE")}

def inputs(tokens, hq, hk, d, dtype, layout, copies):
    """Per copy: q, k in the layout, positions, and transformers' cos/sin (both halves, q's dtype)."""
    cache = cupyrope.rope_cache(32768, d, kind="torch")
    made = []
    for _ in range(copies):
        pos = torch.randint(0, 32768, (tokens,), device="cuda")
        rows = cache[pos]
        cos = torch.cat([rows[:, : d // 2]] * 2, -1).to(dtype)
        sin = torch.cat([rows[:, d // 2 :]] * 2, -1).to(dtype)
        if layout == "THD":
            q, k = (torch.randn(tokens, h, d, device="cuda", dtype=dtype) for h in (hq, hk))
            cos, sin = cos[:, None], sin[:, None]  # (T, 1, D)
        else:  # (B, H, S, D), B = 1
            q, k = (torch.randn(1, h, tokens, d, device="cuda", dtype=dtype) for h in (hq, hk))
            cos, sin, pos2 = cos[None, None], sin[None, None], pos[None, None]  # (1, 1, S, D), (1, 1, S)
            pos = pos2
        made.append(dict(q=q, k=k, pos=pos, cos=cos, sin=sin, cache=cache,
                         outs=(torch.empty_like(q), torch.empty_like(k))))
    return made


def variants():
    return {
        "cache": lambda v: cupyrope.rope_qk(v["q"], v["k"], v["pos"], cos_sin_cache=v["cache"], out=v["outs"]),
        "cos/sin": lambda v: cupyrope.rope_qk_cos_sin(v["q"], v["k"], v["cos"], v["sin"], out=v["outs"]),
        "theta": lambda v: cupyrope.rope_qk(v["q"], v["k"], v["pos"], out=v["outs"]),
    }


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bench.copy_bandwidth_gbps(torch):.0f} GB/s")
    print("T | dtype | heads q+k | D | layout | variant | kernel | GPU us | GB/s")
    for tokens in TOKENS:
        for name, hq, hk, d in CASES:
            dtype = getattr(torch, name)
            qk_bytes = 2 * tokens * (hq + hk) * d * dtype.itemsize
            for layout in ("THD", "BHSD"):
                made = inputs(tokens, hq, hk, d, dtype, layout, bench.copies_for(qk_bytes))
                first = {}
                for variant, fn in variants().items():
                    for kernel, settings in KERNELS.items():
                        if variant == "theta" and kernel.startswith("direct"):
                            continue  # per-head cos/sin: the block kernel's job past 64 tokens
                        for setting, value in {**DEFAULTS, **settings}.items():
                            setattr(rope_module, setting, value)
                        rope_module._plans = _arrays.PlanCache()
                        v = made[0]
                        for o in v["outs"]:
                            o.fill_(float("nan"))
                        fn(v)
                        got = tuple(o.float() for o in v["outs"])
                        if not first:
                            first = {"q": got[0], "k": got[1]}
                        tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
                        torch.testing.assert_close(got[0], first["q"], **tol)
                        torch.testing.assert_close(got[1], first["k"], **tol)
                        plan = next(p for p in rope_module._plans._plans.values() if hasattr(p, "name"))
                        us = bench.gpu_time_us(torch, [lambda v=v: fn(v) for v in made])
                        extra = tokens * d * (4 if variant == "cache" else dtype.itemsize if variant == "cos/sin" else 0)
                        ran = plan.name.split("<")[0].removeprefix("cupyrope::")
                        print(f"{tokens} | {name} | {hq}+{hk} | {d} | {layout} | {variant} | {kernel} ({ran}) | "
                              f"{us:.1f} | {(qk_bytes + extra) / us / 1e3:.0f}", flush=True)
                del made


def decode() -> None:
    """Decode-size calls with the planner's own choices (for A/B runs of two checkouts: PYTHONPATH)."""
    rows = []
    for layout in ("THD", "BHSD"):
        made = inputs(1, 32, 8, 128, torch.bfloat16, layout, bench.MAX_COPIES)
        for variant, fn in variants().items():
            rows.append(f"{layout} {variant} {bench.gpu_time_us(torch, [lambda v=v: fn(v) for v in made]):.3f}")
    print(f"decode bf16 q 32 + k 8 heads, GPU us ({cupyrope.__file__}): " + " | ".join(rows), flush=True)


if __name__ == "__main__":
    decode() if "--decode" in sys.argv else main()
