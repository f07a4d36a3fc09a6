"""float64 NumPy references for every op (used by the tests; usable by anyone on the CPU).

They follow the same definitions as the kernels: vLLM's cos/sin cache layout (cos half, then sin
half), NeoX pairs (i, i + r/2), GPT-J pairs (2i, 2i + 1), and y = x / sqrt(mean(x^2) + eps) * (w + offset).
They take NumPy arrays (or anything np.asarray takes) of any float dtype, compute in float64, and run the
ops' own argument checks first, so bad input raises what the GPU functions raise.
"""

import numpy as np

from ._runtime.arrays import describe_host
from .ops import layernorm_checks, qk_norm_rope_checks, rmsnorm_checks, rope_checks
from .rope_scaling import frequencies, inv_freq  # noqa: F401 (inv_freq: part of the reference API)

_FLOAT64 = ("float64",)


def _float64(value, name: str):
    """value as a float64 NumPy array and its description for the checks; a TypeError where it is not numbers."""
    array = np.asarray(value)
    if array.dtype.kind not in "fiub" and str(array.dtype) != "bfloat16":
        raise TypeError(f"{name}: expected an array of numbers, got dtype {array.dtype}")
    array = np.ascontiguousarray(array, dtype=np.float64)
    return array, describe_host(array, name, numpy_ok=True)


def _optional_float64(value, name: str):
    return (None, None) if value is None else _float64(value, name)


def _integers(value, name: str):
    array = np.asarray(value)
    return array, describe_host(array, name, numpy_ok=True)

STYLES = ("neox", "gptj")
_ROUNDED = ("float32", "float16", "bfloat16")


def round_to(values, dtype: str) -> np.ndarray:
    """Round float64 values once to a storage dtype ('float32', 'float16', 'bfloat16') and back."""
    values = np.asarray(values, dtype=np.float64)
    if dtype == "bfloat16":
        import ml_dtypes

        return values.astype(ml_dtypes.bfloat16).astype(np.float64)
    return values.astype(dtype).astype(np.float64)


def ulp(values, dtype: str) -> np.ndarray:
    """Spacing of ``dtype`` at |values| (one rounding step of an output)."""
    mantissa = {"float32": 23, "float16": 10, "bfloat16": 7, "float8_e4m3fn": 3}[dtype]
    smallest = {"float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133, "float8_e4m3fn": 2.0**-9}[dtype]
    magnitude = np.abs(values)
    exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    return np.maximum(2.0 ** (exponent - mantissa), smallest)


def tolerance(ref, dtype: str, scale: float = 1.0) -> np.ndarray:
    """How far a kernel's output may be from the float64 reference: fp32 1e-5 relative, fp16/bf16 one
    rounding of the output (one ulp); both plus 1e-6 * scale absolute, for values that come out of
    cancellation (scale: the magnitude of the terms that cancelled)."""
    relative = 1e-5 * np.abs(ref) if dtype == "float32" else ulp(ref, dtype)
    return relative + 1e-6 * scale


def rope_cache(max_position: int, rotary_dim: int, theta: float = 10000.0, scaling=None) -> np.ndarray:
    """[max_position, rotary_dim] float64: cos of every angle, then sin (vLLM's layout). ``scaling``: a
    Hugging Face rope_scaling dict (cupyrope.rope_scaling), whose attention factor multiplies both."""
    freqs, attention_factor = frequencies(rotary_dim, theta, scaling)
    angles = np.arange(max_position, dtype=np.float64)[:, None] * freqs
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1) * attention_factor


