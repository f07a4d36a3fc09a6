"""cupyrope.dropin: transformers' / Liger's apply_rotary_pos_emb and vLLM's / FlashInfer's in-place
rotary_embedding. The CPU tests (CI) run the same glue as the GPU (the cos/sin
table and the positions it builds), through cupyrope.torch's CPU formulas; the GPU tests run the kernels."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dropin = pytest.importorskip("cupyrope.dropin")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cupyrope import reference  # noqa: E402
from helpers import assert_close, requires_torch_cuda, rotate_half  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def rotate_every_two(x):  # transformers (Cohere, GLM)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def hf_apply(q, k, cos, sin, unsqueeze_dim=1, style="neox", cos_layout="halves"):
    """transformers' apply_rotary_pos_emb in float64: Llama's (neox, halves), Cohere's (gptj,
    interleaved) and GLM's (gptj, halves: the first half repeated pairwise); the features past cos's
    last dimension pass through (Phi-3, GLM)."""
    cos, sin = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    if style == "gptj" and cos_layout == "halves":
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
    rotate = rotate_half if style == "neox" else rotate_every_two
    r = cos.shape[-1]
    out = []
    for x in (q.double(), k.double()):
        out.append(torch.cat((x[..., :r] * cos + rotate(x[..., :r]) * sin, x[..., r:]), -1))
    return out


def random_cos_sin(lead, rotary_dim, cos_layout, g, dtype=torch.float32):
    """HF-style cos/sin of random angles (any per-token angles, not only theta's), each frequency twice."""
    angles = torch.rand(*lead, rotary_dim // 2, generator=g, dtype=torch.float64) * 2000 - 1000
    if cos_layout == "halves":
        emb = torch.cat((angles, angles), -1)
    else:
        emb = angles.repeat_interleave(2, -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def assert_like_transformers(q, k, cos, sin, unsqueeze_dim, style, cos_layout):
    """apply_rotary_pos_emb's (q, k) against hf_apply's, in q's dtype and on q's device."""
    got = dropin.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, style=style, cos_layout=cos_layout)
    for g, e, x in zip(got, hf_apply(q, k, cos, sin, unsqueeze_dim, style, cos_layout), (q, k)):
        assert g.dtype == q.dtype and g.device == q.device
        assert g.stride() == torch.empty_like(x).stride(), "not laid out in the input's memory order"
        assert_close(g, e, str(q.dtype).removeprefix("torch."))


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**31)))


# ------------------------------------------------------------------------------------- CPU (runs in CI)

LAYOUT_CASES = [
    # (q shape, k heads, cos leading shape, unsqueeze_dim, rotary_dim)
    ((2, 4, 5, 32), 2, (2, 5), 1, 32),  # transformers: q (B, H, S, D), cos (B, S, D)
    ((2, 5, 4, 32), 2, (2, 5), 2, 32),  # q (B, S, H, D)
    ((3, 4, 7, 64), 1, (1, 7), 1, 64),  # cos shared by the batch
    ((2, 4, 5, 48), 2, (2, 5), 1, 16),  # partial rotary (Phi-3, GLM)
    ((1, 2, 1, 16), 2, (1, 1), 1, 16),  # decode
    ((2, 4, 5, 32), 2, (2, 5), -3, 32),  # negative unsqueeze_dim, as torch.unsqueeze takes it
]


def case_id(case):
    return "x".join(map(str, case[0])) + f"-u{case[3]}-r{case[4]}"


def case_tensors(case, cos_layout, gen, device="cpu", dtype=torch.float32):
    """q, k, cos, sin of a LAYOUT_CASES entry (k with its own head count on q's head axis)."""
    q_shape, k_heads, lead, unsqueeze_dim, rotary_dim = case
    k_shape = list(q_shape)
    k_shape[1 if unsqueeze_dim % 4 == 1 else 2] = k_heads
    q, k = torch.randn(q_shape, generator=gen), torch.randn(k_shape, generator=gen)
    return tuple(t.to(device, dtype) for t in (q, k, *random_cos_sin(lead, rotary_dim, cos_layout, gen)))


