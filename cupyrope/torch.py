"""PyTorch integration: differentiable ops, torch.compile / CUDA-graph support, drop-in modules.

Eager calls go straight to the kernels (no dispatcher): autograd through ``torch.autograd.Function``
when a gradient is needed, a plain call otherwise. Under ``torch.compile`` the same functions call the
ops registered with ``torch.library`` (``torch.ops.cupyrope.*``), which have fake (meta) kernels and
registered autograd, so graphs trace with no breaks and ``mode="reduce-overhead"`` captures them in
CUDA graphs. CPU tensors fall back to the same formulas in plain torch, after the same argument checks as
the GPU path (the same exceptions), so the modules stay drop-in replacements everywhere.
"""

from typing import Optional

import torch
from torch import Tensor, nn

from . import reference as _reference
from . import rope_scaling as _rope_scaling
from ._runtime import checks as _checks
from ._runtime.arrays import describe_host as _host
from .ops import rmsnorm_checks as _norm_checks
from .ops import rope_checks as _rope_checks
from .ops.rmsnorm import fused_add_rms_norm as _fused_add_rms_norm
from .ops.rmsnorm import rms_norm as _rms_norm
from .ops.rmsnorm import rms_norm_backward as _rms_norm_backward
from .ops.rope import rope as _rope
from .ops.rope import rope_cache as _rope_cache
from .ops.rope import rope_qk as _rope_qk
from .ops.rope import rope_qk_cos_sin as _rope_qk_cos_sin

__all__ = ["RMSNorm", "RotaryEmbedding", "fused_add_rms_norm", "rms_norm", "rope", "rope_qk", "rope_qk_",
           "rope_qk_cos_sin"]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _contiguous_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.size(-1) <= 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------- RoPE


def _optional_host(t, name):
    return None if t is None else _host(t, name)


def _rope_cpu(x, positions, theta, style, rotary_dim, cos_sin_cache, inverse):
    """rope() on CPU tensors: its checks, then the formula in torch, float32 math, x's dtype out."""
    rotary_dim, _, _ = _rope_checks.check_rope(_host(x, "x"), _host(positions, "positions"),
                                               _optional_host(cos_sin_cache, "cos_sin_cache"), None, theta=theta,
                                               style=style, rotary_dim=rotary_dim, inverse=inverse, impl="auto")
    return _rope_formula(x, positions, theta, style, rotary_dim, cos_sin_cache, inverse)


def _check_rope_qk_cpu(q, k, positions, theta, style, rotary_dim, cos_sin_cache, inverse) -> int:
    """rope_qk()'s checks on CPU tensors; returns the rotary dimension."""
    return _rope_checks.check_rope_qk(_host(q, "q"), _host(k, "k"), _host(positions, "positions"),
                                      _optional_host(cos_sin_cache, "cos_sin_cache"), theta=theta, style=style,
                                      rotary_dim=rotary_dim, inverse=inverse, impl="auto")[0]


def _rope_formula(x, positions, theta, style, rotary_dim, cos_sin_cache, inverse):
    half = rotary_dim // 2
    pos = positions.reshape(tuple(positions.shape) + (1,) * (x.dim() - 1 - positions.dim()))
    if cos_sin_cache is None:
        inv = torch.tensor(_reference.inv_freq(rotary_dim, theta), dtype=torch.float64)
        angles = pos.to(torch.float64).unsqueeze(-1) * inv
        cos, sin = angles.cos().float(), angles.sin().float()
    else:
        rows = cos_sin_cache.float()[pos.clamp(0, cos_sin_cache.shape[0] - 1)]
        bad = ((pos < 0) | (pos >= cos_sin_cache.shape[0])).unsqueeze(-1)
        rows = rows.masked_fill(bad, float("nan"))
        cos, sin = rows[..., :half], rows[..., half:rotary_dim]
    return _rotate_cpu(x, cos, sin, style, rotary_dim, inverse)


