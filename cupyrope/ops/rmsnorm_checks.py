"""RMSNorm's argument checks, on Array descriptions: the GPU path, the torch layer's CPU path and the references
run the same ones and raise the same errors."""

import math

from .._runtime import checks
from .._runtime.arrays import FLOAT_DTYPES, FP8_DTYPES, Array, is_contiguous, merged_rows
from .rmsnorm_plan_fp8 import GROUP_SIZES


def check_options(eps, offset, impl) -> None:
    checks.check_positive(eps, "eps")
    checks.check_finite(offset, "offset")
    checks.check_impl(impl)


def check_weight(weight: Array | None, like: Array, like_name: str, name: str = "weight") -> None:
    """A per-column parameter (a norm's weight, LayerNorm's bias): (hidden,), float32 or like's dtype."""
    if weight is None:
        return
    checks.check_same_device(like, weight, like_name, name)
    if weight.dtype not in ("float32", like.dtype):
        raise TypeError(f"{name}: expected dtype float32 or {like.dtype} (like {like_name}), got {weight.dtype}")
    if weight.shape != (like.shape[-1],):
        raise ValueError(f"{name}: expected shape ({like.shape[-1]},) (the hidden size of {like_name}), got "
                         f"{weight.shape}")
    checks.check_last_dim_contiguous(weight, name)


def check_forward(x: Array, weight: Array | None, out: Array | None, *, eps, offset, impl,
                  dtypes=FLOAT_DTYPES) -> None:
    """Every check of an rms_norm() call."""
    check_options(eps, offset, impl)
    checks.check_float_input(x, "x", "hidden", dtypes)
    check_weight(weight, x, "x")
    if out is not None:
        checks.check_like(out, x, "x", "out")
        checks.check_not_overlapping(x, out, "x", "out", same_allowed=True)


def check_fused_add(x: Array, residual: Array, weight: Array | None, *, eps, offset, impl,
                    dtypes=FLOAT_DTYPES) -> None:
    """Every check of a fused_add_rms_norm() call."""
    check_options(eps, offset, impl)
    checks.check_float_input(x, "x", "hidden", dtypes)
    checks.check_like(residual, x, "x", "residual")
    checks.check_not_overlapping(x, residual, "x", "residual")
    check_weight(weight, x, "x")


def check_add(x: Array, residual: Array, weight: Array | None, *, eps, offset, impl, dtypes=FLOAT_DTYPES) -> None:
    """Every check of an add_rms_norm() call (out of place: x and residual are only read, and may overlap)."""
    check_options(eps, offset, impl)
    checks.check_float_input(x, "x", "hidden", dtypes)
    checks.check_like(residual, x, "x", "residual")
    check_weight(weight, x, "x")


def check_backward(dy: Array, x: Array, weight: Array | None, rstd: Array | None, *, eps, offset, impl,
                   dtypes=FLOAT_DTYPES, residual_grad: Array | None = None) -> None:
    """Every check of an rms_norm_backward() call."""
    check_options(eps, offset, impl)
    checks.check_float_input(x, "x", "hidden", dtypes)
    checks.check_like(dy, x, "x", "dy")
    if residual_grad is not None:
        checks.check_like(residual_grad, x, "x", "residual_grad")
    check_weight(weight, x, "x")
    if rstd is not None:
        check_row_stat(rstd, x, "rstd")


def check_row_stat(stat: Array, x: Array, name: str) -> None:
    """A forward's statistic (rstd; LayerNorm's mean too): float32, one value per row of x, contiguous."""
    checks.check_same_device(x, stat, "x", name)
    if stat.dtype != "float32":
        raise TypeError(f"{name}: expected dtype float32, got {stat.dtype}")
    if stat.shape != x.shape[:-1]:
        raise ValueError(f"{name}: expected shape {x.shape[:-1]} (x's rows), got {stat.shape}")
    if not is_contiguous(stat) and stat.size > 1:
        raise ValueError(f"{name}: expected a contiguous array, got strides {stat.strides}")


def check_scalar_scale(scale: Array | None, like: Array, name: str, dtype: str = "float32") -> None:
    """A one-element array of `dtype` on x's device (read by the kernel: never by the host)."""
    if scale is None:
        return
    checks.check_same_device(like, scale, "x", name)
    if scale.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {scale.dtype}")
    if scale.size != 1 or len(scale.shape) > 1:
        raise ValueError(f"{name}: expected one value, shape () or (1,), got shape {scale.shape}")


