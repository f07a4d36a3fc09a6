"""RoPE's plan: kernel variant, grid, block and parameters of a checked call. A pure function of shapes, dtypes,
strides, pointer alignment and the SM count (unit-tested without a GPU).

Two kernels (kernels_src/rope.cu). The block kernel gives a block a few tokens, computes each (token,
frequency) cos/sin of them once into shared memory, and shares it across every head of q and k. The direct
kernel gives each thread one item (a pair, or a 16-byte chunk, of one head of one token) with no shared memory
and no barrier, so its x and position loads go out together: it takes small calls (decode), where the block
kernel's three memory round trips (positions, cos/sin, x) are the whole call, and calls with a cos/sin cache,
whose rows the L1 serves to every head.

The tensors reduce to a canonical view (canonical_layout): up to three token dimensions (each with a position
stride) times one head dimension, merged wherever every tensor's strides allow, with no copies.
"""

import dataclasses
import math
import struct

from .._runtime.arrays import CTYPE, FLOAT_DTYPES, INDEX_DTYPES, ITEMSIZE, merge_dims
from .._runtime.choices import choice

SOURCE = "rope.cu"
STYLES = {"neox": 0, "gptj": 1}
BLOCK_THREADS = 256  # kernels_src/rope.cu: BLOCK_THREADS
MAX_BLOCK_TOKENS = 64  # kernels_src/rope.cu: MAX_BLOCK_TOKENS (its per-block token tables)
COS_SIN_FLOATS = 8192  # shared-memory cos/sin table per block: 32 KiB
MAX_ROTARY_DIM = 1024
DIRECT_MAX_THREADS = 256  # kernels_src/rope.cu: DIRECT_MAX_THREADS (rope_direct_kernel's launch bound)


@dataclasses.dataclass(frozen=True)
class RopeChoices:
    """RoPE's measured launch choices: a launch profile's "rope" section (ops/profiles.py).

    items_per_block: (token, head, lane) items a block of the block kernel aims at: enough to keep its threads busy,
      few enough to spread a call over the SMs (two tokens of Llama q, or q+k, on an H100).
    blocks_per_sm: below this many blocks an SM, fewer tokens a block.
    direct_max_tokens: rope_direct_kernel (one item a thread, no shared cos/sin) takes calls of at most this many
      tokens; the block kernel's shared cos/sin pays from about 64 tokens on.
    direct_with_cache: the direct kernel also takes every vectorized call with a cos/sin cache whose rows it reads
      as packs (nothing to share: the cache is read, not computed).
    direct_threads: threads a block of the direct kernel: small blocks spread a small call over the SMs.
    """

    items_per_block: int = choice(32, 8192)
    blocks_per_sm: int = choice(1, 32)
    direct_max_tokens: int = choice(0, 2**31)
    direct_with_cache: bool
    direct_threads: int = choice(32, DIRECT_MAX_THREADS)


# Mirrors RopeParams in kernels_src/rope_common.cuh: twelve pointers, then this tail. RoPE's launches pass the
# first seven (ROPE_POINTERS) and pack the five qk_norm_rope ones as null in front of the tail.
_TAIL = struct.Struct("<3q3qqq3qq2q4q16q8q2q3q3qdq2q2f")
ROPE_POINTERS = 7
NORM_POINTERS = bytes(8 * 5)


@dataclasses.dataclass(frozen=True)
class PositionSource:
    """Where a token's position comes from (RopeParams::pos_mode): one position per token ("plain"), M-RoPE's
    three rows ("mrope": each frequency takes the row of its section) or varlen sequences ("varlen": the token's
    offset in its sequence plus the sequence's offset)."""

    mode: str = "plain"
    mrope_stride: int = 0  # mrope: elements between the position rows
    sections: tuple = (0, 0, 0)  # mrope: frequencies of the t, h and w sections
    interleaved: bool = False  # mrope: Qwen3-VL's assignment
    n_seqs: int = 0  # varlen: sequences (cu_seqlens has n_seqs + 1 entries)
    offsets_64: bool = False  # varlen: seqlen_offsets is int64

    def fields(self) -> tuple:
        return (POSITION_MODES[self.mode], self.mrope_stride, *self.sections, int(self.interleaved), self.n_seqs,
                int(self.offsets_64))


POSITION_MODES = {"plain": 0, "mrope": 1, "varlen": 2}  # kernels_src/rope_common.cuh: POS_*
PLAIN = PositionSource()


