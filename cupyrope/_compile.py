"""Kernel source + options -> a loaded CUDA function per (kernel variant, device).

Each variant is one template instantiation compiled on first use (NVRTC through ``cupy.RawModule``,
which also keeps CuPy's on-disk cache across processes). ``compile_all`` is the compile-only path: it
drives NVRTC directly, so it needs no GPU and no driver.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import warnings

from ._sources import kernels_dir, sources_hash
from ._cupy import import_cupy

CXX_STANDARD = "-std=c++17"


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; the message names the .cu/.cuh file and line."""


@functools.cache
def cuda_include_dir() -> str | None:
    """Where cuda_fp16.h and cuda_bf16.h are: the CUDA headers of the pip wheels that the install extras
    bring, found by cuda-pathfinder (as CuPy 14 finds NVRTC itself), else CuPy's CUDA path (a system
    toolkit). CuPy's path alone misses the CUDA 12 wheels' layout (nvidia/cuda_runtime/include)."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
    except Exception:  # cuda-pathfinder missing, too old, or finding nothing
        found = None
    if found and os.path.isfile(os.path.join(found, "cuda_fp16.h")):
        return found
    root = import_cupy().cuda.get_cuda_path()
    return f"{root}/include" if root else None


def compile_options() -> tuple[str, ...]:
    options = [CXX_STANDARD, f"-I{kernels_dir()}", f"-DCUPYROPE_SOURCES_HASH=0x{sources_hash()}"]
    include = cuda_include_dir()
    if include:
        options.append(f"-I{include}")
    # Developer knob for tuning sweeps (e.g. -DROPE_ITEM_UNROLL=4); see docs/perf-notes.md.
    options.extend(os.environ.get("CUPYROPE_EXTRA_NVRTC_OPTIONS", "").split())
    return tuple(options)


def program_text(source_file: str, name_expression: str) -> str:
    # Including the real file (rather than pasting its text) makes NVRTC report errors against
    # kernels_src/<file>(<line>); the comment makes each variant's cache entry distinct.
    return f"// cupyrope variant: {name_expression}\n#include \"{source_file}\"\n"


@functools.cache
def nvrtc_archs() -> tuple[int, ...]:
    """The compute capabilities this NVRTC compiles for, e.g. (75, 80, ..., 121)."""
    return tuple(import_cupy().cuda.nvrtc.getSupportedArchs())


def arch_unsupported(arch: str) -> str | None:
    """Why this NVRTC cannot compile for ``arch`` ("sm_70"), with what to install instead; None when it can.
    GPUs newer than NVRTC's newest target are left to CuPy, which compiles for that target."""
    number = int(arch.removeprefix("sm_"))
    if number >= min(nvrtc_archs()):
        return None
    version = ".".join(map(str, import_cupy().cuda.nvrtc.getVersion()))
    advice = ("CUDA 13 dropped Volta: for it use pip install \"cupyrope[cuda12]\"" if number >= 70 else
              "cupyrope supports compute capability 7.0 (Volta) and newer")
    return f"NVRTC {version} cannot compile for {arch} (it targets sm_{min(nvrtc_archs())} and newer); {advice}."


_ERROR_LINE = re.compile(r"([^\s:]+\.cuh?)\((\d+)\): (?:catastrophic )?error[^\n]*")


def _compile_error(what: str, log: str, arch: str) -> KernelCompileError:
    """The error, naming the first file:line NVRTC complains about (else ``what``), with a hint for the
    failures an install causes (missing headers, an architecture this NVRTC no longer targets)."""
    match = _ERROR_LINE.search(log)
    where = f"{match.group(1)}:{match.group(2)}" if match else what
    hint = ""
    if re.search(r'cannot open source file "cuda_(fp16|bf16)\.h"', log):
        hint = ("\nThe CUDA headers were not found (looked in "
                f"{cuda_include_dir() or 'no CUDA path'}): install them with pip install \"cupyrope[cuda12]\" "
                "(or [cuda13], matching your driver), or point CUDA_PATH at a CUDA toolkit.")
    elif "invalid value for --gpu-architecture" in log:
        hint = "\n" + (arch_unsupported(arch) or f"NVRTC cannot compile for {arch}.")
    return KernelCompileError(f"NVRTC failed to compile {where}\n{log.strip()}{hint}")


_lock = threading.Lock()
_functions: dict[tuple[str, str, int], Kernel] = {}


class Kernel:
    """A loaded kernel: ``ptr`` is its CUfunction handle on one device; ``raw`` keeps the module alive
    (and reports registers and local memory through cupy.RawKernel's attributes)."""

    __slots__ = ("ptr", "raw", "name", "_shared_allowed")

    def __init__(self, ptr: int, raw, name: str):
        self.ptr = ptr
        self.raw = raw
        self.name = name
        self._shared_allowed = 0


