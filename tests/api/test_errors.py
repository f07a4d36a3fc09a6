"""Bad input raises a TypeError/ValueError naming the argument and what was expected, before any launch.
Runs without a GPU (array stand-ins); tests/test_errors_gpu.py repeats the catalogue on real arrays."""

import numpy as np
import pytest

import cupyrope
from fakes import FakeCupyArray as A

X = (6, 4, 64)


def pos(shape=(6,), dtype="int64", **kw):
    return A(shape, dtype, **kw)


ROPE_CASES = [
    # (call, exception, message fragment)
    (lambda: cupyrope.rope(np.zeros(X, np.float32), pos()), TypeError, r"x: .*NumPy.*cupy\.asarray"),
    (lambda: cupyrope.rope([1.0], pos()), TypeError, "x: expected a cupy.ndarray or a CUDA torch.Tensor"),
    (lambda: cupyrope.rope(A(X, "float64"), pos()), TypeError, r"x: expected dtype in \('float32', 'float16', 'bfloat16'\), got float64"),
    (lambda: cupyrope.rope(A(X), pos(dtype="float32")), TypeError, "positions: expected an integer array"),
    (lambda: cupyrope.rope(A(X), pos((5,))), ValueError, "positions: shape"),
    (lambda: cupyrope.rope(A(X), pos((6, 4, 2))), ValueError, "positions: expected at most 2 dimensions"),
    (lambda: cupyrope.rope(A(X), pos(), rotary_dim=33), ValueError, "rotary_dim: expected an even number"),
    (lambda: cupyrope.rope(A(X), pos(), rotary_dim=66), ValueError, r"rotary_dim: .*head_dim=64"),
    (lambda: cupyrope.rope(A(X), pos(), rotary_dim=0), ValueError, "rotary_dim"),
    (lambda: cupyrope.rope(A(X), pos(), rotary_dim=2.0), TypeError, "rotary_dim: expected an int"),
    (lambda: cupyrope.rope(A(X), pos(), cos_sin_cache=A((100, 32))), ValueError, r"cos_sin_cache: .*narrower"),
    (lambda: cupyrope.rope(A(X), pos(), cos_sin_cache=A((100, 64), "float16")), TypeError, r"cos_sin_cache: expected dtype float32 \(like x\), got float16"),
    (lambda: cupyrope.rope(A(X), pos(), cos_sin_cache=A((64,))), ValueError, r"cos_sin_cache: expected shape \(max_position, rotary_dim\)"),
    (lambda: cupyrope.rope(A(X), pos(), cos_sin_cache=A((0, 64))), ValueError, r"cos_sin_cache: .*max_position >= 1, got \(0, 64\)"),
    (lambda: cupyrope.rope(A(X), pos(), out=A((6, 4, 32))), ValueError, r"out: expected shape \(6, 4, 64\)"),
    (lambda: cupyrope.rope(A(X), pos(), out=A(X, "float16")), TypeError, "out: expected dtype float32"),
    (lambda: cupyrope.rope(A(X), pos(), out=A(X, device=1)), ValueError, "out: expected a cupy array on cuda:0"),
    (lambda: cupyrope.rope(A(X), pos(device=1)), ValueError, "positions: expected a cupy array on cuda:0"),
    (lambda: cupyrope.rope(A(X, strides=(512, 128, 2)), pos()), ValueError, "x: expected the last dimension to be contiguous"),
    (lambda: cupyrope.rope(A(X), pos(), style="llama"), ValueError, "style: expected one of"),
    (lambda: cupyrope.rope(A(X), pos(), impl="fast"), ValueError, "impl: expected one of"),
    (lambda: cupyrope.rope(A(X), pos(), theta=-1.0), ValueError, "theta: expected a finite number > 0"),
    (lambda: cupyrope.rope(A(X), pos(), inverse="yes"), TypeError, "inverse: expected a bool"),
    (lambda: cupyrope.rope(A(X), pos(), out=A(X, ptr=0x7F0000000000 + 128)), ValueError, "out: overlaps x"),
    (lambda: cupyrope.rope_qk(A(X), A(X, device=1), pos()), ValueError, "k: expected a cupy array on cuda:0"),
    (lambda: cupyrope.rope_qk(A(X), A((6, 2, 128), ptr=1 << 44), pos()), ValueError, "k: expected head_dim 64"),
    (lambda: cupyrope.rope_qk(A(X), A(X, "float16", ptr=1 << 44), pos()), TypeError, "k: expected dtype float32"),
    (lambda: cupyrope.rope_qk(A(X), A(X), pos()), ValueError, "k: overlaps q"),
    (lambda: cupyrope.rope_qk(A(X), A(X, ptr=1 << 44), pos(), out="fresh"), ValueError, "out: expected None \\(in place\\), 'new' or a pair"),
    (lambda: cupyrope.rope_qk(A(X), A(X, ptr=1 << 44), pos(), out=(A(X, ptr=2 << 44),)), TypeError, "out: expected None \\(in place\\), 'new' or a pair"),
    (lambda: cupyrope.rope_qk(A(X), A((6, 2, 128), ptr=1 << 44), pos(), out="new"), ValueError, "k: expected head_dim 64"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), A((6, 1, 64), ptr=3 << 44), freq_step=3, out="new"), ValueError, "freq_step: expected 1"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), A((6, 1, 64), ptr=3 << 44), freq_step=3), ValueError, "freq_step: expected 1"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), A((6, 1, 64), ptr=3 << 44), freq_step=2.0), ValueError, "freq_step: expected 1"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 32), ptr=2 << 44), A((6, 1, 32), ptr=3 << 44), freq_step=2), ValueError, r"cos: expected at least 63 columns"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((5, 1, 64), ptr=2 << 44), A((5, 1, 64), ptr=3 << 44)), ValueError, r"cos: leading dimensions \(5, 1\) do not match q's \(6, 4\)"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), A((6, 1, 64), strides=(128, 64, 1), ptr=3 << 44)), ValueError, "sin: expected the dtype, shape and strides of cos"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X, "float16"), A(X, "float16", ptr=1 << 44), A((6, 1, 64), "bfloat16", ptr=2 << 44), A((6, 1, 64), "bfloat16", ptr=3 << 44)), TypeError, r"cos: expected dtype float16 or float32 \(like q\), got bfloat16"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), np.zeros((6, 1, 64))), TypeError, "sin: .*NumPy"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), None), TypeError, "sin: expected a cupy.ndarray or a CUDA torch.Tensor, got NoneType"),
    (lambda: cupyrope.rope_qk(A(X), A(X, ptr=1 << 44), None), TypeError, "positions: expected an integer array \(int32 or int64\), got None"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), device=1), A((6, 1, 64), device=1)), ValueError, "cos: expected a cupy array on cuda:0"),
    (lambda: cupyrope.rope_cache(0, 64), ValueError, "max_position"),
    (lambda: cupyrope.rope_cache(10, 63), ValueError, "rotary_dim"),
    (lambda: cupyrope.rope_cache(10, 64, dtype="float64"), TypeError, "dtype"),
]