def per_token_cos_sin(cos_sin_cache, positions, freq_step=1):
    """(cos, sin), each positions.shape + (rotary_dim,), as transformers hands them to
    apply_rotary_pos_emb, from a vLLM-layout table's rows at ``positions``: freq_step 1, the frequencies
    in order and again (``cat((freqs, freqs))``); freq_step 2, each twice in a row (the interleaved
    layout). What rope_cos_sin takes with the same freq_step."""
    rows = np.asarray(cos_sin_cache, dtype=np.float64)[np.asarray(positions)]
    half = rows.shape[-1] // 2
    if freq_step == 2:
        return rows[..., :half].repeat(2, -1), rows[..., half:].repeat(2, -1)
    return (np.concatenate([rows[..., :half]] * 2, -1), np.concatenate([rows[..., half:]] * 2, -1))


def mrope_rows(rotary_dim: int, mrope_section, interleaved: bool = False) -> np.ndarray:
    """(rotary_dim / 2,) ints: the position row (0 t, 1 h, 2 w) each frequency takes under M-RoPE. Contiguous
    sections in order (Qwen2-VL: transformers' ``cos.split(mrope_section * 2)``), or interleaved (Qwen3-VL:
    h at f % 3 == 1 below 3 h, w at f % 3 == 2 below 3 w, t elsewhere)."""
    t, h, w = (int(n) for n in mrope_section)
    f = np.arange(rotary_dim // 2)
    if interleaved:
        return np.where((f % 3 == 1) & (f < 3 * h), 1, np.where((f % 3 == 2) & (f < 3 * w), 2, 0))
    return np.where(f < t, 0, np.where(f < t + h, 1, 2))


def varlen_positions(cu_seqlens, n_tokens: int, seqlen_offsets=None) -> np.ndarray:
    """(n_tokens,) float64 positions of packed sequences: token t of sequence s (cu_seqlens[s] <= t <
    cu_seqlens[s + 1]) at t - cu_seqlens[s] + seqlen_offsets[s]; NaN for a token in no sequence."""
    starts = np.asarray(cu_seqlens, dtype=np.int64)
    offsets = np.zeros(len(starts) - 1, np.int64) if seqlen_offsets is None else np.asarray(seqlen_offsets, np.int64)
    positions = np.full(n_tokens, np.nan)
    for s in range(len(starts) - 1):
        t = np.arange(max(starts[s], 0), min(starts[s + 1], n_tokens))
        positions[t] = np.where(np.isnan(positions[t]), t - starts[s] + offsets[s], positions[t])
    return positions


def _frequency_positions(positions, source, rotary_dim, leading_ndim, cu_seqlens, seqlen_offsets, n_tokens, section,
                         interleaved):
    """(leading..., rotary_dim / 2) float64: the position each frequency of each token takes (NaN: none)."""
    half = rotary_dim // 2
    if source.mode == "varlen":
        pos = varlen_positions(cu_seqlens, n_tokens, seqlen_offsets)
        pos = pos.reshape((n_tokens,) + (1,) * (leading_ndim - 1))
        return np.broadcast_to(pos[..., None], pos.shape + (half,))
    positions = np.asarray(positions).astype(np.float64)
    if source.mode == "mrope":
        rows = positions[mrope_rows(rotary_dim, section, interleaved)]  # (half, ...)
        rows = np.moveaxis(rows, 0, -1)
        return rows.reshape(rows.shape[:-1] + (1,) * (leading_ndim - rows.ndim + 1) + (half,))
    positions = positions.reshape(positions.shape + (1,) * (leading_ndim - positions.ndim))
    return np.broadcast_to(positions[..., None], positions.shape + (half,))


def _cos_sin(positions, rotary_dim, theta, cos_sin_cache):
    """cos, sin at per-frequency positions (..., rotary_dim / 2), NaN where a position is NaN or outside the
    cache."""
    half = rotary_dim // 2
    if cos_sin_cache is None:
        angles = positions * inv_freq(rotary_dim, theta)
        return np.cos(angles), np.sin(angles)
    cache = np.asarray(cos_sin_cache, dtype=np.float64)
    inside = np.isfinite(positions) & (positions >= 0) & (positions < cache.shape[0])
    rows = np.where(inside, positions, 0).astype(np.int64)
    f = np.arange(half)
    cos, sin = cache[rows, f], cache[rows, half + f]
    return np.where(inside, cos, np.nan), np.where(inside, sin, np.nan)  # out-of-range positions give NaN


def _arrays(positions, cu_seqlens, seqlen_offsets):
    pos, pa = (None, None) if positions is None else _integers(positions, "positions")
    cu, cua = (None, None) if cu_seqlens is None else _integers(cu_seqlens, "cu_seqlens")
    so, soa = (None, None) if seqlen_offsets is None else _integers(seqlen_offsets, "seqlen_offsets")
    return (pos, cu, so), (pa, cua, soa)


def rope(x, positions=None, *, theta=10000.0, style="neox", rotary_dim=None, cos_sin_cache=None, inverse=False,
         cu_seqlens=None, seqlen_offsets=None, mrope_section=None, mrope_interleaved=False):
    """Rotate x (..., head_dim) by positions (aligned from the left with x's leading dimensions; with
    mrope_section, (3, ...): M-RoPE) or by the positions of packed sequences (cu_seqlens, seqlen_offsets):
    cupyrope.rope's definitions."""
    x, xa = _float64(x, "x")
    (positions, cu_seqlens, seqlen_offsets), (pa, cua, soa) = _arrays(positions, cu_seqlens, seqlen_offsets)
    cos_sin_cache, ca = _optional_float64(cos_sin_cache, "cos_sin_cache")
    rotary_dim, _, source = rope_checks.check_rope(
        xa, pa, ca, None, theta=theta, style=style, rotary_dim=rotary_dim, inverse=inverse, impl="auto",
        cu_seqlens=cua, seqlen_offsets=soa, mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
        dtypes=_FLOAT64)
    freq_positions = _frequency_positions(positions, source, rotary_dim, x.ndim - 1, cu_seqlens, seqlen_offsets,
                                          x.shape[0], mrope_section, mrope_interleaved)
    cos, sin = _cos_sin(freq_positions, rotary_dim, theta, cos_sin_cache)
    return _rotate(x, cos, sin, style, rotary_dim, inverse)


def rope_cos_sin(x, cos, sin, *, style="neox", rotary_dim=None, freq_step=1, inverse=False):
    """Rotate x (..., head_dim) by per-token cos and sin (..., columns) whose leading dimensions align
    with x's from the left (size-1 ones broadcast); frequency f at column f * freq_step
    (cupyrope.rope_qk_cos_sin's definition)."""
    x, xa = _float64(x, "x")
    cos, cos_a = _float64(cos, "cos")
    sin, sin_a = _float64(sin, "sin")
    rotary_dim, _ = rope_checks.check_rope_qk_cos_sin(xa, xa, cos_a, sin_a, rotary_dim=rotary_dim, freq_step=freq_step,
                                                      style=style, inverse=inverse, impl="auto", dtypes=_FLOAT64)
    pad = (1,) * (x.ndim - np.ndim(cos))
    cos, sin = (t[..., 0 : freq_step * (rotary_dim // 2) : freq_step] for t in (cos, sin))
    cos, sin = (t.reshape(t.shape[:-1] + pad + t.shape[-1:]) for t in (cos, sin))
    return _rotate(x, cos, sin, style, rotary_dim, inverse)


def _rotate(x, cos, sin, style, rotary_dim, inverse):
    if inverse:
        sin = -sin
    half = rotary_dim // 2
    out = x.copy()
    if style == "neox":
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rotary_dim] = x2 * cos + x1 * sin
    elif style == "gptj":
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = x1 * cos - x2 * sin
        out[..., 1:rotary_dim:2] = x2 * cos + x1 * sin
    else:
        raise ValueError(f"style: expected one of {STYLES}, got {style!r}")
    return out


def qk_norm_rope(q, k, q_weight, k_weight, positions=None, *, eps=1e-6, offset=0.0, **rope_options):
    """(q, k) of cupyrope.qk_norm_rope: each head RMS-normalized over head_dim with its weight, then rotated
    (rope_options: rope()'s)."""
    _check_qk_norm_rope(q, k, q_weight, k_weight, positions, eps, offset, rope_options)
    return tuple(rope(rms_norm(x, w, eps, offset), positions, **rope_options)
                 for x, w in ((q, q_weight), (k, k_weight)))


def qk_norm_rope_backward(dq, dk, q, k, q_weight, k_weight, positions=None, *, eps=1e-6, offset=0.0,
                          **rope_options):
    """(dq_in, dk_in, dq_weight, dk_weight) of cupyrope.qk_norm_rope_backward: the inverse rotation of the output
    gradients, then rms_norm_backward per head."""
    _check_qk_norm_rope(q, k, q_weight, k_weight, positions, eps, offset, rope_options)
    grads = []
    for dy, x, w in ((dq, q, q_weight), (dk, k, k_weight)):
        g = rope(dy, positions, inverse=True, **rope_options)
        grads.append(rms_norm_backward(g, x, w, eps, offset))
    (dq_in, dq_weight), (dk_in, dk_weight) = grads
    return dq_in, dk_in, dq_weight, dk_weight


def _check_qk_norm_rope(q, k, q_weight, k_weight, positions, eps, offset, rope_options):
    """qk_norm_rope's argument checks on host arrays; rope_options: rope()'s keywords (inverse is not one)."""
    options = {"theta": 10000.0, "style": "neox", "rotary_dim": None, **rope_options}
    if "inverse" in options:
        raise TypeError("qk_norm_rope() got an unexpected keyword argument 'inverse'")
    _, (pa, cua, soa) = _arrays(positions, options.pop("cu_seqlens", None), options.pop("seqlen_offsets", None))
    cache = _optional_float64(options.pop("cos_sin_cache", None), "cos_sin_cache")[1]
    arrays = [_float64(a, name)[1] for a, name in ((q, "q"), (k, "k"), (q_weight, "q_weight"), (k_weight, "k_weight"))]
    qk_norm_rope_checks.check_qk_norm_rope(*arrays, pa, cache, eps=eps, offset=offset, impl="auto", cu_seqlens=cua,
                                           seqlen_offsets=soa, dtypes=_FLOAT64, **options)


def rms_norm(x, weight=None, eps=1e-6, offset=0.0, return_rstd=False):
    """y = x / sqrt(mean(x^2) + eps) * (weight + offset); without weight, y = x / rms."""
    x, xa = _float64(x, "x")
    weight, wa = _optional_float64(weight, "weight")
    rmsnorm_checks.check_forward(xa, wa, None, eps=eps, offset=offset, impl="auto", dtypes=_FLOAT64)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1) + eps)
    y = x * rstd[..., None]
    if weight is not None:
        y = y * (weight + offset)
    return (y, rstd) if return_rstd else y


def _column_sums(values) -> np.ndarray:
    """The sum over every row of (..., hidden) values: (hidden,)."""
    return values.reshape(-1, values.shape[-1]).sum(axis=0)


def rms_norm_backward(dy, x, weight=None, eps=1e-6, offset=0.0, residual_grad=None):
    """(dx, dweight) of rms_norm; dweight is None without weight. residual_grad: added to dx (add_rms_norm's
    backward, with x its new residual)."""
    dy, dya = _float64(dy, "dy")
    x, xa = _float64(x, "x")
    weight, wa = _optional_float64(weight, "weight")
    residual_grad, ga = _optional_float64(residual_grad, "residual_grad")
    rmsnorm_checks.check_backward(dya, xa, wa, None, eps=eps, offset=offset, impl="auto", dtypes=_FLOAT64,
                                  residual_grad=ga)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    scale = 1.0 if weight is None else weight + offset
    g = dy * scale
    dx = rstd * g - x * rstd**3 * np.mean(g * x, axis=-1, keepdims=True)
    if residual_grad is not None:
        dx = dx + residual_grad
    if weight is None:
        return dx, None
    return dx, _column_sums(dy * x * rstd)


def fused_add_rms_norm(x, residual, weight, eps=1e-6, offset=0.0, dtype="float32"):
    """vLLM semantics: residual <- x + residual (rounded once to ``dtype``), x <- rms_norm(residual).
    Returns (new x, new residual) in float64."""
    return _residual_add_norm(x, residual, weight, eps, offset, dtype, rmsnorm_checks.check_fused_add)


def add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0, dtype="float32"):
    """The out-of-place residual add + RMSNorm: s = x + residual (rounded once to ``dtype``), y = rms_norm(s).
    Returns (y, s) in float64; its backward is rms_norm_backward(dy, s, weight, residual_grad=ds)."""
    return _residual_add_norm(x, residual, weight, eps, offset, dtype, rmsnorm_checks.check_add)


