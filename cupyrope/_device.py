"""Per-device facts the planners need (cached; read once per device)."""

import functools


@functools.cache
def sm_count(device: int) -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
