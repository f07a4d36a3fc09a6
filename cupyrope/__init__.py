"""cupyrope: fused RoPE, RMSNorm and LayerNorm CUDA kernels for CuPy arrays and torch tensors, compiled at run time
with NVRTC (no compiler toolchain, no build step)."""

from . import reference, rope_scaling
from ._runtime.compile import KernelCompileError, NoGPUError, vet_cache_dir
from ._runtime.launch import pdl_mode, set_pdl
from .ops.layernorm import fused_add_layer_norm, layer_norm, layer_norm_backward
from .ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_backward
from .ops.rmsnorm import add_rms_norm, fused_add_rms_norm, rms_norm, rms_norm_backward
from .ops.rmsnorm_fp8 import rms_norm_fp8
from .ops.rope import rope, rope_, rope_cache, rope_cos_sin, rope_qk, rope_qk_cos_sin

__version__ = "0.1.0"

vet_cache_dir()  # before anything imports CuPy: an unusable cache directory would make that fail

__all__ = [
    "KernelCompileError",
    "NoGPUError",
    "add_rms_norm",
    "fused_add_layer_norm",
    "fused_add_rms_norm",
    "layer_norm",
    "layer_norm_backward",
    "pdl_mode",
    "qk_norm_rope",
    "qk_norm_rope_backward",
    "reference",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_fp8",
    "rope",
    "rope_",
    "rope_cache",
    "rope_cos_sin",
    "rope_qk",
    "rope_qk_cos_sin",
    "rope_scaling",
    "set_pdl",
]