@pytest.mark.parametrize("style,cos_layout", [("neox", "halves"), ("gptj", "interleaved"), ("gptj", "halves")])
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=case_id)
def test_apply_rotary_pos_emb_matches_transformers_formula(case, style, cos_layout, gen):
    assert_like_transformers(*case_tensors(case, cos_layout, gen), case[3], style, cos_layout)


def test_apply_rotary_pos_emb_keeps_transformers_q_layout(gen):
    """q and k as transformers has them, (B, H, S, D) views of (B, S, H, D) memory: results in that memory order,
    and the op's fake results (torch.compile) strided alike."""
    from torch.library import opcheck

    q = torch.randn(2, 9, 4, 32, generator=gen).transpose(1, 2)
    k = torch.randn(2, 9, 2, 32, generator=gen).transpose(1, 2)
    cos, sin = random_cos_sin((2, 9), 32, "halves", gen)
    assert_like_transformers(q, k, cos, sin, 1, "neox", "halves")
    q_embed, _ = dropin.apply_rotary_pos_emb(q, k, cos, sin)
    assert q_embed.stride() == q.stride()
    view = (cos.unsqueeze(1), sin.unsqueeze(1))
    opcheck(torch.ops.cupyrope.rope_qk_cos_sin.default, (q.requires_grad_(), k, *view, 32, 1, "neox", False))


