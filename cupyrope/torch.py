"""PyTorch integration: differentiable ops, torch.compile / CUDA-graph support, drop-in modules.

Eager calls go straight to the kernels (no dispatcher): autograd through ``torch.autograd.Function``
when a gradient is needed, a plain call otherwise. Under ``torch.compile`` the same functions call the
ops registered with ``torch.library`` (``torch.ops.cupyrope.*``), which have fake (meta) kernels and
registered autograd, so graphs trace with no breaks and ``mode="reduce-overhead"`` captures them in
CUDA graphs. CPU tensors fall back to the same formulas in plain torch, after the same argument checks as
the GPU path (the same exceptions), so the modules stay drop-in replacements everywhere.
"""

from typing import List, Optional

import torch
from torch import Tensor, nn

from . import reference as _reference
from . import rope_scaling as _rope_scaling
from ._runtime import checks as _checks
from ._runtime.arrays import describe_host as _host
from ._runtime.arrays import merged_rows as _merged_rows
from .ops import layernorm_checks as _ln_checks
from .ops import qk_norm_rope_checks as _qk_norm_checks
from .ops import rmsnorm_checks as _norm_checks
from .ops import rope_checks as _rope_checks
from .ops.layernorm import fused_add_layer_norm as _fused_add_layer_norm
from .ops.layernorm import layer_norm as _layer_norm
from .ops.layernorm import parameter_grads_backward as _layer_norm_backward
from .ops.qk_norm_rope import qk_norm_rope as _qk_norm_rope
from .ops.qk_norm_rope import qk_norm_rope_backward as _qk_norm_rope_backward
from .ops.rmsnorm import add_rms_norm as _add_rms_norm
from .ops.rmsnorm import fused_add_rms_norm as _fused_add_rms_norm
from .ops.rmsnorm import rms_norm as _rms_norm
from .ops.rmsnorm import rms_norm_backward as _rms_norm_backward
from .ops.rmsnorm_fp8 import rms_norm_fp8 as _rms_norm_fp8
from .ops.rope import rope as _rope
from .ops.rope import rope_cache as _rope_cache
from .ops.rope import rope_qk as _rope_qk
from .ops.rope import rope_cos_sin as _rope_cos_sin
from .ops.rope import rope_qk_cos_sin as _rope_qk_cos_sin

__all__ = ["LayerNorm", "QKNormRotaryEmbedding", "RMSNorm", "RotaryEmbedding", "add_rms_norm", "fused_add_layer_norm",
           "fused_add_rms_norm", "layer_norm", "qk_norm_rope", "qk_norm_rope_", "rms_norm", "rms_norm_fp8", "rope",
           "rope_cos_sin", "rope_qk", "rope_qk_", "rope_qk_cos_sin"]


MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # a config's M-RoPE keys (RotaryEmbedding.from_hf_config)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _contiguous_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.size(-1) <= 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------- RoPE


def _optional_host(t, name):
    return None if t is None else _host(t, name)


# Where a call's positions come from: (positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved), as
# the ops take them (see cupyrope.rope); the torch ops carry the five as arguments of their own.
def _where(positions, cu_seqlens=None, seqlen_offsets=None, mrope_section=None, mrope_interleaved=False):
    return (positions, cu_seqlens, seqlen_offsets, None if mrope_section is None else list(mrope_section),
            mrope_interleaved)


def _where_options(where) -> dict:
    positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved = where
    return dict(cu_seqlens=cu_seqlens, seqlen_offsets=seqlen_offsets, mrope_section=mrope_section,
                mrope_interleaved=mrope_interleaved)


def _where_hosts(where) -> dict:
    """_where_options of a CPU call with its arrays described for the checks."""
    options = _where_options(where)
    return {**options, "cu_seqlens": _optional_host(options["cu_seqlens"], "cu_seqlens"),
            "seqlen_offsets": _optional_host(options["seqlen_offsets"], "seqlen_offsets")}


def _rope_cpu(x, where, theta, style, rotary_dim, cos_sin_cache, inverse):
    """rope() on CPU tensors: its checks, then the formula in torch, float32 math, x's dtype out."""
    rotary_dim, _, source = _rope_checks.check_rope(
        _host(x, "x"), _optional_host(where[0], "positions"), _optional_host(cos_sin_cache, "cos_sin_cache"), None,
        theta=theta, style=style, rotary_dim=rotary_dim, inverse=inverse, impl="auto", **_where_hosts(where))
    return _rope_formula(x, where, source, theta, style, rotary_dim, cos_sin_cache, inverse)


def _check_rope_qk_cpu(q, k, where, theta, style, rotary_dim, cos_sin_cache, inverse):
    """rope_qk()'s checks on CPU tensors; returns the rotary dimension and the PositionSource."""
    rotary_dim, _, source = _rope_checks.check_rope_qk(
        _host(q, "q"), _host(k, "k"), _optional_host(where[0], "positions"),
        _optional_host(cos_sin_cache, "cos_sin_cache"), theta=theta, style=style, rotary_dim=rotary_dim,
        inverse=inverse, impl="auto", **_where_hosts(where))
    return rotary_dim, source


def _cpu_numpy(t):
    return None if t is None else t.detach().cpu().numpy()


def _rope_formula(x, where, source, theta, style, rotary_dim, cos_sin_cache, inverse):
    """x rotated on the CPU: each frequency's position (the references' definitions), then cos/sin in float64."""
    positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved = where
    freq_positions = _reference._frequency_positions(
        _cpu_numpy(positions), source, rotary_dim, x.dim() - 1, _cpu_numpy(cu_seqlens), _cpu_numpy(seqlen_offsets),
        x.shape[0], mrope_section, mrope_interleaved)
    cache = None if cos_sin_cache is None else cos_sin_cache.detach().float().cpu().numpy()
    cos, sin = (torch.from_numpy(t.copy()).float() for t in _reference._cos_sin(freq_positions, rotary_dim, theta,
                                                                               cache))
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


def _rope_any(x, where, cos_sin_cache, theta, style, rotary_dim, inverse):
    x = _contiguous_last(x)
    if not x.is_cuda:
        return _rope_cpu(x, where, theta, style, rotary_dim, cos_sin_cache, inverse)
    return _rope(x, where[0], theta=theta, style=style, rotary_dim=rotary_dim,
                 cos_sin_cache=cos_sin_cache, inverse=inverse, **_where_options(where))


@torch.library.custom_op("cupyrope::rope", mutates_args=(), device_types=("cuda", "cpu"))
def _rope_op(x: Tensor, positions: Optional[Tensor], cos_sin_cache: Optional[Tensor], theta: float, style: str,
             rotary_dim: Optional[int], inverse: bool, cu_seqlens: Optional[Tensor], seqlen_offsets: Optional[Tensor],
             mrope_section: Optional[List[int]], mrope_interleaved: bool) -> Tensor:
    where = (positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved)
    return _rope_any(x, where, cos_sin_cache, theta, style, rotary_dim, inverse)


@_rope_op.register_fake
def _(x, positions, cos_sin_cache, theta, style, rotary_dim, inverse, *where):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rope_setup(ctx, inputs, output):
    _, positions, cos_sin_cache, theta, style, rotary_dim, inverse, cu_seqlens, seqlen_offsets, *mrope = inputs
    ctx.save_for_backward(positions, cos_sin_cache, cu_seqlens, seqlen_offsets)
    ctx.options = (theta, style, rotary_dim, inverse, *mrope)