def _rotate_cpu(x, cos, sin, style, rotary_dim, inverse):
    """x rotated by cos/sin (..., rotary_dim / 2), which broadcast over x's leading dimensions."""
    half = rotary_dim // 2
    if inverse:
        sin = -sin
    xf = x.float()
    out = xf.clone()
    if style == "neox":
        x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rotary_dim] = x2 * cos + x1 * sin
    else:
        x1, x2 = xf[..., 0:rotary_dim:2], xf[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = x1 * cos - x2 * sin
        out[..., 1:rotary_dim:2] = x2 * cos + x1 * sin
    return out.to(x.dtype)


def _rope_any(x, positions, theta, style, rotary_dim, cos_sin_cache, inverse):
    if not x.is_cuda:
        return _rope_cpu(x, positions, theta, style, rotary_dim, cos_sin_cache, inverse)
    return _rope(_contiguous_last(x), positions, theta=theta, style=style, rotary_dim=rotary_dim,
                 cos_sin_cache=cos_sin_cache, inverse=inverse)


@torch.library.custom_op("cupyrope::rope", mutates_args=(), device_types=("cuda", "cpu"))
def _rope_op(x: Tensor, positions: Tensor, cos_sin_cache: Optional[Tensor], theta: float, style: str,
             rotary_dim: Optional[int], inverse: bool) -> Tensor:
    return _rope_any(x, positions, theta, style, rotary_dim, cos_sin_cache, inverse)


@_rope_op.register_fake
def _(x, positions, cos_sin_cache, theta, style, rotary_dim, inverse):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rope_setup(ctx, inputs, output):
    _, positions, cos_sin_cache, theta, style, rotary_dim, inverse = inputs
    ctx.save_for_backward(positions, cos_sin_cache)
    ctx.options = (theta, style, rotary_dim, inverse)


def _rope_grad(ctx, grad):
    positions, cos_sin_cache = ctx.saved_tensors
    theta, style, rotary_dim, inverse = ctx.options
    # The rotation is orthogonal: its gradient is the inverse rotation, by the same kernel.
    return _rope_op(grad, positions, cos_sin_cache, theta, style, rotary_dim, not inverse), None, None, None, None, None, None


_rope_op.register_autograd(_rope_grad, setup_context=_rope_setup)


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, cos_sin_cache, theta, style, rotary_dim, inverse):
        ctx.save_for_backward(positions, cos_sin_cache)
        ctx.options = (theta, style, rotary_dim, inverse)
        return _rope_any(x, positions, theta, style, rotary_dim, cos_sin_cache, inverse)

    @staticmethod
    def backward(ctx, grad):
        positions, cos_sin_cache = ctx.saved_tensors
        theta, style, rotary_dim, inverse = ctx.options
        return _rope_any(grad, positions, theta, style, rotary_dim, cos_sin_cache, not inverse), *(None,) * 6


def rope(x: Tensor, positions: Tensor, *, theta: float = 10000.0, style: str = "neox",
         rotary_dim: Optional[int] = None, cos_sin_cache: Optional[Tensor] = None, inverse: bool = False) -> Tensor:
    """Differentiable, torch.compile-able ``cupyrope.rope`` (out of place). Positions and the cache get
    no gradient; x's gradient is the inverse rotation."""
    if _compiling():
        return _rope_op(x, positions, cos_sin_cache, theta, style, rotary_dim, inverse)
    if torch.is_grad_enabled() and x.requires_grad:
        return _RopeFunction.apply(x, positions, cos_sin_cache, theta, style, rotary_dim, inverse)
    return _rope_any(x, positions, theta, style, rotary_dim, cos_sin_cache, inverse)


def _rope_qk_new(q, k, positions, cos_sin_cache, theta, style, rotary_dim, inverse):
    return _rope_qk(_contiguous_last(q), _contiguous_last(k), positions, theta=theta, style=style,
                    rotary_dim=rotary_dim, cos_sin_cache=cos_sin_cache, inverse=inverse, out="new")


