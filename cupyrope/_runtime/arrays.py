"""CuPy arrays and torch tensors in; pointer, dtype, shape, strides, device and stream out.

Nothing here copies data or synchronizes. Results are allocated by the caller's library (torch's caching
allocator for torch inputs, so CUDA-graph capture and torch's memory accounting keep working).
"""

import sys

from .compile import import_cupy

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "int64")
CTYPE = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int", "int64": "long long"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "float64": 8, "uint8": 1,
            "float8_e4m3fn": 1}
# An FP8 (e4m3fn) output's dtype by kind of array: CuPy has no FP8 dtype, so its arrays hold the same bytes as uint8.
FP8_DTYPES = {"torch": "float8_e4m3fn", "cupy": "uint8"}
HOST = "cpu"  # the device of a host (NumPy, CPU torch) array


class Array:
    """What the checks, the planners and a launch need to know about one array or tensor."""

    __slots__ = ("obj", "kind", "ptr", "dtype", "shape", "strides", "device")

    def __init__(self, obj, kind, ptr, dtype, shape, strides, device):
        self.obj = obj
        self.kind = kind  # "cupy", "torch" or (host arrays) "numpy"
        self.ptr = ptr
        self.dtype = dtype  # canonical name: "float32", "bfloat16", "int64", ...
        self.shape = tuple(shape)
        self.strides = tuple(strides)  # in elements
        self.device = device  # a CUDA device index, or HOST

    @property
    def itemsize(self) -> int:
        return ITEMSIZE.get(self.dtype, 0)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def where(self) -> str:
        return HOST if self.device == HOST else f"cuda:{self.device}"


_TORCH_DTYPE_NAMES: dict = {}


def _torch_dtype_name(dtype) -> str:
    name = _TORCH_DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        _TORCH_DTYPE_NAMES[dtype] = name
    return name


