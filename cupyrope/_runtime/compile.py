"""Kernel sources -> NVRTC -> a binary in the kernel cache -> a loaded function per (variant, device).

Each kernel variant is one template instantiation of a ``.cu`` file in ``kernels_src/``, compiled by NVRTC on
first use and written to the kernel cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), from which
later processes load it without compiling. ``compile_all`` (``python -m cupyrope compile``) fills the same cache
ahead of time with NVRTC alone: no GPU, no driver. A cache entry is keyed by everything its code depends on
(NVRTC's version, the target, the options and a hash of every kernel source, headers included), so an edited
source or another NVRTC never loads a stale binary; an entry that fails its checksum is compiled again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import tempfile
import threading
import warnings
from pathlib import Path

CXX_STANDARD = "-std=c++17"
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_CACHE_MAGIC = b"cupyrope kernel 1\n"


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; the message names the .cu/.cuh file and line."""


class NoGPUError(RuntimeError):
    """No CUDA GPU or no CUDA driver on this machine."""


# ------------------------------------------------------------------------------------------------ CuPy


def _usable(directory: str) -> bool:
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def cache_dir() -> str:
    """The kernel cache: CuPy's (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)."""
    return os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")


def vet_cache_dir() -> None:
    """CuPy creates its cache directory when it is imported, and fails to import when that path cannot be a
    directory. Before CuPy is imported, an unusable directory is replaced by a fresh temporary one, with a
    warning: kernels are then compiled again in each process. (A program that imports CuPy itself first is
    beyond our reach.)"""
    if "cupy" not in sys.modules:
        directory = cache_dir()
        if not _usable(directory):
            fallback = tempfile.mkdtemp(prefix="cupyrope-kernel-cache-")
            warnings.warn(
                f"cupyrope: the kernel cache directory {directory!r} is not usable; compiling into "
                f"{fallback!r} instead (kernels are compiled again in each process)",
                RuntimeWarning,
                stacklevel=3,
            )
            os.environ["CUPY_CACHE_DIR"] = fallback


def import_cupy():
    vet_cache_dir()
    import cupy

    return cupy


def device_count() -> int:
    """CUDA devices on this machine; NoGPUError (saying why plainly) where there is no GPU or no usable driver."""
    cupy = import_cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as error:
        raise NoGPUError(_why_no_gpu(error)) from None
    if not count:
        raise NoGPUError("no CUDA GPU/driver found: the driver sees no GPU")
    return count


def _why_no_gpu(error) -> str:
    """The CUDA runtime reports a missing driver library as an "insufficient" driver (error 35): tell them apart."""
    import ctypes

    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return "no CUDA GPU/driver found: the CUDA driver (libcuda) is not installed on this machine"
    if getattr(error, "status", None) == 35:
        return (f"the CUDA driver is older than the CUDA runtime that CuPy uses ({error}): update the driver, or "
                "install the cupyrope extra that matches it (cuda12 or cuda13)")
    return f"no CUDA GPU/driver found ({error})"


# --------------------------------------------------------------------------------------------- sources


@functools.cache
def kernels_dir() -> Path:
    """The kernel sources: ``cupyrope/kernels_src`` in a wheel, the top-level ``kernels_src`` in a checkout or an
    editable install (hatchling's force-include is invisible to those)."""
    for candidate in (_PACKAGE_DIR / "kernels_src", _PACKAGE_DIR.parent / "kernels_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        "cupyrope could not find its CUDA sources: looked for kernels_src/ beside the package "
        f"({_PACKAGE_DIR}) and in the checkout ({_PACKAGE_DIR.parent}); reinstall cupyrope"
    )


