"""python -m cupyrope check: every op on this GPU against the float64 references, over the paths the
planners pick -- fp32/fp16/bf16; RoPE's direct and block kernels, one pair or 16 bytes a thread,
in-kernel, cached and per-token (transformers') cos/sin, both styles, partial rotary, q and k in one
launch, M-RoPE and varlen positions; QK-norm + RoPE forward and backward; RMSNorm rows of 61 to 65536
elements (element-wise, shifted, vectorized, staged, read twice from shared memory, split over a cluster;
small backward calls in one cluster), forward, fused add, backward; RMSNorm's FP8 output per row and per group;
LayerNorm rows of 61 to 65536 elements, forward, fused add, backward --
with the test suite's tolerances (fp32
1e-5 relative, fp16/bf16/FP8 one rounding of the output).
Outputs that can be passed in are filled with NaN first. On a GPU the test suite has not run on, run
this first.

The cases take the array module and the ops as arguments, so the checks themselves are tested on the
CPU (tests/cli/test_check.py) with reference-backed stand-ins.
"""

from types import SimpleNamespace

import numpy as np

from . import reference
from .reference import round_to, tolerance

DTYPES = ("float32", "float16", "bfloat16")


def _cupy_module():
    import cupy

    from ._runtime.arrays import numpy_dtype

    def asarray(host, dtype):
        return cupy.asarray(host.astype(numpy_dtype(dtype)))

    return SimpleNamespace(asarray=asarray, nan=lambda shape, dtype: asarray(np.full(shape, np.nan), dtype),
                           host=lambda array: cupy.asnumpy(array).astype(np.float64))


def _random(rng, shape, dtype):
    return round_to(rng.standard_normal(shape), dtype)


def _rope_cases(xp, ops, rng):
    max_position = 4096
    table = round_to(reference.rope_cache(max_position, 128), "float32")
    table_64 = round_to(reference.rope_cache(max_position, 64), "float32")
    for dtype in DTYPES:
        for tokens in (3, 300):  # the direct kernel, then the block kernel
            for style in reference.STYLES:
                for source in ("in-kernel", "cache"):
                    for impl in ("auto", "scalar"):
                        x = _random(rng, (tokens, 4, 128), dtype)
                        pos = rng.integers(0, 2**20 if source == "in-kernel" else max_position, tokens)
                        cache = table if source == "cache" else None
                        out = xp.nan(x.shape, dtype)
                        ops.rope(xp.asarray(x, dtype), xp.asarray(pos, "int64"), style=style, impl=impl, out=out,
                                 cos_sin_cache=None if cache is None else xp.asarray(cache, "float32"))
                        yield (f"rope {dtype} {tokens} tokens {style} {source} {impl}", xp.host(out),
                               reference.rope(x, pos, style=style, cos_sin_cache=cache), dtype, 1.0)
        # q and k (GQA) in place, partial rotary, inverse; 16-byte items forced at decode size
        q, k = _random(rng, (5, 8, 128), dtype), _random(rng, (5, 2, 128), dtype)
        pos = rng.integers(0, max_position, 5)
        qd, kd = xp.asarray(q, dtype), xp.asarray(k, dtype)
        ops.rope_qk(qd, kd, xp.asarray(pos, "int32"), rotary_dim=64, cos_sin_cache=xp.asarray(table_64, "float32"),
                    inverse=True)
        for name, got, x in (("q", qd, q), ("k", kd, k)):
            expected = reference.rope(x, pos, rotary_dim=64, cos_sin_cache=table_64, inverse=True)
            yield f"rope_qk {dtype} partial inverse ({name})", xp.host(got), expected, dtype, 1.0
        x = _random(rng, (1, 32, 128), dtype)
        out = xp.nan(x.shape, dtype)
        ops.rope(xp.asarray(x, dtype), xp.asarray(pos[:1], "int64"), impl="vector", out=out)
        yield f"rope {dtype} decode 16-byte items", xp.host(out), reference.rope(x, pos[:1]), dtype, 1.0
        yield from _rope_cos_sin_cases(xp, ops, rng, dtype, {128: table, 64: table_64})


