"""The checks and planners on random layouts, with no GPU: every call either gets a plan the kernels can
run (a compiled variant, launch limits, alignment for 16-byte accesses, shared memory within the GPU's)
or a TypeError/ValueError that names the argument, under the reference launch profile or any other whose choices
lie in their ranges. What the plans compute is the GPU tests' job."""

import dataclasses
import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cupyrope._runtime.arrays import FLOAT_DTYPES, ITEMSIZE, Array  # noqa: E402
from cupyrope._runtime.checks import IN_PLACE, NEW, OUT, output_mode  # noqa: E402
from cupyrope.ops import all_variants, layernorm, profiles, qk_norm_rope, rmsnorm, rmsnorm_fp8, rope  # noqa: E402
from cupyrope.ops.rmsnorm_plan_fp8 import TOKEN_SCALE, walks_rows  # noqa: E402
from cupyrope.ops import rmsnorm_plan_backward as backward  # noqa: E402
from cupyrope.ops.rmsnorm_rows import STATIC_SHARED_BYTES  # noqa: E402
from cupyrope.ops.rope_plan import _TAIL, NORM_POINTERS  # noqa: E402
from fakes import PLANNING_PROFILE, stand_in_for_the_device  # noqa: E402
from helpers import layer_norm_fwd_max_threads  # noqa: E402

BASE = 0x7F0000000000
VARIANTS = {name for _, name in all_variants()}
SHARED_OPTIN = 99 * 1024  # an L4's or RTX 4090's: below the H100's, so the limit shows
DEFAULT_SHARED = 48 * 1024  # what a kernel gets without opting in (the RoPE kernels do not)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ARGUMENTS = ("x:", "q:", "k:", "positions:", "cos_sin_cache:", "cos:", "sin:", "freq_step:", "out:", "out[0]:",
             "out[1]:", "rotary_dim:", "impl:", "weight:", "residual:", "dy:", "rstd:", "eps:", "group_size:", "bias:",
             "mean:", "q_weight:", "k_weight:", "dq:", "dk:", "cu_seqlens:", "seqlen_offsets:", "mrope_section:",
             "mrope_interleaved:")