def _rope_grad(ctx, grad):
    positions, cos_sin_cache, cu_seqlens, seqlen_offsets = ctx.saved_tensors
    theta, style, rotary_dim, inverse, *mrope = ctx.options
    # The rotation is orthogonal: its gradient is the inverse rotation, by the same kernel.
    return (_rope_op(grad, positions, cos_sin_cache, theta, style, rotary_dim, not inverse, cu_seqlens, seqlen_offsets,
                     *mrope), *(None,) * 10)


_rope_op.register_autograd(_rope_grad, setup_context=_rope_setup)


class _Rotate(torch.autograd.Function):
    """Tensors rotated in one launch forward and one backward: the gradient of a rotation is the inverse
    rotation. ``_Rotate.apply(rotate, count, *tensors, a, b, *options, inverse)`` calls
    ``rotate(*tensors, a, b, *options, inverse)`` on the first ``count`` arguments (x, or q and k); a and b (the
    positions and the cache, or cos and sin) get no gradient."""

    @staticmethod
    def forward(ctx, rotate, count, *arguments):
        tensors, (a, b, *options) = arguments[:count], arguments[count:]
        ctx.a = a  # a may be a tuple (_where's), which save_for_backward cannot hold; nothing here is modified
        ctx.save_for_backward(b)
        ctx.rotate, ctx.options = rotate, options
        return rotate(*tensors, a, b, *options)

    @staticmethod
    def backward(ctx, *grads):
        (b,) = ctx.saved_tensors
        *options, inverse = ctx.options
        rotated = ctx.rotate(*grads, ctx.a, b, *options, not inverse)
        return None, None, *(rotated if len(grads) > 1 else (rotated,)), None, None, *(None,) * len(ctx.options)


def rope(x: Tensor, positions: Optional[Tensor] = None, *, theta: float = 10000.0, style: str = "neox",
         rotary_dim: Optional[int] = None, cos_sin_cache: Optional[Tensor] = None, inverse: bool = False,
         cu_seqlens: Optional[Tensor] = None, seqlen_offsets: Optional[Tensor] = None,
         mrope_section: Optional[list] = None, mrope_interleaved: bool = False) -> Tensor:
    """Differentiable, torch.compile-able ``cupyrope.rope`` (out of place; M-RoPE and varlen as there).
    Positions and the cache get no gradient; x's gradient is the inverse rotation."""
    where = _where(positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved)
    if _compiling():
        return _rope_op(x, where[0], cos_sin_cache, theta, style, rotary_dim, inverse, *where[1:])
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotate.apply(_rope_any, 1, x, where, cos_sin_cache, theta, style, rotary_dim, inverse)
    return _rope_any(x, where, cos_sin_cache, theta, style, rotary_dim, inverse)


