"""Per-device facts the planners need (read once per device), and the driver entry points CuPy has no
binding for: cuLaunchKernelEx, cuStreamGetCaptureInfo and cuOccupancyMaxActiveClusters, through ctypes."""

import ctypes
import dataclasses
import functools
import struct
import sys

from .compile import import_cupy


@functools.cache
def _properties(device: int) -> dict:
    return import_cupy().cuda.runtime.getDeviceProperties(device)


def sm_count(device: int) -> int:
    return _properties(device)["multiProcessorCount"]


def shared_optin(device: int) -> int:
    """Bytes of dynamic shared memory one block may opt in to."""
    return _properties(device)["sharedMemPerBlockOptin"]


def runs_clusters(device: int) -> bool:
    """Whether the device runs thread block clusters and programmatic dependent launch (compute capability 9.0
    and newer)."""
    return _properties(device)["major"] >= 9


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """What tells GPU models apart for launch profiles: name, compute capability ("9.0"), SMs and memory."""

    name: str
    compute_capability: str
    sm_count: int
    memory_clock_khz: int
    memory_bus_bits: int

    @property
    def bandwidth_per_sm(self) -> float:
        """Peak memory bytes/s per SM (two transfers a clock)."""
        return 2 * self.memory_clock_khz * 1e3 * self.memory_bus_bits / 8 / max(1, self.sm_count)


@functools.cache
def gpu_model(device: int) -> GpuModel:
    properties = _properties(device)
    runtime = import_cupy().cuda.runtime

    def attribute(name: str) -> int:
        """A device attribute, 0 where this driver does not report it (the model is then matched without it)."""
        try:
            return int(runtime.deviceGetAttribute(getattr(runtime, name), device))
        except (AttributeError, runtime.CUDARuntimeError):
            return 0

    name = properties["name"]
    # CUDA 13's cudaDeviceProp has no memory clock field; the device attributes have both numbers.
    return GpuModel(
        name=name.decode() if isinstance(name, bytes) else str(name),
        compute_capability=f"{properties['major']}.{properties['minor']}",
        sm_count=properties["multiProcessorCount"],
        memory_clock_khz=attribute("cudaDevAttrMemoryClockRate"),
        memory_bus_bits=attribute("cudaDevAttrGlobalMemoryBusWidth"),
    )


def resident_blocks(kernel, threads: int, shared_mem: int, device: int) -> int:
    """Blocks of ``kernel`` (a compile.Kernel) of ``threads`` threads one SM holds at once, as the driver
    computes it from the kernel's registers and shared memory."""
    cupy = import_cupy()

    with cupy.cuda.Device(device):
        cupy.cuda.runtime.setDevice(device)  # binds the device's context in a thread that has none (autograd's)
        return max(1, cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads, shared_mem))


# CUlaunchConfig (cuda.h): grid x/y/z, block x/y/z, dynamic shared memory, stream, attributes, their count. The
# launcher packs it with one call per launch; the occupancy query below packs it the same way.
LAUNCH_CONFIG = struct.Struct("<7I4xQQI4x")


@functools.cache
def _libcuda():
    return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")


def _driver_entry(name: str, n_args: int):
    """The driver library's entry point ``name``, taking n_args pointer-sized arguments and returning a CUresult;
    None with no driver library or one without it."""
    try:
        function = getattr(_libcuda(), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p] * n_args
    function.restype = ctypes.c_int
    return function


@functools.cache
def launch_kernel_ex():
    """The driver's cuLaunchKernelEx(config, function, params, extra); None with no driver library or one
    older than CUDA 12."""
    return _driver_entry("cuLaunchKernelEx", 4)


@functools.cache
def stream_capture_info():
    """The driver's cuStreamGetCaptureInfo_v3(stream, status, id, graph, dependencies, edge data, count); None with no
    driver library or one older than CUDA 12.3."""
    return _driver_entry("cuStreamGetCaptureInfo_v3", 7)


PORTABLE_CLUSTER_BLOCKS = 8  # larger clusters need the kernel's opt-in (an H100 places 16)
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute in cuda.h


def resident_clusters(kernel, cluster: int, threads: int, shared_mem: int, device: int) -> int:
    """Clusters of ``cluster`` blocks of ``kernel`` (compiled with that cluster size) of ``threads`` threads the
    device holds at once: cuOccupancyMaxActiveClusters (a cluster's blocks share a GPC, so there may be fewer
    than SMs / cluster). 0 where the driver cannot say or place one. A cluster past the portable size opts the
    kernel in to it first (for this query and its launches); where the driver refuses, the query finds none."""
    cupy = import_cupy()
    config = ctypes.create_string_buffer(LAUNCH_CONFIG.pack(cluster, 1, 1, threads, 1, 1, shared_mem, 0, 0, 0))
    count = ctypes.c_int(0)
    try:
        with cupy.cuda.Device(device):
            if cluster > PORTABLE_CLUSTER_BLOCKS:
                _libcuda().cuFuncSetAttribute(ctypes.c_void_p(kernel.ptr), NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            status = _libcuda().cuOccupancyMaxActiveClusters(ctypes.byref(count), ctypes.c_void_p(kernel.ptr),
                                                             config)
    except (OSError, AttributeError):  # no driver library, or one older than CUDA 12
        return 0
    return count.value if status == 0 else 0
