"""Where the eager host time of the transformers drop-in goes, at decode size on a GPU: the whole call
and its pieces, µs per call (median of 7 interleaved rounds of 2000 calls; the GPU work is tiny, so
host time shows).
Usage on a GPU machine: PYTHONPATH=. python scripts/dropin_host_time.py"""

import statistics
import timeit

import torch

import cupyrope
import cupyrope.torch as ct
from cupyrope import dropin


def per_call(rows: dict, calls=2000, rounds=7) -> dict:
    """Median µs per call of each row over interleaved rounds (host speed drifts during a run)."""
    for fn in rows.values():
        fn()
    samples = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            torch.cuda.synchronize()
            samples[name].append(timeit.timeit(fn, number=calls) / calls * 1e6)
    torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in samples.items()}


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
        "  piece: torch layer's checks": lambda: (ct._compiling(), torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad), q.is_cuda, ct._contiguous_last(q), ct._contiguous_last(k)),
    }
    for name, us in per_call(rows).items():
        print(f"{name:42s} {us:7.2f} us")


if __name__ == "__main__":
    main()