H = (7, 130)
NORM_CASES = [
    (lambda: cupyrope.rms_norm(np.ones(H, np.float32)), TypeError, "x: .*NumPy"),
    (lambda: cupyrope.rms_norm(A(H, "int32")), TypeError, "x: expected dtype"),
    (lambda: cupyrope.rms_norm(A(H), A((129,))), ValueError, r"weight: expected shape \(130,\)"),
    (lambda: cupyrope.rms_norm(A(H, "float16"), A((130,), "bfloat16")), TypeError, "weight: expected dtype float32 or float16"),
    (lambda: cupyrope.rms_norm(A(H), A((130,)), eps=0.0), ValueError, "eps: expected a finite number > 0"),
    (lambda: cupyrope.rms_norm(A(H), A((130,)), eps=-1e-6), ValueError, "eps"),
    (lambda: cupyrope.rms_norm(A(H), A((130,)), offset=float("nan")), ValueError, "offset"),
    (lambda: cupyrope.rms_norm(A(H), A((130,), device=1)), ValueError, "weight: expected a cupy array on cuda:0"),
    (lambda: cupyrope.rms_norm(A(H), out=A((7, 131))), ValueError, "out: expected shape"),
    (lambda: cupyrope.rms_norm_backward(A((7, 131)), A(H), A((130,))), ValueError, r"dy: expected shape \(7, 130\)"),
    (lambda: cupyrope.rms_norm_backward(A(H, "float16"), A(H), A((130,))), TypeError, "dy: expected dtype float32"),
    (lambda: cupyrope.rms_norm_backward(A(H, ptr=1 << 44), A(H), A((130,)), rstd=A((6,))), ValueError, r"rstd: expected shape \(7,\)"),
    (lambda: cupyrope.rms_norm_backward(A(H, ptr=1 << 44), A(H), A((130,)), rstd=A((7,), "float16")), TypeError, "rstd: expected dtype float32"),
    (lambda: cupyrope.fused_add_rms_norm(A(H), A((7, 129), ptr=1 << 44), A((130,))), ValueError, "residual: expected shape"),
    (lambda: cupyrope.fused_add_rms_norm(A(H), A(H), A((130,))), ValueError, "residual: overlaps x"),
    (lambda: cupyrope.fused_add_rms_norm(A(H), A(H, "bfloat16", ptr=1 << 44), A((130,))), TypeError, "residual: expected dtype float32"),
]


@pytest.mark.parametrize("call,error,message", ROPE_CASES + NORM_CASES)
def test_bad_input_is_rejected_with_a_clear_message(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_cpu_torch_tensor_says_move_it_to_the_gpu():
    torch = pytest.importorskip("torch")
    for _ in range(2):  # the second time torch.Tensor is a known type: the per-call fingerprint path
        with pytest.raises(TypeError, match=r"x: expected a CUDA tensor, got a tensor on cpu; move it with x\.cuda\(\)"):
            cupyrope.rope(torch.zeros(X), torch.zeros(6, dtype=torch.int64))
        with pytest.raises(TypeError, match="x: expected a CUDA tensor"):
            cupyrope.rms_norm(torch.zeros(H))
        with pytest.raises(TypeError, match="q: expected a CUDA tensor"):
            cupyrope.rope_qk(torch.zeros(X), torch.zeros(X), torch.zeros(6, dtype=torch.int64))
