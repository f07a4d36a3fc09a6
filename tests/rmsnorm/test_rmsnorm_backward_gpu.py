"""RMSNorm backward on the GPU against the float64 reference: every kernel (register rows, staged, LEAN, one
cluster, rounds of clusters, read twice from shared memory, split over a cluster), odd rows, dweight bitwise
deterministic."""

import math

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from cupyrope._runtime.arrays import ITEMSIZE
from cupyrope.ops import rmsnorm_plan_backward as backward
from cupyrope.ops import rmsnorm_rows as rows_module
from cupyrope.reference import ulp
from helpers import (DTYPES, KINDS, assert_backward_with_offset, assert_matches, random_host, requires_gpu,
                     to_device, to_host, unaligned_view, use_choices)
from norm_helpers import fill_next_allocation_with_nan, fresh_plans, planned, runs_clusters, sample_rows, strided_rows

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.mark.parametrize("hidden", [1, 61, 130, 1027, 4096, 16384, 65536])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(rng, dtype, hidden):
    rows = 8192 if hidden <= 4096 else 64
    weight_dtype = "float32" if hidden % 2 else dtype
    x_host = random_host((rows, hidden), dtype, rng)
    dy_host = random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), weight_dtype, rng)
    x, dy, w = (to_device(a, t, "cupy") for a, t in ((x_host, dtype), (dy_host, dtype), (w_host, weight_dtype)))
    _, rstd = cupyrope.rms_norm(x, w, return_rstd=True)
    for given in (None, rstd):
        dx, dw = cupyrope.rms_norm_backward(dy, x, w, rstd=given, offset=0.5)
        ref_dx, ref_dw = reference.rms_norm_backward(dy_host, x_host, w_host, offset=0.5)
        dx_host = to_host(dx)
        assert not np.isnan(dx_host).any()
        idx = sample_rows(rows, rng)
        rstd_ref = reference.rms_norm(x_host, None, return_rstd=True)[1]
        scale = np.abs(dy_host * (w_host + 0.5) * rstd_ref[:, None]).max()  # dx's first term (cancellation)
        assert_matches(dx_host[idx], ref_dx[idx], dtype, scale=scale, what="dx")
        # dweight sums `rows` fp32 terms: tolerance from the sum of their magnitudes.
        terms = np.abs(dy_host * x_host * reference.rms_norm(x_host, None, return_rstd=True)[1][:, None]).sum(0)
        tol = 4e-6 * terms + (0 if weight_dtype == "float32" else ulp(ref_dw, weight_dtype))
        err = np.abs(to_host(dw) - ref_dw)
        assert np.all(err <= tol), f"dweight: worst {err.max():.3g}"


def poisoned_backward(monkeypatch, kind, dy, x, w, rstd, dtype, weight_dtype):
    """rms_norm_backward(dy, x, w, rstd, offset=0.25) planned afresh, into NaN-filled dx and dweight blocks: (dx,
    dweight, the plan it took)."""
    fresh_plans(monkeypatch)
    fill_next_allocation_with_nan(tuple(x.shape), dtype, kind)
    fill_next_allocation_with_nan((x.shape[-1],), weight_dtype, kind)
    dx, dw = cupyrope.rms_norm_backward(dy, x, w, rstd=rstd, offset=0.25)
    return dx, dw, planned("bwd")


def assert_backward_given_rstd_without_weight(dy, x, dy_host, x_host, dtype, kind):
    """rms_norm_backward(dy, x, None, rstd=rms_norm's rstd): no dweight, and every row of dx against float64."""
    _, rstd = cupyrope.rms_norm(x, None, return_rstd=True)
    fill_next_allocation_with_nan(dy_host.shape, dtype, kind)
    dx, dw = cupyrope.rms_norm_backward(dy, x, None, rstd=rstd)
    ref_dx, _ = reference.rms_norm_backward(dy_host, x_host, None)
    rstd_ref = reference.rms_norm(x_host, None, return_rstd=True)[1]
    assert dw is None
    assert_matches(to_host(dx), ref_dx, dtype, scale=np.abs(dy_host * rstd_ref[:, None]).max(), what="dx")


