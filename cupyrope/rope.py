"""RoPE: argument checks -> plan (variant, grid, block, parameters) -> launch.

The plan is a pure function of shapes, dtypes, strides and pointer alignment (unit-tested without a
GPU); launching is the only step that touches the GPU.
"""

import math
import struct

import numpy as np

from . import _arrays, _launch
from ._arrays import (CTYPE, FLOAT_DTYPES, INDEX_DTYPES, EmptyPlan, check_not_overlapping, describe, describe_optional,
                      fingerprint, fingerprint_optional)
from ._compile import get_kernel
from ._device import sm_count
from ._layout import canonical_layout

SOURCE = "rope.cu"
STYLES = {"neox": 0, "gptj": 1}
BLOCK_THREADS = 256  # kernels_src/rope.cu: BLOCK_THREADS
ITEMS_PER_BLOCK = 640  # two tokens of Llama q (or q+k) per block measured best (docs/perf-notes.md)
MAX_BLOCK_TOKENS = 64
COS_SIN_FLOATS = 8192  # shared-memory cos/sin table per block: 32 KiB
MAX_ROTARY_DIM = 1024
BLOCKS_PER_SM = 2  # below this many blocks per SM, fewer tokens per block
# rope_direct_kernel (one item a thread, no shared memory) takes calls of at most this many tokens,
# and every vectorized call with a cos/sin cache; the block kernel, which shares the cos/sin a
# block's tokens need across their heads, takes the rest (scripts/sweep_rope.py, docs/perf-notes.md).
DIRECT_MAX_TOKENS = 64
DIRECT_WITH_CACHE = True
DIRECT_THREADS = 64  # threads per block of the direct kernel: small blocks spread a call over the SMs

# Mirrors RopeParams in kernels_src/rope.cu: six pointers, then this tail.
_TAIL = struct.Struct("<3q3q4q16q2q3q3qdq")


class RopePlan:
    __slots__ = ("name", "grid", "block", "shared_mem", "tail", "vectorized", "tokens_per_block", "lanes", "extents",
                 "slot_names", "disjoint", "launch", "out_layouts", "new_output")

    def __init__(self, name, grid, block, shared_mem, tail, vectorized, tokens_per_block, lanes):
        self.name = name
        self.grid = grid
        self.block = (block, 1)
        self.shared_mem = shared_mem
        self.tail = tail  # RopeParams after the six pointers, packed
        self.vectorized = vectorized
        self.tokens_per_block = tokens_per_block
        self.lanes = lanes  # (rotating lanes, copying lanes) per head

    def __repr__(self):
        return f"RopePlan({self.name}, grid={self.grid}, tokens_per_block={self.tokens_per_block})"


TOKEN_ROWS = "token rows"  # the "position dtype" of calls with per-token cos and sin tensors
_POSITION_CTYPE = {**CTYPE, TOKEN_ROWS: "cupyrope::TokenRows"}


def kernel_name(dtype, cache_dtype, pos_dtype, style, vectorized, use_cache, direct=False) -> str:
    cache_ctype = CTYPE[cache_dtype] if use_cache else "float"
    return (
        f"cupyrope::{'rope_direct_kernel' if direct else 'rope_kernel'}<{CTYPE[dtype]}, {cache_ctype}, "
        f"{_POSITION_CTYPE[pos_dtype]}, {STYLES[style]}, {'true' if vectorized else 'false'}, "
        f"{'true' if use_cache else 'false'}>"
    )


def all_variants():
    """Every (source, kernel) the launcher can ask for: the compile-only path builds them all."""
    for dtype in FLOAT_DTYPES:
        tables = sorted({"float32", dtype})
        sources = [(None, pos) for pos in INDEX_DTYPES] + [(table, pos) for table in tables for pos in INDEX_DTYPES]
        sources += [(table, TOKEN_ROWS) for table in tables]  # rope_qk_cos_sin
        for table, pos in sources:
            for style in STYLES:
                for vectorized in (False, True):
                    for direct in (False, True):
                        yield SOURCE, kernel_name(dtype, table or "float32", pos, style, vectorized,
                                                  table is not None, direct)


