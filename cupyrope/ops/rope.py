"""RoPE's public functions: rope, rope_, rope_qk, rope_cos_sin, rope_qk_cos_sin and rope_cache.

A call finds its plan (the one preamble: _runtime/plan_cache.py), which a first call makes by checking its
arguments (rope_checks.py) and planning (rope_plan.py), then launches with its own pointers.
"""

from .._runtime import checks
from .._runtime.checks import IN_PLACE, NEW, OUT
from .._runtime.arrays import FLOAT_DTYPES, allocator, contiguous_like, numpy_dtype
from .._runtime.compile import get_kernel
from .._runtime.device import sm_count
from .._runtime.launch import Launch
from .._runtime.plan_cache import EmptyPlan, OpPlans
from . import profiles, rope_checks
from .rope_plan import ROPE_POINTERS, SOURCE, plan_rope

def rope(x, positions=None, *, theta=10000.0, style="neox", rotary_dim=None, cos_sin_cache=None, inverse=False,
         out=None, impl="auto", cu_seqlens=None, seqlen_offsets=None, mrope_section=None, mrope_interleaved=False):
    """Rotary position embedding of ``x`` (..., head_dim) at ``positions``.

    positions: int32/int64, shape matching x's leading dimensions aligned from the left (size-1
    dimensions broadcast), e.g. x (T, H, D) with positions (T,), or x (B, H, S, D) with (B, 1, S).
    style: "neox" (pairs i, i + r/2) or "gptj" (pairs 2i, 2i + 1). rotary_dim: even, <= head_dim; the
    features past it are copied (out of place) or left alone (in place). cos/sin are computed in the
    kernel from theta (exact to fp32 rounding) unless ``cos_sin_cache`` (max_position, rotary_dim) is
    given (cos half, then sin half; fp32 or x's dtype); rotated features of positions outside
    [0, max_position) become NaN. inverse=True rotates by -angle (the backward of RoPE).
    out=x rotates in place. Returns ``out`` (a new array of x's kind when out is None).

    M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``mrope_section=[t, h, w]`` (frequencies, adding up to
    rotary_dim / 2) with positions of shape (3, ...): frequency f takes its position from the row of its section,
    the sections in order, or with ``mrope_interleaved=True`` Qwen3-VL's assignment (h at f % 3 == 1 below 3h,
    w at f % 3 == 2 below 3w, t elsewhere).

    Packed sequences (varlen): ``cu_seqlens`` (int32, (n_seqs + 1,): where each sequence starts in x's first
    dimension, then the end) instead of positions, and optional ``seqlen_offsets`` (int32/int64, (n_seqs,): each
    sequence's first position, e.g. a cached prefix). Token t of sequence s is at position
    t - cu_seqlens[s] + seqlen_offsets[s]. A token outside [cu_seqlens[0], cu_seqlens[-1]), or where cu_seqlens
    does not increase, has no sequence: its rotated features become NaN; nothing is read or written out of bounds.
    """
    mode = NEW if out is None else IN_PLACE if out is x else OUT
    plan, (x_ptr, p_ptr, c_ptr, o_ptr, s_ptr, so_ptr) = _rope_plans.find(
        (x, positions, cos_sin_cache, out if mode == OUT else None, cu_seqlens, seqlen_offsets),
        (mode, cos_sin_cache is None, theta, style, rotary_dim, inverse, impl, _section_key(mrope_section),
         mrope_interleaved, _absent(positions, cu_seqlens, seqlen_offsets)))
    out, o_ptr = checks.output_of(plan, mode, x, out, x_ptr, o_ptr)
    if plan.grid:
        plan.launch(x_ptr, o_ptr, x_ptr, o_ptr, p_ptr or s_ptr, c_ptr, so_ptr)
    return out


def _absent(*arrays) -> int:
    """Which of a call's position arrays are None, as bits: an option of its plan, so that a recalled call (whose
    guard checks only the arrays present) is one with the same arrays present."""
    return sum(1 << i for i, a in enumerate(arrays) if a is None)


def _section_key(section):
    """mrope_section as a hashable option (a list becomes a tuple; anything else is checked by the planner)."""
    return tuple(section) if isinstance(section, list) else section


def rope_(x, positions, **options):
    """In-place spelling of ``rope(x, positions, out=x, ...)``."""
    return rope(x, positions, out=x, **options)