def force_lean(monkeypatch, lean):
    """The staged backward's LEAN variant wherever it applies, or nowhere (and never the one-cluster kernel, which
    takes small calls: test_backward_one_cluster)."""
    limits = {slots: math.inf if lean and limit else 0 for slots, limit in backward.STAGED_LEAN_MAX_ROWS.items()}
    monkeypatch.setattr(backward, "STAGED_LEAN_MAX_ROWS", limits)
    use_choices(monkeypatch, rms_norm_backward={"one_cluster_max_rows": 0})


def assert_lean(plan, lean):
    lean = (lean and backward.STAGED_LEAN_MAX_ROWS[plan.slots] > 0
            and plan.block[0] <= backward.STAGED_LEAN_MAX_THREADS[plan.slots])
    assert plan.staged and plan.name.endswith(", true, false>" if lean else ", false, false>"), plan


# The staged backward (rows copied ahead into shared memory, one row per block): 1, 2 or 4 slots, 128 to
# 1024 threads (whole warps, not only powers of two), 1 to 3 stages; more rows than blocks (the
# lookahead runs past the last row); strided rows; the LEAN variant (1 chunk a thread; fp16/bf16 rows of
# 2 on up to 512 threads, hidden 5120 and 8192; fp32 rows of 4) and the other.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden,rows,pad", [(1024, 3001, 0), (2048, 133, 8), (8192, 1, 0), (8192, 2999, 0),
                                             (3072, 700, 16), (5120, 301, 24)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lean", [False, True])
def test_backward_staged_rows(rng, monkeypatch, kind, dtype, hidden, rows, pad, lean):
    force_lean(monkeypatch, lean)
    x_host = random_host((rows, hidden), dtype, rng)
    dy_host = random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), dtype, rng)
    x = strided_rows(x_host, dtype, kind, pad) if pad else to_device(x_host, dtype, kind)
    dy = strided_rows(dy_host, dtype, kind, pad) if pad else to_device(dy_host, dtype, kind)
    w = to_device(w_host, dtype, kind)
    _, rstd = cupyrope.rms_norm(x, w, return_rstd=True)
    rstd_ref = reference.rms_norm(x_host, None, return_rstd=True)[1]
    for weight, given in ((w, None), (w, rstd), (None, rstd)):
        fill_next_allocation_with_nan((rows, hidden), dtype, kind)
        dx, dw = cupyrope.rms_norm_backward(dy, x, weight, rstd=given)
        if planned("bwd").staged:  # fp32 rows of up to 2 chunks a thread take the register prefetch
            assert_lean(planned("bwd"), lean)
        ref_dx, ref_dw = reference.rms_norm_backward(dy_host, x_host, w_host if weight is not None else None)
        scale = np.abs(dy_host * (w_host if weight is not None else 1) * rstd_ref[:, None]).max()
        assert_matches(to_host(dx), ref_dx, dtype, scale=scale, what="dx")  # every row
        if weight is None:
            assert dw is None
            continue
        terms = np.abs(dy_host * x_host * rstd_ref[:, None]).sum(0)
        err = np.abs(to_host(dw) - ref_dw)
        assert np.all(err <= 4e-6 * terms + ulp(ref_dw, dtype)), f"dweight: worst {err.max():.3g}"


# rms_norm_bwd_reread (rows the registers cannot hold with their dweight sums: fp16/bf16 of 16K-32K
# elements, fp32 of 16K-~29K; fp16/bf16 rows that would leave most of 1024 x 2 slots empty, 8193-~10200; the
# row read twice from its stage, one row copied ahead): whole warps, strided
# rows, a last thread with a part of its chunks, more rows than blocks; given rstd, no weight; every row
# checked, dweight bitwise equal over two runs.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden,rows,pad", [
    ("bfloat16", 32768, 301, 0), ("float16", 24576, 133, 8), ("float32", 20480, 257, 0), ("bfloat16", 18432, 700, 16),
    ("bfloat16", 24576, 290, 0), ("float32", 17000, 199, 4), ("float16", 8200, 2001, 8)])
