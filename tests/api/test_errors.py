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
    (lambda: cupyrope.rope_cos_sin(A(X), A((6, 1, 64), ptr=2 << 44), A((6, 1, 64), ptr=3 << 44), freq_step=3), ValueError, "freq_step: expected 1"),
    (lambda: cupyrope.rope_cos_sin(A(X), A((5, 1, 64), ptr=2 << 44), A((5, 1, 64), ptr=3 << 44)), ValueError, r"cos: leading dimensions \(5, 1\) do not match x's \(6, 4\)"),
    (lambda: cupyrope.rope_cos_sin(A(X), A((6, 1, 64), ptr=2 << 44), None), TypeError, "sin: expected a cupy.ndarray or a CUDA torch.Tensor, got NoneType"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), A((6, 1, 64), ptr=3 << 44), freq_step=3, out="new"), ValueError, "freq_step: expected 1"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), A((6, 1, 64), ptr=3 << 44), freq_step=3), ValueError, "freq_step: expected 1"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), A((6, 1, 64), ptr=3 << 44), freq_step=2.0), ValueError, "freq_step: expected 1"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 32), ptr=2 << 44), A((6, 1, 32), ptr=3 << 44), freq_step=2), ValueError, r"cos: expected at least 63 columns"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((5, 1, 64), ptr=2 << 44), A((5, 1, 64), ptr=3 << 44)), ValueError, r"cos: leading dimensions \(5, 1\) do not match q's \(6, 4\)"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), A((6, 1, 64), strides=(128, 64, 1), ptr=3 << 44)), ValueError, "sin: expected the dtype, shape and strides of cos"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X, "float16"), A(X, "float16", ptr=1 << 44), A((6, 1, 64), "bfloat16", ptr=2 << 44), A((6, 1, 64), "bfloat16", ptr=3 << 44)), TypeError, r"cos: expected dtype float16 or float32 \(like q\), got bfloat16"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), np.zeros((6, 1, 64))), TypeError, "sin: .*NumPy"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), ptr=2 << 44), None), TypeError, "sin: expected a cupy.ndarray or a CUDA torch.Tensor, got NoneType"),
    (lambda: cupyrope.rope_qk(A(X), A(X, ptr=1 << 44), None), TypeError, r"positions: expected an integer array \(int32 or int64\), got None"),
    (lambda: cupyrope.rope_qk_cos_sin(A(X), A(X, ptr=1 << 44), A((6, 1, 64), device=1), A((6, 1, 64), device=1)), ValueError, "cos: expected a cupy array on cuda:0"),
    (lambda: cupyrope.rope_cache(0, 64), ValueError, "max_position"),
    (lambda: cupyrope.rope_cache(10, 63), ValueError, "rotary_dim"),
    (lambda: cupyrope.rope_cache(10, 64, dtype="float64"), TypeError, "dtype"),
]

Q, K = (6, 4, 64), (6, 2, 64)


def qk_norm(**kw):
    """qk_norm_rope on stand-ins: q, k of separate memory, fp32 weights of head_dim 64, positions (6,)."""
    args = dict(q_weight=A((64,), ptr=2 << 44), k_weight=A((64,), ptr=3 << 44), positions=pos())
    args.update(kw)
    return cupyrope.qk_norm_rope(A(Q), A(K, ptr=1 << 44), **args)


def cu(values=3, dtype="int32", **kw):
    return A((values,), dtype, **kw)