def rope_qk(q, k, positions=None, *, theta=10000.0, style="neox", rotary_dim=None, cos_sin_cache=None,
            inverse=False, impl="auto", out=None, cu_seqlens=None, seqlen_offsets=None, mrope_section=None,
            mrope_interleaved=False):
    """Rotate q (..., Hq, head_dim) and k (..., Hk, head_dim) in one launch (options as in rope(), M-RoPE and
    varlen included). In place by default; out=(q_out, k_out) writes elsewhere, out="new" into new arrays. q and k
    may be strided views (e.g. column slices of a fused qkv tensor) as long as their last dimension is
    contiguous. Returns (q, k), or the outputs."""
    mode, q_out, k_out = _qk_outputs(out)
    plan, (q_ptr, k_ptr, p_ptr, c_ptr, qo_ptr, ko_ptr, s_ptr, so_ptr) = _rope_qk_plans.find(
        (q, k, positions, cos_sin_cache, q_out, k_out, cu_seqlens, seqlen_offsets),
        (mode, cos_sin_cache is None, theta, style, rotary_dim, inverse, impl, _section_key(mrope_section),
         mrope_interleaved, _absent(positions, cu_seqlens, seqlen_offsets)))
    return _launch_qk(plan, (q_ptr, k_ptr, p_ptr or s_ptr, c_ptr, qo_ptr, ko_ptr, so_ptr), q, k, mode, out)


def rope_cos_sin(x, cos, sin, *, rotary_dim=None, freq_step=1, style="neox", inverse=False, impl="auto", out=None):
    """Rotate one tensor x (..., head_dim) by per-token cos and sin tensors, as rope_qk_cos_sin rotates q and k: what
    the one-tensor ``apply_rotary_pos_emb(x, cos, sin)`` of Gemma 3n and Gemma 4 gets (cos/sin's leading dimensions
    match x's aligned from the left). out=x rotates in place. Returns ``out`` (a new array of x's kind when out is
    None)."""
    mode = NEW if out is None else IN_PLACE if out is x else OUT
    plan, (x_ptr, c_ptr, s_ptr, o_ptr) = _rope_cos_sin_one_plans.find(
        (x, cos, sin, out if mode == OUT else None), (mode, rotary_dim, freq_step, style, inverse, impl))
    out, o_ptr = checks.output_of(plan, mode, x, out, x_ptr, o_ptr)
    if plan.grid:
        _check_disjoint_slots(plan, (x_ptr, o_ptr, c_ptr, s_ptr))
        plan.launch(x_ptr, o_ptr, x_ptr, o_ptr, c_ptr, s_ptr, 0)
    return out


def rope_qk_cos_sin(q, k, cos, sin, *, rotary_dim=None, freq_step=1, style="neox", inverse=False, impl="auto",
                    out=None):
    """Rotate q and k (as in rope_qk) by per-token cos and sin tensors instead of positions: what
    transformers' ``apply_rotary_pos_emb`` gets (cupyrope.dropin builds on it). cos and sin have one
    shape, dtype (fp32 or q's) and strides: (..., columns), their leading dimensions matching q's and
    k's aligned from the left (size-1 dimensions broadcast, as positions do), frequency f's value at
    column f * freq_step (1: transformers' halves layout, whose second half repeats the first, or a
    (..., rotary_dim / 2) table; 2: the interleaved layout). rotary_dim defaults to head_dim. In place
    by default; out=(q_out, k_out) writes elsewhere, out="new" into new arrays. Returns (q, k), or the
    outputs."""
    mode, q_out, k_out = _qk_outputs(out)
    plan, pointers = _rope_cos_sin_plans.find(
        (q, k, cos, sin, q_out, k_out), (mode, rotary_dim, freq_step, style, inverse, impl))
    return _launch_qk(plan, (*pointers, 0), q, k, mode, out)


def _qk_outputs(out):
    """(mode, q_out, k_out) of a q+k call's ``out``: None (in place), "new" or a pair."""
    if out is None:
        return IN_PLACE, None, None
    if isinstance(out, str):
        if out != NEW:
            raise ValueError(f"out: expected None (in place), {NEW!r} or a pair (q_out, k_out), got {out!r}")
        return NEW, None, None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out: expected None (in place), {NEW!r} or a pair (q_out, k_out)")
    if out[0] is None or out[1] is None:
        raise TypeError("out: expected a pair of arrays (q_out, k_out), got None in it")
    return OUT, out[0], out[1]