class _RotateQK(torch.autograd.Function):
    """q and k rotated in one launch forward and one backward: the gradient of a rotation is the
    inverse rotation. ``rotate(q, k, a, b, *options, inverse)``; a and b (positions and the cache, or
    cos and sin) get no gradient."""

    @staticmethod
    def forward(ctx, rotate, q, k, a, b, *options):
        ctx.save_for_backward(a, b)
        ctx.rotate, ctx.options = rotate, options
        return rotate(q, k, a, b, *options)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        a, b = ctx.saved_tensors
        *options, inverse = ctx.options
        return None, *ctx.rotate(grad_q, grad_k, a, b, *options, not inverse), None, None, *(None,) * len(ctx.options)


def rope_qk(q: Tensor, k: Tensor, positions: Tensor, *, theta: float = 10000.0, style: str = "neox",
            rotary_dim: Optional[int] = None, cos_sin_cache: Optional[Tensor] = None,
            inverse: bool = False) -> tuple[Tensor, Tensor]:
    """Differentiable RoPE of q and k (out of place). On CUDA both are rotated in one launch, forward
    and backward; under torch.compile and on the CPU each goes through ``rope``."""
    if _compiling():
        options = dict(theta=theta, style=style, rotary_dim=rotary_dim, cos_sin_cache=cos_sin_cache, inverse=inverse)
        return rope(q, positions, **options), rope(k, positions, **options)
    if not q.is_cuda:
        _check_rope_qk_cpu(q, k, positions, theta, style, rotary_dim, cos_sin_cache, inverse)  # as the GPU path
        options = dict(theta=theta, style=style, rotary_dim=rotary_dim, cos_sin_cache=cos_sin_cache, inverse=inverse)
        return rope(q, positions, **options), rope(k, positions, **options)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RotateQK.apply(_rope_qk_new, q, k, positions, cos_sin_cache, theta, style, rotary_dim, inverse)
    return _rope_qk_new(q, k, positions, cos_sin_cache, theta, style, rotary_dim, inverse)


@torch.library.custom_op("cupyrope::rope_qk_", mutates_args=("q", "k"), device_types=("cuda", "cpu"))
def _rope_qk_inplace_op(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Optional[Tensor], theta: float,
                        style: str, rotary_dim: Optional[int]) -> None:
    _rope_qk_inplace_any(q, k, positions, theta, style, rotary_dim, cos_sin_cache)


def _rope_qk_inplace_any(q, k, positions, theta, style, rotary_dim, cos_sin_cache):
    if not q.is_cuda:
        rotary_dim = _check_rope_qk_cpu(q, k, positions, theta, style, rotary_dim, cos_sin_cache, False)
        _rope_checks.check_qk_outputs(_host(q, "q"), _host(k, "k"), None, None)  # in place: q and k are written
        for t in (q, k):
            t.copy_(_rope_formula(t, positions, theta, style, rotary_dim, cos_sin_cache, False))
    else:
        _rope_qk(q, k, positions, theta=theta, style=style, rotary_dim=rotary_dim, cos_sin_cache=cos_sin_cache)


@_rope_qk_inplace_op.register_fake
def _(q, k, positions, cos_sin_cache, theta, style, rotary_dim):
    return None


