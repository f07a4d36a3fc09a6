"""RMSNorm over rows that form two strided runs: per-head norms on q's or k's heads as a (T, H, D) or (B, S, H, D)
view of a fused qkv tensor, with no copy. Forward (new output and in place), fused add and backward against the
float64 reference; nothing around the view read or written; rows over three runs refused."""

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from cupyrope.reference import ulp
from helpers import DTYPES, KINDS, assert_matches, poison, random_host, requires_gpu, to_device, to_host
from norm_helpers import fresh_plans, planned

pytestmark = [pytest.mark.gpu, requires_gpu]

# (leading shape, heads, head_dim, heads after them in the buffer, elements around each head, first element of a
# head): q's heads of a fused qkv buffer (k and v after them), aligned and at odd offsets.
CASES = [
    ((300,), 8, 128, 4, 0, 0),       # Qwen3-like q of a fused qkv: 16-byte rows
    ((2, 150), 4, 128, 2, 0, 0),     # (B, S, H, D)
    ((77,), 6, 64, 3, 0, 0),
    ((33,), 5, 67, 2, 0, 0),         # odd head_dim: element by element
    ((19,), 3, 1027, 1, 13, 3),      # long odd rows at one offset from 16 bytes: shifted 16-byte chunks
]


def heads_view(host, dtype, kind, after, pad, start):
    """host (..., H, D) placed in a NaN buffer (..., H + after, pad + D) at column `start` of each head: returns the
    view and the buffer (nothing outside the view may change)."""
    *lead, heads, dim = host.shape
    buffer = np.full((*lead, heads + after, dim + pad), np.nan)
    buffer[..., :heads, start:start + dim] = host
    device = to_device(buffer, dtype, kind)
    return device[..., :heads, start:start + dim], device


def outside(buffer, heads, dim, start):
    values = to_host(buffer).copy()
    values[..., :heads, start:start + dim] = 0.0
    return values


def case_arrays(rng, kind, dtype, case, scale=2.0):
    lead, heads, dim, after, pad, start = case
    x_host = random_host((*lead, heads, dim), dtype, rng, scale=scale)
    x, buffer = heads_view(x_host, dtype, kind, after, pad, start)
    return x_host, x, buffer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_head_rows_forward(rng, monkeypatch, kind, dtype, case):
    lead, heads, dim, after, pad, start = case
    x_host, x, buffer = case_arrays(rng, kind, dtype, case)
    w_host = random_host((dim,), "float32", rng)
    w = to_device(w_host, "float32", kind)
    fresh_plans(monkeypatch)
    y, rstd = cupyrope.rms_norm(x, w, 1e-5, offset=0.5, return_rstd=True)
    assert planned("fwd").name.split("<")[0] == "cupyrope::rms_norm_fwd"  # not refused, not copied
    ref_y, ref_rstd = reference.rms_norm(x_host.reshape(-1, dim), w_host, 1e-5, 0.5, return_rstd=True)
    assert y.shape == x.shape and rstd.shape == x.shape[:-1]
    assert_matches(to_host(y).reshape(-1, dim), ref_y, dtype, scale=3.0, what="y")
    np.testing.assert_allclose(to_host(rstd).reshape(-1), ref_rstd, rtol=2e-6)
    np.testing.assert_array_equal(to_host(x), x_host)  # the input untouched

    before = outside(buffer, heads, dim, start)
    out = cupyrope.rms_norm(x, w, 1e-5, offset=0.5, out=x)  # in place, on the view
    assert out is x
    assert_matches(to_host(x).reshape(-1, dim), ref_y, dtype, scale=3.0, what="in place")
    np.testing.assert_array_equal(outside(buffer, heads, dim, start), before)  # k, v and the gaps: NaN still


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_head_rows_fused_add(rng, kind, dtype, case):
    lead, heads, dim, after, pad, start = case
    x_host, x, x_buffer = case_arrays(rng, kind, dtype, case)
    r_host, r, r_buffer = case_arrays(rng, kind, dtype, case)
    w_host = random_host((dim,), dtype, rng)
    w = to_device(w_host, dtype, kind)
    x_before, r_before = outside(x_buffer, heads, dim, start), outside(r_buffer, heads, dim, start)
    cupyrope.fused_add_rms_norm(x, r, w, 1e-6)
    ref_y, ref_r = reference.fused_add_rms_norm(x_host.reshape(-1, dim), r_host.reshape(-1, dim), w_host, 1e-6,
                                                dtype=dtype)
    np.testing.assert_array_equal(to_host(r).reshape(-1, dim), ref_r)
    assert_matches(to_host(x).reshape(-1, dim), ref_y, dtype, scale=2.0)
    np.testing.assert_array_equal(outside(x_buffer, heads, dim, start), x_before)
    np.testing.assert_array_equal(outside(r_buffer, heads, dim, start), r_before)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dy_layout", ["contiguous", "view"])
def test_head_rows_backward(rng, kind, dtype, case, dy_layout):
    lead, heads, dim, after, pad, start = case
    x_host, x, _ = case_arrays(rng, kind, dtype, case, scale=1.0)
    dy_host = random_host(x_host.shape, dtype, rng)
    dy = to_device(dy_host, dtype, kind) if dy_layout == "contiguous" else heads_view(dy_host, dtype, kind, after,
                                                                                       pad, start)[0]
    w_host = random_host((dim,), "float32", rng)
    w = to_device(w_host, "float32", kind)
    dx, dw = cupyrope.rms_norm_backward(dy, x, w, offset=0.25)
    x2, dy2 = x_host.reshape(-1, dim), dy_host.reshape(-1, dim)
    ref_dx, ref_dw = reference.rms_norm_backward(dy2, x2, w_host, offset=0.25)
    rstd = reference.rms_norm(x2, None, return_rstd=True)[1][:, None]
    assert_matches(to_host(dx).reshape(-1, dim), ref_dx, dtype, scale=np.abs(dy2 * (w_host + 0.25) * rstd).max(),
                   what="dx")
    tol = 4e-6 * np.abs(dy2 * x2 * rstd).sum(0) + ulp(ref_dw, "float32")
    assert np.all(np.abs(to_host(dw) - ref_dw) <= tol), "dweight"
    np.testing.assert_array_equal(to_host(cupyrope.rms_norm_backward(dy, x, w, offset=0.25)[1]), to_host(dw))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_over_three_runs_are_refused(rng, kind):
    # (B, S, H, D) with gaps after each token and each sequence: B, S and H strides merge nowhere.
    host = random_host((2, 5, 3, 64), "float32", rng)
    buffer = np.full((2, 6, 4, 64), 7.0)
    buffer[:, :5, :3] = host
    device = to_device(buffer, "float32", kind)
    x = device[:, :5, :3]
    out = poison(to_device(np.zeros(host.shape), "float32", kind))
    with pytest.raises(ValueError, match=r"x: its rows .* one or two evenly strided runs"):
        cupyrope.rms_norm(x, None, out=out)
    with pytest.raises(ValueError, match=r"dy: its rows"):
        cupyrope.rms_norm_backward(x, x)
    np.testing.assert_array_equal(to_host(device), buffer)
    assert np.isnan(to_host(out)).all()
