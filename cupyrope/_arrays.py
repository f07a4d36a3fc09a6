"""CuPy arrays and torch tensors in; pointer, dtype, shape, strides, device and stream out.

Nothing here copies data or synchronizes. Results are allocated by the caller's library (torch's
caching allocator for torch inputs, so CUDA-graph capture and torch's memory accounting keep working).
"""

import sys
from collections import defaultdict

from ._cupy import import_cupy
from ._recall import RecentCalls

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "int64")
IMPLS = ("auto", "scalar", "vector")
CTYPE = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int", "int64": "long long"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "float64": 8}

_TORCH_DTYPE_NAMES: dict = {}


class Array:
    """What a launcher needs to know about one CuPy array or torch tensor."""

    __slots__ = ("obj", "kind", "ptr", "dtype", "shape", "strides", "device")

    def __init__(self, obj, kind, ptr, dtype, shape, strides, device):
        self.obj = obj
        self.kind = kind  # "cupy" or "torch"
        self.ptr = ptr
        self.dtype = dtype  # canonical name: "float32", "bfloat16", "int64", ...
        self.shape = shape
        self.strides = strides  # in elements
        self.device = device

    @property
    def itemsize(self) -> int:
        return ITEMSIZE.get(self.dtype, 0)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _torch_dtype_name(dtype) -> str:
    name = _TORCH_DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        _TORCH_DTYPE_NAMES[dtype] = name
    return name


