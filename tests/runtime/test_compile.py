"""NVRTC with no GPU: every kernel variant compiles, the kernel cache that `compile` fills and first calls read,
source discovery and cache keys, compile errors naming the file and line, target names."""

import os
import re
import subprocess
import sys

import pytest

from cupyrope._runtime import compile
from cupyrope.__main__ import compile_variants
from cupyrope.ops import all_variants

pytest.importorskip("cupy", reason="compile tests need CuPy (its NVRTC bindings)")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_variant_compiles_without_a_gpu(arch):
    results = compile_variants(arch, jobs=os.cpu_count() or 1, cache=False)
    assert sorted(r[:2] for r in results) == sorted(all_variants())
    assert all(size > 1000 for _, _, size, _ in results)  # a real cubin each


def _static_shared_bytes(source: str, name: str) -> int:
    """The bytes of a variant's own shared arrays: the sizes of its PTX's static .shared declarations."""
    ptx = compile._nvrtc_compile(source, name, "compute_90")[0].decode()
    return sum(int(n) for n in re.findall(r"^\s*\.shared\s+\.align\s+\d+\s+\.b8\s+\S+\[(\d+)\];", ptx, re.M))


def test_static_shared_memory_stays_within_what_the_planners_set_aside():
    """A planner sizes a block's dynamic shared memory to fit beside the kernel's own arrays (its
    STATIC_SHARED_BYTES): a kernel whose arrays outgrow that could ask for more than a block has."""
    from cupyrope.ops import qk_norm_rope_plan, rmsnorm_rows

    rows = rmsnorm_rows.STATIC_SHARED_BYTES
    allowance = {"qk_norm_rope.cu": qk_norm_rope_plan.STATIC_SHARED_BYTES, "rmsnorm_fwd.cu": rows,
                 "rmsnorm_bwd.cu": rows, "rmsnorm_fp8.cu": rows, "layernorm.cu": rows}
    no_dynamic = ("rms_norm_dw<", "e4m3_encode<")  # launched with no dynamic shared memory
    largest = {}  # per kernel: its first variant and its first with in-kernel cos/sin (their own table of frequencies)
    for source, name in all_variants():
        kernel = name.split("<")[0]
        if source in allowance and not name.split("::")[-1].startswith(no_dynamic):
            if kernel not in largest or (name.endswith(", false>") and not largest[kernel][1].endswith(", false>")):
                largest[kernel] = (source, name)
    assert {source for source, _ in largest.values()} == set(allowance)
    for source, name in largest.values():
        assert _static_shared_bytes(source, name) <= allowance[source], name


@pytest.mark.parametrize("source, name, fenced", [
    ("rmsnorm_fwd.cu", "cupyrope::rms_norm_fwd_split<__nv_bfloat16, __nv_bfloat16, 4, false, 4, true>", False),
    ("rmsnorm_bwd.cu", "cupyrope::rms_norm_bwd_split<__nv_bfloat16, __nv_bfloat16, 4, 4, true, false>", False),
    ("layernorm.cu", "cupyrope::layer_norm_bwd_split<__nv_bfloat16, __nv_bfloat16, 2, 2>", False),
    ("layernorm.cu", "cupyrope::layer_norm_bwd_split<float, float, 4, 2>", True),
])
def test_split_rows_add_their_sums_over_the_cluster_without_a_cluster_barrier_a_row(source, name, fenced):
    """cluster_sum: blocks send a row's sums with st.async, counted on the peers' mbarriers; the one cluster barrier
    is the kernel's start (a barrier a row waited for the block's stores in flight). fp32 LayerNorm rows keep a
    barrier a row (FENCED, measured faster there)."""
    assert (source, name) in all_variants()
    ptx = compile._nvrtc_compile(source, name, "compute_90")[0].decode()
    barriers = ptx.count("barrier.cluster.arrive")
    if fenced:
        assert barriers == 2 and "st.async" not in ptx
    else:
        assert barriers == 1 and "st.async" in ptx and "mbarrier.try_wait" in ptx


