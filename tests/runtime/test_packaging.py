"""The wheel ships the kernel sources and the launch profiles, and an installed cupyrope finds them (no network, no
GPU)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    builder = pytest.importorskip("hatchling.builders.wheel", reason="packaging tests need hatchling")
    out = tmp_path_factory.mktemp("dist")
    (artifact,) = builder.WheelBuilder(str(ROOT)).build(directory=str(out), versions=["standard"])
    return Path(artifact)


def test_wheel_contains_package_and_kernel_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for source in (ROOT / "kernels_src").glob("*.cu*"):
        assert f"cupyrope/kernels_src/{source.name}" in names
    profiles = list((ROOT / "cupyrope" / "profiles").glob("*.json"))
    assert profiles
    for profile in profiles:
        assert f"cupyrope/profiles/{profile.name}" in names
    for module in ("__init__.py", "torch.py", "dropin.py", "patch.py", "py.typed", "ops/rope.py", "_runtime/launch.py"):  # py.typed: type checkers read the hints
        assert f"cupyrope/{module}" in names


def test_installed_wheel_finds_its_sources(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")  # what pip install puts in site-packages
    code = ("import cupyrope._runtime.compile as c; from cupyrope.ops import profiles as p; print(c.kernels_dir()); "
            "print(c.sources_hash()); print(len(p.shipped_profiles()))")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found, digest, n_profiles = done.stdout.split()
    assert Path(found) == tmp_path / "site" / "cupyrope" / "kernels_src"
    from cupyrope._runtime.compile import sources_hash

    assert digest == sources_hash()  # the same sources as the checkout
    assert int(n_profiles) == len(list((ROOT / "cupyrope" / "profiles").glob("*.json")))
