"""RoPE's argument checks, on Array descriptions: the GPU path, the torch layer's CPU path and the references
run the same ones and raise the same errors."""

from .._runtime import checks
from .._runtime.arrays import FLOAT_DTYPES, INDEX_DTYPES, Array
from .rope_plan import MAX_ROTARY_DIM, PLAIN, STYLES, TOKEN_ROWS, PositionSource

FREQ_STEPS = (1, 2)


def check_options(style, impl, theta, inverse) -> None:
    checks.check_choice(style, "style", STYLES)
    checks.check_impl(impl)
    checks.check_positive(theta, "theta")
    checks.check_bool(inverse, "inverse")


def check_rotary_dim(rotary_dim, head_dim: int) -> int:
    """The rotary dimension: ``rotary_dim``, or head_dim where it is None."""
    if rotary_dim is None:
        if head_dim > MAX_ROTARY_DIM or head_dim % 2:
            raise ValueError(f"rotary_dim: head_dim {head_dim} cannot be rotated whole (needs an even size <= "
                             f"{MAX_ROTARY_DIM}); pass rotary_dim")
        return head_dim
    if not checks.is_int(rotary_dim):
        raise TypeError(f"rotary_dim: expected an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > min(head_dim, MAX_ROTARY_DIM):
        raise ValueError(f"rotary_dim: expected an even number in [2, min(head_dim={head_dim}, {MAX_ROTARY_DIM})], "
                         f"got {rotary_dim}")
    return int(rotary_dim)


def check_positions(pos: Array, like: Array, like_name: str) -> None:
    if pos.dtype not in INDEX_DTYPES:
        raise TypeError(f"positions: expected an integer array (int32 or int64), got {pos.dtype}")
    checks.check_same_device(like, pos, like_name, "positions")
    check_leading("positions", pos.shape, like, like_name)


def check_mrope_section(section, interleaved, rotary_dim: int):
    """M-RoPE's (t, h, w) section sizes, in frequencies: three ints >= 0 adding up to rotary_dim / 2."""
    checks.check_bool(interleaved, "mrope_interleaved")
    if section is None:
        if interleaved:
            raise ValueError("mrope_interleaved: True needs mrope_section (the t, h, w section sizes)")
        return None
    if (not isinstance(section, (list, tuple)) or len(section) != 3
            or not all(checks.is_int(n) and n >= 0 for n in section)):
        raise ValueError(f"mrope_section: expected three ints >= 0 (the t, h and w sections, in frequencies), got "
                         f"{section!r}")
    if sum(section) != rotary_dim // 2:
        raise ValueError(f"mrope_section: expected sections adding up to rotary_dim / 2 = {rotary_dim // 2} "
                         f"frequencies, got {list(section)} (sum {sum(section)})")
    return tuple(int(n) for n in section)


def check_position_source(positions: Array | None, cu_seqlens: Array | None, offsets: Array | None, section,
                          interleaved, like: Array, like_name: str, rotary_dim: int) -> tuple[Array, PositionSource]:
    """The checks of where a call's positions come from: ``positions`` (one a token; with mrope_section, shape
    (3, ...): M-RoPE's t, h and w rows), or ``cu_seqlens`` with optional ``seqlen_offsets`` (varlen). Returns the
    Array that stands for the positions' token dimensions in the layout, and the PositionSource."""
    section = check_mrope_section(section, interleaved, rotary_dim)
    if cu_seqlens is not None:
        return _check_varlen(positions, cu_seqlens, offsets, section, like, like_name)
    if offsets is not None:
        raise ValueError("seqlen_offsets: only with cu_seqlens (each sequence's first position)")
    if positions is None:
        raise TypeError("positions: expected an integer array (int32 or int64), got None; packed sequences pass "
                        "cu_seqlens instead")
    if section is None:
        check_positions(positions, like, like_name)
        return positions, PLAIN
    if positions.dtype not in INDEX_DTYPES:
        raise TypeError(f"positions: expected an integer array (int32 or int64), got {positions.dtype}")
    checks.check_same_device(like, positions, like_name, "positions")
    if len(positions.shape) < 2 or positions.shape[0] != 3:
        raise ValueError(f"positions: with mrope_section, expected shape (3, ...) (the t, h and w position rows, then "
                         f"{like_name}'s leading dimensions), got {positions.shape}")
    rows = Array(None, positions.kind, positions.ptr, positions.dtype, positions.shape[1:], positions.strides[1:],
                 positions.device)
    check_leading("positions", rows.shape, like, like_name)
    return rows, PositionSource("mrope", mrope_stride=positions.strides[0], sections=section,
                                interleaved=bool(interleaved))


def _check_varlen(positions, cu_seqlens: Array, offsets: Array | None, section, like: Array, like_name: str):
    if positions is not None:
        raise ValueError("positions: pass either positions or cu_seqlens (packed sequences), not both")
    if section is not None:
        raise ValueError("mrope_section: M-RoPE takes positions of shape (3, ...), not cu_seqlens")
    checks.check_same_device(like, cu_seqlens, like_name, "cu_seqlens")
    if cu_seqlens.dtype != "int32":
        raise TypeError(f"cu_seqlens: expected int32, got {cu_seqlens.dtype}")
    if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected shape (n_seqs + 1,) with n_seqs >= 1, got {cu_seqlens.shape}")
    if cu_seqlens.strides != (1,):
        raise ValueError(f"cu_seqlens: expected a contiguous array, got strides {cu_seqlens.strides}")
    n_seqs = cu_seqlens.shape[0] - 1
    if offsets is not None:
        checks.check_same_device(like, offsets, like_name, "seqlen_offsets")
        if offsets.dtype not in INDEX_DTYPES:
            raise TypeError(f"seqlen_offsets: expected int32 or int64, got {offsets.dtype}")
        if offsets.shape != (n_seqs,):
            raise ValueError(f"seqlen_offsets: expected shape ({n_seqs},) (one per sequence of cu_seqlens), got "
                             f"{offsets.shape}")
        if n_seqs > 1 and offsets.strides != (1,):
            raise ValueError(f"seqlen_offsets: expected a contiguous array, got strides {offsets.strides}")
    if len(like.shape) < 2:
        raise ValueError(f"{like_name}: with cu_seqlens, expected shape (tokens, ..., head_dim), got {like.shape}")
    tokens = Array(None, cu_seqlens.kind, cu_seqlens.ptr, "int32", like.shape[:1], (1,), cu_seqlens.device)
    return tokens, PositionSource("varlen", n_seqs=n_seqs, offsets_64=offsets is not None and offsets.dtype == "int64")


def check_leading(name: str, shape, like: Array, like_name: str) -> None:
    """``shape`` matches like's leading dimensions aligned from the left; size-1 dimensions broadcast."""
    lead = like.shape[:-1]
    if len(shape) > len(lead):
        raise ValueError(f"{name}: expected at most {len(lead)} dimensions (the leading dimensions of {like_name}, "
                         f"{lead}), got shape {tuple(shape)}")
    if any(p != 1 and p != n for p, n in zip(shape, lead)):
        raise ValueError(f"{name}: shape {tuple(shape)} does not match the leading dimensions of {like_name}, {lead} "
                         "(aligned from the left; size-1 dimensions broadcast)")


def check_table_dtype(table: Array, name: str, like: Array, like_name: str) -> None:
    """cos/sin values come in fp32 or in the rotated tensor's dtype."""
    allowed = sorted({"float32", like.dtype})
    if table.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(allowed)} (like {like_name}), got {table.dtype}")


