"""RMSNorm forward and fused residual add on the GPU against the float64 reference: every row path (element by
element, 16-byte, shifted, read twice, row cache, wide rows, split over a cluster), strides, kinds, streams and graphs."""

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from cupyrope._runtime.arrays import ITEMSIZE
from cupyrope.ops import rmsnorm_rows as rows_module
from helpers import (DTYPES, KINDS, assert_backward_with_offset, assert_matches, outside_rows, poison, random_host,
                     requires_gpu, requires_torch_cuda, to_device, to_host, unaligned_view, use_choices)
from norm_helpers import (HIDDEN, ROWS, fill_next_allocation_with_nan, fresh_plans, planned, runs_clusters,
                          sample_rows, strided_rows)

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(rng, dtype, rows, hidden):
    if rows * hidden > 2**28:
        rows = 2**28 // hidden  # keeps the host reference affordable; huge sizes: test_huge_gpu.py
    weight_dtype = "float32" if (rows + hidden) % 2 else dtype
    offset = 1.0 if hidden % 2 else 0.0
    x_host = random_host((rows, hidden), dtype, rng, scale=3.0)
    w_host = random_host((hidden,), weight_dtype, rng)
    x, w = to_device(x_host, dtype, "cupy"), to_device(w_host, weight_dtype, "cupy")
    out = poison(to_device(np.zeros((rows, hidden)), dtype, "cupy"))
    y, rstd = cupyrope.rms_norm(x, w, 1e-5, offset=offset, out=out, return_rstd=True)
    assert y is out
    y_host = to_host(y)
    assert not np.isnan(y_host).any()
    idx = sample_rows(rows, rng)
    ref_y, ref_rstd = reference.rms_norm(x_host[idx], w_host, 1e-5, offset, return_rstd=True)
    assert_matches(y_host[idx], ref_y, dtype, scale=3.0)
    np.testing.assert_allclose(to_host(rstd)[idx], ref_rstd, rtol=2e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [61, 4096])
def test_strided_rows_no_weight_and_kinds(rng, kind, dtype, hidden):
    x_host = random_host((9, hidden), dtype, rng)
    x = strided_rows(x_host, dtype, kind, pad=24)
    y = cupyrope.rms_norm(x, None, 1e-6)
    assert type(y).__module__.split(".")[0] == kind
    assert_matches(to_host(y), reference.rms_norm(x_host, None, 1e-6), dtype)
    np.testing.assert_array_equal(to_host(x), x_host)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,start,pad", [(1027, 0, 5), (1027, 3, 5), (2999, 1, 6), (8191, 5, 9), (300, 7, 9)])
def test_unaligned_rows(rng, kind, dtype, hidden, start, pad):
    """Rows that start anywhere relative to 16-byte boundaries (the forward's shifted 16-byte path):
    every element of the row right, nothing around the rows written, same result as element by element."""
    rows = 37
    x_host = random_host((rows, hidden), dtype, rng, scale=2.0)
    r_host = random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), "float32", rng)
    w = to_device(w_host, "float32", kind)

    def view(host):
        return unaligned_view(host, dtype, kind, start, pad)

    x_buf, x = view(x_host)
    out_buf, out = view(np.full((rows, hidden), np.nan))
    cupyrope.rms_norm(x, w, 1e-6, out=out)
    assert_matches(to_host(out), reference.rms_norm(x_host, w_host, 1e-6), dtype, scale=2.0)
    assert np.isnan(outside_rows(out_buf, start, hidden)).all(), "wrote outside the rows"
    scalar = cupyrope.rms_norm(x, w, 1e-6, impl="scalar")
    assert_matches(to_host(out), to_host(scalar).astype(np.float64), dtype, scale=2.0)  # sums in another order
    # Fused add, x and residual both unaligned views.
    r_buf, r = view(r_host)
    cupyrope.fused_add_rms_norm(x, r, w, 1e-6)
    ref_y, ref_r = reference.fused_add_rms_norm(x_host, r_host, w_host, 1e-6, dtype=dtype)
    np.testing.assert_array_equal(to_host(r), ref_r)
    assert_matches(to_host(x), ref_y, dtype, scale=2.0)
    for buffer in (x_buf, r_buf):
        assert np.isnan(outside_rows(buffer, start, hidden)).all(), "wrote outside the rows"
    # Backward from unaligned views (dx is a fresh contiguous array).
    x_buf, x = view(x_host)
    dy_host = random_host((rows, hidden), dtype, rng)
    _, dy = view(dy_host)
    dx, dw = cupyrope.rms_norm_backward(dy, x, w)
    ref_dx, ref_dw = reference.rms_norm_backward(dy_host, x_host, w_host)
    scale = np.abs(dy_host * w_host).max() * reference.rms_norm(x_host, None, return_rstd=True)[1].max()
    assert_matches(to_host(dx), ref_dx, dtype, scale=scale, what="dx")
    np.testing.assert_allclose(to_host(dw), ref_dw, rtol=1e-4, atol=1e-4 * np.abs(ref_dw).max())