SOURCE_CASES = [
    (lambda: cupyrope.rope(A(X), pos(), mrope_section=[8, 12, 12]), ValueError, r"positions: with mrope_section, expected shape \(3, ...\)"),
    (lambda: cupyrope.rope(A(X), pos((2, 6)), mrope_section=[8, 12, 12]), ValueError, r"positions: with mrope_section, expected shape \(3, ...\)"),
    (lambda: cupyrope.rope(A(X), pos((3, 6)), mrope_section=[8, 12, 8]), ValueError, "mrope_section: expected sections adding up to rotary_dim / 2 = 32"),
    (lambda: cupyrope.rope(A(X), pos((3, 6)), mrope_section=[8, 24]), ValueError, "mrope_section: expected three ints"),
    (lambda: cupyrope.rope(A(X), pos((3, 6)), mrope_section=[8, -4, 28]), ValueError, "mrope_section: expected three ints >= 0"),
    (lambda: cupyrope.rope(A(X), pos((3, 5)), mrope_section=[8, 12, 12]), ValueError, "positions: shape"),
    (lambda: cupyrope.rope(A(X), pos(), mrope_interleaved=True), ValueError, "mrope_interleaved: True needs mrope_section"),
    (lambda: cupyrope.rope(A(X), cu_seqlens=cu(dtype="int64")), TypeError, "cu_seqlens: expected int32"),
    (lambda: cupyrope.rope(A(X), cu_seqlens=cu(1)), ValueError, r"cu_seqlens: expected shape \(n_seqs \+ 1,\) with n_seqs >= 1"),
    (lambda: cupyrope.rope(A(X), cu_seqlens=A((3,), "int32", strides=(2,))), ValueError, "cu_seqlens: expected a contiguous array"),
    (lambda: cupyrope.rope(A(X), pos(), cu_seqlens=cu()), ValueError, "positions: pass either positions or cu_seqlens"),
    (lambda: cupyrope.rope(A(X), pos((3, 6)), cu_seqlens=cu(), mrope_section=[8, 12, 12]), ValueError, "positions: pass either"),
    (lambda: cupyrope.rope(A(X), cu_seqlens=cu(), mrope_section=[8, 12, 12]), ValueError, "mrope_section: M-RoPE takes positions"),
    (lambda: cupyrope.rope(A(X), cu_seqlens=cu(), seqlen_offsets=A((3,), "int32")), ValueError, r"seqlen_offsets: expected shape \(2,\)"),
    (lambda: cupyrope.rope(A(X), cu_seqlens=cu(), seqlen_offsets=A((2,), "float32")), TypeError, "seqlen_offsets: expected int32 or int64"),
    (lambda: cupyrope.rope(A(X), pos(), seqlen_offsets=A((2,), "int32")), ValueError, "seqlen_offsets: only with cu_seqlens"),
    (lambda: cupyrope.rope(A(X), cu_seqlens=cu(device=1)), ValueError, "cu_seqlens: expected a cupy array on cuda:0"),
    (lambda: cupyrope.rope(A((64,)), cu_seqlens=cu()), ValueError, r"x: with cu_seqlens, expected shape \(tokens, ..., head_dim\)"),
    (lambda: cupyrope.rope_qk(A(Q), A(K, ptr=1 << 44), cu_seqlens=cu(dtype="float32")), TypeError, "cu_seqlens: expected int32"),
    (lambda: qk_norm(q_weight=A((32,), ptr=2 << 44)), ValueError, r"q_weight: expected shape \(64,\) \(head_dim\)"),
    (lambda: qk_norm(k_weight=A((64,), "float16", ptr=3 << 44)), TypeError, r"k_weight: expected dtype float32 \(like q\), got float16"),
    (lambda: qk_norm(q_weight=None), TypeError, "q_weight: expected a cupy.ndarray or a CUDA torch.Tensor, got NoneType"),
    (lambda: qk_norm(eps=0.0), ValueError, "eps: expected a finite number > 0"),
    (lambda: qk_norm(offset=float("inf")), ValueError, "offset"),
    (lambda: qk_norm(positions=pos((3, 6)), mrope_section=[8, 12, 8]), ValueError, "mrope_section: expected sections adding up"),
    (lambda: qk_norm(positions=pos(), mrope_section=[8, 12, 12]), ValueError, r"positions: with mrope_section, expected shape \(3, ...\)"),
    (lambda: qk_norm(style="llama"), ValueError, "style: expected one of"),
    (lambda: cupyrope.qk_norm_rope(A(Q), A(Q), A((64,), ptr=2 << 44), A((64,), ptr=3 << 44), pos()), ValueError, "k: overlaps q"),
    (lambda: cupyrope.qk_norm_rope_backward(A(Q, ptr=4 << 44), A((6, 2, 32), ptr=5 << 44), A(Q), A(K, ptr=1 << 44), A((64,), ptr=2 << 44), A((64,), ptr=3 << 44), pos()), ValueError, r"dk: expected shape \(6, 2, 64\)"),
    (lambda: cupyrope.qk_norm_rope_backward(A(Q, "float16", ptr=4 << 44), A(K, ptr=5 << 44), A(Q), A(K, ptr=1 << 44), A((64,), ptr=2 << 44), A((64,), ptr=3 << 44), pos()), TypeError, "dq: expected dtype float32"),
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
    # rows over three levels of strides (runs of runs); two levels (q's heads in a fused qkv tensor) are taken
    (lambda: cupyrope.rms_norm(A((4, 4, 5, 16), strides=(700, 200, 20, 1))), ValueError, "x: its rows .* evenly strided runs"),
    (lambda: cupyrope.rms_norm_backward(A((4, 3, 5, 16), strides=(300, 80, 16, 1)),
                                        A((4, 3, 5, 16), strides=(270, 90, 16, 1), ptr=1 << 44)),
     ValueError, "dy: its rows .* evenly strided runs"),
    (lambda: cupyrope.rms_norm_backward(A((7, 131)), A(H), A((130,))), ValueError, r"dy: expected shape \(7, 130\)"),
    (lambda: cupyrope.rms_norm_backward(A(H, "float16"), A(H), A((130,))), TypeError, "dy: expected dtype float32"),
    (lambda: cupyrope.rms_norm_backward(A(H, ptr=1 << 44), A(H), A((130,)), rstd=A((6,))), ValueError, r"rstd: expected shape \(7,\)"),
    (lambda: cupyrope.rms_norm_backward(A(H, ptr=1 << 44), A(H), A((130,)), rstd=A((7,), "float16")), TypeError, "rstd: expected dtype float32"),
    (lambda: cupyrope.fused_add_rms_norm(A(H), A((7, 129), ptr=1 << 44), A((130,))), ValueError, "residual: expected shape"),
    (lambda: cupyrope.fused_add_rms_norm(A(H), A(H), A((130,))), ValueError, "residual: overlaps x"),
    (lambda: cupyrope.fused_add_rms_norm(A(H), A(H, "bfloat16", ptr=1 << 44), A((130,))), TypeError, "residual: expected dtype float32"),
    (lambda: cupyrope.add_rms_norm(A(H), A((7, 129), ptr=1 << 44), A((130,))), ValueError, "residual: expected shape"),
    (lambda: cupyrope.add_rms_norm(A(H), A(H, "float16", ptr=1 << 44)), TypeError, "residual: expected dtype float32"),
    (lambda: cupyrope.add_rms_norm(A(H), A(H, ptr=1 << 44), A((131,))), ValueError, r"weight: expected shape \(130,\)"),
    (lambda: cupyrope.add_rms_norm(A(H), A(H, ptr=1 << 44), return_rstd=1), TypeError, "return_rstd"),
    (lambda: cupyrope.rms_norm_fp8(A(H, "int32")), TypeError, "x: expected dtype"),
    (lambda: cupyrope.rms_norm_fp8(A(H), A((129,))), ValueError, r"weight: expected shape \(130,\)"),
    (lambda: cupyrope.rms_norm_fp8(A(H), eps=0.0), ValueError, "eps: expected a finite number > 0"),
    (lambda: cupyrope.rms_norm_fp8(A(H), scale=A((1,), "float16", ptr=1 << 44)), TypeError, "scale: expected dtype float32, got float16"),
    (lambda: cupyrope.rms_norm_fp8(A(H), scale=A((2,), ptr=1 << 44)), ValueError, r"scale: expected one value, shape \(\) or \(1,\), got shape \(2,\)"),
    (lambda: cupyrope.rms_norm_fp8(A(H), scale=A((1,), ptr=1 << 44, device=1)), ValueError, "scale: expected a cupy array on cuda:0"),
    (lambda: cupyrope.rms_norm_fp8(A(H), scale_ub=A((1, 1), ptr=1 << 44)), ValueError, "scale_ub: expected one value"),
    (lambda: cupyrope.rms_norm_fp8(A(H), group_size=32), ValueError, r"group_size: expected None or one of \(64, 128\), got 32"),
    (lambda: cupyrope.rms_norm_fp8(A(H), group_size=64.0), ValueError, "group_size: expected None or one of"),
    (lambda: cupyrope.rms_norm_fp8(A(H), group_size=64), ValueError, "group_size: expected a divisor of x's hidden size 130, got 64"),
    (lambda: cupyrope.rms_norm_fp8(A((7, 128)), group_size=64, scale=A((1,), ptr=1 << 44)), ValueError, "group_size: per-group scales are dynamic"),
    (lambda: cupyrope.rms_norm_fp8(A(H), scale=A((1,), ptr=1 << 44), scale_ub=A((1,), ptr=2 << 44)), ValueError, "scale_ub: bounds dynamic scales only"),
    (lambda: cupyrope.rms_norm_fp8(A(H), residual=A(H)), ValueError, "residual: overlaps x"),
    (lambda: cupyrope.rms_norm_fp8(A(H), residual=A(H, "float16", ptr=1 << 44)), TypeError, "residual: expected dtype float32"),
    (lambda: cupyrope.rms_norm_fp8(A(H), out=A(H, ptr=1 << 44)), TypeError, r"out: expected dtype uint8 \(like x\), got float32"),
    (lambda: cupyrope.rms_norm_fp8(A(H), out=A((7, 129), "uint8", ptr=1 << 44)), ValueError, "out: expected shape"),
    (lambda: cupyrope.rms_norm_fp8(A(H), out=A(H, "uint8")), ValueError, "out: overlaps x"),
    (lambda: cupyrope.rms_norm_backward(A(H, ptr=1 << 44), A(H), A((130,)), residual_grad=A((7, 129), ptr=1 << 45)), ValueError, r"residual_grad: expected shape \(7, 130\)"),
    (lambda: cupyrope.rms_norm_backward(A(H, ptr=1 << 44), A(H), A((130,)), residual_grad=A(H, "bfloat16", ptr=1 << 45)), TypeError, "residual_grad: expected dtype float32"),
]


