"""QK-norm + RoPE's plan: kernel variant, grid, block and parameters of a checked call (kernels_src/qk_norm_rope.cu).
A pure function of shapes, dtypes, strides, pointer alignment and the GPU's numbers (unit-tested without a GPU).

The tensors reduce to RoPE's canonical layout (rope_plan.canonical_layout) and the tokens go to blocks as in RoPE's
block kernel; a head is a row of `group_threads` threads (a power of two up to a warp) holding its items in
registers: rotating pairs, then the chunks past rotary_dim (normalized, not rotated).
"""

import dataclasses

from .._runtime.arrays import CTYPE, FLOAT_DTYPES, INDEX_DTYPES, ITEMSIZE
from .._runtime.choices import choice
from .._runtime.compile import DEFAULT_SHARED_LIMIT
from .rmsnorm_rows import next_pow2
from .rope_plan import (BLOCK_THREADS, PLAIN, STYLES, NormFields, RopePlan, _vector_blockers, block_tokens,
                        cache_fields, canonical_layout, check_token_count, pack_params, rotating_lanes)

SOURCE = "qk_norm_rope.cu"
MAX_ITEMS = {True: 1, False: 4}  # items a thread, 16-byte and scalar (kernels_src/qk_norm_rope.cu: MAX_ITEMS)
# Blocks an SM holds (kernels_src/qk_norm_rope.cu: FORWARD_MIN_BLOCKS, BACKWARD_MIN_BLOCKS), for balanced_tokens.
BLOCKS_PER_SM = {False: 4, True: 3}  # by backward
STATIC_SHARED_BYTES = 9 * 1024  # the kernels' BlockTokens, inverse frequencies and the backward's x_offset


@dataclasses.dataclass(frozen=True)
class QkNormRopeChoices:
    """QK-norm + RoPE's measured launch choices: a launch profile's "qk_norm_rope" section (ops/profiles.py).

    forward_threads_per_block, backward_threads_per_block: the head rows' threads (rows x group_threads) a block of
      the forward, and a token chunk of the backward, aims at: several passes of a block's threads, so each thread
      has the next pass's row in flight while it computes its own, few enough to spread a call over the SMs.
    """

    forward_threads_per_block: int = choice(256, 8192)
    backward_threads_per_block: int = choice(256, 8192)


def kernel_name(dtype, weight_dtype, cache_dtype, pos_dtype, style, vectorized, use_cache, backward=False) -> str:
    kernel = "qk_norm_rope_bwd_kernel" if backward else "qk_norm_rope_kernel"
    return (f"cupyrope::{kernel}<{CTYPE[dtype]}, {CTYPE[weight_dtype]}, {CTYPE[cache_dtype]}, {CTYPE[pos_dtype]}, "
            f"{STYLES[style]}, {'true' if vectorized else 'false'}, {'true' if use_cache else 'false'}>")


def variants():
    """Every QK-norm + RoPE kernel the planners can ask for."""
    for dtype in FLOAT_DTYPES:
        tables = sorted({"float32", dtype})
        for weight in tables:
            for cache in (None, *tables):
                for pos in INDEX_DTYPES:
                    for style in STYLES:
                        for vectorized in (False, True):
                            for backward in (False, True):
                                yield SOURCE, kernel_name(dtype, weight, cache or "float32", pos, style, vectorized,
                                                          cache is not None, backward)


