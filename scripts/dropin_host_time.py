"""Where the eager host time of the transformers drop-in goes, at decode size on a GPU: the whole call
and its pieces, µs per call (median of 5 runs of 2000 calls; the GPU work is tiny, so host time shows).
Usage on a GPU machine: PYTHONPATH=. python scripts/dropin_host_time.py"""

import statistics
import timeit

import torch

import cupyrope
import cupyrope.torch as ct
from cupyrope import dropin


def per_call(fn, calls=2000) -> float:
    fn()
    torch.cuda.synchronize()
    runs = [timeit.timeit(fn, number=calls) / calls * 1e6 for _ in range(5)]
    torch.cuda.synchronize()
    return statistics.median(runs)


def main() -> None:
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    cos, sin = (torch.randn(1, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cos4, sin4 = cos.view(1, 1, 1, 128), sin.view(1, 1, 1, 128)
    outs = (torch.empty_like(q), torch.empty_like(k))
    pos = torch.zeros(1, 1, 1, dtype=torch.int64, device="cuda")
    rows = {
        "dropin.apply_rotary_pos_emb": lambda: dropin.apply_rotary_pos_emb(q, k, cos, sin),
        "cupyrope.torch.rope_qk_cos_sin": lambda: ct.rope_qk_cos_sin(q, k, cos4, sin4, rotary_dim=128),
        "cupyrope.rope_qk_cos_sin, out=": lambda: cupyrope.rope_qk_cos_sin(q, k, cos4, sin4, out=outs),
        "cupyrope.rope_qk_cos_sin, out='new'": lambda: cupyrope.rope_qk_cos_sin(q, k, cos4, sin4, out="new"),
        "cupyrope.torch.rope_qk (no grad)": lambda: ct.rope_qk(q, k, pos),
        "cupyrope.rope_qk_cos_sin, in place": lambda: cupyrope.rope_qk_cos_sin(q, k, cos4, sin4),
        "cupyrope.rope_qk, in place": lambda: cupyrope.rope_qk(q, k, pos),
        "  piece: torch.empty x2": lambda: (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                                            torch.empty(k.shape, dtype=k.dtype, device=k.device)),
        "  piece: argument checks": lambda: dropin._check_arguments(q, k, cos, sin, "halves"),
        "  piece: cos/sin views": lambda: tuple(t.unsqueeze(dropin._per_token_shape(q.shape, k.shape, t.shape, 1)[1])
                                                for t in (cos, sin)),
        "  piece: torch.compiler.is_compiling": torch.compiler.is_compiling,
    }
    for name, fn in rows.items():
        print(f"{name:42s} {per_call(fn):7.2f} us")


if __name__ == "__main__":
    main()