def fast_divisor(d: int) -> int:
    """(magic | shift << 32) such that n // d == (mulhi32(n, magic) + n) >> shift for every
    0 <= n < 2^31 (kernels_src/rope.cu: fast_div; the round-up method of Granlund and Montgomery)."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divisor {d} out of range")
    shift = (d - 1).bit_length()  # ceil(log2(d))
    magic = (2**32 * (2**shift - d)) // d + 1
    return magic | shift << 32


def _vector_blockers(tensors, dtype, style, rotary_dim, head_dim, copies) -> list[str]:
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
    return reasons


def _cache_in_packs(cache, freqs) -> bool:
    """Whether the direct kernel's 16-byte items, of `freqs` frequencies, can read their cos/sin from this
    cache as packs (kernels_src/rope.cu: cache_cos_sin): its pointer and row stride aligned to a pack.
    rotary_dim's own alignment follows from the items'."""
    pack_bytes = min(16, freqs * _arrays.ITEMSIZE[cache.dtype])
    return cache.ptr % pack_bytes == 0 and cache.strides[0] * _arrays.ITEMSIZE[cache.dtype] % pack_bytes == 0


def plan_rope(groups, positions, cache, *, style, rotary_dim, theta, inverse, impl, n_sm, freq_stride=0) -> RopePlan:
    """groups: [(input, output), ...] Arrays: q's pair, then k's (optional). All checked already.
    positions of dtype TOKEN_ROWS: the leading dimensions of per-token cos/sin tensors (their strides
    locate a token's row), cache then stands for cos (its dtype) and freq_stride is the element
    stride between frequencies in cos and sin."""
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
    blockers = _vector_blockers(named, dtype, style, rotary_dim, head_dim, copies)
    if impl == "vector" and blockers:
        raise ValueError("impl: 'vector' is not possible here: " + "; ".join(blockers))
    n_tokens, n_q_heads, n_heads = layout.n_tokens, layout.heads[0], sum(layout.heads)
    can_vectorize = impl != "scalar" and not blockers
    direct = n_tokens <= DIRECT_MAX_TOKENS or (DIRECT_WITH_CACHE and cache is not None and can_vectorize)
    direct = direct and n_tokens * n_heads * head_dim < 2**31  # item indices in fast_div's range
    # Direct calls with in-kernel cos/sin: one pair a thread measured 0.1-0.4 us faster than 16-byte items
    # (whose 8 cos/sin are computed by 8 threads and gathered by shuffles), so auto takes it.
    vectorized = can_vectorize and not (direct and cache is None and impl == "auto")
    elems = 16 // _arrays.ITEMSIZE[dtype] if vectorized else (2 if style == "gptj" else 1)
    freqs = elems if style == "neox" else elems // 2  # frequencies an item rotates (the kernels' F)
    if direct and vectorized and cache is not None and positions.dtype != TOKEN_ROWS:
        direct = _cache_in_packs(cache, freqs)  # else the block kernel, which reads any cache
    rot_lanes = rotary_dim // 2 // elems if style == "neox" else rotary_dim // elems
    copy_lanes = (head_dim - rotary_dim) // (elems if vectorized else 1) if copies else 0
    if n_tokens >= 2**31 or n_tokens * n_heads * max(rot_lanes, copy_lanes, 1) >= 2**32:
        raise ValueError(f"x: {n_tokens} tokens x {n_heads} heads is too many for one call; split it")
    if direct:  # items (token, head, lane), lanes rotating then copying; one thread each, or one per
        # frequency of a 16-byte item when the kernel computes the cos/sin
        per_item = freqs if vectorized and cache is None else 1
        tokens, block = 0, DIRECT_THREADS
        grid = -(-n_tokens * n_heads * (rot_lanes + copy_lanes) * per_item // block)
    else:
        # Tokens per block: enough items to keep every thread busy, few enough to spread over the SMs.
        tokens = max(1, ITEMS_PER_BLOCK // max(1, n_heads * (rot_lanes + copy_lanes)))
        tokens = min(tokens, MAX_BLOCK_TOKENS, COS_SIN_FLOATS // rotary_dim, max(1, n_tokens // (n_sm * BLOCKS_PER_SM)))
        grid, block = max(1, -(-n_tokens // tokens)), BLOCK_THREADS

    strides = []
    for t in range(4):  # q in, q out, k in, k out; without k, k's slots repeat q's (0 k heads)
        src = t if t < 2 * len(groups) else t - 2
        strides.extend(layout.token_strides[src])
        strides.append(layout.head_strides[src])
    use_cache = cache is not None
    if positions.dtype == TOKEN_ROWS:
        cache_fields = (freq_stride, 0)
    else:
        cache_fields = (cache.strides[0], cache.shape[0]) if use_cache else (0, 0)
    lanes = rot_lanes + copy_lanes
    tail = (
        n_tokens, layout.token_sizes[1], layout.token_sizes[2],
        *layout.pos_strides,
        *(fast_divisor(d) if direct else 0
          for d in (n_heads * lanes, layout.token_sizes[2], layout.token_sizes[1], lanes)),
        *strides,
        *cache_fields,
        n_q_heads, n_heads, tokens,
        rotary_dim, rot_lanes, copy_lanes,
        -2.0 * math.log(theta) / rotary_dim, int(bool(inverse)),
    )  # fmt: skip
    name = kernel_name(dtype, cache.dtype if use_cache else "float32", positions.dtype, style, vectorized, use_cache,
                       direct)
    return RopePlan(name, grid, block, tokens * rotary_dim * 4, _TAIL.pack(*tail), vectorized, tokens,
                    (rot_lanes, copy_lanes))


# ---------------------------------------------------------------------------------------------- checks


def _check_options(style, impl, theta, inverse):
    if style not in STYLES:
        raise ValueError(f"style: expected one of {tuple(STYLES)}, got {style!r}")
    _arrays.check_impl(impl)
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"theta: expected a finite number > 0, got {theta!r}")
    if not isinstance(inverse, (bool, np.bool_)):
        raise TypeError(f"inverse: expected a bool, got {type(inverse).__name__}")


def _check_rotary_dim(rotary_dim, head_dim):
    if rotary_dim is None:
        if head_dim > MAX_ROTARY_DIM or head_dim % 2:
            raise ValueError(f"rotary_dim: head_dim {head_dim} cannot be rotated whole (needs an even size <= "
                             f"{MAX_ROTARY_DIM}); pass rotary_dim")
        return head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)):
        raise TypeError(f"rotary_dim: expected an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > min(head_dim, MAX_ROTARY_DIM):
        raise ValueError(
            f"rotary_dim: expected an even number in [2, min(head_dim={head_dim}, {MAX_ROTARY_DIM})], got {rotary_dim}"
        )
    return int(rotary_dim)


def _check_positions(pos, like, like_name):
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


def _check_cache(cache, like, like_name, rotary_dim):
    if cache is None:
        return None
    _arrays.check_same_device(like, cache, like_name, "cos_sin_cache")
    _check_table_dtype(cache, "cos_sin_cache", like, like_name)
    if len(cache.shape) != 2 or cache.shape[0] == 0:
        raise ValueError(f"cos_sin_cache: expected shape (max_position, rotary_dim) with max_position >= 1, got "
                         f"{tuple(cache.shape)}")
    if cache.shape[1] != rotary_dim:
        relation = "narrower" if cache.shape[1] < rotary_dim else "wider"
        raise ValueError(
            f"cos_sin_cache: expected {rotary_dim} columns (rotary_dim; cos half then sin half), got "
            f"{cache.shape[1]} ({relation} than rotary_dim); pass rotary_dim={cache.shape[1]} if that is "
            "what the cache was built for"
        )
    _arrays.check_last_dim_contiguous(cache, "cos_sin_cache")
    return cache


def _check_table_dtype(table, name, like, like_name):
    """cos/sin values come in fp32 or in the rotated tensor's dtype."""
    allowed = sorted({"float32", like.dtype})
    if table.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(allowed)} (like {like_name}), got {table.dtype}")


