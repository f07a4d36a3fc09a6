"""Compile-only path (NVRTC alone, no GPU), source discovery and cache keys, compile errors."""

import os

import pytest

from cupyrope import _compile, _sources
from cupyrope.__main__ import compile_variants, main
from cupyrope._variants import all_variants

pytest.importorskip("cupy", reason="compile tests need CuPy (its NVRTC bindings)")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_variant_compiles_without_a_gpu(arch):
    results = compile_variants(arch, jobs=os.cpu_count() or 1)
    assert sorted(r[:2] for r in results) == sorted(all_variants())
    assert all(size > 1000 for _, _, size in results)  # a real cubin each


def test_variant_list_covers_both_ops_and_is_unique():
    variants = all_variants()
    assert len(set(variants)) == len(variants)
    rope = [name for source, name in variants if source == "rope.cu"]
    # (fp32: no cache, fp32 cache; fp16/bf16: no cache, fp32 cache, own-dtype cache) x 2 position
    # types, plus per-token cos/sin tensors (fp32 or q's dtype: 1 + 2 + 2), x 2 styles x scalar/vector x
    # block/direct kernel
    assert len(rope) == ((2 + 3 + 3) * 2 + 1 + 2 + 2) * 2 * 2 * 2
    assert sum("TokenRows" in name for name in rope) == (1 + 2 + 2) * 2 * 2 * 2
    assert sum("rope_direct_kernel<" in name for name in rope) == len(rope) // 2
    norm = [name for source, name in variants if source == "rms_norm.cu"]
    assert any("rms_norm_bwd" in n for n in norm) and any("rms_norm_dw" in n for n in norm)
    assert any(n.endswith("true>") and "rms_norm_fwd" in n for n in norm)  # fused add



def test_cuda_headers_are_found():
    """The fp16/bf16 headers NVRTC needs come with the install extra (CUDA 12 wheels keep them in
    nvidia/cuda_runtime/include, CUDA 13 ones in nvidia/cu13/include)."""
    include = _compile.cuda_include_dir()
    assert include and all(os.path.isfile(os.path.join(include, h)) for h in ("cuda_fp16.h", "cuda_bf16.h")), include


def test_missing_cuda_headers_say_how_to_install_them(monkeypatch):
    monkeypatch.setattr(_compile, "cuda_include_dir", lambda: None)
    bf16 = next(v for v in all_variants() if "__nv_bfloat16" in v[1])
    with pytest.raises(_compile.KernelCompileError, match=r"(?s)cuda_(fp|bf)16\.h.*pip install \"cupyrope\[cuda12\]\""):
        _compile.compile_all("sm_90", [bf16])


def test_bad_arch_is_a_clear_error():
    with pytest.raises(ValueError, match="arch"):
        _compile.compile_all("hopper", [])


@pytest.fixture
def broken_sources(tmp_path, monkeypatch):
    (tmp_path / "common.cuh").write_text("#pragma once\n")
    (tmp_path / "broken.cu").write_text('#include "common.cuh"\n__global__ void k() {\n  int x = ;\n}\n')
    monkeypatch.setattr(_compile, "kernels_dir", lambda: tmp_path)
    monkeypatch.setattr(_compile, "sources_hash", lambda: "0")
    return tmp_path


def test_compile_error_names_file_and_line(broken_sources):
    with pytest.raises(_compile.KernelCompileError, match=r"broken\.cu:3"):
        _compile.compile_all("sm_90", [("broken.cu", "k")])


def test_sources_found_and_hash_covers_headers(tmp_path, monkeypatch):
    assert (_sources.kernels_dir() / "rope.cu").is_file()
    for name in ("common.cuh", "rope.cu"):
        (tmp_path / name).write_bytes((_sources.kernels_dir() / name).read_bytes())
    monkeypatch.setattr(_sources, "kernels_dir", lambda: tmp_path)
    _sources.sources_hash.cache_clear()
    try:
        before = _sources.sources_hash()
        (tmp_path / "common.cuh").write_text((tmp_path / "common.cuh").read_text() + "\n// edit\n")
        _sources.sources_hash.cache_clear()
        assert _sources.sources_hash() != before
    finally:
        _sources.sources_hash.cache_clear()


def test_compile_options_carry_the_source_hash():
    options = _compile.compile_options()
    assert any(o.startswith("-DCUPYROPE_SOURCES_HASH=0x") for o in options)
    assert f"-I{_sources.kernels_dir()}" in options

def test_architecture_this_nvrtc_dropped_says_which_extra_targets_it():
    import cupy

    if cupy.cuda.nvrtc.getVersion() < (13, 0):
        pytest.skip("NVRTC 12 still compiles for sm_70 (CI's CUDA 12 step does)")
    with pytest.raises(_compile.KernelCompileError, match=r"(?s)sm_70.*pip install \"cupyrope\[cuda12\]\""):
        _compile.compile_all("sm_70", all_variants()[:1])


def test_gpus_this_nvrtc_cannot_target_are_named_before_compiling(monkeypatch):
    monkeypatch.setattr(_compile, "nvrtc_archs", lambda: (75, 80, 90, 120))  # NVRTC 13's range, shortened
    assert _compile.arch_unsupported("sm_90") is None
    assert _compile.arch_unsupported("sm_130") is None  # newer GPUs: CuPy compiles for NVRTC's newest target
    assert 'pip install "cupyrope[cuda12]"' in _compile.arch_unsupported("sm_70")
    monkeypatch.setattr(_compile, "nvrtc_archs", lambda: (50, 60, 70, 90))  # NVRTC 12's
    assert "compute capability 7.0 (Volta) and newer" in _compile.arch_unsupported("sm_35")
    # A V100 with the CUDA 13 extra: the first kernel load says so, before NVRTC or the GPU is asked.
    monkeypatch.setattr(_compile, "nvrtc_archs", lambda: (75, 80, 90, 120))
    monkeypatch.setattr(_compile, "_device_arch", lambda device: "sm_70")
    with pytest.raises(_compile.KernelCompileError, match=r"cuda:0: NVRTC .* cannot compile for sm_70.*cuda12"):
        _compile._load("rope.cu", all_variants()[0][1], 0)


def test_cli_compile(capsys, monkeypatch):
    monkeypatch.setattr("cupyrope._variants.all_variants", lambda: all_variants()[:2])
    assert main(["compile", "--arch", "sm_90", "--jobs", "1"]) == 0
    assert "compiled 2 kernel variants for sm_90" in capsys.readouterr().out
    assert main(["compile", "--arch", "sm_80, sm_120", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 kernel variants for sm_80" in out and "2 kernel variants for sm_120" in out


def test_cli_compile_reports_errors_without_a_traceback(capsys):
    assert main(["compile", "--arch", "sm_90,hopper", "--jobs", "1"]) == 1
    assert "cupyrope compile: arch: expected something like 'sm_90', got 'hopper'" in capsys.readouterr().err


def test_unusable_kernel_cache_dir_degrades_with_a_warning(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "not-a-dir"
    bad.write_text("a file where CuPy's cache directory should be")
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import cupyrope  # vets the directory before anything imports CuPy\n"
        "    from cupyrope import _compile\n"
        "    from cupyrope._variants import all_variants\n"
        "    assert _compile.compile_all('sm_90', all_variants()[:1])\n"
        "assert any('not usable' in str(w.message) for w in caught), caught\n"
        "print('ok')\n"
    )
    env = dict(os.environ, CUPY_CACHE_DIR=str(bad), PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
