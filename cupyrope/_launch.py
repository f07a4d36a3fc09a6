"""Launch a compiled kernel whose only parameter is a struct, through the CUDA driver.

The struct is the call's pointers followed by constant bytes the plan packed once, handed to
``cuLaunchKernel`` through CuPy's typed binding: much cheaper than CuPy's per-argument kernel call
(docs/perf-notes.md), and it takes a raw stream handle, so torch's current stream needs no wrapper.
"""

import ctypes
import struct
import threading
from ._cupy import import_cupy

CUDA_ERROR_INVALID_CONTEXT = 201
_PARAM_BYTES = 1024
_POINTER_PACKERS = {n: struct.Struct(f"<{n}Q") for n in range(1, 9)}

_driver = None
_runtime = None
_local = threading.local()


def _bind():
    global _driver, _runtime
    cupy = import_cupy()

    _runtime = cupy.cuda.runtime
    _driver = cupy.cuda.driver


def _param_block():
    """This thread's parameter buffer, a writable view of it, and the void*[1] array pointing at it."""
    block = getattr(_local, "block", None)
    if block is None:
        buffer = ctypes.create_string_buffer(_PARAM_BYTES)
        pointers = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
        block = _local.block = (buffer, memoryview(buffer).cast("B"), pointers, ctypes.addressof(pointers))
    return block


def launch(kernel, grid: int, block: tuple[int, int], pointers: tuple, tail: bytes, stream: int, device: int,
           shared_mem: int = 0) -> None:
    """Launch ``kernel`` (a cupyrope._compile.Kernel) with one struct parameter: ``pointers`` (uint64
    each) then ``tail``; on ``stream`` with ``device`` current. Never synchronizes."""
    if _driver is None:
        _bind()
    buffer, view, _, params = _param_block()
    packer = _POINTER_PACKERS[len(pointers)]
    packer.pack_into(buffer, 0, *pointers)
    view[packer.size : packer.size + len(tail)] = tail
    previous = _runtime.getDevice()
    if previous != device:
        _runtime.setDevice(device)
    try:
        try:
            _driver.launchKernel(kernel.ptr, grid, 1, 1, block[0], block[1], 1, shared_mem, stream, params, 0)
        except _driver.CUDADriverError as error:
            if error.status != CUDA_ERROR_INVALID_CONTEXT:
                raise RuntimeError(f"cupyrope: kernel launch failed (grid={grid}, block={block}): {error}") from None
            _runtime.setDevice(device)  # first CUDA call on this thread: bind the device's context
            _driver.launchKernel(kernel.ptr, grid, 1, 1, block[0], block[1], 1, shared_mem, stream, params, 0)
    finally:
        if previous != device:
            _runtime.setDevice(previous)