def _check_out(o, x, x_name):
    if o is None:
        return None
    _arrays.check_same_device(x, o, x_name, "out")
    if o.dtype != x.dtype:
        raise TypeError(f"out: expected dtype {x.dtype} (like {x_name}), got {o.dtype}")
    if tuple(o.shape) != tuple(x.shape):
        raise ValueError(f"out: expected shape {tuple(x.shape)} (like {x_name}), got {tuple(o.shape)}")
    _arrays.check_last_dim_contiguous(o, "out")
    check_not_overlapping(x, o, x_name, "out", same_allowed=True)
    return o


# ------------------------------------------------------------------------------------------ public API

_plans = _arrays.PlanCache()


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
    cache, plan, recall_options = cos_sin_cache, None, None
    if (out is None or out is x) and type(x) in _arrays._TORCH_TYPES:  # may be recalled (_recall.py)
        recall_options = ("rope", out is None, cache is None, theta, style, rotary_dim, inverse, impl)
        tensors = (x, positions) if cache is None else (x, positions, cache)
        plan = _plans.recent["rope"].recall(recall_options, tensors)
    if plan is not None:
        x_ptr, p_ptr, c_ptr = x.data_ptr(), positions.data_ptr(), 0 if cache is None else cache.data_ptr()
        o_ptr = 0 if out is None else x_ptr
    if plan is None or (x_ptr | p_ptr | c_ptr) & 15:
        x_key, x_ptr = fingerprint(x, "x")
        p_key, p_ptr = fingerprint(positions, "positions")
        c_key, c_ptr = fingerprint_optional(cache, "cos_sin_cache")
        o_key, o_ptr = fingerprint_optional(out, "out")
        key = ("rope", x_key, p_key, c_key, o_key, o_ptr == x_ptr, theta, style, rotary_dim, inverse, impl)
        plan = _plans.get(key)
        if plan is None:
            plan = _plan_rope_call(describe(x, "x"), describe(positions, "positions"),
                                   describe_optional(cache, "cos_sin_cache"), describe_optional(out, "out"),
                                   theta, style, rotary_dim, inverse, impl)
            _plans.put(key, plan)
        if recall_options:
            _plans.recent["rope"].remember(recall_options, tensors, (x_ptr, p_ptr, c_ptr), key, plan)
    out, out_ptr = _arrays.output(x, x_ptr, out, o_ptr, plan)
    if plan.grid:
        plan.launch(x_ptr, out_ptr, x_ptr, out_ptr, p_ptr, c_ptr)
    return out