def _rotated_like(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """New memory for rotated copies of q and k in their own memory order (torch.empty_like keeps a dense tensor's
    strides), as torch's elementwise ops give: transformers' q (B, H, S, D), a transposed view of what the projection
    wrote (B, S, H, D), keeps that layout, which its attention expects (a (B, H, S, D)-contiguous q cost sdpa's output
    a transposing copy in each layer)."""
    return torch.empty_like(q), torch.empty_like(k)


def _rope_qk_new(q, k, where, cos_sin_cache, theta, style, rotary_dim, inverse):
    q, k = _contiguous_last(q), _contiguous_last(k)
    return _rope_qk(q, k, where[0], theta=theta, style=style, rotary_dim=rotary_dim, cos_sin_cache=cos_sin_cache,
                    inverse=inverse, out=_rotated_like(q, k), **_where_options(where))


def rope_qk(q: Tensor, k: Tensor, positions: Optional[Tensor] = None, *, theta: float = 10000.0, style: str = "neox",
            rotary_dim: Optional[int] = None, cos_sin_cache: Optional[Tensor] = None, inverse: bool = False,
            cu_seqlens: Optional[Tensor] = None, seqlen_offsets: Optional[Tensor] = None,
            mrope_section: Optional[list] = None, mrope_interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Differentiable RoPE of q and k (out of place; M-RoPE and varlen as in cupyrope.rope). On CUDA both are
    rotated in one launch, forward and backward; under torch.compile and on the CPU each goes through ``rope``."""
    where = _where(positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved)
    options = dict(theta=theta, style=style, rotary_dim=rotary_dim, cos_sin_cache=cos_sin_cache, inverse=inverse,
                   **_where_options(where))
    if _compiling():
        return rope(q, where[0], **options), rope(k, where[0], **options)
    if not q.is_cuda:
        q, k = _contiguous_last(q), _contiguous_last(k)  # as the GPU path
        _check_rope_qk_cpu(q, k, where, theta, style, rotary_dim, cos_sin_cache, inverse)
        return rope(q, where[0], **options), rope(k, where[0], **options)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rotate.apply(_rope_qk_new, 2, q, k, where, cos_sin_cache, theta, style, rotary_dim, inverse)
    return _rope_qk_new(q, k, where, cos_sin_cache, theta, style, rotary_dim, inverse)


@torch.library.custom_op("cupyrope::rope_qk_", mutates_args=("q", "k"), device_types=("cuda", "cpu"))
def _rope_qk_inplace_op(q: Tensor, k: Tensor, positions: Optional[Tensor], cos_sin_cache: Optional[Tensor],
                        theta: float, style: str, rotary_dim: Optional[int], cu_seqlens: Optional[Tensor],
                        seqlen_offsets: Optional[Tensor], mrope_section: Optional[List[int]],
                        mrope_interleaved: bool) -> None:
    where = (positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved)
    _rope_qk_inplace_any(q, k, where, theta, style, rotary_dim, cos_sin_cache)


def _rope_qk_inplace_any(q, k, where, theta, style, rotary_dim, cos_sin_cache):
    if not q.is_cuda:
        rotary_dim, source = _check_rope_qk_cpu(q, k, where, theta, style, rotary_dim, cos_sin_cache, False)
        _rope_checks.check_qk_outputs(_host(q, "q"), _host(k, "k"), None, None)  # in place: q and k are written
        for t in (q, k):
            t.copy_(_rope_formula(t, where, source, theta, style, rotary_dim, cos_sin_cache, False))
    else:
        _rope_qk(q, k, where[0], theta=theta, style=style, rotary_dim=rotary_dim, cos_sin_cache=cos_sin_cache,
                 **_where_options(where))


@_rope_qk_inplace_op.register_fake
def _(q, k, positions, cos_sin_cache, theta, style, rotary_dim, *where):
    return None


def rope_qk_(q: Tensor, k: Tensor, positions: Optional[Tensor] = None, *, theta: float = 10000.0,
             style: str = "neox", rotary_dim: Optional[int] = None, cos_sin_cache: Optional[Tensor] = None,
             cu_seqlens: Optional[Tensor] = None, seqlen_offsets: Optional[Tensor] = None,
             mrope_section: Optional[list] = None, mrope_interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """In-place RoPE of q and k in one launch (inference/serving; not differentiable)."""
    where = _where(positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved)
    if _compiling():
        _rope_qk_inplace_op(q, k, where[0], cos_sin_cache, theta, style, rotary_dim, *where[1:])
    else:
        _rope_qk_inplace_any(q, k, where, theta, style, rotary_dim, cos_sin_cache)
    return q, k


def _per_token_cpu(x, cos, sin, rotary_dim, freq_step):
    """cos and sin's rows of one value per frequency, in float32, shaped to broadcast over x (their leading
    dimensions align with x's from the left, heads and the rest of x's follow)."""
    lead = x.dim() - cos.dim()
    rows = [t[..., 0 : freq_step * (rotary_dim // 2) : freq_step].float() for t in (cos, sin)]
    return tuple(t.reshape(tuple(t.shape[:-1]) + (1,) * lead + (t.shape[-1],)) for t in rows)


def _rope_qk_cos_sin_any(q, k, cos, sin, rotary_dim, freq_step, style, inverse):
    q, k = _contiguous_last(q), _contiguous_last(k)  # e.g. autograd's expanded gradients
    if not q.is_cuda:
        rotary_dim, _ = _rope_checks.check_rope_qk_cos_sin(_host(q, "q"), _host(k, "k"), _host(cos, "cos"),
                                                           _optional_host(sin, "sin"), rotary_dim=rotary_dim,
                                                           freq_step=freq_step, style=style, inverse=inverse,
                                                           impl="auto")
        c, s = _per_token_cpu(q, cos, sin, rotary_dim, freq_step)
        return _rotate_cpu(q, c, s, style, rotary_dim, inverse), _rotate_cpu(k, c, s, style, rotary_dim, inverse)
    return _rope_qk_cos_sin(q, k, cos, sin, rotary_dim=rotary_dim, freq_step=freq_step, style=style, inverse=inverse,
                            out=_rotated_like(q, k))


def _rope_cos_sin_any(x, cos, sin, rotary_dim, freq_step, style, inverse):
    x = _contiguous_last(x)
    if not x.is_cuda:
        rotary_dim, _ = _rope_checks.check_rope_cos_sin(_host(x, "x"), _host(cos, "cos"), _optional_host(sin, "sin"),
                                                        None, rotary_dim=rotary_dim, freq_step=freq_step, style=style,
                                                        inverse=inverse, impl="auto")
        return _rotate_cpu(x, *_per_token_cpu(x, cos, sin, rotary_dim, freq_step), style, rotary_dim, inverse)
    return _rope_cos_sin(x, cos, sin, rotary_dim=rotary_dim, freq_step=freq_step, style=style, inverse=inverse,
                         out=torch.empty_like(x))


@torch.library.custom_op("cupyrope::rope_qk_cos_sin", mutates_args=(), device_types=("cuda", "cpu"))
def _rope_qk_cos_sin_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, rotary_dim: Optional[int], freq_step: int,
                        style: str, inverse: bool) -> tuple[Tensor, Tensor]:
    return _rope_qk_cos_sin_any(q, k, cos, sin, rotary_dim, freq_step, style, inverse)


@_rope_qk_cos_sin_op.register_fake
def _(q, k, cos, sin, rotary_dim, freq_step, style, inverse):
    return _rotated_like(_contiguous_last(q), _contiguous_last(k))


@torch.library.custom_op("cupyrope::rope_cos_sin", mutates_args=(), device_types=("cuda", "cpu"))
def _rope_cos_sin_op(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: Optional[int], freq_step: int, style: str,
                     inverse: bool) -> Tensor:
    return _rope_cos_sin_any(x, cos, sin, rotary_dim, freq_step, style, inverse)


@_rope_cos_sin_op.register_fake
def _(x, cos, sin, rotary_dim, freq_step, style, inverse):
    return torch.empty_like(_contiguous_last(x))


def _register_inverse_rotation(op, count: int) -> None:
    """Autograd of a cos/sin op ``op(*tensors, cos, sin, *options, inverse)`` rotating its first ``count``
    arguments: the gradient of a rotation is the inverse rotation, by the same op; cos and sin get none."""

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[count : count + 2])
        ctx.options = inputs[count + 2 :]

    def grad(ctx, *grads):
        *options, inverse = ctx.options
        rotated = op(*grads, *ctx.saved_tensors, *options, not inverse)
        return *(rotated if count > 1 else (rotated,)), None, None, *(None,) * len(ctx.options)

    op.register_autograd(grad, setup_context=setup)


_register_inverse_rotation(_rope_qk_cos_sin_op, 2)
_register_inverse_rotation(_rope_cos_sin_op, 1)


def rope_qk_cos_sin(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, rotary_dim: Optional[int] = None,
                    freq_step: int = 1, style: str = "neox", inverse: bool = False) -> tuple[Tensor, Tensor]:
    """Differentiable, torch.compile-able ``cupyrope.rope_qk_cos_sin`` (out of place; one launch for q
    and k, forward and backward). cos and sin get no gradient."""
    if _compiling():
        return _rope_qk_cos_sin_op(q, k, cos, sin, rotary_dim, freq_step, style, inverse)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rotate.apply(_rope_qk_cos_sin_any, 2, q, k, cos, sin, rotary_dim, freq_step, style, inverse)
    return _rope_qk_cos_sin_any(q, k, cos, sin, rotary_dim, freq_step, style, inverse)


def rope_cos_sin(x: Tensor, cos: Tensor, sin: Tensor, *, rotary_dim: Optional[int] = None, freq_step: int = 1,
                 style: str = "neox", inverse: bool = False) -> Tensor:
    """Differentiable, torch.compile-able ``cupyrope.rope_cos_sin``: one tensor rotated by per-token cos and sin
    (out of place; one launch forward and one backward). cos and sin get no gradient."""
    if _compiling():
        return _rope_cos_sin_op(x, cos, sin, rotary_dim, freq_step, style, inverse)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotate.apply(_rope_cos_sin_any, 1, x, cos, sin, rotary_dim, freq_step, style, inverse)
    return _rope_cos_sin_any(x, cos, sin, rotary_dim, freq_step, style, inverse)


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


def _column_sums(values: Tensor, dtype) -> Tensor:
    """The CPU backwards' parameter gradients: the fp32 sum over every row of (..., hidden) values, in dtype."""
    return values.reshape(-1, values.shape[-1]).sum(0).to(dtype)


def _rms_norm_backward_cpu(dy, x, weight, rstd, eps, offset, residual_grad=None):
    _norm_checks.check_backward(_host(dy, "dy"), _host(x, "x"), _optional_host(weight, "weight"),
                                _optional_host(rstd, "rstd"), eps=eps, offset=offset, impl="auto",
                                residual_grad=_optional_host(residual_grad, "residual_grad"))
    xf, dyf = x.float(), dy.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps) if rstd is None else rstd
    r = rstd.unsqueeze(-1)
    g = dyf * ((weight.float() + offset) if weight is not None else 1.0)
    dx = r * g - xf * r.pow(3) * (g * xf).mean(-1, keepdim=True)
    if residual_grad is not None:
        dx = dx + residual_grad.float()
    dw = None if weight is None else _column_sums(dyf * xf * r, weight.dtype)
    return dx.to(x.dtype), dw


def _row_order(t: Tensor) -> Optional[List[int]]:
    """The order of t's leading dimensions that puts its rows in memory order (largest stride first), or None where
    they are in it. E.g. q after transformers' view(...).transpose(1, 2), which Gemma 3's q_norm receives, is one
    strided run of rows in that order. RMSNorm treats rows alike, so the torch layer reorders them (views) and
    orders the outputs back."""
    if t.is_contiguous():  # the common case, in a fraction of the sort's host time
        return None
    lead = list(range(t.dim() - 1))
    order = sorted(lead, key=lambda d: -t.stride(d))  # stable: equal strides keep their order
    return None if order == lead else order


def _in_row_order(t: Tensor, order, rows_only: bool = False) -> Tensor:
    """t's dimensions in `order`, the last one last (rows_only: t has only the leading ones, as rstd)."""
    return t if order is None else t.permute(order if rows_only else [*order, t.dim() - 1])


def _from_row_order(t: Tensor, order, rows_only: bool = False) -> Tensor:
    """_in_row_order undone."""
    if order is None:
        return t
    back = sorted(range(len(order)), key=order.__getitem__)
    return t.permute(back if rows_only else [*back, t.dim() - 1])


