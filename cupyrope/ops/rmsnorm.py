"""RMSNorm's public functions: rms_norm, fused_add_rms_norm, add_rms_norm and rms_norm_backward.

A call finds its plan (the one preamble: _runtime/plan_cache.py), which a first call makes by checking its
arguments (rmsnorm_checks.py) and planning (rmsnorm_plan_forward.py, rmsnorm_plan_backward.py), then launches with
its own pointers.
"""

import struct

from .._runtime import checks
from .._runtime.arrays import allocator, contiguous_like
from .._runtime.checks import IN_PLACE, OUT, output_mode
from .._runtime.compile import get_kernel
from .._runtime.device import sm_count
from .._runtime.launch import Launch
from .._runtime.plan_cache import EmptyPlan, OpPlans
from . import profiles, rmsnorm_checks
from .rmsnorm_checks import row_layout, rows
from .rmsnorm_plan_backward import DW_SPLIT, dweight_kernel_name, plan_backward_for_device
from .rmsnorm_plan_forward import plan_forward_for_device, row_cache_bytes
from .rmsnorm_rows import kernel_for, shared_limit

# Mirror NormParams, NormBwdParams and DweightParams in kernels_src: pointers, then these.
FWD_TAIL = struct.Struct("<6q3f")  # rows, hidden, four row strides, then _scalars()
BWD_TAIL = struct.Struct("<7q2f")  # rows, hidden, four row strides, shared_acc, offset, 1 / hidden
# The rms_norm_*_runs kernels' structs extend those: inner_rows and the outer strides of x and y (forward, after the
# padding to 8 bytes), of dy, x and dx (backward).
FWD_RUNS_TAIL = struct.Struct("<4x3q")
BWD_RUNS_TAIL = struct.Struct("<4q")
DW_TAIL = struct.Struct("<2q")


def _scalars(eps, offset, hidden) -> tuple[float, float, float]:
    """The float parameters that end the forward's struct: eps, offset, 1 / hidden."""
    return float(eps), float(offset), 1 / hidden


def rms_norm(x, weight=None, eps=1e-6, *, offset=0.0, out=None, return_rstd=False, impl="auto"):
    """y = x / sqrt(mean(x^2) + eps) * (weight + offset) over the last dimension of x (..., hidden).

    weight: (hidden,), float32 or x's dtype; None means no scale. offset=1.0 gives Gemma's (1 + w).
    Accumulates in fp32 and returns x's dtype. Returns y, or (y, rstd) with rstd fp32 of shape (...).
    out: where to write y (x's shape and dtype; out=x normalizes in place).
    """
    out, rstd, _ = _forward(x, weight, eps, offset, out, return_rstd, impl)
    return (out, rstd) if return_rstd else out


def _forward(x, weight, eps, offset, out, return_rstd, impl):
    """rms_norm's call: (y, rstd or None, rstd's pointer or 0)."""
    mode = output_mode(out, x)
    plan, (x_ptr, w_ptr, o_ptr) = _forward_plans.find(
        (x, weight, out if mode == OUT else None), (mode, weight is None, eps, offset, return_rstd, impl))
    out, o_ptr = checks.output_of(plan, mode, x, out, x_ptr, o_ptr)
    rstd, rstd_ptr = plan.new_rstd(x) if return_rstd else (None, 0)
    if plan.grid:
        plan.launch(x_ptr, o_ptr, 0, 0, w_ptr, rstd_ptr)
    return out, rstd, rstd_ptr


def fused_add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, impl="auto"):
    """vLLM's in-place fused residual add: residual <- x + residual (rounded to x's dtype), then
    x <- rms_norm(residual, weight, eps). Each tensor is read once and written once (rows over 64 KiB read
    the new residual a second time, mostly from the L2). Returns (x, residual)."""
    plan, (x_ptr, r_ptr, w_ptr) = _fused_add_plans.find((x, residual, weight), (weight is None, eps, offset, impl))
    if plan.grid:
        checks.check_disjoint(x_ptr, plan.extents[0], r_ptr, plan.extents[1], "x", "residual", "pass separate memory")
        plan.launch(x_ptr, x_ptr, r_ptr, r_ptr, w_ptr, 0)
    return x, residual


