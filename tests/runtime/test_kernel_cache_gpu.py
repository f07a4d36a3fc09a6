"""`python -m cupyrope compile` builds ahead of time: after it, a fresh process's first calls load every kernel they
need from the kernel cache and compile nothing (on a GPU)."""

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

FIRST_CALLS = textwrap.dedent("""
    import cupy, numpy as np
    import cupyrope
    from cupyrope import reference
    from cupyrope._runtime import compile

    def no_compiling(*args):
        raise AssertionError(f"compiled {args[1]} at run time")

    compile._nvrtc_compile = no_compiling  # every kernel must come from the kernel cache
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 8, 128)).astype(np.float32)
    pos = rng.integers(0, 4096, 300)
    table = cupyrope.rope_cache(4096, 128)
    out = cupyrope.rope(cupy.asarray(x), cupy.asarray(pos), cos_sin_cache=table)
    assert np.allclose(cupy.asnumpy(out), reference.rope(x, pos, cos_sin_cache=cupy.asnumpy(table)), atol=1e-5)
    q, k = cupy.asarray(x[:1]), cupy.asarray(x[:1, :2])
    cupyrope.rope_qk(q, k, cupy.asarray(pos[:1]))
    h = rng.standard_normal((512, 4096)).astype(np.float32)
    w = rng.standard_normal(4096).astype(np.float32)
    y = cupyrope.rms_norm(cupy.asarray(h), cupy.asarray(w))
    assert np.allclose(cupy.asnumpy(y), reference.rms_norm(h, w), rtol=1e-4, atol=1e-5)
    cupyrope.fused_add_rms_norm(cupy.asarray(h), cupy.asarray(h[::-1].copy()), cupy.asarray(w))
    dx, dw = cupyrope.rms_norm_backward(cupy.asarray(h), cupy.asarray(h), cupy.asarray(w))
    cupy.cuda.get_current_stream().synchronize()
    print("ok")
""")


def fresh_process_env(tmp_path) -> dict:
    """A child process's environment: this checkout importable, a kernel cache of its own under tmp_path."""
    return dict(os.environ, CUPY_CACHE_DIR=str(tmp_path / "kernel_cache"),
                PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))


def test_after_compile_a_fresh_process_compiles_nothing(tmp_path):
    import cupy

    from cupyrope._runtime.compile import target_of

    capability = int("".join(map(str, cupy.cuda.Device(0).compute_capability)))
    if not target_of(capability).startswith("sm_"):
        pytest.skip(f"this NVRTC has no machine code for compute capability {capability} (PTX is compiled on use)")
    env = fresh_process_env(tmp_path)
    built = subprocess.run([sys.executable, "-m", "cupyrope", "compile"], env=env, capture_output=True, text=True)
    assert built.returncode == 0 and f"sm_{capability}: " in built.stdout, built.stdout + built.stderr
    first = subprocess.run([sys.executable, "-c", FIRST_CALLS], env=env, capture_output=True, text=True)
    assert first.returncode == 0 and "ok" in first.stdout, first.stderr[-3000:]


PTX_CALLS = textwrap.dedent("""
    import cupy, numpy as np
    import cupyrope
    from cupyrope import reference
    from cupyrope._runtime import compile

    # What a GPU newer than NVRTC's targets runs: PTX, compiled by the driver on load.
    compile.target_of = lambda capability: f"compute_{capability}"
    rng = np.random.default_rng(1)
    x = rng.standard_normal((37, 4, 64)).astype(np.float32)
    pos = rng.integers(0, 4096, 37)
    out = cupyrope.rope(cupy.asarray(x), cupy.asarray(pos))
    assert np.allclose(cupy.asnumpy(out), reference.rope(x, pos), rtol=1e-5, atol=1e-5)
    print("ok")
""")


def test_kernels_load_from_ptx(tmp_path):
    env = fresh_process_env(tmp_path)
    run = subprocess.run([sys.executable, "-c", PTX_CALLS], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]
    assert list((tmp_path / "kernel_cache").glob("cupyrope-*.bin"))  # the PTX went through the cache
