"""Launch a compiled kernel with its parameters packed in one struct, through the CUDA driver.

Calling ``cuLaunchKernel`` through ctypes with a pre-packed parameter block costs a fraction of
CuPy's per-argument launch path (see docs/perf-notes.md), and takes a raw stream handle, so torch's
current stream needs no CuPy wrapper.
"""

import ctypes
import struct
import threading

CUDA_ERROR_INVALID_CONTEXT = 201
_PARAM_BYTES = 1024

_driver = None
_local = threading.local()


def _launch_function():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernel
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        fn.restype = ctypes.c_int
        _driver = fn
    return _driver


def _param_block():
    block = getattr(_local, "block", None)
    if block is None:
        buffer = ctypes.create_string_buffer(_PARAM_BYTES)
        pointers = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
        block = _local.block = (buffer, pointers)
    return block


def launch(kernel, grid: int, block: tuple[int, int], params: struct.Struct, values, stream: int, device: int,
           shared_mem: int = 0) -> None:
    """Launch ``kernel`` (a cupyrope._compile.Kernel) with ``values`` packed by ``params`` as its only argument,
    on ``stream`` with ``device`` current. Never synchronizes."""
    buffer, pointers = _param_block()
    params.pack_into(buffer, 0, *values)
    function = kernel.ptr
    cu_launch = _launch_function()
    import cupy

    runtime = cupy.cuda.runtime
    previous = runtime.getDevice()
    if previous != device:
        runtime.setDevice(device)
    try:
        status = cu_launch(function, grid, 1, 1, block[0], block[1], 1, shared_mem, stream, pointers, None)
        if status == CUDA_ERROR_INVALID_CONTEXT:  # first CUDA call on this thread: bind the context
            runtime.setDevice(device)
            status = cu_launch(function, grid, 1, 1, block[0], block[1], 1, shared_mem, stream, pointers, None)
    finally:
        if previous != device:
            runtime.setDevice(previous)
    if status != 0:
        raise RuntimeError(f"cupyrope: cuLaunchKernel failed with CUDA error {status} (grid={grid}, block={block})")