def add_rms_norm(x, residual, weight=None, eps=1e-6, *, offset=0.0, return_rstd=False, impl="auto"):
    """The out-of-place residual add + RMSNorm of training: s = x + residual (rounded to x's dtype), then
    y = rms_norm(s, weight, eps, offset=offset), in one launch that reads x and residual once and writes y and s.
    x and residual are left as they are. Returns (y, s), or (y, s, rstd) with return_rstd.

    Its backward is one call: rms_norm_backward(dy, s, weight, rstd, eps, offset, residual_grad=ds) (ds: the
    gradient reaching s, the residual stream's next use) returns the gradient of x, which is also residual's, and
    dweight."""
    plan, (x_ptr, r_ptr, w_ptr) = _add_plans.find((x, residual, weight), (weight is None, eps, offset, return_rstd, impl))
    y, y_ptr = plan.new_output(x)
    s, s_ptr = plan.new_output(x)
    rstd, rstd_ptr = plan.new_rstd(x) if return_rstd else (None, 0)
    if plan.grid:
        plan.launch(x_ptr, y_ptr, r_ptr, s_ptr, w_ptr, rstd_ptr)
    return (y, s, rstd) if return_rstd else (y, s)


def rms_norm_backward(dy, x, weight=None, rstd=None, eps=1e-6, offset=0.0, *, residual_grad=None, impl="auto"):
    """Gradients of rms_norm: returns (dx, dweight); dweight is None when weight is None.

    rstd (fp32, shape x.shape[:-1], as returned by rms_norm(..., return_rstd=True)): without it, rms_norm
    computes it first (a read of x and a write more), so that dx has the same bits either way. dweight is reduced
    in a fixed order: bitwise identical from run to run, no atomics.
    residual_grad (x's shape and dtype): added to dx before its rounding. add_rms_norm's backward: x is its s, and
    residual_grad the gradient reaching s besides through y; dx is then the gradient of add_rms_norm's x and of
    its residual."""
    plan, (d_ptr, x_ptr, w_ptr, r_ptr, g_ptr) = _backward_plans.find(
        (dy, x, weight, rstd, residual_grad), (weight is None, rstd is None, residual_grad is None, eps, offset, impl))
    if rstd is None:  # the forward's own sum of squares: the same rstd bits as rms_norm's
        # rstd held until the launches (freed, its memory could be handed to the partial sums the kernel writes); the
        # forward's y freed at once (an x-sized block the call has no use for)
        rstd, r_ptr = _forward(x, weight, eps, offset, None, True, impl)[1:]
    dx, dx_ptr = plan.new_dx(x)
    dweight, dweight_ptr = plan.new_dweight(weight) if weight is not None else (None, 0)
    if not plan.grid:
        if dweight is not None and len(dweight):
            dweight[...] = 0
        return dx, dweight
    if weight is None:
        plan.launch(d_ptr, x_ptr, 0, r_ptr, dx_ptr, 0, g_ptr)
        return dx, None
    if plan.one_cluster:  # its partial row is dweight
        plan.launch(d_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, dweight_ptr, g_ptr)
        return dx, dweight
    partial, partial_ptr = plan.new_partial(x)
    plan.launch(d_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, partial_ptr, g_ptr)
    plan.dw_launch(partial_ptr, dweight_ptr)
    return dx, dweight


# ------------------------------------------------------------------------------------------ planning


def _plan_forward_call(xa, wa, oa, mode, _no_weight, eps, offset, return_rstd, impl):
    rmsnorm_checks.check_forward(xa, wa, oa, eps=eps, offset=offset, impl=impl)
    checks.check_bool(return_rstd, "return_rstd")
    if xa.size:
        ya = xa if mode == IN_PLACE else oa if mode == OUT else contiguous_like(xa, xa.shape, xa.dtype)
        n_rows, hidden = rows(xa.shape), xa.shape[-1]
        layout = row_layout([xa, ya], ["x", "out"])
        plan = plan_forward_for_device(xa, ya, None, wa, layout.plan_strides(), n_rows, hidden, impl, xa.device,
                                      profiles.profile_for(xa.device).rms_norm_forward, runs=layout.inner_rows > 0)
        if mode == OUT:
            plan.out_layouts = checks.out_layouts(xa, oa)
        tail = FWD_TAIL.pack(n_rows, hidden, *layout.strides_of(0, 1, None, None), *_scalars(eps, offset, hidden))
        if layout.inner_rows:
            tail += FWD_RUNS_TAIL.pack(*layout.runs_of(0, 1))
        plan.launch = Launch(kernel_for(plan, xa.device), plan.grid, plan.block, 6, tail, xa.device, xa.kind,
                             plan.shared_mem)
    else:
        plan = EmptyPlan()
    plan.new_output = allocator(xa, xa.shape, xa.dtype)
    plan.new_rstd = allocator(xa, xa.shape[:-1], "float32") if return_rstd else None
    return plan