def test_backward_reread_rows(rng, monkeypatch, kind, dtype, hidden, rows, pad):
    fresh_plans(monkeypatch)
    x_host, dy_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), "float32", rng)
    x = strided_rows(x_host, dtype, kind, pad) if pad else to_device(x_host, dtype, kind)
    dy = strided_rows(dy_host, dtype, kind, pad) if pad else to_device(dy_host, dtype, kind)
    w = to_device(w_host, "float32", kind)
    fill_next_allocation_with_nan((rows, hidden), dtype, kind)
    dx, dw = cupyrope.rms_norm_backward(dy, x, w, offset=0.25)
    plan = planned("bwd")
    assert plan.reread and plan.name.endswith(", 1, false, false>") and plan.grid < rows, plan
    assert_backward_with_offset(dy, x, w, dx, dw, dy_host, x_host, w_host, dtype)
    assert_backward_given_rstd_without_weight(dy, x, dy_host, x_host, dtype, kind)


# rms_norm_bwd_cluster (sm_90+): small calls with a weight in one launch, one cluster of 8 blocks (up to 8 rows) or 16
# (a non-portable size: more rows) reducing dweight over distributed shared memory. Fewer rows than blocks (idle
# blocks add zeros), one to 4-8 rows a block (64), strided and odd rows (SHIFT: each row at another offset from a
# 16-byte boundary), 1, 2 and 4 chunks a thread, a weight in x's dtype or fp32, given rstd, an offset; every row of dx
# against float64 (rstd recomputed), dweight poisoned first, and dx and dweight bitwise equal to the two-launch path
# (the staged kernel on as many blocks, then rms_norm_dw: the same additions in the same order).
@pytest.mark.skipif(not runs_clusters(), reason="thread block clusters need compute capability 9.0+")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden,rows,pad_or_start,weight_dtype", [
    ("bfloat16", 4096, 1, 0, "bfloat16"), ("float16", 1024, 5, 8, "float32"), ("bfloat16", 8192, 64, 0, "float32"),
    ("float32", 8192, 9, 4, "float32"), ("float32", 5120, 64, 0, "float32"), ("bfloat16", 1027, 13, 8, "float32"),
    ("float16", 2053, 64, 0, "float16"), ("float16", 3072, 8, 0, "float16"), ("bfloat16", 5120, 33, 16, "bfloat16"),
    ("bfloat16", 4096, 16, 0, "float32"), ("float16", 2053, 11, 8, "float32"), ("float32", 8192, 16, 0, "float32")])
def test_backward_one_cluster(rng, monkeypatch, kind, dtype, hidden, rows, pad_or_start, weight_dtype):
    # the kernel over more rows than the planner gives it
    use_choices(monkeypatch, rms_norm_backward={"one_cluster_max_rows": 64})
    x_host, dy_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), weight_dtype, rng)
    if hidden % 2:  # odd rows: columns pad_or_start ... of rows of hidden + 16
        _, x = unaligned_view(x_host, dtype, kind, pad_or_start, 16)
        _, dy = unaligned_view(dy_host, dtype, kind, pad_or_start, 16)
    else:
        x, dy = (strided_rows(a, dtype, kind, pad_or_start) if pad_or_start else to_device(a, dtype, kind)
                 for a in (x_host, dy_host))
    w = to_device(w_host, weight_dtype, kind)
    _, rstd = cupyrope.rms_norm(x, w, return_rstd=True)
    for given in (None, rstd):
        dx, dw, plan = poisoned_backward(monkeypatch, kind, dy, x, w, given, dtype, weight_dtype)
        blocks = backward.cluster_bwd_blocks(rows)
        assert plan.one_cluster and plan.name.startswith("cupyrope::rms_norm_bwd_cluster<"), plan
        assert plan.grid == blocks and plan.name.endswith(f", {blocks}, false>"), plan
        if given is None:  # (its bitwise check repeats the call without rstd)
            assert_backward_with_offset(dy, x, w, dx, dw, dy_host, x_host, w_host, dtype, weight_dtype)
        with monkeypatch.context() as two_launches:
            two_launches.setattr(backward, "blocks_per_wave", lambda *args: blocks)
            use_choices(two_launches, rms_norm_backward={"one_cluster_max_rows": 0})
            dx_two, dw_two = cupyrope.rms_norm_backward(dy, x, w, rstd=given, offset=0.25)
            plan = planned("bwd")
            assert plan.staged and plan.name.endswith(", true, false>") and plan.grid == min(rows, blocks), plan
        np.testing.assert_array_equal(to_host(dx), to_host(dx_two))
        np.testing.assert_array_equal(to_host(dw), to_host(dw_two))