def _rows_in_runs(*tensors, levels=2):
    """The tensors (None passes through), or contiguous copies where their rows together need more than `levels`
    levels of strides (rmsnorm_checks.row_layout's rule): 2, evenly strided runs of evenly strided rows (rms_norm and
    its backward; q's heads as a (T, H, D) view of a fused qkv tensor are such runs, normalized where they lie); 1,
    one run (the fused adds)."""
    if all(t is None or t.is_contiguous() for t in tensors):
        return tensors
    tensors = [None if t is None else _contiguous_last(t) for t in tensors]
    given = [t for t in tensors if t is not None]
    if len(_merged_rows(given[0].shape, [t.stride() for t in given])) <= levels:
        return tensors
    return [None if t is None else t.contiguous() for t in tensors]


def _rms_norm_any(x, weight, eps, offset, return_rstd=True):
    """(y, rstd) as rms_norm's op returns them (rstd None where not return_rstd), on either device. Rows are taken
    in memory order; the outputs are new memory whose rows lie in x's order."""
    order = _row_order(x)
    x = _in_row_order(x, order)
    if not x.is_cuda:
        y, rstd = _rms_norm_cpu(_contiguous_last(x), weight, eps, offset)
    elif return_rstd:
        y, rstd = _rms_norm(_rows_in_runs(x)[0], weight, eps, offset=offset, return_rstd=True)
    else:
        y, rstd = _rms_norm(_rows_in_runs(x)[0], weight, eps, offset=offset), None
    if order is None:  # contiguous x: nothing to put back
        return y, rstd
    return _from_row_order(y, order), (None if rstd is None else _from_row_order(rstd, order, rows_only=True))


def _rms_norm_backward_any(dy, x, weight, rstd, eps, offset, residual_grad=None):
    order = _row_order(x)  # the forward's: rstd is laid out in it
    if order is not None:
        dy, x = _in_row_order(dy, order), _in_row_order(x, order)
        rstd = _in_row_order(rstd, order, rows_only=True).contiguous()
        residual_grad = None if residual_grad is None else _in_row_order(residual_grad, order)
    if not x.is_cuda:
        residual_grad = None if residual_grad is None else _contiguous_last(residual_grad)
        dx, dw = _rms_norm_backward_cpu(_contiguous_last(dy), _contiguous_last(x), weight, rstd, eps, offset,
                                        residual_grad)
    else:
        dy, x, residual_grad = _rows_in_runs(dy, x, residual_grad, levels=2 if residual_grad is None else 1)
        dx, dw = _rms_norm_backward(dy, x, weight, rstd, eps, offset, residual_grad=residual_grad)
    return _from_row_order(dx, order), dw


def _new_rows_like(x: Tensor, drop_last: bool = False, dtype=None) -> Tensor:
    """New memory shaped like x (drop_last: like its rows, as rstd), laid out as _rms_norm_any lays out its
    outputs."""
    order = _row_order(x)
    shape = list(_in_row_order(x, order).shape)
    new = torch.empty(shape[:-1] if drop_last else shape, dtype=dtype or x.dtype, device=x.device)
    return _from_row_order(new, order, rows_only=drop_last)


@torch.library.custom_op("cupyrope::rms_norm", mutates_args=(), device_types=("cuda", "cpu"))
def _rms_norm_op(x: Tensor, weight: Optional[Tensor], eps: float, offset: float) -> tuple[Tensor, Tensor]:
    return _rms_norm_any(x, weight, eps, offset)


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return _new_rows_like(x), _new_rows_like(x, drop_last=True, dtype=torch.float32)


@torch.library.custom_op("cupyrope::rms_norm_backward", mutates_args=(), device_types=("cuda", "cpu"))
def _rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor, eps: float,
                          offset: float, residual_grad: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(dx, dweight); dweight is an empty tensor without weight (ops cannot return None). residual_grad: added to dx
    (add_rms_norm's backward)."""
    dx, dw = _rms_norm_backward_any(dy, x, weight, rstd, eps, offset, residual_grad)
    return dx, (dw if dw is not None else dx.new_empty(0))


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, eps, offset, residual_grad=None):
    dw = x.new_empty(0) if weight is None else torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return _new_rows_like(x), dw


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
    return _rms_norm_any(x, weight, eps, offset, return_rstd=False)[0]  # no rstd: one output fewer


def _add_rms_norm_any(x, residual, weight, eps, offset, return_rstd=True):
    """(y, s, rstd) of add_rms_norm (s = x + residual, rounded to x's dtype), on either device; new contiguous
    outputs. Without return_rstd, (y, s): on the GPU no rstd is written (inference has no use for it)."""
    if not x.is_cuda:
        x, residual = _contiguous_last(x), _contiguous_last(residual)  # as _rows_in_runs on the GPU
        _norm_checks.check_add(_host(x, "x"), _host(residual, "residual"), _optional_host(weight, "weight"), eps=eps,
                               offset=offset, impl="auto")
        s = (x.float() + residual.float()).to(x.dtype).contiguous()
        y, rstd = _rms_norm_cpu(s, weight, eps, offset)
        return (y, s, rstd) if return_rstd else (y, s)
    x, residual = _rows_in_runs(x, residual, levels=1)
    return _add_rms_norm(x, residual, weight, eps, offset=offset, return_rstd=return_rstd)


@torch.library.custom_op("cupyrope::add_rms_norm", mutates_args=(), device_types=("cuda", "cpu"))
def _add_rms_norm_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                     offset: float) -> tuple[Tensor, Tensor, Tensor]:
    return _add_rms_norm_any(x, residual, weight, eps, offset)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset):
    new = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(2)]
    return (*new, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))


def _add_grads(ctx, grad_y, grad_s, rms_backward):
    """add_rms_norm's gradients (x, residual, weight, eps, offset) through rms_backward (the op or the function):
    the gradient of s, with grad_s added in the kernel, is both x's and residual's."""
    s, weight, rstd = ctx.saved_tensors
    eps, offset = ctx.options
    ds, dw = rms_backward(grad_y, s, weight, rstd, eps, offset, grad_s)
    wants_dw = weight is not None and ctx.needs_input_grad[2]
    return (ds if ctx.needs_input_grad[0] else None), (ds if ctx.needs_input_grad[1] else None), \
        (dw if wants_dw else None), None, None


def _add_setup(ctx, inputs, output):
    _, _, weight, eps, offset = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.options = (eps, offset)


_add_rms_norm_op.register_autograd(lambda ctx, grad_y, grad_s, _grad_rstd: _add_grads(ctx, grad_y, grad_s,
                                                                                      _rms_norm_backward_op),
                                   setup_context=_add_setup)


class _AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset):
        y, s, rstd = _add_rms_norm_any(x, residual, weight, eps, offset)
        ctx.save_for_backward(s, weight, rstd)
        ctx.options = (eps, offset)
        return y, s

    @staticmethod
    def backward(ctx, grad_y, grad_s):
        return _add_grads(ctx, grad_y, grad_s, _rms_norm_backward_any)


def _fp32_stream(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, offset: float,
                 residual_dtype) -> bool:
    """Whether add_rms_norm keeps the residual stream in fp32 (residual_dtype=torch.float32 with fp16/bf16 x), after
    the checks of that form; False for the fused kernel's (None or x's dtype), which checks its own arguments."""
    if residual_dtype is None or residual_dtype == x.dtype:
        return False
    if residual_dtype != torch.float32:
        raise ValueError(f"residual_dtype: expected None, x's dtype ({x.dtype}) or torch.float32, got {residual_dtype}")
    xa, ra = _host(x, "x"), _host(residual, "residual")
    _norm_checks.check_options(eps, offset, "auto")
    _checks.check_float_input(xa, "x", "hidden", ("float16", "bfloat16"))
    if ra.dtype not in (xa.dtype, "float32"):
        raise TypeError(f"residual: expected dtype {xa.dtype} (like x) or float32 (residual_dtype=torch.float32), got "
                        f"{ra.dtype}")
    _checks.check_like(ra, xa, "x", "residual", dtype=ra.dtype)
    _norm_checks.check_weight(_optional_host(weight, "weight"), xa, "x")
    return True


