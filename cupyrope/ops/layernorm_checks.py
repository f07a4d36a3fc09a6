"""LayerNorm's argument checks, on Array descriptions: the GPU path, the torch layer's CPU path and the references
run the same ones and raise the same errors. Weight and bias are checked as RMSNorm's weight is."""

from .._runtime import checks
from .._runtime.arrays import FLOAT_DTYPES, Array
from .rmsnorm_checks import check_row_stat, check_weight


def check_options(eps, impl) -> None:
    checks.check_positive(eps, "eps")
    checks.check_impl(impl)


def check_params(x: Array, weight: Array | None, bias: Array | None) -> None:
    """weight and bias: (hidden,), float32 or x's dtype, one dtype where both are given (the kernels read them as
    one type)."""
    check_weight(weight, x, "x")
    check_weight(bias, x, "x", "bias")
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(f"bias: expected dtype {weight.dtype} (like weight), got {bias.dtype}")


def check_forward(x: Array, weight: Array | None, bias: Array | None, out: Array | None, *, eps, impl,
                  dtypes=FLOAT_DTYPES) -> None:
    """Every check of a layer_norm() call."""
    check_options(eps, impl)
    checks.check_float_input(x, "x", "hidden", dtypes)
    check_params(x, weight, bias)
    if out is not None:
        checks.check_like(out, x, "x", "out")
        checks.check_not_overlapping(x, out, "x", "out", same_allowed=True)


def check_fused_add(x: Array, residual: Array, weight: Array | None, bias: Array | None, *, eps, impl,
                    dtypes=FLOAT_DTYPES) -> None:
    """Every check of a fused_add_layer_norm() call."""
    check_options(eps, impl)
    checks.check_float_input(x, "x", "hidden", dtypes)
    checks.check_like(residual, x, "x", "residual")
    checks.check_not_overlapping(x, residual, "x", "residual")
    check_params(x, weight, bias)


def check_backward(dy: Array, x: Array, weight: Array | None, bias: Array | None, mean: Array | None,
                   rstd: Array | None, *, eps, impl, dtypes=FLOAT_DTYPES) -> None:
    """Every check of a layer_norm_backward() call."""
    check_options(eps, impl)
    checks.check_float_input(x, "x", "hidden", dtypes)
    checks.check_like(dy, x, "x", "dy")
    check_params(x, weight, bias)
    if (mean is None) != (rstd is None):
        raise ValueError("mean, rstd: expected both (layer_norm(..., return_stats=True)'s) or neither, got "
                         f"{'mean' if rstd is None else 'rstd'} alone")
    if mean is not None:
        check_row_stat(mean, x, "mean")
        check_row_stat(rstd, x, "rstd")
