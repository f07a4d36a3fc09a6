"""RoPE: argument checks -> plan (variant, grid, block, parameters) -> launch.

The plan is a pure function of shapes, dtypes, strides and pointer alignment (unit-tested without a
GPU); launching is the only step that touches the GPU.
"""

import math
import struct

import numpy as np

from . import _arrays, _launch
from ._arrays import FLOAT_DTYPES, INDEX_DTYPES, describe
from ._compile import get_kernel
from ._device import sm_count
from ._layout import canonical_layout

SOURCE = "rope.cu"
STYLES = {"neox": 0, "gptj": 1}
IMPLS = ("auto", "scalar", "vector")
CTYPE = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int", "int64": "long long"}
MAX_THREADS = 256
THREADS_PER_SM = 2048  # one full wave of resident threads per SM is enough to saturate bandwidth

# Mirrors RopeParams in kernels_src/rope.cu.
_PARAMS = struct.Struct("<6Q3q16q3q2q3q3qdq")


class RopePlan:
    __slots__ = ("name", "grid", "block", "values", "vectorized", "head_groups", "lanes")

    def __init__(self, name, grid, block, values, vectorized, head_groups, lanes):
        self.name = name
        self.grid = grid
        self.block = block
        self.values = values  # RopeParams, in order
        self.vectorized = vectorized
        self.head_groups = head_groups
        self.lanes = lanes  # (rotating lanes, copying lanes) per unit

    def __repr__(self):
        return f"RopePlan({self.name}, grid={self.grid}, block={self.block})"


def kernel_name(dtype, cache_dtype, pos_dtype, style, vectorized, use_cache) -> str:
    cache_ctype = CTYPE[cache_dtype] if use_cache else "float"
    return (
        f"cupyrope::rope_kernel<{CTYPE[dtype]}, {cache_ctype}, {CTYPE[pos_dtype]}, {STYLES[style]}, "
        f"{'true' if vectorized else 'false'}, {'true' if use_cache else 'false'}>"
    )


def all_variants():
    """Every (source, kernel) the launcher can ask for: the compile-only path builds them all."""
    for dtype in FLOAT_DTYPES:
        caches = [None] + sorted({"float32", dtype})
        for cache in caches:
            for pos in INDEX_DTYPES:
                for style in STYLES:
                    for vectorized in (False, True):
                        name = kernel_name(dtype, cache or "float32", pos, style, vectorized, cache is not None)
                        yield SOURCE, name


def _vector_blockers(tensors, dtype, style, rotary_dim, head_dim, copies, cache) -> list[str]:
    """Why the 16-byte kernel cannot run (empty when it can)."""
    elems = 16 // _arrays.ITEMSIZE[dtype]
    reasons = []
    need = 2 * elems if style == "neox" else elems
    if rotary_dim % need:
        reasons.append(f"rotary_dim {rotary_dim} is not a multiple of {need}")
    if copies and (head_dim - rotary_dim) % elems:
        reasons.append(f"head_dim - rotary_dim = {head_dim - rotary_dim} is not a multiple of {elems}")
    for name, array, token_strides, head_stride in tensors:
        if array.ptr % 16:
            reasons.append(f"{name} is not 16-byte aligned")
        if any(s % elems for s in token_strides) or head_stride % elems:
            reasons.append(f"{name} has strides that are not multiples of {elems} elements")
    if cache is not None:
        cache_elems = 16 // cache.itemsize
        if cache.ptr % 16 or cache.strides[0] % cache_elems:
            reasons.append("cos_sin_cache rows are not 16-byte aligned")
    return reasons