def check_cache(cache: Array | None, like: Array, like_name: str, rotary_dim: int) -> None:
    if cache is None:
        return
    checks.check_same_device(like, cache, like_name, "cos_sin_cache")
    check_table_dtype(cache, "cos_sin_cache", like, like_name)
    if len(cache.shape) != 2 or cache.shape[0] == 0:
        raise ValueError(f"cos_sin_cache: expected shape (max_position, rotary_dim) with max_position >= 1, got "
                         f"{cache.shape}")
    if cache.shape[1] != rotary_dim:
        relation = "narrower" if cache.shape[1] < rotary_dim else "wider"
        raise ValueError(f"cos_sin_cache: expected {rotary_dim} columns (rotary_dim; cos half then sin half), got "
                         f"{cache.shape[1]} ({relation} than rotary_dim); pass rotary_dim={cache.shape[1]} if that "
                         "is what the cache was built for")
    checks.check_last_dim_contiguous(cache, "cos_sin_cache")


def check_out(out: Array | None, x: Array, x_name: str) -> None:
    if out is None:
        return
    checks.check_same_device(x, out, x_name, "out")
    if out.dtype != x.dtype:
        raise TypeError(f"out: expected dtype {x.dtype} (like {x_name}), got {out.dtype}")
    if out.shape != x.shape:
        raise ValueError(f"out: expected shape {x.shape} (like {x_name}), got {out.shape}")
    checks.check_last_dim_contiguous(out, "out")
    checks.check_not_overlapping(x, out, x_name, "out", same_allowed=True)


def check_rope(x: Array, positions: Array | None, cache: Array | None, out: Array | None, *, theta, style,
               rotary_dim, inverse, impl, cu_seqlens=None, seqlen_offsets=None, mrope_section=None,
               mrope_interleaved=False, dtypes=FLOAT_DTYPES) -> tuple[int, Array, PositionSource]:
    """Every check of a rope() call; returns the rotary dimension and check_position_source's pair."""
    check_options(style, impl, theta, inverse)
    checks.check_float_input(x, "x", "head_dim", dtypes)
    rotary_dim = check_rotary_dim(rotary_dim, x.shape[-1])
    rows, source = check_position_source(positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved, x,
                                         "x", rotary_dim)
    check_cache(cache, x, "x", rotary_dim)
    check_out(out, x, "x")
    return rotary_dim, rows, source