def _rope_cos_sin_cases(xp, ops, rng, dtype, tables):
    """rope_qk_cos_sin on transformers' call: q (B, H, S, D), cos/sin (B, 1, S, columns) in q's dtype
    from the tables' rows at random positions; the halves layout with NeoX pairs out of place, the
    interleaved one with GPT-J pairs, partial rotary, in place."""
    for freq_step, style, rotary_dim in ((1, "neox", 128), (2, "gptj", 64)):
        positions = rng.integers(0, tables[rotary_dim].shape[0], (2, 1, 9))
        cos, sin = (round_to(t, dtype) for t in reference.per_token_cos_sin(tables[rotary_dim], positions, freq_step))
        q, k = _random(rng, (2, 4, 9, 128), dtype), _random(rng, (2, 1, 9, 128), dtype)
        qd, kd = xp.asarray(q, dtype), xp.asarray(k, dtype)
        options = dict(rotary_dim=rotary_dim, freq_step=freq_step, style=style)
        if freq_step == 1:
            outs = ops.rope_qk_cos_sin(qd, kd, xp.asarray(cos, dtype), xp.asarray(sin, dtype),
                                       out=(xp.nan(q.shape, dtype), xp.nan(k.shape, dtype)), **options)
        else:
            outs = ops.rope_qk_cos_sin(qd, kd, xp.asarray(cos, dtype), xp.asarray(sin, dtype), **options)
        for name, got, x in (("q", outs[0], q), ("k", outs[1], k)):
            expected = reference.rope_cos_sin(x, cos, sin, **options)
            yield f"rope_qk_cos_sin {dtype} {style} freq_step {freq_step} ({name})", xp.host(got), expected, dtype, 1.0


def _position_source_cases(xp, ops, rng):
    """rope with M-RoPE's three position rows (both assignments) and with varlen cu_seqlens (and offsets)."""
    for dtype in DTYPES:
        x = _random(rng, (40, 3, 128), dtype)
        rows = rng.integers(0, 8192, (3, 40))
        for interleaved, section in ((False, [16, 24, 24]), (True, [24, 20, 20])):
            options = dict(mrope_section=section, mrope_interleaved=interleaved)
            got = ops.rope(xp.asarray(x, dtype), xp.asarray(rows, "int64"), out=xp.nan(x.shape, dtype), **options)
            yield (f"rope {dtype} M-RoPE {'interleaved' if interleaved else 'sections'}", xp.host(got),
                   reference.rope(x, rows, **options), dtype, 1.0)
        cu_seqlens, offsets = np.array([0, 7, 7, 33, 40], np.int32), rng.integers(0, 4096, 4)
        got = ops.rope(xp.asarray(x, dtype), cu_seqlens=xp.asarray(cu_seqlens, "int32"),
                       seqlen_offsets=xp.asarray(offsets, "int64"), out=xp.nan(x.shape, dtype))
        expected = reference.rope(x, cu_seqlens=cu_seqlens, seqlen_offsets=offsets)
        yield f"rope {dtype} varlen", xp.host(got), expected, dtype, 1.0


def _qk_norm_rope_cases(xp, ops, rng):
    """qk_norm_rope (Qwen3's head_dim 128 with 4 + 2 heads; partial rotary, GPT-J) and its backward."""
    for dtype in DTYPES:
        for style, rotary_dim, tokens in (("neox", None, 1), ("neox", None, 300), ("gptj", 64, 37)):
            q, k = _random(rng, (tokens, 4, 128), dtype), _random(rng, (tokens, 2, 128), dtype)
            qw, kw = (round_to(1 + 0.5 * rng.standard_normal(128), dtype) for _ in range(2))
            positions = rng.integers(0, 32768, tokens)
            options = dict(eps=1e-6, offset=0.5, style=style, rotary_dim=rotary_dim)
            args = (xp.asarray(qw, dtype), xp.asarray(kw, dtype), xp.asarray(positions, "int64"))
            outs = ops.qk_norm_rope(xp.asarray(q, dtype), xp.asarray(k, dtype), *args,
                                    out=(xp.nan(q.shape, dtype), xp.nan(k.shape, dtype)), **options)
            expected = reference.qk_norm_rope(q, k, qw, kw, positions, **options)
            label = f"{dtype} {tokens} tokens {style}"
            for name, got, ref in zip("qk", outs, expected):
                yield f"qk_norm_rope {label} ({name})", xp.host(got), ref, dtype, 4.0
            dq, dk = _random(rng, q.shape, dtype), _random(rng, k.shape, dtype)
            grads = ops.qk_norm_rope_backward(xp.asarray(dq, dtype), xp.asarray(dk, dtype), xp.asarray(q, dtype),
                                              xp.asarray(k, dtype), *args, **options)
            expected = reference.qk_norm_rope_backward(dq, dk, q, k, qw, kw, positions, **options)
            for name, got, ref, x, dy, w in (("dq", grads[0], expected[0], q, dq, qw),
                                             ("dk", grads[1], expected[1], k, dk, kw)):
                rstd = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
                yield (f"qk_norm_rope_backward {label} ({name})", xp.host(got), ref, dtype,
                       4.0 * float(np.abs(dy).max() * np.abs(w + 0.5).max() * rstd.max()))
            for name, got, ref, x, dy in (("dq_weight", grads[2], expected[2], q, dq),
                                          ("dk_weight", grads[3], expected[3], k, dk)):
                rstd = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
                terms = float((np.abs(dy).max() * np.abs(x) * rstd).reshape(-1, 128).sum(0).max())
                yield f"qk_norm_rope_backward {label} ({name})", xp.host(got), ref, dtype, 4.0 * terms