@dataclasses.dataclass(frozen=True)
class NormFields:
    """The qk_norm_rope fields of RopeParams (zero in RoPE's plans)."""

    head_dim: int = 0
    group_threads: int = 0
    eps: float = 0.0
    weight_offset: float = 0.0
    x_strides: tuple = ((0,) * 4, (0,) * 4)  # backward: q_x's and k_x's strides (3 token dims, heads)


def pack_params(layout, strides, source, *, divisors, n_tokens, heads, lanes, tokens, cache_fields, rotary_dim,
                theta, inverse, norm=NormFields()) -> bytes:
    """RopeParams after its pointers. strides: q in, q out, k in, k out (3 token dims, then heads, each); heads:
    (q heads, all heads); lanes: (rotating, copying) a head; divisors: the four fast_div divisors (div_token_items,
    div_n2, div_n1, div_lanes) as plain numbers, 0 where the kernel does not divide by it."""
    rot_lanes, copy_lanes = lanes
    n_q_heads, n_heads = heads
    return _TAIL.pack(
        n_tokens, layout.token_sizes[1], layout.token_sizes[2],
        *layout.pos_strides,
        *source.fields(),
        *(fast_divisor(d) if d else 0 for d in divisors),
        *(s for tensor in strides for s in tensor),
        *(s for tensor in norm.x_strides for s in tensor),
        *cache_fields,
        n_q_heads, n_heads, tokens,
        rotary_dim, rot_lanes, copy_lanes,
        -2.0 * math.log(theta) / rotary_dim, int(bool(inverse)),
        norm.head_dim, norm.group_threads, norm.eps, norm.weight_offset,
    )  # fmt: skip


def rotating_lanes(rotary_dim: int, style: str, elems: int) -> int:
    """Rotating items a head: NeoX pairs of `elems`-element chunks (one from each half), or GPT-J chunks of
    interleaved pairs."""
    return rotary_dim // 2 // elems if style == "neox" else rotary_dim // elems


def tensor_strides(layout, n_groups: int) -> list[tuple]:
    """(3 token strides, head stride) of q in, q out, k in, k out; without k, k's repeat q's (0 k heads)."""
    strides = []
    for t in range(4):
        src = t if t < 2 * n_groups else t - 2
        strides.append((*layout.token_strides[src], layout.head_strides[src]))
    return strides


class RopePlan:
    __slots__ = ("name", "grid", "block", "shared_mem", "tail", "vectorized", "tokens_per_block", "lanes", "extents",
                 "slot_names", "disjoint", "launch", "out_layouts", "new_output", "partial_rows", "dw_launch", "new_grads", "new_partial")

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


def variants():
    """Every RoPE kernel the planner can ask for."""
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
    elems = 16 // ITEMSIZE[dtype]
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


def _in_packs(tables, strides, freqs) -> bool:
    """Whether the direct kernel's 16-byte items, of `freqs` frequencies, can read their cos/sin as packs from
    `tables` (arrays of one dtype) whose rows lie `strides` elements apart: the pointers and row strides aligned to
    a pack. rotary_dim's own alignment follows from the items'."""
    itemsize = ITEMSIZE[tables[0].dtype]
    pack_bytes = min(16, freqs * itemsize)
    return all(t.ptr % pack_bytes == 0 for t in tables) and all(s * itemsize % pack_bytes == 0 for s in strides)