def add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *,
                 offset: float = 0.0, residual_dtype=None) -> tuple[Tensor, Tensor]:
    """The residual add + RMSNorm of a pre-norm decoder, out of place and differentiable: s = x + residual (rounded
    to x's dtype), y = rms_norm(s, weight, eps, offset). Returns (y, s); s is the residual stream's next value.
    One forward launch (x and residual read once, y and s written) and one backward launch (dx = dresidual, with
    s's own gradient added in the kernel; dweight reduced deterministically). x and residual are left as they are.
    residual_dtype: None (x's dtype), or torch.float32 with fp16/bf16 x: the residual stream kept in fp32 (residual
    in x's dtype or fp32; s = x + residual not rounded to x's dtype, returned in fp32; y in x's dtype, rounded from
    fp32). That form runs as torch's add, cupyrope's fp32 rms_norm and a cast (three launches forward, and their
    backwards through autograd), not as one fused kernel."""
    if _fp32_stream(x, residual, weight, eps, offset, residual_dtype):
        s = residual.float() + x  # one fp32 add where residual is fp32 already (x promoted exactly)
        return rms_norm(s, None if weight is None else weight.float(), eps, offset).to(x.dtype), s
    if _compiling():
        return _add_rms_norm_op(x, residual, weight, eps, offset)[:2]
    needs_grad = x.requires_grad or residual.requires_grad or (weight is not None and weight.requires_grad)
    if torch.is_grad_enabled() and needs_grad:
        return _AddRMSNormFunction.apply(x, residual, weight, eps, offset)
    return _add_rms_norm_any(x, residual, weight, eps, offset, return_rstd=False)


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


# ------------------------------------------------------------------------------------------ LayerNorm


def _layer_norm_cpu(x, weight, bias, eps):
    """layer_norm() on CPU tensors: its checks, then the formula in torch, fp32 math, x's dtype out; mean and rstd."""
    _ln_checks.check_forward(_host(x, "x"), _optional_host(weight, "weight"), _optional_host(bias, "bias"), None,
                             eps=eps, impl="auto")
    xf = x.float()
    mean = xf.mean(-1)
    centered = xf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centered.pow(2).mean(-1) + eps)
    y = centered * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def _layer_norm_backward_cpu(dy, x, weight, bias, mean, rstd, eps):
    _ln_checks.check_backward(_host(dy, "dy"), _host(x, "x"), _optional_host(weight, "weight"),
                              _optional_host(bias, "bias"), _optional_host(mean, "mean"), _optional_host(rstd, "rstd"),
                              eps=eps, impl="auto")
    xf, dyf = x.float(), dy.float()
    xhat = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    g = dyf * weight.float() if weight is not None else dyf
    dx = rstd.unsqueeze(-1) * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    param = weight if weight is not None else bias
    grads = None if param is None else torch.stack([_column_sums(dyf * xhat, param.dtype),
                                                    _column_sums(dyf, param.dtype)])
    return dx.to(x.dtype), grads


def _layer_norm_any(x, weight, bias, eps, return_stats=True):
    """(y, mean, rstd) as layer_norm's op returns them (mean and rstd None where not return_stats), on either device.
    Rows are taken in memory order; the outputs are new memory whose rows lie in x's order."""
    order = _row_order(x)
    x = _in_row_order(x, order)
    if not x.is_cuda:
        y, mean, rstd = _layer_norm_cpu(_contiguous_last(x), weight, bias, eps)
    elif return_stats:
        y, mean, rstd = _layer_norm(_rows_in_runs(x, levels=1)[0], weight, bias, eps, return_stats=True)
    else:
        y, mean, rstd = _layer_norm(_rows_in_runs(x, levels=1)[0], weight, bias, eps), None, None
    if order is None:
        return y, mean, rstd
    stats = [None if t is None else _from_row_order(t, order, rows_only=True) for t in (mean, rstd)]
    return _from_row_order(y, order), *stats


def _layer_norm_backward_any(dy, x, weight, bias, mean, rstd, eps):
    """(dx, grads): grads the (2, hidden) dweight and dbias (None without either parameter)."""
    order = _row_order(x)  # the forward's: mean and rstd are laid out in it
    if order is not None:
        dy, x = _in_row_order(dy, order), _in_row_order(x, order)
        mean, rstd = (_in_row_order(t, order, rows_only=True).contiguous() for t in (mean, rstd))
    if not x.is_cuda:
        dx, grads = _layer_norm_backward_cpu(_contiguous_last(dy), _contiguous_last(x), weight, bias, mean, rstd, eps)
    else:
        dy, x = _rows_in_runs(dy, x, levels=1)
        dx, grads = _layer_norm_backward(dy, x, weight, bias, mean, rstd, eps)
    return _from_row_order(dx, order), grads


@torch.library.custom_op("cupyrope::layer_norm", mutates_args=(), device_types=("cuda", "cpu"))
def _layer_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _layer_norm_any(x, weight, bias, eps)


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    stats = [_new_rows_like(x, drop_last=True, dtype=torch.float32) for _ in range(2)]
    return _new_rows_like(x), *stats


@torch.library.custom_op("cupyrope::layer_norm_backward", mutates_args=(), device_types=("cuda", "cpu"))
def _layer_norm_backward_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                            rstd: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(dx, grads): grads the (2, hidden) dweight and dbias in one tensor (ops return no views of their outputs),
    empty without either parameter (ops cannot return None)."""
    dx, grads = _layer_norm_backward_any(dy, x, weight, bias, mean, rstd, eps)
    return dx, (grads if grads is not None else dx.new_empty(0))


@_layer_norm_backward_op.register_fake
def _(dy, x, weight, bias, mean, rstd, eps):
    param = weight if weight is not None else bias
    grads = x.new_empty(0) if param is None else param.new_empty((2, param.shape[-1]))
    return _new_rows_like(x), grads


def _layer_norm_grads(ctx, grad_y, backward):
    """layer_norm's gradients (x, weight, bias, eps) through backward (the op or the function)."""
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, grads = backward(grad_y, x, weight, bias, mean, rstd, ctx.eps)
    return ((dx if ctx.needs_input_grad[0] else None),
            (grads[0] if weight is not None and ctx.needs_input_grad[1] else None),
            (grads[1] if bias is not None and ctx.needs_input_grad[2] else None), None)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.eps = eps


_layer_norm_op.register_autograd(lambda ctx, grad_y, _grad_mean, _grad_rstd: _layer_norm_grads(
    ctx, grad_y, _layer_norm_backward_op), setup_context=_layer_norm_setup)


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _layer_norm_any(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, grad):
        return _layer_norm_grads(ctx, grad, _layer_norm_backward_any)


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """Differentiable, torch.compile-able ``cupyrope.layer_norm`` (``F.layer_norm`` over the last dimension): dx,
    dweight and dbias come from the backward kernel (dweight and dbias reduced deterministically)."""
    if _compiling():
        return _layer_norm_op(x, weight, bias, eps)[0]
    params = [t for t in (x, weight, bias) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in params):
        return _LayerNormFunction.apply(x, weight, bias, eps)
    return _layer_norm_any(x, weight, bias, eps, return_stats=False)[0]