def _random_call(data):
    """A random transformers-style call: shapes, GQA, broadcast batch, partial rotary, both call forms,
    rotation style and cos layout; fp32 CPU tensors from a seed hypothesis draws."""
    batch, seq, heads, kv_heads = (data.draw(st.integers(1, n)) for n in (3, 9, 6, 3))
    rotary_dim = 2 * data.draw(st.integers(1, 24))
    head_dim = rotary_dim + 2 * data.draw(st.integers(0, 8))
    unsqueeze_dim = data.draw(st.sampled_from([1, 2, -3, -2]))
    cos_batch = data.draw(st.sampled_from([1, batch]))
    style, cos_layout = data.draw(st.sampled_from([("neox", "halves"), ("gptj", "interleaved"), ("gptj", "halves")]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    shape = (lambda h: (batch, h, seq, head_dim)) if unsqueeze_dim % 4 == 1 else (lambda h: (batch, seq, h, head_dim))
    q, k = torch.randn(shape(heads), generator=g), torch.randn(shape(kv_heads), generator=g)
    cos, sin = random_cos_sin((cos_batch, seq), rotary_dim, cos_layout, g)
    return q, k, cos, sin, dict(unsqueeze_dim=unsqueeze_dim), dict(style=style, cos_layout=cos_layout)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_apply_rotary_pos_emb_fuzzed_against_transformers_formula(data):
    q, k, cos, sin, call, ours = _random_call(data)
    assert_like_transformers(q, k, cos, sin, call["unsqueeze_dim"], ours["style"], ours["cos_layout"])


def test_apply_rotary_pos_emb_old_transformers_position_ids(gen):
    """transformers < 4.38: cos (max_position, dim) gathered by position_ids inside the function."""
    q, k = torch.randn(2, 4, 6, 32, generator=gen), torch.randn(2, 2, 6, 32, generator=gen)
    cos, sin = random_cos_sin((50,), 32, "halves", gen)
    position_ids = torch.randint(0, 50, (2, 6), generator=gen)
    got = dropin.apply_rotary_pos_emb(q, k, cos, sin, position_ids)
    expected = hf_apply(q, k, cos[position_ids], sin[position_ids])
    for g, e in zip(got, expected):
        assert_close(g, e, "float32")


def test_apply_rotary_pos_emb_gradient_is_transformers_gradient(gen):
    q, k = torch.randn(2, 4, 5, 32, generator=gen), torch.randn(2, 2, 5, 32, generator=gen)
    cos, sin = random_cos_sin((2, 5), 32, "halves", gen)
    weights = [torch.randn(t.shape, generator=gen) for t in (q, k)]
    grads = []
    for fn in (dropin.apply_rotary_pos_emb, hf_apply):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        sum((w * out).sum() for w, out in zip(weights, fn(qq, kk, cos, sin))).backward()
        grads.append((qq.grad, kk.grad))
    for g, e in zip(*grads):
        assert_close(g, e, "float32")


def assert_one_tensor_like_transformers(x, cos, sin, unsqueeze_dim, style, cos_layout):
    """apply_rotary_pos_emb_one_tensor's x against hf_apply's, in x's dtype, on x's device, in x's memory order."""
    got = dropin.apply_rotary_pos_emb_one_tensor(x, cos, sin, unsqueeze_dim, style=style, cos_layout=cos_layout)
    assert got.dtype == x.dtype and got.device == x.device
    assert got.stride() == torch.empty_like(x).stride(), "not laid out in the input's memory order"
    assert_close(got, hf_apply(x, x, cos, sin, unsqueeze_dim, style, cos_layout)[0], str(x.dtype).removeprefix("torch."))


@pytest.mark.parametrize("style,cos_layout", [("neox", "halves"), ("gptj", "interleaved"), ("gptj", "halves")])
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=case_id)
def test_one_tensor_apply_rotary_pos_emb_matches_transformers_formula(case, style, cos_layout, gen):
    """Gemma 3n's and Gemma 4's apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim): q and k each on its own."""
    q, k, cos, sin = case_tensors(case, cos_layout, gen)
    for x in (q, k):
        assert_one_tensor_like_transformers(x, cos, sin, case[3], style, cos_layout)


def test_one_tensor_apply_rotary_pos_emb_keeps_layout_and_gradient(gen):
    """Gemma's call: x (B, S, H, D) as a transposed view, unsqueeze_dim=2; the result keeps x's memory order, x's
    gradient is transformers', and the op's fake result (torch.compile) is strided alike."""
    from torch.library import opcheck

    x = torch.randn(2, 4, 9, 32, generator=gen).transpose(1, 2)
    cos, sin = random_cos_sin((2, 9), 32, "halves", gen)
    assert_one_tensor_like_transformers(x, cos, sin, 2, "neox", "halves")
    weight = torch.randn(x.shape, generator=gen)
    grads = []
    for fn in (lambda t: dropin.apply_rotary_pos_emb_one_tensor(t, cos, sin, 2),
               lambda t: hf_apply(t, t, cos, sin, 2)[0]):
        xx = x.clone().requires_grad_()
        (weight * fn(xx)).sum().backward()
        grads.append(xx.grad)
    assert_close(*grads, "float32")
    opcheck(torch.ops.cupyrope.rope_cos_sin.default, (x.requires_grad_(), cos.unsqueeze(2), sin.unsqueeze(2), 32, 1,
                                                        "neox", False))


def test_rotary_embedding_is_vllm_in_place(gen):
    """vLLM's ops.rotary_embedding: query (tokens, heads * head_size), key (tokens, kv_heads * head_size),
    here column slices of one fused qkv tensor, rotated in place; the cache in vLLM's layout."""
    tokens, heads, kv_heads, head_size, rotary_dim = 9, 4, 2, 64, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen)
    query, key = qkv[:, : heads * head_size], qkv[:, heads * head_size: (heads + kv_heads) * head_size]
    before = qkv.clone()
    cache = torch.from_numpy(reference.rope_cache(100, rotary_dim, 10000.0)).float()
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    for is_neox in (True, False):
        qkv.copy_(before)
        assert dropin.rotary_embedding(positions, query, key, head_size, cache, is_neox) is None
        style = "neox" if is_neox else "gptj"
        for got, x in ((query, before[:, : heads * head_size]), (key, before[:, heads * head_size: (heads + kv_heads) * head_size])):
            x = x.reshape(tokens, -1, head_size).double().numpy()
            expected = reference.rope(x, positions.numpy(), style=style, rotary_dim=rotary_dim, cos_sin_cache=cache.double().numpy())
            assert_close(got.reshape(tokens, -1, head_size), torch.from_numpy(expected), "float32")
        assert torch.equal(qkv[:, (heads + kv_heads) * head_size:], before[:, (heads + kv_heads) * head_size:])  # v untouched


def test_rotary_embedding_batched_positions_and_no_key(gen):
    """(batch, seq) positions with query (batch, seq, heads * head_size); key=None rotates query alone."""
    query = torch.randn(2, 3, 4 * 32, generator=gen)
    x = query.clone()
    cache = torch.from_numpy(reference.rope_cache(10, 32, 500000.0)).float()
    positions = torch.randint(0, 10, (2, 3), generator=gen)
    dropin.rotary_embedding(positions, query, None, 32, cache)
    expected = reference.rope(x.reshape(2, 3, 4, 32).double().numpy(), positions.numpy(), cos_sin_cache=cache.double().numpy())
    assert_close(query.reshape(2, 3, 4, 32), torch.from_numpy(expected), "float32")


