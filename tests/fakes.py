"""Host-only stand-ins for CuPy arrays, enough for the argument checks, which must reject bad input before
anything touches a GPU (so these tests run in CI, which has none); and for the GPU itself, enough to run a
planned call's host path with CPU torch tensors (stand_in_for_the_gpu)."""

from types import SimpleNamespace

import numpy as np

from cupyrope._runtime.device import GpuModel
from cupyrope.ops.layernorm_plan import LayerNormChoices
from cupyrope.ops.profiles import Profile
from cupyrope.ops.qk_norm_rope_plan import QkNormRopeChoices
from cupyrope.ops.rmsnorm_plan_backward import BackwardChoices
from cupyrope.ops.rmsnorm_plan_forward import ForwardChoices
from cupyrope.ops.rope_plan import RopeChoices


def _np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class FakeCupyArray:
    def __init__(self, shape, dtype="float32", strides=None, ptr=0x7F0000000000, device=0):
        self.shape = tuple(shape)
        self.dtype = _np_dtype(dtype)
        self.itemsize = self.dtype.itemsize
        if strides is None:
            strides, step = [], 1
            for n in reversed(self.shape):
                strides.insert(0, step)
                step *= max(n, 1)
        self.strides = tuple(s * self.itemsize for s in strides)
        self.data = SimpleNamespace(ptr=ptr, device_id=device)
        self.device = SimpleNamespace(id=device)
        self.size = int(np.prod(self.shape))


FakeCupyArray.__module__ = "cupy._core.fake"  # how describe() recognizes CuPy arrays


def stand_in_for_the_gpu(patch=setattr):
    """Let cupyrope's ops take CPU torch tensors as if they were on cuda:0 and make the driver calls (current
    device, current stream, cuLaunchKernel) no-ops, so that a call runs exactly cupyrope's own host code:
    fingerprints or recall, plan-cache lookup, overlap checks, parameter packing, output allocation.
    ``patch(module, name, value)``: setattr (tools/host_path_cpu.py), or a test's monkeypatch.setattr."""
    import torch

    from cupyrope._runtime import arrays, launch, plan_cache

    def describe_cpu(obj, name):  # describe() that takes a CPU tensor as if it were on cuda:0 (planning only)
        if isinstance(obj, torch.Tensor):
            array = arrays._from_torch(obj)
            array.device = 0  # a CPU tensor's get_device() is -1
            return array
        return arrays.describe(obj, name)

    torch_types = arrays.TORCH_TYPES | {torch.Tensor}  # fingerprints and recall take CPU tensors
    patch(arrays, "TORCH_TYPES", torch_types)
    patch(plan_cache, "TORCH_TYPES", torch_types)
    patch(plan_cache, "describe_optional", lambda obj, name: None if obj is None else describe_cpu(obj, name))
    stand_in_for_the_device(patch)
    patch(launch, "_runtime", SimpleNamespace(getDevice=lambda: 0, setDevice=lambda device: None))
    patch(launch, "_driver", SimpleNamespace(launchKernel=lambda *args: None, CUDADriverError=RuntimeError))
    patch(launch, "_torch_stream", lambda device: 0)
    patch(launch, "_cupy_stream", lambda device: 0)


# The GPU model stand_in_for_the_device answers for (an H100 SXM as the driver describes it).
H100 = GpuModel("NVIDIA H100 80GB HBM3", "9.0", 132, 2619000, 5120)
# The launch profile the planning tests plan with: fixed here, so that a newly tuned shipped profile changes no
# planning test (the values measured by hand on an H100).
PLANNING_PROFILE = Profile(
    H100, RopeChoices(items_per_block=640, blocks_per_sm=2, direct_max_tokens=64, direct_with_cache=True,
                      direct_threads=64),
    QkNormRopeChoices(forward_threads_per_block=1024, backward_threads_per_block=1024),
    ForwardChoices(small_row_bytes=4096, row_cache_max_bytes=65536, split_min_row_bytes=131072,
                   fp8_elems_per_thread=32, fp8_token_elems_per_thread=16),
    BackwardChoices(long_row_bytes=8192, one_cluster_max_rows=32, grad_lean_max_rows=48),
    LayerNormChoices(backward_three_blocks_min_rows=2, forward_eight_slots_min_hidden=8192), source="tests/fakes.py")


def stand_in_for_the_device(patch=setattr, shared_optin=227 * 1024, blocks_per_wave=132 * 4, resident_clusters=None):
    """Answer the device queries the planners make as an H100 would (132 SMs, clusters), with ``shared_optin``
    bytes of shared memory a block, ``blocks_per_wave`` resident blocks and ``resident_clusters(split)`` clusters
    (default 16, clusters of 8 an H100 holds at once); no kernel is loaded and launches are plain."""
    from cupyrope._runtime import launch
    from cupyrope.ops import (layernorm, profiles, qk_norm_rope, rmsnorm, rmsnorm_fp8, rmsnorm_plan_backward,
                              rmsnorm_plan_forward, rmsnorm_rows, rope)

    no_kernel = SimpleNamespace(ptr=0, device=0, attribute=lambda attribute: 0)
    for module in (rope, rmsnorm, rmsnorm_rows, rmsnorm_plan_forward, layernorm, qk_norm_rope):
        patch(module, "get_kernel", lambda *args: no_kernel)
    for module in (rope, rmsnorm, rmsnorm_rows, qk_norm_rope):
        patch(module, "sm_count", lambda device: 132)
    patch(qk_norm_rope, "allow_shared_memory", lambda *args: None)
    patch(qk_norm_rope, "resident_blocks", lambda *args: blocks_per_wave // 132)
    patch(rmsnorm_rows, "shared_optin", lambda device: shared_optin)
    patch(rmsnorm_rows, "allow_shared_memory", lambda *args: None)
    clusters = resident_clusters or (lambda split: 16)
    for module in (rmsnorm_plan_backward, rmsnorm_fp8):  # LayerNorm's backward: rmsnorm_plan_backward.resident_grid
        patch(module, "blocks_per_wave", lambda *args: blocks_per_wave)
    for module in (rmsnorm_plan_forward, rmsnorm_plan_backward):  # LayerNorm's backward: fitted_to_device
        patch(module, "runs_clusters", lambda device: True)
    for module in (rmsnorm_rows, rmsnorm_plan_backward):
        patch(module, "resident_clusters", lambda kernel, split, *args: clusters(split))
    patch(launch, "_bind", lambda: None)
    patch(launch, "_programmatic", lambda device: False)  # plain launches
    patch(profiles, "_profile_of", lambda device: (PLANNING_PROFILE, "the planning tests'"))