def _rms_norm_cases(xp, ops, rng):
    for dtype in DTYPES:
        # (5, 12 and 29 rows: one launch of one cluster of 8 or 16 blocks on sm_90+)
        for hidden, rows in ((61, 300), (1027, 300), (1027, 5), (4096, 300), (4096, 12), (2048, 29), (8191, 32),
                             (16384, 64), (24576, 16), (65536, 4)):
            x, w = _random(rng, (rows, hidden), dtype), _random(rng, (hidden,), dtype)
            xd, wd = xp.asarray(x, dtype), xp.asarray(w, dtype)
            label = f"{dtype} [{rows}, {hidden}]"
            out = xp.nan(x.shape, dtype)
            ops.rms_norm(xd, wd, 1e-6, offset=0.5, out=out)
            yield f"rms_norm {label}", xp.host(out), reference.rms_norm(x, w, 1e-6, offset=0.5), dtype, 2.0

            r = _random(rng, x.shape, dtype)
            xs, rs = xp.asarray(x, dtype), xp.asarray(r, dtype)
            ops.fused_add_rms_norm(xs, rs, wd, 1e-6)
            y, summed = reference.fused_add_rms_norm(x, r, w, 1e-6, dtype=dtype)
            yield f"fused_add_rms_norm {label} (residual)", xp.host(rs), summed, dtype, 0.0
            yield f"fused_add_rms_norm {label} (x)", xp.host(xs), y, dtype, 2.0

            dy = _random(rng, x.shape, dtype)
            dx, dw = ops.rms_norm_backward(xp.asarray(dy, dtype), xd, wd)
            ref_dx, ref_dw = reference.rms_norm_backward(dy, x, w)
            rstd = reference.rms_norm(x, None, return_rstd=True)[1][:, None]
            yield f"rms_norm_backward {label} (dx)", xp.host(dx), ref_dx, dtype, float(np.abs(dy * w * rstd).max())
            # dweight sums `rows` fp32 terms: its tolerance grows with their magnitudes (as in the tests)
            terms = float(np.abs(dy * x * rstd).sum(0).max())
            yield f"rms_norm_backward {label} (dweight)", xp.host(dw), ref_dw, dtype, 4.0 * terms


def _rms_norm_fp8_cases(xp, ops, rng):
    """The FP8 output's values against the reference's unrounded ones (within one FP8 step: its one rounding) and its
    scales, per row and per group of 128; odd rows go element by element. On GPUs before sm_89 this checks the
    software conversion."""
    for dtype in DTYPES:
        for hidden, rows in ((1027, 300), (4096, 300), (7168, 64), (32768, 4)):
            x, w = _random(rng, (rows, hidden), dtype), _random(rng, (hidden,), dtype)
            for group_size in (None, 128) if hidden % 128 == 0 else (None,):
                y, scales = ops.rms_norm_fp8(xp.asarray(x, dtype), xp.asarray(w, dtype), 1e-6, group_size=group_size)
                q, ref_scales = reference.rms_norm_fp8(x, w, 1e-6, group_size=group_size, dtype=dtype)
                label = f"{dtype} [{rows}, {hidden}] {'groups of 128' if group_size else 'per token'}"
                values = reference.e4m3_values(xp.host(y).astype(np.uint8))
                yield f"rms_norm_fp8 {label} (y)", values, q, "float8_e4m3fn", 0.0
                yield f"rms_norm_fp8 {label} (scales)", xp.host(scales), ref_scales, "float32", 0.0