def check_fp8(x: Array, weight: Array | None, residual: Array | None, scale: Array | None, scale_ub: Array | None,
              out: Array | None, *, group_size, eps, offset, impl, dtypes=FLOAT_DTYPES, scale_dtype="float32") -> None:
    """Every check of an rms_norm_fp8() call (the references' scales are float64: scale_dtype)."""
    check_options(eps, offset, impl)
    checks.check_float_input(x, "x", "hidden", dtypes)
    check_weight(weight, x, "x")
    if residual is not None:
        checks.check_like(residual, x, "x", "residual")
        checks.check_not_overlapping(x, residual, "x", "residual")
    check_scalar_scale(scale, x, "scale", scale_dtype)
    check_scalar_scale(scale_ub, x, "scale_ub", scale_dtype)
    if group_size is not None:
        if not checks.is_int(group_size) or group_size not in GROUP_SIZES:
            raise ValueError(f"group_size: expected None or one of {GROUP_SIZES}, got {group_size!r}")
        if x.shape[-1] % group_size:
            raise ValueError(f"group_size: expected a divisor of x's hidden size {x.shape[-1]}, got {group_size}")
    if scale is not None and group_size is not None:
        raise ValueError("group_size: per-group scales are dynamic; pass scale=None (a static scale is one "
                         "for the whole tensor)")
    if scale is not None and scale_ub is not None:
        raise ValueError("scale_ub: bounds dynamic scales only; pass scale_ub=None with a static scale")
    if out is not None:
        checks.check_like(out, x, "x", "out", dtype=FP8_DTYPES[x.kind])
        for other, name in ((x, "x"), (residual, "residual")):
            if other is not None:
                checks.check_not_overlapping(other, out, name, "out")


class RowLayout:
    """Where the rows of a call's arrays lie: one evenly strided run (inner_rows 0), or runs of inner_rows rows, as
    q's heads (tokens, heads, head_dim) inside a fused qkv tensor. strides: each array's between neighbouring rows of
    a run; outer: between runs (0s for one run). The kernels' strides and, for rows in runs, the rms_norm_*_runs
    kernels' parameters (row_in_runs)."""

    __slots__ = ("strides", "outer", "inner_rows")

    def __init__(self, strides, outer, inner_rows):
        self.strides, self.outer, self.inner_rows = tuple(strides), tuple(outer), inner_rows

    def strides_of(self, *which) -> tuple:
        """The strides of the arrays named by index in which (0 for None): the kernels' row strides."""
        return tuple(0 if i is None else self.strides[i] for i in which)

    def runs_of(self, *which) -> tuple:
        """inner_rows, then the outer strides of the arrays named by index in which (0 for None): the kernels' RUNS
        parameters."""
        return (self.inner_rows, *(0 if i is None else self.outer[i] for i in which))

    def plan_strides(self) -> tuple:
        """The row strides the row planner's alignment checks see (rmsnorm_rows.vectorizable, shiftable): each
        array's stride, or with runs the gcd of its two (a multiple of 16 bytes exactly when both are) and a 0, so
        that shifted rows need every row at the first row's offset from a 16-byte boundary (rms_norm_bwd takes a
        thread's shift once)."""
        if not self.inner_rows:
            return self.strides
        return (*(math.gcd(s, o) for s, o in zip(self.strides, self.outer)), 0)


def row_layout(arrays, names, runs=True) -> RowLayout:
    """The RowLayout of arrays' rows (all dimensions but the last), or a ValueError where they need more than two
    levels of strides (runs: rms_norm and rms_norm_backward), or more than one (the fused adds, FP8)."""
    merged = merged_rows(arrays[0].shape, [a.strides for a in arrays])
    if len(merged) > (2 if runs else 1):
        where = ("lie in evenly strided runs, evenly strided (such as the (tokens, heads) of a fused qkv tensor's q)"
                 if runs else "be evenly strided")
        raise ValueError(f"{names[0]}: its rows (all dimensions but the last) must {where}, got strides "
                         f"{arrays[0].strides} for shape {arrays[0].shape}; pass a contiguous array")
    if len(merged) == 2:
        (n_runs, outer), (inner_rows, strides) = merged
        if n_runs * inner_rows >= 2**32:
            raise ValueError(f"{names[0]}: rows in runs (strides {arrays[0].strides}) must number below 2^32, got "
                             f"{n_runs * inner_rows}; pass a contiguous array")
        return RowLayout(strides, outer, inner_rows)
    strides = merged[0][1] if merged else tuple(arrays[0].shape[-1] for _ in arrays)
    return RowLayout(strides, (0,) * len(arrays), 0)


def rows(shape) -> int:
    return math.prod(shape[:-1])
