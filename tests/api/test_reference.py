"""The float64 references against textbook formulas, their argument checks, and host cos/sin tables (CPU only)."""

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from helpers import n_gpus


def hf_llama_rope(x, positions, theta, rotary_dim):
    """Hugging Face Llama: q * cos + rotate_half(q) * sin with cos/sin = cat(freqs, freqs)."""
    # theta^(-2i/d) as reference.inv_freq computes it: 1 / theta^(2i/d) differs in the last bit (~1e-12 at 4096)
    inv = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    freqs = positions[:, None].astype(np.float64) * inv
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotate_half = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return np.concatenate([rot * cos + rotate_half * sin, rest], axis=-1)


def gptj_rope(x, positions, theta, rotary_dim):
    """GPT-J: rotate_every_two with sin/cos repeated interleaved."""
    # theta^(-2i/d) as reference.inv_freq computes it: 1 / theta^(2i/d) differs in the last bit (~1e-12 at 4096)
    inv = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    freqs = positions[:, None].astype(np.float64) * inv
    sin = np.repeat(np.sin(freqs), 2, axis=-1)[:, None, :]
    cos = np.repeat(np.cos(freqs), 2, axis=-1)[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = np.stack([-rot[..., 1::2], rot[..., ::2]], axis=-1).reshape(rot.shape)
    return np.concatenate([rot * cos + rotated * sin, rest], axis=-1)


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_neox_matches_hf_rotate_half(rng, rotary_dim):
    x = rng.standard_normal((9, 3, 64))
    pos = rng.integers(0, 4096, 9)
    np.testing.assert_allclose(
        reference.rope(x, pos, theta=500000.0, style="neox", rotary_dim=rotary_dim),
        hf_llama_rope(x, pos, 500000.0, rotary_dim),
        rtol=1e-12, atol=1e-12,
    )


@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_gptj_matches_gptj_formula(rng, rotary_dim):
    x = rng.standard_normal((9, 3, 64))
    pos = rng.integers(0, 4096, 9)
    np.testing.assert_allclose(
        reference.rope(x, pos, style="gptj", rotary_dim=rotary_dim), gptj_rope(x, pos, 10000.0, rotary_dim),
        rtol=1e-12, atol=1e-12,
    )


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_properties(rng, style):
    x = rng.standard_normal((7, 4, 32))
    zero = np.zeros(7, dtype=np.int64)
    np.testing.assert_allclose(reference.rope(x, zero, style=style), x, atol=1e-15)  # position 0: identity
    pos = rng.integers(0, 2**24, 7)
    y = reference.rope(x, pos, style=style)
    np.testing.assert_allclose(reference.rope(y, pos, style=style, inverse=True), x, atol=1e-9)
    pairs = (lambda a: a[..., :16] ** 2 + a[..., 16:] ** 2) if style == "neox" else (lambda a: a[..., ::2] ** 2 + a[..., 1::2] ** 2)
    np.testing.assert_allclose(pairs(y), pairs(x), rtol=1e-12)  # each pair keeps its norm


def test_cache_equals_formula_and_out_of_range_is_nan(rng):
    cache = reference.rope_cache(100, 16, theta=10000.0)
    x = rng.standard_normal((5, 2, 16))
    pos = np.array([0, 3, 99, 100, -1])
    via_cache = reference.rope(x, pos, cos_sin_cache=cache)
    direct = reference.rope(x[:3], pos[:3])
    np.testing.assert_allclose(via_cache[:3], direct, atol=1e-15)
    assert np.isnan(via_cache[3:]).all()


def test_positions_broadcast_from_the_left(rng):
    x = rng.standard_normal((2, 3, 5, 8))  # (B, H, S, D)
    pos = rng.integers(0, 1000, (2, 1, 5))
    out = reference.rope(x, pos)
    for h in range(3):
        np.testing.assert_allclose(out[:, h], reference.rope(x[:, h], pos[:, 0]), atol=1e-15)


def test_rms_norm_definition(rng):
    x = rng.standard_normal((6, 130))
    w = rng.standard_normal(130)
    y, rstd = reference.rms_norm(x, w, eps=1e-5, offset=1.0, return_rstd=True)
    expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * (1.0 + w)
    np.testing.assert_allclose(y, expected, rtol=1e-13)
    np.testing.assert_allclose(rstd, 1 / np.sqrt((x**2).mean(-1) + 1e-5), rtol=1e-13)


def test_rms_norm_backward_matches_torch_autograd(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((5, 61))
    w = rng.standard_normal(61)
    dy = rng.standard_normal((5, 61))
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    y = xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + 1e-6) * (wt + 0.5)
    y.backward(torch.tensor(dy))
    dx, dw = reference.rms_norm_backward(dy, x, w, eps=1e-6, offset=0.5)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dw, wt.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_rms_norm_backward_matches_finite_differences(rng):
    x = rng.standard_normal((3, 7))
    w = rng.standard_normal(7)
    dy = rng.standard_normal((3, 7))
    dx, dw = reference.rms_norm_backward(dy, x, w)
    h = 1e-6
    for idx in [(0, 0), (1, 3), (2, 6)]:
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        numeric = ((reference.rms_norm(xp, w) - reference.rms_norm(xm, w)) * dy).sum() / (2 * h)
        assert abs(numeric - dx[idx]) < 1e-6
    wp, wm = w.copy(), w.copy()
    wp[2] += h
    wm[2] -= h
    numeric = ((reference.rms_norm(x, wp) - reference.rms_norm(x, wm)) * dy).sum() / (2 * h)
    assert abs(numeric - dw[2]) < 1e-6


def test_fused_add_rounds_the_residual_once(rng):
    x = reference.round_to(rng.standard_normal((4, 64)), "bfloat16")
    r = reference.round_to(rng.standard_normal((4, 64)), "bfloat16")
    w = rng.standard_normal(64)
    y, new_r = reference.fused_add_rms_norm(x, r, w, dtype="bfloat16")
    np.testing.assert_array_equal(new_r, reference.round_to(x + r, "bfloat16"))
    np.testing.assert_allclose(y, reference.rms_norm(new_r, w), rtol=1e-13)


def test_add_rms_norm_is_the_fused_add_out_of_place_and_its_backward_adds_the_residual_grad(rng):
    x = reference.round_to(rng.standard_normal((4, 64)), "float16")
    r = reference.round_to(rng.standard_normal((4, 64)), "float16")
    w, dy, ds = rng.standard_normal(64), rng.standard_normal((4, 64)), rng.standard_normal((4, 64))
    y, s = reference.add_rms_norm(x, r, w, dtype="float16")
    fused_y, fused_r = reference.fused_add_rms_norm(x, r, w, dtype="float16")
    np.testing.assert_array_equal(s, fused_r)
    np.testing.assert_array_equal(y, fused_y)
    dx, dw = reference.rms_norm_backward(dy, s, w, residual_grad=ds)
    plain_dx, plain_dw = reference.rms_norm_backward(dy, s, w)
    np.testing.assert_allclose(dx, plain_dx + ds, rtol=1e-14)
    np.testing.assert_array_equal(dw, plain_dw)


@pytest.mark.parametrize("style", reference.STYLES)
@pytest.mark.parametrize("freq_step", [1, 2])
def test_rope_cos_sin_is_rope_at_the_positions_whose_rows_it_holds(rng, style, freq_step):
    """Per-token cos/sin in transformers' halves layout (freq_step 1) or interleaved (2), broadcast over
    heads from the left, rotate exactly as the cache rows at those positions do; partial rotary too."""
    table = reference.rope_cache(500, 32)
    positions = rng.integers(0, 500, (2, 1, 7))
    cos, sin = table[positions][..., :16], table[positions][..., 16:]
    if freq_step == 2:
        cos, sin = cos.repeat(2, -1), sin.repeat(2, -1)
    else:
        cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
    helper = reference.per_token_cos_sin(table, positions, freq_step)
    np.testing.assert_array_equal(helper[0], cos)
    np.testing.assert_array_equal(helper[1], sin)
    x = rng.standard_normal((2, 3, 7, 48))
    for inverse in (False, True):
        got = reference.rope_cos_sin(x, cos, sin, style=style, rotary_dim=32, freq_step=freq_step, inverse=inverse)
        expected = reference.rope(x, positions, style=style, rotary_dim=32, cos_sin_cache=table, inverse=inverse)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-15)


