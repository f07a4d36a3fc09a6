"""python -m cupyrope check: run every op once on the GPU against the float64 references."""

import numpy as np

from . import reference


def _cases():
    import cupy

    import cupyrope

    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 4, 128)).astype(np.float32)
    pos = rng.integers(0, 2**20, 37)
    yield "rope (in-kernel cos/sin)", cupy.asnumpy(cupyrope.rope(cupy.asarray(x), cupy.asarray(pos))), \
        reference.rope(x, pos), 1e-5
    table = reference.rope_cache(2**20, 64).astype(np.float32)
    yield "rope (cache, gptj, partial)", cupy.asnumpy(cupyrope.rope(
        cupy.asarray(x), cupy.asarray(pos), style="gptj", rotary_dim=64, cos_sin_cache=cupy.asarray(table))), \
        reference.rope(x, pos, style="gptj", rotary_dim=64, cos_sin_cache=table), 1e-5
    h = rng.standard_normal((33, 1027)).astype(np.float32)
    w = rng.standard_normal(1027).astype(np.float32)
    yield "rms_norm", cupy.asnumpy(cupyrope.rms_norm(cupy.asarray(h), cupy.asarray(w))), reference.rms_norm(h, w), 1e-5
    dy = rng.standard_normal(h.shape).astype(np.float32)
    dx, dw = cupyrope.rms_norm_backward(cupy.asarray(dy), cupy.asarray(h), cupy.asarray(w))
    ref_dx, ref_dw = reference.rms_norm_backward(dy, h, w)
    yield "rms_norm_backward dx", cupy.asnumpy(dx), ref_dx, 1e-4
    yield "rms_norm_backward dweight", cupy.asnumpy(dw), ref_dw, 1e-4
    r = rng.standard_normal(h.shape).astype(np.float32)
    xs, rs = cupy.asarray(h), cupy.asarray(r)
    cupyrope.fused_add_rms_norm(xs, rs, cupy.asarray(w))
    yield "fused_add_rms_norm", cupy.asnumpy(xs), reference.fused_add_rms_norm(h, r, w)[0], 1e-5


def run_selfcheck() -> int:
    failures = 0
    try:
        for name, got, expected, rtol in _cases():
            error = float(np.max(np.abs(got - expected) / (np.abs(expected) + 1.0)))
            ok = error <= rtol and not np.isnan(got).any()
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: max relative error {error:.2e}")
    except Exception as error:  # no GPU, no driver, compile failure: say what happened
        print(f"FAIL: {type(error).__name__}: {error}")
        return 1
    return 1 if failures else 0