def rope_qk_(q: Tensor, k: Tensor, positions: Tensor, *, theta: float = 10000.0, style: str = "neox",
             rotary_dim: Optional[int] = None, cos_sin_cache: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """In-place RoPE of q and k in one launch (inference/serving; not differentiable)."""
    if _compiling():
        _rope_qk_inplace_op(q, k, positions, cos_sin_cache, theta, style, rotary_dim)
    else:
        _rope_qk_inplace_any(q, k, positions, theta, style, rotary_dim, cos_sin_cache)
    return q, k


def _rope_cos_sin_any(q, k, cos, sin, rotary_dim, freq_step, style, inverse):
    if not q.is_cuda:
        rotary_dim, _ = _rope_checks.check_rope_qk_cos_sin(_host(q, "q"), _host(k, "k"), _host(cos, "cos"),
                                                           _optional_host(sin, "sin"), rotary_dim=rotary_dim,
                                                           freq_step=freq_step, style=style, inverse=inverse,
                                                           impl="auto")
        lead = q.dim() - cos.dim()  # cos's leading dimensions align with q's from the left
        rows = [t[..., 0 : freq_step * (rotary_dim // 2) : freq_step].float() for t in (cos, sin)]
        c, s = (t.reshape(tuple(t.shape[:-1]) + (1,) * lead + (t.shape[-1],)) for t in rows)
        return _rotate_cpu(q, c, s, style, rotary_dim, inverse), _rotate_cpu(k, c, s, style, rotary_dim, inverse)
    return _rope_qk_cos_sin(_contiguous_last(q), _contiguous_last(k), cos, sin, rotary_dim=rotary_dim,
                            freq_step=freq_step, style=style, inverse=inverse, out="new")


@torch.library.custom_op("cupyrope::rope_qk_cos_sin", mutates_args=(), device_types=("cuda", "cpu"))
def _rope_cos_sin_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, rotary_dim: Optional[int], freq_step: int,
                     style: str, inverse: bool) -> tuple[Tensor, Tensor]:
    return _rope_cos_sin_any(q, k, cos, sin, rotary_dim, freq_step, style, inverse)


@_rope_cos_sin_op.register_fake
def _(q, k, cos, sin, rotary_dim, freq_step, style, inverse):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


def _rope_cos_sin_setup(ctx, inputs, output):
    _, _, cos, sin, *options = inputs
    ctx.save_for_backward(cos, sin)
    ctx.options = options


def _rope_cos_sin_grad(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    rotary_dim, freq_step, style, inverse = ctx.options
    return *_rope_cos_sin_op(grad_q, grad_k, cos, sin, rotary_dim, freq_step, style, not inverse), *(None,) * 6


_rope_cos_sin_op.register_autograd(_rope_cos_sin_grad, setup_context=_rope_cos_sin_setup)


def rope_qk_cos_sin(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, rotary_dim: Optional[int] = None,
                    freq_step: int = 1, style: str = "neox", inverse: bool = False) -> tuple[Tensor, Tensor]:
    """Differentiable, torch.compile-able ``cupyrope.rope_qk_cos_sin`` (out of place; one launch for q
    and k, forward and backward). cos and sin get no gradient."""
    if _compiling():
        return _rope_cos_sin_op(q, k, cos, sin, rotary_dim, freq_step, style, inverse)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RotateQK.apply(_rope_cos_sin_any, q, k, cos, sin, rotary_dim, freq_step, style, inverse)
    return _rope_cos_sin_any(q, k, cos, sin, rotary_dim, freq_step, style, inverse)


# ------------------------------------------------------------------------------------------- RMSNorm


def _rms_norm_cpu(x, weight, eps, offset):
    """rms_norm() on CPU tensors: its checks, then the formula in torch, fp32 math, x's dtype out; and rstd."""
    _norm_checks.check_forward(_host(x, "x"), _optional_host(weight, "weight"), None, eps=eps, offset=offset,
                               impl="auto")
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * (weight.float() + offset)
    return y.to(x.dtype), rstd


def _rms_norm_backward_cpu(dy, x, weight, rstd, eps, offset):
    _norm_checks.check_backward(_host(dy, "dy"), _host(x, "x"), _optional_host(weight, "weight"),
                                _optional_host(rstd, "rstd"), eps=eps, offset=offset, impl="auto")
    xf, dyf = x.float(), dy.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps) if rstd is None else rstd
    r = rstd.unsqueeze(-1)
    g = dyf * ((weight.float() + offset) if weight is not None else 1.0)
    dx = r * g - xf * r.pow(3) * (g * xf).mean(-1, keepdim=True)
    dw = None if weight is None else (dyf * xf * r).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx.to(x.dtype), dw


def _rows_in_one_run(t: Tensor) -> Tensor:
    """t, or a contiguous copy where its rows are not one evenly strided run (the kernels take one row
    stride): e.g. q after transformers' view(...).transpose(1, 2), which Gemma 3's q_norm receives."""
    if t.is_contiguous() or t.numel() == 0:
        return t
    t = _contiguous_last(t)
    try:
        t.view(-1, t.shape[-1])  # possible exactly when the leading dimensions merge into one stride
        return t
    except RuntimeError:
        return t.contiguous()


def _rms_norm_any(x, weight, eps, offset):
    if not x.is_cuda:
        return _rms_norm_cpu(x, weight, eps, offset)
    return _rms_norm(_rows_in_one_run(x), weight, eps, offset=offset, return_rstd=True)


def _rms_norm_backward_any(dy, x, weight, rstd, eps, offset):
    if not x.is_cuda:
        return _rms_norm_backward_cpu(dy, x, weight, rstd, eps, offset)
    return _rms_norm_backward(_rows_in_one_run(dy), _rows_in_one_run(x), weight, rstd, eps, offset)


@torch.library.custom_op("cupyrope::rms_norm", mutates_args=(), device_types=("cuda", "cpu"))
def _rms_norm_op(x: Tensor, weight: Optional[Tensor], eps: float, offset: float) -> tuple[Tensor, Tensor]:
    return _rms_norm_any(x, weight, eps, offset)


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape[:-1], dtype=torch.float32,
                                                                            device=x.device)


@torch.library.custom_op("cupyrope::rms_norm_backward", mutates_args=(), device_types=("cuda", "cpu"))
def _rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor, eps: float,
                          offset: float) -> tuple[Tensor, Tensor]:
    """(dx, dweight); dweight is an empty tensor without weight (ops cannot return None)."""
    dx, dw = _rms_norm_backward_any(dy, x, weight, rstd, eps, offset)
    return dx, (dw if dw is not None else dx.new_empty(0))


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, eps, offset):
    dw = x.new_empty(0) if weight is None else torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), dw


