"""Launch a compiled kernel whose only parameter is a struct, through the CUDA driver.

A plan builds one ``Launch`` per kernel it runs: the grid, block, device and the constant bytes of the
struct are fixed then, so a call only packs its pointers (and the constant bytes after them) into this
thread's parameter buffer with one ``struct`` call and hands it to ``cuLaunchKernel`` through CuPy's
typed binding. That is much cheaper than CuPy's per-argument kernel call (docs/perf-notes.md), and it
takes a raw stream handle, so torch's current stream needs no wrapper object.

On compute capability 9.0+ launches are programmatic dependent launches (PDL) by default: ``cuLaunchKernelEx``
with PROGRAMMATIC_STREAM_SERIALIZATION, so a kernel is launched and placed while the previous kernel in its stream
finishes. Every kernel waits for that kernel's completion before touching memory (``wait_for_previous_grid`` in
kernels_src/common.cuh), so results are the same; back-to-back calls lose most of a launch's latency (bf16
[512, 256] forward 2.03 -> 1.54 us a call in graph replay; docs/perf-notes.md). ``set_pdl(False)`` or
``CUPYROPE_PDL=0`` launches plainly.
"""

import ctypes
import os
import struct
import sys
import threading

from ._compile import compile_options
from ._cupy import import_cupy
from ._device import launch_kernel_ex, runs_clusters

CUDA_ERROR_INVALID_CONTEXT = 201
_PARAM_BYTES = 1024
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
# CUlaunchConfig: grid x/y/z, block x/y/z, dynamic shared memory, stream, attributes, their count.
_CONFIG = struct.Struct("<7I4xQQI4x")
# One CUlaunchAttribute: id, padding, then its 64-byte value (programmaticStreamSerializationAllowed = 1).
_PDL_ATTRIBUTE = ctypes.create_string_buffer(struct.pack("<I4xi60x", PROGRAMMATIC_STREAM_SERIALIZATION, 1), 72)
_pdl = os.environ.get("CUPYROPE_PDL", "1") != "0"


def set_pdl(enabled: bool) -> bool:
    """Launch kernels as programmatic dependent launches (compute capability 9.0+; the default) or plainly; returns
    the previous setting. It applies to launches made after it (a CUDA graph keeps what its capture recorded)."""
    global _pdl
    previous, _pdl = _pdl, bool(enabled)
    return previous


def pdl_enabled() -> bool:
    """Whether kernels are launched as programmatic dependent launches where the device runs them (set_pdl)."""
    return _pdl


def _programmatic(device: int) -> bool:
    """Whether launches on ``device`` can be programmatic dependent launches: sm_90+, a driver with cuLaunchKernelEx,
    and kernels that wait for the previous grid (not built with the A/B knob -DCUPYROPE_PDL=0)."""
    return runs_clusters(device) and launch_kernel_ex() is not None and "-DCUPYROPE_PDL=0" not in compile_options()

_driver = None
_runtime = None
_local = threading.local()


def _bind():
    global _driver, _runtime
    cupy = import_cupy()

    _runtime = cupy.cuda.runtime
    _driver = cupy.cuda.driver


def _param_block():
    """A new parameter buffer for this thread and the address of the void*[1] array pointing at it."""
    buffer = ctypes.create_string_buffer(_PARAM_BYTES)
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
    _local.pointers = pointers  # keeps the array alive
    _local.block = buffer, ctypes.addressof(pointers)
    return _local.block


def _config_block():
    """This thread's CUlaunchConfig buffer (cuLaunchKernelEx) and its address."""
    try:
        return _local.config
    except AttributeError:
        buffer = ctypes.create_string_buffer(_CONFIG.size)
        _local.config = buffer, ctypes.addressof(buffer)
        return _local.config


def _torch_stream(device: int) -> int:
    return sys.modules["torch"]._C._cuda_getCurrentRawStream(device)


def _cupy_stream(device: int) -> int:
    return sys.modules["cupy"].cuda.get_current_stream(device).ptr


class Launch:
    """One kernel launch of a plan: ``kernel`` (a cupyrope._compile.Kernel) with one struct parameter
    made of ``n_pointers`` uint64 then ``tail``, on ``device``. Calling it with the pointers launches
    on the caller's current stream (torch's for ``kind="torch"``, CuPy's otherwise); it never
    synchronizes."""

    __slots__ = ("function", "grid", "block", "shared_mem", "device", "tail", "packer", "current_stream", "pdl")

    def __init__(self, kernel, grid: int, block: tuple[int, int], n_pointers: int, tail: bytes, device: int,
                 kind: str, shared_mem: int = 0):
        if 8 * n_pointers + len(tail) > _PARAM_BYTES:
            raise ValueError(f"kernel parameters of {8 * n_pointers + len(tail)} bytes exceed {_PARAM_BYTES}")
        if _driver is None:
            _bind()
        self.function = kernel.ptr
        self.grid = grid
        self.block = block
        self.shared_mem = shared_mem
        self.device = device
        self.tail = tail
        self.packer = struct.Struct(f"<{n_pointers}Q{len(tail)}s")
        self.current_stream = _torch_stream if kind == "torch" else _cupy_stream
        self.pdl = _programmatic(device)

    def __call__(self, *pointers) -> None:
        stream = self.current_stream(self.device)
        try:
            buffer, params = _local.block
        except AttributeError:  # this thread's first launch (e.g. in torch's autograd thread)
            buffer, params = _param_block()
            _runtime.setDevice(_runtime.getDevice())  # binds the current device's context: no failed launch first
        self.packer.pack_into(buffer, 0, *pointers, self.tail)
        previous = _runtime.getDevice()
        if previous != self.device:
            _runtime.setDevice(self.device)
        try:
            if _pdl and self.pdl:
                self._launch_programmatic(stream, params)
            else:
                _driver.launchKernel(self.function, self.grid, 1, 1, self.block[0], self.block[1], 1, self.shared_mem,
                                     stream, params, 0)
        except _driver.CUDADriverError as error:
            self._retry(error, stream, params)
        finally:
            if previous != self.device:
                _runtime.setDevice(previous)

    def _launch_programmatic(self, stream: int, params: int) -> None:
        """cuLaunchKernelEx with PROGRAMMATIC_STREAM_SERIALIZATION. A driver that refuses it gets this plan's
        launches plainly from then on (a refused launch has not run)."""
        config, address = _config_block()
        _CONFIG.pack_into(config, 0, self.grid, 1, 1, self.block[0], self.block[1], 1, self.shared_mem, stream,
                          ctypes.addressof(_PDL_ATTRIBUTE), 1)
        status = launch_kernel_ex()(address, self.function, params, None)
        if status == CUDA_ERROR_INVALID_CONTEXT:
            raise _driver.CUDADriverError(status)
        if status:
            self.pdl = False
            _driver.launchKernel(self.function, self.grid, 1, 1, self.block[0], self.block[1], 1, self.shared_mem,
                                 stream, params, 0)

    def _retry(self, error, stream: int, params: int) -> None:
        """A thread with no context bound (the first launch binds one; this is the fallback): bind the
        device's and launch again. Any other failure is raised."""
        if error.status != CUDA_ERROR_INVALID_CONTEXT:
            raise RuntimeError(f"cupyrope: kernel launch failed (grid={self.grid}, block={self.block}): {error}") from None
        _runtime.setDevice(self.device)
        if _pdl and self.pdl:
            self._launch_programmatic(stream, params)
        else:
            _driver.launchKernel(self.function, self.grid, 1, 1, self.block[0], self.block[1], 1, self.shared_mem,
                                 stream, params, 0)