def _plan_add_kernel(xa, ya, ra, sa, wa, eps, offset, impl) -> object:
    """The plan of a residual add + RMSNorm launch (rms_norm_fwd's ADD): x and residual in, y and s = x + residual
    out; in place (fused_add_rms_norm) ya is xa and sa None: the sum goes into residual."""
    n_rows, hidden = rows(xa.shape), xa.shape[-1]
    arrays = [xa, ya, ra] + ([] if sa is None else [sa])
    layout = row_layout(arrays, ["x", "y", "residual", "s"], runs=False)
    choices = profiles.profile_for(xa.device).rms_norm_forward
    plan = plan_forward_for_device(xa, ya, ra, wa, layout.plan_strides(), n_rows, hidden, impl, xa.device, choices,
                                  residual_out=sa)
    plan.shared_mem = row_cache_bytes(plan, hidden, xa.dtype, shared_limit(xa.device), choices)
    strides = layout.strides_of(0, 1, 2, 2 if sa is None else 3)
    tail = FWD_TAIL.pack(n_rows, hidden, *strides, *_scalars(eps, offset, hidden))
    plan.launch = Launch(kernel_for(plan, xa.device), plan.grid, plan.block, 6, tail, xa.device, xa.kind,
                         plan.shared_mem)
    return plan


def _plan_fused_add_call(xa, ra, wa, _no_weight, eps, offset, impl):
    rmsnorm_checks.check_fused_add(xa, ra, wa, eps=eps, offset=offset, impl=impl)
    if not xa.size:
        return EmptyPlan()
    plan = _plan_add_kernel(xa, xa, ra, None, wa, eps, offset, impl)
    plan.extents = (checks.layout_key(xa), checks.layout_key(ra))
    return plan


def _plan_add_call(xa, ra, wa, _no_weight, eps, offset, return_rstd, impl):
    rmsnorm_checks.check_add(xa, ra, wa, eps=eps, offset=offset, impl=impl)
    checks.check_bool(return_rstd, "return_rstd")
    if xa.size:
        new = contiguous_like(xa, xa.shape, xa.dtype)
        plan = _plan_add_kernel(xa, new, ra, new, wa, eps, offset, impl)
    else:
        plan = EmptyPlan()
    plan.new_output = allocator(xa, xa.shape, xa.dtype)
    plan.new_rstd = allocator(xa, xa.shape[:-1], "float32") if return_rstd else None
    return plan


def _plan_backward_call(da, xa, wa, ra, ga, _no_weight, _no_rstd, _no_residual_grad, eps, offset, impl):
    rmsnorm_checks.check_backward(da, xa, wa, ra, eps=eps, offset=offset, impl=impl, residual_grad=ga)
    n_rows, hidden = rows(xa.shape), xa.shape[-1]
    if xa.size:
        dxa = contiguous_like(xa, xa.shape, xa.dtype)
        grads = [] if ga is None else [ga]
        layout = row_layout([da, xa, dxa, *grads], ["dy", "x", "dx", "residual_grad"], runs=not grads)
        plan, kernel = plan_backward_for_device(da, xa, dxa, wa, layout.plan_strides(), n_rows, hidden,
                                                sm_count(xa.device), impl,
                                                shared_limit(xa.device), xa.device,
                                                profiles.profile_for(xa.device).rms_norm_backward, residual_grad=ga,
                                                runs=layout.inner_rows > 0)
        tail = BWD_TAIL.pack(n_rows, hidden, *layout.strides_of(0, 1, 2, 3 if grads else None),
                             int(plan.shared_acc), float(offset), 1 / hidden)
        if layout.inner_rows:
            tail += BWD_RUNS_TAIL.pack(*layout.runs_of(0, 1, 2))
        plan.launch = Launch(kernel, plan.grid, plan.block, 7, tail, xa.device, xa.kind, plan.shared_mem)
        if wa is not None and not plan.one_cluster:
            partials = plan.grid // plan.split  # one partial row a block, or a cluster
            dw_kernel = get_kernel(plan.source, dweight_kernel_name(wa.dtype), xa.device)
            plan.dw_launch = Launch(dw_kernel, -(-hidden // 32), (32, DW_SPLIT), 2, DW_TAIL.pack(partials, hidden),
                                    xa.device, xa.kind)
            plan.new_partial = allocator(xa, (partials, hidden), "float32")
    else:
        plan = EmptyPlan()
    plan.new_dx = allocator(xa, xa.shape, xa.dtype)
    # Like the weight (its shape and dtype): torch's empty_like, the cheapest allocation.
    plan.new_dweight = allocator(wa, (hidden,), wa.dtype) if wa is not None else None
    return plan


_forward_plans = OpPlans(("x", "weight", "out"), _plan_forward_call, optional=("weight", "out"))
_fused_add_plans = OpPlans(("x", "residual", "weight"), _plan_fused_add_call, optional=("weight",))
_add_plans = OpPlans(("x", "residual", "weight"), _plan_add_call, optional=("weight",))
_backward_plans = OpPlans(("dy", "x", "weight", "rstd", "residual_grad"), _plan_backward_call,
                          optional=("weight", "rstd", "residual_grad"))