def get_kernel(source_file: str, name_expression: str, device: int) -> Kernel:
    """One template instantiation loaded on one device, compiled once per process (thread-safe:
    concurrent first calls compile it once)."""
    key = (source_file, name_expression, device)
    kernel = _functions.get(key)
    if kernel is None:
        with _lock:
            kernel = _functions.get(key)
            if kernel is None:
                kernel = _load(source_file, name_expression, device)
                _functions[key] = kernel
    return kernel


DEFAULT_SHARED_LIMIT = 48 * 1024


def allow_shared_memory(kernel: Kernel, nbytes: int, device: int) -> None:
    """Opt the kernel in to ``nbytes`` of dynamic shared memory where that and its static shared
    memory pass the default 48 KiB (once per kernel and size)."""
    if not nbytes or kernel._shared_allowed >= nbytes:
        return
    cupy = import_cupy()

    with cupy.cuda.Device(device):
        if nbytes + kernel.raw.shared_size_bytes > DEFAULT_SHARED_LIMIT:
            kernel.raw.max_dynamic_shared_size_bytes = nbytes
    kernel._shared_allowed = nbytes


def _load(source_file: str, name_expression: str, device: int):
    cupy = import_cupy()
    CompileException = cupy.cuda.compiler.CompileException

    text = program_text(source_file, name_expression)
    arch = _device_arch(device)
    unsupported = arch_unsupported(arch)
    if unsupported:
        raise KernelCompileError(f"cuda:{device}: {unsupported}")
    with cupy.cuda.Device(device):
        try:
            raw = _compile_with_cupy(text, name_expression)
        except CompileException as error:
            raise _compile_error(source_file, str(error), arch) from None
        except OSError as error:  # CuPy's disk cache is unreadable or unwritable
            warnings.warn(
                f"cupyrope: CuPy's kernel cache failed ({error}); compiling {name_expression} "
                "without the disk cache",
                RuntimeWarning,
                stacklevel=3,
            )
            raw = _compile_in_memory(text, name_expression, arch)
        return Kernel(raw.kernel.ptr, raw, name_expression)


def _device_arch(device: int) -> str:
    return "sm_" + "".join(map(str, import_cupy().cuda.Device(device).compute_capability))


def _compile_with_cupy(text: str, name_expression: str):
    cupy = import_cupy()

    module = cupy.RawModule(code=text, options=compile_options(), name_expressions=[name_expression])
    kernel = module.get_function(name_expression)
    kernel.kernel  # noqa: B018 - forces compile + load now, so errors surface here
    return kernel


def _compile_in_memory(text: str, name_expression: str, arch: str):
    cupy = import_cupy()

    # As CuPy does: a GPU newer than NVRTC's newest target gets code for that target.
    number = min(int(arch.removeprefix("sm_")), max(nvrtc_archs()))
    binary, mapping = _nvrtc_compile(text, name_expression, f"-arch=sm_{number}")
    module = cupy.cuda.function.Module()
    module.load(binary)
    _keepalive.append(module)
    return _LoadedKernel(module.get_function(mapping[name_expression]))


_keepalive: list = []


class _LoadedKernel:
    """Same interface as cupy.RawKernel's ``.kernel`` for modules loaded by hand."""

    def __init__(self, function):
        self.kernel = function


def _nvrtc_compile(text: str, name_expression: str, arch_option: str):
    nvrtc = import_cupy().cuda.nvrtc

    program = nvrtc.createProgram(text, "cupyrope_variant.cu", (), ())
    try:
        nvrtc.addNameExpression(program, name_expression)
        try:
            nvrtc.compileProgram(program, (*compile_options(), arch_option))
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(program)
            raise _compile_error(name_expression, log, arch_option.removeprefix("-arch=")) from None
        mapping = {name_expression: nvrtc.getLoweredName(program, name_expression)}
        return nvrtc.getCUBIN(program), mapping
    finally:
        nvrtc.destroyProgram(program)


def checked_arch(arch: str) -> str:
    """``arch`` as NVRTC's "sm_NN" (also accepts "compute_NN" and "NN"), or a ValueError."""
    number = arch.strip().removeprefix("sm_").removeprefix("compute_")
    if not number.isdigit():
        raise ValueError(f"arch: expected something like 'sm_90', got {arch!r}")
    return f"sm_{number}"


def compile_all(arch: str, variants: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """Compile every (source file, name expression) for ``arch`` (e.g. "sm_90") with NVRTC alone:
    no GPU, no driver. Returns (file, variant, cubin size). Raises KernelCompileError on failure."""
    arch = checked_arch(arch)
    results = []
    for source_file, name_expression in variants:
        text = program_text(source_file, name_expression)
        binary, _ = _nvrtc_compile(text, name_expression, f"-arch={arch}")
        results.append((source_file, name_expression, len(binary)))
    return results
