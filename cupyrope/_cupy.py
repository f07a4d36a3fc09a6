"""Import CuPy safely: an unusable kernel cache directory must not make cupyrope fail.

CuPy creates CUPY_CACHE_DIR when it is imported, and fails to import when that path cannot be a
directory. When cupyrope is imported, and again before it first imports CuPy, it checks the
directory; if it cannot be created or written, it warns and points CuPy at a fresh temporary
directory, so kernels are compiled again rather than read from the cache. (A program that imports
CuPy itself before cupyrope is beyond our reach.)
"""

import os
import sys
import tempfile
import warnings


def _usable(directory: str) -> bool:
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def vet_cache_dir() -> None:
    if "cupy" not in sys.modules:
        directory = os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")
        if not _usable(directory):
            fallback = tempfile.mkdtemp(prefix="cupyrope-kernel-cache-")
            warnings.warn(
                f"cupyrope: CuPy's kernel cache directory {directory!r} is not usable; compiling into "
                f"{fallback!r} instead (kernels are compiled again in each process)",
                RuntimeWarning,
                stacklevel=3,
            )
            os.environ["CUPY_CACHE_DIR"] = fallback


def import_cupy():
    vet_cache_dir()
    import cupy

    return cupy
