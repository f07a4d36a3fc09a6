"""`python -m cupyrope check`'s cases and verdicts, on the CPU: NumPy arrays stand in for CuPy ones and
reference-backed functions (exact, then rounded once to the output dtype, as a correct kernel is)
stand in for the ops. Correct stand-ins pass every check; wrong ones fail it."""

from types import SimpleNamespace

import numpy as np
import pytest

from cupyrope import check, reference

pytest.importorskip("ml_dtypes")


def numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


HOST = SimpleNamespace(asarray=lambda host, dtype: host.astype(numpy_dtype(dtype)),
                       nan=lambda shape, dtype: np.full(shape, np.nan, dtype=numpy_dtype(dtype)),
                       host=lambda array: np.asarray(array, dtype=np.float64))


def f64(array):
    return None if array is None else np.asarray(array, dtype=np.float64)


def reference_ops(rope_style=None, skip_rows=0, fp8_steps=0):
    """The ops, computed by the references. rope_style forces one style (a wrong kernel); skip_rows
    leaves that many rows of rms_norm's output unwritten; fp8_steps moves rms_norm_fp8's bytes that many FP8 steps
    (a wrong rounding)."""

    def rotate(x, positions, style="neox", rotary_dim=None, cos_sin_cache=None, inverse=False):
        return reference.rope(f64(x), np.asarray(positions), style=rope_style or style, rotary_dim=rotary_dim,
                              cos_sin_cache=f64(cos_sin_cache), inverse=inverse).astype(x.dtype)

    def rope(x, positions=None, *, out, impl="auto", cu_seqlens=None, seqlen_offsets=None, mrope_section=None,
             mrope_interleaved=False, **options):
        if cu_seqlens is None and mrope_section is None:
            out[...] = rotate(x, positions, **options)
        else:
            out[...] = reference.rope(f64(x), positions, cu_seqlens=cu_seqlens, seqlen_offsets=seqlen_offsets,
                                      mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
                                      style=rope_style or options.get("style", "neox")).astype(x.dtype)
        return out

    def qk_norm_rope(q, k, q_weight, k_weight, positions, *, out, style="neox", **options):
        results = reference.qk_norm_rope(f64(q), f64(k), f64(q_weight), f64(k_weight), positions,
                                         style=rope_style or style, **options)
        for o, r in zip(out, results):
            o[...] = r.astype(o.dtype)
        return out

    def qk_norm_rope_backward(dq, dk, q, k, q_weight, k_weight, positions, *, style="neox", **options):
        grads = reference.qk_norm_rope_backward(f64(dq), f64(dk), f64(q), f64(k), f64(q_weight), f64(k_weight),
                                                positions, style=rope_style or style, **options)
        return tuple(g.astype(like.dtype) for g, like in zip(grads, (q, k, q_weight, k_weight)))

    def rope_qk(q, k, positions, impl="auto", **options):
        q[...], k[...] = rotate(q, positions, **options), rotate(k, positions, **options)
        return q, k

    def rope_qk_cos_sin(q, k, cos, sin, out=None, style="neox", **options):
        out = (q, k) if out is None else out
        for x, o in zip((q, k), out):
            o[...] = reference.rope_cos_sin(f64(x), f64(cos), f64(sin), style=rope_style or style,
                                            **options).astype(x.dtype)
        return out

    def rms_norm(x, w, eps, *, offset=0.0, out):
        out[skip_rows:] = reference.rms_norm(f64(x), f64(w), eps, offset=offset)[skip_rows:].astype(x.dtype)
        return out

    def fused_add_rms_norm(x, residual, w, eps):
        dtype = "bfloat16" if x.dtype == numpy_dtype("bfloat16") else x.dtype.name
        y, summed = reference.fused_add_rms_norm(f64(x), f64(residual), f64(w), eps, dtype=dtype)
        x[...], residual[...] = y.astype(x.dtype), summed.astype(x.dtype)
        return x, residual

    def rms_norm_backward(dy, x, w):
        dx, dw = reference.rms_norm_backward(f64(dy), f64(x), f64(w))
        return dx.astype(x.dtype), dw.astype(w.dtype)

    def rms_norm_fp8(x, w, eps, group_size=None):
        q, scales = reference.rms_norm_fp8(f64(x), f64(w), eps, group_size=group_size)
        codes = reference.e4m3(q).astype(np.int64)
        moved = np.where((codes & 0x7F) < 0x7E - fp8_steps, codes + fp8_steps, codes)  # within the finite codes
        return moved.astype(np.uint8), scales.astype(np.float32)

    def layer_norm(x, w, b, eps, *, out):
        out[skip_rows:] = reference.layer_norm(f64(x), f64(w), f64(b), eps)[skip_rows:].astype(x.dtype)
        return out

    def fused_add_layer_norm(x, residual, w, b, eps):
        dtype = "bfloat16" if x.dtype == numpy_dtype("bfloat16") else x.dtype.name
        y, summed = reference.fused_add_layer_norm(f64(x), f64(residual), f64(w), f64(b), eps, dtype=dtype)
        x[...], residual[...] = y.astype(x.dtype), summed.astype(x.dtype)
        return x, residual

    def layer_norm_backward(dy, x, w, b):
        dx, dw, db = reference.layer_norm_backward(f64(dy), f64(x), f64(w), f64(b))
        return dx.astype(x.dtype), dw.astype(w.dtype), db.astype(b.dtype)

    return SimpleNamespace(rope=rope, rope_qk=rope_qk, rope_qk_cos_sin=rope_qk_cos_sin, rms_norm=rms_norm,
                           fused_add_rms_norm=fused_add_rms_norm, rms_norm_backward=rms_norm_backward,
                           qk_norm_rope=qk_norm_rope, qk_norm_rope_backward=qk_norm_rope_backward,
                           rms_norm_fp8=rms_norm_fp8, layer_norm=layer_norm, fused_add_layer_norm=fused_add_layer_norm,
                           layer_norm_backward=layer_norm_backward)


