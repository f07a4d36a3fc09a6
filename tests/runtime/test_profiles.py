"""Launch profiles, with no GPU: the shipped files read, a device's profile is chosen in the documented order
(CUPYROPE_PROFILE, tuned on this GPU, shipped for it, nearest shipped), a bad file is passed over with one
warning and never crashes, and the ops plan with the device's profile."""

import dataclasses
import json
import warnings

import pytest
from fakes import H100, PLANNING_PROFILE, stand_in_for_the_device
from helpers import PLAN_BASE as BASE
from helpers import planned_array as arr
from helpers import requires_gpu

from cupyrope._runtime.checks import NEW
from cupyrope._runtime.device import GpuModel
from cupyrope.ops import profiles, rope

H200 = GpuModel("NVIDIA H200", "9.0", 132, 3201000, 6144)
A100 = GpuModel("NVIDIA A100-SXM4-80GB", "8.0", 108, 1593000, 5120)


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    """No CUPYROPE_PROFILE, an empty kernel cache directory, and warnings not yet given."""
    monkeypatch.delenv("CUPYROPE_PROFILE", raising=False)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(profiles, "_warned", set())


def shipped_h100():
    return next(p for p in profiles.shipped_profiles() if p.gpu.name == H100.name)


def write(path, profile=PLANNING_PROFILE, **changes):
    """A profile file: ``profile``'s text, with top-level entries changed (None removes one)."""
    data = json.loads(profiles.profile_json(profile))
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def with_choice(profile, section, **values):
    return dataclasses.replace(profile, **{section: dataclasses.replace(getattr(profile, section), **values)})


def test_shipped_profiles_read_and_one_is_the_h100s():
    shipped = profiles.shipped_profiles()
    assert shipped and all(p.source.endswith(profiles.file_name(p.gpu)) for p in shipped)
    assert profiles.nearest(H100, shipped) is shipped_h100()
    assert shipped_h100().gpu.compute_capability == H100.compute_capability


def test_file_names_say_the_model_and_architecture():
    assert profiles.file_name(H100) == "nvidia-h100-80gb-hbm3-sm90.json"
    assert profiles.file_name(A100) == "nvidia-a100-sxm4-80gb-sm80.json"


def test_profile_text_reads_back(tmp_path):
    changed = with_choice(PLANNING_PROFILE, "rope", items_per_block=1024, direct_with_cache=False)
    read = profiles.read_profile(write(tmp_path / "p.json", changed))
    assert (read.rope, read.rms_norm_forward, read.gpu) == (changed.rope, changed.rms_norm_forward, changed.gpu)


@pytest.mark.parametrize("changes,message", [
    (dict(cupyrope_profile=2), "not a cupyrope launch profile of format 1"),
    (dict(gpu=None), "gpu: expected an object"),
    (dict(gpu={"name": "x"}), "gpu: expected name, compute_capability"),
    (dict(rope=None), "rope: expected an object of choices"),
    (dict(rope={"items_per_block": 640}), "rope: missing blocks_per_sm"),
    (dict(rms_norm_backward={"long_row_bytes": 8192, "one_cluster_max_rows": 32, "grad_lean_max_rows": 48, "spare": 1}),
     "rms_norm_backward: unknown spare"),
    (dict(rms_norm_backward={"long_row_bytes": 8192, "one_cluster_max_rows": 65, "grad_lean_max_rows": 48}),
     r"rms_norm_backward.one_cluster_max_rows: expected an integer in \[0, 64\], got 65"),
    (dict(rms_norm_backward={"long_row_bytes": 8192.0, "one_cluster_max_rows": 32, "grad_lean_max_rows": 48}),
     "rms_norm_backward.long_row_bytes: expected an integer"),
    (dict(rms_norm_backward={"long_row_bytes": True, "one_cluster_max_rows": 32, "grad_lean_max_rows": 48}),
     "rms_norm_backward.long_row_bytes: expected an integer"),
])
def test_a_profile_that_does_not_fit_is_refused_saying_why(tmp_path, changes, message):
    path = write(tmp_path / "p.json", **changes)
    with pytest.raises(profiles.ProfileError, match=message) as error:
        profiles.read_profile(path)
    assert str(path) in str(error.value)


def test_a_file_that_is_not_json_is_refused(tmp_path):
    (tmp_path / "p.json").write_text("{ not json")
    with pytest.raises(profiles.ProfileError, match="cannot read it"):
        profiles.read_profile(tmp_path / "p.json")
    with pytest.raises(profiles.ProfileError, match="cannot read it"):
        profiles.read_profile(tmp_path / "missing.json")