# The forward and fused add of shifted fp16/bf16 rows take a chunk's weight from what it straddles: an fp32 weight's
# 16-byte units (straddling_weight; 2+ chunks a thread, rows read twice or split) when it is 16-byte aligned, a 16-bit
# weight's 32-bit words (word_straddling_weight; rows read twice or split), from either parity of a 2-byte offset;
# else element by element, as every other weight of shifted rows. Weights that start 0, 1 and 3 elements past a
# boundary, NaN around them (a column read from outside the weight shows), both weight dtypes, 2 and 4 chunks a
# thread, rows read twice (33001) and split over a cluster (65539, on sm_90+), the backward too.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [2053, 4099, 33001, 65539])
@pytest.mark.parametrize("weight_start", [0, 1, 3])
def test_shifted_rows_weight_alignment(rng, monkeypatch, kind, dtype, hidden, weight_start):
    rows, start = (300 if hidden < 10000 else 40), 3
    x_host, r_host = random_host((rows, hidden), dtype, rng, scale=2.0), random_host((rows, hidden), dtype, rng)
    dy_host = random_host((rows, hidden), dtype, rng)
    for weight_dtype in sorted({dtype, "float32"}):
        w_host = random_host((hidden,), weight_dtype, rng)
        padded = np.full(hidden + 8, np.nan)
        padded[weight_start:weight_start + hidden] = w_host
        w = to_device(padded, weight_dtype, kind)[weight_start:weight_start + hidden]
        _, x = unaligned_view(x_host, dtype, kind, start, 8)
        out_buf, out = unaligned_view(np.full((rows, hidden), np.nan), dtype, kind, start, 8)
        fresh_plans(monkeypatch)
        cupyrope.rms_norm(x, w, 1e-6, out=out)
        assert planned("fwd").shifted and planned("fwd").slots != 1, planned("fwd")
        assert_matches(to_host(out), reference.rms_norm(x_host, w_host, 1e-6), dtype, scale=2.0)
        assert np.isnan(outside_rows(out_buf, start, hidden)).all(), "wrote outside the rows"
        _, r = unaligned_view(r_host, dtype, kind, start, 8)
        cupyrope.fused_add_rms_norm(x, r, w, 1e-6)
        ref_y, ref_r = reference.fused_add_rms_norm(x_host, r_host, w_host, 1e-6, dtype=dtype)
        np.testing.assert_array_equal(to_host(r), ref_r)
        assert_matches(to_host(x), ref_y, dtype, scale=2.0)
        _, x = unaligned_view(x_host, dtype, kind, start, 8)
        _, dy = unaligned_view(dy_host, dtype, kind, start, 8)
        fill_next_allocation_with_nan((rows, hidden), dtype, kind)
        dx, dw = cupyrope.rms_norm_backward(dy, x, w, offset=0.25)
        assert_backward_with_offset(dy, x, w, dx, dw, dy_host, x_host, w_host, dtype, weight_dtype)