def rope_(x, positions, **options):
    """In-place spelling of ``rope(x, positions, out=x, ...)``."""
    return rope(x, positions, out=x, **options)


def rope_qk(q, k, positions, *, theta=10000.0, style="neox", rotary_dim=None, cos_sin_cache=None,
            inverse=False, impl="auto", out=None):
    """Rotate q (..., Hq, head_dim) and k (..., Hk, head_dim) in one launch (options as in rope()). In
    place by default; out=(q_out, k_out) writes elsewhere, out="new" into new arrays. q and k may be
    strided views (e.g. column slices of a fused qkv tensor) as long as their last dimension is
    contiguous. Returns (q, k), or the outputs."""
    return _qk_call("rope_qk", q, k, "positions", positions, "cos_sin_cache", cos_sin_cache, out,
                    (theta, style, rotary_dim, inverse, impl), _plan_rope_qk_call)


def rope_qk_cos_sin(q, k, cos, sin, *, rotary_dim=None, freq_step=1, style="neox", inverse=False, impl="auto",
                    out=None):
    """Rotate q and k (as in rope_qk) by per-token cos and sin tensors instead of positions: what
    transformers' ``apply_rotary_pos_emb`` gets (cupyrope.dropin builds on it). cos and sin have one
    shape, dtype (fp32 or q's) and strides: (..., columns), their leading dimensions matching q's and
    k's aligned from the left (size-1 dimensions broadcast, as positions do), frequency f's value at
    column f * freq_step (1: transformers' halves layout, whose second half repeats the first, or a
    (..., rotary_dim / 2) table; 2: the interleaved layout). rotary_dim defaults to head_dim. In place
    by default; out=(q_out, k_out) writes elsewhere, out="new" into new arrays. Returns (q, k), or the
    outputs."""
    return _qk_call("rope_qk_cos_sin", q, k, "cos", cos, "sin", sin, out, (rotary_dim, freq_step, style, inverse, impl),
                    _plan_rope_qk_cos_sin_call)


