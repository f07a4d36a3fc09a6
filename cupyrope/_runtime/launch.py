"""Launch a compiled kernel whose only parameter is a struct, through the CUDA driver.

A plan builds one ``Launch`` per kernel it runs: the grid, block, device and the constant bytes of the
struct are fixed then, so a call only packs its pointers (and the constant bytes after them) into this
thread's parameter buffer with one ``struct`` call and hands it to ``cuLaunchKernel`` through CuPy's
typed binding. That is much cheaper than CuPy's per-argument kernel call, and it takes a raw stream handle,
so torch's current stream needs no wrapper object.

On compute capability 9.0+, a launch captured into a CUDA graph right after another cupyrope launch is a
programmatic dependent launch (PDL): ``cuLaunchKernelEx`` with PROGRAMMATIC_STREAM_SERIALIZATION, so at replay it is
launched and placed while the kernel before it finishes. Every kernel waits for that kernel's completion before
touching memory and then lets its own successor launch (``wait_for_previous_grid`` in kernels_src/common.cuh), so
results are the same bits; back-to-back calls lose most of a launch's latency (bf16 [512, 256] forward 2.03 -> 1.54
us a call). After any other node (a matmul, attention, a torch kernel: how early those let a successor launch is
theirs to say) the launch stays plain: PDL there cost a transformers decode step captured in a graph 0.45 us a launch
(H200, Llama-3 shape: 2.916 against 2.894 ms). Eager launches stay plain by default: there the PDL launch (through
ctypes) costs the host 0.6-1.5 us more a launch than CuPy's binding, which small calls pay in full.
``set_pdl`` / ``CUPYROPE_PDL`` choose: "graphs" (the default), "always" or "never".
"""

import ctypes
import os
import struct
import sys
import threading

from .compile import import_cupy
from .device import LAUNCH_CONFIG, launch_kernel_ex, runs_clusters, stream_capture_info

CUDA_ERROR_INVALID_CONTEXT = 201
_PARAM_BYTES = 1024
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
# One CUlaunchAttribute: id, padding, then its 64-byte value (programmaticStreamSerializationAllowed = 1).
_PDL_ATTRIBUTE = ctypes.create_string_buffer(struct.pack("<I4xi60x", PROGRAMMATIC_STREAM_SERIALIZATION, 1), 72)
_PDL_ATTRIBUTE_ADDRESS = ctypes.addressof(_PDL_ATTRIBUTE)
PDL_MODES = ("never", "graphs", "always")
NEVER, GRAPHS, ALWAYS = range(3)  # their indices


_MODE_ALIASES = {True: "always", False: "never", "1": "always", "0": "never"}


def _mode(value, what: str = "mode") -> int:
    """The index in PDL_MODES of a set_pdl argument (True: "always", False: "never") or of CUPYROPE_PDL's value
    (also "1" and "0"); ``what`` names it in the error."""
    name = _MODE_ALIASES.get(value, value) if isinstance(value, (bool, str)) else value
    if name not in PDL_MODES:
        raise ValueError(f"{what}: expected one of {', '.join(map(repr, PDL_MODES))} (or True / False), got {value!r}")
    return PDL_MODES.index(name)


_pdl = _mode(os.environ.get("CUPYROPE_PDL", "graphs").strip().lower(), "CUPYROPE_PDL")


def set_pdl(mode) -> str:
    """Which launches are programmatic dependent launches on compute capability 9.0+: "graphs" (the default: those
    captured into a CUDA graph right after another cupyrope launch), "always" (every launch, eager ones too: GPU-bound
    eager loops gain 1-5%, small host-bound calls pay 0.6-1.5 us more host time a launch) or "never"; True and False
    mean "always" and "never". Returns the previous mode. It applies to launches made after it (a graph keeps what its
    capture recorded)."""
    global _pdl
    previous, _pdl = _pdl, _mode(mode)
    return PDL_MODES[previous]


def pdl_mode() -> str:
    """The launches that are programmatic dependent launches where the device runs them (see set_pdl)."""
    return PDL_MODES[_pdl]


def _programmatic(device: int) -> bool:
    """Whether launches on ``device`` can be programmatic dependent launches: sm_90+ and a driver with
    cuLaunchKernelEx."""
    return runs_clusters(device) and launch_kernel_ex() is not None


_driver = None
_runtime = None
_launch_ex = None  # the driver's cuLaunchKernelEx, or None without one
_capture_info = None  # the driver's cuStreamGetCaptureInfo_v3, or None without one
_local = threading.local()
_own_tails = {}  # capturing stream -> its capture_tail() right after a cupyrope launch into it