# rms_norm_fwd_split (sm_90+): aligned rows past one block's registers from 128 KiB (fp32 over 32K elements,
# the fp32 fused add's from 32K, fp16/bf16 from 64K) split over a cluster of 2, 4 or 8 blocks, the clusters
# walking the rows (more rows than clusters: 300): parts of whole chunks and a shorter last one (65544, 32776),
# NaN around the rows (nothing outside written, nothing outside summed), a weight in x's dtype, fp32 or none,
# rstd (rank 0 writes it); the fused add in place. Rows that stay unsplit: the fp32 fused add of 96 KiB, the
# fp16/bf16 fused add, odd fp16/bf16 rows under 128 KiB (bf16 40001).
@pytest.mark.skipif(not runs_clusters(), reason="thread block clusters need compute capability 9.0+")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden,rows,split,add_split", [
    ("float32", 65544, 17, 4, 8), ("float32", 32776, 300, 2, 4), ("float32", 32768, 45, 1, 2),
    ("float32", 24576, 9, 1, 1), ("bfloat16", 65536, 9, 4, 1), ("float16", 65544, 300, 4, 1),
    ("bfloat16", 262144, 5, 8, 1),
    # odd rows (SHIFT, each row's parts from its own shift, the rows' shifts all different)
    ("float32", 40001, 300, 2, 4), ("float32", 32769, 45, 2, 4), ("float32", 65539, 17, 4, 8),
    ("bfloat16", 65539, 300, 4, 1), ("float16", 131075, 9, 8, 1), ("bfloat16", 40001, 9, 1, 1)])
def test_forward_split_rows(rng, monkeypatch, kind, dtype, hidden, rows, split, add_split):
    x_host = random_host((rows, hidden), dtype, rng, scale=3.0)
    _, x = unaligned_view(x_host, dtype, kind, 0, 8)
    _, ref_rstd = reference.rms_norm(x_host, None, 1e-5, return_rstd=True)
    for weight_dtype in (dtype, "float32", None):
        fresh_plans(monkeypatch)
        w_host = None if weight_dtype is None else random_host((hidden,), weight_dtype, rng)
        w = None if weight_dtype is None else to_device(w_host, weight_dtype, kind)
        out_buf, out = unaligned_view(np.full((rows, hidden), np.nan), dtype, kind, 0, 8)
        y, rstd = cupyrope.rms_norm(x, w, 1e-5, offset=0.5, out=out, return_rstd=True)
        assert planned("fwd").split == split, planned("fwd")
        assert_matches(to_host(y), reference.rms_norm(x_host, w_host, 1e-5, 0.5), dtype, scale=3.0)
        np.testing.assert_allclose(to_host(rstd), ref_rstd, rtol=2e-6)
        assert np.isnan(outside_rows(out_buf, 0, hidden)).all(), "wrote outside"
    r_host, w_host = random_host((rows, hidden), dtype, rng), random_host((hidden,), dtype, rng)
    x_buf, x = unaligned_view(x_host, dtype, kind, 0, 8)
    r_buf, r = unaligned_view(r_host, dtype, kind, 0, 8)
    cupyrope.fused_add_rms_norm(x, r, to_device(w_host, dtype, kind), 1e-6)
    assert planned("add").split == add_split, planned("add")
    ref_y, ref_r = reference.fused_add_rms_norm(x_host, r_host, w_host, 1e-6, dtype=dtype)
    np.testing.assert_array_equal(to_host(r), ref_r)
    assert_matches(to_host(x), ref_y, dtype, scale=3.0)
    for buf in (x_buf, r_buf):
        assert np.isnan(outside_rows(buf, 0, hidden)).all(), "wrote outside"


# Forward rows of 2 and 4 chunks a thread: fp16/bf16 held as 32-bit words (shifted and aligned
# rows), aligned rows with the weight loaded early, fp32 too. NaN around the rows, a weight
# in x's dtype or fp32 or none, an offset, rstd; every row checked.
REGISTER_CHUNKS = [(dt, h, 3, slots) for dt in ("bfloat16", "float16")
                   for h, slots in ((2053, 2), (6151, 2), (8195, 4), (12289, 4))]  # shifted


REGISTER_CHUNKS += [(dt, h, 0, slots) for dt in ("bfloat16", "float16") for h, slots in ((4096, 2), (16384, 4))]


