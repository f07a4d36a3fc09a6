"""RoPE on the GPU against the float64 reference: every variant, layouts, streams, graphs."""

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from cupyrope.ops import rope

from helpers import (DTYPES, KINDS, assert_matches, data_ptr, fresh_plans, index_to_device, planned_kernels, poison,
                     poisoned_allocations, random_host, requires_gpu, requires_torch_cuda, to_device, to_host,
                     use_choices)

pytestmark = [pytest.mark.gpu, requires_gpu]

MAX_POS = 2**24


@pytest.fixture(params=["block", "direct"])
def kernel(request, monkeypatch):
    """Runs a test with each RoPE kernel: the block kernel (cos/sin shared by a block's heads) and the
    direct one (one item a thread; what the planner takes for small calls). Returns its name's start."""
    direct = request.param == "direct"
    use_choices(monkeypatch, rope={"direct_max_tokens": 2**31 if direct else 0, "direct_with_cache": direct})
    return "rope_direct_kernel<" if request.param == "direct" else "rope_kernel<"


def made_plans():
    """The kernel names of every RoPE plan made since the kernel fixture (or fresh_plans) ran."""
    return [name for plans in (rope._rope_plans, rope._rope_qk_plans, rope._rope_cos_sin_plans)
            for name in planned_kernels(plans)]


def assert_ran(kernel):
    """Every plan made since the kernel fixture ran that kernel."""
    names = made_plans()
    assert names and all(kernel in name for name in names), names


