"""LayerNorm's public functions: layer_norm, fused_add_layer_norm and layer_norm_backward.

A call finds its plan (the one preamble: _runtime/plan_cache.py), which a first call makes by checking its
arguments (layernorm_checks.py) and planning (layernorm_plan.py), then launches with its own pointers.
"""

import struct

from .._runtime import checks
from .._runtime.arrays import allocator, contiguous_like
from .._runtime.checks import IN_PLACE, OUT, output_mode
from .._runtime.compile import get_kernel
from .._runtime.launch import Launch
from .._runtime.plan_cache import EmptyPlan, OpPlans
from . import layernorm_checks, profiles
from .layernorm_plan import DW_SOURCE, plan_backward, plan_forward, weight_dtype
from .rmsnorm_checks import row_layout, rows
from .rmsnorm_plan_backward import DW_SPLIT, dweight_kernel_name, fitted_to_device
from .rmsnorm_rows import kernel_for, shared_limit

# Mirror LayerNormParams and LayerNormBwdParams in kernels_src/layernorm.cu: pointers, then these.
FWD_TAIL = struct.Struct("<5q2f")  # rows, hidden, three row strides, eps, 1 / hidden
BWD_TAIL = struct.Struct("<6qfi")  # rows, hidden, three row strides, row slots, 1 / hidden, shared partial rows
DW_TAIL = struct.Struct("<2q")  # rms_norm_dw's: partial rows, hidden


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, out=None, return_stats=False, impl="auto"):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dimension of x (..., hidden), with the biased
    variance (torch.nn.functional.layer_norm's).

    weight, bias: (hidden,), float32 or x's dtype (one dtype where both are given); None: no scale, no shift.
    Accumulates in fp32 and returns x's dtype. Returns y, or (y, mean, rstd) with return_stats (fp32, shape (...)).
    out: where to write y (x's shape and dtype; out=x normalizes in place).
    """
    out, mean, rstd, _ = _forward(x, weight, bias, eps, out, return_stats, impl)
    return (out, mean, rstd) if return_stats else out


def _forward(x, weight, bias, eps, out, return_stats, impl):
    """layer_norm's call: (y, mean, rstd, their pointers (0, 0) where not return_stats)."""
    mode = output_mode(out, x)
    plan, (x_ptr, w_ptr, b_ptr, o_ptr) = _forward_plans.find(
        (x, weight, bias, out if mode == OUT else None), (mode, weight is None, bias is None, eps, return_stats, impl))
    out, o_ptr = checks.output_of(plan, mode, x, out, x_ptr, o_ptr)
    mean, mean_ptr = plan.new_stat(x) if return_stats else (None, 0)
    rstd, rstd_ptr = plan.new_stat(x) if return_stats else (None, 0)
    if plan.grid:
        plan.launch(x_ptr, o_ptr, 0, w_ptr, b_ptr, mean_ptr, rstd_ptr)
    return out, mean, rstd, (mean_ptr, rstd_ptr)


def fused_add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, impl="auto"):
    """The in-place fused residual add, as fused_add_rms_norm's: residual <- x + residual (rounded to x's dtype), then
    x <- layer_norm(residual, weight, bias, eps). One read and one write of each tensor where a row fits the
    registers. Returns (x, residual)."""
    plan, (x_ptr, r_ptr, w_ptr, b_ptr) = _fused_add_plans.find((x, residual, weight, bias),
                                                              (weight is None, bias is None, eps, impl))
    if plan.grid:
        checks.check_disjoint(x_ptr, plan.extents[0], r_ptr, plan.extents[1], "x", "residual", "pass separate memory")
        plan.launch(x_ptr, x_ptr, r_ptr, w_ptr, b_ptr, 0, 0)
    return x, residual


def layer_norm_backward(dy, x, weight=None, bias=None, mean=None, rstd=None, eps=1e-5, *, impl="auto"):
    """Gradients of layer_norm: returns (dx, dweight, dbias); dweight is None without weight, dbias None without bias
    (bias is only read for its dtype: dbias has it).

    mean, rstd (fp32, shape x.shape[:-1], as layer_norm(..., return_stats=True) returns them): without them,
    layer_norm computes them first (a read of x more), so that dx has the same bits either way. dweight and dbias
    are reduced in a fixed order: bitwise identical from run to run, no atomics. They are the two rows of one
    (2, hidden) array, reduced by one launch."""
    dx, grads = parameter_grads_backward(dy, x, weight, bias, mean, rstd, eps, impl=impl)
    return dx, (grads[0] if weight is not None else None), (grads[1] if bias is not None else None)


def parameter_grads_backward(dy, x, weight=None, bias=None, mean=None, rstd=None, eps=1e-5, *, impl="auto"):
    """layer_norm_backward's (dx, grads): grads the (2, hidden) array of dweight and dbias (a row without its
    parameter unused), None without either parameter."""
    plan, (d_ptr, x_ptr, w_ptr, b_ptr, m_ptr, r_ptr) = _backward_plans.find(
        (dy, x, weight, bias, mean, rstd), (weight is None, bias is None, mean is None, rstd is None, eps, impl))
    if mean is None and plan.grid:  # the forward's own statistics: the same bits as layer_norm's
        # (held until the launches: freed, their memory could be handed to dx or the partial sums the kernel writes)
        mean, rstd, (m_ptr, r_ptr) = _forward(x, weight, bias, eps, None, True, impl)[1:]  # y freed at once
    dx, dx_ptr = plan.new_dx(x)
    grads, grads_ptr = plan.new_params(weight if weight is not None else bias) if plan.new_params else (None, 0)
    if not plan.grid:
        if grads is not None and grads.size:
            grads[...] = 0
        return dx, grads
    partial, partial_ptr = plan.new_partial(x) if grads is not None else (None, 0)
    plan.launch(d_ptr, x_ptr, w_ptr, m_ptr, r_ptr, dx_ptr, partial_ptr)
    if grads is not None:
        plan.dw_launch(partial_ptr, grads_ptr)
    return dx, grads


# ------------------------------------------------------------------------------------------ planning


def _fwd_launch(plan, xa, n_rows, hidden, strides, eps):
    tail = FWD_TAIL.pack(n_rows, hidden, *strides, float(eps), 1 / hidden)
    return Launch(kernel_for(plan, xa.device), plan.grid, plan.block, 7, tail, xa.device, xa.kind)


def _plan_forward_call(xa, wa, ba, oa, mode, _no_weight, _no_bias, eps, return_stats, impl):
    layernorm_checks.check_forward(xa, wa, ba, oa, eps=eps, impl=impl)
    checks.check_bool(return_stats, "return_stats")
    if xa.size:
        ya = xa if mode == IN_PLACE else oa if mode == OUT else contiguous_like(xa, xa.shape, xa.dtype)
        n_rows, hidden = rows(xa.shape), xa.shape[-1]
        layout = row_layout([xa, ya], ["x", "out"], runs=False)
        plan = plan_forward(xa, ya, None, wa, ba, layout.plan_strides(), n_rows, hidden, impl,
                            choices=profiles.profile_for(xa.device).layer_norm)
        if mode == OUT:
            plan.out_layouts = checks.out_layouts(xa, oa)
        plan.launch = _fwd_launch(plan, xa, n_rows, hidden, layout.strides_of(0, 1, None), eps)
    else:
        plan = EmptyPlan()
    plan.new_output = allocator(xa, xa.shape, xa.dtype)
    plan.new_stat = allocator(xa, xa.shape[:-1], "float32") if return_stats else None
    return plan


def _plan_fused_add_call(xa, ra, wa, ba, _no_weight, _no_bias, eps, impl):
    layernorm_checks.check_fused_add(xa, ra, wa, ba, eps=eps, impl=impl)
    if not xa.size:
        return EmptyPlan()
    n_rows, hidden = rows(xa.shape), xa.shape[-1]
    layout = row_layout([xa, ra], ["x", "residual"], runs=False)
    strides = layout.plan_strides()
    plan = plan_forward(xa, xa, ra, wa, ba, (strides[0], strides[0], strides[1]), n_rows, hidden, impl,
                        choices=profiles.profile_for(xa.device).layer_norm)
    plan.launch = _fwd_launch(plan, xa, n_rows, hidden, layout.strides_of(0, 0, 1), eps)
    plan.extents = (checks.layout_key(xa), checks.layout_key(ra))
    return plan


def _plan_backward_call(da, xa, wa, ba, ma, ra, _no_weight, _no_bias, _no_mean, _no_rstd, eps, impl):
    layernorm_checks.check_backward(da, xa, wa, ba, ma, ra, eps=eps, impl=impl)
    n_rows, hidden = rows(xa.shape), xa.shape[-1]
    if xa.size:
        dxa = contiguous_like(xa, xa.shape, xa.dtype)
        layout = row_layout([da, xa, dxa], ["dy", "x", "dx"], runs=False)
        planning = (da, xa, dxa, wa, ba, layout.plan_strides(), n_rows, hidden, impl, shared_limit(xa.device))
        choices = profiles.profile_for(xa.device).layer_norm
        # rows unshifted; where no cluster fits, long rows are read in passes
        plan, kernel = fitted_to_device(lambda clusters: plan_backward(*planning, clusters=clusters, choices=choices),
                                        n_rows, xa.device, xa.dtype)
        slots = plan.grid // plan.split * plan.block[1]  # a split row's slot: its cluster (of one-row blocks)
        tail = BWD_TAIL.pack(n_rows, hidden, *layout.strides_of(0, 1, 2), slots, 1 / hidden, int(plan.shared_acc))
        plan.launch = Launch(kernel, plan.grid, plan.block, 7, tail, xa.device, xa.kind, plan.shared_mem)
        # a slot's partial rows of dweight and dbias, one row of 2 * hidden (none where neither is asked for)
        if wa is not None or ba is not None:
            dw_kernel = get_kernel(DW_SOURCE, dweight_kernel_name(weight_dtype(wa, ba)), xa.device)
            plan.dw_launch = Launch(dw_kernel, -(-2 * hidden // 32), (32, DW_SPLIT), 2,
                                    DW_TAIL.pack(slots, 2 * hidden), xa.device, xa.kind)
            plan.new_partial = allocator(xa, (slots, 2, hidden), "float32")
    else:
        plan = EmptyPlan()
    plan.new_dx = allocator(xa, xa.shape, xa.dtype)
    param = wa if wa is not None else ba
    plan.new_params = allocator(param, (2, hidden), param.dtype) if param is not None else None
    return plan


_forward_plans = OpPlans(("x", "weight", "bias", "out"), _plan_forward_call, optional=("weight", "bias", "out"))
_fused_add_plans = OpPlans(("x", "residual", "weight", "bias"), _plan_fused_add_call, optional=("weight", "bias"))
_backward_plans = OpPlans(("dy", "x", "weight", "bias", "mean", "rstd"), _plan_backward_call,
                          optional=("weight", "bias", "mean", "rstd"))