def _qk_call(op, q, k, a_name, a, b_name, b, out, options, plan_call):
    """One call of rope_qk or rope_qk_cos_sin: the plan cached by the fingerprints of q, k, the cos/sin
    source's two arrays (a, and b, which may be None: positions and the cache, or cos and sin) and out,
    and the options; plan_call makes it from (q, k, a, b, the outputs, *options). Then the launch with
    this call's pointers. In place and out="new", a repeated call with torch tensors is recalled instead."""
    plan = recall_options = None
    if (out is None or isinstance(out, str)) and type(q) in _arrays._TORCH_TYPES:  # in place or new outputs
        recall_options, tensors = (op, out, b is None, *options), (q, k, a) if b is None else (q, k, a, b)
        plan = _plans.recent[op].recall(recall_options, tensors)
    if plan is not None:
        q_ptr, k_ptr, a_ptr, b_ptr = q.data_ptr(), k.data_ptr(), a.data_ptr(), 0 if b is None else b.data_ptr()
        if not (q_ptr | k_ptr | a_ptr | b_ptr) & 15:
            return _launch_qk(plan, q, k, (q_ptr, q_ptr, k_ptr, k_ptr, a_ptr, b_ptr), out)
    q_key, q_ptr = fingerprint(q, "q")
    k_key, k_ptr = fingerprint(k, "k")
    a_key, a_ptr = fingerprint(a, a_name)
    b_key, b_ptr = fingerprint_optional(b, b_name)
    q_out, k_out, out_key, qo_ptr, ko_ptr = _qk_outputs(q_ptr, k_ptr, out)
    key = (op, q_key, k_key, a_key, b_key, out_key, *options)
    plan = _plans.get(key)
    if plan is None:
        qa, ka = describe(q, "q"), describe(k, "k")
        plan = plan_call(qa, ka, describe(a, a_name), describe_optional(b, b_name),
                         *_describe_qk_outputs(qa, ka, q_out, k_out, out), *options)
        _plans.put(key, plan)
    if recall_options:
        _plans.recent[op].remember(recall_options, tensors, (q_ptr, k_ptr, a_ptr, b_ptr), key, plan)
    return _launch_qk(plan, q, k, (q_ptr, qo_ptr, k_ptr, ko_ptr, a_ptr, b_ptr), out)


NEW = "new"  # out=NEW: rope_qk and rope_qk_cos_sin write into new arrays


def _qk_outputs(q_ptr, k_ptr, out):
    """(q_out, k_out, the outputs' plan key, their pointers) of out: None (in place: q and k, key
    None), NEW (objects and pointers made per call from the plan) or a pair (fingerprinted)."""
    if out is None:
        return None, None, None, q_ptr, k_ptr
    if isinstance(out, str):
        if out != NEW:
            raise ValueError(f"out: expected None (in place), {NEW!r} or a pair (q_out, k_out), got {out!r}")
        return None, None, NEW, 0, 0
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out: expected None (in place), {NEW!r} or a pair (q_out, k_out)")
    q_out, k_out = out
    (qo_key, qo_ptr), (ko_key, ko_ptr) = fingerprint(q_out, "out[0]"), fingerprint(k_out, "out[1]")
    return q_out, k_out, (qo_key, ko_key), qo_ptr, ko_ptr


def _describe_qk_outputs(qa, ka, q_out, k_out, out):
    """(qo, ko) for the planner: q and k themselves in place, None for new arrays, else the caller's."""
    if out is None:
        return qa, ka
    if isinstance(out, str):
        return None, None
    return describe(q_out, "out[0]"), describe(k_out, "out[1]")


def _launch_qk(plan, q, k, ptrs, out):
    """Launch a planned rope_qk/rope_qk_cos_sin call with ptrs (q, q_out, k, k_out, then the cos/sin
    source's two); returns what the call returns. New outputs share memory with nothing: they skip
    the per-call overlap checks (~3 µs of a decode call)."""
    if isinstance(out, str):
        new_q, new_k = plan.new_output
        (q_out, qo_ptr), (k_out, ko_ptr) = new_q(q), new_k(k)
        if plan.grid:
            plan.launch(ptrs[0], qo_ptr, ptrs[2], ko_ptr, ptrs[4], ptrs[5])
        return q_out, k_out
    if plan.grid:
        _check_disjoint_and_launch(plan, ptrs)
    return (q, k) if out is None else tuple(out)


def _check_disjoint_and_launch(plan, ptrs) -> None:
    """Launch with this call's pointers (q, q_out, k, k_out, then the cos/sin source's two) after checking
    the pairs of them that must not share memory (plan.disjoint: (slot, written slot), with their
    layouts in plan.extents): pointers change between calls of one plan."""
    extents, names = plan.extents, plan.slot_names
    for a, b in plan.disjoint:
        _arrays.check_disjoint(ptrs[a], extents[a], ptrs[b], extents[b], names[a], names[b], "pass separate memory")
    plan.launch(*ptrs)


