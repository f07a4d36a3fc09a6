"""cupyrope.torch on CPU tensors runs the GPU path's argument checks and raises its exceptions (the same check
functions), before computing anything; the modules check their constructor arguments; CPU cos/sin tables."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import cupyrope  # noqa: E402
import cupyrope.torch as ct  # noqa: E402
from cupyrope import reference  # noqa: E402

X = (6, 4, 64)


def pos(shape=(6,), dtype=torch.int64):
    return torch.zeros(shape, dtype=dtype)


def x(shape=X, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


CASES = [
    # (call, exception, message fragment): each as the GPU path words it (tests/api/test_errors.py)
    (lambda: ct.rope_qk(x(), x((6, 2, 64)), pos(), style="llama"), ValueError, "style: expected one of"),
    (lambda: ct.rope_qk_(x(), x((6, 2, 64)), pos(), style="llama"), ValueError, "style: expected one of"),
    (lambda: ct.rope(x(), pos(), style="llama"), ValueError, "style: expected one of"),
    (lambda: ct.rope(torch.zeros(X, dtype=torch.int32), pos()), TypeError,
     r"x: expected dtype in \('float32', 'float16', 'bfloat16'\), got int32"),
    (lambda: ct.rope(x(), pos(dtype=torch.float32)), TypeError, "positions: expected an integer array"),
    (lambda: ct.rope(x(), pos((5,))), ValueError, r"positions: shape \(5,\) does not match"),
    (lambda: ct.rope(x(), pos((6, 4, 2))), ValueError, "positions: expected at most 2 dimensions"),
    (lambda: ct.rope(x(), pos(), rotary_dim=33), ValueError, "rotary_dim: expected an even number"),
    (lambda: ct.rope(x(), pos(), theta=-1.0), ValueError, "theta: expected a finite number > 0"),
    (lambda: ct.rope(x(), pos(), cos_sin_cache=torch.zeros(100, 32)), ValueError, r"cos_sin_cache: .*narrower"),
    (lambda: ct.rope(x(), pos(), cos_sin_cache=torch.zeros(100, 64, dtype=torch.float16)), TypeError,
     r"cos_sin_cache: expected dtype float32 \(like x\), got float16"),
    (lambda: ct.rope_qk(x(), x((6, 2, 128)), pos()), ValueError, "k: expected head_dim 64"),
    (lambda: ct.rope_qk(x(), x(dtype=torch.float16), pos()), TypeError, "k: expected dtype float32"),
    (lambda: ct.rope_qk_cos_sin(x(), x(), x((6, 1, 64)), x((6, 1, 64)), freq_step=3), ValueError,
     "freq_step: expected 1"),
    (lambda: ct.rope_qk_cos_sin(x(), x(), x((5, 1, 64)), x((5, 1, 64))), ValueError,
     r"cos: leading dimensions \(5, 1\) do not match q's \(6, 4\)"),
    (lambda: ct.rms_norm(x((4, 64)), torch.ones(64), eps=-1.0), ValueError, "eps: expected a finite number > 0"),
    (lambda: ct.rms_norm(x((4, 64)), torch.ones(64), offset=float("nan")), ValueError, "offset: expected a finite"),
    (lambda: ct.rms_norm(x((4, 64)), torch.ones(32)), ValueError, r"weight: expected shape \(64,\)"),
    (lambda: ct.rms_norm(torch.zeros(4, 64, dtype=torch.int32)), TypeError, "x: expected dtype in"),
    (lambda: ct.rms_norm(x((4, 64), torch.bfloat16), torch.ones(64, dtype=torch.float16)), TypeError,
     r"weight: expected dtype float32 or bfloat16 \(like x\), got float16"),
    (lambda: ct.fused_add_rms_norm(x((4, 64)), x((4, 32)), torch.ones(64)), ValueError,
     r"residual: expected shape \(4, 64\)"),
    (lambda: ct.add_rms_norm(x((4, 64)), x((4, 32)), torch.ones(64)), ValueError,
     r"residual: expected shape \(4, 64\)"),
    (lambda: ct.add_rms_norm(x((4, 64), torch.bfloat16), x((4, 64)), None), TypeError,
     r"residual: expected dtype bfloat16 \(like x\)"),
    (lambda: ct.add_rms_norm(x((4, 64), torch.bfloat16), x((4, 64), torch.bfloat16), None,
                             residual_dtype=torch.float16), ValueError,
     r"residual_dtype: expected None, x's dtype \(torch.bfloat16\) or torch.float32, got torch.float16"),
    (lambda: ct.add_rms_norm(x((4, 64), torch.bfloat16), x((4, 64), torch.float16), None,
                             residual_dtype=torch.float32), TypeError,
     r"residual: expected dtype bfloat16 \(like x\) or float32 \(residual_dtype=torch.float32\), got float16"),
    (lambda: ct.add_rms_norm(x((4, 64), torch.bfloat16), x((4, 32)), None, residual_dtype=torch.float32), ValueError,
     r"residual: expected shape \(4, 64\)"),
    (lambda: ct.add_rms_norm(x((4, 64), torch.bfloat16), x((4, 64)), torch.ones(32), residual_dtype=torch.float32),
     ValueError, r"weight: expected shape \(64,\)"),
    (lambda: ct.add_rms_norm(x((4, 64), torch.bfloat16), x((4, 64)), None, eps=0.0, residual_dtype=torch.float32),
     ValueError, "eps: expected a finite number > 0"),
    (lambda: ct.add_rms_norm(x((4, 64)), x((4, 64)), None, eps=0.0), ValueError, "eps: expected a finite number > 0"),
    (lambda: ct.RMSNorm(64, eps=0.0), ValueError, "eps: expected a finite number > 0"),
    (lambda: ct.RMSNorm(0), ValueError, "hidden_size: expected an int >= 1"),
    (lambda: ct.RotaryEmbedding(63, 128), ValueError, "rotary_dim: head_dim 63 cannot be rotated whole"),
    (lambda: ct.RotaryEmbedding(64, 128, rotary_dim=128), ValueError,
     r"rotary_dim: expected an even number in \[2, min\(head_dim=64"),
    (lambda: ct.RotaryEmbedding(64, 0), ValueError, "max_position: expected an int >= 1"),
    (lambda: ct.RotaryEmbedding(64, 128, style="llama"), ValueError, "style: expected one of"),
    (lambda: ct.RotaryEmbedding(64, 128, theta=0), ValueError, "theta: expected a finite number > 0"),
]


@pytest.mark.parametrize("call,error,message", CASES, ids=[c[2][:40] for c in CASES])
def test_cpu_tensors_get_the_gpu_paths_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_refused_in_place_call_leaves_its_inputs_untouched():
    q, k = x(), x((6, 2, 64))
    before = q.clone(), k.clone()
    with pytest.raises(ValueError, match="style"):
        ct.rope_qk_(q, k, pos(), style="llama")
    with pytest.raises(ValueError, match="k: overlaps q"):
        ct.rope_qk_(q, q, pos())  # in place, q and k are both written
    residual = x()
    with pytest.raises(ValueError, match="eps"):
        ct.fused_add_rms_norm(q, residual, None, eps=-1.0)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_the_cpu_and_gpu_paths_share_their_checks():
    """The torch layer's CPU checks are the GPU path's own functions: the same words for the same mistake."""
    from fakes import FakeCupyArray as A

    with pytest.raises(ValueError) as gpu:
        cupyrope.rope(A(X), A((5,), "int64", ptr=1 << 44))
    with pytest.raises(ValueError) as cpu:
        ct.rope(x(), pos((5,)))
    assert str(gpu.value).replace("cupy", "") == str(cpu.value).replace("torch", "")


def test_cpu_results_still_match_the_reference():
    q, k, p = x((5, 4, 64)), x((5, 2, 64)), torch.tensor([0, 3, 9, 100, 7])
    q_out, k_out = ct.rope_qk(q, k, p, style="gptj", rotary_dim=32)
    for got, t in ((q_out, q), (k_out, k)):
        np.testing.assert_allclose(got.numpy(), reference.rope(t.numpy(), p.numpy(), style="gptj", rotary_dim=32),
                                   rtol=1e-5, atol=1e-5)
    w = torch.randn(64)
    np.testing.assert_allclose(ct.rms_norm(q, w, 1e-6).numpy(), reference.rms_norm(q.numpy(), w.numpy(), 1e-6),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_tables_on_the_cpu(dtype):
    table = ct.rope_cache(64, 32, device="cpu", dtype=dtype)
    assert table.device.type == "cpu" and table.dtype == dtype and table.shape == (64, 32)
    name = str(dtype).removeprefix("torch.")
    expected = reference.round_to(reference.rope_cache(64, 32), name)
    np.testing.assert_array_equal(table.float().numpy(), expected)
    same = cupyrope.rope_cache(64, 32, dtype=dtype, kind="torch", device="cpu")
    assert torch.equal(same, table)
    q = torch.randn(3, 2, 32)
    np.testing.assert_allclose(ct.rope(q, torch.tensor([1, 2, 63]), cos_sin_cache=table.float()).numpy(),
                               reference.rope(q.numpy(), [1, 2, 63], cos_sin_cache=expected), rtol=1e-5, atol=1e-6)


def test_cos_sin_table_devices_are_checked():
    with pytest.raises(ValueError, match="device: expected 'cpu', 'cuda', 'cuda:N'"):
        ct.rope_cache(64, 32, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch has no CUDA device here.*pass device='cpu'"):
            ct.rope_cache(64, 32)


@pytest.mark.parametrize("options", [{}, {"group_size": 64}, {"scale_ub": 0.5}, {"scale": 0.02}])
def test_rms_norm_fp8_on_the_cpu(options):
    """The CPU path: the reference's FP8 bytes (within one step where the value is on a rounding boundary), its scales,
    the residual updated in place; bad input raises the GPU path's errors and leaves the residual as it was."""
    x_, w, r = torch.randn(5, 128, dtype=torch.bfloat16), torch.randn(128), torch.randn(5, 128, dtype=torch.bfloat16)
    r0 = r.clone()
    device = {k: torch.tensor([v]) if k in ("scale", "scale_ub") else v for k, v in options.items()}
    result = ct.rms_norm_fp8(x_, w, residual=r, **device)
    y, scales = (result, None) if "scale" in options else result
    assert y.dtype == torch.float8_e4m3fn and y.shape == x_.shape
    assert torch.equal(r, (x_.float() + r0.float()).to(torch.bfloat16))
    host = {k: np.float32(v) if k in ("scale", "scale_ub") else v for k, v in options.items()}
    q, ref_scales = reference.rms_norm_fp8(x_.float().numpy(), w.numpy(), residual=r0.float().numpy(),
                                           dtype="bfloat16", **host)
    codes = y.view(torch.uint8).numpy().astype(int)
    assert np.abs(codes - reference.e4m3(q).astype(int)).max() <= 1 and np.mean(codes == reference.e4m3(q)) > 0.99
    if scales is not None:
        np.testing.assert_allclose(scales.numpy(), ref_scales, rtol=1e-6)
    with pytest.raises(ValueError, match="group_size: expected a divisor of x's hidden size 96, got 64"):
        ct.rms_norm_fp8(torch.randn(5, 96), group_size=64)
    kept = r.clone()
    with pytest.raises(ValueError, match="scale_ub: bounds dynamic scales only"):
        ct.rms_norm_fp8(x_, w, residual=r, scale=torch.tensor([1.0]), scale_ub=torch.tensor([1.0]))
    assert torch.equal(r, kept)
