"""Reliability: bad input leaves inputs untouched, fuzzed shapes, threads, NaN/Inf, kernel cache
failures, several GPUs, tensors past 2**31 elements."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from cupyrope._runtime import compile
from helpers import (DTYPES, assert_backward_with_offset, assert_matches, fresh_plans, index_to_device, n_gpus, poison,
                     random_host, requires_gpu, to_device, to_host)

pytestmark = [pytest.mark.gpu, requires_gpu]
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def arrays(rng):
    """Real GPU arguments for the error catalogue."""
    import cupy

    return {
        "x": to_device(random_host((6, 4, 64), "float32", rng), "float32", "cupy"),
        "x16": to_device(random_host((6, 4, 64), "float16", rng), "float16", "cupy"),
        "pos": cupy.arange(6, dtype=cupy.int64),
        "h": to_device(random_host((7, 130), "float32", rng), "float32", "cupy"),
        "w": to_device(random_host((130,), "float32", rng), "float32", "cupy"),
    }


# The "Errors" section of docs/api.md, one entry per documented mistake: (call, exception, message fragment).
CATALOGUE = [
    ("numpy input", lambda a: cupyrope.rope(to_host(a["x"]), a["pos"]), TypeError, "NumPy"),
    ("float64 x", lambda a: cupyrope.rope(a["x"].astype("float64"), a["pos"]), TypeError, "x: expected dtype"),
    ("float positions", lambda a: cupyrope.rope(a["x"], a["pos"].astype("float32")), TypeError, "positions"),
    ("positions shape", lambda a: cupyrope.rope(a["x"], a["pos"][:5]), ValueError, "positions: shape"),
    ("odd rotary_dim", lambda a: cupyrope.rope(a["x"], a["pos"], rotary_dim=31), ValueError, "rotary_dim"),
    ("rotary_dim > head_dim", lambda a: cupyrope.rope(a["x"], a["pos"], rotary_dim=66), ValueError, "rotary_dim"),
    ("narrow cache", lambda a: cupyrope.rope(a["x"], a["pos"], cos_sin_cache=a["x"][0, :2, :32]), ValueError, "narrower"),
    ("out shape", lambda a: cupyrope.rope(a["x"], a["pos"], out=a["x"][:5]), ValueError, "out: expected shape"),
    ("out dtype", lambda a: cupyrope.rope(a["x"], a["pos"], out=a["x16"]), TypeError, "out: expected dtype"),
    ("non-contiguous last dim", lambda a: cupyrope.rope(a["x"][..., ::2], a["pos"]), ValueError, "contiguous"),
    ("bad style", lambda a: cupyrope.rope(a["x"], a["pos"], style="llama"), ValueError, "style"),
    ("q/k head_dim", lambda a: cupyrope.rope_qk(a["x"], a["x16"][..., :32].astype("float32"), a["pos"]), ValueError,
     "head_dim"),
    ("q/k same memory", lambda a: cupyrope.rope_qk(a["x"], a["x"], a["pos"]), ValueError, "overlaps"),
    ("weight shape", lambda a: cupyrope.rms_norm(a["h"], a["w"][:129]), ValueError, "weight: expected shape"),
    ("weight dtype", lambda a: cupyrope.rms_norm(a["x16"], a["w"][:64].astype("float64")), TypeError, "weight"),
    ("eps <= 0", lambda a: cupyrope.rms_norm(a["h"], a["w"], 0.0), ValueError, "eps"),
    ("backward shapes", lambda a: cupyrope.rms_norm_backward(a["h"][:6], a["h"], a["w"]), ValueError, "dy"),
    ("residual shape", lambda a: cupyrope.fused_add_rms_norm(a["h"], a["h"][:6].copy(), a["w"]), ValueError, "residual"),
]


@pytest.mark.parametrize("name,call,error,message", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_input_raises_and_leaves_inputs_untouched(rng, name, call, error, message):
    import cupy

    a = arrays(rng)
    before = {k: cupy.asnumpy(v).tobytes() for k, v in a.items()}
    with pytest.raises(error, match=message):
        call(a)
    cupy.cuda.runtime.deviceSynchronize()
    assert {k: cupy.asnumpy(v).tobytes() for k, v in a.items()} == before


def test_nan_and_inf_propagate_as_ieee_says(rng):
    host = random_host((8, 2, 64), "float32", rng)
    host[1, 0, 3], host[2, 1, 40], host[3, 0, 0] = np.nan, np.inf, -np.inf
    pos = rng.integers(0, 1000, 8)
    with np.errstate(invalid="ignore"):
        expected = reference.rope(host, pos)
        out = to_host(cupyrope.rope(to_device(host, "float32", "cupy"), index_to_device(pos, "cupy")))
        assert np.array_equal(np.isnan(out), np.isnan(expected))
        assert np.array_equal(np.isinf(out), np.isinf(expected))
        rows = random_host((4, 130), "float32", rng)
        rows[1, 5], rows[2, 7] = np.nan, np.inf
        y = to_host(cupyrope.rms_norm(to_device(rows, "float32", "cupy")))
        ref = reference.rms_norm(rows)
    assert np.array_equal(np.isnan(y), np.isnan(ref)) and np.isfinite(y[[0, 3]]).all()


def test_eight_threads_compile_each_variant_once(rng, monkeypatch):
    import cupy

    loads = []
    real_load = compile._load
    monkeypatch.setattr(compile, "_load", lambda *args: loads.append(args) or real_load(*args))
    monkeypatch.setattr(compile, "_kernels", {})
    fresh_plans(monkeypatch)
    hosts = [random_host((33, 3, 64), "float16", rng) for _ in range(8)]
    pos = rng.integers(0, 5000, 33).astype(np.int32)
    results, errors, barrier = [None] * 8, [], threading.Barrier(8)

    def work(i):
        try:
            x = to_device(hosts[i], "float16", "cupy")
            barrier.wait()
            out = cupyrope.rope(x, cupy.asarray(pos), style="gptj")
            cupy.cuda.get_current_stream().synchronize()
            results[i] = to_host(out)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(loads) == 1  # one compile for the one variant all eight threads needed
    for host, out in zip(hosts, results):
        assert_matches(out, reference.rope(host, pos, style="gptj"), "float16")


CACHE_SCRIPT = textwrap.dedent("""
    import warnings, numpy as np, cupyrope, cupy  # cupyrope first: it vets CuPy's cache directory
    from cupyrope import reference
    warnings.simplefilter("always")
    x = np.random.default_rng(0).standard_normal((5, 2, 32)).astype(np.float32)
    pos = np.arange(5) * 1000
    out = cupy.asnumpy(cupyrope.rope(cupy.asarray(x), cupy.asarray(pos), style="gptj", theta=12345.0))
    assert np.allclose(out, reference.rope(x, pos, style="gptj", theta=12345.0), atol=1e-5)
    print("ok")