REFERENCE_ERRORS = [
    (lambda: reference.rope(np.zeros((6, 4, 64)), np.zeros(6, np.int64), style="llama"), ValueError,
     "style: expected one of"),
    (lambda: reference.rope(np.zeros((6, 4, 64)), np.zeros(6, np.float32)), TypeError,
     "positions: expected an integer array"),
    (lambda: reference.rope(np.zeros((6, 4, 64)), np.zeros(5, np.int64)), ValueError, r"positions: shape \(5,\)"),
    (lambda: reference.rope(np.zeros((6, 4, 64)), np.zeros(6, np.int64), rotary_dim=33), ValueError,
     "rotary_dim: expected an even number"),
    (lambda: reference.rope(np.zeros((6, 4, 64)), np.zeros(6, np.int64), cos_sin_cache=np.zeros((9, 32))),
     ValueError, "cos_sin_cache: .*narrower"),
    (lambda: reference.rope(np.array(["a"]), np.zeros(1, np.int64)), TypeError, "x: expected an array of numbers"),
    (lambda: reference.rope_cos_sin(np.zeros((2, 64)), np.zeros((2, 32)), np.zeros((2, 32)), freq_step=3),
     ValueError, "freq_step: expected 1"),
    (lambda: reference.rms_norm(np.zeros((2, 64)), np.zeros(32)), ValueError, r"weight: expected shape \(64,\)"),
    (lambda: reference.rms_norm(np.zeros((2, 64)), None, eps=0.0), ValueError, "eps: expected a finite number > 0"),
    (lambda: reference.rms_norm_backward(np.zeros((2, 32)), np.zeros((2, 64))), ValueError,
     r"dy: expected shape \(2, 64\)"),
    (lambda: reference.fused_add_rms_norm(np.zeros((2, 64)), np.zeros((2, 64)), None, dtype="float64"), TypeError,
     "dtype: expected one of"),
]