def _layer_norm_cases(xp, ops, rng):
    """LayerNorm rows of 61 to 65536 elements (element by element, shifted, 16-byte, 1024 threads, read in passes):
    forward (rows off zero mean), fused add, backward (dx, dweight, dbias)."""
    for dtype in DTYPES:
        for hidden, rows in ((61, 300), (1027, 37), (1152, 300), (4096, 300), (8192, 64), (32768, 8), (65536, 4)):
            x = round_to(rng.standard_normal((rows, hidden)) + rng.uniform(-4, 4, (rows, 1)), dtype)
            w, b = _random(rng, (hidden,), dtype), _random(rng, (hidden,), dtype)
            xd, wd, bd = xp.asarray(x, dtype), xp.asarray(w, dtype), xp.asarray(b, dtype)
            label = f"{dtype} [{rows}, {hidden}]"
            scale = 5.0 * float(np.abs(w).max() + np.abs(b).max())
            out = xp.nan(x.shape, dtype)
            ops.layer_norm(xd, wd, bd, 1e-5, out=out)
            yield f"layer_norm {label}", xp.host(out), reference.layer_norm(x, w, b, 1e-5), dtype, scale

            r = _random(rng, x.shape, dtype)
            xs, rs = xp.asarray(x, dtype), xp.asarray(r, dtype)
            ops.fused_add_layer_norm(xs, rs, wd, bd, 1e-5)
            y, summed = reference.fused_add_layer_norm(x, r, w, b, 1e-5, dtype=dtype)
            yield f"fused_add_layer_norm {label} (residual)", xp.host(rs), summed, dtype, 0.0
            yield f"fused_add_layer_norm {label} (x)", xp.host(xs), y, dtype, scale

            dy = _random(rng, x.shape, dtype)
            dx, dw, db = ops.layer_norm_backward(xp.asarray(dy, dtype), xd, wd, bd)
            ref_dx, ref_dw, ref_db = reference.layer_norm_backward(dy, x, w, b)
            _, mean, rstd = reference.layer_norm(x, return_stats=True)
            yield (f"layer_norm_backward {label} (dx)", xp.host(dx), ref_dx, dtype,
                   3.0 * float(np.abs(dy * w).max() * rstd.max()))
            # dweight and dbias sum `rows` fp32 terms: tolerances grow with their magnitudes (as in the tests)
            magnitude = (np.abs(x) + np.abs(mean)[:, None]) * rstd[:, None]
            yield (f"layer_norm_backward {label} (dweight)", xp.host(dw), ref_dw, dtype,
                   4.0 * float(np.abs(dy * magnitude).sum(0).max()))
            yield (f"layer_norm_backward {label} (dbias)", xp.host(db), ref_db, dtype,
                   4.0 * float(np.abs(dy).sum(0).max()))


def cases(xp, ops, rng):
    """(name, output, float64 reference, dtype, scale) of every check."""
    yield from _rope_cases(xp, ops, rng)
    yield from _position_source_cases(xp, ops, rng)
    yield from _qk_norm_rope_cases(xp, ops, rng)
    yield from _rms_norm_cases(xp, ops, rng)
    yield from _rms_norm_fp8_cases(xp, ops, rng)
    yield from _layer_norm_cases(xp, ops, rng)


def worst_miss(got, expected, dtype, scale) -> tuple[int, float]:
    """(elements outside the tolerance, worst error / tolerance); NaN where the reference has none
    counts as outside."""
    err = np.abs(got - expected)
    ratio = np.where(np.isnan(err), np.inf, err / tolerance(expected, dtype, scale))
    return int(np.count_nonzero(ratio > 1)), float(ratio.max()) if ratio.size else 0.0


def run_checks(xp=None, ops=None, seed=0) -> bool:
    """Print one line per check; True when all pass. Without ``xp`` and ``ops``: cupyrope's ops on CuPy arrays
    (raises NoGPUError where there is no GPU). Other failures to run (a compile error) are raised."""
    if ops is None:
        import cupyrope as ops
        from ._runtime.compile import device_count

        device_count()
        xp = _cupy_module()
        print("compiling each kernel variant on first use (the kernel cache keeps them for later runs)")
    failures = 0
    for name, got, expected, dtype, scale in cases(xp, ops, np.random.default_rng(seed)):
        off, worst = worst_miss(got, expected, dtype, scale)
        failures += off > 0
        print(f"{'ok  ' if not off else 'FAIL'} {name}: worst error {worst:.2f}x the tolerance"
              + (f", {off} of {got.size} elements outside it" if off else ""))
    print(f"{'all checks passed' if not failures else f'{failures} checks FAILED'}")
    return not failures