REGISTER_CHUNKS += [("float32", h, 0, 4) for h in (1028, 8192)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden,start,slots", REGISTER_CHUNKS)
def test_forward_register_chunks(rng, monkeypatch, kind, dtype, hidden, start, slots):
    rows = 45
    x_host = random_host((rows, hidden), dtype, rng, scale=3.0)
    _, x = unaligned_view(x_host, dtype, kind, start, 8)
    _, ref_rstd = reference.rms_norm(x_host, None, 1e-5, return_rstd=True)
    for weight_dtype in (dtype, "float32", None):
        fresh_plans(monkeypatch)
        w_host = None if weight_dtype is None else random_host((hidden,), weight_dtype, rng)
        w = None if weight_dtype is None else to_device(w_host, weight_dtype, kind)
        out_buf, out = unaligned_view(np.full((rows, hidden), np.nan), dtype, kind, start, 8)
        y, rstd = cupyrope.rms_norm(x, w, 1e-5, offset=0.5, out=out, return_rstd=True)
        plan = planned("fwd")
        assert plan.vectorized and plan.shifted == (start > 0) and plan.slots == slots, plan
        assert_matches(to_host(y), reference.rms_norm(x_host, w_host, 1e-5, 0.5), dtype, scale=3.0)
        np.testing.assert_allclose(to_host(rstd), ref_rstd, rtol=2e-6)
        assert np.isnan(outside_rows(out_buf, start, hidden)).all(), "wrote outside"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden", [61, 1027, 4096, 65536])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add(rng, kind, dtype, hidden):
    rows = 7 if hidden > 4096 else 300
    x_host, r_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), dtype, rng)
    x, r, w = to_device(x_host, dtype, kind), to_device(r_host, dtype, kind), to_device(w_host, dtype, kind)
    out_x, out_r = cupyrope.fused_add_rms_norm(x, r, w, 1e-6)
    assert out_x is x and out_r is r
    ref_y, ref_r = reference.fused_add_rms_norm(x_host, r_host, w_host, 1e-6, dtype=dtype)
    np.testing.assert_array_equal(to_host(r), ref_r)  # exactly one rounding of x + residual
    assert_matches(to_host(x), ref_y, dtype, scale=2.0)


# The fused add with rows of 2+ chunks a thread, aligned and shifted (held row pointers there): x and
# residual are views with NaN around the rows; every row checked, nothing outside written. (Shifted fp16/bf16
# rows past 2 chunks a thread are read twice: test_fused_add_row_cache.)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden,start", [(16384, 0), (4099, 3), (6151, 5), (12289, 5)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_chunks(rng, monkeypatch, kind, dtype, hidden, start):
    fresh_plans(monkeypatch)
    rows, pad = 45, 8
    x_host, r_host = random_host((rows, hidden), dtype, rng, scale=2.0), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), dtype, rng)
    x_buf, x = unaligned_view(x_host, dtype, kind, start, pad)
    r_buf, r = unaligned_view(r_host, dtype, kind, start, pad)
    cupyrope.fused_add_rms_norm(x, r, to_device(w_host, dtype, kind), 1e-6)
    plan = planned("add")
    shifted = start * ITEMSIZE[dtype] % 16 != 0
    read_twice = shifted and ITEMSIZE[dtype] == 2 and hidden > 8190
    assert plan.shifted == shifted and (plan.slots == 0 if read_twice else plan.slots >= 2), plan
    ref_y, ref_r = reference.fused_add_rms_norm(x_host, r_host, w_host, 1e-6, dtype=dtype)
    np.testing.assert_array_equal(to_host(r), ref_r)
    assert_matches(to_host(x), ref_y, dtype, scale=2.0)
    for buf in (x_buf, r_buf):
        assert np.isnan(outside_rows(buf, start, hidden)).all(), "wrote outside"


def two_pass_cache_bytes(dtype, hidden, impl):
    """The row cache of a two-pass fused-add row: its chunks' span (odd rows in 16-byte chunks: from the
    boundary before the row), in whole chunks."""
    itemsize = ITEMSIZE[dtype]
    elems = 16 // itemsize if impl == "auto" else 1
    span = hidden + (elems - 1 if hidden % elems else 0)
    return -(-span // elems) * elems * itemsize


# The fused add of rows read twice (the two-pass loop, slots 0), its rounded sums kept for the output
# pass in the row cache (shared memory, up to 136 KiB here: past the planner's cap) or read back from
# residual: aligned rows, odd ones in shifted 16-byte chunks (every row at another shift) and element
# by element (impl="scalar"), strided, NaN around the rows.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden,start,impl", [("float32", 20000, 0, "auto"), ("bfloat16", 32768, 0, "auto"),
                                                     ("float16", 20001, 0, "auto"), ("bfloat16", 20001, 3, "auto"),
                                                     ("float32", 33001, 1, "auto"), ("float16", 20001, 3, "scalar"),
                                                     ("bfloat16", 8191, 0, "auto")])
