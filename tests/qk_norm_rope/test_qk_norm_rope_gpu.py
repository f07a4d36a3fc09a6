"""QK-norm + RoPE on the GPU against the float64 reference: dtypes, layouts (heads of a fused qkv tensor), GQA,
partial rotary, styles, cos/sin sources, M-RoPE and varlen; the backward, its determinism and the torch layer."""

import numpy as np
import pytest

import cupyrope
from cupyrope import reference

from helpers import (DTYPES, KINDS, assert_matches, fresh_plans, index_to_device, planned_kernels, poison,
                     random_host, requires_gpu, requires_torch_cuda, to_device, to_host, use_choices)

pytestmark = [pytest.mark.gpu, requires_gpu]

QWEN3 = dict(hq=32, hk=8, d=128)


def fused_qkv(rng, tokens, hq, hk, d, dtype, kind, batch=None):
    """(host q, host k, q view, k view, qkv): q and k are column slices of one (tokens, (hq + 2 hk) d) buffer, as a
    model's QKV projection leaves them ((batch, tokens, ...) with batch); v's columns hold NaN (never read)."""
    lead = (tokens,) if batch is None else (batch, tokens)
    width = (hq + 2 * hk) * d
    host = random_host(lead + (width,), dtype, rng, scale=3.0)
    host[..., (hq + hk) * d:] = np.nan
    qkv = to_device(host, dtype, kind)
    q = qkv[..., : hq * d].reshape(lead + (hq, d))
    k = qkv[..., hq * d:(hq + hk) * d].reshape(lead + (hk, d))
    return host[..., : hq * d].reshape(lead + (hq, d)), host[..., hq * d:(hq + hk) * d].reshape(lead + (hk, d)), q, k, qkv


def weights(rng, d, dtype, kind):
    host_q, host_k = (reference.round_to(1 + 0.5 * rng.standard_normal(d), dtype) for _ in range(2))
    return host_q, host_k, to_device(host_q, dtype, kind), to_device(host_k, dtype, kind)


def source_options(rng, source, rotary_dim, dtype, kind, max_pos):
    if source == "theta":
        return {}, {}
    table_dtype = "float32" if source == "cache-fp32" else dtype
    table = reference.round_to(reference.rope_cache(max_pos, rotary_dim, 10000.0), table_dtype)
    return {"cos_sin_cache": to_device(table, table_dtype, kind)}, {"cos_sin_cache": table}


def assert_outputs(got, ref, dtype, what):
    scale = np.nanmax(np.abs(ref)) if np.isfinite(ref).any() else 1.0
    assert_matches(to_host(got), ref, dtype, scale=scale, what=what)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("source", ["theta", "cache-fp32", "cache-own"])
