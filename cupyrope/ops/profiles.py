"""Launch profiles: the planners' measured choices for one GPU model, one JSON file each.

A profile holds the GPU it was measured on (device.GpuModel) and one section of choices per planner:
"rope" (rope_plan.RopeChoices), "qk_norm_rope" (QkNormRopeChoices), "rms_norm_forward" (ForwardChoices),
"rms_norm_backward" (BackwardChoices) and "layer_norm" (LayerNormChoices).
Choices change speed, never results: each is declared with the range the planners are tested over
(_runtime/choices.py).

A device's profile is looked up once per process, the first of:
1. the file CUPYROPE_PROFILE names;
2. the profile tuned on this GPU model, in the kernel cache's directory (tuned_path);
3. the shipped profile of this GPU model (cupyrope/profiles/);
4. the shipped profile nearest to it: the same compute capability first, then the closest memory bandwidth per SM.
A file that cannot be read, or that this cupyrope cannot take (another format, a missing or unknown choice, a
value of the wrong type or out of range), is passed over with one warning.
"""

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import warnings
from pathlib import Path

from .._runtime.choices import choices_dict, read_choices
from .._runtime.compile import cache_dir
from .._runtime.device import GpuModel, gpu_model
from .._runtime.plan_cache import forget_plans
from .layernorm_plan import LayerNormChoices
from .qk_norm_rope_plan import QkNormRopeChoices
from .rmsnorm_plan_backward import BackwardChoices
from .rmsnorm_plan_forward import ForwardChoices
from .rope_plan import RopeChoices

FORMAT = 1  # the "cupyrope_profile" number of files this version reads
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "profiles"
SECTIONS = {"rope": RopeChoices, "qk_norm_rope": QkNormRopeChoices, "rms_norm_forward": ForwardChoices,
            "rms_norm_backward": BackwardChoices, "layer_norm": LayerNormChoices}


@dataclasses.dataclass(frozen=True)
class Profile:
    gpu: GpuModel
    rope: RopeChoices
    qk_norm_rope: QkNormRopeChoices
    rms_norm_forward: ForwardChoices
    rms_norm_backward: BackwardChoices
    layer_norm: LayerNormChoices
    source: str  # the file it was read from


class ProfileError(ValueError):
    """A profile file that cannot be read or does not fit this version of cupyrope."""


def read_profile(path) -> Profile:
    """The profile in the file at ``path``; ProfileError saying why not."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ProfileError(f"{path}: cannot read it ({error})") from None
    try:
        if not isinstance(data, dict) or data.get("cupyrope_profile") != FORMAT:
            raise ValueError(f"not a cupyrope launch profile of format {FORMAT}")
        gpu = data.get("gpu")
        if not isinstance(gpu, dict):
            raise ValueError("gpu: expected an object")
        names = [field.name for field in dataclasses.fields(GpuModel)]
        if sorted(gpu) != sorted(names) or not isinstance(gpu["name"], str) or \
                not isinstance(gpu["compute_capability"], str) or \
                not all(isinstance(gpu[n], int) and gpu[n] > 0 for n in names[2:]):
            raise ValueError(f"gpu: expected {', '.join(names)}")
        sections = {name: read_choices(cls, data.get(name), name) for name, cls in SECTIONS.items()}
    except ValueError as error:
        raise ProfileError(f"{path}: {error}") from None
    return Profile(GpuModel(**gpu), **sections, source=str(path))


def profile_json(profile: Profile, **notes) -> str:
    """The text of a profile file; ``notes`` (how it was made) are kept beside the choices and ignored when
    read."""
    data = {"cupyrope_profile": FORMAT, **notes, "gpu": dataclasses.asdict(profile.gpu)}
    data.update({name: choices_dict(getattr(profile, name)) for name in SECTIONS})
    return json.dumps(data, indent=2) + "\n"


def file_name(gpu: GpuModel) -> str:
    """A profile's file name for this GPU model: its name and compute capability, e.g.
    nvidia-h100-80gb-hbm3-sm90.json."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.name.lower()).strip("-") or "gpu"
    return f"{slug}-sm{gpu.compute_capability.replace('.', '')}.json"


def tuned_path(gpu: GpuModel) -> Path:
    """Where a profile tuned on this GPU model is kept: beside the kernel cache."""
    return Path(cache_dir()) / "cupyrope-profiles" / file_name(gpu)


_warned: set[str] = set()


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"cupyrope: {message}", RuntimeWarning, stacklevel=3)


@functools.cache
def shipped_profiles() -> tuple[Profile, ...]:
    return tuple(read_profile(path) for path in sorted(SHIPPED_DIR.glob("*.json")))


def nearest(gpu: GpuModel, profiles) -> Profile:
    """The profile measured on this GPU model (same name, compute capability and SMs), else the nearest: the same
    compute capability first, then the closest memory bandwidth per SM."""
    def distance(profile):
        other = profile.gpu
        same_model = (other.name, other.compute_capability, other.sm_count) == \
            (gpu.name, gpu.compute_capability, gpu.sm_count)
        return (not same_model, other.compute_capability != gpu.compute_capability,
                abs(math.log(other.bandwidth_per_sm / gpu.bandwidth_per_sm)) if gpu.bandwidth_per_sm else 0.0)
    return min(profiles, key=distance)


def select_profile(gpu: GpuModel) -> tuple[Profile, str]:
    """The profile this GPU model runs with (the order in the module's docstring), and why it was chosen."""
    explicit = os.environ.get("CUPYROPE_PROFILE")
    if explicit:
        try:
            return read_profile(explicit), "CUPYROPE_PROFILE"
        except ProfileError as error:
            _warn(f"CUPYROPE_PROFILE: ignoring {error}")
    tuned = tuned_path(gpu)
    if tuned.exists():
        try:
            return read_profile(tuned), "tuned on this GPU"
        except ProfileError as error:
            _warn(f"ignoring the tuned profile {error}; run `python -m cupyrope tune` again")
    profile = nearest(gpu, shipped_profiles())
    same = (profile.gpu.name, profile.gpu.compute_capability) == (gpu.name, gpu.compute_capability)
    return profile, "shipped for this GPU" if same else f"shipped, nearest to this GPU ({profile.gpu.name})"


@functools.cache
def _profile_of(device: int) -> tuple[Profile, str]:
    return select_profile(gpu_model(device))


_planning_with: list[Profile] = []  # planning_with's profile, where one is given


@contextlib.contextmanager
def planning_with(profile: Profile):
    """Calls inside plan with ``profile`` on every device (the tuner's candidates); every op's plans are forgotten
    on the way in and out."""
    forget_plans()
    _planning_with[:] = [profile]
    try:
        yield profile
    finally:
        _planning_with.clear()
        forget_plans()


def profile_for(device: int) -> Profile:
    """The launch profile the planners use on this device (looked up once per process)."""
    return _planning_with[0] if _planning_with else _profile_of(device)[0]


def describe_profile(device: int) -> str:
    """Which profile a device runs with, and why: a line for `python -m cupyrope info`."""
    profile, why = _profile_of(device)
    return f"{profile.source} ({why})"