def test_variant_list_covers_every_op_and_is_unique():
    variants = all_variants()
    assert len(set(variants)) == len(variants)
    rope = [name for source, name in variants if source == "rope.cu"]
    # (fp32: no cache, fp32 cache; fp16/bf16: no cache, fp32 cache, own-dtype cache) x 2 position
    # types, plus per-token cos/sin tensors (fp32 or q's dtype: 1 + 2 + 2), x 2 styles x scalar/vector x
    # block/direct kernel
    assert len(rope) == ((2 + 3 + 3) * 2 + 1 + 2 + 2) * 2 * 2 * 2
    assert sum("TokenRows" in name for name in rope) == (1 + 2 + 2) * 2 * 2 * 2
    assert sum("rope_direct_kernel<" in name for name in rope) == len(rope) // 2
    forward = [name for source, name in variants if source == "rmsnorm_fwd.cu"]
    backward = [name for source, name in variants if source == "rmsnorm_bwd.cu"]
    assert all(n.startswith("cupyrope::rms_norm_fwd") for n in forward)
    assert any(n.endswith("true, false>") and "rms_norm_fwd<" in n for n in forward)  # fused add
    assert all(n.startswith("cupyrope::rms_norm_bwd") or n.startswith("cupyrope::rms_norm_dw") for n in backward)
    norm_rope = [name for source, name in variants if source == "qk_norm_rope.cu"]
    # fp32: 1 weight dtype x 2 cos/sin sources; fp16, bf16: 2 x 3 (in kernel, fp32 table, own-dtype table);
    # x 2 position types x 2 styles x scalar/vector x forward/backward
    assert len(norm_rope) == (1 * 2 + 2 * (2 * 3)) * 2 * 2 * 2 * 2
    assert sum("qk_norm_rope_bwd_kernel<" in name for name in norm_rope) == len(norm_rope) // 2
    fp8 = [name for source, name in variants if source == "rmsnorm_fp8.cu"]
    # fp32: 1 weight dtype x 5 slot counts (0, 1, 2, 4, 8); fp16, bf16: 2 x 4 (0, 1, 2, 4); x scalar/vector x fused
    # add or not x 4 scale modes (static, per token, groups of 64 and 128); and the two conversion kernels
    assert len(fp8) == (1 * 5 + 2 * 2 * 4) * 2 * 2 * 4 + 2
    layer_norm = [name for source, name in variants if source == "layernorm.cu"]
    assert all(n.split("<")[0] in ("cupyrope::layer_norm_fwd", "cupyrope::layer_norm_bwd",
                                   "cupyrope::layer_norm_bwd_split") for n in layer_norm)
    # rows split over clusters of 2, 4 and 8 blocks: fp32 1 weight dtype, fp16/bf16 2
    assert sum("layer_norm_bwd_split<" in name for name in layer_norm) == (1 + 2 * 2) * 3
    # backward: fp32 1 weight dtype x (element by element 0, 1, 2, 4, 8 slots; 16-byte 0, 1, 2, 4), fp16/bf16 2 x (5 + 3);
    # the staged rows (fp32 4 slots at 2 blocks an SM, fp16/bf16 2 slots at 2 or 3) unstaged too, for devices whose
    # shared memory cannot hold the stages
    assert sum("layer_norm_bwd<" in name for name in layer_norm) == 1 * (5 + 4 + 1) + 2 * 2 * (5 + 3 + 2)
    assert any(n.endswith(", true, true>") for n in layer_norm)  # the fused add of shifted rows
    assert len(rope) + len(forward) + len(backward) + len(norm_rope) + len(fp8) + len(layer_norm) == len(variants)


def test_cuda_headers_are_found():
    """The fp16/bf16 headers NVRTC needs come with the install extra (CUDA 12 wheels keep them in
    nvidia/cuda_runtime/include, CUDA 13 ones in nvidia/cu13/include)."""
    include = compile.cuda_include_dir()
    assert include and all(os.path.isfile(os.path.join(include, h)) for h in ("cuda_fp16.h", "cuda_bf16.h")), include


def test_missing_cuda_headers_say_how_to_install_them(monkeypatch):
    monkeypatch.setattr(compile, "cuda_include_dir", lambda: None)
    bf16 = next(v for v in all_variants() if "__nv_bfloat16" in v[1])
    with pytest.raises(compile.KernelCompileError, match=r"(?s)cuda_(fp|bf)16\.h.*pip install \"cupyrope\[cuda12\]\""):
        compile.compile_all("sm_90", [bf16], cache=False)