@pytest.mark.parametrize("case", ["qwen3-prefill", "decode", "partial-gqa", "batched", "scalar"])
def test_qk_norm_rope_matches_the_reference(rng, kind, dtype, style, source, case):
    tokens, hq, hk, d, rotary_dim, batch, impl = {
        "qwen3-prefill": (67, 32, 8, 128, None, None, "auto"),
        "decode": (1, 32, 8, 128, None, None, "auto"),
        "partial-gqa": (19, 6, 2, 128, 64, None, "auto"),
        "batched": (11, 4, 2, 64, None, 3, "auto"),
        "scalar": (13, 4, 2, 128, 96, None, "scalar"),
    }[case]
    rot = rotary_dim or d
    if source == "cache-own" and dtype == "float32":
        pytest.skip("the fp32 cache is cache-fp32")
    max_pos = 4096 if source != "theta" else 2**20
    q_host, k_host, q, k, qkv = fused_qkv(rng, tokens, hq, hk, d, dtype, kind, batch)
    qw_host, kw_host, qw, kw = weights(rng, d, dtype if dtype != "float32" else "float32", kind)
    lead = (tokens,) if batch is None else (batch, tokens)
    pos_host = rng.integers(0, max_pos, lead).astype(np.int64)
    positions = index_to_device(pos_host, kind)
    dev, ref_opts = source_options(rng, source, rot, dtype, kind, max_pos)
    options = dict(eps=1e-6, offset=0.0, style=style, rotary_dim=rotary_dim)
    ref_q, ref_k = reference.qk_norm_rope(q_host, k_host, qw_host, kw_host, pos_host, **options, **ref_opts)
    # Out of place into poisoned outputs, then in place (the fused buffer's v stays NaN, untouched).
    q_out, k_out = (poison(to_device(np.zeros(t.shape), dtype, kind)) for t in (q_host, k_host))
    result = cupyrope.qk_norm_rope(q, k, qw, kw, positions, out=(q_out, k_out), impl=impl, **options, **dev)
    assert result[0] is q_out and result[1] is k_out
    assert_outputs(q_out, ref_q, dtype, "q out of place")
    assert_outputs(k_out, ref_k, dtype, "k out of place")
    np.testing.assert_array_equal(to_host(q).reshape(q_host.shape), q_host)  # inputs untouched
    new_q, new_k = cupyrope.qk_norm_rope(q, k, qw, kw, positions, out="new", impl=impl, **options, **dev)
    np.testing.assert_array_equal(to_host(new_q), to_host(q_out))
    cupyrope.qk_norm_rope(q, k, qw, kw, positions, impl=impl, **options, **dev)
    assert_outputs(q, ref_q, dtype, "q in place")
    assert_outputs(k, ref_k, dtype, "k in place")
    assert np.isnan(to_host(qkv)[..., (hq + hk) * d:]).all()  # v never written


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_offset_and_fp32_weights(rng, dtype):
    q_host, k_host, q, k, _ = fused_qkv(rng, 33, 8, 4, 256, dtype, "cupy")
    qw_host, kw_host, qw, kw = weights(rng, 256, "float32", "cupy")
    pos_host = rng.integers(0, 8192, 33)
    ref_q, ref_k = reference.qk_norm_rope(q_host, k_host, qw_host - 1, kw_host - 1, pos_host, offset=1.0, eps=1e-5)
    cupyrope.qk_norm_rope(q, k, qw - 1, kw - 1, index_to_device(pos_host, "cupy"), offset=1.0, eps=1e-5)
    assert_outputs(q, ref_q, dtype, "q")
    assert_outputs(k, ref_k, dtype, "k")


