"""Random calls of every op on the GPU against the float64 references, with inputs and outputs as views
inside NaN-filled buffers: at random offsets from 16-byte boundaries, with padded rows, in either kind.
Anything read from outside a view turns a result into NaN; anything written outside one is caught by
comparing the whole buffer afterwards. The grids of the other GPU tests cover each path on purpose; this
covers their combinations. More examples for a campaign: CUPYROPE_FUZZ_EXAMPLES=500."""

import math
import os

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from helpers import (DTYPES, assert_matches, data_ptr, has_torch_cuda, index_to_device, outside_rows,
                     poisoned_allocations, random_host, requires_gpu, to_device, to_host, unaligned_view)

pytestmark = [pytest.mark.gpu, requires_gpu]
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(max_examples=int(os.environ.get("CUPYROPE_FUZZ_EXAMPLES", "25")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
KIND = st.sampled_from(["cupy", "torch"] if has_torch_cuda() else ["cupy"])
START = st.sampled_from([0, 0, 0, 1, 2, 3, 5, 8])  # elements from the buffer's (256-byte aligned) start
PAD = st.sampled_from([0, 0, 0, 1, 3, 8, 24])  # elements between rows
# Hidden sizes around every planner boundary: small, odd, 16-byte multiples, a stage, a cluster split.
HIDDEN = st.one_of(st.integers(1, 300), st.integers(300, 5000),
                   st.sampled_from([1024, 2048, 4096, 4099, 5120, 8191, 8192, 10240, 16384, 16389, 20001, 28672, 32768,
                                    32769, 40960, 65536, 65539]))
MAX_ELEMENTS = 2**21  # per tensor: keeps the float64 references quick
IMPL = st.sampled_from(["auto", "auto", "scalar", "vector"])
SEED = st.integers(0, 2**32 - 1)
NORM_CALL = given(data=st.data(), dtype=st.sampled_from(DTYPES), kind=KIND, hidden=HIDDEN, seed=SEED)


class Buffer:
    """A view of `shape` (last dimension contiguous) inside a NaN-filled buffer (helpers.unaligned_view): its rows
    start `start` elements into rows of the buffer that are `start + pad` elements longer; `host` is the view's
    float64 values (NaN where values=False: an output)."""

    def __init__(self, rng, dtype, kind, shape, start=0, pad=0, values=True):
        *lead, last = shape
        self.host = random_host(shape, dtype, rng) if values else np.full(shape, np.nan)
        self.dtype, self.start, self.last = dtype, start, last
        self.base, rows = unaligned_view(self.host.reshape(-1, last), dtype, kind, start, start + pad)
        self.view = rows.reshape(*lead, last)
        self.before = to_host(self.base)

    def check_outside(self, what):
        assert np.isnan(outside_rows(self.base, self.start, self.last)).all(), f"{what}: written outside the view"

    def check_unchanged(self, what):
        np.testing.assert_array_equal(to_host(self.base), self.before, err_msg=f"{what}: input changed")


def rows_for(draw, hidden, most=3000):
    rows = draw(st.integers(0, max(0, min(most, MAX_ELEMENTS // hidden))))
    split = draw(st.booleans()) and rows % 2 == 0 and rows > 0
    return (2, rows // 2) if split else (rows,)


def norm_rows(data, seed, dtype, kind, hidden, count):
    """(draw, rng, shape, Buffers): `count` row tensors of one random (..., hidden) shape, each at its own
    offset and row padding."""
    rng, draw = np.random.default_rng(seed), data.draw
    shape = (*rows_for(draw, hidden), hidden)
    return draw, rng, shape, [Buffer(rng, dtype, kind, shape, draw(START), draw(PAD)) for _ in range(count)]


def weight_of(rng, draw, dtype, kind, hidden):
    """None, or a weight of fp32 or x's dtype at a random offset."""
    choice = draw(st.sampled_from(["none", "float32", "same"]))
    if choice == "none":
        return None
    return Buffer(rng, "float32" if choice == "float32" else dtype, kind, (hidden,), draw(START))


def call_or_refused(call, impl, kind, new_output=None):
    """The call's result; None where impl='vector' was refused for a layout it cannot take (a ValueError
    naming impl, which the argument tests cover). new_output: (shape, dtype) of an output the call
    allocates, which then comes from NaN-filled memory (helpers.poisoned_allocations)."""
    try:
        if new_output is None:
            return call()
        with poisoned_allocations(kind, [new_output[0]], new_output[1]) as poisoned:
            result = call()
        first = result[0] if isinstance(result, tuple) else result
        assert math.prod(first.shape) == 0 or data_ptr(first) in poisoned, "the output did not get the poisoned block"
        return result
    except ValueError as error:
        if impl == "vector" and "impl" in str(error):
            return None
        raise


@FUZZ
@NORM_CALL
def test_fuzz_rms_norm_forward(data, dtype, kind, hidden, seed):
    draw, rng, shape, (x,) = norm_rows(data, seed, dtype, kind, hidden, 1)
    w = weight_of(rng, draw, dtype, kind, hidden)
    out = Buffer(rng, dtype, kind, shape, draw(START), draw(PAD), values=False) if draw(st.booleans()) else None
    offset, eps = draw(st.sampled_from([0.0, 1.0])), draw(st.sampled_from([1e-6, 1e-2]))
    impl = draw(IMPL)
    result = call_or_refused(lambda: cupyrope.rms_norm(x.view, None if w is None else w.view, eps, offset=offset,
                                                       out=None if out is None else out.view, return_rstd=True,
                                                       impl=impl), impl, kind,
                             None if out is not None else (shape, dtype))
    if result is None:
        return
    y, rstd = result
    ref_y, ref_rstd = reference.rms_norm(x.host, None if w is None else w.host, eps, offset, return_rstd=True)
    assert_matches(to_host(y), ref_y, dtype, scale=2.0, what="y")
    np.testing.assert_allclose(to_host(rstd), ref_rstd, rtol=2e-6)
    x.check_unchanged("x")
    if out is not None:
        assert y is out.view
        out.check_outside("out")


@FUZZ
@NORM_CALL
def test_fuzz_fused_add_rms_norm(data, dtype, kind, hidden, seed):
    draw, rng, shape, (x, residual) = norm_rows(data, seed, dtype, kind, hidden, 2)
    w = Buffer(rng, draw(st.sampled_from(["float32", dtype])), kind, (hidden,), draw(START))
    offset = draw(st.sampled_from([0.0, 1.0]))
    impl = draw(IMPL)
    if call_or_refused(lambda: cupyrope.fused_add_rms_norm(x.view, residual.view, w.view, 1e-6, offset=offset,
                                                           impl=impl), impl, kind) is None:
        return
    ref_y, ref_residual = reference.fused_add_rms_norm(x.host, residual.host, w.host, 1e-6, offset, dtype=dtype)
    np.testing.assert_array_equal(to_host(residual.view), ref_residual)  # one rounding of x + residual
    assert_matches(to_host(x.view), ref_y, dtype, scale=2.0, what="x")
    x.check_outside("x")
    residual.check_outside("residual")
    w.check_unchanged("weight")


@FUZZ
@NORM_CALL
def test_fuzz_rms_norm_backward(data, dtype, kind, hidden, seed):
    draw, rng, shape, (dy, x) = norm_rows(data, seed, dtype, kind, hidden, 2)
    w = weight_of(rng, draw, dtype, kind, hidden)
    weight = None if w is None else w.view
    offset, eps = draw(st.sampled_from([0.0, 0.25, 1.0])), draw(st.sampled_from([1e-6, 1e-2]))
    rstd = cupyrope.rms_norm(x.view, None, eps, return_rstd=True)[1] if draw(st.booleans()) else None
    impl = draw(IMPL)
    result = call_or_refused(lambda: cupyrope.rms_norm_backward(dy.view, x.view, weight, rstd, eps, offset,
                                                                impl=impl), impl, kind, (shape, dtype))
    if result is None:
        return
    dx, dw = result
    ref_dx, ref_dw = reference.rms_norm_backward(dy.host, x.host, None if w is None else w.host, eps, offset)
    x_rstd = reference.rms_norm(x.host, None, eps, return_rstd=True)[1][..., None]
    scale = np.abs(dy.host * (1.0 if w is None else w.host + offset) * x_rstd)
    assert_matches(to_host(dx), ref_dx, dtype, scale=scale.max(initial=0.0), what="dx")
    if w is None:
        assert dw is None
    else:  # dweight sums one fp32 term a row: tolerance from the terms' magnitudes, and one rounding
        terms = np.abs(dy.host * x.host * x_rstd).reshape(-1, hidden).sum(0)
        tol = 4e-6 * terms + (0 if w.dtype == "float32" else reference.ulp(ref_dw, w.dtype)) + 1e-30
        err = np.abs(to_host(dw) - ref_dw)
        assert np.all(err <= tol), f"dweight: worst {err.max():.3g}"
        again = cupyrope.rms_norm_backward(dy.view, x.view, weight, rstd, eps, offset, impl=impl)[1]
        np.testing.assert_array_equal(to_host(again), to_host(dw))  # bitwise deterministic
    for buffer, what in ((dy, "dy"), (x, "x")) + (() if w is None else ((w, "weight"),)):
        buffer.check_unchanged(what)


@st.composite
def rope_layouts(draw):
    """(q shape, k shape, positions shape, how the heads sit in memory): tokens-major (T, H, D) as column
    slices of one fused qkv buffer, batch-major (B, S, H, D), or heads-major (B, H, S, D)."""
    layout = draw(st.sampled_from(["qkv", "bshd", "bhsd"]))
    hq, hk = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    if layout == "qkv":
        t = draw(st.integers(0, 80))
        return layout, (t,), hq, hk, (t,)
    b, s = draw(st.integers(1, 3)), draw(st.integers(0, 40))
    return layout, (b, s), hq, hk, (b, s) if layout == "bshd" else (b, 1, s)


def rope_operands(rng, draw, layout, lead, hq, hk, head_dim, dtype, kind):
    """(buffers, q, k, q's and k's values, read) for a layout; `read()` gives q's and k's values as the
    buffers hold them now, and checks that nothing else in them changed (qkv: v, the row padding)."""
    start = draw(START)
    if layout == "qkv":  # q and k column slices of one (T, (hq + hk + 1) * D) buffer
        t, width = lead[0], (hq + hk) * head_dim
        fused = Buffer(rng, dtype, kind, (t, width + head_dim), start, draw(PAD))

        def split(rows):
            return rows[:, : hq * head_dim].reshape(t, hq, head_dim), rows[:, hq * head_dim: width].reshape(
                t, hk, head_dim)

        def read():
            fused.check_outside("qkv")
            now = to_host(fused.view)
            np.testing.assert_array_equal(now[:, width:], fused.host[:, width:], err_msg="v changed")
            return split(now)

        return [fused], *split(fused.view), *split(fused.host), read
    b, s = lead
    bufs = [Buffer(rng, dtype, kind, (b, s, h, head_dim), start, draw(PAD)) for h in (hq, hk)]
    heads_major = layout == "bhsd"  # (B, H, S, D) views of token-major memory

    def arrange(a):
        return a.swapaxes(1, 2) if heads_major else a

    def read():
        for buffer in bufs:
            buffer.check_outside("q/k")
        return [arrange(to_host(buffer.view)) for buffer in bufs]

    return bufs, arrange(bufs[0].view), arrange(bufs[1].view), arrange(bufs[0].host), arrange(bufs[1].host), read


@FUZZ
@given(data=st.data(), dtype=st.sampled_from(DTYPES), kind=KIND, layout=rope_layouts(), seed=SEED)
def test_fuzz_rope_qk(data, dtype, kind, layout, seed):
    rng, draw = np.random.default_rng(seed), data.draw
    layout, lead, hq, hk, pos_shape = layout
    head_dim = 2 * draw(st.sampled_from([1, 2, 3, 4, 8, 16, 20, 24, 32, 33, 40, 48, 64, 128]))
    rotary_dim = max(2, int(head_dim * draw(st.sampled_from([1.0, 1.0, 0.5, 0.25]))) // 2 * 2)
    style, inverse = draw(st.sampled_from(["neox", "gptj"])), draw(st.booleans())
    theta = draw(st.sampled_from([10000.0, 500000.0]))
    source = draw(st.sampled_from(["theta", "cache float32", "cache x"]))
    table = None
    if source != "theta":  # positions up to 1.25 past the table: those rotate to NaN (documented)
        max_position = draw(st.integers(1, 3000))
        positions = rng.integers(0, max_position * 5 // 4 + 1, pos_shape)
        table = reference.rope_cache(max_position, rotary_dim, theta)
        table_dtype = "float32" if source == "cache float32" else dtype
        table = reference.round_to(table, table_dtype)
        cache = to_device(table, table_dtype, kind)
    else:
        positions = rng.integers(0, 2**24, pos_shape)
    positions = positions.astype(draw(st.sampled_from(["int32", "int64"])))
    buffers, q, k, q_host, k_host, read = rope_operands(rng, draw, layout, lead, hq, hk, head_dim, dtype, kind)
    placement = draw(st.sampled_from(["in place", "new", "views"]))
    outs = None
    if placement == "views":
        outs = [Buffer(rng, dtype, kind, q_host.shape, draw(START), draw(PAD), values=False),
                Buffer(rng, dtype, kind, k_host.shape, draw(START), draw(PAD), values=False)]
    impl = draw(IMPL)
    options = dict(theta=theta, style=style, rotary_dim=rotary_dim, inverse=inverse, impl=impl,
                   cos_sin_cache=None if table is None else cache)
    out = {"in place": None, "new": "new", "views": None if outs is None else (outs[0].view, outs[1].view)}[placement]
    positions_on_device = index_to_device(positions, kind)
    result = call_or_refused(lambda: cupyrope.rope_qk(q, k, positions_on_device, out=out, **options), impl, kind,
                             (q_host.shape, dtype) if placement == "new" else None)
    if result is None:
        return
    reference_options = dict(theta=theta, style=style, rotary_dim=rotary_dim, inverse=inverse, cos_sin_cache=table)
    expected = [reference.rope(host, positions, **reference_options) for host in (q_host, k_host)]
    if placement == "in place":
        got = read()  # what the buffers hold: the rotation happened in them, nothing else changed
    else:
        got = [to_host(a) for a in result]
        for buffer in buffers:
            buffer.check_unchanged("q/k")
        for buffer in outs or []:
            buffer.check_outside("out")
    for g, e, what in zip(got, expected, "qk"):
        assert_matches(g, e, dtype, what=what)