@pytest.mark.parametrize("cache", [False, True])
def test_fused_add_row_cache(rng, monkeypatch, kind, dtype, hidden, start, impl, cache):
    use_choices(monkeypatch, rms_norm_forward={"row_cache_max_bytes": 136 * 1024 if cache else 0})
    monkeypatch.setattr(rows_module, "SPLIT_SIZES", ())  # aligned rows: not split over a cluster (GPUs before sm_90)
    rows = 37
    x_host, r_host = random_host((rows, hidden), dtype, rng, scale=2.0), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), "float32", rng)
    x_buf, x = unaligned_view(x_host, dtype, kind, start, 8)
    r_buf, r = unaligned_view(r_host, dtype, kind, start, 8)
    cupyrope.fused_add_rms_norm(x, r, to_device(w_host, "float32", kind), 1e-6, offset=0.25, impl=impl)
    plan = planned("add")
    shifted = impl == "auto" and hidden * ITEMSIZE[dtype] % 16 != 0
    assert plan.slots == 0 and plan.shifted == shifted, plan
    assert plan.shared_mem == (two_pass_cache_bytes(dtype, hidden, impl) if cache else 0), plan
    ref_y, ref_r = reference.fused_add_rms_norm(x_host, r_host, w_host, 1e-6, 0.25, dtype=dtype)
    np.testing.assert_array_equal(to_host(r), ref_r)
    assert_matches(to_host(x), ref_y, dtype, scale=2.0)
    for buf in (x_buf, r_buf):
        assert np.isnan(outside_rows(buf, start, hidden)).all(), "wrote outside"


# Rows on more than 512 threads (forward.FWD_MAX_WIDTH): fp32 aligned rows of 4 and 8 chunks a
# thread, shifted rows of the fused add, shifted rows of the plain forward that 512 threads cannot hold (and
# one they can: it keeps 512); fp16/bf16 rows of the plain forward that 512 threads cannot hold, aligned and
# shifted. The forward out of place (out= a view with NaN around it) with rstd, the fused add in place on
# views with NaN around the rows; every row checked, nothing outside written.
WIDE_ROWS = [("float32", 16384, 0, False, 1024, 4), ("float32", 24576, 0, False, 768, 8),
             ("float32", 32768, 0, False, 1024, 8), ("float32", 20001, 3, False, 640, 8),
             ("float32", 12291, 3, False, 416, 8), ("float32", 16384, 0, True, 1024, 4),
             ("float32", 9000, 0, True, 576, 4), ("float32", 12291, 3, True, 800, 4),
             ("float32", 20001, 3, True, 640, 8), ("bfloat16", 32768, 0, False, 1024, 4),
             ("float16", 24576, 0, False, 768, 4), ("bfloat16", 20001, 3, False, 640, 4),
             ("float16", 16389, 5, False, 544, 4)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden,start,add,threads,slots", WIDE_ROWS)
def test_forward_wide_rows(rng, monkeypatch, kind, dtype, hidden, start, add, threads, slots):
    fresh_plans(monkeypatch)
    rows = 37
    x_host, w_host = random_host((rows, hidden), dtype, rng, scale=2.0), random_host((hidden,), dtype, rng)
    x_buf, x = unaligned_view(x_host, dtype, kind, start, 8)
    w = to_device(w_host, dtype, kind)
    if add:
        r_host = random_host((rows, hidden), dtype, rng)
        r_buf, r = unaligned_view(r_host, dtype, kind, start, 8)
        cupyrope.fused_add_rms_norm(x, r, w, 1e-6, offset=0.25)
        plan, y, written = planned("add"), x, (x_buf, r_buf)
        ref_y, ref_r = reference.fused_add_rms_norm(x_host, r_host, w_host, 1e-6, 0.25, dtype=dtype)
        np.testing.assert_array_equal(to_host(r), ref_r)
    else:
        out_buf, out = unaligned_view(np.full((rows, hidden), np.nan), dtype, kind, start, 8)
        y, rstd = cupyrope.rms_norm(x, w, 1e-6, offset=0.25, out=out, return_rstd=True)
        plan, written = planned("fwd"), (out_buf,)
        ref_y, ref_rstd = reference.rms_norm(x_host, w_host, 1e-6, 0.25, return_rstd=True)
        np.testing.assert_allclose(to_host(rstd), ref_rstd, rtol=2e-6)
    assert plan.block == (threads, 1) and plan.slots == slots and plan.shifted == (start > 0), plan
    assert_matches(to_host(y), ref_y, dtype, scale=2.0)
    for buf in written:
        assert np.isnan(outside_rows(buf, start, hidden)).all(), "wrote outside"


# The plain forward of rows read twice (fp16/bf16 over 32768 elements, fp32 over 32768): aligned rows, odd
# ones in shifted 16-byte chunks and element by element (impl="scalar"); strided, in place and out of
# place (out= a view with NaN around it), rstd returned.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden,start,impl", [("bfloat16", 40000, 0, "auto"), ("float16", 36001, 5, "auto"),
                                                     ("float32", 33001, 1, "auto"), ("bfloat16", 40001, 3, "scalar")])
