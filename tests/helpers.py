"""Shared test helpers: device detection, random inputs in every dtype, poisoning, tolerances."""

import contextlib
import functools

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from cupyrope.reference import round_to, tolerance, ulp


@functools.cache
def gpu_status() -> tuple[int, str]:
    try:
        import cupy  # noqa: F401
    except ImportError as error:
        return 0, f"CuPy is not installed ({error})"
    from cupyrope._runtime.compile import NoGPUError, device_count

    try:
        return device_count(), ""
    except NoGPUError as error:
        return 0, str(error)


def n_gpus() -> int:
    return gpu_status()[0]


requires_gpu = pytest.mark.skipif(n_gpus() == 0, reason=f"needs a CUDA GPU: {gpu_status()[1]}")


def has_torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


requires_torch_cuda = pytest.mark.skipif(not has_torch_cuda(), reason="needs torch with CUDA")

KINDS = ["cupy", pytest.param("torch", marks=requires_torch_cuda)]
DTYPES = ["float32", "float16", "bfloat16"]


def random_host(shape, dtype, rng, scale=1.0) -> np.ndarray:
    """float64 values exactly representable in ``dtype`` (so the reference sees the kernel's input)."""
    return round_to(rng.standard_normal(shape) * scale, dtype)


def to_device(host: np.ndarray, dtype: str, kind: str, device: int = 0):
    if kind == "torch":
        import torch

        return torch.from_numpy(host).to(device=f"cuda:{device}", dtype=getattr(torch, dtype))
    import cupy

    from cupyrope._runtime.arrays import numpy_dtype

    with cupy.cuda.Device(device):
        return cupy.asarray(host.astype(numpy_dtype(dtype)))


def to_host(array) -> np.ndarray:
    if type(array).__module__.startswith("torch"):
        return array.detach().float().cpu().numpy().astype(np.float64)
    import cupy

    return cupy.asnumpy(array).astype(np.float64)


def index_to_device(host: np.ndarray, kind: str, device: int = 0):
    if kind == "torch":
        import torch

        return torch.from_numpy(host).to(f"cuda:{device}")
    import cupy

    with cupy.cuda.Device(device):
        return cupy.asarray(host)


_LIVE_POOLS: list = []


@contextlib.contextmanager
def poisoned_allocations(kind: str, shapes, dtype: str, value=np.nan):
    """Inside, new arrays come from a private pool of the caller's allocator (CuPy's or torch's) that
    first held arrays of these shapes filled with `value` (NaN; for byte outputs e.g. 0x7F, FP8's NaN), freed
    again: the next allocations of those sizes get those blocks, so the outputs a call allocates itself start out
    poisoned. Yields the blocks' pointers (the test asserts its outputs got them). Make the call's inputs before
    entering."""
    if kind == "torch":
        import torch

        pool = torch.cuda.MemPool()
        _LIVE_POOLS.append(pool)  # the outputs outlive the block: their pool must too
        with torch.cuda.use_mem_pool(pool):
            blocks = [torch.empty(shape, dtype=getattr(torch, dtype), device="cuda") for shape in shapes]
            ptrs = {data_ptr(block.fill_(value)) for block in blocks}
            del blocks
            yield ptrs
    else:
        import cupy

        from cupyrope._runtime.arrays import numpy_dtype

        with cupy.cuda.using_allocator(cupy.cuda.MemoryPool().malloc):
            blocks = [cupy.full(shape, value, dtype=numpy_dtype(dtype)) for shape in shapes]  # no name outlives `del`
            ptrs = {data_ptr(block) for block in blocks}
            del blocks
            yield ptrs


def outside_rows(buffer, start, hidden):
    """The columns of an unaligned_view's buffer around its rows, on the host."""
    whole = to_host(buffer)
    return np.concatenate([whole[:, :start], whole[:, start + hidden:]], axis=1)


def unaligned_view(host, dtype, kind, start, pad):
    """(buffer, view): the view is columns start .. start + hidden of a (rows, hidden + pad) buffer
    holding `host` there and NaN around it."""
    rows, hidden = host.shape
    wide = np.full((rows, hidden + pad), np.nan)
    wide[:, start:start + hidden] = host
    buffer = to_device(wide, dtype, kind)
    return buffer, buffer[:, start:start + hidden]


def data_ptr(array) -> int:
    return array.data_ptr() if type(array).__module__.startswith("torch") else array.data.ptr


def poison(array):
    """Fill with NaN so that any element the kernel fails to write fails the comparison."""
    if type(array).__module__.startswith("torch"):
        array.fill_(float("nan"))
    else:
        array.fill(np.nan)
    return array


