"""RMSNorm per head on views of a fused qkv tensor: q's and k's heads, (tokens, heads, head_dim), are rows in runs
(a run a token, the runs a qkv row apart), which rms_norm and rms_norm_backward take where they lie (the RUNS
variants of rows held in registers): forward (new, out= and in place) and backward with dy and x both views, against
float64, 16-byte and element by element. Rows too long for registers, and the fused adds and FP8 output, refuse such
views with a ValueError and leave the inputs as they were."""

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from helpers import DTYPES, KINDS, assert_matches, poisoned_allocations, random_host, requires_gpu, to_device, to_host
from norm_helpers import fresh_plans, planned

pytestmark = [pytest.mark.gpu, requires_gpu]

# (tokens, q heads, kv heads, head_dim): Qwen3's 128, odd sizes (element by element: the views' strides are not
# 16-byte multiples), and the longest rows the backward holds in registers at every dtype.
CASES = [(1000, 8, 2, 128), (37, 4, 1, 64), (19, 3, 2, 100), (5, 2, 1, 1027), (3, 2, 1, 4096)]


def fused_qkv(rng, tokens, q_heads, kv_heads, head_dim, dtype, kind):
    """(qkv host values, the qkv array, q's view, k's view): q and k as (tokens, heads, head_dim) views."""
    width = (q_heads + 2 * kv_heads) * head_dim
    host = random_host((tokens, width), dtype, rng, scale=2.0)
    qkv = to_device(host, dtype, kind)
    q = qkv[:, : q_heads * head_dim].reshape(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim: (q_heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    return host, qkv, q, k


def heads_of(host, start, heads, head_dim):
    """The float64 values of heads start ... start + heads - 1 of a fused host tensor, as (tokens * heads, head_dim)."""
    return host[:, start * head_dim: (start + heads) * head_dim].reshape(-1, head_dim)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", CASES)
def test_rms_norm_of_head_views(rng, monkeypatch, kind, dtype, tokens, q_heads, kv_heads, head_dim):
    host, qkv, q, k = fused_qkv(rng, tokens, q_heads, kv_heads, head_dim, dtype, kind)
    w_host = random_host((head_dim,), "float32", rng)
    w = to_device(w_host, "float32", kind)
    q_host = heads_of(host, 0, q_heads, head_dim)
    ref_y, ref_rstd = reference.rms_norm(q_host, w_host, 1e-6, 0.5, return_rstd=True)
    fresh_plans(monkeypatch)
    with poisoned_allocations(kind, [tuple(q.shape)], dtype):
        y, rstd = cupyrope.rms_norm(q, w, 1e-6, offset=0.5, return_rstd=True)
    assert planned("fwd").grid and tuple(y.shape) == (tokens, q_heads, head_dim)
    assert_matches(to_host(y).reshape(-1, head_dim), ref_y, dtype, scale=2.0, what="y")
    np.testing.assert_allclose(to_host(rstd).reshape(-1), ref_rstd, rtol=2e-6)
    np.testing.assert_array_equal(to_host(qkv), host)  # the input untouched

    # Backward: dy a view of another fused tensor, x the q view.
    dy_host, _, dy, _ = fused_qkv(rng, tokens, q_heads, kv_heads, head_dim, dtype, kind)
    dy_q = heads_of(dy_host, 0, q_heads, head_dim)
    ref_dx, ref_dw = reference.rms_norm_backward(dy_q, q_host, w_host, 1e-6, 0.5)
    dx, dw = cupyrope.rms_norm_backward(dy, q, w, rstd, 1e-6, 0.5)
    scale = np.abs(dy_q * (w_host + 0.5) * ref_rstd[:, None]).max()
    assert_matches(to_host(dx).reshape(-1, head_dim), ref_dx, dtype, scale=scale, what="dx")
    terms = np.abs(dy_q * q_host * ref_rstd[:, None]).sum(0)
    assert np.all(np.abs(to_host(dw) - ref_dw) <= 4e-6 * terms + 1e-30), "dweight"

    # In place on k's view: only k's part of qkv changes.
    k_host = heads_of(host, q_heads, kv_heads, head_dim)
    out = cupyrope.rms_norm(k, w, 1e-6, out=k)
    assert out is k
    after = to_host(qkv)
    k_cols = slice(q_heads * head_dim, (q_heads + kv_heads) * head_dim)
    assert_matches(after[:, k_cols].reshape(-1, head_dim), reference.rms_norm(k_host, w_host, 1e-6), dtype,
                   scale=2.0, what="k in place")
    untouched = np.delete(after, np.r_[k_cols], axis=1)
    np.testing.assert_array_equal(untouched, np.delete(host, np.r_[k_cols], axis=1))


@pytest.mark.parametrize("kind", KINDS)
def test_views_the_kernels_do_not_take_are_refused(rng, kind):
    """Rows too long for registers (read twice), and the fused adds and FP8 on runs: a ValueError, inputs unchanged."""
    host, qkv, q, _ = fused_qkv(rng, 2, 2, 1, 65536, "float32", kind)
    r_host, r_qkv, r, _ = fused_qkv(rng, 2, 2, 1, 65536, "float32", kind)
    w = to_device(random_host((65536,), "float32", rng), "float32", kind)
    with pytest.raises(ValueError, match="x: rows in runs .* rows of 65536 elements do not"):
        cupyrope.rms_norm(q, w)
    with pytest.raises(ValueError, match="x: rows in runs"):
        cupyrope.rms_norm_backward(r, q, w)
    _, _, small_q, _ = fused_qkv(rng, 5, 4, 1, 128, "float32", kind)
    _, _, small_r, _ = fused_qkv(rng, 5, 4, 1, 128, "float32", kind)
    for call in (lambda: cupyrope.add_rms_norm(small_q, small_r), lambda: cupyrope.fused_add_rms_norm(small_q, small_r, None),
                 lambda: cupyrope.rms_norm_fp8(small_q), lambda: cupyrope.rms_norm_backward(small_q, small_q, residual_grad=small_r)):
        with pytest.raises(ValueError, match="rows .* must be evenly strided"):
            call()
    np.testing.assert_array_equal(to_host(qkv), host)
    np.testing.assert_array_equal(to_host(r_qkv), r_host)