def _rms_setup(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.options = (eps, offset)


def _rms_grad(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    eps, offset = ctx.options
    dx, dw = _rms_norm_backward_op(grad_y, x, weight, rstd, eps, offset)
    return (dx if ctx.needs_input_grad[0] else None), (dw if weight is not None and ctx.needs_input_grad[1] else None), None, None


_rms_norm_op.register_autograd(_rms_grad, setup_context=_rms_setup)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        y, rstd = _rms_norm_any(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.options = (eps, offset)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        eps, offset = ctx.options
        dx, dw = _rms_norm_backward_any(grad, x, weight, rstd, eps, offset)
        return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None, None


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    """Differentiable, torch.compile-able ``cupyrope.rms_norm``: dx and dweight come from the backward
    kernels (dweight reduced deterministically)."""
    if _compiling():
        return _rms_norm_op(x, weight, eps, offset)[0]
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return _RMSNormFunction.apply(x, weight, eps, offset)
    if not x.is_cuda:
        return _rms_norm_cpu(x, weight, eps, offset)[0]
    return _rms_norm(_rows_in_one_run(x), weight, eps, offset=offset)  # no rstd: one output fewer


@torch.library.custom_op("cupyrope::fused_add_rms_norm_", mutates_args=("x", "residual"), device_types=("cuda", "cpu"))
def _fused_add_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, offset: float) -> None:
    _fused_add_any(x, residual, weight, eps, offset)


def _fused_add_any(x, residual, weight, eps, offset):
    if not x.is_cuda:
        _norm_checks.check_fused_add(_host(x, "x"), _host(residual, "residual"), _optional_host(weight, "weight"),
                                     eps=eps, offset=offset, impl="auto")
        residual.add_(x)
        x.copy_(_rms_norm_cpu(residual, weight, eps, offset)[0])
    else:
        _fused_add_rms_norm(x, residual, weight, eps, offset=offset)


@_fused_add_op.register_fake
def _(x, residual, weight, eps, offset):
    return None


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float = 1e-6,
                       offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """vLLM's in-place residual add + RMSNorm (inference; not differentiable). Returns (x, residual)."""
    if _compiling():
        _fused_add_op(x, residual, weight, eps, offset)
    else:
        _fused_add_any(x, residual, weight, eps, offset)
    return x, residual


# ------------------------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """Drop-in for Hugging Face's LlamaRMSNorm / Qwen2RMSNorm and ``torch.nn.RMSNorm`` (state_dict key
    ``weight``); offset=1.0 gives Gemma's (1 + weight) scaling (weight then starts at zero)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, device=None, dtype=None):
        super().__init__()
        if not _checks.is_int(hidden_size) or hidden_size < 1:
            raise ValueError(f"hidden_size: expected an int >= 1, got {hidden_size!r}")
        _norm_checks.check_options(eps, offset, "auto")
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.hidden_size = hidden_size
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}"