def _launch_qk(plan, pointers, q, k, mode, out, *norm_pointers):
    """Launch a planned q+k call with its pointers (q, k, the cos/sin source's two, q_out, k_out, seqlen_offsets)
    and, for qk_norm_rope, the weights'; returns what the call returns. New outputs share memory with nothing: they
    skip the per-call overlap checks."""
    q_ptr, k_ptr, a_ptr, b_ptr, qo_ptr, ko_ptr, so_ptr = pointers
    if mode == NEW:
        new_q, new_k = plan.new_output
        (q_out, qo_ptr), (k_out, ko_ptr) = new_q(q), new_k(k)
        result = q_out, k_out
    elif mode == IN_PLACE:
        qo_ptr, ko_ptr, result = q_ptr, k_ptr, (q, k)
    else:
        result = tuple(out)
    if plan.grid:
        ptrs = (q_ptr, qo_ptr, k_ptr, ko_ptr, a_ptr, b_ptr)
        _check_disjoint_slots(plan, ptrs)
        plan.launch(*ptrs, so_ptr, *norm_pointers)
    return result


def _check_disjoint_slots(plan, ptrs) -> None:
    """The per-call checks of the pairs of a plan's pointer slots that must not share memory (plan.disjoint, set at
    planning with the slots' layouts and names): pointers change between calls of one plan."""
    extents, names = plan.extents, plan.slot_names
    for a, b in plan.disjoint:
        checks.check_disjoint(ptrs[a], extents[a], ptrs[b], extents[b], names[a], names[b], "pass separate memory")


# ------------------------------------------------------------------------------------------ planning


def _plan_rope_call(xa, pa, ca, oa, sa, soa, mode, _no_cache, theta, style, rotary_dim, inverse, impl, section=None,
                    interleaved=False, _absent_arrays=None):
    rotary_dim, rows, source = rope_checks.check_rope(
        xa, pa, ca, oa, theta=theta, style=style, rotary_dim=rotary_dim, inverse=inverse, impl=impl, cu_seqlens=sa,
        seqlen_offsets=soa, mrope_section=section, mrope_interleaved=interleaved)
    return _plan_one(xa, oa, mode, rows, ca, style=style, rotary_dim=rotary_dim, theta=theta, inverse=inverse,
                     impl=impl, source=source)


def _plan_one(xa, oa, mode, rows, cache, **options):
    """The plan of a checked one-tensor call (options: plan_rope's); its output x itself (IN_PLACE), the caller's
    (OUT, checked against x per call) or new (plan.new_output: its allocator)."""
    if not xa.size:
        plan = EmptyPlan()
    else:
        out = xa if mode == IN_PLACE else oa if mode == OUT else contiguous_like(xa, xa.shape, xa.dtype)
        plan = plan_rope([(xa, out)], rows, cache, n_sm=sm_count(xa.device),
                         choices=profiles.profile_for(xa.device).rope, in_place=mode == IN_PLACE, **options)
        if mode == OUT:
            plan.out_layouts = checks.out_layouts(xa, oa)
        _prepare_launch(plan, xa)
    plan.new_output = allocator(xa, xa.shape, xa.dtype)
    return plan


def _plan_rope_qk_call(qa, ka, pa, ca, qo, ko, sa, soa, mode, _no_cache, theta, style, rotary_dim, inverse, impl,
                       section=None, interleaved=False, _absent_arrays=None):
    rotary_dim, rows, source = rope_checks.check_rope_qk(
        qa, ka, pa, ca, theta=theta, style=style, rotary_dim=rotary_dim, inverse=inverse, impl=impl, cu_seqlens=sa,
        seqlen_offsets=soa, mrope_section=section, mrope_interleaved=interleaved)
    return _plan_qk(qa, ka, qo, ko, mode, (pa, ca), ("positions", "cos_sin_cache"), False, positions=rows, cache=ca,
                    style=style, rotary_dim=rotary_dim, theta=theta, inverse=inverse, impl=impl, source=source)