LAYER_NORM_CASES = [
    (lambda: cupyrope.layer_norm(A(H, "int32")), TypeError, "x: expected dtype"),
    (lambda: cupyrope.layer_norm(A(H), A((130,), ptr=1 << 44), A((129,), ptr=2 << 44)), ValueError, r"bias: expected shape \(130,\)"),
    (lambda: cupyrope.layer_norm(A(H), A((130,), ptr=1 << 44), A((130,), "float16", ptr=2 << 44)), TypeError, "bias: expected dtype float32 or float32 .like x., got float16"),
    (lambda: cupyrope.layer_norm(A(H, "float16"), A((130,), ptr=1 << 44), A((130,), "float16", ptr=2 << 44)), TypeError, r"bias: expected dtype float32 \(like weight\), got float16"),
    (lambda: cupyrope.layer_norm(A(H), None, A((130,), ptr=2 << 44, device=1)), ValueError, "bias: expected a cupy array on cuda:0"),
    (lambda: cupyrope.layer_norm(A(H), eps=0.0), ValueError, "eps: expected a finite number > 0"),
    (lambda: cupyrope.layer_norm(A(H), return_stats=1), TypeError, "return_stats: expected a bool"),
    (lambda: cupyrope.layer_norm(A(H), out=A((7, 129), ptr=1 << 44)), ValueError, r"out: expected shape \(7, 130\)"),
    (lambda: cupyrope.layer_norm(A(H), out=A(H, ptr=0x7F0000000000 + 8)), ValueError, "out: overlaps x"),
    (lambda: cupyrope.fused_add_layer_norm(A(H), A(H)), ValueError, "residual: overlaps x"),
    (lambda: cupyrope.fused_add_layer_norm(A(H), A(H, "float16", ptr=1 << 44)), TypeError, "residual: expected dtype float32"),
    (lambda: cupyrope.layer_norm_backward(A(H, ptr=1 << 44), A(H), mean=A((7,), ptr=1 << 45)), ValueError, "mean, rstd: expected both"),
    (lambda: cupyrope.layer_norm_backward(A(H, ptr=1 << 44), A(H), mean=A((7,), ptr=1 << 45), rstd=A((6,), ptr=1 << 46)), ValueError, r"rstd: expected shape \(7,\)"),
    (lambda: cupyrope.layer_norm_backward(A(H, ptr=1 << 44), A(H), mean=A((7,), "float16", ptr=1 << 45), rstd=A((7,), ptr=1 << 46)), TypeError, "mean: expected dtype float32"),
    (lambda: cupyrope.layer_norm_backward(A((7, 129), ptr=1 << 44), A(H)), ValueError, r"dy: expected shape \(7, 130\)"),
]


@pytest.mark.parametrize("call,error,message", ROPE_CASES + SOURCE_CASES + NORM_CASES + LAYER_NORM_CASES)
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
