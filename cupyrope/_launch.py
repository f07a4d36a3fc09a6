"""Launch a compiled kernel whose only parameter is a struct, through the CUDA driver.

The struct is the call's pointers followed by constant bytes the plan packed once. Calling
``cuLaunchKernel`` through ctypes with that block costs a fraction of CuPy's per-argument launch path
(docs/perf-notes.md), and takes a raw stream handle, so torch's current stream needs no CuPy wrapper.
"""

import ctypes
import struct
import threading

CUDA_ERROR_INVALID_CONTEXT = 201
_PARAM_BYTES = 1024
_POINTER_PACKERS = {n: struct.Struct(f"<{n}Q") for n in range(1, 9)}

_cu_launch = None
_runtime = None
_local = threading.local()


def _bind():
    global _cu_launch, _runtime
    import cupy

    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    _runtime = cupy.cuda.runtime
    _cu_launch = fn


def _param_block():
    block = getattr(_local, "block", None)
    if block is None:
        buffer = ctypes.create_string_buffer(_PARAM_BYTES)
        address = ctypes.addressof(buffer)
        pointers = (ctypes.c_void_p * 1)(address)
        block = _local.block = (buffer, address, pointers)
    return block


def launch(kernel, grid: int, block: tuple[int, int], pointers: tuple, tail: bytes, stream: int, device: int,
           shared_mem: int = 0) -> None:
    """Launch ``kernel`` (a cupyrope._compile.Kernel) with one struct parameter: ``pointers`` (uint64
    each) then ``tail``; on ``stream`` with ``device`` current. Never synchronizes."""
    if _cu_launch is None:
        _bind()
    buffer, address, params = _param_block()
    packer = _POINTER_PACKERS[len(pointers)]
    packer.pack_into(buffer, 0, *pointers)
    ctypes.memmove(address + packer.size, tail, len(tail))  # (slice assignment copies byte by byte)
    previous = _runtime.getDevice()
    if previous != device:
        _runtime.setDevice(device)
    try:
        status = _cu_launch(kernel.ptr, grid, 1, 1, block[0], block[1], 1, shared_mem, stream, params, None)
        if status == CUDA_ERROR_INVALID_CONTEXT:  # first CUDA call on this thread: bind the context
            _runtime.setDevice(device)
            status = _cu_launch(kernel.ptr, grid, 1, 1, block[0], block[1], 1, shared_mem, stream, params, None)
    finally:
        if previous != device:
            _runtime.setDevice(previous)
    if status != 0:
        raise RuntimeError(f"cupyrope: cuLaunchKernel failed with CUDA error {status} (grid={grid}, block={block})")