""")


@pytest.mark.parametrize("damage", ["cache dir is a file", "cache files corrupted"])
def test_broken_kernel_cache_degrades_to_recompiling(tmp_path, damage):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    cache = tmp_path / "cache"
    if damage == "cache dir is a file":
        cache.write_text("not a directory")
    else:
        env["CUPY_CACHE_DIR"] = str(cache)
        subprocess.run([sys.executable, "-c", CACHE_SCRIPT], env=env, check=True, capture_output=True)
        for f in cache.rglob("*"):
            if f.is_file():
                f.write_bytes(b"garbage" * 10)
    env["CUPY_CACHE_DIR"] = str(cache)
    done = subprocess.run([sys.executable, "-c", CACHE_SCRIPT], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.skipif(n_gpus() < 2, reason="needs 2 GPUs (run it on a 2-GPU machine)")
@pytest.mark.multigpu
def test_inputs_on_another_gpu_run_there(rng):
    import cupy
    import torch

    host = random_host((40, 8, 128), "bfloat16", rng)
    pos = rng.integers(0, 8192, 40)
    with cupy.cuda.Device(1):
        x = to_device(host, "bfloat16", "cupy", device=1)
        p = index_to_device(pos, "cupy", device=1)
    assert cupy.cuda.runtime.getDevice() == 0
    out = cupyrope.rope(x, p)
    assert out.device.id == 1 and cupy.cuda.runtime.getDevice() == 0
    assert_matches(to_host(out), reference.rope(host, pos), "bfloat16")
    xt = torch.from_numpy(host).to("cuda:1", torch.bfloat16)
    w = torch.randn(128, device="cuda:1")
    for _ in range(2):  # the same call on cuda:0 first: recalled plans (cupyrope/_runtime/plan_cache.py) know the device
        cupyrope.rms_norm(xt.to("cuda:0"), w.to("cuda:0"))
    y = cupyrope.rms_norm(xt, w)
    assert y.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    assert_matches(to_host(y), reference.rms_norm(host, w.cpu().numpy()), "bfloat16", scale=2.0)
    # Training on cuda:1 through the transformers drop-in and the torch layer: the backward runs in
    # torch's autograd thread for that device, whose first launch binds cuda:1's context.
    import cupyrope.torch as ct
    from cupyrope import dropin

    table = reference.round_to(reference.rope_cache(8192, 128), "bfloat16")
    cos, sin = (torch.from_numpy(t).to("cuda:1", torch.bfloat16) for t in reference.per_token_cos_sin(table, pos[None]))
    q_host = host.transpose(1, 0, 2)[None]  # (1, 8 heads, 40 tokens, 128): transformers' layout
    q = torch.from_numpy(q_host).to("cuda:1", torch.bfloat16).requires_grad_()
    k = torch.from_numpy(q_host[:, :2].copy()).to("cuda:1", torch.bfloat16).requires_grad_()
    q_out, k_out = dropin.apply_rotary_pos_emb(q, k, cos, sin)
    norm = ct.RMSNorm(128, device="cuda:1", dtype=torch.bfloat16)
    (norm(q_out).float().square().sum() + k_out.float().sum()).backward()
    assert q.grad.device == k.grad.device == norm.weight.grad.device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0
    positions = pos[None, None, :]
    assert_matches(to_host(q_out), reference.rope(q_host, positions, cos_sin_cache=table), "bfloat16")
    # d(sum of k_out)/dk: the inverse rotation of ones
    ones_back = reference.rope(np.ones(k.shape), positions, cos_sin_cache=table, inverse=True)
    assert_matches(to_host(k.grad), ones_back, "bfloat16")
    assert torch.isfinite(q.grad).all() and torch.isfinite(norm.weight.grad).all()


@pytest.mark.skipif(n_gpus() < 2, reason="needs 2 GPUs (run it on a 2-GPU machine)")
@pytest.mark.multigpu
def test_large_backward_on_another_gpu_gives_the_first_gpus_bits(rng):
    # Large backward calls (sm_90+: rounds of clusters) size their grid by the input's own GPU's occupancy
    # query: on cuda:1, with cuda:0 current, dx and dweight match float64 (the backward tests' tolerances) and are
    # cuda:0's bits.
    import cupy

    rows, hidden = 20000, 4096
    dy_host, x_host = (random_host((rows, hidden), "bfloat16", rng) for _ in range(2))
    w_host = random_host((hidden,), "float32", rng)
    results = []
    for device in (1, 0):
        dy, x = (to_device(h, "bfloat16", "cupy", device=device) for h in (dy_host, x_host))
        w = to_device(w_host, "float32", "cupy", device=device)
        dx, dw = cupyrope.rms_norm_backward(dy, x, w, offset=0.25)
        assert dx.device.id == dw.device.id == device and cupy.cuda.runtime.getDevice() == 0
        if device == 1:
            assert_backward_with_offset(dy, x, w, dx, dw, dy_host, x_host, w_host, "bfloat16")
        results.append((to_host(dx), to_host(dw)))
    for first, second in zip(*results):
        np.testing.assert_array_equal(first, second)


@pytest.mark.huge
def test_huge_tensors_past_2_31_elements(rng):
    import cupy

    torch = pytest.importorskip("torch")
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < 14 * 2**30:
        pytest.skip("needs 14 GiB of free GPU memory")
    t, h, d = 537_000, 32, 128  # 2.2e9 bf16 elements
    x = torch.ones((t, h, d), dtype=torch.bfloat16, device="cuda")
    rows = np.sort(rng.choice(t, 64, replace=False))
    rows[-1] = t - 1
    sample = random_host((64, h, d), "bfloat16", rng)
    x[torch.from_numpy(rows).cuda()] = to_device(sample, "bfloat16", "torch")
    pos_host = rng.integers(0, 2**20, t)
    cupyrope.rope_(x, torch.from_numpy(pos_host).cuda())
    assert_matches(to_host(x[torch.from_numpy(rows).cuda()]), reference.rope(sample, pos_host[rows]), "bfloat16")
    del x
    torch.cuda.empty_cache()
    # RMSNorm: 2**21 + 3 rows of 1024 (> 2**31 elements), then 2**31 + 5 rows of one element.
    for n_rows, hidden in ((2**21 + 3, 1024), (2**31 + 5, 1)):
        check_huge_rms_norm(cupy, rng, n_rows, hidden)
        cupy.get_default_memory_pool().free_all_blocks()


def check_huge_rms_norm(cupy, rng, n_rows, hidden):
    """Forward, backward (dweight summed over every row) and fused add of n_rows constant fp16 rows, four of them
    random (the first two, the middle one, the last) and one constant row checked as well."""
    picked = np.array([0, 1, n_rows // 2, n_rows - 2, n_rows - 1])  # n_rows - 2 stays constant
    at = cupy.asarray(picked)
    part = random_host((5, hidden), "float16", rng)
    part[3] = 2.0
    x = cupy.full((n_rows, hidden), 2.0, dtype=cupy.float16)
    x[at] = cupy.asarray(part.astype(np.float16))
    y = cupyrope.rms_norm(x)
    assert_matches(to_host(y[at]), reference.rms_norm(part), "float16")
    del y
    w_host = random_host((hidden,), "float32", rng)  # fp32: dweight sums past fp16's range
    dy_part = random_host((5, hidden), "float16", rng)
    dy_part[3] = 0.5
    dy = cupy.full((n_rows, hidden), 0.5, dtype=cupy.float16)
    dy[at] = cupy.asarray(dy_part.astype(np.float16))
    dx, dw = cupyrope.rms_norm_backward(dy, x, to_device(w_host, "float32", "cupy"))
    ref_dx, ref_dw = reference.rms_norm_backward(dy_part, part, w_host)
    # dx is a difference of two terms (nearly cancelling for one element a row): tolerance from the first one's size.
    rstd = reference.rms_norm(part, None, return_rstd=True)[1]
    assert_matches(to_host(dx[at]), ref_dx, "float16", scale=np.abs(dy_part * w_host * rstd[:, None]).max())
    # dweight: the 5 rows above plus n_rows - 5 more constant rows, each adding 0.5 * 2 * rstd(2.0) per column.
    constant = (n_rows - 5) * 0.5 * 2.0 / np.sqrt(4.0 + 1e-6)
    np.testing.assert_allclose(to_host(dw).astype(np.float64), ref_dw + constant, rtol=2e-3)
    del dy, dx, dw
    residual = cupy.full((n_rows, hidden), 1.0, dtype=cupy.float16)
    res_part = random_host((5, hidden), "float16", rng)
    res_part[3] = 1.0
    residual[at] = cupy.asarray(res_part.astype(np.float16))
    x.fill(1.0)
    x[at] = cupy.asarray(part.astype(np.float16))
    cupyrope.fused_add_rms_norm(x, residual, to_device(w_host, "float32", "cupy"))
    ref_x, ref_residual = reference.fused_add_rms_norm(part, res_part, w_host, dtype="float16")
    np.testing.assert_array_equal(to_host(residual[at]), ref_residual)
    assert_matches(to_host(x[at]), ref_x, "float16", scale=2.0)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES), style=st.sampled_from(["neox", "gptj"]), half=st.integers(1, 64),
    rot_frac=st.sampled_from([1.0, 0.5, 0.25]), tokens=st.integers(0, 70), heads=st.integers(1, 6),
    layout=st.sampled_from(["contiguous", "strided heads", "transposed"]), in_place=st.booleans(),
    cache=st.booleans(), pos_dtype=st.sampled_from(["int32", "int64"]), seed=st.integers(0, 2**32 - 1),
)
def test_fuzz_rope(dtype, style, half, rot_frac, tokens, heads, layout, in_place, cache, pos_dtype, seed):
    import cupy

    rng = np.random.default_rng(seed)
    head_dim = 2 * half
    rotary_dim = max(2, int(head_dim * rot_frac) // 2 * 2)
    if layout == "strided heads":  # heads as a column slice of a wider (tokens, 2 * heads * D) buffer
        wide = random_host((tokens, 2 * heads * head_dim), dtype, rng)
        buf = to_device(wide, dtype, "cupy")
        x, host = buf[:, : heads * head_dim].reshape(tokens, heads, head_dim), wide[:, : heads * head_dim].reshape(
            tokens, heads, head_dim)
    elif layout == "transposed":  # (heads, tokens, D) memory viewed as (tokens, heads, D)
        base = random_host((heads, tokens, head_dim), dtype, rng)
        x, host = to_device(base, dtype, "cupy").transpose(1, 0, 2), base.transpose(1, 0, 2)
    else:
        host = random_host((tokens, heads, head_dim), dtype, rng)
        x = to_device(host, dtype, "cupy")
    pos = rng.integers(0, 3000 if cache else 2**24, tokens).astype(pos_dtype)
    table = reference.rope_cache(3000, rotary_dim).astype(np.float32) if cache else None
    options = dict(style=style, rotary_dim=rotary_dim, cos_sin_cache=cupy.asarray(table) if cache else None)
    out = x if in_place else poison(cupy.empty(x.shape, x.dtype))
    cupyrope.rope(x, cupy.asarray(pos), out=out, **options)
    expected = reference.rope(host, pos, style=style, rotary_dim=rotary_dim, cos_sin_cache=table)
    assert_matches(to_host(out), expected, dtype)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES), hidden=st.integers(1, 5000), rows=st.integers(0, 40), pad=st.sampled_from([0, 8, 3]),
    weight=st.sampled_from(["none", "float32", "same"]), offset=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**32 - 1),
)
def test_fuzz_rms_norm(dtype, hidden, rows, pad, weight, offset, seed):
    rng = np.random.default_rng(seed)
    wide = random_host((rows, hidden + pad), dtype, rng)
    x = to_device(wide, dtype, "cupy")[:, :hidden]
    w_dtype = dtype if weight == "same" else "float32"
    w_host = None if weight == "none" else random_host((hidden,), w_dtype, rng)
    w = None if w_host is None else to_device(w_host, w_dtype, "cupy")
    y = cupyrope.rms_norm(x, w, 1e-5, offset=offset)
    assert_matches(to_host(y), reference.rms_norm(wide[:, :hidden], w_host, 1e-5, offset), dtype, scale=2.0)
    if rows and w is not None:
        dy_host = random_host((rows, hidden), dtype, rng)
        dx, dw = cupyrope.rms_norm_backward(to_device(dy_host, dtype, "cupy"), x, w, eps=1e-5, offset=offset)
        ref_dx, ref_dw = reference.rms_norm_backward(dy_host, wide[:, :hidden], w_host, 1e-5, offset)
        # dx is a difference of two terms (tiny for small rows): tolerance from the first term's size.
        rstd = reference.rms_norm(wide[:, :hidden], None, 1e-5, return_rstd=True)[1]
        term = np.abs(dy_host * (w_host + offset) * rstd[:, None]).max()
        assert_matches(to_host(dx), ref_dx, dtype, scale=term)
        np.testing.assert_allclose(to_host(dw), ref_dw, rtol=2e-2, atol=2e-2 * np.abs(ref_dw).max() + 1e-6)