# rms_norm_bwd_cluster over rounds of clusters (sm_90+): large calls whose staged plan would take the long chain.
# Forced at small sizes (a LEAN limit of 2 rows a block; 2-4 rows a block, so the grid is several rounds of the
# resident clusters), and as the planner takes it (bf16 [20000, 4096], 76 rows a block at one wave); 1 and 2 chunks a
# thread, strided rows, a weight in x's dtype or fp32, given rstd, an offset, a row count that leaves the last cluster
# short. dx and dweight poisoned first and checked against float64 (each row), then a second call gives the same bits.
@pytest.mark.skipif(not runs_clusters(), reason="thread block clusters need compute capability 9.0+")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden,rows,pad,weight_dtype,forced", [
    ("bfloat16", 4096, 2003, 0, "bfloat16", True), ("float16", 8192, 1500, 16, "float32", True),
    ("bfloat16", 1024, 5001, 8, "float32", True), ("float16", 6144, 1200, 0, "float16", True),
    ("bfloat16", 4096, 20000, 0, "bfloat16", False)])
def test_backward_cluster_rounds(rng, monkeypatch, kind, dtype, hidden, rows, pad, weight_dtype, forced):
    if forced:
        monkeypatch.setattr(backward, "STAGED_LEAN_MAX_ROWS", {**backward.STAGED_LEAN_MAX_ROWS, 1: 2, 2: 2})
        monkeypatch.setattr(backward, "CLUSTER_ROUNDS_ROWS", {1: 3, 2: 3})
    x_host, dy_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), weight_dtype, rng)
    x, dy = (strided_rows(a, dtype, kind, pad) if pad else to_device(a, dtype, kind) for a in (x_host, dy_host))
    w = to_device(w_host, weight_dtype, kind)
    _, rstd = cupyrope.rms_norm(x, w, return_rstd=True)
    for given in (None, rstd):
        dx, dw, plan = poisoned_backward(monkeypatch, kind, dy, x, w, given, dtype, weight_dtype)
        blocks = backward.CLUSTER_ROUNDS_BLOCKS
        assert plan.cluster_rounds and plan.name.endswith(f", false, {blocks}, false>") and plan.split == blocks, plan
        assert plan.grid % blocks == 0 and rows / plan.grid <= 2 * backward.CLUSTER_ROUNDS_ROWS[plan.slots], plan
        if given is None:
            assert_backward_with_offset(dy, x, w, dx, dw, dy_host, x_host, w_host, dtype, weight_dtype)
        dx_again, dw_again = cupyrope.rms_norm_backward(dy, x, w, rstd=given, offset=0.25)
        np.testing.assert_array_equal(to_host(dx), to_host(dx_again))
        np.testing.assert_array_equal(to_host(dw), to_host(dw_again))