def assert_matches(out: np.ndarray, ref: np.ndarray, dtype: str, scale: float = 1.0, what: str = ""):
    """fp32: 1e-5 relative (plus 1e-6 * scale absolute for values from cancellation); fp16/bf16: one
    rounding of the output (one ulp, plus the same small absolute term). NaN never passes unless the
    reference is NaN at that place."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    ref_nan = np.isnan(ref)
    assert np.array_equal(np.isnan(out), ref_nan), f"{what}: NaN pattern differs (unwritten outputs?)"
    out, ref = out[~ref_nan], ref[~ref_nan]
    tol = tolerance(ref, dtype, scale)
    err = np.abs(out - ref)
    worst = np.argmax(err - tol) if err.size else 0
    assert np.all(err <= tol), (
        f"{what}: {np.count_nonzero(err > tol)} of {err.size} elements off; worst |{out.flat[worst]} - "
        f"{ref.flat[worst]}| = {err.flat[worst]:.3g} > {tol.flat[worst]:.3g}"
    )


def assert_backward_with_offset(dy, x, w, dx, dw, dy_host, x_host, w_host, dtype, weight_dtype="float32"):
    """rms_norm_backward(dy, x, w, offset=0.25) = (dx, dw): every row of dx against float64, dweight within
    its terms' sum (and one rounding to a 16-bit weight's dtype), and bitwise the same dweight from a second call."""
    ref_dx, ref_dw = reference.rms_norm_backward(dy_host, x_host, w_host, offset=0.25)
    rstd_ref = reference.rms_norm(x_host, None, return_rstd=True)[1]
    scale = np.abs(dy_host * (w_host + 0.25) * rstd_ref[:, None]).max()
    assert_matches(to_host(dx), ref_dx, dtype, scale=scale, what="dx")
    terms = np.abs(dy_host * x_host * rstd_ref[:, None]).sum(0)
    err = np.abs(to_host(dw) - ref_dw)
    tol = 4e-6 * terms + (0 if weight_dtype == "float32" else ulp(ref_dw, weight_dtype))
    assert np.all(err <= tol), f"dweight: worst {err.max():.3g}"
    np.testing.assert_array_equal(to_host(cupyrope.rms_norm_backward(dy, x, w, offset=0.25)[1]), to_host(dw))


# Each public op's plans: (its module, the name of its OpPlans there).
OP_PLANS = {"rope": ("rope", "_rope_plans"), "rope_qk": ("rope", "_rope_qk_plans"),
            "rope_cos_sin": ("rope", "_rope_cos_sin_one_plans"), "rope_qk_cos_sin": ("rope", "_rope_cos_sin_plans"), "rms_norm": ("rmsnorm", "_forward_plans"),
            "fused_add_rms_norm": ("rmsnorm", "_fused_add_plans"), "add_rms_norm": ("rmsnorm", "_add_plans"),
            "rms_norm_backward": ("rmsnorm", "_backward_plans"), "rms_norm_fp8": ("rmsnorm_fp8", "_plans"),
            "qk_norm_rope": ("qk_norm_rope", "_forward_plans"),
            "qk_norm_rope_backward": ("qk_norm_rope", "_backward_plans"),
            "layer_norm": ("layernorm", "_forward_plans"), "fused_add_layer_norm": ("layernorm", "_fused_add_plans"),
            "layer_norm_backward": ("layernorm", "_backward_plans")}


def fresh_plans(monkeypatch) -> dict:
    """Empty plan caches (and recall) for every op, for this test: {op name: its OpPlans}, whose ``plans`` then
    hold the plans the test's calls made."""
    import importlib

    fresh = {}
    for op, (module_name, name) in OP_PLANS.items():
        module = importlib.import_module(f"cupyrope.ops.{module_name}")
        fresh[op] = getattr(module, name).emptied()
        monkeypatch.setattr(module, name, fresh[op])
    return fresh


def use_choices(monkeypatch, **sections) -> dict:
    """Plan with the device's launch profile but for some choices, e.g. rope={"direct_max_tokens": 0}, from empty
    plan caches (returns fresh_plans'). monkeypatch: the test's fixture or one of its contexts."""
    import dataclasses

    from cupyrope.ops import profiles

    profile_for = profiles.profile_for

    def changed(device):
        profile = profile_for(device)
        return dataclasses.replace(profile, **{
            name: dataclasses.replace(getattr(profile, name), **values) for name, values in sections.items()})

    monkeypatch.setattr(profiles, "profile_for", changed)
    return fresh_plans(monkeypatch)


def layer_norm_fwd_max_threads(plan) -> int:
    """The threads layer_norm_fwd's launch bound allows a plan's block (layernorm.cu's LayerNormBounds): 1024 for rows
    of 4+ register slots, but 512 for 16-byte rows of 8 and for the others."""
    long_row = plan.vectorized and plan.slots == 8
    return 1024 if plan.slots >= 4 and not long_row else 512


def planned_kernels(plans) -> list:
    """The kernel names of the plans an OpPlans made (calls with nothing to compute have none)."""
    return [plan.name for plan in plans.plans.values() if hasattr(plan, "name")]


def rotate_half(x):  # transformers' (Llama), on torch tensors
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def assert_close(got, expected, dtype):
    """assert_matches on torch tensors: fp32 1e-5 relative, fp16/bf16 one rounding of the output."""
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert_matches(to_host(got), to_host(expected), dtype, scale=float(expected.abs().max()))


# A device address aligned past any vector width, for planning without a GPU.
PLAN_BASE = 0x7F0000000000


def planned_array(shape, dtype="bfloat16", strides=None, ptr=PLAN_BASE):
    """An Array description (no memory behind it) with C-order strides unless given: what the planners read."""
    from cupyrope._runtime.arrays import Array, contiguous_strides

    return Array(None, "cupy", ptr, dtype, tuple(shape), strides or contiguous_strides(shape), 0)
