"""rms_norm_fp8 on the GPU against the float64 reference followed by the FP8 rounding: every quantization mode (a
static scale, one a row with and without scale_ub, one per group of 64 or 128 columns), with and without the fused
residual add, over the kernel's row paths (element by element, 16-byte chunks held in registers, rows read again),
with outputs poisoned (FP8 NaN bytes) and inputs checked unchanged; saturation, NaN and Inf; the conversion itself
(hardware and software) bit for bit; torch's dtype, op and torch.compile."""

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from helpers import (DTYPES, KINDS, data_ptr, poisoned_allocations, random_host, requires_gpu, requires_torch_cuda,
                     to_device, to_host, unaligned_view, use_choices)

pytestmark = [pytest.mark.gpu, requires_gpu]

# (rows, hidden): one chunk a thread or fewer lanes than a group (128), 16-byte rows of 1-2 chunks a thread (4096,
# 7168), odd rows element by element (1027), rows of 4-8 chunks a thread (16384), rows read again (32768).
SHAPES = [(300, 128), (300, 1027), (300, 4096), (37, 7168), (45, 16384), (7, 32768)]
MODES = ["static", "token", "token_ub", "group64", "group128"]
# How far the kernel's fp32 value may be from the float64 one, relatively: a value this close to a rounding boundary
# of FP8 may round either way.
SLACK = 2e-6


def mode_options(mode, static_scale=0.02):
    """The call's options for a mode (scales as numbers: device_options makes them arrays) and the reference's."""
    if mode == "static":
        return {"scale": static_scale}, {"scale": np.float32(static_scale)}
    if mode == "token_ub":
        return {"scale_ub": 1.5}, {"scale_ub": np.float32(1.5)}
    if mode.startswith("group"):
        return {"group_size": int(mode[5:])}, {"group_size": int(mode[5:])}
    return {}, {}


def device_options(options, kind):
    return {k: to_device(np.array([v], np.float64), "float32", kind) if k in ("scale", "scale_ub") else v
            for k, v in options.items()}


def codes_of(y) -> np.ndarray:
    """The bytes of an FP8 output (a torch float8 tensor or a CuPy uint8 array)."""
    if type(y).__module__.startswith("torch"):
        import torch

        return y.view(torch.uint8).cpu().numpy()
    import cupy

    return cupy.asnumpy(y)


def assert_fp8_matches(codes, q):
    """Each byte is the FP8 rounding of the reference's unrounded value q, or of a value within SLACK of it (where q
    lies that close to a rounding boundary). No share of exact matches is asked for: without a weight q is
    448 x_i / max |x| with x in 8 bits, so up to 1/16 of the values can sit on a tie, where the kernel's fp32 value
    may fall on either side."""
    low, high = reference.e4m3(q * (1 - SLACK)), reference.e4m3(q * (1 + SLACK))
    bad = (codes != low) & (codes != high)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} bytes off; first at {np.argwhere(bad)[0]}: "
                           f"{codes[bad][0]:#x} for {q[bad][0]!r}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_fp8(rng, kind, dtype, rows, hidden, mode, add):
    options, ref_options = mode_options(mode)
    if options.get("group_size") and hidden % options["group_size"]:
        pytest.skip("group_size must divide hidden")
    x_host, r_host = random_host((rows, hidden), dtype, rng, scale=2.0), random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), dtype, rng)
    x, w = to_device(x_host, dtype, kind), to_device(w_host, dtype, kind)
    r = to_device(r_host, dtype, kind) if add else None
    call_options = device_options(options, kind)
    dynamic = "scale" not in options
    groups = hidden // options.get("group_size", hidden)
    sizes = [rows * hidden] + ([rows * groups * 4] if dynamic else [])
    warm_up = to_device(r_host, dtype, kind) if add else None  # planned and compiled before the poisoned pool
    cupyrope.rms_norm_fp8(x, w, 1e-6, residual=warm_up, offset=0.5, **call_options)
    with poisoned_allocations(kind, [(n,) for n in sizes], "uint8", 0x7F) as blocks:  # 0x7F: FP8 NaN (a huge float32 scale)
        result = cupyrope.rms_norm_fp8(x, w, 1e-6, residual=r, offset=0.5, **call_options)
    y, scales = result if dynamic else (result, None)
    assert {data_ptr(y)} | ({data_ptr(scales)} if dynamic else set()) == blocks, "outputs not in the poisoned blocks"
    assert type(y) is type(x) and y.shape == x.shape
    q, ref_scales = reference.rms_norm_fp8(x_host, w_host, 1e-6, residual=r_host if add else None, offset=0.5,
                                           dtype=dtype, **ref_options)
    assert_fp8_matches(codes_of(y), q)
    if dynamic:
        assert scales.shape == ref_scales.shape
        np.testing.assert_allclose(to_host(scales), ref_scales, rtol=SLACK)
    np.testing.assert_array_equal(to_host(x), x_host)
    if add:
        np.testing.assert_array_equal(to_host(r), reference.round_to(x_host + r_host, dtype))