def plan_rope(groups, positions, cache, *, style, rotary_dim, theta, inverse, impl, n_sm) -> RopePlan:
    """groups: [(input, output), ...] Arrays: q's pair, then k's (optional). All checked already."""
    dtype = groups[0][0].dtype
    head_dim = groups[0][0].shape[-1]
    layout = canonical_layout(
        [(inp.shape[:-1], [inp.strides[:-1], out.strides[:-1]]) for inp, out in groups],
        positions.shape,
        positions.strides,
    )
    in_place = all(inp.ptr == out.ptr and inp.strides == out.strides for inp, out in groups)
    copies = not in_place and rotary_dim < head_dim
    named = []
    for g, (inp, out) in enumerate(groups):
        for i, (role, array) in enumerate((("input", inp), ("output", out))):
            t = 2 * g + i
            named.append((f"{'qk'[g]} {role}", array, layout.token_strides[t], layout.head_strides[t]))
    blockers = _vector_blockers(named, dtype, style, rotary_dim, head_dim, copies, cache)
    if impl == "vector" and blockers:
        raise ValueError("impl: 'vector' is not possible here: " + "; ".join(blockers))
    vectorized = impl != "scalar" and not blockers

    elems = 16 // _arrays.ITEMSIZE[dtype] if vectorized else (2 if style == "gptj" else 1)
    rot_lanes = rotary_dim // 2 // elems if style == "neox" else rotary_dim // elems
    copy_elems = elems if vectorized else 1
    copy_lanes = (head_dim - rotary_dim) // copy_elems if copies else 0
    lanes = rot_lanes + copy_lanes
    block_x = min(lanes, MAX_THREADS)
    units_per_block = max(1, MAX_THREADS // block_x)

    n_q_heads = layout.heads[0]
    n_heads = sum(layout.heads)
    n_tokens = layout.n_tokens
    wanted_threads = n_sm * THREADS_PER_SM
    head_groups = max(1, min(n_heads, math.ceil(wanted_threads / max(1, n_tokens * lanes))))
    n_units = n_tokens * head_groups
    grid = math.ceil(n_units / units_per_block)

    (q_in, q_out), (k_in, k_out) = groups[0], groups[-1]  # without k, k's slots repeat q's (0 k heads)
    strides = []
    for t in range(4):
        src = t if t < 2 * len(groups) else t - 2
        strides.extend(layout.token_strides[src])
        strides.append(layout.head_strides[src])
    use_cache = cache is not None
    values = (
        q_in.ptr, q_out.ptr, k_in.ptr, k_out.ptr,
        positions.ptr, cache.ptr if use_cache else 0,
        n_units, layout.token_sizes[1], layout.token_sizes[2],
        *strides,
        *layout.pos_strides,
        cache.strides[0] if use_cache else 0, cache.shape[0] if use_cache else 0,
        n_q_heads, n_heads, head_groups,
        rotary_dim, rot_lanes, copy_lanes,
        float(theta), int(bool(inverse)),
    )  # fmt: skip
    name = kernel_name(dtype, cache.dtype if use_cache else "float32", positions.dtype, style, vectorized, use_cache)
    return RopePlan(name, grid, (block_x, units_per_block), values, vectorized, head_groups, (rot_lanes, copy_lanes))


# ---------------------------------------------------------------------------------------------- checks


def _check_options(style, impl, theta, inverse):
    if style not in STYLES:
        raise ValueError(f"style: expected one of {tuple(STYLES)}, got {style!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"theta: expected a finite number > 0, got {theta!r}")
    if not isinstance(inverse, (bool, np.bool_)):
        raise TypeError(f"inverse: expected a bool, got {type(inverse).__name__}")


def _check_heads(array, name):
    _arrays.check_dtype(array, name, FLOAT_DTYPES)
    if len(array.shape) < 1:
        raise ValueError(f"{name}: expected shape (..., head_dim), got a 0-d array")
    _arrays.check_last_dim_contiguous(array, name)


def _check_rotary_dim(rotary_dim, head_dim):
    if rotary_dim is None:
        return head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)):
        raise TypeError(f"rotary_dim: expected an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim: expected an even number in [2, head_dim={head_dim}], got {rotary_dim}")
    return int(rotary_dim)


def _check_positions(positions, like, like_name):
    pos = describe(positions, "positions")
    if pos.dtype not in INDEX_DTYPES:
        raise TypeError(f"positions: expected an integer array (int32 or int64), got {pos.dtype}")
    _arrays.check_same_device(like, pos, like_name, "positions")
    lead = tuple(like.shape[:-1])
    if len(pos.shape) > len(lead):
        raise ValueError(
            f"positions: expected at most {len(lead)} dimensions (the leading dimensions of {like_name}, {lead}), "
            f"got shape {tuple(pos.shape)}"
        )
    if any(p != 1 and p != n for p, n in zip(pos.shape, lead)):
        raise ValueError(
            f"positions: shape {tuple(pos.shape)} does not match the leading dimensions of {like_name}, {lead} "
            "(aligned from the left; size-1 dimensions broadcast)"
        )
    return pos


