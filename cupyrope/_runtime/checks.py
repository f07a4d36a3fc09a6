"""Argument checks the ops share, on Array descriptions (so the GPU path, the torch layer's CPU path and the
references raise the same errors), and the overlap geometry of arrays that a kernel reads and writes.

Errors are TypeError (kind, dtype) or ValueError (shape, value) and name the argument, what was expected and
what was received. Nothing here reads device memory.
"""

import math
import numbers

from .arrays import FLOAT_DTYPES, Array, merge_dims

IMPLS = ("auto", "scalar", "vector")


# ------------------------------------------------------------------------------------------- values


def check_choice(value, name: str, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def check_impl(impl) -> None:
    check_choice(impl, "impl", IMPLS)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive(value, name: str) -> None:
    """A finite number > 0 (eps, theta)."""
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")


def check_finite(value, name: str) -> None:
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")


def check_bool(value, name: str) -> None:
    if not isinstance(value, bool) and type(value).__name__ != "bool_":  # NumPy's bool too
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------- arrays


def check_same_device(a: Array, b: Array, name_a: str, name_b: str) -> None:
    if a.device != b.device or a.kind != b.kind:
        raise ValueError(f"{name_b}: expected a {a.kind} array on {a.where} like {name_a}, "
                         f"got a {b.kind} array on {b.where}")


def check_dtype(array: Array, name: str, allowed) -> None:
    if array.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype in {tuple(allowed)}, got {array.dtype}")


def check_last_dim_contiguous(array: Array, name: str) -> None:
    if array.shape and array.shape[-1] > 1 and array.strides[-1] != 1 and 0 not in array.shape:
        raise ValueError(
            f"{name}: expected the last dimension to be contiguous (stride 1), got strides "
            f"{array.strides}; pass {name}.contiguous() or a view with a unit last stride"
        )


def check_float_input(array: Array, name: str, last_dim: str, dtypes=FLOAT_DTYPES) -> None:
    """A (..., last_dim) array of one of ``dtypes`` with a contiguous last dimension."""
    check_dtype(array, name, dtypes)
    if len(array.shape) < 1:
        raise ValueError(f"{name}: expected shape (..., {last_dim}), got a 0-d array")
    check_last_dim_contiguous(array, name)


def check_like(a: Array, like: Array, like_name: str, name: str, dtype=None) -> None:
    """``a`` on ``like``'s device, with its shape and dtype (or ``dtype``) and a contiguous last dimension."""
    check_same_device(like, a, like_name, name)
    expected = dtype or like.dtype
    if a.dtype != expected:
        raise TypeError(f"{name}: expected dtype {expected} (like {like_name}), got {a.dtype}")
    if a.shape != like.shape:
        raise ValueError(f"{name}: expected shape {like.shape} (like {like_name}), got {a.shape}")
    check_last_dim_contiguous(a, name)


# ---------------------------------------------------------------------------------------- overlaps


def extent(array: Array) -> tuple[int, int]:
    """[low, high) byte offsets, relative to ptr, that the array's elements occupy."""
    low = sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s > 0)
    return low * array.itemsize, (high + 1) * array.itemsize


def row_extent(array: Array):
    """(row stride in bytes, rows, extent of one row): lets interleaved views of one buffer (q and k as column
    slices of a fused qkv tensor, (T, H, D) or (B, S, H, D)) be told apart from overlapping ones. The rows are the
    most leading dimensions that form one evenly strided run."""
    dims = [(n, (s,)) for n, s in zip(array.shape, array.strides) if n != 1]
    for k in range(len(dims) - 1, 0, -1):
        run = merge_dims(dims[:k])
        if len(run) == 1 and run[0][0] >= 2:
            rest = dims[k:]
            inner = Array(None, array.kind, 0, array.dtype, [n for n, _ in rest], [s for _, (s,) in rest],
                          array.device)
            return run[0][1][0] * array.itemsize, run[0][0], extent(inner)
    return None


def layout_key(array: Array):
    """What check_disjoint needs about an array, computed once per plan (None: no elements)."""
    return (extent(array), row_extent(array)) if array.size else None


def check_disjoint(a_ptr: int, a_layout, b_ptr: int, b_layout, name_a: str, name_b: str, hint: str) -> None:
    """Raise unless a and b provably share no element: their byte ranges are disjoint, or both are
    row-interleaved with the same row stride and disjoint ranges within a row."""
    if a_layout is None or b_layout is None:
        return
    (a_lo, a_hi), a_rows = a_layout
    (b_lo, b_hi), b_rows = b_layout
    if not (a_ptr + a_lo < b_ptr + b_hi and b_ptr + b_lo < a_ptr + a_hi):
        return
    if a_rows and b_rows and a_rows[0] == b_rows[0] and a_rows[0] > 0:
        stride = a_rows[0]
        shift = (b_ptr - a_ptr) % stride  # where b's rows start within a's rows
        (ra_lo, ra_hi), (rb_lo, rb_hi) = a_rows[2], b_rows[2]
        if ra_lo >= 0 and rb_lo >= 0 and ra_hi <= stride and rb_hi <= stride:
            b_start, b_end = shift + rb_lo, shift + rb_hi
            if (ra_hi <= b_start and b_end <= stride + ra_lo) or (b_end <= stride and ra_hi <= b_start):
                return
    raise ValueError(f"{name_b}: overlaps {name_a} in memory; {hint}")


def check_not_overlapping(a: Array, b: Array, name_a: str, name_b: str, same_allowed: bool = False) -> None:
    """Distinct arrays must not share memory (a kernel would read what another thread wrote);
    ``same_allowed``: b may be exactly a (in place)."""
    if same_allowed and a.ptr == b.ptr and a.strides == b.strides and a.shape == b.shape:
        return
    hint = f"pass {name_b}={name_a} (in place) or separate memory" if same_allowed else "pass separate memory"
    check_disjoint(a.ptr, layout_key(a), b.ptr, layout_key(b), name_a, name_b, hint)


# How a call returns its result: a new array, in its input(s), or in arrays the caller passed.
NEW, IN_PLACE, OUT = "new", "in place", "out"


def output_mode(out, x) -> str:
    """How a one-output call returns: out None, a new array; out x, in place; else the caller's out. (rope writes
    this expression out: it runs before its plan lookup on every call.)"""
    return NEW if out is None else IN_PLACE if out is x else OUT


def out_layouts(x: Array, out: Array):
    """What check_out_per_call needs, computed once per plan: both layouts and whether the strides are equal."""
    return layout_key(x), layout_key(out), x.strides == out.strides


def output_of(plan, mode: str, x, out, x_ptr: int, out_ptr: int):
    """The array a one-output call writes and its pointer: a new one (mode NEW), x itself (IN_PLACE), or the
    caller's out, checked against x on every call that launches (OUT)."""
    if mode == NEW:
        return plan.new_output(x)
    if mode == IN_PLACE:
        return x, x_ptr
    if plan.grid:
        check_out_per_call(plan, x_ptr, out_ptr)
    return out, out_ptr


def check_out_per_call(plan, x_ptr: int, out_ptr: int) -> None:
    """A caller's ``out`` at x's own address with x's own strides is x (in place); otherwise it must not overlap x
    (checked per call, with the layouts the plan computed once: pointers change between calls of one plan)."""
    if out_ptr == x_ptr and plan.out_layouts[2]:
        return
    check_disjoint(x_ptr, plan.out_layouts[0], out_ptr, plan.out_layouts[1], "x", "out",
                   "pass out=x (in place) or separate memory")