@pytest.mark.parametrize("op", ["rope", "rope_qk", "qk_norm_rope"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", ["theta", "cache-fp32"])
@pytest.mark.parametrize("tokens", [1, 200])
def test_mrope_matches_the_reference(rng, op, interleaved, source, tokens):
    dtype, hq, hk, d = "bfloat16", 8, 2, 128
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    q_host, k_host, q, k, _ = fused_qkv(rng, tokens, hq, hk, d, dtype, "cupy")
    pos_host = rng.integers(0, 4096, (3, tokens)).astype(np.int64)
    pos_host[1:, : tokens // 2] = pos_host[0, : tokens // 2]  # text tokens: the three rows equal
    positions = index_to_device(pos_host, "cupy")
    dev, ref_opts = source_options(rng, source, d, dtype, "cupy", 4096)
    mrope = dict(mrope_section=section, mrope_interleaved=interleaved)
    if op == "rope":
        ref = reference.rope(q_host, pos_host, **mrope, **ref_opts)
        out = cupyrope.rope(q, positions, **mrope, **dev)
        assert_outputs(out, ref, dtype, "rope")
        return
    if op == "rope_qk":
        ref_q, ref_k = (reference.rope(t, pos_host, **mrope, **ref_opts) for t in (q_host, k_host))
        cupyrope.rope_qk(q, k, positions, **mrope, **dev)
    else:
        qw_host, kw_host, qw, kw = weights(rng, d, dtype, "cupy")
        ref_q, ref_k = reference.qk_norm_rope(q_host, k_host, qw_host, kw_host, pos_host, **mrope, **ref_opts)
        cupyrope.qk_norm_rope(q, k, qw, kw, positions, **mrope, **dev)
    assert_outputs(q, ref_q, dtype, "q")
    assert_outputs(k, ref_k, dtype, "k")


def test_mrope_sections_take_their_rows(rng):
    """Each frequency's angle comes from its section's row: rows that differ only in h move only h's features."""
    x_host = random_host((5, 2, 64), "float32", rng)
    pos = np.tile(rng.integers(0, 1000, 5), (3, 1))
    x = to_device(x_host, "float32", "cupy")
    base = to_host(cupyrope.rope(x, index_to_device(pos, "cupy"), mrope_section=[8, 12, 12]))
    pos[1] += 7
    moved = to_host(cupyrope.rope(x, index_to_device(pos, "cupy"), mrope_section=[8, 12, 12]))
    changed = np.abs(moved - base).max(axis=(0, 1)) > 0
    f = np.arange(32)
    h = (f >= 8) & (f < 20)
    np.testing.assert_array_equal(changed, np.concatenate([h, h]))


@pytest.mark.parametrize("op", ["rope", "rope_qk", "qk_norm_rope"])
@pytest.mark.parametrize("offsets", [None, "int32", "int64"])
@pytest.mark.parametrize("source", ["theta", "cache-fp32"])
def test_varlen_matches_the_reference(rng, op, offsets, source):
    dtype, hq, hk, d = "float16", 4, 2, 64
    lengths = [5, 0, 61, 1, 17]
    cu_host = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = int(cu_host[-1])
    q_host, k_host, q, k, _ = fused_qkv(rng, tokens, hq, hk, d, dtype, "cupy")
    off_host = None if offsets is None else rng.integers(0, 1000, len(lengths)).astype(offsets)
    varlen = dict(cu_seqlens=index_to_device(cu_host, "cupy"),
                  seqlen_offsets=None if off_host is None else index_to_device(off_host, "cupy"))
    ref_varlen = dict(cu_seqlens=cu_host, seqlen_offsets=off_host)
    dev, ref_opts = source_options(rng, source, d, dtype, "cupy", 2048)
    if op == "rope":
        out = cupyrope.rope(q, **varlen, **dev)
        assert_outputs(out, reference.rope(q_host, **ref_varlen, **ref_opts), dtype, "rope")
        return
    if op == "rope_qk":
        ref_q, ref_k = (reference.rope(t, **ref_varlen, **ref_opts) for t in (q_host, k_host))
        cupyrope.rope_qk(q, k, **varlen, **dev)
    else:
        qw_host, kw_host, qw, kw = weights(rng, d, dtype, "cupy")
        ref_q, ref_k = reference.qk_norm_rope(q_host, k_host, qw_host, kw_host, **ref_varlen, **ref_opts)
        cupyrope.qk_norm_rope(q, k, qw, kw, **varlen, **dev)
    assert_outputs(q, ref_q, dtype, "q")
    assert_outputs(k, ref_k, dtype, "k")
    # The same as positions made by hand.
    pos_host = reference.varlen_positions(cu_host, tokens, off_host).astype(np.int64)
    np.testing.assert_array_equal(reference.rope(q_host, pos_host, **ref_opts), reference.rope(q_host, **ref_varlen,
                                                                                              **ref_opts))


@pytest.mark.parametrize("kernel_tokens", [0, 2**31], ids=["block", "direct"])
@pytest.mark.parametrize("cu", [[3, 10, 12], [0, 9, 4, 20], [-5, 2, 2**30], [0, 0, 0]])
def test_varlen_tokens_outside_every_sequence_become_nan(rng, monkeypatch, cu, kernel_tokens):
    """cu_seqlens that leave tokens out (or do not increase, or point far outside) never read or write out of
    bounds: those tokens' rotated features become NaN, the others are rotated as the reference says."""
    use_choices(monkeypatch, rope={"direct_max_tokens": kernel_tokens})
    tokens = 20
    x_host = random_host((tokens, 3, 32), "float32", rng)
    cu_host = np.asarray(cu, np.int32)
    out = to_host(cupyrope.rope(to_device(x_host, "float32", "cupy"), cu_seqlens=index_to_device(cu_host, "cupy")))
    starts = cu_host.astype(np.int64)
    inside = np.zeros(tokens, bool)  # in a sequence the bisection can find: [starts[s], starts[s + 1])
    for s in range(len(starts) - 1):
        inside[max(starts[s], 0):max(min(starts[s + 1], tokens), 0)] = True
    assert np.isnan(out[(np.arange(tokens) < starts[0]) | (np.arange(tokens) >= starts.max())]).all()
    if np.all(np.diff(starts) >= 0):
        assert np.isnan(out[~inside]).all()
        ref = reference.rope(x_host, cu_seqlens=cu_host)
        np.testing.assert_allclose(out[inside], ref[inside], rtol=1e-5, atol=1e-5)
    else:  # each token is NaN or rotated at a position the bisection found (norms kept)
        kept = ~np.isnan(out).any(axis=(1, 2))
        np.testing.assert_allclose(np.linalg.norm(out[kept], axis=-1), np.linalg.norm(x_host[kept], axis=-1), rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("case", ["qwen3", "partial-cache", "mrope", "varlen", "scalar"])
def test_backward_matches_the_reference_and_is_deterministic(rng, kind, dtype, style, case):
    tokens, hq, hk, d, rotary_dim, impl = {"qwen3": (300, 32, 8, 128, None, "auto"),
                                           "partial-cache": (41, 6, 2, 128, 64, "auto"),
                                           "mrope": (57, 4, 2, 128, None, "auto"),
                                           "varlen": (40, 4, 2, 64, None, "auto"),
                                           "scalar": (23, 4, 2, 64, 32, "scalar")}[case]
    rot = rotary_dim or d
    q_host, k_host, q, k, _ = fused_qkv(rng, tokens, hq, hk, d, dtype, kind)
    weight_dtype = "float32" if case == "scalar" else dtype
    qw_host, kw_host, qw, kw = weights(rng, d, weight_dtype, kind)
    dq_host, dk_host = (random_host(t.shape, dtype, rng) for t in (q_host, k_host))
    dq, dk = to_device(dq_host, dtype, kind), to_device(dk_host, dtype, kind)
    options, ref_options, positions, pos_host = dict(rotary_dim=rotary_dim, style=style, eps=1e-5, offset=0.5), {}, None, None
    if case == "mrope":
        pos_host = rng.integers(0, 5000, (3, tokens))
        options.update(mrope_section=[16, 24, 24])
    elif case == "varlen":
        cu_host = np.asarray([0, 7, 30, 40], np.int32)
        options["cu_seqlens"], ref_options["cu_seqlens"] = index_to_device(cu_host, kind), cu_host
    else:
        pos_host = rng.integers(0, 4096, tokens)
    if pos_host is not None:
        positions = index_to_device(pos_host, kind)
    if case == "partial-cache":
        dev, ref_cache = source_options(rng, "cache-fp32", rot, dtype, kind, 4096)
        options.update(dev)
        ref_options.update(ref_cache)
    ref_options.update({key: value for key, value in options.items() if key not in ("cos_sin_cache", "cu_seqlens")})
    grads = cupyrope.qk_norm_rope_backward(dq, dk, q, k, qw, kw, positions, impl=impl, **options)
    ref = reference.qk_norm_rope_backward(dq_host, dk_host, q_host, k_host, qw_host, kw_host, pos_host, **ref_options)
    for got, expected, x_host, w_host, dy_host, name in ((grads[0], ref[0], q_host, qw_host, dq_host, "dq"),
                                                         (grads[1], ref[1], k_host, kw_host, dk_host, "dk")):
        rstd = 1 / np.sqrt(np.mean(x_host**2, -1, keepdims=True) + 1e-5)
        scale = np.abs(dy_host).max() * np.abs(w_host + 0.5).max() * rstd.max()
        assert_matches(to_host(got), expected, dtype, scale=4 * scale, what=name)
    for got, expected, x_host, dy_host, name in ((grads[2], ref[2], q_host, dq_host, "dq_weight"),
                                                 (grads[3], ref[3], k_host, dk_host, "dk_weight")):
        rstd = 1 / np.sqrt(np.mean(x_host**2, -1, keepdims=True) + 1e-5)
        terms = (np.abs(dy_host).max() * np.abs(x_host) * rstd).reshape(-1, d).sum(0)
        tol = 4e-6 * terms + (0 if weight_dtype == "float32" else reference.ulp(expected, weight_dtype))
        assert np.all(np.abs(to_host(got) - expected) <= tol), name
    again = cupyrope.qk_norm_rope_backward(dq, dk, q, k, qw, kw, positions, impl=impl, **options)
    for a, b in zip(grads, again):
        np.testing.assert_array_equal(to_host(a), to_host(b))  # bitwise, weights included


def test_backward_of_a_huge_batch_keeps_one_wave_of_blocks(rng, monkeypatch):
    plans = fresh_plans(monkeypatch)
    q_host, k_host, q, k, _ = fused_qkv(rng, 8192, 32, 8, 128, "bfloat16", "cupy")
    qw_host, kw_host, qw, kw = weights(rng, 128, "bfloat16", "cupy")
    positions = index_to_device(np.arange(8192), "cupy")
    dq, dk = (to_device(random_host(t.shape, "bfloat16", rng), "bfloat16", "cupy") for t in (q_host, k_host))
    cupyrope.qk_norm_rope_backward(dq, dk, q, k, qw, kw, positions)
    (plan,) = plans["qk_norm_rope_backward"].plans.values()
    from cupyrope._runtime.device import sm_count
    assert plan.grid <= 32 * sm_count(0) and plan.partial_rows == plan.grid
    assert planned_kernels(plans["qk_norm_rope_backward"])[0].startswith("cupyrope::qk_norm_rope_bwd_kernel<")


@requires_torch_cuda
@pytest.mark.parametrize("case", ["plain", "mrope", "varlen"])
def test_torch_gradients_match_float64_autograd(rng, case):
    import torch

    import cupyrope.torch as ct

    tokens, hq, hk, d = 29, 4, 2, 64
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device="cuda", dtype=torch.float32, requires_grad=True)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    qw = (1 + 0.3 * torch.randn(d, device="cuda")).requires_grad_()
    kw = (1 + 0.3 * torch.randn(d, device="cuda")).requires_grad_()
    kwargs, positions = {}, None
    if case == "mrope":
        positions = torch.randint(0, 3000, (3, tokens), device="cuda")
        kwargs["mrope_section"] = [8, 12, 12]
    elif case == "varlen":
        kwargs["cu_seqlens"] = torch.tensor([0, 10, 29], device="cuda", dtype=torch.int32)
    else:
        positions = torch.randint(0, 3000, (tokens,), device="cuda")
    out_q, out_k = ct.qk_norm_rope(q, k, qw, kw, positions, eps=1e-6, offset=0.0, **kwargs)
    gq, gk = torch.randn_like(out_q), torch.randn_like(out_k)
    torch.autograd.backward((out_q, out_k), (gq, gk))
    # autograd of the CPU formula (float32 math, like the kernels)
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, qw, kw)]
    cpu_kwargs = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    ref_q, ref_k = ct.qk_norm_rope(*cpu, None if positions is None else positions.cpu(), **cpu_kwargs)
    torch.autograd.backward((ref_q, ref_k), (gq.cpu(), gk.cpu()))
    np.testing.assert_allclose(out_q.detach().cpu().numpy(), ref_q.detach().numpy(), rtol=1e-5, atol=1e-5)
    grad_qkv = qkv.grad.cpu().numpy()
    np.testing.assert_allclose(grad_qkv[:, : hq * d].reshape(tokens, hq, d), cpu[0].grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grad_qkv[:, hq * d:(hq + hk) * d].reshape(tokens, hk, d), cpu[1].grad.numpy(),
                               rtol=1e-4, atol=1e-5)
    assert (grad_qkv[:, (hq + hk) * d:] == 0).all()
    np.testing.assert_allclose(qw.grad.cpu().numpy(), cpu[2].grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(kw.grad.cpu().numpy(), cpu[3].grad.numpy(), rtol=1e-4, atol=1e-4)


@requires_torch_cuda
def test_torch_compile_fullgraph_and_cuda_graphs(rng):
    import torch

    import cupyrope.torch as ct

    module = ct.QKNormRotaryEmbedding(128, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        module.q_norm.weight.uniform_(0.5, 1.5)
        module.k_norm.weight.uniform_(0.5, 1.5)
    qkv = torch.randn(64, 48 * 128, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, : 32 * 128].view(64, 32, 128), qkv[:, 32 * 128: 40 * 128].view(64, 8, 128)
    positions = torch.arange(64, device="cuda")
    eager = module(q, k, positions)
    compiled = torch.compile(module, fullgraph=True)
    out = compiled(q, k, positions)
    for a, b in zip(eager, out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the in-place form, captured in a CUDA graph
    q2, k2 = q.clone(), k.clone()
    module(q2, k2, positions, inplace=True)  # warm up (compile, plan)
    q3, k3 = q.clone(), k.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module(q3, k3, positions, inplace=True)
    q3.copy_(q)
    k3.copy_(k)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(q3, eager[0], rtol=0, atol=0)
    torch.testing.assert_close(k3, eager[1], rtol=0, atol=0)


def test_bad_input_leaves_the_inputs_alone(rng):
    q_host, k_host, q, k, _ = fused_qkv(rng, 9, 4, 2, 64, "bfloat16", "cupy")
    qw_host, kw_host, qw, kw = weights(rng, 64, "bfloat16", "cupy")
    positions = index_to_device(np.arange(9), "cupy")
    cases = [
        (dict(positions=positions, mrope_section=[8, 12, 12]), ValueError, r"positions: with mrope_section, expected shape \(3, ...\)"),
        (dict(positions=index_to_device(np.zeros((3, 9), np.int64), "cupy"), mrope_section=[8, 12, 8]), ValueError,
         "mrope_section: expected sections adding up to rotary_dim / 2 = 32"),
        (dict(cu_seqlens=index_to_device(np.asarray([0, 9], np.int64), "cupy")), TypeError, "cu_seqlens: expected int32"),
        (dict(cu_seqlens=index_to_device(np.asarray([0, 9], np.int32), "cupy"), positions=positions), ValueError,
         "positions: pass either positions or cu_seqlens"),
        (dict(positions=positions, seqlen_offsets=index_to_device(np.asarray([0]), "cupy")), ValueError,
         "seqlen_offsets: only with cu_seqlens"),
        (dict(positions=positions, q_weight=kw[:32]), ValueError, r"q_weight: expected shape \(64,\)"),
        (dict(positions=positions, eps=0.0), ValueError, "eps"),
    ]
    for kwargs, error, message in cases:
        args = dict(q_weight=qw, k_weight=kw)
        args.update(kwargs)
        with pytest.raises(error, match=message):
            cupyrope.qk_norm_rope(q, k, **args)
        np.testing.assert_array_equal(to_host(q), q_host)
        np.testing.assert_array_equal(to_host(k), k_host)