@pytest.mark.parametrize("call,error,message", REFERENCE_ERRORS, ids=[c[2][:40] for c in REFERENCE_ERRORS])
def test_references_check_their_inputs_as_the_ops_do(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_references_take_any_float_dtype_and_lists():
    x = np.random.default_rng(0).standard_normal((3, 2, 8))
    for dtype in ("float16", "float32", "float64"):
        np.testing.assert_allclose(reference.rope(x.astype(dtype), [0, 1, 2]),
                                   reference.rope(x.astype(dtype).astype(np.float64), np.arange(3)))
    assert reference.rms_norm(x.tolist()).shape == x.shape


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rope_cache_builds_a_numpy_table_with_no_gpu(dtype):
    table = cupyrope.rope_cache(100, 16, 500000.0, dtype=dtype, kind="numpy")
    assert isinstance(table, np.ndarray) and table.shape == (100, 16) and table.dtype.name == dtype
    np.testing.assert_array_equal(table.astype(np.float64),
                                  reference.round_to(reference.rope_cache(100, 16, 500000.0), dtype))


def test_rope_cache_arguments_are_checked():
    with pytest.raises(ValueError, match="kind: expected one of"):
        cupyrope.rope_cache(100, 16, kind="jax")
    with pytest.raises(ValueError, match="device: a NumPy table lives on the host"):
        cupyrope.rope_cache(100, 16, kind="numpy", device=0)
    with pytest.raises(TypeError, match="dtype: expected one of"):
        cupyrope.rope_cache(100, 16, dtype="float64", kind="numpy")
    with pytest.raises(ValueError, match="rotary_dim: expected an even int >= 2"):
        cupyrope.rope_cache(100, 15, kind="numpy")
    with pytest.raises(ValueError, match="device: expected a CUDA device index"):
        cupyrope.rope_cache(100, 16, device="cpu")  # a CuPy table lives on a GPU


@pytest.mark.skipif(n_gpus() > 0, reason="this machine has a GPU")
def test_a_cupy_table_without_a_gpu_says_what_to_pass_instead():
    pytest.importorskip("cupy")
    with pytest.raises(cupyrope.NoGPUError, match="kind='cupy': no CUDA GPU/driver found.*kind='numpy'"):
        cupyrope.rope_cache(100, 16)


def test_e4m3_is_torchs_cast_of_saturated_values():
    """reference.e4m3 gives torch's float8_e4m3fn cast of the value clamped to +-448, bit for bit, over random
    magnitudes, every FP8 value, the midpoints between neighbours (ties to even) and the specials; e4m3_values
    decodes every byte back."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    grid = reference.e4m3_values(np.arange(256, dtype=np.uint8))
    finite = np.sort(grid[np.isfinite(grid)])
    values = np.concatenate([rng.standard_normal(50000) * 2.0 ** rng.uniform(-12, 10, 50000), finite,
                             (finite[1:] + finite[:-1]) / 2, [448.0, 464.0, 479.0, 500.0, -1e30, np.inf, -np.inf]])
    values = values.astype(np.float32)
    expected = torch.from_numpy(np.clip(values, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(reference.e4m3(values.astype(np.float64)), expected)
    assert reference.e4m3(np.nan) == 0x7F
    codes = np.arange(256, dtype=np.uint8)
    decoded = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(reference.e4m3_values(codes), decoded)


def test_rms_norm_fp8_reference_scales():
    """Dynamic scales: max |v| / 448 over a row or group (bounded by scale_ub, at least 1 / (448 * 512)); the
    quantized values' largest magnitude is then 448 exactly where no bound applies."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 256))
    x[2] = 0.0
    v = reference.rms_norm(x[:2], None, 1e-6)
    q, scales = reference.rms_norm_fp8(x, group_size=128)
    np.testing.assert_allclose(scales[:2], np.abs(v).reshape(2, 2, 128).max(-1) / 448)
    np.testing.assert_array_equal(scales[2], [1 / (448 * 512)] * 2)
    np.testing.assert_allclose(np.abs(q[:2]).reshape(2, 2, 128).max(-1), 448)
    q, scales = reference.rms_norm_fp8(x, scale_ub=0.5)
    np.testing.assert_allclose(scales, [0.5 / 448, 0.5 / 448, 1 / (448 * 512)])