def _check_rounded(dtype) -> None:
    """dtype: what the fused adds round x + residual to, as the kernels do in x's dtype."""
    if dtype not in _ROUNDED:
        raise TypeError(f"dtype: expected one of {_ROUNDED}, got {dtype!r}")


def _residual_add_norm(x, residual, weight, eps, offset, dtype, check):
    """(rms_norm(s), s) with s = x + residual rounded once to dtype, after the op's own argument checks."""
    x, xa = _float64(x, "x")
    residual, ra = _float64(residual, "residual")
    weight, wa = _optional_float64(weight, "weight")
    check(xa, ra, wa, eps=eps, offset=offset, impl="auto", dtypes=_FLOAT64)
    _check_rounded(dtype)
    s = round_to(x + residual, dtype)
    return rms_norm(s, weight, eps, offset), s


def layer_norm(x, weight=None, bias=None, eps=1e-5, return_stats=False):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dimension, var the biased variance (torch's
    layer_norm). return_stats: (y, mean, rstd)."""
    x, xa = _float64(x, "x")
    weight, wa = _optional_float64(weight, "weight")
    bias, ba = _optional_float64(bias, "bias")
    layernorm_checks.check_forward(xa, wa, ba, None, eps=eps, impl="auto", dtypes=_FLOAT64)
    mean = np.mean(x, axis=-1)
    centered = x - mean[..., None]
    rstd = 1.0 / np.sqrt(np.mean(centered * centered, axis=-1) + eps)
    y = centered * rstd[..., None]
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return (y, mean, rstd) if return_stats else y


def layer_norm_backward(dy, x, weight=None, bias=None, eps=1e-5):
    """(dx, dweight, dbias) of layer_norm; dweight is None without weight, dbias None without bias."""
    dy, dya = _float64(dy, "dy")
    x, xa = _float64(x, "x")
    weight, wa = _optional_float64(weight, "weight")
    bias, ba = _optional_float64(bias, "bias")
    layernorm_checks.check_backward(dya, xa, wa, ba, None, None, eps=eps, impl="auto", dtypes=_FLOAT64)
    _, mean, rstd = layer_norm(x, eps=eps, return_stats=True)
    xhat = (x - mean[..., None]) * rstd[..., None]
    g = dy if weight is None else dy * weight
    dx = rstd[..., None] * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    dweight = None if weight is None else _column_sums(dy * xhat)
    return dx, dweight, (None if bias is None else _column_sums(dy))


def fused_add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, dtype="float32"):
    """residual <- x + residual (rounded once to ``dtype``), x <- layer_norm(residual). Returns (new x, new residual)
    in float64."""
    x, xa = _float64(x, "x")
    residual, ra = _float64(residual, "residual")
    _, wa = _optional_float64(weight, "weight")
    _, ba = _optional_float64(bias, "bias")
    layernorm_checks.check_fused_add(xa, ra, wa, ba, eps=eps, impl="auto", dtypes=_FLOAT64)
    _check_rounded(dtype)
    s = round_to(x + residual, dtype)
    return layer_norm(s, weight, bias, eps), s


E4M3_MAX = 448.0
MIN_FP8_SCALE = 1.0 / (448.0 * 512.0)


def e4m3(values) -> np.ndarray:
    """FP8 e4m3fn bytes (uint8) of float64 values as rms_norm_fp8 writes them: saturated to +-448 (+-Inf included),
    rounded once to nearest even; NaN becomes 0x7F."""
    values = np.asarray(values, dtype=np.float64)
    magnitude = np.minimum(np.abs(np.nan_to_num(values)), E4M3_MAX)
    exponent = np.floor(np.log2(np.maximum(magnitude, 2.0**-6)))  # subnormals: the step of 2^-6's binade
    steps = np.rint(magnitude / 2.0 ** (exponent - 3))  # 3 mantissa bits: exact quotients, ties to even
    exponent += steps >= 16  # rounded up into the next binade
    steps = np.where(steps >= 16, steps / 2, steps)
    normal = magnitude >= 2.0**-6
    codes = np.where(normal, (exponent + 7) * 8 + steps - 8, steps).astype(np.uint8)
    codes = np.where(np.signbit(values), codes | 0x80, codes)
    return np.where(np.isnan(values), np.uint8(0x7F), codes).astype(np.uint8)


def e4m3_values(codes) -> np.ndarray:
    """The float64 values of FP8 e4m3fn bytes (0x7F and 0xFF: NaN)."""
    codes = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    magnitude = np.where(exponent > 0, (8 + mantissa) * 2.0 ** (exponent - 10), mantissa * 2.0**-9)
    values = np.where(codes & 0x80, -magnitude, magnitude)
    return np.where((codes & 0x7F) == 0x7F, np.nan, values)


def rms_norm_fp8(x, weight=None, eps=1e-6, *, scale=None, group_size=None, residual=None, offset=0.0, scale_ub=None,
                 dtype="float32"):
    """rms_norm_fp8's values before their FP8 rounding, and its scales: (v / scale, scales) in float64, where v is
    rms_norm's value (of round_to(x + residual, dtype) with a residual) and scale the static one or, dynamic, max |v|
    over the row (group_size None) or over each group of group_size columns, bounded by scale_ub, / 448, at least
    MIN_FP8_SCALE. scales: the dynamic scales' shape (see rms_norm_fp8), or the static scale. e4m3() of the first
    gives the output's bytes."""
    x, xa = _float64(x, "x")
    weight, wa = _optional_float64(weight, "weight")
    residual, ra = _optional_float64(residual, "residual")
    scale_array, sa = _optional_float64(scale, "scale")
    bound, ua = _optional_float64(scale_ub, "scale_ub")
    rmsnorm_checks.check_fp8(xa, wa, ra, sa, ua, None, group_size=group_size, eps=eps, offset=offset, impl="auto",
                             dtypes=_FLOAT64, scale_dtype="float64")
    _check_rounded(dtype)
    source = round_to(x + residual, dtype) if residual is not None else x
    v = rms_norm(source, weight, eps, offset)
    if scale is not None:
        return v / scale_array.reshape(()), scale_array.reshape(())
    groups = v.reshape(*v.shape[:-1], -1, group_size) if group_size else v[..., None, :]
    amax = np.max(np.abs(np.nan_to_num(groups, nan=0.0)), axis=-1, initial=0.0)
    if bound is not None:
        amax = np.minimum(amax, bound.reshape(()))
    scales = np.maximum(amax / E4M3_MAX, MIN_FP8_SCALE)
    q = (groups / scales[..., None]).reshape(v.shape)
    return q, scales if group_size else scales[..., 0]