def _qkcs(gen, d=32, r=32):
    q, k = torch.randn(2, 4, 5, d, generator=gen), torch.randn(2, 2, 5, d, generator=gen)
    return (q, k, *random_cos_sin((2, 5), r, "halves", gen))


BAD_APPLY = [
    (lambda q, k, c, s: (q, k, c, s[..., :16]), {}, ValueError, "sin: expected the shape"),
    (lambda q, k, c, s: (q, k, c, s.double()), {}, ValueError, "sin: expected the shape, dtype"),
    (lambda q, k, c, s: (q, k, c[..., :15], s[..., :15]), {}, ValueError, "cos: expected a last dimension"),
    (lambda q, k, c, s: (q[..., :16], k[..., :16], c, s), {}, ValueError, "at most q's head_dim 16"),
    (lambda q, k, c, s: (q, k, c.numpy(), s), {}, TypeError, "cos: expected a torch.Tensor"),
    (lambda q, k, c, s: (q, k, c.to("meta"), s.to("meta")), {}, ValueError, "cos: expected a tensor on q's device"),
    (lambda q, k, c, s: (q, k, c, s), {"unsqueeze_dim": 3}, ValueError, "unsqueeze_dim: expected a dimension of cos"),
    (lambda q, k, c, s: (q, k, c, s), {"unsqueeze_dim": 2}, ValueError, "does not broadcast to q's"),
    (lambda q, k, c, s: (q, k[:, :, :4], c, s), {}, ValueError, "does not broadcast to k's"),
    (lambda q, k, c, s: (q[0], k[0], c, s), {}, ValueError, "more leading dimensions than q"),
    (lambda q, k, c, s: (q, k, c, s), {"cos_layout": "pairs"}, ValueError, "cos_layout: expected one of"),
    (lambda q, k, c, s: (q, k, c.requires_grad_(), s), {}, ValueError, "gradients with respect to cos"),
]


@pytest.mark.parametrize("make,options,error,message", BAD_APPLY, ids=[b[3][:30] for b in BAD_APPLY])
def test_apply_rotary_pos_emb_rejects_bad_input(make, options, error, message, gen):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        dropin.apply_rotary_pos_emb(*make(*_qkcs(gen)), **options)


BAD_ONE_TENSOR = [
    (lambda x, c, s: (x, c, s[..., :16]), {}, ValueError, "sin: expected the shape"),
    (lambda x, c, s: (x[..., :16], c, s), {}, ValueError, "at most x's head_dim 16"),
    (lambda x, c, s: (x.numpy(), c, s), {}, TypeError, "x: expected a torch.Tensor"),
    (lambda x, c, s: (x, c.to("meta"), s.to("meta")), {}, ValueError, "cos: expected a tensor on x's device"),
    (lambda x, c, s: (x, c, s), {"unsqueeze_dim": 2}, ValueError, "does not broadcast to x's"),
    (lambda x, c, s: (x[0], c, s), {}, ValueError, "more leading dimensions than x"),
    (lambda x, c, s: (x, c, s), {"style": "rotate"}, ValueError, "style"),
]


@pytest.mark.parametrize("make,options,error,message", BAD_ONE_TENSOR, ids=[b[3][:30] for b in BAD_ONE_TENSOR])
def test_one_tensor_apply_rotary_pos_emb_rejects_bad_input(make, options, error, message, gen):
    q, _, cos, sin = _qkcs(gen)
    before = q.clone()
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        dropin.apply_rotary_pos_emb_one_tensor(*make(q, cos, sin), **options)
    assert torch.equal(q, before)


