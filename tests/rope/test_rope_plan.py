"""RoPE's plans (kernel, variant, grid, block, parameters) are pure functions of shapes, dtypes, strides and
alignment: checked here without a GPU."""

import numpy as np
import pytest
from helpers import PLAN_BASE as BASE
from helpers import planned_array as arr

from fakes import PLANNING_PROFILE
from cupyrope.ops.rope_plan import NORM_POINTERS, TOKEN_ROWS, _TAIL, fast_divisor, plan_rope


def plan(groups, pos, cache=None, **kw):
    opts = dict(style="neox", rotary_dim=groups[0][0].shape[-1], theta=1e4, inverse=False, impl="auto", n_sm=132,
                choices=PLANNING_PROFILE.rope, in_place=all(inp is out for inp, out in groups))
    opts.update(kw)
    return plan_rope(groups, pos, cache, **opts)


def test_llama_prefill_bf16_is_vectorized_and_shares_cos_sin():
    x, y = arr((32768, 32, 128)), arr((32768, 32, 128), ptr=BASE + 2**30)
    p = plan([(x, y)], arr((32768,), "int64"))
    assert p.vectorized
    assert "rope_kernel<__nv_bfloat16, float, long long, 0, true, false>" in p.name
    assert p.lanes == (8, 0)  # 8 lanes x 8 bf16 = one 64-pair half of a head per lane
    assert p.tokens_per_block == 2  # 2 tokens x 32 heads x 8 lanes = 512 items for 256 threads
    assert p.grid == 32768 // 2 and p.block == (256, 1)
    assert p.shared_mem == 2 * 128 * 4  # one cos/sin row per token of the block


def test_decode_takes_the_direct_kernel_one_pair_a_thread():
    q, k = arr((1, 32, 128)), arr((1, 8, 128), ptr=BASE + 4096 * 2)
    p = plan([(q, q), (k, k)], arr((1,), "int32"))
    assert p.name == "cupyrope::rope_direct_kernel<__nv_bfloat16, float, int, 0, false, false>"
    assert p.lanes == (64, 0) and p.block == (64, 1) and p.grid == 40 and p.shared_mem == 0  # 40 heads x 64
    # Forced 16-byte items: each shared by the 8 threads computing its 8 cos/sin (40 heads x 8 lanes x 8).
    vector = plan([(q, q), (k, k)], arr((1,), "int32"), impl="vector")
    assert vector.vectorized and vector.lanes == (8, 0) and vector.grid == 40 * 8 * 8 // 64
    gptj = plan([(q, q), (k, k)], arr((1,), "int32"), style="gptj", impl="vector")  # 4 pairs in 16 bytes
    assert gptj.lanes == (16, 0) and gptj.grid == 40 * 16 * 4 // 64


@pytest.mark.parametrize("tokens,direct", [(1, True), (64, True), (65, False), (32768, False)])
def test_in_kernel_cos_sin_take_the_block_kernel_past_64_tokens(tokens, direct):
    x, y = arr((tokens, 32, 128)), arr((tokens, 32, 128), ptr=BASE + 2**30)
    p = plan([(x, y)], arr((tokens,), "int64"))
    assert ("rope_direct_kernel<" in p.name) == direct and p.vectorized != direct


