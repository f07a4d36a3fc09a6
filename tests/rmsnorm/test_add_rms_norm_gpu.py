"""add_rms_norm (the out-of-place residual add + RMSNorm) and its backward (rms_norm_backward with residual_grad) on
the GPU against the float64 reference: the forward's row paths (element by element, 16-byte, shifted, rows of
several chunks a thread, read twice with and without the row cache, split over a cluster) and the backward's kernels
(register rows, staged, one cluster, rounds of clusters, read twice from shared memory, split over a cluster), with
their outputs poisoned and their inputs checked unchanged."""

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from helpers import (DTYPES, KINDS, assert_matches, data_ptr, poisoned_allocations, random_host, requires_gpu, to_device,
                     to_host, unaligned_view, use_choices)
from norm_helpers import planned, runs_clusters, sample_rows

pytestmark = [pytest.mark.gpu, requires_gpu]

# (rows, hidden) reaching each forward row path: element by element (61), one 16-byte chunk a thread (1027 odd:
# shifted; 4096), rows of 4 chunks (16384), read twice (20001 shifted, 32768), split over a cluster on sm_90+ (65536).
FORWARD_SHAPES = [(300, 61), (300, 1027), (300, 4096), (45, 16384), (37, 20001), (37, 32768), (7, 65536)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", FORWARD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_cache", [False, True])
def test_add_rms_norm(rng, monkeypatch, kind, dtype, rows, hidden, row_cache):
    """y and s = x + residual (exactly one rounding) in new memory that starts out NaN; x and residual unchanged."""
    use_choices(monkeypatch, rms_norm_forward={"row_cache_max_bytes": 136 * 1024 if row_cache else 0})
    x_host, r_host = random_host((rows, hidden), dtype, rng, scale=2.0), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), "float32", rng)
    x, r, w = to_device(x_host, dtype, kind), to_device(r_host, dtype, kind), to_device(w_host, "float32", kind)
    with poisoned_allocations(kind, [(rows, hidden)] * 2, dtype) as blocks:
        y, s, rstd = cupyrope.add_rms_norm(x, r, w, 1e-6, offset=0.25, return_rstd=True)
    assert {data_ptr(y), data_ptr(s)} == blocks, "outputs not in the poisoned blocks"
    assert type(y) is type(x) and type(s) is type(x)
    ref_y, ref_s = reference.add_rms_norm(x_host, r_host, w_host, 1e-6, 0.25, dtype=dtype)
    np.testing.assert_array_equal(to_host(s), ref_s)
    assert_matches(to_host(y), ref_y, dtype, scale=2.0)
    np.testing.assert_allclose(to_host(rstd), reference.rms_norm(ref_s, None, return_rstd=True)[1], rtol=2e-6)
    np.testing.assert_array_equal(to_host(x), x_host)
    np.testing.assert_array_equal(to_host(r), r_host)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,start", [(4096, 0), (1027, 3), (12289, 5)])
def test_add_rms_norm_views(rng, kind, dtype, hidden, start):
    """x and residual as views with NaN around their rows (x shifted from its outputs' 16-byte offsets): the same
    values as the reference, nothing around the rows read into the result, the in-place fused add's bits."""
    rows = 37
    x_host, r_host = random_host((rows, hidden), dtype, rng, scale=2.0), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), dtype, rng)
    w = to_device(w_host, dtype, kind)
    _, x = unaligned_view(x_host, dtype, kind, start, 8)
    _, r = unaligned_view(r_host, dtype, kind, 0, 3)
    y, s = cupyrope.add_rms_norm(x, r, w, 1e-6)
    ref_y, ref_s = reference.add_rms_norm(x_host, r_host, w_host, 1e-6, dtype=dtype)
    np.testing.assert_array_equal(to_host(s), ref_s)
    assert_matches(to_host(y), ref_y, dtype, scale=2.0)
    cupyrope.fused_add_rms_norm(x, r, w, 1e-6)  # in place: the same add and norm
    np.testing.assert_array_equal(to_host(r), to_host(s))


# (rows, hidden, dtype) reaching each backward kernel: register rows (fp32 4096 with prefetch, odd 61 element by
# element), staged (bf16 [8192, 4096]; 2 chunks a thread, [512, 7168]; shifted, 1027), one cluster (bf16 [64, 4096]
# on sm_90+), read twice from shared memory (bf16 [64, 20000], odd [64, 20001]), split over a cluster (bf16 [16,
# 40000], odd fp32 [16, 33001] on sm_90+). Rounds of clusters: test_backward_residual_grad_clusters.
BACKWARD_CASES = [(300, 4096, "float32"), (300, 61, "float32"), (300, 1027, "bfloat16"), (8192, 4096, "bfloat16"),
                  (512, 7168, "bfloat16"), (64, 4096, "bfloat16"), (64, 4096, "float16"), (64, 20000, "bfloat16"),
                  (64, 20001, "float16"), (16, 40000, "bfloat16"), (16, 33001, "float32")]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden,dtype", BACKWARD_CASES)