def _bind():
    global _driver, _runtime, _launch_ex, _capture_info
    cupy = import_cupy()

    _runtime = cupy.cuda.runtime
    _driver = cupy.cuda.driver
    _launch_ex = launch_kernel_ex()
    _capture_info = stream_capture_info()


def capture_tail(stream: int):
    """(capture id, node) of the one node a launch into the capturing ``stream`` would depend on; None where it would
    depend on several nodes or none, or the driver cannot tell."""
    if _capture_info is None:
        return None
    status, capture_id, nodes, count = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p(), ctypes.c_size_t()
    if _capture_info(stream, ctypes.byref(status), ctypes.byref(capture_id), None, ctypes.byref(nodes), None,
                     ctypes.byref(count)) or count.value != 1:
        return None
    return capture_id.value, ctypes.c_void_p.from_address(nodes.value).value


def _follows_own_launch(stream: int) -> bool:
    """Whether the node a launch into the capturing ``stream`` would follow is a cupyrope launch."""
    tail = capture_tail(stream)
    return tail is not None and _own_tails.get(stream) == tail


def _param_block():
    """This thread's new launch buffers: (parameter buffer, address of the void*[1] array pointing at it, CUlaunchConfig
    buffer, its address)."""
    buffer = ctypes.create_string_buffer(_PARAM_BYTES)
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
    config = ctypes.create_string_buffer(LAUNCH_CONFIG.size)
    _local.pointers = pointers  # keeps the array alive
    _local.block = buffer, ctypes.addressof(pointers), config, ctypes.addressof(config)
    return _local.block


def _torch_stream(device: int) -> int:
    return sys.modules["torch"]._C._cuda_getCurrentRawStream(device)


def _cupy_stream(device: int) -> int:
    return sys.modules["cupy"].cuda.get_current_stream(device).ptr


class Launch:
    """One kernel launch of a plan: ``kernel`` (a compile.Kernel) with one struct parameter
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
            buffer, params, config, config_address = _local.block
        except AttributeError:  # this thread's first launch (e.g. in torch's autograd thread)
            buffer, params, config, config_address = _param_block()
            _runtime.setDevice(_runtime.getDevice())  # binds the current device's context: no failed launch first
        self.packer.pack_into(buffer, 0, *pointers, self.tail)
        previous = _runtime.getDevice()
        if previous != self.device:
            _runtime.setDevice(self.device)
        try:
            self._launch(stream, params, config, config_address)
        except _driver.CUDADriverError as error:
            self._retry(error, stream, params, config, config_address)
        finally:
            if previous != self.device:
                _runtime.setDevice(previous)

    def _launch(self, stream: int, params: int, config, config_address: int) -> None:
        """The launch itself: a programmatic dependent launch where set_pdl's mode takes one ("graphs": the stream
        is capturing and its last node is a cupyrope launch), through cuLaunchKernelEx with the CUlaunchConfig packed
        into ``config``; else CuPy's cuLaunchKernel. A driver that refuses the PDL gets this plan's launches plainly
        from then on (a refused launch has not run)."""
        capturing = self.pdl and _pdl == GRAPHS and _runtime.streamIsCapturing(stream)
        launched = False
        if self.pdl and (_pdl == ALWAYS or capturing and _follows_own_launch(stream)):
            LAUNCH_CONFIG.pack_into(config, 0, self.grid, 1, 1, self.block[0], self.block[1], 1, self.shared_mem, stream,
                              _PDL_ATTRIBUTE_ADDRESS, 1)
            status = _launch_ex(config_address, self.function, params, None)
            if status == CUDA_ERROR_INVALID_CONTEXT:
                raise _driver.CUDADriverError(status)
            launched = self.pdl = not status
        if not launched:
            _driver.launchKernel(self.function, self.grid, 1, 1, self.block[0], self.block[1], 1, self.shared_mem,
                                 stream, params, 0)
        if capturing:
            _own_tails[stream] = capture_tail(stream)

    def _retry(self, error, stream: int, params: int, config, config_address: int) -> None:
        """A thread with no context bound (the first launch binds one; this is the fallback): bind the
        device's and launch again. Any other failure is raised."""
        if error.status != CUDA_ERROR_INVALID_CONTEXT:
            raise RuntimeError(f"cupyrope: kernel launch failed (grid={self.grid}, block={self.block}): {error}") from None
        _runtime.setDevice(self.device)
        self._launch(stream, params, config, config_address)