def run_case(rng, *, dtype, style, source, impl, rotary_dim, in_place, kernel, shape=(37, 3, 128), kind="cupy",
             pos_dtype="int64"):
    """Rotate random x at random positions with cupyrope and compare with the reference."""
    x_host = random_host(shape, dtype, rng)
    cache_host = cache = None
    max_pos = MAX_POS if source == "theta" else 4096
    pos_host = rng.integers(0, max_pos, shape[0]).astype(pos_dtype)
    if source != "theta":
        cache_dtype = "float32" if source == "cache-fp32" else dtype
        cache_host = reference.round_to(reference.rope_cache(max_pos, rotary_dim, 10000.0), cache_dtype)
        cache = to_device(cache_host, cache_dtype, kind)
    x = to_device(x_host, dtype, kind)
    positions = index_to_device(pos_host, kind)
    options = dict(style=style, rotary_dim=rotary_dim, cos_sin_cache=cache, impl=impl)
    if in_place:
        result = cupyrope.rope_(x, positions, **options)
        assert result is x
    else:
        out = poison(to_device(np.zeros(shape), dtype, kind))
        result = cupyrope.rope(x, positions, out=out, **options)
        assert result is out
        np.testing.assert_array_equal(to_host(x), x_host)  # input untouched
    expected = reference.rope(x_host, pos_host, style=style, rotary_dim=rotary_dim, cos_sin_cache=cache_host)
    assert_matches(to_host(result), expected, dtype, what=f"{dtype} {style} {source} {impl}")
    assert_ran(kernel)
    return result


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("impl", ["scalar", "vector"])
@pytest.mark.parametrize("source", ["theta", "cache-fp32", "cache-dtype"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_variant(rng, dtype, style, source, impl, partial, in_place, kernel):
    run_case(rng, dtype=dtype, style=style, source=source, impl=impl, rotary_dim=64 if partial else 128,
             in_place=in_place, kernel=kernel)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims_auto(rng, dtype, style, head_dim, kernel):
    run_case(rng, dtype=dtype, style=style, source="theta", impl="auto", rotary_dim=head_dim, in_place=False,
             shape=(19, 5, head_dim), kernel=kernel)


@pytest.mark.parametrize("pos_dtype", ["int32", "int64"])
@pytest.mark.parametrize("kind", KINDS)
def test_kinds_and_position_dtypes(rng, kind, pos_dtype, kernel):
    result = run_case(rng, dtype="bfloat16", style="neox", source="cache-fp32", impl="auto", rotary_dim=96,
                      in_place=False, shape=(33, 4, 128), kind=kind, pos_dtype=pos_dtype, kernel=kernel)
    assert type(result).__module__.split(".")[0] == kind


def test_in_kernel_cos_sin_is_exact_to_fp32_rounding(rng, kernel):
    """x = (1, ..., 1, 0, ..., 0) rotates to (cos, sin): compare with float64 at positions up to 2^24."""
    n, rotary_dim = 4096, 128
    host = np.concatenate([np.ones((n, 1, 64)), np.zeros((n, 1, 64))], axis=-1)
    pos_host = np.concatenate([[0, 1, MAX_POS - 1, MAX_POS], rng.integers(0, MAX_POS, n - 4)]).astype(np.int64)
    out = to_host(cupyrope.rope(to_device(host, "float32", "cupy"), index_to_device(pos_host, "cupy")))
    angles = pos_host[:, None].astype(np.float64) * reference.inv_freq(rotary_dim)
    exact = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1)[:, None, :]
    err = np.abs(out - exact)
    # fp32 rounding of the result (sincosf's bound is 2 ulp) with an absolute floor of a quarter ulp
    # at 1: the float64 angle itself is only known to ~1e-16 relative (~4e-9 rad at 2^24).
    fp32_ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert np.all(err <= 2 * fp32_ulp + 2.0**-25), f"max error {err.max():.3g} ({(err / fp32_ulp).max():.2f} ulp)"
    assert err.max() < 2.0**-23  # below one fp32 ulp of 1 everywhere
    # Hugging Face's fp32 table (angle rounded in fp32) is far off at large positions: we are not.
    hf_angle = (pos_host[:, None].astype(np.float32) * reference.inv_freq(rotary_dim).astype(np.float32))
    hf_err = np.abs(np.cos(hf_angle.astype(np.float64)) - exact[:, 0, :64]).max()
    assert err.max() < hf_err / 1000
    assert_ran(kernel)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_inverse_undoes_rope(rng, style, kernel):
    host = random_host((29, 4, 64), "float32", rng)
    x = to_device(host, "float32", "cupy")
    pos = index_to_device(rng.integers(0, 100000, 29), "cupy")
    y = cupyrope.rope(x, pos, style=style)
    back = cupyrope.rope(y, pos, style=style, inverse=True)
    np.testing.assert_allclose(to_host(back), host, atol=2e-6)
    expected = reference.rope(host, to_host(pos).astype(np.int64), style=style, inverse=True)
    assert_matches(to_host(cupyrope.rope(x, pos, style=style, inverse=True)), expected, "float32")
    assert_ran(kernel)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_on_fused_qkv_slices_with_gqa(rng, kind, dtype, kernel):
    t, hq, hk, d = 45, 8, 2, 128
    qkv_host = random_host((t, (hq + 2 * hk) * d), dtype, rng)
    qkv = to_device(qkv_host, dtype, kind)
    q = qkv[:, : hq * d].reshape(t, hq, d) if kind == "cupy" else qkv[:, : hq * d].view(t, hq, d)
    k = (qkv[:, hq * d : (hq + hk) * d].reshape(t, hk, d) if kind == "cupy"
         else qkv[:, hq * d : (hq + hk) * d].view(t, hk, d))
    assert (q.strides if kind == "cupy" else q.stride())[0] != hq * d * (q.itemsize if kind == "cupy" else 1)
    pos_host = rng.integers(0, 8192, t)
    cupyrope.rope_qk(q, k, index_to_device(pos_host, kind), style="neox")
    out = to_host(qkv)
    q_ref = reference.rope(qkv_host[:, : hq * d].reshape(t, hq, d), pos_host)
    k_ref = reference.rope(qkv_host[:, hq * d : (hq + hk) * d].reshape(t, hk, d), pos_host)
    assert_matches(out[:, : hq * d].reshape(t, hq, d), q_ref, dtype, what="q")
    assert_matches(out[:, hq * d : (hq + hk) * d].reshape(t, hk, d), k_ref, dtype, what="k")
    np.testing.assert_array_equal(out[:, (hq + hk) * d :], qkv_host[:, (hq + hk) * d :])  # v untouched
    assert_ran(kernel)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["theta", "cache"])