def _plan_rope_cos_sin_one_call(xa, cos, sin, oa, mode, rotary_dim, freq_step, style, inverse, impl):
    rotary_dim, rows = rope_checks.check_rope_cos_sin(xa, cos, sin, oa, rotary_dim=rotary_dim, freq_step=freq_step,
                                                      style=style, inverse=inverse, impl=impl)
    plan = _plan_one(xa, oa, mode, rows, cos, style=style, rotary_dim=rotary_dim, theta=10000.0, inverse=inverse,
                     impl=impl, freq_stride=freq_step * cos.strides[-1], sin=sin)
    if plan.grid:  # cos and sin may be views of anything: what is written (x in place, else out) must not hold them
        plan.slot_names = ("x", "out", "cos", "sin")
        written = xa if mode == IN_PLACE else oa
        plan.extents = tuple(None if a is None else checks.layout_key(a) for a in (xa, written, cos, sin))
        plan.disjoint = [] if mode == NEW else [(2, 1), (3, 1)]
    return plan


def _plan_rope_cos_sin_call(qa, ka, cos, sin, qo, ko, mode, rotary_dim, freq_step, style, inverse, impl):
    rotary_dim, rows = rope_checks.check_rope_qk_cos_sin(qa, ka, cos, sin, rotary_dim=rotary_dim,
                                                         freq_step=freq_step, style=style, inverse=inverse, impl=impl)
    return _plan_qk(qa, ka, qo, ko, mode, (cos, sin), ("cos", "sin"), True, positions=rows, cache=cos, style=style,
                    rotary_dim=rotary_dim, theta=10000.0, inverse=inverse, impl=impl,
                    freq_stride=freq_step * cos.strides[-1], sin=sin)


def _plan_qk(qa, ka, qo, ko, mode, sources, source_names, check_reads, planner=plan_rope,
             kernels=(SOURCE, ROPE_POINTERS), **options):
    """The plan of a checked q+k call (options: the planner's; kernels: its kernels' source file and pointers). New
    outputs (plan.new_output: their allocators) overlap nothing; otherwise the outputs (q and k in place) are
    checked here and the pairs that must not share memory (sources: the cos/sin source's two arrays) are set for
    the per-call checks."""
    if mode == NEW:
        qo, ko = (contiguous_like(a, a.shape, a.dtype) for a in (qa, ka))
    elif mode == IN_PLACE:
        qo, ko = qa, ka
        rope_checks.check_qk_outputs(qa, ka, None, None)
    else:
        rope_checks.check_qk_outputs(qa, ka, qo, ko)
    if not (qa.size or ka.size):
        plan = EmptyPlan()
    else:
        plan = planner([(qa, qo), (ka, ko)], n_sm=sm_count(qa.device),
                       choices=profiles.profile_for(qa.device).rope, in_place=mode == IN_PLACE, **options)
        _set_disjoint(plan, qa, ka, qo, ko, mode, sources, source_names, check_reads)
        _prepare_launch(plan, qa, *kernels)
    if mode == NEW:
        plan.new_output = tuple(allocator(a, a.shape, a.dtype) for a in (qa, ka))
    return plan


def _set_disjoint(plan, qa, ka, qo, ko, mode, sources, source_names, check_reads) -> None:
    """What _launch_qk checks per call: in place, q against k; out of place, the outputs against each other and
    against q and k; new outputs, nothing. check_reads: the cos/sin source against what is written too
    (positions and a cache are arrays of their own in practice; cos/sin may be views of anything)."""
    plan.slot_names = ("q", "out[0]", "k", "out[1]", *source_names)
    plan.extents = tuple(None if a is None else checks.layout_key(a) for a in (qa, qo, ka, ko, *sources))
    read = [4, 5] if check_reads else []
    if mode == NEW:
        plan.disjoint = []
    elif mode == IN_PLACE:
        plan.disjoint = [(0, 2)] + [(r, w) for w in (0, 2) for r in read]
    else:
        plan.disjoint = [(1, 3)] + [(r, w) for w in (1, 3) for r in [0, 2, *read]]


def _prepare_launch(plan, like, source=SOURCE, pointers=ROPE_POINTERS) -> None:
    kernel = get_kernel(source, plan.name, like.device)
    plan.launch = Launch(kernel, plan.grid, plan.block, pointers, plan.tail, like.device, like.kind, plan.shared_mem)