def _check_cache(cos_sin_cache, like, like_name, rotary_dim):
    if cos_sin_cache is None:
        return None
    cache = describe(cos_sin_cache, "cos_sin_cache")
    _arrays.check_same_device(like, cache, like_name, "cos_sin_cache")
    allowed = ("float32", like.dtype)
    if cache.dtype not in allowed:
        raise TypeError(f"cos_sin_cache: expected dtype float32 or {like.dtype} (like {like_name}), got {cache.dtype}")
    if len(cache.shape) != 2:
        raise ValueError(f"cos_sin_cache: expected shape (max_position, rotary_dim), got {cache.shape}")
    if cache.shape[1] != rotary_dim:
        relation = "narrower" if cache.shape[1] < rotary_dim else "wider"
        raise ValueError(
            f"cos_sin_cache: expected {rotary_dim} columns (rotary_dim; cos half then sin half), got "
            f"{cache.shape[1]} ({relation} than rotary_dim); pass rotary_dim={cache.shape[1]} if that is "
            "what the cache was built for"
        )
    _arrays.check_last_dim_contiguous(cache, "cos_sin_cache")
    return cache


def _extent(array):
    low = sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s > 0)
    return array.ptr + low * array.itemsize, array.ptr + (high + 1) * array.itemsize


def check_not_overlapping(a, b, name_a, name_b, same_allowed=False):
    """Distinct arrays must not share memory (a kernel would read what another thread wrote);
    ``same_allowed``: b may be exactly a (in place)."""
    if same_allowed and a.ptr == b.ptr and a.strides == b.strides and a.shape == b.shape:
        return
    a_lo, a_hi = _extent(a)
    b_lo, b_hi = _extent(b)
    if a.size and b.size and a_lo < b_hi and b_lo < a_hi:
        hint = f"pass {name_b}={name_a} (in place) or separate memory" if same_allowed else "pass separate memory"
        raise ValueError(f"{name_b}: overlaps {name_a} in memory; {hint}")


def _check_out(out, x, x_name):
    if out is None:
        return None
    o = describe(out, "out")
    _arrays.check_same_device(x, o, x_name, "out")
    if o.dtype != x.dtype:
        raise TypeError(f"out: expected dtype {x.dtype} (like {x_name}), got {o.dtype}")
    if tuple(o.shape) != tuple(x.shape):
        raise ValueError(f"out: expected shape {tuple(x.shape)} (like {x_name}), got {tuple(o.shape)}")
    _arrays.check_last_dim_contiguous(o, "out")
    check_not_overlapping(x, o, x_name, "out", same_allowed=True)
    return o


# ------------------------------------------------------------------------------------------ public API


def rope(x, positions, *, theta=10000.0, style="neox", rotary_dim=None, cos_sin_cache=None, inverse=False,
         out=None, impl="auto"):
    """Rotary position embedding of ``x`` (..., head_dim) at ``positions``.

    positions: int32/int64, shape matching x's leading dimensions aligned from the left (size-1
    dimensions broadcast), e.g. x (T, H, D) with positions (T,), or x (B, H, S, D) with (B, 1, S).
    style: "neox" (pairs i, i + r/2) or "gptj" (pairs 2i, 2i + 1). rotary_dim: even, <= head_dim; the
    features past it are copied (out of place) or left alone (in place). cos/sin are computed in the
    kernel from theta (exact to fp32 rounding) unless ``cos_sin_cache`` (max_position, rotary_dim) is
    given (cos half, then sin half; fp32 or x's dtype); rotated features of positions outside
    [0, max_position) become NaN. inverse=True rotates by -angle (the backward of RoPE).
    out=x rotates in place. Returns ``out`` (a new array of x's kind when out is None).
    """
    _check_options(style, impl, theta, inverse)
    xa = describe(x, "x")
    _check_heads(xa, "x")
    rotary_dim = _check_rotary_dim(rotary_dim, xa.shape[-1])
    pos = _check_positions(positions, xa, "x")
    cache = _check_cache(cos_sin_cache, xa, "x", rotary_dim)
    oa = _check_out(out, xa, "x")
    if oa is None:
        out = _arrays.empty(xa, xa.shape, xa.dtype)
        oa = describe(out, "out")
    plan = plan_rope([(xa, oa)], pos, cache, style=style, rotary_dim=rotary_dim, theta=theta,
                     inverse=inverse, impl=impl, n_sm=sm_count(xa.device) if xa.size else 1)
    if xa.size:
        _run(plan, xa)
    return out