def test_rotary_embedding_rejects_bad_input(gen):
    cache = torch.from_numpy(reference.rope_cache(10, 32, 10000.0)).float()
    positions = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="query: expected shape"):
        dropin.rotary_embedding(positions, torch.randn(3, 100), None, 32, cache)
    with pytest.raises(ValueError, match="key: expected shape"):
        dropin.rotary_embedding(positions, torch.randn(3, 64), torch.randn(4, 64), 32, cache)
    with pytest.raises(ValueError, match="query: expected a contiguous last dimension"):
        dropin.rotary_embedding(positions, torch.randn(64, 3).t(), None, 32, cache)
    with pytest.raises(ValueError, match="query: its strides"):  # heads of 32 cannot be read as heads of 64
        dropin.rotary_embedding(positions, torch.randn(3, 4, 64)[:, :, :32], None, 64, cache)
    with pytest.raises(TypeError, match="positions: expected a torch.Tensor"):
        dropin.rotary_embedding([0, 0, 0], torch.randn(3, 64), None, 32, cache)
    with pytest.raises(TypeError, match="key: expected a torch.Tensor"):
        dropin.rotary_embedding(positions, torch.randn(3, 64), np.zeros((3, 64)), 32, cache)


def test_drop_ins_trace_without_graph_breaks(gen):
    q, k = torch.randn(2, 4, 5, 32, generator=gen), torch.randn(2, 2, 5, 32, generator=gen)
    cos, sin = random_cos_sin((2, 5), 32, "halves", gen)
    compiled = torch.compile(dropin.apply_rotary_pos_emb, fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(q, k, cos, sin), dropin.apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(got, expected)
    one = torch.compile(dropin.apply_rotary_pos_emb_one_tensor, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(one(q, cos, sin), dropin.apply_rotary_pos_emb_one_tensor(q, cos, sin))
    cache = torch.from_numpy(reference.rope_cache(10, 32, 10000.0)).float()
    query, key, positions = torch.randn(3, 128, generator=gen), torch.randn(3, 64, generator=gen), torch.tensor([1, 2, 9])
    inplace = torch.compile(dropin.rotary_embedding, fullgraph=True, backend="aot_eager")
    for k_or_none in (key, None):
        a, b = query.clone(), query.clone()
        ka, kb = (None, None) if k_or_none is None else (key.clone(), key.clone())
        inplace(positions, a, ka, 32, cache)
        dropin.rotary_embedding(positions, b, kb, 32, cache)
        torch.testing.assert_close(a, b)
        assert not torch.equal(a, query)
        if ka is not None:
            torch.testing.assert_close(ka, kb)


def gpu(test):
    return pytest.mark.gpu(requires_torch_cuda(test))


@gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("style,cos_layout", [("neox", "halves"), ("gptj", "interleaved")])
@pytest.mark.parametrize("case", LAYOUT_CASES[:4], ids=case_id)
def test_apply_rotary_pos_emb_on_gpu(case, style, cos_layout, dtype, gen):
    tensors = case_tensors(case, cos_layout, gen, "cuda", TORCH_DTYPES[dtype])
    assert_like_transformers(*tensors, case[3], style, cos_layout)


@gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_apply_rotary_pos_emb_keeps_transformers_q_layout_on_gpu(dtype, gen):
    """transformers' q and k: (B, H, S, D) transposed views of the projections' (B, S, H, D) output. The rotated
    copies keep that memory order (sdpa's output then needs no transposing copy), forward and backward."""
    td = TORCH_DTYPES[dtype]
    q = torch.randn(2, 9, 4, 64, generator=gen).to("cuda", td).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 9, 2, 64, generator=gen).to("cuda", td).transpose(1, 2).requires_grad_()
    cos, sin = (t.to("cuda", td) for t in random_cos_sin((2, 9), 64, "halves", gen))
    assert_like_transformers(q.detach(), k.detach(), cos, sin, 1, "neox", "halves")
    q_embed, k_embed = dropin.apply_rotary_pos_emb(q, k, cos, sin)
    (q_embed.float().square().sum() + k_embed.float().sum()).backward()
    assert q_embed.stride() == q.stride() and k_embed.stride() == k.stride()
    assert q.grad.shape == q.shape and not q.grad.isnan().any()


@gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("style,cos_layout", [("neox", "halves"), ("gptj", "interleaved")])
@pytest.mark.parametrize("case", LAYOUT_CASES[:4], ids=case_id)
def test_one_tensor_apply_rotary_pos_emb_on_gpu(case, style, cos_layout, dtype, gen):
    q, k, cos, sin = case_tensors(case, cos_layout, gen, "cuda", TORCH_DTYPES[dtype])
    for x in (q, k):
        assert_one_tensor_like_transformers(x, cos, sin, case[3], style, cos_layout)


@gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_one_tensor_apply_rotary_pos_emb_gemma_call_on_gpu(dtype, gen):
    """Gemma 4's call: x (B, S, H, D) straight from its norm, cos/sin (B, S, D) in the model's dtype, unsqueeze_dim=2;
    forward, x's gradient against transformers', and under torch.compile."""
    td = TORCH_DTYPES[dtype]
    x = torch.randn(2, 9, 4, 128, generator=gen).to("cuda", td)
    cos, sin = (t.to("cuda", td) for t in random_cos_sin((2, 9), 128, "halves", gen))
    assert_one_tensor_like_transformers(x, cos, sin, 2, "neox", "halves")
    weight = torch.randn(x.shape, generator=gen).to("cuda", td)
    grads = []
    for fn in (lambda t: dropin.apply_rotary_pos_emb_one_tensor(t, cos, sin, 2), lambda t: hf_apply(t, t, cos, sin, 2)[0]):
        xx = x.clone().requires_grad_()
        (weight.double() * fn(xx).double()).sum().backward()
        grads.append(xx.grad)
    assert_close(*grads, dtype)
    compiled = torch.compile(dropin.apply_rotary_pos_emb_one_tensor, fullgraph=True)
    assert_close(compiled(x, cos, sin, 2), hf_apply(x, x, cos, sin, 2)[0], dtype)


@gpu
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_apply_rotary_pos_emb_fuzzed_on_gpu(data):
    q, k, cos, sin, call, ours = _random_call(data)
    td = TORCH_DTYPES[data.draw(st.sampled_from(list(TORCH_DTYPES)))]
    q, k, cos, sin = (t.to("cuda", td) for t in (q, k, cos, sin))
    if data.draw(st.booleans()):  # strided heads: q and k as views of one wider tensor
        axis = 1 if call["unsqueeze_dim"] % 4 == 1 else 2
        q, k = torch.cat((q, k), axis).split([q.shape[axis], k.shape[axis]], axis)
    assert_like_transformers(q, k, cos, sin, call["unsqueeze_dim"], ours["style"], ours["cos_layout"])


@gpu
def test_rotary_embedding_on_gpu(gen):
    tokens, head_size = 33, 128
    query, key = torch.randn(tokens, 8 * head_size, generator=gen), torch.randn(tokens, 2 * head_size, generator=gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cache = torch.from_numpy(reference.rope_cache(4096, 128, 10000.0)).float()
    q_gpu, k_gpu = query.cuda().bfloat16(), key.cuda().bfloat16()
    dropin.rotary_embedding(positions.cuda(), q_gpu, k_gpu, head_size, cache.cuda())
    for got, x in ((q_gpu, query), (k_gpu, key)):
        x = x.bfloat16().double().reshape(tokens, -1, head_size).numpy()
        expected = reference.rope(x, positions.numpy(), cos_sin_cache=cache.double().numpy())
        assert_close(got.reshape(tokens, -1, head_size), torch.from_numpy(expected), "bfloat16")


@gpu
def test_apply_rotary_pos_emb_under_compile_and_graphs(gen):
    q = torch.randn(2, 4, 8, 64, generator=gen).cuda()
    k = torch.randn(2, 2, 8, 64, generator=gen).cuda()
    cos, sin = (t.cuda() for t in random_cos_sin((2, 8), 64, "halves", gen))
    expected = hf_apply(q, k, cos, sin)
    compiled = torch.compile(dropin.apply_rotary_pos_emb, fullgraph=True)
    for g, e in zip(compiled(q, k, cos, sin), expected):
        assert_close(g, e, "float32")
    dropin.apply_rotary_pos_emb(q, k, cos, sin)  # compile the kernel before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = dropin.apply_rotary_pos_emb(q, k, cos, sin)
    cos2, sin2 = (t.cuda() for t in random_cos_sin((2, 8), 64, "halves", gen))
    cos.copy_(cos2)
    sin.copy_(sin2)
    graph.replay()
    for g, e in zip(outs, hf_apply(q, k, cos, sin)):
        assert_close(g, e, "float32")