_rope_plans = OpPlans(("x", "positions", "cos_sin_cache", "out", "cu_seqlens", "seqlen_offsets"), _plan_rope_call,
                      optional=("positions", "cos_sin_cache", "out", "cu_seqlens", "seqlen_offsets"))
_rope_qk_plans = OpPlans(("q", "k", "positions", "cos_sin_cache", "out[0]", "out[1]", "cu_seqlens", "seqlen_offsets"),
                         _plan_rope_qk_call,
                         optional=("positions", "cos_sin_cache", "out[0]", "out[1]", "cu_seqlens", "seqlen_offsets"))
_rope_cos_sin_one_plans = OpPlans(("x", "cos", "sin", "out"), _plan_rope_cos_sin_one_call, optional=("out",))
_rope_cos_sin_plans = OpPlans(("q", "k", "cos", "sin", "out[0]", "out[1]"), _plan_rope_cos_sin_call,
                              optional=("out[0]", "out[1]"))


# ---------------------------------------------------------------------------------------------- tables


KINDS = ("cupy", "torch", "numpy")


def rope_cache(max_position, rotary_dim, theta=10000.0, *, scaling=None, dtype="float32", kind="cupy", device=None):
    """The (max_position, rotary_dim) cos/sin table in vLLM's layout (cos half, then sin half), computed in
    float64 and rounded once to ``dtype``. ``kind``: "cupy" (on CuPy's current device, or ``device``), "torch"
    (``device``: "cpu", "cuda", "cuda:1", an index or a torch.device; default the current CUDA device) or
    "numpy" (on the host). ``scaling``: a Hugging Face ``rope_scaling``/``rope_parameters`` dict for
    long-context models ("linear", "llama3" or "yarn"; see cupyrope.rope_scaling). A setup-time helper: the
    table is built on the host, then copied where it goes."""
    from .. import reference

    if not checks.is_int(max_position) or max_position < 1:
        raise ValueError(f"max_position: expected an int >= 1, got {max_position!r}")
    if not checks.is_int(rotary_dim) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even int >= 2, got {rotary_dim!r}")
    checks.check_positive(theta, "theta")
    dtype = str(dtype).removeprefix("torch.")  # a torch dtype too
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype!r}")
    checks.check_choice(kind, "kind", KINDS)
    # Round float64 -> dtype once, on the host (torch's double -> half cast rounds twice, via float).
    host = reference.rope_cache(int(max_position), int(rotary_dim), theta, scaling).astype(numpy_dtype(dtype))
    if kind == "numpy":
        if device not in (None, "cpu"):
            raise ValueError(f"device: a NumPy table lives on the host: expected None or 'cpu', got {device!r}")
        return host
    if kind == "torch":
        return _torch_table(host, dtype, device)
    return _cupy_table(host, device)


def _torch_table(host, dtype: str, device):
    import torch

    try:
        where = torch.device("cuda" if device is None else device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: expected 'cpu', 'cuda', 'cuda:N', an index or a torch.device, got {device!r} "
                         f"({error})") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {str(where)!r}, but torch has no CUDA device here (torch.cuda.is_available() is "
                         "False); pass device='cpu' for a CPU table")
    if where.type not in ("cuda", "cpu"):
        raise ValueError(f"device: expected a CPU or CUDA device, got {str(where)!r}")
    table = torch.from_numpy(host.view("uint16")).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(host)
    return table.to(where)


def _cupy_table(host, device):
    from .._runtime.compile import NoGPUError, device_count, import_cupy

    if device is not None and not checks.is_int(device):
        text = str(device)
        if not text.startswith("cuda:") or not text[5:].isdigit():
            raise ValueError(f"device: expected a CUDA device index (or 'cuda:N') for a CuPy table, got {device!r}")
        device = int(text[5:])
    try:
        count = device_count()
    except NoGPUError as error:
        raise NoGPUError(f"kind='cupy': {error}; for a table on the host pass kind='numpy' (or kind='torch', "
                         "device='cpu')") from None
    if device is not None and not 0 <= device < count:
        raise ValueError(f"device: expected a CUDA device index in [0, {count}), got {device}")
    cupy = import_cupy()
    with cupy.cuda.Device(device if device is not None else cupy.cuda.runtime.getDevice()):
        return cupy.asarray(host)