def _plan_rope_call(xa, pa, ca, oa, theta, style, rotary_dim, inverse, impl):
    _check_options(style, impl, theta, inverse)
    _arrays.check_float_input(xa, "x", "head_dim")
    rotary_dim = _check_rotary_dim(rotary_dim, xa.shape[-1])
    _check_positions(pa, xa, "x")
    cache = _check_cache(ca, xa, "x", rotary_dim)
    _check_out(oa, xa, "x")
    if xa.size:
        out = oa if oa is not None else _arrays.contiguous_like(xa, xa.shape, xa.dtype)
        plan = plan_rope([(xa, out)], pa, cache, style=style, rotary_dim=rotary_dim, theta=theta, inverse=inverse,
                         impl=impl, n_sm=sm_count(xa.device))
        plan.out_layouts = _arrays.out_layouts(xa, oa)
        _prepare_launch(plan, xa)
    else:
        plan = EmptyPlan()
    plan.new_output = _arrays.allocator(xa, xa.shape, xa.dtype)
    return plan


def _plan_rope_qk_call(qa, ka, pa, ca, qo, ko, theta, style, rotary_dim, inverse, impl):
    _check_options(style, impl, theta, inverse)
    _check_qk(qa, ka)
    rotary_dim = _check_rotary_dim(rotary_dim, qa.shape[-1])
    _check_positions(pa, qa, "q")
    cache = _check_cache(ca, qa, "q", rotary_dim)
    return _plan_qk(qa, ka, qo, ko, (pa, cache), ("positions", "cos_sin_cache"), False, positions=pa, cache=cache,
                    style=style, rotary_dim=rotary_dim, theta=theta, inverse=inverse, impl=impl)


def _plan_rope_qk_cos_sin_call(qa, ka, cos, sin, qo, ko, rotary_dim, freq_step, style, inverse, impl):
    _check_options(style, impl, 10000.0, inverse)
    _check_qk(qa, ka)
    rotary_dim = _check_rotary_dim(rotary_dim, qa.shape[-1])
    rows = _check_cos_sin(cos, sin, qa, rotary_dim, freq_step)
    return _plan_qk(qa, ka, qo, ko, (cos, sin), ("cos", "sin"), True, positions=rows, cache=cos, style=style,
                    rotary_dim=rotary_dim, theta=10000.0, inverse=inverse, impl=impl,
                    freq_stride=freq_step * cos.strides[-1])


def _plan_qk(qa, ka, qo, ko, sources, source_names, check_reads, **options):
    """The plan of a checked q+k call (options: plan_rope's). qo = ko = None: into new arrays
    (plan.new_output: their allocators), which overlap nothing; otherwise the outputs (q and k in
    place) are checked here and the pairs that must not share memory (sources: the cos/sin source's
    two arrays) are set for the per-call checks."""
    new = qo is None
    if new:
        qo, ko = (_arrays.contiguous_like(a, a.shape, a.dtype) for a in (qa, ka))
    else:
        _check_qk_outputs(qa, ka, qo, ko)
    if not (qa.size or ka.size):
        plan = EmptyPlan()
    else:
        plan = plan_rope([(qa, qo), (ka, ko)], n_sm=sm_count(qa.device), **options)
        if not new:
            _set_disjoint(plan, qa, ka, qo, ko, sources, source_names, check_reads)
        _prepare_launch(plan, qa)
    if new:
        plan.new_output = tuple(_arrays.allocator(a, a.shape, a.dtype) for a in (qa, ka))
    return plan


def _check_qk(qa, ka):
    _arrays.check_float_input(qa, "q", "head_dim")
    _arrays.check_float_input(ka, "k", "head_dim")
    _arrays.check_same_device(qa, ka, "q", "k")
    if ka.dtype != qa.dtype:
        raise TypeError(f"k: expected dtype {qa.dtype} (like q), got {ka.dtype}")
    if ka.shape[-1] != qa.shape[-1]:
        raise ValueError(f"k: expected head_dim {qa.shape[-1]} (like q), got {ka.shape[-1]}")
    if len(ka.shape) != len(qa.shape):
        raise ValueError(f"k: expected {len(qa.shape)} dimensions (like q {tuple(qa.shape)}), got shape {tuple(ka.shape)}")


def _check_qk_outputs(qa, ka, qo, ko):
    if qo is qa:  # in place: q and k are both written
        check_not_overlapping(qa, ka, "q", "k")
    else:  # q and k are only read; the outputs are written
        _check_out(qo, qa, "q")
        _check_out(ko, ka, "k")
        check_not_overlapping(qo, ko, "out[0]", "out[1]")


