"""Host-only stand-ins for CuPy arrays: enough for the argument checks, which must reject bad input
before anything touches a GPU (so these tests run in CI, which has none)."""

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