def _fused_add_layer_norm_any(x, residual, weight, bias, eps):
    if not x.is_cuda:
        _ln_checks.check_fused_add(_host(x, "x"), _host(residual, "residual"), _optional_host(weight, "weight"),
                                   _optional_host(bias, "bias"), eps=eps, impl="auto")
        residual.add_(x)
        x.copy_(_layer_norm_cpu(residual, weight, bias, eps)[0])
    else:
        _fused_add_layer_norm(x, residual, weight, bias, eps)


@torch.library.custom_op("cupyrope::fused_add_layer_norm_", mutates_args=("x", "residual"),
                         device_types=("cuda", "cpu"))
def _fused_add_layer_norm_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                             eps: float) -> None:
    _fused_add_layer_norm_any(x, residual, weight, bias, eps)


@_fused_add_layer_norm_op.register_fake
def _(x, residual, weight, bias, eps):
    return None


def fused_add_layer_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                         eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """In-place residual add + LayerNorm (inference; not differentiable): residual <- x + residual, then
    x <- layer_norm(residual). Returns (x, residual)."""
    if _compiling():
        _fused_add_layer_norm_op(x, residual, weight, bias, eps)
    else:
        _fused_add_layer_norm_any(x, residual, weight, bias, eps)
    return x, residual


def _rms_norm_fp8_cpu(x, weight, residual, scale, scale_ub, group_size, eps, offset):
    """rms_norm_fp8() on CPU tensors: its checks, then the kernel's arithmetic in torch (fp32 values, the scale's
    reciprocal, NaN left out of the maxima)."""
    _norm_checks.check_fp8(_host(x, "x"), _optional_host(weight, "weight"), _optional_host(residual, "residual"),
                           _optional_host(scale, "scale"), _optional_host(scale_ub, "scale_ub"), None,
                           group_size=group_size, eps=eps, offset=offset, impl="auto")
    if residual is not None:
        residual.add_(x)
    source = (x if residual is None else residual).float()
    v = source * torch.rsqrt(source.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        v = v * (weight.float() + offset)
    if scale is not None:
        scales = x.new_empty(0, dtype=torch.float32)
        q = v * (1 / scale.float().reshape(()))
    else:
        groups = v.unflatten(-1, (-1, group_size or v.shape[-1]))
        amax = groups.abs().nan_to_num(nan=0.0, posinf=float("inf")).amax(-1)
        if scale_ub is not None:
            amax = torch.minimum(amax, scale_ub.float().reshape(()))
        scales = torch.clamp(amax / _reference.E4M3_MAX, min=_reference.MIN_FP8_SCALE)
        q = (groups * (1 / scales).unsqueeze(-1)).flatten(-2)
        scales = scales if group_size else scales.squeeze(-1)
    q = torch.where(q.isnan(), q, q.clamp(-_reference.E4M3_MAX, _reference.E4M3_MAX))
    return q.to(torch.float8_e4m3fn), scales


@torch.library.custom_op("cupyrope::rms_norm_fp8", mutates_args=("residual",), device_types=("cuda", "cpu"))
def _rms_norm_fp8_op(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], scale: Optional[Tensor],
                     scale_ub: Optional[Tensor], group_size: Optional[int], eps: float,
                     offset: float) -> tuple[Tensor, Tensor]:
    """(y, scales); scales is an empty tensor with a static scale (ops cannot return None)."""
    if not x.is_cuda:
        return _rms_norm_fp8_cpu(x, weight, residual, scale, scale_ub, group_size, eps, offset)
    result = _rms_norm_fp8(x, weight, eps, scale=scale, group_size=group_size, residual=residual, offset=offset,
                           scale_ub=scale_ub)
    return (result, x.new_empty(0, dtype=torch.float32)) if scale is not None else result