def test_nearest_takes_the_same_model_then_architecture_then_bandwidth_per_sm():
    reference = PLANNING_PROFILE
    h200 = dataclasses.replace(reference, gpu=H200, source="h200")
    a100 = dataclasses.replace(reference, gpu=A100, source="a100")
    assert profiles.nearest(H200, [reference, h200, a100]) is h200
    assert profiles.nearest(H100, [reference, h200, a100]) is reference
    # an H100 PCIe (114 SMs, slower memory): same architecture, closer to the H100 SXM's bandwidth per SM
    pcie = GpuModel("NVIDIA H100 PCIe", "9.0", 114, 1593000, 5120)
    assert profiles.nearest(pcie, [reference, h200, a100]) is reference
    # an A100 40GB: the A100's architecture wins over a closer bandwidth per SM elsewhere
    a100_40 = GpuModel("NVIDIA A100-SXM4-40GB", "8.0", 108, 1215000, 5120)
    assert profiles.nearest(a100_40, [reference, h200, a100]) is a100
    # a GPU of an architecture no profile has: the closest bandwidth per SM
    l40s = GpuModel("NVIDIA L40S", "8.9", 142, 9001000, 384)
    assert profiles.nearest(l40s, [reference, h200, a100]).gpu.bandwidth_per_sm == min(
        (p.gpu.bandwidth_per_sm for p in (reference, h200, a100)),
        key=lambda bw: abs(bw - l40s.bandwidth_per_sm))


def test_selection_order(tmp_path, monkeypatch):
    profile, why = profiles.select_profile(H100)
    assert profile is shipped_h100() and why == "shipped for this GPU"
    profile, why = profiles.select_profile(H200)
    assert profile is profiles.nearest(H200, profiles.shipped_profiles())
    if profile.gpu.name != H200.name:
        assert why.startswith("shipped, nearest to this GPU")
    tuned = write(profiles.tuned_path(H100), with_choice(PLANNING_PROFILE, "rope", items_per_block=512))
    assert tuned.parent == tmp_path / "cache" / "cupyrope-profiles"
    profile, why = profiles.select_profile(H100)
    assert (profile.rope.items_per_block, why) == (512, "tuned on this GPU")
    explicit = write(tmp_path / "mine.json", with_choice(PLANNING_PROFILE, "rope", items_per_block=256))
    monkeypatch.setenv("CUPYROPE_PROFILE", str(explicit))
    profile, why = profiles.select_profile(H100)
    assert (profile.rope.items_per_block, why, profile.source) == (256, "CUPYROPE_PROFILE", str(explicit))


def test_a_bad_file_is_passed_over_with_one_warning(tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    monkeypatch.setenv("CUPYROPE_PROFILE", str(bad))
    with pytest.warns(RuntimeWarning, match="CUPYROPE_PROFILE: ignoring .*bad.json: cannot read it"):
        profile, why = profiles.select_profile(H100)
    assert profile is shipped_h100()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profiles.select_profile(H100)[0] is profile  # warned once
    monkeypatch.delenv("CUPYROPE_PROFILE")
    write(profiles.tuned_path(H100), cupyrope_profile=0)  # a tuned file another version wrote
    with pytest.warns(RuntimeWarning, match="ignoring the tuned profile .*run `python -m cupyrope tune` again"):
        assert profiles.select_profile(H100)[0] is shipped_h100()


def test_ops_plan_with_the_devices_profile(tmp_path, monkeypatch):
    stand_in_for_the_device(monkeypatch.setattr)
    monkeypatch.setattr(profiles, "_profile_of", lambda device: profiles.select_profile(H100))  # each time
    x, positions = arr((4, 8, 128)), arr((4,), "int64", ptr=BASE + 2**32)
    options = dict(theta=1e4, style="neox", rotary_dim=None, inverse=False, impl="auto")

    def planned():
        return rope._plan_rope_call(x, positions, None, None, None, None, NEW, True, **options).name

    assert planned().startswith("cupyrope::rope_direct_kernel<")  # 4 tokens: the shipped profile takes them directly
    block_only = with_choice(PLANNING_PROFILE, "rope", direct_max_tokens=0)
    monkeypatch.setenv("CUPYROPE_PROFILE", str(write(tmp_path / "block.json", block_only)))
    assert planned().startswith("cupyrope::rope_kernel<")


@pytest.mark.gpu
@requires_gpu
def test_the_gpu_describes_its_model_and_gets_a_profile():
    from cupyrope._runtime.device import gpu_model

    model = gpu_model(0)
    assert model.sm_count > 0 and model.memory_clock_khz > 0 and model.memory_bus_bits > 0, model
    profile, why = profiles.select_profile(model)
    assert profile in profiles.shipped_profiles() and why.startswith("shipped")
    if model.name == H100.name:  # the shipped H100 profile names this GPU as its driver does
        shipped = shipped_h100().gpu
        assert (model.compute_capability, model.sm_count) == (shipped.compute_capability, shipped.sm_count)
        assert profile is shipped_h100() and why == "shipped for this GPU"