@requires_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("hidden,mode", [(4096, "static"), (1027, "static"), (4096, "token"), (1027, "token"),
                                         (4096, "group128"), (7168, "group128")])
def test_blocks_walking_rows(rng, monkeypatch, dtype, hidden, mode):
    """More rows than the GPU's resident blocks hold at once, with a last round of a few: blocks walk the rows, each
    loading its next row while it quantizes one (rows of 1-2 slots, 16-byte or element by element), into poisoned
    outputs. The rows repeat a tile of 67 (the reference's), which falls differently on
    the blocks in each round."""
    import torch

    from cupyrope._runtime.device import sm_count

    options, ref_options = mode_options(mode)
    rows = 80 * sm_count(0) + 5  # more than 32 blocks an SM of 2 rows hold
    tile_host, w_host = random_host((67, hidden), dtype, rng, scale=2.0), random_host((hidden,), dtype, rng)
    def tiled():
        return to_device(tile_host, dtype, "torch").repeat(-(-rows // 67), 1)[:rows].contiguous()

    x = tiled()
    w = to_device(w_host, dtype, "torch")
    call_options = device_options(options, "torch")
    # 16-byte rows of 2 slots (16 elements a thread) in every mode, whatever the profile gives it.
    plans = use_choices(monkeypatch, rms_norm_forward={"fp8_elems_per_thread": 16, "fp8_token_elems_per_thread": 16})
    cupyrope.rms_norm_fp8(x, w, 1e-6, offset=0.25, **call_options)  # planned and compiled first
    (plan,) = plans["rms_norm_fp8"].plans.values()
    assert plan.grid * plan.block[1] < rows, plan  # the blocks walk
    groups = hidden // options.get("group_size", hidden)
    sizes = [rows * hidden] + ([rows * groups * 4] if mode != "static" else [])
    with poisoned_allocations("torch", [(n,) for n in sizes], "uint8", 0x7F) as blocks:
        result = cupyrope.rms_norm_fp8(x, w, 1e-6, offset=0.25, **call_options)
    y, scales = (result, None) if mode == "static" else result
    assert {data_ptr(y)} | ({data_ptr(scales)} if scales is not None else set()) == blocks
    q, ref_scales = reference.rms_norm_fp8(tile_host, w_host, 1e-6, offset=0.25, dtype=dtype, **ref_options)
    codes, got_scales = codes_of(y), to_host(scales) if scales is not None else None
    for j in range(67):  # rows j, j + 67, ... are tile row j
        assert_fp8_matches(codes[j::67], np.broadcast_to(q[j], codes[j::67].shape))
        if got_scales is not None:
            np.testing.assert_allclose(got_scales[j::67], np.broadcast_to(ref_scales[j], got_scales[j::67].shape),
                                       rtol=SLACK)
    assert torch.equal(x, tiled())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hidden,start", [(4096, 3), (1024, 1), (7168, 0)])
@pytest.mark.parametrize("mode", ["token", "group128"])
def test_views_and_out(rng, kind, dtype, hidden, start, mode):
    """x and residual as views with NaN around their rows (16-byte aligned or not), y into the caller's out (a
    strided view whose neighbours stay untouched): the reference's bytes, nothing around the rows read."""
    rows = 37
    options, ref_options = mode_options(mode)
    x_host, r_host = random_host((rows, hidden), dtype, rng), random_host((rows, hidden), dtype, rng)
    _, x = unaligned_view(x_host, dtype, kind, start, 8)
    _, r = unaligned_view(r_host, dtype, kind, start, 8)
    out_host = np.full((rows, hidden + 16), 0x55, np.uint8)
    if kind == "torch":
        import torch

        out_buffer = torch.from_numpy(out_host).cuda().view(torch.float8_e4m3fn)
    else:
        import cupy

        out_buffer = cupy.asarray(out_host)
    out = out_buffer[:, 8:8 + hidden]
    y, scales = cupyrope.rms_norm_fp8(x, None, 1e-5, residual=r, out=out, **device_options(options, kind))
    assert data_ptr(y) == data_ptr(out)
    q, ref_scales = reference.rms_norm_fp8(x_host, None, 1e-5, residual=r_host, dtype=dtype, **ref_options)
    whole = codes_of(out_buffer)
    assert_fp8_matches(whole[:, 8:8 + hidden], q)
    assert (whole[:, :8] == 0x55).all() and (whole[:, 8 + hidden:] == 0x55).all()
    np.testing.assert_allclose(to_host(scales), ref_scales, rtol=SLACK)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["static", "token", "group64"])
def test_saturation_nan_and_inf(rng, kind, mode):
    """Values past +-448 and +-Inf saturate to +-448 (0x7E, 0xFE); NaN stays NaN (0x7F); NaN is left out of a
    dynamic scale's maximum. A weight with NaN and Inf columns makes them; a small static scale pushes values past
    448. With a dynamic scale, a row holding Inf normalizes to NaN there and zeros elsewhere, and its scale is the
    least one."""
    rows, hidden = 64, 256
    x_host = random_host((rows, hidden), "bfloat16", rng)
    if mode != "static":  # (static: the Inf weight columns are what the saturation checks below read)
        x_host[9, 17] = np.inf
    w_host = random_host((hidden,), "float32", rng)
    w_host[[3, 70]] = np.nan
    if mode == "static":
        w_host[[5, 200]] = [np.inf, -np.inf]
    options, ref_options = mode_options(mode, static_scale=1e-3)
    x, w = to_device(x_host, "bfloat16", kind), to_device(w_host, "float32", kind)
    result = cupyrope.rms_norm_fp8(x, w, **device_options(options, kind))
    y = result if mode == "static" else result[0]
    q, ref_scales = reference.rms_norm_fp8(x_host, w_host, dtype="bfloat16", **ref_options)
    codes = codes_of(y)
    assert_fp8_matches(codes, q)
    assert (codes[:, [3, 70]] == 0x7F).all()
    if mode == "static":
        assert np.isin(codes[:, [5, 200]], [0x7E, 0xFE]).all() and (np.abs(q) > 448).any()
        assert np.isin(codes[np.abs(q) > 448], [0x7E, 0xFE]).all()
    else:
        np.testing.assert_allclose(to_host(result[1]), ref_scales, rtol=SLACK)


@pytest.mark.parametrize("software", [False, True])
def test_e4m3_conversion_bit_for_bit(rng, software):
    """The kernel's conversion (the hardware's on sm_89+, and the software one older GPUs run) gives the reference's
    byte for every float32 it is given: random magnitudes from 2^-12 to 2^10, every FP8 value and the midpoints
    between neighbours (ties to even), subnormals, +-0, saturation, Inf and NaN."""
    import cupy

    from cupyrope._runtime.compile import get_kernel

    grid = reference.e4m3_values(np.arange(256, dtype=np.uint8))
    finite = np.sort(grid[np.isfinite(grid)])
    midpoints = (finite[1:] + finite[:-1]) / 2
    values = np.concatenate([rng.standard_normal(100000) * 2.0 ** rng.uniform(-12, 10, 100000), finite, midpoints,
                             np.nextafter(midpoints, np.inf), np.nextafter(midpoints, -np.inf),
                             [0.0, -0.0, 448.0, 464.0, 465.0, -479.0, 480.0, 1e30, np.inf, -np.inf, np.nan]])
    values = values.astype(np.float32)
    if len(values) % 2 == 0:
        values = np.append(values, np.float32(3.0))  # an odd count: the last one alone
    kernel = get_kernel("rmsnorm_fp8.cu", f"cupyrope::e4m3_encode<{'true' if software else 'false'}>", 0)
    x = cupy.asarray(values)
    y = cupy.full(values.shape, 0x55, cupy.uint8)
    _launch_encode(kernel, x, y, len(values))
    expected = reference.e4m3(values.astype(np.float64))
    got = cupy.asnumpy(y)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    assert (got[nan] & 0x7F == 0x7F).all()


def _launch_encode(kernel, x, y, n):
    import struct

    from cupyrope._runtime.launch import Launch

    threads, pairs = 256, -(-n // 2)
    Launch(kernel, -(-pairs // threads), (threads, 1), 2, struct.pack("<q", n), 0, "cupy")(x.data.ptr, y.data.ptr)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["token", "group128", "static"])
def test_batch_invariant(rng, kind, mode):
    """A row's bytes and scale do not depend on how many rows share the call."""
    hidden = 4096
    x_host = random_host((513, hidden), "bfloat16", rng)
    x = to_device(x_host, "bfloat16", kind)
    options = device_options(mode_options(mode)[0], kind)
    many, one = cupyrope.rms_norm_fp8(x, **options), cupyrope.rms_norm_fp8(x[5:6], **options)
    if mode == "static":
        many, one = (many, None), (one, None)
    np.testing.assert_array_equal(codes_of(many[0])[5:6], codes_of(one[0]))
    if mode != "static":
        np.testing.assert_array_equal(to_host(many[1])[5:6], to_host(one[1]))


@requires_torch_cuda
def test_torch_layer_and_compile(rng):
    """cupyrope.torch.rms_norm_fp8: float8_e4m3fn out, the op's opcheck, and torch.compile(fullgraph) giving the
    eager bytes with the residual updated in place."""
    import torch
    from torch.library import opcheck

    import cupyrope.torch as ct

    x = torch.randn(64, 2048, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2048, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(64, 2048, dtype=torch.bfloat16, device="cuda")
    y, scales = ct.rms_norm_fp8(x, w, group_size=128, residual=r.clone())
    assert y.dtype == torch.float8_e4m3fn and scales.shape == (64, 16)
    opcheck(torch.ops.cupyrope.rms_norm_fp8.default, (x, w, r.clone(), None, None, 128, 1e-6, 0.0))

    def step(x, r):
        return ct.rms_norm_fp8(x, w, group_size=128, residual=r)

    r_compiled = r.clone()
    y_compiled, scales_compiled = torch.compile(step, fullgraph=True)(x, r_compiled)
    assert torch.equal(y_compiled.view(torch.uint8), y.view(torch.uint8))
    assert torch.equal(scales_compiled, scales)
    assert torch.equal(r_compiled, (x.float() + r.float()).to(torch.bfloat16))
    static = ct.rms_norm_fp8(x, w, scale=torch.tensor(0.05, device="cuda"))
    cpu = ct.rms_norm_fp8(x.cpu(), w.cpu(), scale=torch.tensor(0.05))
    assert (static.cpu().view(torch.uint8).int() - cpu.view(torch.uint8).int()).abs().max() <= 1