def _is_torch_tensor(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


TORCH_TYPES: set = set()  # CUDA tensor classes seen already: the hot path skips the module checks
CUPY_TYPES: set = set()


def _from_torch(obj) -> Array:
    return Array(obj, "torch", obj.data_ptr(), _torch_dtype_name(obj.dtype), obj.shape, obj.stride(), obj.get_device())


def _from_cupy(obj) -> Array:
    itemsize = obj.itemsize
    return Array(obj, "cupy", obj.data.ptr, obj.dtype.name, obj.shape, tuple(s // itemsize for s in obj.strides),
                 obj.device.id)


def describe(obj, name: str) -> Array:
    """Describe ``obj`` (the argument called ``name``) or raise a TypeError saying what to pass."""
    cls = type(obj)
    if cls in TORCH_TYPES and obj.is_cuda:
        return _from_torch(obj)
    if cls in CUPY_TYPES:
        return _from_cupy(obj)
    module = cls.__module__
    if module.startswith("cupy") and hasattr(obj, "data") and hasattr(obj, "device"):
        CUPY_TYPES.add(cls)
        return _from_cupy(obj)
    if _is_torch_tensor(obj):
        if obj.device.type != "cuda":
            raise TypeError(
                f"{name}: expected a CUDA tensor, got a tensor on {obj.device}; move it with "
                f"{name}.cuda() (cupyrope's kernels run on the GPU; cupyrope.torch also takes CPU tensors)"
            )
        TORCH_TYPES.add(cls)
        return _from_torch(obj)
    if module == "numpy":
        raise TypeError(
            f"{name}: expected a cupy.ndarray or a CUDA torch.Tensor, got a NumPy array; move it to "
            f"the GPU with cupy.asarray({name}) (cupyrope's kernels run on the GPU; for a CPU "
            "answer use cupyrope.reference)"
        )
    raise TypeError(f"{name}: expected a cupy.ndarray or a CUDA torch.Tensor, got {cls.__name__}")


def describe_optional(obj, name: str) -> Array | None:
    return None if obj is None else describe(obj, name)


def describe_host(obj, name: str, *, numpy_ok: bool = False) -> Array:
    """Describe a CPU torch tensor (or, ``numpy_ok``, a NumPy array) for the argument checks of the CPU paths
    (the torch layer's fallback, the references), which raise what the GPU path raises; anything else as
    describe() does."""
    if _is_torch_tensor(obj) and obj.device.type == "cpu":
        return Array(obj, "torch", obj.data_ptr(), _torch_dtype_name(obj.dtype), obj.shape, obj.stride(), HOST)
    if numpy_ok and type(obj).__module__ == "numpy" and hasattr(obj, "strides"):
        itemsize = obj.dtype.itemsize
        return Array(obj, "numpy", obj.ctypes.data, obj.dtype.name, obj.shape,
                     tuple(s // itemsize for s in obj.strides), HOST)
    return describe(obj, name)


def fingerprint(obj, name: str):
    """(key, pointer) of ``obj`` (the argument called ``name``). The key holds everything a plan depends
    on -- type, dtype, shape, strides, device and 16-byte alignment -- and costs a few attribute reads,
    so every call can afford it. An object of a type not seen yet goes through describe() first, which
    raises for what cupyrope cannot take. A CPU (or meta) tensor's get_device() is -1, a key no plan
    has: plans are made only after describe() accepted every array. (get_device() is ~0.3 µs cheaper
    than .device; a torch build has one accelerator backend, so a device index means a CUDA device.)"""
    cls = type(obj)
    if cls in TORCH_TYPES:
        ptr = obj.data_ptr()
        return (cls, obj.dtype, obj.shape, obj.stride(), obj.get_device(), ptr & 15), ptr
    if cls in CUPY_TYPES:
        data = obj.data
        ptr = data.ptr
        return (cls, obj.dtype, obj.shape, obj.strides, data.device_id, ptr & 15), ptr
    describe(obj, name)
    return fingerprint(obj, name)


def fingerprint_optional(obj, name: str):
    """fingerprint() of an optional argument; (None, 0) when it is None."""
    return (None, 0) if obj is None else fingerprint(obj, name)


def allocator(like: Array, shape, dtype: str):
    """A function (input object) -> (new uninitialized contiguous array, its pointer) of ``like``'s
    kind, ``shape`` and ``dtype`` on ``like``'s device; chosen once per plan as the cheapest call."""
    shape = tuple(shape)
    if like.kind == "torch":
        torch = sys.modules["torch"]  # imported: `like` is a torch tensor
        if shape == like.shape and dtype == like.dtype and is_contiguous(like):
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
    cupy_dtype, device = numpy_dtype(dtype), like.device

    def new_cupy(obj):
        if cupy.cuda.runtime.getDevice() == device:
            new = cupy.empty(shape, dtype=cupy_dtype)
        else:
            with cupy.cuda.Device(device):
                new = cupy.empty(shape, dtype=cupy_dtype)
        return new, new.data.ptr

    return new_cupy


def contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= max(n, 1)
    return tuple(strides)


def is_contiguous(array: Array) -> bool:
    return array.strides == contiguous_strides(array.shape)


def contiguous_like(like: Array, shape, dtype: str) -> Array:
    """Description of a fresh contiguous array (the allocator aligns it to 256 bytes) for planning."""
    return Array(None, like.kind, 0, dtype, shape, contiguous_strides(shape), like.device)


def numpy_dtype(dtype: str):
    """The NumPy (and CuPy) dtype of a dtype name; bfloat16 is ml_dtypes'."""
    if dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - depends on the environment
            raise TypeError("bfloat16 CuPy arrays need the ml_dtypes package: pip install ml_dtypes") from None
        return ml_dtypes.bfloat16
    return dtype


def merged_rows(shape, strides_per_array):
    """The rows of arrays of one shape (all dimensions but the last; size-1 ones dropped) as merge_dims leaves them:
    [(size, (stride of each array, ...)), ...], outermost first. One entry: one evenly strided run."""
    return merge_dims([(n, tuple(s[j] for s in strides_per_array)) for j, n in enumerate(shape[:-1]) if n != 1])


def merge_dims(dims):
    """dims: [(size, (stride of each tensor, ...)), ...], outermost first. Neighbours merge into one dimension
    where every tensor's strides allow it (outer stride = inner size x inner stride)."""
    merged = []
    for size, strides in dims:
        if merged:
            prev_size, prev_strides = merged[-1]
            if all(ps == size * s for ps, s in zip(prev_strides, strides)):
                merged[-1] = (prev_size * size, strides)
                continue
        merged.append((size, strides))
    return merged