class RotaryEmbedding(nn.Module):
    """RoPE for (q, k, positions): ``forward(q, k, positions, inplace=False) -> (q, k)``.

    By default cos/sin are computed in the kernel from theta (exact to fp32 rounding, no table);
    ``use_cache=True`` builds a (max_position, rotary_dim) fp32 cos/sin buffer instead (vLLM layout).
    ``scaling`` (a Hugging Face rope_scaling dict: "linear", "llama3", "yarn") always uses the buffer,
    built with the scaled frequencies. ``from_hf_config`` reads all of it from a model config."""

    def __init__(self, head_dim: int, max_position: int, theta: float = 10000.0, style: str = "neox",
                 rotary_dim: Optional[int] = None, use_cache: Optional[bool] = None, scaling: Optional[dict] = None,
                 device=None):
        super().__init__()
        if not _checks.is_int(head_dim) or head_dim < 2:
            raise ValueError(f"head_dim: expected an int >= 2, got {head_dim!r}")
        if not _checks.is_int(max_position) or max_position < 1:
            raise ValueError(f"max_position: expected an int >= 1, got {max_position!r}")
        _rope_checks.check_options(style, "auto", theta, False)
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = float(theta)
        self.style = style
        self.rotary_dim = _rope_checks.check_rotary_dim(rotary_dim, head_dim)
        self.scaling = None if _rope_scaling.check_scaling(scaling, self.theta) == "default" else dict(scaling)
        if self.scaling is not None and use_cache is False:
            raise ValueError("use_cache: scaled RoPE (scaling=...) needs the cos/sin table; leave use_cache unset")
        cache = None
        if use_cache or self.scaling is not None:
            table = _reference.rope_cache(max_position, self.rotary_dim, self.theta, self.scaling)
            cache = torch.from_numpy(table.astype("float32")).to(device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    @classmethod
    def from_hf_config(cls, config, max_position: Optional[int] = None, device=None) -> "RotaryEmbedding":
        """The RoPE of a Hugging Face model config (transformers 4's rope_theta / rope_scaling /
        partial_rotary_factor, or 5's rope_parameters), NeoX style (rotate_half, as in transformers).
        max_position defaults to the config's max_position_embeddings."""
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if any(isinstance(value, dict) for value in params.values()):
            raise ValueError("config: per-layer rope_parameters (one dict per layer type) are not supported; "
                             "build one RotaryEmbedding per layer type")
        if "mrope_section" in params or params.get("rope_type", params.get("type")) == "mrope":
            raise ValueError("config: multimodal RoPE (mrope_section) takes each frequency's position from one of "
                             "three rows (time, height, width); RotaryEmbedding takes one position per token. For "
                             "a loaded model use cupyrope.dropin.patch_transformers, which keeps the model's own "
                             "cos/sin")
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        return cls(head_dim, max_position or config.max_position_embeddings, theta=theta,
                   rotary_dim=int(head_dim * partial), scaling=params or None, device=device)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor, inplace: bool = False) -> tuple[Tensor, Tensor]:
        options = dict(theta=self.theta, style=self.style, rotary_dim=self.rotary_dim, cos_sin_cache=self.cos_sin_cache)
        if inplace:
            return rope_qk_(q, k, positions, **options)
        return rope_qk(q, k, positions, **options)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return (f"head_dim={self.head_dim}, max_position={self.max_position}, theta={self.theta}, "
                f"style={self.style!r}, rotary_dim={self.rotary_dim}{scaling}")


def rope_cache(max_position: int, rotary_dim: int, theta: float = 10000.0, *, scaling: Optional[dict] = None,
               dtype=torch.float32, device="cuda"):
    """``cupyrope.rope_cache`` as a torch tensor on ``device`` ("cpu", "cuda", "cuda:1", ...)."""
    return _rope_cache(max_position, rotary_dim, theta, scaling=scaling, dtype=dtype, kind="torch", device=device)