@pytest.mark.parametrize("weighted", [True, False])
def test_backward_residual_grad(rng, kind, rows, hidden, dtype, weighted):
    """dx = rms_norm's dx + residual_grad, rounded once; dweight bitwise what it is without residual_grad."""
    assert_backward_residual_grad(rng, kind, rows, hidden, dtype, weighted)


# rms_norm_bwd_cluster's GRAD variants (sm_90+), whose stages hold residual_grad beside dy and x: over rounds of
# clusters (forced at small sizes, as test_backward_cluster_rounds does: 1 and 2 chunks a thread, 3 rows a block, a
# short last cluster; the profile's grad_lean_max_rows lowered with the plain limit, so that residual_grad's walk is
# the plain call's and dweight is bitwise the same) and as one cluster.
@pytest.mark.skipif(not runs_clusters(), reason="thread block clusters need compute capability 9.0+")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden,dtype,rounds", [(2003, 4096, "bfloat16", True), (1500, 8192, "float16", True),
                                                      (64, 4096, "bfloat16", False)])
def test_backward_residual_grad_clusters(rng, monkeypatch, kind, rows, hidden, dtype, rounds):
    from cupyrope.ops import rmsnorm_plan_backward as backward

    if rounds:
        monkeypatch.setattr(backward, "STAGED_LEAN_MAX_ROWS", {**backward.STAGED_LEAN_MAX_ROWS, 1: 2, 2: 2})
        monkeypatch.setattr(backward, "CLUSTER_ROUNDS_ROWS", {1: 3, 2: 3})
        use_choices(monkeypatch, rms_norm_backward={"one_cluster_max_rows": 0, "grad_lean_max_rows": 2})
    else:
        use_choices(monkeypatch, rms_norm_backward={"one_cluster_max_rows": 64})
    assert_backward_residual_grad(rng, kind, rows, hidden, dtype, True)
    plan = planned("bwd")
    assert plan.name.startswith("cupyrope::rms_norm_bwd_cluster<") and plan.name.endswith(", true>"), plan
    assert plan.cluster_rounds == rounds and plan.one_cluster != rounds, plan


def assert_backward_residual_grad(rng, kind, rows, hidden, dtype, weighted):
    """rms_norm_backward with residual_grad into poisoned dx against float64 (sampled rows), residual_grad unchanged,
    and dweight bitwise the plain backward's."""
    s_host, dy_host, g_host = (random_host((rows, hidden), dtype, rng) for _ in range(3))
    w_host = random_host((hidden,), "float32", rng) if weighted else None
    s, dy, g = (to_device(a, dtype, kind) for a in (s_host, dy_host, g_host))
    w = to_device(w_host, "float32", kind) if weighted else None
    _, rstd = cupyrope.rms_norm(s, w, 1e-6, offset=0.25, return_rstd=True)
    with poisoned_allocations(kind, [(rows, hidden)], dtype):
        dx, dw = cupyrope.rms_norm_backward(dy, s, w, rstd, 1e-6, 0.25, residual_grad=g)
    ref_dx, ref_dw = reference.rms_norm_backward(dy_host, s_host, w_host, 1e-6, 0.25, residual_grad=g_host)
    rstd_ref = reference.rms_norm(s_host, None, 1e-6, return_rstd=True)[1]
    scale = np.abs(dy_host * ((w_host + 0.25) if weighted else 1.0) * rstd_ref[:, None]).max() + np.abs(g_host).max()
    dx_host = to_host(dx)
    assert not np.isnan(dx_host).any(), "unwritten dx"
    idx = sample_rows(rows, rng)
    assert_matches(dx_host[idx], ref_dx[idx], dtype, scale=scale, what="dx")
    np.testing.assert_array_equal(to_host(g), g_host)
    if weighted:
        plain_dx, plain_dw = cupyrope.rms_norm_backward(dy, s, w, rstd, 1e-6, 0.25)
        np.testing.assert_array_equal(to_host(dw), to_host(plain_dw))
        assert not np.array_equal(to_host(plain_dx), dx_host)
    else:
        assert dw is None


@pytest.mark.skipif(not runs_clusters(), reason="thread block clusters need compute capability 9.0+")
def test_add_rms_norm_split_rows_cluster(rng, monkeypatch):
    """Rows split over a cluster (the forward's rms_norm_fwd_split with ADD): planned, and right."""
    use_choices(monkeypatch, rms_norm_forward={"split_min_row_bytes": 16384})
    rows, hidden, dtype = 9, 40001, "float32"  # the fp16/bf16 fused add is read twice instead (its parts spill)
    x_host, r_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), dtype, rng)
    x, r, w = (to_device(a, dtype, "cupy") for a in (x_host, r_host, w_host))
    y, s = cupyrope.add_rms_norm(x, r, w)
    assert planned("add_out").split > 1, planned("add_out")
    ref_y, ref_s = reference.add_rms_norm(x_host, r_host, w_host, dtype=dtype)
    np.testing.assert_array_equal(to_host(s), ref_s)
    assert_matches(to_host(y), ref_y, dtype)