def _is_torch_tensor(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


_TORCH_TYPES: set = set()  # tensor classes seen already: the hot path skips the module checks
_CUPY_TYPES: set = set()


def _from_torch(obj) -> Array:
    return Array(obj, "torch", obj.data_ptr(), _torch_dtype_name(obj.dtype), obj.shape, obj.stride(), obj.get_device())


def _from_cupy(obj) -> Array:
    itemsize = obj.itemsize
    return Array(obj, "cupy", obj.data.ptr, obj.dtype.name, obj.shape, tuple(s // itemsize for s in obj.strides),
                 obj.device.id)


def describe(obj, name: str) -> Array:
    """Describe ``obj`` (the argument called ``name``) or raise a TypeError saying what to pass."""
    cls = type(obj)
    if cls in _TORCH_TYPES and obj.is_cuda:
        return _from_torch(obj)
    if cls in _CUPY_TYPES:
        return _from_cupy(obj)
    module = cls.__module__
    if module.startswith("cupy") and hasattr(obj, "data") and hasattr(obj, "device"):
        _CUPY_TYPES.add(cls)
        return _from_cupy(obj)
    if _is_torch_tensor(obj):
        if obj.device.type != "cuda":
            raise TypeError(
                f"{name}: expected a CUDA tensor, got a tensor on {obj.device}; move it with "
                f"{name}.cuda() (cupyrope runs on the GPU only)"
            )
        _TORCH_TYPES.add(cls)
        return _from_torch(obj)
    if module == "numpy":
        raise TypeError(
            f"{name}: expected a cupy.ndarray or a CUDA torch.Tensor, got a NumPy array; move it to "
            f"the GPU with cupy.asarray({name}) (cupyrope runs on the GPU only; for a CPU "
            "answer use cupyrope.reference)"
        )
    raise TypeError(f"{name}: expected a cupy.ndarray or a CUDA torch.Tensor, got {cls.__name__}")


def fingerprint(obj, name: str):
    """(key, pointer) of ``obj`` (the argument called ``name``). The key holds everything a plan depends
    on -- type, dtype, shape, strides, device and 16-byte alignment -- and costs a few attribute reads,
    so every call can afford it. An object of a type not seen yet goes through describe() first, which
    raises for what cupyrope cannot take. A CPU (or meta) tensor's get_device() is -1, a key no plan
    has: plans are made only after describe() accepted every array. (get_device() is ~0.3 µs cheaper
    than .device; a torch build has one accelerator backend, so a device index means a CUDA device.)"""
    cls = type(obj)
    if cls in _TORCH_TYPES:
        ptr = obj.data_ptr()
        return (cls, obj.dtype, obj.shape, obj.stride(), obj.get_device(), ptr & 15), ptr
    if cls in _CUPY_TYPES:
        data = obj.data
        ptr = data.ptr
        return (cls, obj.dtype, obj.shape, obj.strides, data.device_id, ptr & 15), ptr
    describe(obj, name)
    return fingerprint(obj, name)


def fingerprint_optional(obj, name: str):
    """fingerprint() of an optional argument; (None, 0) when it is None."""
    return (None, 0) if obj is None else fingerprint(obj, name)


def describe_optional(obj, name: str) -> Array | None:
    return None if obj is None else describe(obj, name)


class EmptyPlan:
    """Plan of a call with nothing to compute (zero-size input); the planner attaches the allocators
    of the results it still returns."""

    grid = 0


def allocator(like: Array, shape, dtype: str):
    """A function (input object) -> (new uninitialized contiguous array, its pointer) of ``like``'s
    kind, ``shape`` and ``dtype`` on ``like``'s device; chosen once per plan as the cheapest call."""
    shape = tuple(shape)
    if like.kind == "torch":
        torch = sys.modules["torch"]  # imported: `like` is a torch tensor
        if shape == tuple(like.shape) and dtype == like.dtype and is_contiguous(like):
            def new_torch(obj):  # a contiguous input gives a contiguous result its own layout
                new = torch.empty_like(obj)
                return new, new.data_ptr()
        else:
            torch_dtype, device = getattr(torch, dtype), like.obj.device

            def new_torch(obj):
                new = torch.empty(shape, dtype=torch_dtype, device=device)
                return new, new.data_ptr()
        return new_torch
    cupy = import_cupy()
    cupy_dtype, device = _cupy_dtype(dtype), like.device

    def new_cupy(obj):
        if cupy.cuda.runtime.getDevice() == device:
            new = cupy.empty(shape, dtype=cupy_dtype)
        else:
            with cupy.cuda.Device(device):
                new = cupy.empty(shape, dtype=cupy_dtype)
        return new, new.data.ptr

    return new_cupy


def is_contiguous(array: Array) -> bool:
    return tuple(array.strides) == contiguous_like(array, array.shape, array.dtype).strides


def _cupy_dtype(dtype: str):
    if dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - depends on the environment
            raise TypeError("bfloat16 CuPy arrays need the ml_dtypes package: pip install ml_dtypes") from None
        return ml_dtypes.bfloat16
    return dtype


def from_host(numpy_array, like_kind: str, device: int):
    """Copy a host NumPy array to the GPU as the requested kind (setup paths only, never hot)."""
    if like_kind == "torch":
        import torch

        return torch.from_numpy(numpy_array).to(f"cuda:{device}")
    cupy = import_cupy()

    with cupy.cuda.Device(device):
        return cupy.asarray(numpy_array)


def check_same_device(a: Array, b: Array, name_a: str, name_b: str) -> None:
    if a.device != b.device or a.kind != b.kind:
        raise ValueError(
            f"{name_b}: expected a {a.kind} array on cuda:{a.device} like {name_a}, "
            f"got a {b.kind} array on cuda:{b.device}"
        )


def check_dtype(array: Array, name: str, allowed) -> None:
    if array.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype in {tuple(allowed)}, got {array.dtype}")


def check_impl(impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")


def check_float_input(array: Array, name: str, last_dim: str) -> None:
    """A (..., last_dim) fp32/fp16/bf16 array with a contiguous last dimension."""
    check_dtype(array, name, FLOAT_DTYPES)
    if len(array.shape) < 1:
        raise ValueError(f"{name}: expected shape (..., {last_dim}), got a 0-d array")
    check_last_dim_contiguous(array, name)


def check_not_overlapping(a: Array, b: Array, name_a: str, name_b: str, same_allowed: bool = False) -> None:
    """Distinct arrays must not share memory (a kernel would read what another thread wrote);
    ``same_allowed``: b may be exactly a (in place)."""
    if same_allowed and a.ptr == b.ptr and a.strides == b.strides and tuple(a.shape) == tuple(b.shape):
        return
    hint = f"pass {name_b}={name_a} (in place) or separate memory" if same_allowed else "pass separate memory"
    check_disjoint(a.ptr, layout_key(a), b.ptr, layout_key(b), name_a, name_b, hint)


def output(x, x_ptr: int, out, out_ptr: int, plan):
    """(output object, its pointer): a new array like x (``plan.new_output``), or the caller's ``out``.
    An ``out`` that is not x itself (which the plan checked) is checked per call not to overlap x, with
    the layouts the plan computed once (``plan.out_layouts``)."""
    if out is None:
        return plan.new_output(x)
    if plan.grid and out_ptr != x_ptr:
        check_disjoint(x_ptr, plan.out_layouts[0], out_ptr, plan.out_layouts[1], "x", "out",
                       "pass out=x (in place) or separate memory")
    return out, out_ptr


def out_layouts(x: Array, out: Array | None):
    """What output() needs per call, computed once per plan."""
    return None if out is None else (layout_key(x), layout_key(out))


def check_last_dim_contiguous(array: Array, name: str) -> None:
    if array.shape and array.shape[-1] > 1 and array.strides[-1] != 1 and 0 not in array.shape:
        raise ValueError(
            f"{name}: expected the last dimension to be contiguous (stride 1), got strides "
            f"{array.strides}; pass {name}.contiguous() or a view with a unit last stride"
        )


def extent(array: Array) -> tuple[int, int]:
    """[low, high) byte offsets, relative to ptr, that the array's elements occupy."""
    low = sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s > 0)
    return low * array.itemsize, (high + 1) * array.itemsize


def row_extent(array: Array):
    """(outer stride in bytes, extent of one outer row) -- lets interleaved views of one buffer (q and k
    as column slices of a fused qkv tensor) be told apart from overlapping ones."""
    if len(array.shape) < 2 or array.shape[0] < 2:
        return None
    inner = Array(None, array.kind, 0, array.dtype, tuple(array.shape[1:]), tuple(array.strides[1:]), array.device)
    return array.strides[0] * array.itemsize, array.shape[0], extent(inner)


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


def contiguous_like(like: Array, shape, dtype: str) -> Array:
    """Description of a fresh contiguous array (the allocator aligns it to 256 bytes) for planning."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= max(n, 1)
    return Array(None, like.kind, 0, dtype, tuple(shape), tuple(strides), like.device)


class PlanCache:
    """Plans keyed by call signature: a repeated call skips the checks and the planning (pure Python,
    tens of microseconds) and only substitutes its pointers. ``recent[op]``: op's last calls with torch
    tensors, recalled without fingerprints (_recall.py); a new PlanCache forgets them too."""

    def __init__(self, limit: int = 4096):
        self._plans: dict = {}
        self._limit = limit
        self.recent = defaultdict(RecentCalls)

    def get(self, key):
        try:
            return self._plans.get(key)
        except TypeError:  # an unhashable option: plan on every call
            return None

    def put(self, key, plan) -> None:
        try:
            hash(key)
        except TypeError:
            return
        if len(self._plans) >= self._limit:
            self._plans.clear()
        self._plans[key] = plan