@pytest.mark.parametrize("tokens", [1, 64, 65, 32768])
def test_a_cos_sin_cache_takes_the_direct_kernel_at_every_size(tokens):
    x, y = arr((tokens, 32, 128)), arr((tokens, 32, 128), ptr=BASE + 2**30)
    cache = arr((32768, 128), "float32", ptr=BASE + 2**34)
    p = plan([(x, y)], arr((tokens,), "int64"), cache)
    assert p.name == "cupyrope::rope_direct_kernel<__nv_bfloat16, float, long long, 0, true, true>"
    assert p.grid == -(-tokens * 32 * 8 // 64)  # one 16-byte pair of chunks a thread
    scalar = plan([(x, y)], arr((tokens,), "int64"), cache, impl="scalar")  # one pair a thread: block past 64
    assert ("rope_direct_kernel<" in scalar.name) == (tokens <= 64) and not scalar.vectorized


def test_huge_calls_keep_the_block_kernel():  # the direct kernel's item index stays below 2^31
    x = arr((2**20, 32, 128))
    p = plan([(x, x)], arr((2**20,), "int64"), arr((32768, 128), "float32", ptr=BASE + 2**40))
    assert "rope_kernel<" in p.name and p.vectorized


def test_fast_divisor_matches_integer_division():
    rng = np.random.default_rng(0)
    divisors = list(range(1, 300)) + [2**k for k in range(31)] + [2**k + 1 for k in range(30)] + [2**31 - 1]
    divisors += rng.integers(1, 2**31, 200).tolist()
    for d in divisors:
        packed = fast_divisor(d)
        magic, shift = packed & 0xFFFFFFFF, packed >> 32
        n = np.array([0, 1, d - 1, d, d + 1, 2**31 - 1, (2**31 - 1) // d * d, (2**31 - 1) // d * d - 1]
                     + rng.integers(0, 2**31, 50).tolist(), dtype=object)
        n = n[(n >= 0) & (n < 2**31)]
        got = (((n * magic) >> 32) + n) >> shift  # kernels_src/rope.cu: fast_div, in exact integers
        assert (got == n // d).all(), d
    with pytest.raises(ValueError):
        fast_divisor(0)


def test_misaligned_pointer_falls_back_to_scalar_and_vector_request_is_refused():
    x = arr((4, 2, 64), ptr=BASE + 2)
    assert not plan([(x, x)], arr((4,), "int64")).vectorized
    with pytest.raises(ValueError, match="16-byte aligned"):
        plan([(x, x)], arr((4,), "int64"), impl="vector")


@pytest.mark.parametrize(
    "head_dim,rotary_dim,style,dtype,vec,lanes",
    [
        (128, 128, "neox", "float32", True, (16, 0)),
        (64, 64, "gptj", "float32", True, (16, 0)),
        (80, 80, "neox", "bfloat16", True, (5, 0)),
        (128, 64, "neox", "bfloat16", True, (4, 8)),  # out of place: 8 lanes copy the last 64
        (96, 40, "neox", "bfloat16", False, (20, 56)),  # 20 is not a multiple of 8: scalar
        (64, 64, "gptj", "float16", True, (8, 0)),
    ],
)
def test_lanes_per_head(head_dim, rotary_dim, style, dtype, vec, lanes):
    x, y = arr((300, 4, head_dim), dtype), arr((300, 4, head_dim), dtype, ptr=BASE + 2**20)
    p = plan([(x, y)], arr((300,), "int64"), style=style, rotary_dim=rotary_dim)
    assert p.vectorized == vec
    assert p.lanes == lanes


def test_in_place_partial_rotary_copies_nothing():
    x = arr((300, 4, 128))
    p = plan([(x, x)], arr((300,), "int64"), rotary_dim=64)
    assert p.lanes == (4, 0)  # 32 pairs = 4 lanes of 8 bf16 pairs; no copying lanes in place


def test_fused_qkv_slices_stay_vectorized():
    row = (32 + 8 + 8) * 128
    q = arr((700, 32, 128), strides=(row, 128, 1))
    k = arr((700, 8, 128), strides=(row, 128, 1), ptr=BASE + 32 * 128 * 2)
    assert plan([(q, q), (k, k)], arr((700,), "int64")).vectorized
    assert plan([(q, q), (k, k)], arr((700,), "int64"), impl="vector").vectorized


def test_cache_variant_and_alignment():
    x = arr((5, 2, 64))
    cache = arr((100, 64), "float32")
    p = plan([(x, x)], arr((5,), "int32"), cache)
    assert p.name == "cupyrope::rope_direct_kernel<__nv_bfloat16, float, int, 0, true, true>"
    # The direct kernel reads an item's cos/sin as packs: a cache whose pointer or row stride is not aligned
    # to one goes to the block kernel, which reads any cache element by element, still with 16-byte items.
    for odd_cache in (arr((100, 64), "float32", ptr=BASE + 4), arr((100, 64), "float32", strides=(66, 1))):
        odd = plan([(x, x)], arr((5,), "int32"), odd_cache)
        assert odd.vectorized and odd.name.startswith("cupyrope::rope_kernel<")
    # The pack is F frequencies of the cache's dtype: 4 bf16 (8 bytes) for GPT-J's 16-byte bf16 items.
    gptj_cache = arr((100, 64), "bfloat16", ptr=BASE + 8, strides=(68, 1))
    assert "rope_direct_kernel<" in plan([(x, x)], arr((5,), "int32"), gptj_cache, style="gptj").name
    assert "rope_kernel<" in plan([(x, x)], arr((5,), "int32"), gptj_cache).name  # NeoX: 16-byte packs


def test_transformers_cos_sin_rows_are_read_where_they_lie():
    """rope_qk_cos_sin's plan for transformers' call: q (B, H, S, D), cos (B, 1, S, D) in fp32 with each
    frequency at its column (freq_stride 1): the direct kernel reading each token's own row, with cos's
    token strides in place of positions' and no cache bounds."""
    import struct

    q, k = arr((2, 32, 2048, 128)), arr((2, 8, 2048, 128), ptr=BASE + 2**32)
    rows = arr((2, 1, 2048), TOKEN_ROWS, strides=(2048 * 128, 2048 * 128, 128), ptr=BASE + 2**34)
    cos = arr((2, 1, 2048, 128), "float32", ptr=BASE + 2**34)
    p = plan([(q, q), (k, k)], rows, cos, freq_stride=2)
    assert p.name == "cupyrope::rope_direct_kernel<__nv_bfloat16, float, cupyrope::TokenRows, 0, true, true>"
    tail = struct.unpack(_TAIL.format, p.tail[len(NORM_POINTERS):])
    assert tail[0] == 2 * 2048  # tokens: (B, S); the heads of q and k share each token's row
    assert tail[3:6] == (0, 2048 * 128, 128)  # cos's token strides (B merged away: padded to 3)
    assert tail[6] == 0  # positions: one a token (here cos/sin rows)
    assert tail[42:44] == (2, 0)  # freq_stride; frequencies 2 apart: not read as packs


def test_transformers_cos_sin_rows_are_read_as_packs_where_contiguous_and_aligned():
    """An item's 8 bf16 cos (and sin) are one 16-byte pack where frequencies are contiguous and cos, sin and every
    token's row are 16-byte aligned (RopeParams::rows_in_packs); any of them off: one by one."""
    import struct

    q, k = arr((64, 32, 1, 64)), arr((64, 8, 1, 64), ptr=BASE + 2**32)  # decode: 64 sequences, bf16 cos/sin

    def rows_in_packs(cos_ptr=BASE + 2**34, sin_ptr=BASE + 2**35, row=64, freq_stride=1):
        rows = arr((64, 1, 1), TOKEN_ROWS, strides=(row, row, row), ptr=cos_ptr)
        cos, sin = arr((64, 1, 1, 64), ptr=cos_ptr), arr((64, 1, 1, 64), ptr=sin_ptr)
        p = plan([(q, arr(q.shape, ptr=BASE + 2**36)), (k, arr(k.shape, ptr=BASE + 2**37))], rows, cos,
                 freq_stride=freq_stride, sin=sin)
        assert "rope_direct_kernel<__nv_bfloat16, __nv_bfloat16, cupyrope::TokenRows, 0, true, true>" in p.name
        tail = struct.unpack(_TAIL.format, p.tail[len(NORM_POINTERS):])
        assert tail[42] == freq_stride
        return tail[43]

    assert rows_in_packs() == 1
    assert rows_in_packs(cos_ptr=BASE + 2**34 + 2) == 0
    assert rows_in_packs(sin_ptr=BASE + 2**35 + 8) == 0
    assert rows_in_packs(row=68) == 0  # every 2nd row 8 bytes off
    assert rows_in_packs(freq_stride=2) == 0
