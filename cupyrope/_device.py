"""Per-device facts the planners need (cached; read once per device)."""

import functools
from ._cupy import import_cupy


@functools.cache
def sm_count(device: int) -> int:
    cupy = import_cupy()

    return cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