def test_correct_ops_pass_every_check(capsys):
    assert check.run_checks(HOST, reference_ops())
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.strip().endswith("all checks passed")
    lines = out.splitlines()
    for what in ("rope float16 300 tokens gptj cache scalar", "rope bfloat16 decode 16-byte items",
                 "rope_qk float32 partial inverse (k)", "rope_qk_cos_sin bfloat16 gptj freq_step 2 (q)",
                 "rope_qk_cos_sin float16 neox freq_step 1 (k)", "rms_norm_backward bfloat16 [300, 1027] (dweight)",
                 "fused_add_rms_norm float16 [64, 16384] (residual)", "rope bfloat16 M-RoPE interleaved",
                 "rope float16 varlen", "qk_norm_rope bfloat16 300 tokens neox (q)",
                 "qk_norm_rope_backward float32 37 tokens gptj (dk_weight)",
                 "rms_norm_fp8 bfloat16 [64, 7168] groups of 128 (y)", "rms_norm_fp8 float16 [300, 1027] per token (scales)",
                 "layer_norm bfloat16 [4, 65536]", "fused_add_layer_norm float16 [37, 1027] (residual)",
                 "layer_norm_backward float32 [300, 1152] (dbias)"):
        assert any(line.startswith(f"ok   {what}:") for line in lines), what
    assert len(lines) > 100


def test_a_wrong_rotation_fails_its_checks(capsys):
    assert not check.run_checks(HOST, reference_ops(rope_style="neox"))
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert failed and all(" gptj " in line for line in failed)
    assert out.strip().endswith(f"{len(failed)} checks FAILED")


def test_fp8_bytes_two_steps_off_fail(capsys):
    assert not check.run_checks(HOST, reference_ops(fp8_steps=2))
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    assert failed and all(line.startswith("FAIL rms_norm_fp8") and "(y)" in line for line in failed)


def test_unwritten_outputs_fail(capsys):
    assert not check.run_checks(HOST, reference_ops(skip_rows=1))
    out = capsys.readouterr().out
    assert "FAIL rms_norm float32 [300, 61]" in out and "FAIL layer_norm float32 [300, 61]" in out


def test_tolerance_is_one_rounding_for_half_types_and_1e5_for_fp32():
    assert reference.ulp(1.0, "bfloat16") == 2.0**-7 and reference.ulp(3.0, "float16") == 2.0**-9
    assert reference.tolerance(np.array([2.0]), "float32")[0] == pytest.approx(2e-5 + 1e-6)
    assert reference.tolerance(np.array([2.0]), "bfloat16", scale=0.0)[0] == 2.0**-6