def plan_rope(groups, positions, cache, *, style, rotary_dim, theta, inverse, impl, n_sm, choices, in_place,
              freq_stride=0, sin=None, source=PLAIN) -> RopePlan:
    """groups: [(input, output), ...] Arrays: q's pair, then k's (optional). All checked already. in_place: each
    output is its input (out of place, features past rotary_dim are copied). positions of dtype TOKEN_ROWS: the
    leading dimensions of per-token cos/sin tensors (their strides locate a token's row), cache then stands for
    cos, sin for sin, and freq_stride is the element stride between frequencies in cos and sin. source: where the
    positions come from (PositionSource; positions then stands for the token dimensions they cover). n_sm and
    choices (RopeChoices): the GPU's SMs and its launch profile's "rope" section."""
    dtype = groups[0][0].dtype
    head_dim = groups[0][0].shape[-1]
    layout = canonical_layout(
        [(inp.shape[:-1], [inp.strides[:-1], out.strides[:-1]]) for inp, out in groups],
        positions.shape,
        positions.strides,
    )
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
    direct = n_tokens <= choices.direct_max_tokens or (choices.direct_with_cache and cache is not None and can_vectorize
                                                       and source.mode != "mrope")
    direct = direct and n_tokens * n_heads * head_dim < 2**31  # item indices in fast_div's range
    # Direct calls with in-kernel cos/sin: one pair a thread measured 0.1-0.4 us faster than 16-byte items
    # (whose 8 cos/sin are computed by 8 threads and gathered by shuffles), so auto takes it.
    vectorized = can_vectorize and not (direct and cache is None and impl == "auto")
    elems = 16 // ITEMSIZE[dtype] if vectorized else (2 if style == "gptj" else 1)
    freqs = elems if style == "neox" else elems // 2  # frequencies an item rotates (the kernels' F)
    if direct and vectorized and cache is not None and positions.dtype != TOKEN_ROWS:
        direct = _in_packs([cache], cache.strides[:1], freqs)  # else the block kernel, which reads any cache
    rot_lanes = rotating_lanes(rotary_dim, style, elems)
    copy_lanes = (head_dim - rotary_dim) // (elems if vectorized else 1) if copies else 0
    lanes = rot_lanes + copy_lanes
    check_token_count(n_tokens, n_heads, max(rot_lanes, copy_lanes, 1))
    if direct:  # items (token, head, lane), lanes rotating then copying; one thread each, or one per
        # frequency of a 16-byte item when the kernel computes the cos/sin
        per_item = freqs if vectorized and cache is None else 1
        tokens, block = 0, choices.direct_threads
        grid = -(-n_tokens * n_heads * lanes * per_item // block)
    else:
        # Tokens per block: enough items to keep every thread busy, few enough to spread over the SMs.
        tokens = block_tokens(n_tokens, n_heads * lanes, rotary_dim, n_sm, choices.items_per_block,
                              choices.blocks_per_sm)
        grid, block = max(1, -(-n_tokens // tokens)), BLOCK_THREADS
    use_cache = cache is not None
    divisors = (n_heads * lanes, layout.token_sizes[2], layout.token_sizes[1], lanes) if direct else (0, 0, 0, 0)
    tail = pack_params(layout, tensor_strides(layout, len(groups)), source, divisors=divisors, n_tokens=n_tokens,
                       heads=(n_q_heads, n_heads), lanes=(rot_lanes, copy_lanes), tokens=tokens,
                       cache_fields=cache_fields(positions, cache, freq_stride, sin, freqs), rotary_dim=rotary_dim,
                       theta=theta,
                       inverse=inverse)
    name = kernel_name(dtype, cache.dtype if use_cache else "float32", positions.dtype, style, vectorized, use_cache,
                       direct)
    return RopePlan(name, grid, block, tokens * rotary_dim * 4, NORM_POINTERS + tail, vectorized, tokens,
                    (rot_lanes, copy_lanes))


def check_token_count(n_tokens: int, n_heads: int, lanes: int) -> None:
    """Token and item indices stay 32-bit in the kernels."""
    if n_tokens >= 2**31 or n_tokens * n_heads * lanes >= 2**32:
        raise ValueError(f"x: {n_tokens} tokens x {n_heads} heads is too many for one call; split it")


def block_tokens(n_tokens: int, items_per_token: int, rotary_dim: int, n_sm: int, items_per_block: int,
                 blocks_per_sm: int) -> int:
    """Tokens a block of a block kernel takes: about items_per_block items (threads' work), few enough to give
    each SM blocks_per_sm blocks, and as many cos/sin rows as its shared memory holds."""
    tokens = max(1, items_per_block // max(1, items_per_token))
    return min(tokens, MAX_BLOCK_TOKENS, COS_SIN_FLOATS // rotary_dim, max(1, n_tokens // (n_sm * blocks_per_sm)))


def cache_fields(positions, cache, freq_stride, sin=None, freqs=1) -> tuple[int, int]:
    """RopeParams' (cache_stride, max_position), or with per-token cos and sin (cache: cos) (freq_stride,
    rows_in_packs): whether the direct kernel's items, of `freqs` frequencies, read their cos and their sin as one
    pack each (kernels_src/rope_common.cuh: token_rows_cos_sin): frequencies contiguous, both tensors and every
    token's row aligned to a pack."""
    if positions.dtype == TOKEN_ROWS:
        rows = [s for n, s in zip(positions.shape, positions.strides) if n > 1]
        return freq_stride, int(freq_stride == 1 and sin is not None and _in_packs([cache, sin], rows, freqs))
    return (cache.strides[0], cache.shape[0]) if cache is not None else (0, 0)


# ------------------------------------------------------------------------------------------- layout

MAX_TOKEN_DIMS = 3


class Layout:
    """(..., head_dim) tensors and their broadcast positions as up to three token dimensions (each with a
    position stride) times one head dimension. Leading dimensions where positions have size 1 are head
    dimensions (cos/sin are shared across them); the others are token dimensions. Dimensions merge when every
    tensor's strides allow it, so a contiguous tensor collapses to (tokens, heads) and (B, H, S, D) with
    positions (B, 1, S) becomes two token dimensions and one head dimension. Head dimensions that cannot merge
    into one run are demoted to token dimensions whose position stride is 0 (correct, only less sharing)."""

    __slots__ = ("token_sizes", "token_strides", "pos_strides", "heads", "head_strides")

    def __init__(self, token_sizes, token_strides, pos_strides, heads, head_strides):
        self.token_sizes = token_sizes  # 3 sizes, outermost first
        self.token_strides = token_strides  # one 3-tuple per tensor
        self.pos_strides = pos_strides  # 3-tuple
        self.heads = heads  # one count per group
        self.head_strides = head_strides  # one stride per tensor

    @property
    def n_tokens(self) -> int:
        a, b, c = self.token_sizes
        return a * b * c


def _merges(dims) -> bool:
    """dims: (size, strides) outermost first; True when they form one run for every tensor."""
    return all(
        all(so == inner_size * si for so, si in zip(outer_strides, inner_strides))
        for (_, outer_strides), (inner_size, inner_strides) in zip(dims, dims[1:])
    )


def canonical_layout(groups, pos_shape, pos_strides, arg_name="x") -> Layout:
    """groups: [(leading_shape, [element strides of each tensor with that shape]), ...] -- q's tensors,
    then k's. Groups share token dimensions and may differ in head dimensions (GQA)."""
    ndim = len(groups[0][0])
    if len(pos_shape) > ndim:
        raise ValueError(
            f"positions: expected at most {ndim} dimensions (the leading dimensions of {arg_name}, "
            f"{tuple(groups[0][0])}), got shape {tuple(pos_shape)}"
        )
    pad = ndim - len(pos_shape)
    pshape = tuple(pos_shape) + (1,) * pad
    pstride = tuple(pos_strides) + (0,) * pad

    for j in range(ndim):
        if pshape[j] != 1 and any(shape[j] != pshape[j] for shape, _ in groups):
            raise ValueError(
                f"positions: shape {tuple(pos_shape)} does not match the leading dimensions of {arg_name}, "
                f"{tuple(groups[0][0])} (aligned from the left; size-1 dimensions broadcast)"
            )

    def group_dims(g, indices):
        shape, strides = groups[g]
        return [(shape[j], tuple(s[j] for s in strides)) for j in indices if shape[j] != 1]

    head_idx = [j for j in range(ndim) if pshape[j] == 1 and any(shape[j] != 1 for shape, _ in groups)]
    keep = len(head_idx)
    while keep > 1 and not all(_merges(group_dims(g, head_idx[-keep:])) for g in range(len(groups))):
        keep -= 1
    demoted = head_idx[: len(head_idx) - keep]
    for j in demoted:
        sizes = sorted({shape[j] for shape, _ in groups})
        if len(sizes) != 1:
            raise ValueError(
                f"{arg_name}: dimension {j} has sizes {sizes} across q and k and cannot be merged with "
                "their head dimension; give q and k the same size there"
            )

    token_idx = [j for j in range(ndim) if pshape[j] != 1 or j in demoted]
    token_dims = [
        (groups[0][0][j], tuple(s[j] for _, strides in groups for s in strides) + (pstride[j] if j not in demoted else 0,))
        for j in token_idx
        if groups[0][0][j] != 1
    ]
    tokens = merge_dims(token_dims)
    if len(tokens) > MAX_TOKEN_DIMS:
        raise ValueError(
            f"{arg_name}: its leading dimensions reduce to {len(tokens)} token dimensions that cannot be "
            f"merged (at most {MAX_TOKEN_DIMS} are supported); pass a contiguous tensor"
        )
    n_tensors = sum(len(strides) for _, strides in groups)
    tokens = [(1, (0,) * (n_tensors + 1))] * (MAX_TOKEN_DIMS - len(tokens)) + tokens

    heads, head_strides = [], []
    for g, (_, strides) in enumerate(groups):
        run = merge_dims(group_dims(g, head_idx[len(head_idx) - keep :]))
        heads.append(run[0][0] if run else 1)
        head_strides.extend(run[0][1] if run else (0,) * len(strides))
    return Layout(
        tuple(t[0] for t in tokens),
        [tuple(t[1][i] for t in tokens) for i in range(n_tensors)],
        tuple(t[1][n_tensors] for t in tokens),
        heads,
        head_strides,
    )
