"""Per-device facts the planners need (cached; read once per device)."""

import functools
from ._cupy import import_cupy


@functools.cache
def _properties(device: int) -> dict:
    return import_cupy().cuda.runtime.getDeviceProperties(device)


def sm_count(device: int) -> int:
    return _properties(device)["multiProcessorCount"]


def shared_optin(device: int) -> int:
    """Bytes of dynamic shared memory one block may opt in to."""
    return _properties(device)["sharedMemPerBlockOptin"]


def resident_blocks(kernel, threads: int, shared_mem: int, device: int) -> int:
    """Blocks of ``kernel`` (a cupyrope._compile.Kernel) of ``threads`` threads one SM holds at once,
    as the driver computes it from the kernel's registers and shared memory."""
    cupy = import_cupy()

    with cupy.cuda.Device(device):
        return max(1, cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads, shared_mem))
