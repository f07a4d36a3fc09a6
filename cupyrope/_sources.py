"""Find the kernel sources (.cu/.cuh) and fingerprint them.

A wheel ships them as ``cupyrope/kernels_src``; a checkout or an editable install has them in the
top-level ``kernels_src`` (hatchling's force-include is invisible to editable installs).
"""

import functools
import hashlib
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


@functools.cache
def kernels_dir() -> Path:
    for candidate in (_PACKAGE_DIR / "kernels_src", _PACKAGE_DIR.parent / "kernels_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        "cupyrope could not find its CUDA sources: looked for kernels_src/ beside the package "
        f"({_PACKAGE_DIR}) and in the checkout ({_PACKAGE_DIR.parent}); reinstall cupyrope"
    )


@functools.cache
def sources_hash() -> str:
    """Hash of every kernel source, headers included: it goes into the compile options so that
    CuPy's disk cache (which does not hash included headers) is invalidated by any change."""
    digest = hashlib.sha256()
    for path in sorted(kernels_dir().glob("*.cu*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
