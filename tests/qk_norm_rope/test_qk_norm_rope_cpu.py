"""QK-norm + RoPE, M-RoPE and varlen without a GPU: the float64 references against the models' own formulas
(transformers' Qwen2-VL and Qwen3-VL M-RoPE, Qwen3's QK-norm), the plans, and the torch layer's CPU path."""

import dataclasses

import numpy as np
import pytest
from helpers import PLAN_BASE as BASE
from helpers import planned_array as arr

from cupyrope import reference
from cupyrope.ops.qk_norm_rope_plan import balanced_tokens, cap_backward_grid, plan_qk_norm_rope
from cupyrope.ops.rope_plan import _TAIL, PositionSource
from fakes import PLANNING_PROFILE


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def hf_mrope(x, positions, section, interleaved, theta=10000.0):
    """transformers' M-RoPE on x (T, H, D): Qwen2-VL's apply_multimodal_rotary_pos_emb (the sections of
    cat(freqs, freqs) taken from rows t, h, w in turn), or Qwen3-VL's apply_interleaved_mrope."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    freqs = positions[..., None].astype(np.float64) * inv  # (3, T, D/2)
    if interleaved:
        f = freqs[0].copy()
        for row, offset in ((1, 1), (2, 2)):
            f[..., offset:section[row] * 3:3] = freqs[row, ..., offset:section[row] * 3:3]
        emb = np.concatenate([f, f], -1)
        cos, sin = np.cos(emb), np.sin(emb)
    else:
        emb = np.concatenate([freqs, freqs], -1)  # (3, T, D)
        bounds = np.cumsum(list(section) * 2)[:-1]
        pick = lambda t: np.concatenate([m[i % 3] for i, m in enumerate(np.split(t, bounds, -1))], -1)  # noqa: E731
        cos, sin = pick(np.cos(emb)), pick(np.sin(emb))
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@pytest.mark.parametrize("section,interleaved", [([16, 24, 24], False), ([24, 20, 20], True), ([64, 0, 0], False)])
def test_mrope_reference_is_transformers_formula(rng, section, interleaved):
    x = rng.standard_normal((9, 3, 128))
    positions = rng.integers(0, 5000, (3, 9))
    ours = reference.rope(x, positions, mrope_section=section, mrope_interleaved=interleaved)
    np.testing.assert_allclose(ours, hf_mrope(x, positions, section, interleaved), atol=1e-9)


def test_mrope_with_equal_rows_is_plain_rope(rng):
    x = rng.standard_normal((7, 2, 64))
    p = rng.integers(0, 1000, 7)
    np.testing.assert_allclose(reference.rope(x, np.stack([p, p, p]), mrope_section=[8, 12, 12]),
                               reference.rope(x, p), atol=1e-12)


def test_varlen_positions_restart_each_sequence_and_add_offsets():
    cu = np.array([0, 3, 3, 7], np.int32)
    np.testing.assert_array_equal(reference.varlen_positions(cu, 7), [0, 1, 2, 0, 1, 2, 3])
    np.testing.assert_array_equal(reference.varlen_positions(cu, 7, np.array([10, 20, 30])), [10, 11, 12, 30, 31, 32, 33])
    gaps = reference.varlen_positions(np.array([2, 4], np.int32), 6)  # tokens outside every sequence: NaN
    assert np.isnan(gaps[[0, 1, 4, 5]]).all() and list(gaps[2:4]) == [0, 1]


def test_qk_norm_rope_reference_is_qwen3s_attention_prep(rng):
    """Qwen3: q_norm (RMSNorm over head_dim) then apply_rotary_pos_emb, in float64."""
    q, k = rng.standard_normal((5, 4, 64)), rng.standard_normal((5, 2, 64))
    qw, kw = rng.standard_normal(64), rng.standard_normal(64)
    pos = rng.integers(0, 100, 5)
    inv = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    emb = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None]

    def expected(x, w):
        normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w
        return normed * np.cos(emb) + rotate_half(normed) * np.sin(emb)

    ours = reference.qk_norm_rope(q, k, qw, kw, pos)
    np.testing.assert_allclose(ours[0], expected(q, qw), atol=1e-12)
    np.testing.assert_allclose(ours[1], expected(k, kw), atol=1e-12)


def test_qk_norm_rope_backward_reference_is_autograd(rng):
    torch = pytest.importorskip("torch")
    q, k = rng.standard_normal((5, 4, 64)), rng.standard_normal((5, 2, 64))
    qw, kw = rng.standard_normal(64), rng.standard_normal(64)
    dq, dk = rng.standard_normal(q.shape), rng.standard_normal(k.shape)
    pos = rng.integers(0, 100, 5)
    cos, sin = (torch.from_numpy(t) for t in reference._cos_sin(
        np.broadcast_to(pos[:, None, None].astype(float), (5, 1, 32)), 64, 10000.0, None))
    tensors = [torch.from_numpy(t).requires_grad_() for t in (q, k, qw, kw)]
    outputs = []
    for x, w in ((tensors[0], tensors[2]), (tensors[1], tensors[3])):
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (w + 0.5)
        x1, x2 = n[..., :32], n[..., 32:]
        outputs.append(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1))
    torch.autograd.backward(outputs, [torch.from_numpy(dq), torch.from_numpy(dk)])
    ours = reference.qk_norm_rope_backward(dq, dk, q, k, qw, kw, pos, offset=0.5)
    for got, t in zip(ours, tensors):
        np.testing.assert_allclose(got, t.grad.numpy(), atol=1e-10)


# RopeParams' fields after its pointers (kernels_src/rope_common.cuh), by name: arrays as name0, name1, ...
FIELD_NAMES = (["n_tokens", "n1", "n2", "pos_s0", "pos_s1", "pos_s2", "pos_mode", "mrope_stride", "section0", "section1",
                "section2", "interleaved", "n_seqs", "offsets_64", "div0", "div1", "div2", "div_heads"]
               + [f"stride{i}" for i in range(24)] + ["cache_stride", "max_position", "n_q_heads", "n_heads",
                                                      "tokens_per_block", "rot_dim", "rot_lanes", "copy_lanes",
                                                      "log_step", "inverse", "head_dim", "group_threads", "eps",
                                                      "weight_offset"])


def fields(p) -> dict:
    import struct

    assert len(FIELD_NAMES) == len(struct.unpack(_TAIL.format, bytes(_TAIL.size)))
    return dict(zip(FIELD_NAMES, struct.unpack(_TAIL.format, p.tail)))


def qwen3_views(tokens, dtype="bfloat16"):
    width = 48 * 128
    q = arr((tokens, 32, 128), dtype, strides=(width, 128, 1))
    k = arr((tokens, 8, 128), dtype, strides=(width, 128, 1), ptr=BASE + 32 * 128 * 2)
    return q, k


def plan(groups, weights, positions, **kw):
    options = dict(style="neox", rotary_dim=128, theta=1e4, eps=1e-6, offset=0.0, impl="auto", n_sm=132,
                   choices=PLANNING_PROFILE.qk_norm_rope, rope_choices=PLANNING_PROFILE.rope)
    options.update(kw)
    return plan_qk_norm_rope(groups, weights, positions, options.pop("cache", None), **options)


def test_qwen3_fused_qkv_plans_16_byte_rows_of_8_threads():
    q, k = qwen3_views(32768)
    weights = (arr((128,), ptr=BASE + 2**36), arr((128,), ptr=BASE + 2**37))
    p = plan([(q, q), (k, k)], weights, arr((32768,), "int64", ptr=BASE + 2**38))
    assert p.name == "cupyrope::qk_norm_rope_kernel<__nv_bfloat16, __nv_bfloat16, float, long long, 0, true, false>"
    assert p.lanes == (8, 0) and p.block == (256, 1)
    assert p.tokens_per_block == 1024 // (40 * 8)  # the (test) profile's threads a block, over 40 heads of 8 threads
    assert p.shared_mem == p.tokens_per_block * 128 * 4 + 2 * 128 * 4  # cos/sin rows, then both weights as floats
    f = fields(p)
    assert (f["n_tokens"], f["head_dim"], f["group_threads"], f["inverse"]) == (32768, 128, 8, 0)
    assert f["eps"] == pytest.approx(1e-6) and f["div_heads"] != 0  # rows split into (token, head) by fast_div


def test_partial_rotary_and_gptj_and_misaligned_weights():
    q, k = qwen3_views(100)
    weights = (arr((128,), ptr=BASE + 2**36), arr((128,), ptr=BASE + 2**37))
    partial = plan([(q, q), (k, k)], weights, arr((100,), "int64"), rotary_dim=64)
    assert partial.lanes == (4, 8)  # 4 rotating pairs of chunks, 8 chunks normalized past rotary_dim
    gptj = plan([(q, q), (k, k)], weights, arr((100,), "int64"), style="gptj")
    assert gptj.lanes == (16, 0)
    odd = plan([(q, q), (k, k)], (arr((128,), ptr=BASE + 2), weights[1]), arr((100,), "int64"))
    assert not odd.vectorized and odd.lanes == (64, 0)  # a weight off 16 bytes: element by element
    with pytest.raises(ValueError, match="impl: 'vector' is not possible here: q_weight is not 16-byte aligned"):
        plan([(q, q), (k, k)], (arr((128,), ptr=BASE + 2), weights[1]), arr((100,), "int64"), impl="vector")


def test_head_dim_past_the_registers_is_refused():
    q, k = arr((4, 2, 1024), "float32"), arr((4, 2, 1024), "float32", ptr=BASE + 2**30)
    weights = (arr((1024,), "float32", ptr=BASE + 2**36), arr((1024,), "float32", ptr=BASE + 2**37))
    with pytest.raises(ValueError, match="q: head_dim 1024 is too large for qk_norm_rope"):
        plan([(q, q), (k, k)], weights, arr((4,), "int64"), rotary_dim=1024)


def test_backward_grid_is_one_wave_and_sums_fit():
    q, k = qwen3_views(32768)
    dq, dk = arr((32768, 32, 128), ptr=BASE + 2**40), arr((32768, 8, 128), ptr=BASE + 2**41)
    weights = (arr((128,), ptr=BASE + 2**36), arr((128,), ptr=BASE + 2**37))
    p = plan([(dq, dq), (dk, dk)], weights, arr((32768,), "int64"), x_inputs=(q, k))
    assert p.grid == -(-32768 // p.tokens_per_block)  # one block a token chunk, until fitted to the GPU
    cap_backward_grid(p, 396)
    assert "qk_norm_rope_bwd_kernel<" in p.name and p.grid == 396 and p.partial_rows == 396
    assert p.shared_mem <= 48 * 1024 - 8 * 1024
    f = fields(p)
    assert f["inverse"] == 1  # the cos/sin table holds -sin: the inverse rotation of dy
    assert f["stride18"] == f["stride22"] == 48 * 128  # q's and k's token strides (the forward's inputs)


def test_position_sources_pack_their_fields():
    q, k = qwen3_views(64)
    weights = (arr((128,), ptr=BASE + 2**36), arr((128,), ptr=BASE + 2**37))
    source = PositionSource("mrope", mrope_stride=64, sections=(16, 24, 24), interleaved=True)
    p = plan([(q, q), (k, k)], weights, arr((64,), "int64"), source=source)
    f = fields(p)
    assert [f[name] for name in ("pos_mode", "mrope_stride", "section0", "section1", "section2", "interleaved")] == \
        [1, 64, 16, 24, 24, 1]
    varlen = plan([(q, q), (k, k)], weights, arr((64,), "int32"), source=PositionSource("varlen", n_seqs=5,
                                                                                        offsets_64=True))
    assert [fields(varlen)[name] for name in ("pos_mode", "n_seqs", "offsets_64")] == [2, 5, 1]


@pytest.mark.parametrize("case", ["plain", "mrope", "varlen", "cache"])
def test_torch_cpu_path_matches_the_reference_and_its_gradients(rng, case):
    torch = pytest.importorskip("torch")
    ct = pytest.importorskip("cupyrope.torch")
    q, k = torch.randn(11, 4, 64), torch.randn(11, 2, 64)
    qw, kw = 1 + 0.3 * torch.randn(64), 1 + 0.3 * torch.randn(64)
    kwargs, positions, ref_kwargs = {}, None, {}
    if case == "mrope":
        positions = torch.randint(0, 500, (3, 11))
        kwargs = ref_kwargs = {"mrope_section": [8, 12, 12], "mrope_interleaved": True}
    elif case == "varlen":
        kwargs = {"cu_seqlens": torch.tensor([0, 4, 11], dtype=torch.int32), "seqlen_offsets": torch.tensor([5, 0])}
        ref_kwargs = {key: value.numpy() for key, value in kwargs.items()}
    else:
        positions = torch.randint(0, 500, (11,))
    if case == "cache":
        table = reference.rope_cache(500, 64)
        kwargs["cos_sin_cache"], ref_kwargs["cos_sin_cache"] = torch.from_numpy(table).float(), table
    out = ct.qk_norm_rope(q, k, qw, kw, positions, **kwargs)
    ref = reference.qk_norm_rope(q.numpy(), k.numpy(), qw.numpy(), kw.numpy(),
                                 None if positions is None else positions.numpy(), **ref_kwargs)
    for got, expected in zip(out, ref):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)
    leaves = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    out = ct.qk_norm_rope(*leaves, positions, **kwargs)
    dq, dk = torch.randn_like(out[0]), torch.randn_like(out[1])
    torch.autograd.backward(out, (dq, dk))
    ref_grads = reference.qk_norm_rope_backward(dq.numpy(), dk.numpy(), q.numpy(), k.numpy(), qw.numpy(), kw.numpy(),
                                                None if positions is None else positions.numpy(), **ref_kwargs)
    for leaf, expected in zip(leaves, ref_grads):
        np.testing.assert_allclose(leaf.grad.numpy(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens,per_block", [(1, 1), (1024, 2), (2048, 4), (4096, 4), (8192, 4), (32768, 6)])
def test_forward_blocks_fill_whole_waves(tokens, per_block):
    """Six tokens a block (the H200 profile's 2048 threads over 40 heads of 8) shrink to as few as three where that
    leaves no last wave that fills only part of the GPU (132 SMs, 4 forward blocks each)."""
    q, k = qwen3_views(tokens)
    weights = (arr((128,), ptr=BASE + 2**36), arr((128,), ptr=BASE + 2**37))
    choices = dataclasses.replace(PLANNING_PROFILE.qk_norm_rope, forward_threads_per_block=2048)
    p = plan([(q, q), (k, k)], weights, arr((tokens,), "int64", ptr=BASE + 2**38), choices=choices)
    assert p.tokens_per_block == per_block and p.grid == -(-tokens // per_block)

    def last_wave(grid):  # the share of the GPU's resident blocks its last wave fills
        return grid / (132 * 4) % 1 or 1.0

    assert last_wave(p.grid) >= last_wave(-(-tokens // 6))


def test_balanced_tokens_never_leave_the_targets_half():
    for tokens in (1, 3, 527, 528, 529, 5000, 10**6):
        for target in (1, 2, 5, 6, 64):
            assert target // 2 <= balanced_tokens(tokens, target, 528) <= target


def test_backward_chunks_fill_whole_waves_of_its_grid():
    """4096 threads a chunk (the H200 profile's) is 12 tokens: 683 chunks of 8192 tokens for 396 resident blocks
    (132 SMs, 3 each) leave the second round of chunks 72% full; 11 tokens a chunk, 745 chunks: 88%."""
    q, k = qwen3_views(8192)
    dq, dk = arr((8192, 32, 128), ptr=BASE + 2**40), arr((8192, 8, 128), ptr=BASE + 2**41)
    weights = (arr((128,), ptr=BASE + 2**36), arr((128,), ptr=BASE + 2**37))
    choices = dataclasses.replace(PLANNING_PROFILE.qk_norm_rope, backward_threads_per_block=4096)
    p = plan([(dq, dq), (dk, dk)], weights, arr((8192,), "int64"), x_inputs=(q, k), choices=choices)
    assert p.tokens_per_block == 11 and p.grid == 745