def rope_(x, positions, **options):
    """In-place spelling of ``rope(x, positions, out=x, ...)``."""
    return rope(x, positions, out=x, **options)


def rope_qk(q, k, positions, *, theta=10000.0, style="neox", rotary_dim=None, cos_sin_cache=None,
            inverse=False, impl="auto"):
    """Rotate q (..., Hq, head_dim) and k (..., Hk, head_dim) in place, in one launch; cos/sin are
    computed once per token and shared by all heads. q and k may be strided views (e.g. column slices
    of a fused qkv tensor) as long as their last dimension is contiguous. Returns (q, k)."""
    _check_options(style, impl, theta, inverse)
    qa = describe(q, "q")
    ka = describe(k, "k")
    _check_heads(qa, "q")
    _check_heads(ka, "k")
    _arrays.check_same_device(qa, ka, "q", "k")
    if ka.dtype != qa.dtype:
        raise TypeError(f"k: expected dtype {qa.dtype} (like q), got {ka.dtype}")
    if ka.shape[-1] != qa.shape[-1]:
        raise ValueError(f"k: expected head_dim {qa.shape[-1]} (like q), got {ka.shape[-1]}")
    if len(ka.shape) != len(qa.shape):
        raise ValueError(f"k: expected {len(qa.shape)} dimensions (like q {qa.shape}), got shape {ka.shape}")
    check_not_overlapping(qa, ka, "q", "k")
    rotary_dim = _check_rotary_dim(rotary_dim, qa.shape[-1])
    pos = _check_positions(positions, qa, "q")
    cache = _check_cache(cos_sin_cache, qa, "q", rotary_dim)
    plan = plan_rope([(qa, qa), (ka, ka)], pos, cache, style=style, rotary_dim=rotary_dim, theta=theta,
                     inverse=inverse, impl=impl, n_sm=sm_count(qa.device) if qa.size else 1)
    if qa.size or ka.size:
        _run(plan, qa)
    return q, k


def _run(plan: RopePlan, like) -> None:
    kernel = get_kernel(SOURCE, plan.name, like.device)
    _launch.launch(kernel, plan.grid, plan.block, _PARAMS, plan.values, _arrays.current_stream(like), like.device)


def rope_cache(max_position, rotary_dim, theta=10000.0, *, dtype="float32", kind="cupy", device=0):
    """The (max_position, rotary_dim) cos/sin table in vLLM's layout, computed in float64 and rounded
    once to ``dtype``; returned as a CuPy array (kind="cupy") or a torch tensor (kind="torch") on
    ``device``. A setup-time helper: it builds the table on the host and copies it over."""
    from . import reference

    if isinstance(max_position, bool) or not isinstance(max_position, (int, np.integer)) or max_position < 1:
        raise ValueError(f"max_position: expected an int >= 1, got {max_position!r}")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even int >= 2, got {rotary_dim!r}")
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"theta: expected a finite number > 0, got {theta!r}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype!r}")
    if kind not in ("cupy", "torch"):
        raise ValueError(f"kind: expected 'cupy' or 'torch', got {kind!r}")
    table = reference.rope_cache(int(max_position), int(rotary_dim), theta)
    if kind == "torch":
        import torch

        return torch.from_numpy(table).to(device=f"cuda:{device}", dtype=getattr(torch, dtype))
    host = table.astype(_arrays._cupy_dtype(dtype))
    return _arrays.from_host(host, "cupy", device)