@_rms_norm_fp8_op.register_fake
def _(x, weight, residual, scale, scale_ub, group_size, eps, offset):
    y = x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
    if scale is not None:
        return y, x.new_empty(0, dtype=torch.float32)
    lead = list(x.shape[:-1])
    return y, x.new_empty(lead + [x.shape[-1] // group_size] if group_size else lead, dtype=torch.float32)


def rms_norm_fp8(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *, scale: Optional[Tensor] = None,
                 group_size: Optional[int] = None, residual: Optional[Tensor] = None, offset: float = 0.0,
                 scale_ub: Optional[Tensor] = None):
    """cupyrope.rms_norm_fp8 for torch (inference; not differentiable): y as torch.float8_e4m3fn, and with no
    static scale (y, scales). On CPU tensors too, and under torch.compile as ``torch.ops.cupyrope.rms_norm_fp8``
    (residual, when given, is updated in place)."""
    if x.is_cuda and not _compiling():  # eager: straight to the kernel
        return _rms_norm_fp8(x, weight, eps, scale=scale, group_size=group_size, residual=residual, offset=offset,
                             scale_ub=scale_ub)
    y, scales = _rms_norm_fp8_op(x, weight, residual, scale, scale_ub, group_size, eps, offset)
    return y if scale is not None else (y, scales)


# -------------------------------------------------------------------------------------- QK-norm + RoPE


def _qk_norm_rope_cpu(q, k, q_weight, k_weight, where, eps, offset, theta, style, rotary_dim, cos_sin_cache):
    """qk_norm_rope() on CPU tensors: its checks, then RMSNorm per head in fp32, rounded to q's dtype, and the
    rotation."""
    rotary_dim, _, source = _qk_norm_checks.check_qk_norm_rope(
        _host(q, "q"), _host(k, "k"), _optional_host(q_weight, "q_weight"), _optional_host(k_weight, "k_weight"),
        _optional_host(where[0], "positions"), _optional_host(cos_sin_cache, "cos_sin_cache"), eps=eps,
        offset=offset, theta=theta, style=style, rotary_dim=rotary_dim, impl="auto", **_where_hosts(where))
    outputs = []
    for x, w in ((q, q_weight), (k, k_weight)):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (w.float() + offset)
        outputs.append(_rope_formula(normed, where, source, theta, style, rotary_dim, cos_sin_cache, False).to(x.dtype))
    return tuple(outputs)


def _qk_norm_rope_any(q, k, q_weight, k_weight, where, eps, offset, theta, style, rotary_dim, cos_sin_cache):
    q, k = _contiguous_last(q), _contiguous_last(k)
    if not q.is_cuda:
        return _qk_norm_rope_cpu(q, k, q_weight, k_weight, where, eps, offset, theta, style, rotary_dim,
                                 cos_sin_cache)
    return _qk_norm_rope(q, k, q_weight, k_weight, where[0], eps=eps,
                         offset=offset, theta=theta, style=style, rotary_dim=rotary_dim, cos_sin_cache=cos_sin_cache,
                         out="new", **_where_options(where))


def _qk_norm_rope_backward_any(dq, dk, q, k, q_weight, k_weight, where, eps, offset, theta, style, rotary_dim,
                               cos_sin_cache):
    if not q.is_cuda:  # autograd through the CPU formula
        with torch.enable_grad():
            inputs = [_contiguous_last(t.detach()).requires_grad_() for t in (q, k, q_weight, k_weight)]
            outputs = _qk_norm_rope_cpu(*inputs, where, eps, offset, theta, style, rotary_dim, cos_sin_cache)
            return torch.autograd.grad(outputs, inputs, (dq, dk))
    return _qk_norm_rope_backward(_contiguous_last(dq), _contiguous_last(dk), _contiguous_last(q), _contiguous_last(k),
                                  q_weight, k_weight, where[0], eps=eps, offset=offset, theta=theta, style=style,
                                  rotary_dim=rotary_dim, cos_sin_cache=cos_sin_cache, **_where_options(where))


@torch.library.custom_op("cupyrope::qk_norm_rope", mutates_args=(), device_types=("cuda", "cpu"))
def _qk_norm_rope_op(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Optional[Tensor],
                     eps: float, offset: float, theta: float, style: str, rotary_dim: Optional[int],
                     cos_sin_cache: Optional[Tensor], cu_seqlens: Optional[Tensor], seqlen_offsets: Optional[Tensor],
                     mrope_section: Optional[List[int]], mrope_interleaved: bool) -> tuple[Tensor, Tensor]:
    where = (positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved)
    return _qk_norm_rope_any(q, k, q_weight, k_weight, where, eps, offset, theta, style, rotary_dim, cos_sin_cache)


@_qk_norm_rope_op.register_fake
def _(q, k, *rest):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


@torch.library.custom_op("cupyrope::qk_norm_rope_backward", mutates_args=(), device_types=("cuda", "cpu"))
def _qk_norm_rope_backward_op(dq: Tensor, dk: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                              positions: Optional[Tensor], eps: float, offset: float, theta: float, style: str,
                              rotary_dim: Optional[int], cos_sin_cache: Optional[Tensor],
                              cu_seqlens: Optional[Tensor], seqlen_offsets: Optional[Tensor],
                              mrope_section: Optional[List[int]],
                              mrope_interleaved: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    where = (positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved)
    grads = _qk_norm_rope_backward_any(dq, dk, q, k, q_weight, k_weight, where, eps, offset, theta, style, rotary_dim,
                                       cos_sin_cache)
    return tuple(g.clone() if g._base is not None else g for g in grads)  # ops return no views of their outputs


@_qk_norm_rope_backward_op.register_fake
def _(dq, dk, q, k, q_weight, k_weight, *rest):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(q_weight),
            torch.empty_like(k_weight))


def _qk_norm_rope_setup(ctx, inputs, output):
    q, k, q_weight, k_weight, positions, *options = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, positions)
    ctx.options = options


def _qk_norm_rope_grad(ctx, grad_q, grad_k):
    q, k, q_weight, k_weight, positions = ctx.saved_tensors
    grads = _qk_norm_rope_backward_op(grad_q, grad_k, q, k, q_weight, k_weight, positions, *ctx.options)
    return *grads, *(None,) * 11


_qk_norm_rope_op.register_autograd(_qk_norm_rope_grad, setup_context=_qk_norm_rope_setup)


class _QKNormRopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, where, *options):
        ctx.save_for_backward(q, k, q_weight, k_weight)
        ctx.where, ctx.options = where, options
        return _qk_norm_rope_any(q, k, q_weight, k_weight, where, *options)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        q, k, q_weight, k_weight = ctx.saved_tensors
        grads = _qk_norm_rope_backward_any(grad_q, grad_k, q, k, q_weight, k_weight, ctx.where, *ctx.options)
        return *(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad)), None, *(None,) * 6


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Optional[Tensor] = None, *,
                 eps: float = 1e-6, offset: float = 0.0, theta: float = 10000.0, style: str = "neox",
                 rotary_dim: Optional[int] = None, cos_sin_cache: Optional[Tensor] = None,
                 cu_seqlens: Optional[Tensor] = None, seqlen_offsets: Optional[Tensor] = None,
                 mrope_section: Optional[list] = None, mrope_interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Differentiable, torch.compile-able ``cupyrope.qk_norm_rope`` (out of place): one launch forward, one (plus
    the weights' reduction) backward, with gradients for q, k, q_weight and k_weight (the weights' reduced in a
    fixed order)."""
    where = _where(positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved)
    options = (eps, offset, theta, style, rotary_dim, cos_sin_cache)
    if _compiling():
        return _qk_norm_rope_op(q, k, q_weight, k_weight, where[0], *options, *where[1:])
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, q_weight, k_weight)):
        return _QKNormRopeFunction.apply(q, k, q_weight, k_weight, where, *options)
    return _qk_norm_rope_any(q, k, q_weight, k_weight, where, *options)


@torch.library.custom_op("cupyrope::qk_norm_rope_", mutates_args=("q", "k"), device_types=("cuda", "cpu"))
def _qk_norm_rope_inplace_op(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Optional[Tensor],
                             eps: float, offset: float, theta: float, style: str, rotary_dim: Optional[int],
                             cos_sin_cache: Optional[Tensor], cu_seqlens: Optional[Tensor],
                             seqlen_offsets: Optional[Tensor], mrope_section: Optional[List[int]],
                             mrope_interleaved: bool) -> None:
    where = (positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved)
    _qk_norm_rope_inplace_any(q, k, q_weight, k_weight, where, eps, offset, theta, style, rotary_dim, cos_sin_cache)


def _qk_norm_rope_inplace_any(q, k, q_weight, k_weight, where, eps, offset, theta, style, rotary_dim, cos_sin_cache):
    if not q.is_cuda:
        _rope_checks.check_qk_outputs(_host(q, "q"), _host(k, "k"), None, None)  # in place: q and k are written
        q_out, k_out = _qk_norm_rope_cpu(q, k, q_weight, k_weight, where, eps, offset, theta, style, rotary_dim,
                                         cos_sin_cache)
        q.copy_(q_out)
        k.copy_(k_out)
    else:
        _qk_norm_rope(q, k, q_weight, k_weight, where[0], eps=eps, offset=offset, theta=theta, style=style,
                      rotary_dim=rotary_dim, cos_sin_cache=cos_sin_cache, **_where_options(where))


@_qk_norm_rope_inplace_op.register_fake
def _(q, k, *rest):
    return None


def qk_norm_rope_(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Optional[Tensor] = None, *,
                  eps: float = 1e-6, offset: float = 0.0, theta: float = 10000.0, style: str = "neox",
                  rotary_dim: Optional[int] = None, cos_sin_cache: Optional[Tensor] = None,
                  cu_seqlens: Optional[Tensor] = None, seqlen_offsets: Optional[Tensor] = None,
                  mrope_section: Optional[list] = None, mrope_interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """In-place QK-norm + RoPE of q and k in one launch (inference/serving; not differentiable)."""
    where = _where(positions, cu_seqlens, seqlen_offsets, mrope_section, mrope_interleaved)
    options = (eps, offset, theta, style, rotary_dim, cos_sin_cache)
    if _compiling():
        _qk_norm_rope_inplace_op(q, k, q_weight, k_weight, where[0], *options, *where[1:])
    else:
        _qk_norm_rope_inplace_any(q, k, q_weight, k_weight, where, *options)
    return q, k


# ------------------------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """Drop-in for Hugging Face's LlamaRMSNorm / Qwen2RMSNorm and ``torch.nn.RMSNorm`` (state_dict key
    ``weight``); offset=1.0 gives Gemma's (1 + weight) scaling (weight then starts at zero). residual_dtype: that of
    forward(x, residual)'s add_rms_norm (None: x's dtype; torch.float32: the residual stream kept in fp32)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, device=None, dtype=None,
                 residual_dtype=None):
        super().__init__()
        if not _checks.is_int(hidden_size) or hidden_size < 1:
            raise ValueError(f"hidden_size: expected an int >= 1, got {hidden_size!r}")
        _norm_checks.check_options(eps, offset, "auto")
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.hidden_size = hidden_size
        self.eps = eps
        self.offset = offset
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        """rms_norm(x); with residual, add_rms_norm(x, residual): (y, x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.offset)
        return add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset, residual_dtype=self.residual_dtype)

    def extra_repr(self) -> str:
        stream = "" if self.residual_dtype is None else f", residual_dtype={self.residual_dtype}"
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}{stream}"


class LayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm`` over the last dimension (state_dict keys ``weight`` and ``bias``, which
    ``elementwise_affine=False`` and ``bias=False`` leave out, as torch's do)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        shape = (normalized_shape,) if _checks.is_int(normalized_shape) else tuple(normalized_shape)
        if len(shape) != 1 or not _checks.is_int(shape[0]) or shape[0] < 1:
            raise ValueError(f"normalized_shape: expected an int >= 1 (or a 1-tuple: the last dimension), got "
                             f"{normalized_shape!r}")
        _ln_checks.check_options(eps, "auto")
        self.normalized_shape = shape
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        affine = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(shape, **affine)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(shape, **affine)) if elementwise_affine and bias else None

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RotaryEmbedding(nn.Module):
    """RoPE for (q, k, positions): ``forward(q, k, positions, inplace=False) -> (q, k)``.

    By default cos/sin are computed in the kernel from theta (exact to fp32 rounding, no table);
    ``use_cache=True`` builds a (max_position, rotary_dim) fp32 cos/sin buffer instead (vLLM layout).
    ``scaling`` (a Hugging Face rope_scaling dict: "linear", "llama3", "yarn") always uses the buffer,
    built with the scaled frequencies. ``from_hf_config`` reads all of it from a model config."""

    def __init__(self, head_dim: int, max_position: int, theta: float = 10000.0, style: str = "neox",
                 rotary_dim: Optional[int] = None, use_cache: Optional[bool] = None, scaling: Optional[dict] = None,
                 mrope_section: Optional[list] = None, mrope_interleaved: bool = False, device=None):
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
        section = _rope_checks.check_mrope_section(mrope_section, mrope_interleaved, self.rotary_dim)
        self.mrope_section = None if section is None else list(section)
        self.mrope_interleaved = bool(mrope_interleaved)
        self.scaling = None if _rope_scaling.check_scaling(scaling, self.theta) == "default" else dict(scaling)
        if self.scaling is not None and use_cache is False:
            raise ValueError("use_cache: scaled RoPE (scaling=...) needs the cos/sin table; leave use_cache unset")
        cache = None
        if use_cache or self.scaling is not None:
            table = _reference.rope_cache(max_position, self.rotary_dim, self.theta, self.scaling)
            cache = torch.from_numpy(table.astype("float32")).to(device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    @classmethod
    def from_hf_config(cls, config, max_position: Optional[int] = None, device=None,
                       layer_type: Optional[str] = None) -> "RotaryEmbedding":
        """The RoPE of a Hugging Face model config (transformers 4's rope_theta / rope_scaling /
        partial_rotary_factor, or 5's rope_parameters), NeoX style (rotate_half, as in transformers), M-RoPE's
        mrope_section and mrope_interleaved included (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: positions (3, ...) then).
        max_position defaults to the config's max_position_embeddings. layer_type: for configs with one
        rope_parameters dict per layer type (Gemma 3: "sliding_attention", "full_attention"), which one."""
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if any(isinstance(value, dict) for value in params.values()):
            if layer_type not in params:
                raise ValueError(f"layer_type: the config has rope_parameters per layer type; expected one of "
                                 f"{sorted(params)}, got {layer_type!r}")
            params = params[layer_type]
        mrope = {key: params[key] for key in MROPE_KEYS if key in params}
        params = {key: value for key, value in params.items() if key not in MROPE_KEYS}
        if params.get("rope_type", params.get("type")) == "mrope":  # transformers' older name of default M-RoPE
            params = {key: value for key, value in params.items() if key not in ("rope_type", "type")}
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        return cls(head_dim, max_position or config.max_position_embeddings, theta=theta,
                   rotary_dim=int(head_dim * partial), scaling=params or None, device=device, **mrope)

    def forward(self, q: Tensor, k: Tensor, positions: Optional[Tensor] = None, inplace: bool = False, *,
                cu_seqlens: Optional[Tensor] = None, seqlen_offsets: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """q, k rotated at positions ((3, ...) with M-RoPE), or at the positions of packed sequences
        (cu_seqlens, seqlen_offsets)."""
        options = self.rope_options(cu_seqlens, seqlen_offsets)
        if inplace:
            return rope_qk_(q, k, positions, **options)
        return rope_qk(q, k, positions, **options)

    def rope_options(self, cu_seqlens=None, seqlen_offsets=None) -> dict:
        """The keyword arguments of this embedding's rope calls."""
        return dict(theta=self.theta, style=self.style, rotary_dim=self.rotary_dim, cos_sin_cache=self.cos_sin_cache,
                    mrope_section=self.mrope_section, mrope_interleaved=self.mrope_interleaved, cu_seqlens=cu_seqlens,
                    seqlen_offsets=seqlen_offsets)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        if self.mrope_section is not None:
            scaling += f", mrope_section={self.mrope_section}, mrope_interleaved={self.mrope_interleaved}"
        return (f"head_dim={self.head_dim}, max_position={self.max_position}, theta={self.theta}, "
                f"style={self.style!r}, rotary_dim={self.rotary_dim}{scaling}")


class QKNormRotaryEmbedding(nn.Module):
    """QK-norm + RoPE for an attention layer (Qwen3, Gemma 3, OLMo-style QK-norm): ``forward(q, k, positions)``
    normalizes each head of q and k over head_dim (weights ``q_norm.weight`` and ``k_norm.weight``, the state-dict
    keys of transformers' Qwen3 and Gemma 3 attention) and rotates them, in one launch (cupyrope.qk_norm_rope).
    ``rotary``: the RotaryEmbedding (built from the same arguments, or from_hf_config's); offset=1.0 for Gemma's
    (1 + w) weights."""

    def __init__(self, head_dim: int, max_position: int, eps: float = 1e-6, offset: float = 0.0, *,
                 rotary: Optional[RotaryEmbedding] = None, device=None, dtype=None, **rotary_options):
        super().__init__()
        self.q_norm = RMSNorm(head_dim, eps, offset, device=device, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, eps, offset, device=device, dtype=dtype)
        self.rotary = rotary if rotary is not None else RotaryEmbedding(head_dim, max_position, device=device,
                                                                         **rotary_options)

    @classmethod
    def from_hf_config(cls, config, max_position: Optional[int] = None, offset: float = 0.0, device=None,
                       dtype=None, layer_type: Optional[str] = None) -> "QKNormRotaryEmbedding":
        """The QK-norm (eps: the config's rms_norm_eps) and RoPE of a Hugging Face model config (layer_type: see
        RotaryEmbedding.from_hf_config)."""
        rotary = RotaryEmbedding.from_hf_config(config, max_position, device=device, layer_type=layer_type)
        return cls(rotary.head_dim, rotary.max_position, getattr(config, "rms_norm_eps", 1e-6), offset, rotary=rotary,
                   device=device, dtype=dtype)

    def forward(self, q: Tensor, k: Tensor, positions: Optional[Tensor] = None, inplace: bool = False, *,
                cu_seqlens: Optional[Tensor] = None, seqlen_offsets: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        options = dict(self.rotary.rope_options(cu_seqlens, seqlen_offsets), eps=self.q_norm.eps,
                       offset=self.q_norm.offset)
        function = qk_norm_rope_ if inplace else qk_norm_rope
        return function(q, k, self.q_norm.weight, self.k_norm.weight, positions, **options)


def rope_cache(max_position: int, rotary_dim: int, theta: float = 10000.0, *, scaling: Optional[dict] = None,
               dtype=torch.float32, device="cuda"):
    """``cupyrope.rope_cache`` as a torch tensor on ``device`` ("cpu", "cuda", "cuda:1", ...)."""
    return _rope_cache(max_position, rotary_dim, theta, scaling=scaling, dtype=dtype, kind="torch", device=device)