# rms_norm_bwd_split (sm_90+): aligned rows too long for one block's shared memory (fp16/bf16 over 32K
# elements, fp32 over ~29K) split over a cluster of 2, 4 or 8 blocks, only the row sums crossing blocks: parts of
# whole chunks and a shorter last one (40968, 65544), strided rows (pad). Odd rows (SHIFT) past the shifted reread
# kernel (fp16/bf16 over ~28.6K elements, fp32 over ~18.9K), views into a wider buffer from column `start` with NaN
# around them, every row at another offset: on 2 blocks block 0's part from the row's shift, the others from
# 16-byte boundaries, a cluster's rows sharing one offset (its step a multiple of E); on 4 and 8 parts of
# whole E-column chunks, each at the row's shift, the clusters walking the rows class by class (rows r = k mod E
# share one offset; most clusters here cross a class). The last 4 cases cap the clusters at 3, so that a cluster
# walks rows of 2-5 classes, adding its dweight sums to its partial row at each new class (50 rows of E = 8:
# classes of 6-7 rows against 16-17 a cluster; E = 4: 12-13), and fewer rows than classes (7 of E = 8: classes of
# one row and an empty one). More rows than clusters and fewer, a weight in x's dtype, fp32 or none, given rstd;
# every row checked, dweight bitwise equal over two runs.
@pytest.mark.skipif(not runs_clusters(), reason="thread block clusters need compute capability 9.0+")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden,rows,pad_or_start,weight_dtype,split,max_clusters", [
    ("bfloat16", 65536, 301, 0, "float32", 2, None), ("float16", 40968, 70, 8, "float16", 2, None),
    ("float32", 32768, 199, 4, "float32", 2, None), ("bfloat16", 131072, 40, 0, "bfloat16", 4, None),
    ("float32", 65544, 150, 0, "float32", 4, None), ("bfloat16", 262144, 5, 8, "float32", 8, None),
    ("bfloat16", 30001, 301, 8, "float32", 2, None), ("float16", 40961, 70, 0, "float16", 2, None),  # odd: start
    ("float32", 20001, 199, 4, "float32", 2, None), ("bfloat16", 65539, 40, 0, "bfloat16", 4, None),
    ("float32", 65537, 33, 0, "float32", 4, None), ("bfloat16", 150001, 5, 8, "float32", 8, None),
    ("bfloat16", 65539, 50, 8, "float32", 4, 3), ("float32", 40001, 50, 4, "float32", 4, 3),  # across classes
    ("float16", 65539, 7, 0, "float16", 4, 3), ("bfloat16", 131075, 29, 0, "bfloat16", 8, 3)])
def test_backward_split_rows(rng, monkeypatch, kind, dtype, hidden, rows, pad_or_start, weight_dtype, split,
                             max_clusters):
    fresh_plans(monkeypatch)
    if max_clusters:
        resident = rows_module.resident_clusters
        monkeypatch.setattr(rows_module, "resident_clusters", lambda *args: min(max_clusters, resident(*args)))
    x_host, dy_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), weight_dtype, rng)
    odd = hidden * (4 if dtype == "float32" else 2) % 16 != 0  # rows off 16-byte boundaries
    if odd:
        x, dy = (unaligned_view(h, dtype, kind, pad_or_start, 16)[1] for h in (x_host, dy_host))
    else:
        x, dy = (strided_rows(h, dtype, kind, pad_or_start) if pad_or_start else to_device(h, dtype, kind)
                 for h in (x_host, dy_host))
    w = to_device(w_host, weight_dtype, kind)
    fill_next_allocation_with_nan((rows, hidden), dtype, kind)
    dx, dw = cupyrope.rms_norm_backward(dy, x, w, offset=0.25)
    plan = planned("bwd")
    assert plan.split == split and plan.name.startswith("cupyrope::rms_norm_bwd_split<"), plan
    assert plan.shifted == odd and plan.grid % split == 0 and plan.grid // split <= rows, plan
    assert not max_clusters or plan.grid == max_clusters * split, plan
    assert_backward_with_offset(dy, x, w, dx, dw, dy_host, x_host, w_host, dtype, weight_dtype)
    assert_backward_given_rstd_without_weight(dy, x, dy_host, x_host, dtype, kind)


# rms_norm_bwd_reread of odd rows (SHIFT: fp16/bf16 from ~4090 elements, fp32 from ~4095; up to what a
# stage and the weight's copy hold): every row starts at another offset from a 16-byte boundary, a block's
# rows share one (its grid step a multiple of E), and the weight waits in shared memory from that offset. NaN
# around the rows (views into a wider buffer) shows any column outside a row that gets into the sums; more
# rows than blocks and fewer, a weight in x's dtype, fp32 or none, given rstd.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden,rows,start,weight_dtype", [
    ("bfloat16", 8191, 700, 8, "float32"), ("float16", 12289, 301, 0, "float16"), ("bfloat16", 20001, 199, 8, "bfloat16"),
    ("bfloat16", 28001, 150, 0, "float32"), ("bfloat16", 4099, 5, 0, "float32"), ("float16", 10001, 1001, 8, "float32"),
    ("float32", 4099, 1001, 4, "float32"), ("float32", 16389, 133, 8, "float32"), ("float32", 8191, 100, 0, "float32")])