def _check_cos_sin(cos, sin, qa, rotary_dim, freq_step):
    """The Array standing for cos/sin's leading dimensions as positions (dtype TOKEN_ROWS)."""
    if sin is None:  # _qk_call passes the second source on when it is None (rope_qk's cache may be)
        raise TypeError("sin: expected a cupy.ndarray or a CUDA torch.Tensor, got NoneType")
    if isinstance(freq_step, bool) or not isinstance(freq_step, (int, np.integer)) or freq_step not in (1, 2):
        raise ValueError(f"freq_step: expected 1 (frequency f at column f) or 2 (at column 2f), got {freq_step!r}")
    for name, t in (("cos", cos), ("sin", sin)):
        _arrays.check_same_device(qa, t, "q", name)
        _check_table_dtype(t, name, qa, "q")
        if not t.shape:
            raise ValueError(f"{name}: expected shape (..., columns), got a 0-d array")
    if (sin.dtype, tuple(sin.shape), tuple(sin.strides)) != (cos.dtype, tuple(cos.shape), tuple(cos.strides)):
        raise ValueError(f"sin: expected the dtype, shape and strides of cos ({cos.dtype}, {tuple(cos.shape)}, "
                         f"{tuple(cos.strides)}), got {sin.dtype}, {tuple(sin.shape)}, {tuple(sin.strides)}")
    columns = (rotary_dim // 2 - 1) * freq_step + 1
    if cos.shape[-1] < columns:
        raise ValueError(f"cos: expected at least {columns} columns (rotary_dim {rotary_dim} with freq_step "
                         f"{freq_step}), got shape {tuple(cos.shape)}")
    rows = _arrays.Array(None, cos.kind, cos.ptr, TOKEN_ROWS, tuple(cos.shape[:-1]), tuple(cos.strides[:-1]),
                         cos.device)
    lead = tuple(qa.shape[:-1])
    if len(rows.shape) > len(lead) or any(c != 1 and c != n for c, n in zip(rows.shape, lead)):
        raise ValueError(f"cos: leading dimensions {rows.shape} do not match q's {lead} (aligned from the left; "
                         "size-1 dimensions broadcast)")
    return rows


def _set_disjoint(plan, qa, ka, qo, ko, sources, source_names, check_reads) -> None:
    """What _check_disjoint_and_launch checks per call: in place, q against k; out of place, the outputs
    against each other and against q and k. check_reads: the cos/sin source against what is written
    too (positions and a cache are arrays of their own in practice; cos/sin may be views of anything)."""
    plan.slot_names = ("q", "out[0]", "k", "out[1]", *source_names)
    plan.extents = tuple(None if a is None else _arrays.layout_key(a) for a in (qa, qo, ka, ko, *sources))
    read = [4, 5] if check_reads else []
    if qo is qa:
        plan.disjoint = [(0, 2)] + [(r, w) for w in (0, 2) for r in read]
    else:
        plan.disjoint = [(1, 3)] + [(r, w) for w in (1, 3) for r in [0, 2, *read]]


def _prepare_launch(plan: RopePlan, like) -> None:
    kernel = get_kernel(SOURCE, plan.name, like.device)
    plan.launch = _launch.Launch(kernel, plan.grid, plan.block, 6, plan.tail, like.device, like.kind, plan.shared_mem)


def rope_cache(max_position, rotary_dim, theta=10000.0, *, scaling=None, dtype="float32", kind="cupy",
               device=0):
    """The (max_position, rotary_dim) cos/sin table in vLLM's layout, computed in float64 and rounded
    once to ``dtype``; returned as a CuPy array (kind="cupy") or a torch tensor (kind="torch") on
    ``device``. ``scaling``: a Hugging Face ``rope_scaling``/``rope_parameters`` dict for long-context
    models ("linear", "llama3" or "yarn"; see cupyrope.rope_scaling), checked before anything reaches
    the GPU. A setup-time helper: it builds the table on the host and copies it over."""
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
    # Round float64 -> dtype once, on the host (torch's double -> half cast rounds twice, via float).
    host = reference.rope_cache(int(max_position), int(rotary_dim), theta, scaling).astype(_arrays._cupy_dtype(dtype))
    if kind == "torch":
        import torch

        if dtype == "bfloat16":
            return torch.from_numpy(host.view("uint16")).view(torch.bfloat16).to(f"cuda:{device}")
        return torch.from_numpy(host).to(f"cuda:{device}")
    return _arrays.from_host(host, "cupy", device)