@functools.cache
def sources_hash() -> str:
    """Hash of every kernel source, headers included (a cache key must change when any of them does)."""
    digest = hashlib.sha256()
    for path in sorted(kernels_dir().glob("*.cu*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


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
    return tuple(options)


def program_text(source_file: str, name_expression: str) -> str:
    # Including the real file (rather than pasting its text) makes NVRTC report errors against
    # kernels_src/<file>(<line>).
    return f"// cupyrope variant: {name_expression}\n#include \"{source_file}\"\n"


# ------------------------------------------------------------------------------------------ targets


@functools.cache
def nvrtc_archs() -> tuple[int, ...]:
    """The compute capabilities this NVRTC compiles for, e.g. (75, 80, ..., 121)."""
    return tuple(import_cupy().cuda.nvrtc.getSupportedArchs())


def nvrtc_version() -> str:
    return ".".join(map(str, import_cupy().cuda.nvrtc.getVersion()))


def arch_unsupported(arch: str) -> str | None:
    """Why this NVRTC cannot compile for ``arch`` ("sm_70"), with what to install instead; None when it can.
    GPUs newer than NVRTC's newest target get that target's PTX (target_of)."""
    number = int(arch.removeprefix("sm_"))
    if number >= min(nvrtc_archs()):
        return None
    advice = ("CUDA 13 dropped Volta: for it use pip install \"cupyrope[cuda12]\"" if number >= 70 else
              "cupyrope supports compute capability 7.0 (Volta) and newer")
    return (f"NVRTC {nvrtc_version()} cannot compile for {arch} (it targets sm_{min(nvrtc_archs())} and newer); "
            f"{advice}.")


def target_of(capability: int) -> str:
    """What a GPU of compute capability ``capability`` (e.g. 90) loads: its own machine code ("sm_90") where
    NVRTC targets it, else the PTX of the newest target below it ("compute_120"), which the driver compiles."""
    if capability in nvrtc_archs():
        return f"sm_{capability}"
    older = [a for a in nvrtc_archs() if a <= capability]
    if not older:
        raise KernelCompileError(arch_unsupported(f"sm_{capability}"))
    return f"compute_{max(older)}"


_ARCH = re.compile(r"(?:sm_)?(\d{2,3})|(\d{1,2})\.(\d)")


def checked_arch(arch: str) -> str:
    """``arch`` as NVRTC's "sm_NN": accepts "sm_90", "90" and a compute capability "9.0". Refuses what would
    build code no GPU loads from the cache: "sm_90a" (cupyrope uses no architecture-specific instructions; an
    H100 loads sm_90) and PTX targets ("compute_90"); and targets this NVRTC does not have."""
    text = arch.strip()
    match = _ARCH.fullmatch(text)
    if not match:
        if re.fullmatch(r"sm_\d+[af]", text):
            raise ValueError(f"arch: {text!r} is an architecture-specific target; cupyrope's kernels use no "
                             f"such instructions and a GPU loads the plain target: pass {text[:-1]!r}")
        if re.fullmatch(r"compute_\d+", text):
            raise ValueError(f"arch: {text!r} is a PTX target; compile builds machine code for a GPU "
                             f"architecture: pass {'sm_' + text.removeprefix('compute_')!r}")
        raise ValueError(f"arch: expected something like 'sm_90', '90' or '9.0', got {arch!r}")
    number = int(match.group(1) or match.group(2) + match.group(3))
    unsupported = arch_unsupported(f"sm_{number}")
    if unsupported:
        raise ValueError(f"arch: {unsupported}")
    if number not in nvrtc_archs():
        raise ValueError(f"arch: NVRTC {nvrtc_version()} has no target sm_{number}; its targets are "
                         + ", ".join(f"sm_{a}" for a in nvrtc_archs()))
    return f"sm_{number}"


# -------------------------------------------------------------------------------------------- NVRTC


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


def _nvrtc_compile(source_file: str, name_expression: str, target: str) -> tuple[bytes, str]:
    """(binary, lowered kernel name) of one variant for ``target`` ("sm_90": a cubin; "compute_120": PTX)."""
    nvrtc = import_cupy().cuda.nvrtc
    program = nvrtc.createProgram(program_text(source_file, name_expression), "cupyrope_variant.cu", (), ())
    try:
        nvrtc.addNameExpression(program, name_expression)
        try:
            nvrtc.compileProgram(program, (*compile_options(), f"-arch={target}"))
        except nvrtc.NVRTCError:
            raise _compile_error(name_expression, nvrtc.getProgramLog(program), target) from None
        if target.startswith("sm_"):
            binary = nvrtc.getCUBIN(program)
        else:  # PTX: bytes from CuPy 14, text before
            binary = nvrtc.getPTX(program)
            binary = binary if isinstance(binary, bytes) else binary.encode()
        return binary, nvrtc.getLoweredName(program, name_expression)
    finally:
        nvrtc.destroyProgram(program)


# ------------------------------------------------------------------------------------------ the cache


def _cache_path(source_file: str, name_expression: str, target: str) -> Path:
    key = "\n".join((nvrtc_version(), target, source_file, name_expression, sources_hash(),
                     " ".join(o for o in compile_options() if not o.startswith("-I"))))
    return Path(cache_dir()) / f"cupyrope-{hashlib.sha256(key.encode()).hexdigest()[:40]}.bin"


def _read_cached(path: Path, name_expression: str) -> tuple[bytes, str] | None:
    """(binary, lowered name) from a cache entry, or None where it is missing, unreadable or corrupt."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        magic, name, lowered, digest, binary = data.split(b"\n", 4)
    except ValueError:
        return None
    if (magic + b"\n" != _CACHE_MAGIC or name.decode(errors="replace") != name_expression
            or hashlib.sha256(binary).hexdigest().encode() != digest):
        return None
    return binary, lowered.decode()


_warned_unwritable = False


def _write_cached(path: Path, name_expression: str, binary: bytes, lowered: str) -> None:
    """Write an entry atomically (a reader sees the old entry or the new one); warn once where the cache
    cannot be written, and carry on without it."""
    global _warned_unwritable
    data = b"".join((_CACHE_MAGIC, name_expression.encode(), b"\n", lowered.encode(), b"\n",
                     hashlib.sha256(binary).hexdigest().encode(), b"\n", binary))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-cupyrope-", delete=False) as file:
            file.write(data)
        os.replace(file.name, path)
    except OSError as error:
        if not _warned_unwritable:
            _warned_unwritable = True
            warnings.warn(f"cupyrope: cannot write the kernel cache ({error}); kernels are compiled again in "
                          "each process", RuntimeWarning, stacklevel=4)


def cached_binary(source_file: str, name_expression: str, target: str, *, force: bool = False):
    """(binary, lowered name, whether it was compiled now) of a variant for ``target``: from the cache, else
    compiled by NVRTC and written there. ``force``: compile even where the cache has it."""
    path = _cache_path(source_file, name_expression, target)
    cached = None if force else _read_cached(path, name_expression)
    if cached is not None:
        return *cached, False
    binary, lowered = _nvrtc_compile(source_file, name_expression, target)
    _write_cached(path, name_expression, binary, lowered)
    return binary, lowered, True


def compile_all(arch: str, variants, *, cache: bool = True, force: bool = False) -> list[tuple[str, str, int, bool]]:
    """Compile every (source file, name expression) for ``arch`` ("sm_90"; see checked_arch) with NVRTC alone:
    no GPU, no driver. ``cache``: into the kernel cache, where later processes load them (entries already
    there are kept unless ``force``); without it, only to check that they compile. Returns (file, variant,
    binary size, compiled now) of each. Raises KernelCompileError on failure."""
    arch = checked_arch(arch)
    results = []
    for source_file, name_expression in variants:
        if cache:
            binary, _, compiled = cached_binary(source_file, name_expression, arch, force=force)
        else:
            (binary, _), compiled = _nvrtc_compile(source_file, name_expression, arch), True
        results.append((source_file, name_expression, len(binary), compiled))
    return results


# ------------------------------------------------------------------------------------------- loading


class Kernel:
    """A loaded kernel: ``ptr`` is its CUfunction handle on one device; ``module`` keeps it loaded."""

    __slots__ = ("ptr", "module", "name", "device", "_shared_allowed")

    def __init__(self, ptr: int, module, name: str, device: int):
        self.ptr = ptr
        self.module = module
        self.name = name
        self.device = device
        self._shared_allowed = 0

    def attribute(self, attribute: int) -> int:
        """A CUfunction attribute (cupy.cuda.driver.CU_FUNC_ATTRIBUTE_*): registers, local memory, ..."""
        return import_cupy().cuda.driver.funcGetAttribute(attribute, self.ptr)


_lock = threading.Lock()
_kernels: dict[tuple[str, str, int], Kernel] = {}


def get_kernel(source_file: str, name_expression: str, device: int) -> Kernel:
    """One template instantiation loaded on one device, compiled at most once per process and cache
    (thread-safe: concurrent first calls compile it once)."""
    key = (source_file, name_expression, device)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = _load(source_file, name_expression, device)
                _kernels[key] = kernel
    return kernel


def _device_capability(device: int) -> int:
    return int("".join(map(str, import_cupy().cuda.Device(device).compute_capability)))


def _load(source_file: str, name_expression: str, device: int) -> Kernel:
    cupy = import_cupy()
    capability = _device_capability(device)
    unsupported = arch_unsupported(f"sm_{capability}")
    if unsupported:
        raise KernelCompileError(f"cuda:{device}: {unsupported}")
    binary, lowered, _ = cached_binary(source_file, name_expression, target_of(capability))
    with cupy.cuda.Device(device):
        module = cupy.cuda.function.Module()
        module.load(binary)
        return Kernel(module.get_function(lowered).ptr, module, name_expression, device)


DEFAULT_SHARED_LIMIT = 48 * 1024


def allow_shared_memory(kernel: Kernel, nbytes: int) -> None:
    """Opt the kernel in to ``nbytes`` of dynamic shared memory where that and its static shared memory pass
    the default 48 KiB (once per kernel and size)."""
    if not nbytes or kernel._shared_allowed >= nbytes:
        return
    cupy = import_cupy()
    driver = cupy.cuda.driver
    with cupy.cuda.Device(kernel.device):
        if nbytes + kernel.attribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) > DEFAULT_SHARED_LIMIT:
            driver.funcSetAttribute(kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
    kernel._shared_allowed = nbytes
