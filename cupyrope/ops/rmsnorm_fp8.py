"""RMSNorm with an FP8 output's public function: rms_norm_fp8.

A call finds its plan (the one preamble: _runtime/plan_cache.py), which a first call makes by checking its
arguments (rmsnorm_checks.check_fp8) and planning (rmsnorm_plan_fp8.py), then launches with its own pointers.
"""

import struct

from .._runtime import checks
from .._runtime.arrays import FP8_DTYPES, allocator, contiguous_like
from .._runtime.launch import Launch
from .._runtime.plan_cache import EmptyPlan, OpPlans
from . import profiles, rmsnorm_checks
from .rmsnorm import _scalars
from .rmsnorm_checks import row_layout, rows
from .rmsnorm_plan_backward import cap_grid
from .rmsnorm_plan_fp8 import TOKEN_SCALE, kernel_group, plan_fp8, walks_rows
from .rmsnorm_rows import blocks_per_wave, kernel_for

# Mirrors Fp8NormParams in kernels_src/rmsnorm_fp8.cu: its 7 pointers, then rows, hidden, three row strides, eps,
# offset, 1 / hidden.
FP8_POINTERS = 7
FP8_TAIL = struct.Struct("<5q3f")


def rms_norm_fp8(x, weight=None, eps=1e-6, *, scale=None, group_size=None, residual=None, offset=0.0, scale_ub=None,
                 out=None, impl="auto"):
    """RMSNorm over the last dimension of x (..., hidden), quantized to FP8 e4m3fn in the same launch: the fp32
    value v = x / sqrt(mean(x^2) + eps) * (weight + offset) becomes saturate(v / scale), rounded once to nearest
    even (+-Inf and values past +-448 saturate to +-448; NaN stays NaN).

    The output y has x's shape: a torch.float8_e4m3fn tensor for torch input; for CuPy (which has no FP8 dtype) a
    uint8 array holding the same bytes.
    - scale (a float32 device array of one value): static quantization; returns y.
    - no scale: dynamic quantization, returns (y, scales), float32:
      - group_size None: one scale a row (shape x.shape[:-1]): max |v| over the row / 448;
      - group_size 64 or 128 (dividing hidden): one per group of that many columns, shape
        (*x.shape[:-1], hidden / group_size), DeepSeek-V3's block layout.
      scale_ub (a float32 device array of one value) bounds the maximum a scale is computed from, as vLLM's; a
      scale is at least 1 / (448 * 512), so that zeros stay zeros.
    residual (x's shape and dtype): the fused add first, in place: residual <- x + residual (rounded to x's dtype),
    and that is normalized (fused_add_rms_norm's semantics). x is left as it is.
    out: where to write y (x's shape, the FP8 dtype above)."""
    plan, (x_ptr, w_ptr, r_ptr, s_ptr, u_ptr, o_ptr) = _plans.find(
        (x, weight, residual, scale, scale_ub, out),
        (weight is None, residual is None, scale is None, scale_ub is None, out is None, group_size, eps, offset,
         impl))
    y, y_ptr = plan.new_output(x) if out is None else (out, o_ptr)
    scales, scales_ptr = plan.new_scales(x) if scale is None else (None, 0)
    if plan.grid:
        if residual is not None:
            checks.check_disjoint(x_ptr, plan.extents[0], r_ptr, plan.extents[1], "x", "residual",
                                  "pass separate memory")
        if out is not None:
            for ptr, extent, name in ((x_ptr, plan.extents[0], "x"), (r_ptr, plan.extents[1], "residual")):
                checks.check_disjoint(ptr, extent, o_ptr, plan.extents[2], name, "out", "pass separate memory")
        plan.launch(x_ptr, y_ptr, r_ptr, w_ptr, s_ptr, scales_ptr, u_ptr)
    return y if scale is not None else (y, scales)


def _plan_call(xa, wa, ra, sa, ua, oa, _no_weight, _no_residual, _no_scale, _no_scale_ub, _no_out, group_size, eps,
               offset, impl):
    rmsnorm_checks.check_fp8(xa, wa, ra, sa, ua, oa, group_size=group_size, eps=eps, offset=offset, impl=impl)
    fp8 = FP8_DTYPES[xa.kind]
    group = kernel_group(sa is not None, group_size)
    hidden = xa.shape[-1]
    lead = xa.shape[:-1]
    scales_shape = (*lead, hidden // group) if group > TOKEN_SCALE else lead
    if xa.size:
        ya = oa if oa is not None else contiguous_like(xa, xa.shape, fp8)
        arrays, names = [xa, ya], ["x", "out"]
        if ra is not None:
            arrays, names = [*arrays, ra], [*names, "residual"]
        layout = row_layout(arrays, names, runs=False)
        n_rows = rows(xa.shape)
        strides = layout.strides_of(0, 1, None if ra is None else 2)  # x, y, residual (0: none)
        plan = plan_fp8(xa, ya, ra, wa, strides, n_rows, hidden, group, impl,
                        choices=profiles.profile_for(xa.device).rms_norm_forward)
        tail = FP8_TAIL.pack(n_rows, hidden, *strides, *_scalars(eps, offset, hidden))
        kernel = kernel_for(plan, xa.device)
        if walks_rows(plan, ra):  # a block walks rows: as many as the GPU holds at once
            plan.grid = cap_grid(plan, blocks_per_wave(kernel, plan, xa.device), n_rows, xa.dtype)
        plan.launch = Launch(kernel, plan.grid, plan.block, FP8_POINTERS, tail, xa.device, xa.kind)
        plan.extents = tuple(None if a is None else checks.layout_key(a) for a in (xa, ra, oa))
    else:
        plan = EmptyPlan()
    plan.new_output = allocator(xa, xa.shape, fp8)
    plan.new_scales = allocator(xa, scales_shape, "float32") if sa is None else None
    return plan


_plans = OpPlans(("x", "weight", "residual", "scale", "scale_ub", "out"), _plan_call,
                 optional=("weight", "residual", "scale", "scale_ub", "out"))