@pytest.mark.parametrize("impl", ["scalar", "vector"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_into_new_arrays(rng, kind, dtype, impl, source, kernel):
    """out="new": q and k (strided column slices of a fused qkv, GQA, partial rotary) rotated into
    new contiguous arrays of the caller's kind; the inputs are left as they were."""
    t, hq, hk, d, rotary_dim = 21, 8, 2, 128, 64
    qkv_host = random_host((t, (hq + 2 * hk) * d), dtype, rng)
    qkv = to_device(qkv_host, dtype, kind)
    q, k = (qkv[:, a * d : b * d].reshape(t, b - a, d) for a, b in ((0, hq), (hq, hq + hk)))
    pos_host = rng.integers(0, 8192, t)
    cache = reference.round_to(reference.rope_cache(8192, rotary_dim, 10000.0), "float32") if source == "cache" else None
    positions, cos_sin_cache = index_to_device(pos_host, kind), cache if cache is None else to_device(cache, "float32", kind)
    with poisoned_allocations(kind, ((t, hq, d), (t, hk, d)), dtype) as poisoned:
        q_out, k_out = cupyrope.rope_qk(q, k, positions, rotary_dim=rotary_dim, impl=impl, out="new",
                                        cos_sin_cache=cos_sin_cache)
    assert {data_ptr(q_out), data_ptr(k_out)} == poisoned
    assert all(type(o).__module__.split(".")[0] == kind and tuple(o.shape) == shape
               for o, shape in ((q_out, (t, hq, d)), (k_out, (t, hk, d))))
    np.testing.assert_array_equal(to_host(qkv), qkv_host)
    for got, x_host in ((q_out, qkv_host[:, : hq * d]), (k_out, qkv_host[:, hq * d : (hq + hk) * d])):
        expected = reference.rope(x_host.reshape(t, -1, d), pos_host, rotary_dim=rotary_dim, cos_sin_cache=cache)
        assert_matches(to_host(got), expected, dtype, what=f"{kind} {dtype} {impl} {source}")
    assert_ran(kernel)


@pytest.mark.parametrize(
    "x_shape,pos_shape,transpose",
    [
        ((3, 17, 4, 64), (3, 17), None),  # (B, S, H, D), positions (B, S)
        ((3, 4, 17, 64), (3, 1, 17), None),  # (B, H, S, D), positions (B, 1, S)
        ((3, 17, 4, 64), (1, 17), None),  # positions shared across the batch
        ((3, 17, 4, 64), (3, 17), (0, 2, 1, 3)),  # a transposed (non-contiguous) view
        ((5, 6, 64), (5, 1), None),
    ],
)
def test_layouts_and_broadcast_positions(rng, x_shape, pos_shape, transpose, kernel):
    import cupy

    host = random_host(x_shape, "float16", rng)
    x = to_device(host, "float16", "cupy")
    if transpose:
        x, host = x.transpose(transpose), host.transpose(transpose)  # (B, H, S, D) view of (B, S, H, D)
        pos_shape = (x_shape[0], 1, x_shape[1])
    pos_host = rng.integers(0, 50000, pos_shape)
    out = cupyrope.rope(x, cupy.asarray(pos_host), style="gptj")
    assert_matches(to_host(out), reference.rope(host, pos_host, style="gptj"), "float16")
    assert_ran(kernel)


@pytest.mark.parametrize("impl", ["vector", "scalar"])
def test_out_of_range_cache_positions_give_nan_and_never_read_outside(rng, kernel, impl):
    host = random_host((6, 2, 64), "float32", rng)
    cache = cupyrope.rope_cache(100, 32)
    pos_host = np.array([0, 99, 100, -1, 2**40, 5])
    out = to_host(cupyrope.rope(to_device(host, "float32", "cupy"), index_to_device(pos_host, "cupy"),
                                rotary_dim=32, cos_sin_cache=cache, impl=impl))
    assert np.isnan(out[2:5, :, :32]).all() and not np.isnan(out[[0, 1, 5]]).any()
    np.testing.assert_array_equal(out[:, :, 32:], host[:, :, 32:])  # the unrotated tail is still copied
    assert_ran(kernel)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl,kernel", [("vector", "rope_kernel<"), ("scalar", "rope_direct_kernel<")])
def test_cache_rows_off_16_byte_boundaries(rng, style, cache_dtype, impl, kernel, monkeypatch):
    """A column-offset cache view (rows off 16-byte boundaries): the same results as an aligned cache. The
    direct kernel reads a 16-byte item's cos/sin as packs, so 16-byte items take the block kernel here
    (which reads any cache element by element); one pair a thread stays in the direct kernel."""
    fresh_plans(monkeypatch)
    shape, rotary_dim, max_pos = (21, 3, 128), 128, 500
    x_host = random_host(shape, "bfloat16", rng)
    table = reference.round_to(reference.rope_cache(max_pos, rotary_dim, 10000.0), cache_dtype)
    padded = np.full((max_pos, rotary_dim + 1), np.nan)
    padded[:, 1:] = table
    cache = to_device(padded, cache_dtype, "cupy")[:, 1:]
    pos_host = rng.integers(0, max_pos, shape[0])
    out = cupyrope.rope(to_device(x_host, "bfloat16", "cupy"), index_to_device(pos_host, "cupy"), style=style,
                        cos_sin_cache=cache, impl=impl)
    assert_matches(to_host(out), reference.rope(x_host, pos_host, style=style, cos_sin_cache=table), "bfloat16")
    assert_ran(kernel)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_cache_matches_reference(kind, dtype):
    cache = cupyrope.rope_cache(1000, 64, 500000.0, dtype=dtype, kind=kind)
    assert type(cache).__module__.split(".")[0] == kind
    np.testing.assert_array_equal(to_host(cache), reference.round_to(reference.rope_cache(1000, 64, 500000.0), dtype))


SCALINGS = {  # Llama 3.1's, and DeepSeek-V3's YaRN (its attention factor scales cos and sin)
    "llama3": (500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}),
    "yarn": (10000.0, {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707,
                       "mscale_all_dim": 1.0}),
}


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_scaled_cache(rng, kind, cache_dtype, scaling, kernel):
    """rope_cache(scaling=...) on the device equals the float64 table rounded once, and rotates like it."""
    theta, config = SCALINGS[scaling]
    max_pos, shape = 20000, (19, 5, 128)
    cache = cupyrope.rope_cache(max_pos, 128, theta, scaling=config, dtype=cache_dtype, kind=kind)
    table = reference.round_to(reference.rope_cache(max_pos, 128, theta, config), cache_dtype)
    np.testing.assert_array_equal(to_host(cache), table)
    x_host = random_host(shape, "bfloat16", rng)
    pos_host = rng.integers(0, max_pos, shape[0])
    out = cupyrope.rope(to_device(x_host, "bfloat16", kind), index_to_device(pos_host, kind), cos_sin_cache=cache)
    assert_matches(to_host(out), reference.rope(x_host, pos_host, cos_sin_cache=table), "bfloat16")
    assert_ran(kernel)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_size_returns_at_once(kind):
    x = to_device(np.zeros((0, 4, 64)), "bfloat16", kind)
    out = cupyrope.rope(x, index_to_device(np.zeros(0, np.int64), kind))
    assert tuple(out.shape) == (0, 4, 64)


def test_cupy_non_default_stream(rng):
    import cupy

    host = random_host((300, 8, 128), "bfloat16", rng)
    pos_host = rng.integers(0, 4096, 300)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = to_device(host, "bfloat16", "cupy")
        out = cupyrope.rope(x, cupy.asarray(pos_host))
        result = cupy.asnumpy(out.astype(cupy.float32), stream=stream)
    stream.synchronize()
    assert_matches(result.astype(np.float64), reference.rope(host, pos_host), "bfloat16")


@requires_torch_cuda
def test_torch_side_stream_and_cuda_graph(rng, kernel):
    import torch

    host = random_host((64, 8, 128), "bfloat16", rng)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = to_device(host, "bfloat16", "torch")
        pos = torch.arange(64, device="cuda") * 37
        out = cupyrope.rope(x, pos)
    torch.cuda.current_stream().wait_stream(side)
    assert_matches(to_host(out), reference.rope(host, np.arange(64) * 37), "bfloat16")

    q = to_device(host, "bfloat16", "torch")
    k = to_device(host[:, :2], "bfloat16", "torch")
    positions = torch.zeros(64, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    cupyrope.rope_qk(q, k, positions)  # compile outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        cupyrope.rope_qk(q, k, positions)
    for _ in range(2):  # replay with fresh inputs copied into the captured buffers
        new_q, new_k = random_host(q.shape, "bfloat16", rng), random_host(k.shape, "bfloat16", rng)
        new_pos = rng.integers(0, 10**6, 64)
        q.copy_(torch.from_numpy(new_q)), k.copy_(torch.from_numpy(new_k)), positions.copy_(torch.from_numpy(new_pos))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(to_host(q), reference.rope(new_q, new_pos), "bfloat16", what="graph q")
        assert_matches(to_host(k), reference.rope(new_k, new_pos), "bfloat16", what="graph k")
    assert_ran(kernel)


# ------------------------------------------------------------------- per-token cos/sin tensors (rope_qk_cos_sin)


@pytest.mark.parametrize("mode", ["out-full", "out-partial", "new-partial", "inplace-partial"])
@pytest.mark.parametrize("impl", ["scalar", "vector"])
@pytest.mark.parametrize("freq_step", [1, 2])
@pytest.mark.parametrize("table_dtype", ["float32", "own"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_cos_sin_every_variant(rng, dtype, style, table_dtype, freq_step, impl, mode, kernel):
    """q (B, Hq, S, D) and k (B, Hk, S, D) rotated by cos/sin (B, 1, S, columns): transformers' call,
    against the reference at the positions whose table rows the tensors hold."""
    rotary_dim = 64 if mode.endswith("partial") else 128
    b, s, d = 2, 19, 128
    table_dtype = dtype if table_dtype == "own" else table_dtype
    table = reference.round_to(reference.rope_cache(4096, rotary_dim, 10000.0), table_dtype)
    pos_host = rng.integers(0, 4096, (b, 1, s))
    cos_host, sin_host = reference.per_token_cos_sin(table, pos_host, freq_step)
    cos, sin = to_device(cos_host, table_dtype, "cupy"), to_device(sin_host, table_dtype, "cupy")
    q_host, k_host = random_host((b, 3, s, d), dtype, rng), random_host((b, 1, s, d), dtype, rng)
    q, k = to_device(q_host, dtype, "cupy"), to_device(k_host, dtype, "cupy")
    options = dict(rotary_dim=rotary_dim, freq_step=freq_step, style=style, impl=impl)
    if mode.startswith("inplace"):
        q_out, k_out = cupyrope.rope_qk_cos_sin(q, k, cos, sin, **options)
        assert q_out is q and k_out is k
    else:
        if mode.startswith("new"):
            with poisoned_allocations("cupy", (q_host.shape, k_host.shape), dtype) as poisoned:
                q_out, k_out = cupyrope.rope_qk_cos_sin(q, k, cos, sin, out="new", **options)
            assert {data_ptr(q_out), data_ptr(k_out)} == poisoned
        else:
            out = tuple(poison(to_device(np.zeros(x.shape), dtype, "cupy")) for x in (q_host, k_host))
            q_out, k_out = cupyrope.rope_qk_cos_sin(q, k, cos, sin, out=out, **options)
            assert q_out is out[0] and k_out is out[1]
        np.testing.assert_array_equal(to_host(q), q_host)  # inputs untouched
        np.testing.assert_array_equal(to_host(k), k_host)
    for got, x_host, name in ((q_out, q_host, "q"), (k_out, k_host, "k")):
        expected = reference.rope(x_host, pos_host, style=style, rotary_dim=rotary_dim, cos_sin_cache=table)
        assert_matches(to_host(got), expected, dtype, what=f"{name} {dtype} {style} {impl} step {freq_step}")
    assert_ran(kernel)
    assert all("TokenRows" in name for name in made_plans())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "q_shape,cos_lead",
    [
        ((2, 4, 9, 128), (1, 1, 9)),  # cos shared by the batch
        ((2, 9, 4, 128), (2, 9, 1)),  # q (B, S, H, D): transformers' unsqueeze_dim=2
        ((9, 4, 128), (9,)),  # (T, H, D) with one row per token
        ((1, 4, 1, 128), (1, 1, 1)),  # decode
    ],
)
def test_rope_qk_cos_sin_layouts(rng, kind, q_shape, cos_lead, kernel):
    table = reference.round_to(reference.rope_cache(512, 128, 10000.0), "bfloat16")
    pos_host = rng.integers(0, 512, cos_lead)
    cos_host, sin_host = reference.per_token_cos_sin(table, pos_host)
    q_host, k_host = random_host(q_shape, "bfloat16", rng), random_host(q_shape, "bfloat16", rng)
    q, k = to_device(q_host, "bfloat16", kind), to_device(k_host, "bfloat16", kind)
    cos, sin = to_device(cos_host, "bfloat16", kind), to_device(sin_host, "bfloat16", kind)
    out = tuple(poison(to_device(np.zeros(q_shape), "bfloat16", kind)) for _ in range(2))
    out = cupyrope.rope_qk_cos_sin(q, k, cos, sin, out=out)
    assert all(type(o).__module__.split(".")[0] == kind for o in out)
    for got, x_host in zip(out, (q_host, k_host)):
        assert_matches(to_host(got), reference.rope(x_host, pos_host, cos_sin_cache=table), "bfloat16")
    assert_ran(kernel)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["new", "out", "inplace"])
@pytest.mark.parametrize("impl", ["scalar", "vector"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_cos_sin_rotates_one_tensor(rng, dtype, style, impl, mode, kind, kernel):
    """rope_cos_sin: Gemma 4's one-tensor call, x (B, S, H, D) with cos/sin (B, S, 1, columns), partial rotary,
    against the reference at the positions whose table rows the tensors hold; the input untouched out of place."""
    shape, rotary_dim = (2, 11, 4, 128), 64
    table = reference.round_to(reference.rope_cache(2048, rotary_dim, 10000.0), "float32")
    pos_host = rng.integers(0, 2048, (2, 11, 1))
    cos, sin = (to_device(t, "float32", kind) for t in reference.per_token_cos_sin(table, pos_host))
    x_host = random_host(shape, dtype, rng)
    x = to_device(x_host, dtype, kind)
    options = dict(rotary_dim=rotary_dim, style=style, impl=impl)
    if mode == "inplace":
        got = cupyrope.rope_cos_sin(x, cos, sin, out=x, **options)
        assert got is x
    else:
        out = poison(to_device(np.zeros(shape), dtype, kind)) if mode == "out" else None
        got = cupyrope.rope_cos_sin(x, cos, sin, out=out, **options)
        assert got is out if out is not None else type(got).__module__.split(".")[0] == kind
        np.testing.assert_array_equal(to_host(x), x_host)
    expected = reference.rope(x_host, pos_host, style=style, rotary_dim=rotary_dim, cos_sin_cache=table)
    assert_matches(to_host(got), expected, dtype, what=f"{dtype} {style} {impl} {mode}")
    assert_ran(kernel)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1, 4])
def test_rope_qk_cos_sin_rows_at_any_alignment(rng, offset, dtype, kernel):
    """Decode (64 sequences) with cos/sin starting `offset` elements into wider rows: each item's cos and sin read
    as one pack where the rows are pack-aligned (offset 0; 4 for fp32's 16 bytes), else one by one."""
    b, d = 64, 64
    table = reference.round_to(reference.rope_cache(1024, d, 10000.0), dtype)
    pos_host = rng.integers(0, 1024, (b, 1, 1))
    cos_host, sin_host = reference.per_token_cos_sin(table, pos_host)
    cos, sin = (to_device(np.pad(t, [(0, 0)] * 3 + [(offset, 0)], constant_values=np.nan), dtype, "cupy")[..., offset:]
                for t in (cos_host, sin_host))
    q_host, k_host = random_host((b, 4, 1, d), dtype, rng), random_host((b, 2, 1, d), dtype, rng)
    q, k = to_device(q_host, dtype, "cupy"), to_device(k_host, dtype, "cupy")
    out = tuple(poison(to_device(np.zeros(x.shape), dtype, "cupy")) for x in (q_host, k_host))
    cupyrope.rope_qk_cos_sin(q, k, cos, sin, out=out)
    for got, x_host in zip(out, (q_host, k_host)):
        assert_matches(to_host(got), reference.rope(x_host, pos_host, cos_sin_cache=table), dtype, what=f"offset {offset}")
    assert_ran(kernel)


@requires_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_cos_sin_torch_gradient_is_the_inverse_rotation(rng, dtype):
    """cupyrope.torch.rope_qk_cos_sin: one launch for q and k forward and backward; the gradient of a
    rotation is the inverse rotation of the incoming gradient."""
    import torch

    import cupyrope.torch as ct

    table = reference.round_to(reference.rope_cache(1000, 64, 10000.0), "float32")
    pos_host = rng.integers(0, 1000, (2, 1, 7))
    cos, sin = (to_device(t, "float32", "torch") for t in reference.per_token_cos_sin(table, pos_host, 2))
    q = to_device(random_host((2, 4, 7, 96), dtype, rng), dtype, "torch").requires_grad_()
    k = to_device(random_host((2, 2, 7, 96), dtype, rng), dtype, "torch").requires_grad_()
    grads_host = [random_host(t.shape, dtype, rng) for t in (q, k)]
    outs = ct.rope_qk_cos_sin(q, k, cos, sin, rotary_dim=64, freq_step=2, style="gptj")
    torch.autograd.backward(outs, [to_device(g, dtype, "torch") for g in grads_host])
    for x, g in zip((q, k), grads_host):
        expected = reference.rope(g, pos_host, style="gptj", rotary_dim=64, cos_sin_cache=table, inverse=True)
        assert_matches(to_host(x.grad), expected, dtype, what="gradient")