def test_backward_reread_shifted_rows(rng, monkeypatch, kind, dtype, hidden, rows, start, weight_dtype):
    fresh_plans(monkeypatch)
    x_host, dy_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), weight_dtype, rng)
    _, x = unaligned_view(x_host, dtype, kind, start, 16)
    _, dy = unaligned_view(dy_host, dtype, kind, start, 16)
    w = to_device(w_host, weight_dtype, kind)
    fill_next_allocation_with_nan((rows, hidden), dtype, kind)
    dx, dw = cupyrope.rms_norm_backward(dy, x, w, offset=0.25)
    plan = planned("bwd")
    assert plan.reread and plan.shifted and plan.name.endswith(", 1, true, false>") and plan.grid <= rows, plan
    assert_backward_with_offset(dy, x, w, dx, dw, dy_host, x_host, w_host, dtype, weight_dtype)
    assert_backward_given_rstd_without_weight(dy, x, dy_host, x_host, dtype, kind)


# The staged backward of shifted rows (fp16/bf16 odd hidden sizes of one chunk a thread): each row's first
# 16-byte copy starts before the row and its last one ends at the row's end. NaN around the rows (views
# into a wider buffer; row stride and start a multiple of 16 bytes away from dx's, so the rows shift like dx's)
# shows any column outside a row that gets into the sums, and any write outside dx's rows.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden,rows,start", [(1027, 3001, 8), (1027, 5, 0), (3071, 700, 8), (2053, 133, 0)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lean", [False, True])
def test_backward_staged_shifted_rows(rng, monkeypatch, kind, dtype, hidden, rows, start, lean):
    force_lean(monkeypatch, lean)
    x_host, dy_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), "float32", rng)
    _, x = unaligned_view(x_host, dtype, kind, start, 16)
    _, dy = unaligned_view(dy_host, dtype, kind, start, 16)
    w = to_device(w_host, "float32", kind)
    rstd_ref = reference.rms_norm(x_host, None, return_rstd=True)[1]
    for weight in (w, None):
        fresh_plans(monkeypatch)
        fill_next_allocation_with_nan((rows, hidden), dtype, kind)
        dx, dw = cupyrope.rms_norm_backward(dy, x, weight, offset=0.5)
        plan = planned("bwd")
        assert plan.shifted and plan.staged == (dtype != "float32"), plan
        if plan.staged:
            assert_lean(plan, lean)
        ref_dx, ref_dw = reference.rms_norm_backward(dy_host, x_host, w_host if weight is not None else None, offset=0.5)
        scale = np.abs(dy_host * (w_host + 0.5 if weight is not None else 1) * rstd_ref[:, None]).max()
        assert_matches(to_host(dx), ref_dx, dtype, scale=scale, what="dx")  # every row
        if weight is not None:
            terms = np.abs(dy_host * x_host * rstd_ref[:, None]).sum(0)
            err = np.abs(to_host(dw) - ref_dw)
            assert np.all(err <= 4e-6 * terms), f"dweight: worst {err.max():.3g}"