BLOCKS_PER_WAVE = 132 * 2


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """The device queries the planners make, answered as an H100-like GPU with an L4's shared memory."""
    stand_in_for_the_device(monkeypatch.setattr, shared_optin=SHARED_OPTIN, blocks_per_wave=BLOCKS_PER_WAVE,
                            resident_clusters=lambda split: 132 // split)


def mostly(usual, anything):
    """`usual` four times in five, else `anything` (one_of would take each half the time)."""
    return st.integers(0, 4).flatmap(lambda i: anything if i == 0 else usual)


@st.composite
def launch_profiles(draw):
    """The planning tests' profile, or one whose every choice is drawn from its range (its ends, mostly)."""
    reference = PLANNING_PROFILE
    if draw(st.booleans()):
        return reference
    sections = {}
    for name in profiles.SECTIONS:
        choices = getattr(reference, name)
        values = {}
        for field in dataclasses.fields(choices):
            if field.type in (bool, "bool"):
                values[field.name] = draw(st.booleans())
            else:
                low, high = field.metadata["range"]
                ends = st.sampled_from([low, high, getattr(choices, field.name)])
                values[field.name] = draw(mostly(ends, st.integers(low, high)))
        sections[name] = dataclasses.replace(choices, **values)
    return dataclasses.replace(reference, **sections)


@st.composite
def arrays(draw, shape, dtype, ptr, padded=True):
    """An Array of `shape`: contiguous, or with each dimension's stride padded (last one contiguous),
    possibly offset from a 16-byte boundary by a few elements."""
    padded = padded and draw(st.sampled_from([False, False, True]))
    strides, step = [], 1
    for i, n in enumerate(reversed(shape)):
        strides.insert(0, step)
        pad = draw(st.sampled_from([0, 1, 8, 64])) if padded and i < len(shape) - 1 else 0
        step = step * max(n, 1) + pad
    offset = draw(st.sampled_from([0] * 5 + [1, 2, 4])) * ITEMSIZE[dtype]
    return Array(None, "cupy", ptr + offset, dtype, tuple(shape), tuple(strides), 0)


def aligned_16(a):
    """16-byte accesses are possible: the pointer and the stride of every dimension that has one are
    multiples of 16 bytes."""
    return a.ptr % 16 == 0 and all(s * ITEMSIZE[a.dtype] % 16 == 0 for n, s in zip(a.shape[:-1], a.strides[:-1]) if n > 1)


def assert_clear_error(error):
    assert str(error).startswith(ARGUMENTS), f"error does not name an argument: {error}"
    event(f"refused: {str(error).split(':')[0]}")


def plan_or_refusal(profile, make_plan):
    """make_plan()'s plan under the launch profile `profile`, or None where the call was refused with a TypeError or
    ValueError that names the argument."""
    with profiles.planning_with(profile):
        try:
            return make_plan()
        except (TypeError, ValueError) as error:
            assert_clear_error(error)
            return None


def assert_launchable(plan, what, max_threads):
    """A plan of a compiled variant, noted as `what`, whose grid, block (at most max_threads) and shared memory the
    GPU takes."""
    event(f"planned: {plan.name.split('<')[0].removeprefix('cupyrope::')}, {what}")
    assert plan.name in VARIANTS, plan.name
    assert 1 <= plan.grid < 2**31 and 1 <= math.prod(plan.block) <= max_threads
    assert plan.shared_mem <= SHARED_OPTIN - STATIC_SHARED_BYTES


def assert_runnable_rope(plan, arrays_, cache=None, style="neox"):
    event(f"planned: {plan.name.split('<')[0].removeprefix('cupyrope::')}, vectorized {plan.vectorized}")
    assert plan.name in VARIANTS, plan.name
    assert 1 <= plan.grid < 2**31 and 1 <= plan.block[0] <= 1024
    assert plan.shared_mem <= DEFAULT_SHARED
    if "rope_direct_kernel" in plan.name:
        assert plan.grid * plan.block[0] < 2**31  # the kernel's unsigned thread index
    if plan.vectorized:
        assert all(aligned_16(a) for a in arrays_)
        if cache is not None and "rope_direct_kernel" in plan.name:  # an item's cos/sin read as two packs
            freqs = 16 // ITEMSIZE[arrays_[0].dtype] // (2 if style == "gptj" else 1)
            pack = min(16, freqs * ITEMSIZE[cache.dtype])
            assert cache.ptr % pack == 0 and cache.strides[0] * ITEMSIZE[cache.dtype] % pack == 0
    assert len(plan.tail) == len(NORM_POINTERS) + _TAIL.size


@st.composite
def rope_calls(draw, qk=False):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    head_dim = draw(mostly(st.sampled_from([2, 8, 16, 64, 80, 96, 128, 256]), st.integers(1, 130)))
    lead = draw(st.lists(st.sampled_from([1, 2, 3, 7, 40, 100]), min_size=1, max_size=3))
    heads = draw(st.integers(1, 9))
    rotary_dim = draw(mostly(st.sampled_from([None, head_dim, max(2, 2 * (head_dim // 4))]), st.integers(0, 140)))
    x = draw(arrays((*lead, heads, head_dim), dtype, BASE))
    # positions: x's leading dimensions from the left (some of them 1, broadcast), the heads too at times
    pos_shape = [n if draw(st.booleans()) else 1 for n in lead] + ([1] if draw(st.booleans()) else [])
    positions = draw(arrays(pos_shape, draw(st.sampled_from(["int32", "int64"])), BASE + 2**32, padded=False))
    cache = None
    if draw(st.booleans()):
        width = draw(mostly(st.just(rotary_dim or head_dim), st.sampled_from([head_dim, 2 * head_dim, 7])))
        cache_dtype = draw(st.sampled_from(["float32", dtype]))
        cache = draw(arrays((draw(st.integers(1, 5000)), width), cache_dtype, BASE + 2**33))
    options = dict(theta=draw(st.sampled_from([10000.0, 500000.0])), style=draw(st.sampled_from(["neox", "gptj"])),
                   rotary_dim=rotary_dim, inverse=draw(st.booleans()),
                   impl=draw(st.sampled_from(["auto", "auto", "scalar", "vector"])))
    if qk:
        k = draw(arrays((*lead, draw(st.integers(1, 4)), head_dim), dtype, BASE + 2**31))
        return x, k, positions, cache, options
    out = draw(st.sampled_from(["none", "x", "other"]))
    out = {"none": None, "x": x}.get(out) or draw(arrays(x.shape, dtype, BASE + 2**30))
    return x, positions, cache, out, options


def position_sources(data, positions, head_dim, rotary_dim):
    """A call's positions as drawn (rope_calls'), or M-RoPE's rows of them with its sections (mostly three rows and
    sections adding up to rotary_dim / 2), or packed sequences: (source, positions, cu_seqlens, seqlen_offsets,
    mrope_section, mrope_interleaved)."""
    source = data.draw(st.sampled_from(["positions", "positions", "mrope", "varlen"]))
    if source == "mrope":
        rows = data.draw(mostly(st.just(3), st.sampled_from([1, 2, 4])))
        positions = data.draw(arrays((rows, *positions.shape), positions.dtype, BASE + 2**32, padded=False))
        half = (rotary_dim or head_dim) // 2
        t = data.draw(st.integers(0, max(half, 0)))
        h = data.draw(st.integers(0, max(half - t, 0)))
        section = data.draw(mostly(st.just([t, h, half - t - h]), st.lists(st.integers(-1, 40), max_size=4)))
        return source, positions, None, None, section, data.draw(st.booleans())
    if source == "varlen":
        n_seqs = data.draw(st.integers(0, 5))
        cu_seqlens = data.draw(arrays((n_seqs + 1,), data.draw(mostly(st.just("int32"), st.just("int64"))),
                                      BASE + 2**32, padded=False))
        seqlen_offsets = None
        if data.draw(st.booleans()):
            seqlen_offsets = data.draw(arrays((max(n_seqs, 1),), data.draw(st.sampled_from(["int32", "int64"])),
                                              BASE + 2**32 + 2**20, padded=False))
        return source, None, cu_seqlens, seqlen_offsets, None, False
    return source, positions, None, None, None, False


@SETTINGS
@given(rope_calls(), st.data(), launch_profiles())
def test_rope_plans_are_runnable_or_refused_clearly(call, data, profile):
    x, positions, cache, out, options = call
    source, positions, cu_seqlens, offsets, section, interleaved = position_sources(data, positions, x.shape[-1],
                                                                                    options["rotary_dim"])
    event(f"positions: {source}")
    def make_plan():
        mode = output_mode(out, x)
        return rope._plan_rope_call(x, positions, cache, out if mode == OUT else None, cu_seqlens, offsets, mode,
                                    cache is None, **options, section=section, interleaved=interleaved)

    plan = plan_or_refusal(profile, make_plan)
    if plan is not None:
        assert_runnable_rope(plan, [x, out or x], cache, options["style"])


@SETTINGS
@given(rope_calls(qk=True), st.booleans(), st.data(), launch_profiles())
def test_rope_qk_plans_are_runnable_or_refused_clearly(call, new, data, profile):
    """In place, or into new arrays (out="new": the planner describes them as contiguous)."""
    q, k, positions, cache, options = call
    source, positions, cu_seqlens, offsets, section, interleaved = position_sources(data, positions, q.shape[-1],
                                                                                    options["rotary_dim"])
    event(f"positions: {source}")
    plan = plan_or_refusal(profile, lambda: rope._plan_rope_qk_call(
        q, k, positions, cache, None, None, cu_seqlens, offsets, NEW if new else IN_PLACE, cache is None, **options,
        section=section, interleaved=interleaved))
    if plan is None:
        return
    assert_runnable_rope(plan, [q, k], cache, options["style"])
    assert len(plan.new_output) == 2 if new else not hasattr(plan, "new_output")
    assert plan.disjoint == ([] if new else [(0, 2)])  # in place: q against k, per call


@SETTINGS
@given(rope_calls(qk=True), st.data(), launch_profiles())
def test_rope_qk_cos_sin_plans_are_runnable_or_refused_clearly(call, data, profile):
    """Per-token cos/sin tensors in place of positions: leading dimensions like positions', the
    frequencies one or two columns apart, sin laid out like cos (or not)."""
    q, k, positions, _, options = call
    freq_step = data.draw(mostly(st.sampled_from([1, 2]), st.sampled_from([0, 3])))
    width = data.draw(mostly(st.just(freq_step * (options["rotary_dim"] or q.shape[-1]) // 2), st.integers(1, 140)))
    table_dtype = data.draw(st.sampled_from(["float32", q.dtype, "float16"]))
    cos = data.draw(arrays((*positions.shape, width), table_dtype, BASE + 2**33))
    sin = Array(None, "cupy", BASE + 2**34 + cos.ptr % 16, table_dtype, cos.shape, cos.strides, 0)
    if data.draw(st.integers(0, 9)) == 0:
        sin = data.draw(arrays(cos.shape, table_dtype, BASE + 2**34))
    options = dict(rotary_dim=options["rotary_dim"], freq_step=freq_step, style=options["style"],
                   inverse=options["inverse"], impl=options["impl"])
    plan = plan_or_refusal(profile, lambda: rope._plan_rope_cos_sin_call(q, k, cos, sin, None, None, IN_PLACE,
                                                                         **options))
    if plan is None:
        return
    assert "TokenRows" in plan.name
    assert_runnable_rope(plan, [q, k])


@SETTINGS
@given(rope_calls(qk=False), st.data(), launch_profiles())
def test_rope_cos_sin_plans_are_runnable_or_refused_clearly(call, data, profile):
    """One tensor by per-token cos/sin tensors (Gemma 3n's and Gemma 4's call), in place or out of place."""
    x, positions, _, _, options = call
    freq_step = data.draw(st.sampled_from([1, 2]))
    cos = data.draw(arrays((*positions.shape, freq_step * (options["rotary_dim"] or x.shape[-1]) // 2),
                           data.draw(st.sampled_from(["float32", x.dtype])), BASE + 2**33))
    sin = Array(None, "cupy", BASE + 2**34 + cos.ptr % 16, cos.dtype, cos.shape, cos.strides, 0)
    mode = data.draw(st.sampled_from([IN_PLACE, NEW]))
    plan = plan_or_refusal(profile, lambda: rope._plan_rope_cos_sin_one_call(
        x, cos, sin, None, mode, options["rotary_dim"], freq_step, options["style"], options["inverse"],
        options["impl"]))
    if plan is None:
        return
    assert "TokenRows" in plan.name
    assert_runnable_rope(plan, [x])
    assert plan.disjoint == ([] if mode == NEW else [(2, 1), (3, 1)])  # cos and sin against what is written


def test_rope_cos_sin_never_writes_over_cos_or_sin():
    """In place x, out of place out, must not hold cos or sin (checked per call)."""
    import cupyrope
    from fakes import FakeCupyArray

    x = FakeCupyArray((3, 2, 64))
    cos, sin = FakeCupyArray((3, 1, 64), ptr=BASE + 2**31), FakeCupyArray((3, 1, 64), ptr=BASE + 2**32)
    inside_x = FakeCupyArray((3, 1, 64), ptr=BASE + 64 * 4)  # x's second head of the first token
    with pytest.raises(ValueError, match="overlaps cos"):
        cupyrope.rope_cos_sin(x, inside_x, sin, out=x)
    with pytest.raises(ValueError, match="overlaps sin"):
        cupyrope.rope_cos_sin(x, cos, sin, out=FakeCupyArray((3, 2, 64), ptr=BASE + 2**32))


def test_rope_qk_cos_sin_never_writes_over_cos_or_sin():
    """cos and sin are read by every head of their token while q and k are written: in place, q and k
    must not overlap them (checked per call: the pointers change between calls of one plan)."""
    import cupyrope
    from fakes import FakeCupyArray

    q, k = FakeCupyArray((3, 2, 64)), FakeCupyArray((3, 2, 64), ptr=BASE + 2**30)
    cos, sin = FakeCupyArray((3, 1, 64), ptr=BASE + 2**31), FakeCupyArray((3, 1, 64), ptr=BASE + 2**32)
    inside_q = FakeCupyArray((3, 1, 64), ptr=BASE + 64 * 4)  # q's second head of the first token
    with pytest.raises(ValueError, match="q: overlaps cos"):
        cupyrope.rope_qk_cos_sin(q, k, inside_q, sin)
    with pytest.raises(ValueError, match="out\\[1\\]: overlaps sin"):
        cupyrope.rope_qk_cos_sin(q, k, cos, sin, out=(FakeCupyArray((3, 2, 64), ptr=BASE + 2**33),
                                                      FakeCupyArray((3, 2, 64), ptr=BASE + 2**32)))


def assert_runnable_norm(plan, arrays_):
    if plan.grid:
        event(f"planned: {plan.name.split('<')[0].removeprefix('cupyrope::')}, vectorized {plan.vectorized}, "
              f"shifted {plan.shifted}")
    assert plan.name in VARIANTS, plan.name
    assert 1 <= plan.grid < 2**31 and 1 <= plan.block[0] * plan.block[1] <= 1024
    assert plan.grid % plan.split == 0 and (plan.split == 1 or plan.block[1] == 1)  # whole clusters, one row a block
    dtype, _, _, slots, add = plan.name.split("<")[1].split(", ")[:5]
    if plan.name.startswith("cupyrope::rms_norm_fwd<") and add == "true" and dtype != "float" and int(slots) >= 4:
        assert plan.block[0] * plan.block[1] <= 512  # the fp16/bf16 fused add stays at 512 threads (FWD_MAX_WIDTH)
    if plan.split >= backward.CLASS_WALK_MIN_SPLIT and plan.shifted and plan.name.startswith("cupyrope::rms_norm_bwd"):
        assert plan.block[0] <= backward.CLASS_WALK_MAX_THREADS  # its launch bound
        assert plan.grid // plan.split <= math.prod(arrays_[0].shape[:-1])  # no cluster without rows
    assert plan.shared_mem <= SHARED_OPTIN - STATIC_SHARED_BYTES
    if plan.vectorized and not plan.shifted:
        assert all(aligned_16(a) for a in arrays_ if a is not None)
    rows = math.prod(arrays_[0].shape[:-1])
    step = plan.grid // plan.split * plan.block[1]  # rows between a rows slot's rows
    # A rows slot's sums over rows of one shift (the split backward on 4+ blocks walks its rows class by class)
    walks = plan.split >= backward.CLASS_WALK_MIN_SPLIT
    if plan.shifted and plan.name.startswith("cupyrope::rms_norm_bwd") and not walks and step < rows:
        assert step % (16 // ITEMSIZE[arrays_[0].dtype]) == 0, plan


@st.composite
def norm_calls(draw):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    hidden = draw(mostly(st.sampled_from([1, 61, 64, 130, 1027, 2048, 4096, 8191, 16384, 24577, 32767, 40961, 65536]),
                         st.integers(1, 3000)))
    lead = draw(st.lists(st.sampled_from([1, 7, 64, 300, 8192]), min_size=1, max_size=2))
    x = draw(arrays((*lead, hidden), dtype, BASE))
    weight_dtype = draw(st.sampled_from([None, "float32", dtype, dtype, "float16"]))
    weight = None if weight_dtype is None else draw(arrays((hidden,), weight_dtype, BASE + 2**33, padded=False))
    other = draw(arrays(x.shape, dtype, BASE + 2**31))
    eps = draw(st.sampled_from([1e-6, 1e-5, 1e-6, 1e-5, 1e-6, 0.0]))
    return x, weight, other, eps, draw(st.sampled_from([0.0, 1.0])), draw(st.sampled_from(["auto", "scalar", "vector"]))


@SETTINGS
@given(norm_calls(), st.sampled_from(["forward", "fused add", "add", "backward", "residual backward"]),
       launch_profiles())
def test_rms_norm_plans_are_runnable_or_refused_clearly(call, op, profile):
    x, weight, other, eps, offset, impl = call
    grad = None if op != "residual backward" else Array(None, "cupy", BASE + 2**32 + (x.ptr - BASE), x.dtype, x.shape,
                                                       x.strides, 0)  # x's layout elsewhere
    def make_plan():
        if op == "forward":
            return rmsnorm._plan_forward_call(x, weight, other, OUT, weight is None, eps, offset, True, impl)
        if op == "fused add":
            return rmsnorm._plan_fused_add_call(x, other, weight, weight is None, eps, offset, impl)
        if op == "add":
            return rmsnorm._plan_add_call(x, other, weight, weight is None, eps, offset, True, impl)
        return rmsnorm._plan_backward_call(other, x, weight, None, grad, weight is None, True, grad is None, eps,
                                           offset, impl)

    plan = plan_or_refusal(profile, make_plan)
    if plan is not None:
        assert_runnable_norm(plan, [x, other, grad, weight])


def test_rope_qk_out_of_place_reads_overlapping_inputs_but_never_writes_overlapping_outputs():
    """Out of place, q and k are only read: views of one tensor that no stride rule can tell apart (here
    the same array) are fine. The outputs are written: they must not overlap each other."""
    q, pos = Array(None, "cupy", BASE, "float32", (3, 2, 64), (128, 64, 1), 0), Array(
        None, "cupy", BASE + 2**32, "int64", (3,), (1,), 0)
    out = Array(None, "cupy", BASE + 2**30, "float32", (3, 2, 64), (128, 64, 1), 0)
    other = Array(None, "cupy", BASE + 2**31, "float32", (3, 2, 64), (128, 64, 1), 0)
    options = dict(theta=1e4, style="neox", rotary_dim=None, inverse=False, impl="auto")
    assert rope._plan_rope_qk_call(q, q, pos, None, out, other, None, None, OUT, True, **options).grid
    with pytest.raises(ValueError, match="out\\[1\\]: overlaps out\\[0\\]"):
        rope._plan_rope_qk_call(q, q, pos, None, out, out, None, None, OUT, True, **options)
    new = rope._plan_rope_qk_call(q, q, pos, None, None, None, None, None, NEW, True, **options)  # out="new": fresh memory
    assert new.grid and len(new.new_output) == 2 and new.disjoint == []
    with pytest.raises(ValueError, match="k: overlaps q"):  # in place
        rope._plan_rope_qk_call(q, q, pos, None, None, None, None, None, IN_PLACE, True, **options)


@SETTINGS
@given(norm_calls(), st.sampled_from(["static", "token", 64, 128]), st.booleans(), st.booleans(), launch_profiles())
def test_rms_norm_fp8_plans_are_runnable_or_refused_clearly(call, mode, add, out, profile):
    """rms_norm_fp8's plans: a compiled variant; rows covered by their threads' chunks (or read again on 512 threads);
    a quantization group's lanes within one row; 16-byte accesses only where x, residual and the weight are 16-byte
    aligned and y's rows are aligned to a chunk's bytes."""
    x, weight, other, eps, offset, impl = call
    scale = Array(None, "cupy", BASE + 2**34, "float32", (1,), (1,), 0)
    y = Array(None, "cupy", BASE + 2**35 + (x.ptr - BASE) // ITEMSIZE[x.dtype], "uint8", x.shape, x.strides, 0)
    group_size = mode if isinstance(mode, int) else None
    plan = plan_or_refusal(profile, lambda: rmsnorm_fp8._plan_call(
        x, weight, other if add else None, scale if mode == "static" else None, None, y if out else None,
        weight is None, not add, mode != "static", True, not out, group_size, eps, offset, impl))
    if plan is None or not plan.grid:
        return
    assert_launchable(plan, f"vectorized {plan.vectorized}, slots {plan.slots}", 512)
    hidden, elems = x.shape[-1], 16 // ITEMSIZE[x.dtype]
    width = plan.block[0]
    assert width * plan.slots * elems >= hidden if plan.slots else width == 512
    row_blocks = -(-math.prod(x.shape[:-1]) // plan.block[1])
    if walks_rows(plan, other if add else None):
        assert plan.grid == min(row_blocks, BLOCKS_PER_WAVE)  # the blocks the (stand-in) GPU holds walk the rows
    else:
        assert plan.grid == row_blocks
    if group_size:
        lanes = group_size // elems
        assert width >= lanes and width % lanes == 0
        assert plan.name.endswith(f", {group_size}>")
    else:
        assert plan.name.endswith(f", {0 if mode == 'static' else TOKEN_SCALE}>")
    if plan.vectorized:
        assert all(aligned_16(a) for a in (x, other if add else None, weight) if a is not None)
        y_out = y if out else None
        assert y_out is None or (y_out.ptr % elems == 0 and all(s % elems == 0 for n, s in zip(y_out.shape[:-1],
                                                                                            y_out.strides[:-1]) if n > 1))


@SETTINGS
@given(norm_calls(), st.sampled_from(["forward", "forward out", "fused add", "backward", "backward, stats"]),
       st.sampled_from(["weight", "bias", "both", "neither"]), st.data(), launch_profiles())
def test_layer_norm_plans_are_runnable_or_refused_clearly(call, op, params, data, profile):
    """layer_norm's plans: a compiled variant within its launch bounds (forward rows of 4+ register slots up to 1024
    threads, but 16-byte rows of 8 up to 512, others and the backward up to 512), shared memory within the GPU's, a row's chunks covered by its
    threads' slots (a split row's over its cluster's blocks), 16-byte accesses only where every array the call reads
    or writes is aligned (shifted rows aside);
    the backward's grid no more blocks than rows need."""
    x, weight, other, eps, _, impl = call
    if weight is not None and params in ("bias", "neither"):
        weight = None
    bias = None
    if params in ("bias", "both"):
        bias_dtype = weight.dtype if weight is not None and data.draw(st.integers(0, 9)) else \
            data.draw(st.sampled_from(["float32", x.dtype]))
        bias = data.draw(arrays((x.shape[-1],), bias_dtype, BASE + 2**36, padded=False))
    rows = math.prod(x.shape[:-1])
    stats = [Array(None, "cupy", BASE + 2**37 + i * 2**30, "float32", x.shape[:-1],
                   tuple(math.prod(x.shape[1 + j:-1]) for j in range(len(x.shape) - 1)), 0) for i in range(2)]
    def make_plan():
        if op.startswith("forward"):
            out, mode = (other, OUT) if op == "forward out" else (None, NEW)
            return layernorm._plan_forward_call(x, weight, bias, out, mode, weight is None, bias is None, eps, True,
                                                impl)
        if op == "fused add":
            return layernorm._plan_fused_add_call(x, other, weight, bias, weight is None, bias is None, eps, impl)
        mean, rstd = stats if op == "backward, stats" else (None, None)
        return layernorm._plan_backward_call(other, x, weight, bias, mean, rstd, weight is None, bias is None,
                                             mean is None, rstd is None, eps, impl)

    plan = plan_or_refusal(profile, make_plan)
    if plan is None or not plan.grid:
        return
    assert_launchable(plan, f"vectorized {plan.vectorized}, slots {plan.slots}",
                      layer_norm_fwd_max_threads(plan) if "_fwd<" in plan.name else 512)
    if plan.slots:  # rows split over a cluster: each block a part
        assert plan.split * plan.block[0] * plan.slots * (16 // ITEMSIZE[x.dtype] if plan.vectorized else 1) >= \
            x.shape[-1]
    if "_bwd<" in plan.name:
        assert plan.grid <= max(1, -(-rows // plan.block[1]))  # no block without a row
    used = {"forward": (x, weight, bias), "forward out": (x, other, weight, bias), "fused add": (x, other, weight, bias),
            "backward": (x, other, weight), "backward, stats": (x, other, weight)}[op]  # bias: its dtype alone
    if plan.vectorized and not plan.shifted:
        assert all(aligned_16(a) for a in used if a is not None)


@SETTINGS
@given(rope_calls(qk=True), st.sampled_from(["in place", "new", "backward"]), st.data(), launch_profiles())
def test_qk_norm_rope_plans_are_runnable_or_refused_clearly(call, op, data, profile):
    """qk_norm_rope's forward (in place, into new arrays) and backward plans: a compiled variant, launch limits,
    shared memory within the GPU's, 16-byte accesses only where q and k (and dq, dk) are 16-byte aligned; the
    backward's partial rows of the weight gradients at least one. Positions, or M-RoPE's three rows of them with
    its sections, or packed sequences (cu_seqlens, perhaps with seqlen_offsets)."""
    q, k, positions, cache, options = call
    head_dim = q.shape[-1]
    source, positions, cu_seqlens, seqlen_offsets, section, interleaved = position_sources(data, positions, head_dim,
                                                                                          options["rotary_dim"])
    weight_dtype = data.draw(st.sampled_from(["float32", q.dtype, "float16"]))
    q_weight = data.draw(arrays((head_dim,), weight_dtype, BASE + 2**36, padded=False))
    k_weight = data.draw(arrays((head_dim,), data.draw(mostly(st.just(weight_dtype), st.just("float32"))),
                                BASE + 2**37, padded=False))
    eps = data.draw(st.sampled_from([1e-6, 1e-6, 1e-6, 1e-5, 0.0]))
    rope_options = (eps, 0.0, options["theta"], options["style"], options["rotary_dim"], options["impl"], section,
                    interleaved, rope._absent(positions, cu_seqlens, seqlen_offsets))
    written = []
    if op == "backward":
        written = [data.draw(arrays(a.shape, a.dtype, BASE + 2**38 + i * 2**32)) for i, a in enumerate((q, k))]

    def make_plan():
        if op == "backward":
            return qk_norm_rope._plan_backward_call(*written, q, k, q_weight, k_weight, positions, cache, cu_seqlens,
                                                    seqlen_offsets, cache is None, *rope_options)
        return qk_norm_rope._plan_forward_call(q, k, q_weight, k_weight, positions, cache, None, None, cu_seqlens,
                                               seqlen_offsets, NEW if op == "new" else IN_PLACE, cache is None,
                                               *rope_options)

    plan = plan_or_refusal(profile, make_plan)
    if plan is None or not plan.grid:
        return
    assert_launchable(plan, f"{source}, vectorized {plan.vectorized}", 1024)
    if plan.vectorized:
        assert all(aligned_16(a) for a in [q, k, *written])
    if op == "backward":
        assert plan.partial_rows >= 1
