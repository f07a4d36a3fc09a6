"""python -m cupyrope (and the `cupyrope` command): info, compile, check, bench, tune; what each says and its exit
code where there is no GPU (EXIT_NO_GPU, the same for check, bench and tune), and the kernel cache compile fills."""

import json
import os
import subprocess
import sys

import pytest

from cupyrope import __main__ as cli
from cupyrope._runtime import compile
from cupyrope._runtime.compile import NoGPUError
from cupyrope.ops import all_variants
from helpers import n_gpus

pytest.importorskip("cupy", reason="the command line needs CuPy")

NO_GPU = "no CUDA GPU/driver found: the CUDA driver (libcuda) is not installed on this machine"


@pytest.fixture
def no_gpu(monkeypatch):
    def no_device():
        raise NoGPUError(NO_GPU)

    monkeypatch.setattr(compile, "device_count", no_device)


@pytest.mark.parametrize("command", [["check"], ["bench", "--op", "rope"], ["bench", "--op", "model"], ["tune"]])
def test_check_and_bench_say_there_is_no_gpu_with_one_exit_code(no_gpu, capsys, command):
    assert cli.main(command) == cli.EXIT_NO_GPU == 3
    assert capsys.readouterr().err.strip() == f"cupyrope {command[0]}: {NO_GPU}"


def test_info_reports_no_gpu_plainly_and_succeeds(no_gpu, capsys):
    assert cli.main(["info"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert f"GPU: {NO_GPU}" in out and "kernel cache: " in out and "NVRTC" in out


@pytest.mark.skipif(n_gpus() > 0, reason="this machine has a GPU")
def test_on_a_machine_without_a_gpu(tmp_path):
    """The real thing, as a user runs it: a new process, the installed command's module."""
    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp_path))
    for command, code in (("info", 0), ("check", 3), ("bench", 3), ("compile", 1)):
        done = subprocess.run([sys.executable, "-m", "cupyrope", command], capture_output=True, text=True, env=env)
        assert done.returncode == code, (command, done.stdout, done.stderr)
        assert "no CUDA GPU/driver found" in done.stdout + done.stderr, (command, done.stdout, done.stderr)
        assert "insufficient" not in done.stdout + done.stderr  # said plainly, not as a driver version problem


def test_compile_without_arch_and_without_gpu_asks_for_one(no_gpu, capsys):
    assert cli.main(["compile"]) == cli.EXIT_FAILED
    assert "name the GPU's architecture, e.g. --arch sm_90" in capsys.readouterr().err


def test_compile_builds_into_the_kernel_cache_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("cupyrope.ops.all_variants", lambda: all_variants()[:2])
    assert cli.main(["compile", "--arch", "sm_90", "--jobs", "1"]) == cli.EXIT_OK
    assert f"sm_90: 2 kernel variants (2 compiled, 0 already in the kernel cache {tmp_path})" in capsys.readouterr().out
    assert len(list(tmp_path.glob("cupyrope-*.bin"))) == 2
    assert cli.main(["compile", "--arch", "90, 8.0", "--jobs", "2"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "sm_90: 2 kernel variants (0 compiled, 2 already in the kernel cache" in out
    assert "sm_80: 2 kernel variants (2 compiled, 0 already" in out
    assert cli.main(["compile", "--arch", "sm_90", "--force"]) == cli.EXIT_OK
    assert "(2 compiled, 0 already" in capsys.readouterr().out
    assert cli.main(["compile", "--arch", "sm_120", "--check-only"]) == cli.EXIT_OK
    assert "sm_120: 2 kernel variants (checked only, nothing kept)" in capsys.readouterr().out
    assert len(list(tmp_path.glob("cupyrope-*.bin"))) == 4


@pytest.mark.parametrize("arch,message", [("sm_90,hopper", "arch: expected something like 'sm_90'"),
                                          ("sm_90a", "pass 'sm_90'"), ("compute_90", "pass 'sm_90'")])
def test_compile_refuses_bad_architectures_before_compiling_anything(capsys, arch, message):
    assert cli.main(["compile", "--arch", arch, "--jobs", "1"]) == cli.EXIT_FAILED
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_bench_names_its_extra_where_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps({"environment": "saved run", "copy_gbps": 3000.0, "results": [
        {"op": "rope", "label": "x", "dtype": "bfloat16", "size": 8, "bytes": 16, "provider": "cupyrope vector",
         "gpu_us": 1.0, "eager_us": 5.0, "gbps": 0.016}]}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(["bench", "--from-json", str(saved), "--plot", str(tmp_path / "p.png")]) == cli.EXIT_OK
    assert 'pip install "cupyrope[bench]"' in capsys.readouterr().out
