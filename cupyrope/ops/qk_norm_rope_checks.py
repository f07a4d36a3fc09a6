"""QK-norm + RoPE's argument checks, on Array descriptions: the GPU path, the torch layer's CPU path and the
references run the same ones and raise the same errors."""

from .._runtime import checks
from .._runtime.arrays import FLOAT_DTYPES, Array
from . import rmsnorm_checks, rope_checks
from .rope_plan import PositionSource


def check_weights(q_weight: Array, k_weight: Array, q: Array) -> None:
    """One weight a head feature for q and for k: (head_dim,), float32 or q's dtype, both the same dtype."""
    allowed = sorted({"float32", q.dtype})
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight is None:
            raise TypeError(f"{name}: expected an array of shape ({q.shape[-1]},), got None")
        checks.check_same_device(q, weight, "q", name)
        if weight.dtype not in allowed:
            raise TypeError(f"{name}: expected dtype {' or '.join(allowed)} (like q), got {weight.dtype}")
        if weight.shape != (q.shape[-1],):
            raise ValueError(f"{name}: expected shape ({q.shape[-1]},) (head_dim), got {weight.shape}")
        checks.check_last_dim_contiguous(weight, name)
    if k_weight.dtype != q_weight.dtype:
        raise TypeError(f"k_weight: expected dtype {q_weight.dtype} (like q_weight), got {k_weight.dtype}")


def check_qk_norm_rope(q: Array, k: Array, q_weight: Array, k_weight: Array, positions: Array | None,
                       cache: Array | None, *, eps, offset, theta, style, rotary_dim, impl, cu_seqlens=None,
                       seqlen_offsets=None, mrope_section=None, mrope_interleaved=False,
                       dtypes=FLOAT_DTYPES) -> tuple[int, Array, PositionSource]:
    """The checks of a qk_norm_rope() call but its outputs'; returns rope_checks.check_rope_qk's triple."""
    rmsnorm_checks.check_options(eps, offset, impl)
    result = rope_checks.check_rope_qk(q, k, positions, cache, theta=theta, style=style, rotary_dim=rotary_dim,
                                       inverse=False, impl=impl, cu_seqlens=cu_seqlens, seqlen_offsets=seqlen_offsets,
                                       mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, dtypes=dtypes)
    check_weights(q_weight, k_weight, q)
    return result


def check_gradients(dq: Array, dk: Array, q: Array, k: Array) -> None:
    """The output gradients of a qk_norm_rope_backward() call: like q and k."""
    checks.check_like(dq, q, "q", "dq")
    checks.check_like(dk, k, "k", "dk")