@pytest.mark.parametrize("in_place", [False, True])
def test_forward_two_pass_rows(rng, monkeypatch, kind, dtype, hidden, start, impl, in_place):
    fresh_plans(monkeypatch)
    monkeypatch.setattr(rows_module, "SPLIT_SIZES", ())  # aligned rows: not split over a cluster (GPUs before sm_90)
    rows = 29
    x_host = random_host((rows, hidden), dtype, rng, scale=3.0)
    w_host = random_host((hidden,), dtype, rng)
    x_buf, x = unaligned_view(x_host, dtype, kind, start, 8)
    out_buf, out = (x_buf, x) if in_place else unaligned_view(np.full((rows, hidden), np.nan), dtype, kind, start, 8)
    y, rstd = cupyrope.rms_norm(x, to_device(w_host, dtype, kind), 1e-5, offset=0.5, out=out, return_rstd=True,
                                impl=impl)
    plan = planned("fwd")
    shifted = impl == "auto" and hidden * ITEMSIZE[dtype] % 16 != 0
    assert plan.slots == 0 and plan.vectorized == (impl == "auto") and plan.shifted == shifted, plan
    assert plan.shared_mem == 0, plan
    assert_matches(to_host(y), reference.rms_norm(x_host, w_host, 1e-5, 0.5), dtype, scale=3.0)
    np.testing.assert_allclose(to_host(rstd), reference.rms_norm(x_host, None, 1e-5, return_rstd=True)[1], rtol=2e-6)
    assert np.isnan(outside_rows(out_buf, start, hidden)).all(), "wrote outside"


@pytest.mark.parametrize("kind", KINDS)
def test_zero_size(kind):
    x = to_device(np.zeros((0, 64)), "float16", kind)
    y, rstd = cupyrope.rms_norm(x, None, return_rstd=True)
    assert tuple(y.shape) == (0, 64) and tuple(rstd.shape) == (0,)
    dx, dw = cupyrope.rms_norm_backward(x, x, to_device(np.ones(64), "float16", kind))
    assert tuple(dx.shape) == (0, 64) and np.all(to_host(dw) == 0)


@requires_torch_cuda
def test_torch_stream_and_cuda_graph(rng):
    import torch

    x_host = random_host((32, 4096), "bfloat16", rng)
    x = to_device(x_host, "bfloat16", "torch")
    w = torch.randn(4096, device="cuda")
    y = cupyrope.rms_norm(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cupyrope.rms_norm(x, w)
    new = random_host((32, 4096), "bfloat16", rng)
    x.copy_(torch.from_numpy(new))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(to_host(y), reference.rms_norm(new, w.cpu().numpy()), "bfloat16")