@pytest.mark.parametrize("arch,expected", [("sm_90", "sm_90"), ("90", "sm_90"), ("9.0", "sm_90"), (" sm_80 ", "sm_80"),
                                           ("12.0", "sm_120")])
def test_architectures_are_named_as_nvrtc_targets(arch, expected):
    assert compile.checked_arch(arch) == expected


@pytest.mark.parametrize("arch,message", [
    ("hopper", r"arch: expected something like 'sm_90', '90' or '9.0', got 'hopper'"),
    ("sm_90a", r"architecture-specific target; .* pass 'sm_90'"),
    ("compute_90", r"PTX target; .* pass 'sm_90'"),
    ("sm_91", r"has no target sm_91; its targets are sm_"),
])
def test_bad_architectures_are_refused_saying_what_to_pass(arch, message):
    with pytest.raises(ValueError, match=message):
        compile.compile_all(arch, [], cache=False)


@pytest.fixture
def broken_sources(tmp_path, monkeypatch):
    (tmp_path / "common.cuh").write_text("#pragma once\n")
    (tmp_path / "broken.cu").write_text('#include "common.cuh"\n__global__ void k() {\n  int x = ;\n}\n')
    monkeypatch.setattr(compile, "kernels_dir", lambda: tmp_path)
    monkeypatch.setattr(compile, "sources_hash", lambda: "0")
    return tmp_path


def test_compile_error_names_file_and_line(broken_sources):
    with pytest.raises(compile.KernelCompileError, match=r"broken\.cu:3"):
        compile.compile_all("sm_90", [("broken.cu", "k")], cache=False)


def test_sources_found_and_hash_covers_headers(tmp_path, monkeypatch):
    assert (compile.kernels_dir() / "rope.cu").is_file()
    for name in ("common.cuh", "rope.cu"):
        (tmp_path / name).write_bytes((compile.kernels_dir() / name).read_bytes())
    monkeypatch.setattr(compile, "kernels_dir", lambda: tmp_path)
    compile.sources_hash.cache_clear()
    try:
        before = compile.sources_hash()
        (tmp_path / "common.cuh").write_text((tmp_path / "common.cuh").read_text() + "\n// edit\n")
        compile.sources_hash.cache_clear()
        assert compile.sources_hash() != before
    finally:
        compile.sources_hash.cache_clear()


def test_architecture_this_nvrtc_dropped_says_which_extra_targets_it():
    import cupy

    if cupy.cuda.nvrtc.getVersion() < (13, 0):
        pytest.skip("NVRTC 12 still compiles for sm_70 (CI's CUDA 12 step does)")
    with pytest.raises(ValueError, match=r"(?s)sm_70.*pip install \"cupyrope\[cuda12\]\""):
        compile.compile_all("sm_70", all_variants()[:1], cache=False)


def test_gpus_this_nvrtc_cannot_target_are_named_before_compiling(monkeypatch):
    monkeypatch.setattr(compile, "nvrtc_archs", lambda: (75, 80, 90, 120))  # NVRTC 13's range, shortened
    assert compile.arch_unsupported("sm_90") is None
    assert compile.arch_unsupported("sm_130") is None  # newer GPUs: the newest target's PTX
    assert compile.target_of(90) == "sm_90" and compile.target_of(130) == "compute_120"
    assert compile.target_of(86) == "compute_80"  # no machine code of its own: the PTX of the one below
    assert 'pip install "cupyrope[cuda12]"' in compile.arch_unsupported("sm_70")
    monkeypatch.setattr(compile, "nvrtc_archs", lambda: (50, 60, 70, 90))  # NVRTC 12's
    assert "compute capability 7.0 (Volta) and newer" in compile.arch_unsupported("sm_35")
    # A V100 with the CUDA 13 extra: the first kernel load says so, before NVRTC or the GPU is asked.
    monkeypatch.setattr(compile, "nvrtc_archs", lambda: (75, 80, 90, 120))
    monkeypatch.setattr(compile, "_device_capability", lambda device: 70)
    with pytest.raises(compile.KernelCompileError, match=r"cuda:0: NVRTC .* cannot compile for sm_70.*cuda12"):
        compile._load("rope.cu", all_variants()[0][1], 0)