def plan_qk_norm_rope(groups, weights, positions, cache, *, style, rotary_dim, theta, eps, offset, impl, n_sm,
                      choices, rope_choices, source=PLAIN, x_inputs=None) -> RopePlan:
    """groups: [(q input, q output), (k input, k output)] Arrays, checked; weights: (q_weight, k_weight).
    Backward (x_inputs: the forward's q and k): the inputs are the output gradients, the outputs dq and dk; the
    grid is one block a token chunk until cap_backward_grid fits it to the GPU. n_sm, choices (QkNormRopeChoices)
    and rope_choices (RopeChoices: blocks_per_sm): the GPU's SMs and its launch profile."""
    backward = x_inputs is not None
    dtype, head_dim = groups[0][0].dtype, groups[0][0].shape[-1]
    tensors = [[inp, out] + ([x_inputs[g]] if backward else []) for g, (inp, out) in enumerate(groups)]
    layout = canonical_layout([(t[0].shape[:-1], [a.strides[:-1] for a in t]) for t in tensors], positions.shape,
                              positions.strides, "q")
    per_group = len(tensors[0])
    roles = ("input", "output", "forward input") if backward else ("input", "output")
    named = [(f"{'qk'[g]} {role}", tensors[g][i], layout.token_strides[per_group * g + i],
              layout.head_strides[per_group * g + i]) for g in range(2) for i, role in enumerate(roles)]
    blockers = _vector_blockers(named, dtype, style, rotary_dim, head_dim, True)
    blockers += [f"{name} is not 16-byte aligned" for name, w in zip(("q_weight", "k_weight"), weights) if w.ptr % 16]
    if impl == "vector" and blockers:
        raise ValueError("impl: 'vector' is not possible here: " + "; ".join(blockers))
    vectorized = impl != "scalar" and not blockers
    elems = 16 // ITEMSIZE[dtype] if vectorized else (2 if style == "gptj" else 1)
    # The rotating items, then the features past rotary_dim (normalized, not rotated) in chunks or one by one.
    rot_lanes = rotating_lanes(rotary_dim, style, elems)
    copy_lanes = (head_dim - rotary_dim) // (elems if vectorized else 1)
    lanes = rot_lanes + copy_lanes
    group = min(32, next_pow2(lanes))
    if -(-lanes // group) > MAX_ITEMS[vectorized]:
        kind = "16-byte" if vectorized else "element-by-element"
        raise ValueError(f"q: head_dim {head_dim} is too large for qk_norm_rope's {kind} rows (at most "
                         f"{32 * MAX_ITEMS[vectorized]} items of a head, here {lanes})")
    n_tokens, n_q_heads, n_heads = layout.n_tokens, layout.heads[0], sum(layout.heads)
    check_token_count(n_tokens, n_heads, lanes)
    threads = choices.backward_threads_per_block if backward else choices.forward_threads_per_block
    tokens = block_tokens(n_tokens, n_heads * group, rotary_dim, n_sm, threads, rope_choices.blocks_per_sm)
    staged = 2 * head_dim * 4  # the weights, as floats
    if backward:  # each thread's weight-gradient slots, then the sums by row group and feature in the same place
        halves = 2 if style == "neox" else 1
        slots = 2 * halves * MAX_ITEMS[vectorized] * elems * BLOCK_THREADS
        staged += 4 * max(slots, BLOCK_THREADS // group * 2 * head_dim)
        tokens = max(1, min(tokens, (DEFAULT_SHARED_LIMIT - STATIC_SHARED_BYTES - staged) // (rotary_dim * 4)))
    # The forward's blocks, or the backward's token chunks (its grid is the GPU's resident blocks: cap_backward_grid).
    tokens = balanced_tokens(n_tokens, tokens, n_sm * BLOCKS_PER_SM[backward])
    shared = tokens * rotary_dim * 4 + staged
    grid = max(1, -(-n_tokens // tokens))
    strides = [(*layout.token_strides[i], layout.head_strides[i]) for i in range(len(layout.token_strides))]
    if backward:  # q in, q out, q x, k in, k out, k x
        strides, x_strides = [strides[0], strides[1], strides[3], strides[4]], (strides[2], strides[5])
    else:
        x_strides = ((0,) * 4, (0,) * 4)
    norm = NormFields(head_dim=head_dim, group_threads=group, eps=float(eps), weight_offset=float(offset),
                      x_strides=x_strides)
    # The kernels divide a block's row index by the head count (fast_div, in div_lanes); nothing else.
    tail = pack_params(layout, strides, source, divisors=(0, 0, 0, n_heads), n_tokens=n_tokens,
                       heads=(n_q_heads, n_heads),
                       lanes=(rot_lanes, copy_lanes), tokens=tokens,
                       cache_fields=cache_fields(positions, cache, 0), rotary_dim=rotary_dim, theta=theta,
                       inverse=backward, norm=norm)
    name = kernel_name(dtype, weights[0].dtype, cache.dtype if cache is not None else "float32", positions.dtype, style,
                       vectorized, cache is not None, backward)
    plan = RopePlan(name, grid, BLOCK_THREADS, shared, tail, vectorized, tokens, (rot_lanes, copy_lanes))
    plan.partial_rows = grid if backward else 0
    return plan


def balanced_tokens(n_tokens: int, target: int, resident_blocks: int) -> int:
    """Tokens a block (the forward) or a token chunk (the backward, whose resident blocks walk the chunks), from
    target / 2 to target, fitting the work to the GPU's waves of resident blocks: the fewest waves' worth of block
    time, a block's time taken as its tokens plus one (its positions, cos/sin, weights and barriers cost about one
    token's rows). Blocks all take about as long, so a last wave that fills a fraction of the GPU costs nearly a
    whole one. Measured on the H200 (Qwen3-8B, 528 resident forward blocks) against six tokens a block: 1024 tokens
    10.4 -> 8.9 µs (two a block: 0.97 waves), 2048 17.7 -> 14.3, 4096 30.0 -> 26.1, 8192 50.4 -> 48.7 (four: 3.88
    waves); larger blocks than the target gained no more (8192: eight, 49.4) and lost up to 2% at 32768 tokens, where
    six stay."""
    def cost(tokens):  # ties: the larger blocks
        blocks = -(-n_tokens // tokens)
        waves = -(-blocks // resident_blocks)
        return waves * (tokens + 1), -tokens

    return min(range(max(1, target // 2), target + 1), key=cost)


def cap_backward_grid(plan, resident_blocks: int) -> None:
    """A backward plan's grid: at most the blocks the GPU holds at once (each walks the token chunks b, b + grid,
    ...), one partial row of weight-gradient sums each."""
    plan.grid = plan.partial_rows = max(1, min(plan.grid, resident_blocks))
