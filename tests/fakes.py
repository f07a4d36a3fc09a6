"""Host-only stand-ins for CuPy arrays, enough for the argument checks, which must reject bad input before
anything touches a GPU (so these tests run in CI, which has none); and for the GPU itself, enough to run a
planned call's host path with CPU torch tensors (stand_in_for_the_gpu)."""

import sys
from types import SimpleNamespace

import numpy as np


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
    ``patch(module, name, value)``: setattr (scripts/host_path_cpu.py), or a test's monkeypatch.setattr."""
    import torch

    from cupyrope import _arrays, _launch

    rope_module, norm_module = sys.modules["cupyrope.rope"], sys.modules["cupyrope.rmsnorm"]

    def describe_cpu(obj, name):  # describe() that takes a CPU tensor as if it were on cuda:0 (planning only)
        if isinstance(obj, torch.Tensor):
            array = _arrays._from_torch(obj)
            array.device = 0  # a CPU tensor's get_device() is -1
            return array
        return _arrays.describe(obj, name)

    patch(_arrays, "_TORCH_TYPES", _arrays._TORCH_TYPES | {torch.Tensor})  # fingerprints take CPU tensors
    no_kernel = SimpleNamespace(ptr=0, raw=SimpleNamespace(shared_size_bytes=0))
    for module in (rope_module, norm_module):
        patch(module, "describe", describe_cpu)
        patch(module, "describe_optional", lambda obj, name: None if obj is None else describe_cpu(obj, name))
        patch(module, "get_kernel", lambda *args: no_kernel)
        patch(module, "sm_count", lambda device: 132)  # an H100's
    patch(norm_module, "shared_optin", lambda device: 227 * 1024)
    patch(norm_module, "allow_shared_memory", lambda *args: None)
    patch(norm_module, "_blocks_per_wave", lambda *args: 132 * 4)
    patch(norm_module, "_waves", lambda *args: 1)
    patch(norm_module, "runs_clusters", lambda device: True)
    patch(norm_module, "resident_clusters", lambda *args: 16)  # clusters of 8 an H100 holds at once
    patch(_launch, "_bind", lambda: None)
    patch(_launch, "_runtime", SimpleNamespace(getDevice=lambda: 0, setDevice=lambda device: None))
    patch(_launch, "_driver", SimpleNamespace(launchKernel=lambda *args: None, CUDADriverError=RuntimeError))
    patch(_launch, "_torch_stream", lambda device: 0)
    patch(_launch, "_cupy_stream", lambda device: 0)
    patch(_launch, "_programmatic", lambda device: False)  # plain launches: the no-op launchKernel above