# ----------------------------------------------------------------------------------------- the kernel cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "kernel_cache"))
    return tmp_path / "kernel_cache"


def test_a_gpu_newer_than_nvrtc_gets_ptx_through_the_cache(cache_dir):
    """What a GPU past NVRTC's newest target loads: the PTX of that target, compiled and cached like machine code
    (the driver compiles it on load)."""
    variant = all_variants()[0]
    target = f"compute_{max(compile.nvrtc_archs())}"
    binary, lowered, compiled = compile.cached_binary(*variant, target)
    assert compiled and isinstance(binary, bytes)
    text = binary.rstrip(b"\0").decode()
    assert f".target sm_{max(compile.nvrtc_archs())}" in text and f".entry {lowered}" in text
    assert compile.cached_binary(*variant, target)[:2] == (binary, lowered)  # read back, not compiled again


def test_compile_fills_the_kernel_cache_and_a_second_run_compiles_nothing(cache_dir, monkeypatch):
    variants = all_variants()[:3] + all_variants()[-2:]
    first = compile.compile_all("sm_90", variants)
    assert all(compiled for *_, compiled in first)
    assert len(list(cache_dir.glob("cupyrope-*.bin"))) == len(variants)
    compiled_now = []
    real = compile._nvrtc_compile
    monkeypatch.setattr(compile, "_nvrtc_compile", lambda *args: compiled_now.append(args) or real(*args))
    second = compile.compile_all("sm_90", variants)
    assert not compiled_now and not any(compiled for *_, compiled in second)
    assert [r[:3] for r in first] == [r[:3] for r in second]
    # What a first call on an sm_90 GPU reads: the same binary, with no NVRTC compile.
    binary, lowered, compiled = compile.cached_binary(*variants[0], compile.target_of(90))
    assert not compiled and not compiled_now and len(binary) == first[0][2] and lowered.startswith("_Z")
    compile.compile_all("sm_90", variants[:1], force=True)
    assert len(compiled_now) == 1


def test_cache_entries_are_keyed_by_target_and_sources(cache_dir, monkeypatch):
    variant = all_variants()[0]
    paths = {compile._cache_path(*variant, target) for target in ("sm_80", "sm_90", "compute_120")}
    assert len(paths) == 3
    monkeypatch.setattr(compile, "sources_hash", lambda: "edited")
    assert compile._cache_path(*variant, "sm_90") not in paths  # an edited source never loads a stale binary


@pytest.mark.parametrize("damage", [b"", b"garbage", None])
def test_a_damaged_cache_entry_is_compiled_again(cache_dir, damage):
    variant = all_variants()[0]
    (path_entry,) = [compile._cache_path(*variant, "sm_90")]
    compile.compile_all("sm_90", [variant])
    data = path_entry.read_bytes()
    path_entry.write_bytes(data[:-10] + b"0123456789" if damage is None else damage)  # None: a flipped tail
    ((*_, compiled),) = compile.compile_all("sm_90", [variant])
    assert compiled and compile._read_cached(path_entry, variant[1]) is not None  # a good entry again


def test_an_unwritable_cache_warns_once_and_carries_on(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocked / "cache"))
    monkeypatch.setattr(compile, "_warned_unwritable", False)
    with pytest.warns(RuntimeWarning, match="cannot write the kernel cache"):
        results = compile.compile_all("sm_90", all_variants()[:2])
    assert all(compiled for *_, compiled in results)


def test_unusable_kernel_cache_dir_degrades_with_a_warning(tmp_path):
    bad = tmp_path / "not-a-dir"
    bad.write_text("a file where CuPy's cache directory should be")
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import cupyrope  # vets the directory before anything imports CuPy\n"
        "    from cupyrope._runtime import compile\n"
        "    from cupyrope.ops import all_variants\n"
        "    assert compile.compile_all('sm_90', all_variants()[:1])\n"
        "assert any('not usable' in str(w.message) for w in caught), caught\n"
        "print('ok')\n"
    )
    env = dict(os.environ, CUPY_CACHE_DIR=str(bad), PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