# Shifted rows (odd hidden sizes: each row starts at another offset from a 16-byte boundary) keep their
# dweight sums and weights in registers: a rows slot revisits rows one grid step apart, which the planner
# keeps a multiple of 16 bytes' elements so that they all share one shift. threads_per_sm=480 makes the
# grid 396 blocks of 160 threads on an H100, rounded to 392 for 16-bit rows (wide rows, 288 threads:
# 132 -> 128); hidden 301 puts 4 rows slots in a block (their sums added in order through shared memory).
@pytest.mark.parametrize("threads_per_sm", [2048, 480])
@pytest.mark.parametrize("hidden", [1027, 301, "wide"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_shifted_rows_revisited(rng, monkeypatch, dtype, hidden, threads_per_sm):
    if hidden == "wide":  # fp32: two chunks a thread; fp16/bf16: rms_norm_bwd_reread (SHIFT)
        hidden = 2051 if dtype == "float32" else 4099

    monkeypatch.setattr(backward, "THREADS_PER_SM", threads_per_sm)
    fresh_plans(monkeypatch)
    rows = 5001 if hidden < 4096 else 1201  # more than a wave of rows slots
    x_host, dy_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), "float32", rng)
    x, dy, w = to_device(x_host, dtype, "cupy"), to_device(dy_host, dtype, "cupy"), to_device(w_host, "float32", "cupy")
    fill_next_allocation_with_nan((rows, hidden), dtype, "cupy")
    dx, dw = cupyrope.rms_norm_backward(dy, x, w, offset=0.25)
    plan = planned("bwd")
    assert plan.shifted and plan.grid * plan.block[1] < rows, plan  # rows are revisited
    assert_backward_with_offset(dy, x, w, dx, dw, dy_host, x_host, w_host, dtype)


@pytest.mark.parametrize("hidden", [4096, 1027])  # dweight sums in registers: aligned / shifted rows
def test_backward_dweight_is_deterministic(rng, hidden):
    x = to_device(random_host((8192, hidden), "bfloat16", rng), "bfloat16", "cupy")
    dy = to_device(random_host((8192, hidden), "bfloat16", rng), "bfloat16", "cupy")
    w = to_device(random_host((hidden,), "float32", rng), "float32", "cupy")
    first = to_host(cupyrope.rms_norm_backward(dy, x, w)[1])
    for _ in range(3):
        np.testing.assert_array_equal(to_host(cupyrope.rms_norm_backward(dy, x, w)[1]), first)


def test_backward_without_weight(rng):
    x_host, dy_host = random_host((5, 130), "float32", rng), random_host((5, 130), "float32", rng)
    dx, dw = cupyrope.rms_norm_backward(to_device(dy_host, "float32", "cupy"), to_device(x_host, "float32", "cupy"))
    assert dw is None
    assert_matches(to_host(dx), reference.rms_norm_backward(dy_host, x_host)[0], "float32")


# The backward of rows read twice from global memory (rms_norm_bwd's two-pass loop). Odd rows in shifted 16-byte
# chunks (only rows past what rms_norm_bwd_reread's stage and weight copy hold: fp16/bf16 over
# 28665 elements with an fp32 weight, over 32761 otherwise, fp32 over 18941 on an H100); aligned rows past a
# stage where no cluster splits them (GPUs before sm_90, rows past 8 parts; SPLIT_SIZES=() here). dweight sums
# in shared memory (shifted: from the block's shift), or by column in the block's partial row past 160 KiB (bf16
# 45001, 49152); more rows than blocks (a block's shifted rows share one shift; the rows of a call have every
# shift: contiguous, as dx is, whose rows must share dy's and x's offsets); every row checked; dweight bitwise
# equal over two runs.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hidden", [("bfloat16", 30001), ("float16", 33001), ("float32", 20001),
                                          ("bfloat16", 45001), ("bfloat16", 49152), ("float32", 36864)])
def test_backward_two_pass_rows(rng, monkeypatch, kind, dtype, hidden):
    fresh_plans(monkeypatch)
    monkeypatch.setattr(rows_module, "SPLIT_SIZES", ())
    rows = 700
    x_host, dy_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), "float32", rng)
    x, dy, w = to_device(x_host, dtype, kind), to_device(dy_host, dtype, kind), to_device(w_host, "float32", kind)
    fill_next_allocation_with_nan((rows, hidden), dtype, kind)
    dx, dw = cupyrope.rms_norm_backward(dy, x, w, offset=0.25)
    plan = planned("bwd")
    shifted = hidden * ITEMSIZE[dtype] % 16 != 0
    assert plan.vectorized and plan.shifted == shifted and not (plan.slots or plan.staged), plan
    assert plan.shared_acc == (hidden < 40000), plan
    assert plan.grid < rows and (not shifted or plan.grid % (16 // ITEMSIZE[dtype]) == 0), plan
    assert_backward_with_offset(dy, x, w, dx, dw, dy_host, x_host, w_host, dtype)
