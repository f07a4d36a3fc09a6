"""python -m cupyrope tune, with no GPU: its candidates lie in their choices' ranges, a candidate replaces the
current value only when it is clearly faster on the choice's workloads, and the command writes a profile that reads
back (timings stood in for)."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
from fakes import H100, PLANNING_PROFILE

from cupyrope import __main__ as cli
from cupyrope import tune
from cupyrope.ops import profiles


def test_every_candidate_lies_in_its_choices_range():
    for section, name, candidates, workloads in tune.choices_to_tune(None, None):
        field = next(f for f in dataclasses.fields(getattr(PLANNING_PROFILE, section)) if f.name == name)
        assert workloads and len(candidates) >= 2, name
        for value in candidates:
            if field.type in (bool, "bool"):
                assert isinstance(value, bool), (name, value)
            else:
                low, high = field.metadata["range"]
                assert low <= value <= high, (name, value)


class _Device:
    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


FAKE_CUPY = SimpleNamespace(cuda=SimpleNamespace(Device=_Device),
                            get_default_memory_pool=lambda: SimpleNamespace(free_all_blocks=lambda: None))


@pytest.fixture
def stood_in(monkeypatch):
    """tune() on a fake GPU whose times per call: items_per_block 1024 is 10% faster than anything else,
    blocks_per_sm 4 1% faster (noise: kept out), everything else the same."""
    monkeypatch.setattr("cupyrope._runtime.compile.import_cupy", lambda: FAKE_CUPY)
    monkeypatch.setattr("cupyrope._runtime.device.gpu_model", lambda device: H100)
    monkeypatch.setattr(profiles, "profile_for", lambda device: PLANNING_PROFILE)
    monkeypatch.setattr(profiles, "describe_profile", lambda device: "the planning tests' profile")
    workloads = [tune.Workload("a", lambda: []), tune.Workload("b", lambda: [])]
    monkeypatch.setattr(tune, "choices_to_tune", lambda cupy, rng: [
        ("rope", "items_per_block", (512, 1024), workloads), ("rope", "blocks_per_sm", (1, 4), workloads)])

    def time_candidate(cupy, profile, workloads, inputs):
        t = 0.9 if profile.rope.items_per_block == 1024 else 1.0
        return [t * (0.99 if profile.rope.blocks_per_sm == 4 else 1.0)] * len(workloads)

    monkeypatch.setattr(tune, "time_candidate", time_candidate)


def test_a_candidate_replaces_the_current_value_only_when_clearly_faster(stood_in):
    lines = []
    profile, measured = tune.tune(0, say=lines.append)
    assert profile.rope.items_per_block == 1024 and profile.rope.blocks_per_sm == PLANNING_PROFILE.rope.blocks_per_sm
    assert profile.rms_norm_forward == PLANNING_PROFILE.rms_norm_forward
    assert measured["rope.items_per_block"] == {"640": 1.0, "512": 1.0, "1024": 0.9}
    assert measured["rope.blocks_per_sm"]["4"] == 0.99
    assert lines[0].startswith("tuning NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)")
    assert lines[1].startswith("[1/2] rope.items_per_block = 1024") and lines[2].startswith("[2/2] rope.blocks_per_sm = 2")


def test_the_command_writes_a_profile_that_reads_back(stood_in, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("cupyrope._runtime.compile.device_count", lambda: 1)
    out = tmp_path / "sub" / "tuned.json"
    assert cli.main(["tune", "--out", str(out)]) == cli.EXIT_OK
    read = profiles.read_profile(out)
    assert read.gpu == H100 and read.rope.items_per_block == 1024
    data = json.loads(out.read_text())
    assert data["made_by"] == "python -m cupyrope tune" and "rope.items_per_block" in data["measured"]
    assert f"wrote {out}" in capsys.readouterr().out
    assert cli.main(["tune", "--device", "3"]) == cli.EXIT_USAGE