def check_qk(q: Array, k: Array, dtypes=FLOAT_DTYPES) -> None:
    checks.check_float_input(q, "q", "head_dim", dtypes)
    checks.check_float_input(k, "k", "head_dim", dtypes)
    checks.check_same_device(q, k, "q", "k")
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected dtype {q.dtype} (like q), got {k.dtype}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected head_dim {q.shape[-1]} (like q), got {k.shape[-1]}")
    if len(k.shape) != len(q.shape):
        raise ValueError(f"k: expected {len(q.shape)} dimensions (like q {q.shape}), got shape {k.shape}")


def check_qk_outputs(q: Array, k: Array, q_out: Array | None, k_out: Array | None) -> None:
    """In place (no outputs): q and k are both written, so they must not share memory. Out of place: q and k
    are only read; the outputs are written."""
    if q_out is None:
        checks.check_not_overlapping(q, k, "q", "k")
    else:
        check_out(q_out, q, "q")
        check_out(k_out, k, "k")
        checks.check_not_overlapping(q_out, k_out, "out[0]", "out[1]")


def check_rope_qk(q: Array, k: Array, positions: Array | None, cache: Array | None, *, theta, style, rotary_dim,
                  inverse, impl, cu_seqlens=None, seqlen_offsets=None, mrope_section=None, mrope_interleaved=False,
                  dtypes=FLOAT_DTYPES) -> tuple[int, Array, PositionSource]:
    """The checks of a rope_qk() call but its outputs'; returns the rotary dimension and check_position_source's
    pair."""
    check_options(style, impl, theta, inverse)
    check_qk(q, k, dtypes)
    rotary_dim = check_rotary_dim(rotary_dim, q.shape[-1])
    rows, source = check_position_source(positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved, q,
                                         "q", rotary_dim)
    check_cache(cache, q, "q", rotary_dim)
    return rotary_dim, rows, source


def check_rope_cos_sin(x: Array, cos: Array, sin: Array | None, out: Array | None, *, rotary_dim, freq_step, style,
                       inverse, impl, dtypes=FLOAT_DTYPES) -> tuple[int, Array]:
    """Every check of a rope_cos_sin() call; returns what check_rope_qk_cos_sin returns."""
    check_options(style, impl, 10000.0, inverse)
    checks.check_float_input(x, "x", "head_dim", dtypes)
    rotary_dim = check_rotary_dim(rotary_dim, x.shape[-1])
    rows = check_cos_sin(cos, sin, x, "x", rotary_dim, freq_step)
    check_out(out, x, "x")
    return rotary_dim, rows


def check_rope_qk_cos_sin(q: Array, k: Array, cos: Array, sin: Array | None, *, rotary_dim, freq_step, style,
                          inverse, impl, dtypes=FLOAT_DTYPES) -> tuple[int, Array]:
    """The checks of a rope_qk_cos_sin() call but its outputs'. Returns the rotary dimension and the Array
    standing for cos/sin's leading dimensions as positions (dtype TOKEN_ROWS: their strides locate a token's
    row)."""
    check_options(style, impl, 10000.0, inverse)
    check_qk(q, k, dtypes)
    rotary_dim = check_rotary_dim(rotary_dim, q.shape[-1])
    return rotary_dim, check_cos_sin(cos, sin, q, "q", rotary_dim, freq_step)


def check_cos_sin(cos: Array, sin: Array | None, x: Array, x_name: str, rotary_dim: int, freq_step) -> Array:
    """Per-token cos and sin for x (named x_name) and their column step; returns the TOKEN_ROWS Array of their
    leading dimensions."""
    if sin is None:
        raise TypeError("sin: expected a cupy.ndarray or a CUDA torch.Tensor, got NoneType")
    if not checks.is_int(freq_step) or freq_step not in FREQ_STEPS:
        raise ValueError(f"freq_step: expected 1 (frequency f at column f) or 2 (at column 2f), got {freq_step!r}")
    for name, t in (("cos", cos), ("sin", sin)):
        checks.check_same_device(x, t, x_name, name)
        check_table_dtype(t, name, x, x_name)
        if not t.shape:
            raise ValueError(f"{name}: expected shape (..., columns), got a 0-d array")
    if (sin.dtype, sin.shape, sin.strides) != (cos.dtype, cos.shape, cos.strides):
        raise ValueError(f"sin: expected the dtype, shape and strides of cos ({cos.dtype}, {cos.shape}, "
                         f"{cos.strides}), got {sin.dtype}, {sin.shape}, {sin.strides}")
    columns = (rotary_dim // 2 - 1) * freq_step + 1
    if cos.shape[-1] < columns:
        raise ValueError(f"cos: expected at least {columns} columns (rotary_dim {rotary_dim} with freq_step "
                         f"{freq_step}), got shape {cos.shape}")
    rows = Array(None, cos.kind, cos.ptr, TOKEN_ROWS, cos.shape[:-1], cos.strides[:-1], cos.device)
    lead = x.shape[:-1]
    if len(rows.shape) > len(lead) or any(c != 1 and c != n for c, n in zip(rows.shape, lead)):
        raise ValueError(f"cos: leading dimensions {rows.shape} do not match {x_name}'s {lead} (aligned from the "
                         "left; size-1 dimensions broadcast)")
    return rows
