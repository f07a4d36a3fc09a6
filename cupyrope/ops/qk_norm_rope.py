"""QK-norm + RoPE's public functions: qk_norm_rope and qk_norm_rope_backward.

A call finds its plan (the one preamble: _runtime/plan_cache.py), which a first call makes by checking its
arguments (qk_norm_rope_checks.py) and planning (qk_norm_rope_plan.py), then launches with its own pointers. The
q+k call machinery (outputs, overlap checks) is RoPE's (rope.py).
"""

from .._runtime.arrays import allocator, contiguous_like
from .._runtime.compile import allow_shared_memory, get_kernel
from .._runtime.device import resident_blocks, sm_count
from .._runtime.launch import Launch
from .._runtime.plan_cache import EmptyPlan, OpPlans
from . import profiles, qk_norm_rope_checks
from .rmsnorm import DW_TAIL
from .rmsnorm_plan_backward import DW_SPLIT, dweight_kernel_name
from .rmsnorm_plan_backward import SOURCE as DWEIGHT_SOURCE
from .qk_norm_rope_plan import SOURCE, cap_backward_grid, plan_qk_norm_rope
from .rope import _absent, _launch_qk, _plan_qk, _qk_outputs, _section_key
from .rope_plan import BLOCK_THREADS

POINTERS = 12  # RopeParams' (kernels_src/rope_common.cuh)


def qk_norm_rope(q, k, q_weight, k_weight, positions=None, *, eps=1e-6, offset=0.0, theta=10000.0, style="neox",
                 rotary_dim=None, cos_sin_cache=None, mrope_section=None, mrope_interleaved=False, cu_seqlens=None,
                 seqlen_offsets=None, out=None, impl="auto"):
    """QK-norm then RoPE in one launch: each head of q (..., Hq, head_dim) and of k (..., Hk, head_dim) becomes
    rope(x / sqrt(mean(x^2) + eps) * (weight + offset)), with q_weight / k_weight of shape (head_dim,) (float32
    or q's dtype, both the same) and offset=1.0 for Gemma's (1 + w). The norm covers all of head_dim, the rotation
    the first rotary_dim features. fp32 math, one rounding to q's dtype.

    Positions and the cos/sin source as in rope_qk: positions, a cos_sin_cache, M-RoPE (mrope_section with
    positions (3, ...)) or packed sequences (cu_seqlens, seqlen_offsets). q and k may be strided views (heads of a
    fused qkv tensor) with a contiguous last dimension; GQA's head counts may differ. In place by default;
    out=(q_out, k_out) writes elsewhere, out="new" into new arrays. Returns (q, k), or the outputs."""
    mode, q_out, k_out = _qk_outputs(out)
    plan, (q_ptr, k_ptr, qw_ptr, kw_ptr, p_ptr, c_ptr, qo_ptr, ko_ptr, s_ptr, so_ptr) = _forward_plans.find(
        (q, k, q_weight, k_weight, positions, cos_sin_cache, q_out, k_out, cu_seqlens, seqlen_offsets),
        (mode, cos_sin_cache is None, eps, offset, theta, style, rotary_dim, impl, _section_key(mrope_section),
         mrope_interleaved, _absent(positions, cu_seqlens, seqlen_offsets)))
    return _launch_qk(plan, (q_ptr, k_ptr, p_ptr or s_ptr, c_ptr, qo_ptr, ko_ptr, so_ptr), q, k, mode, out, qw_ptr,
                      kw_ptr, 0, 0, 0)


def qk_norm_rope_backward(dq, dk, q, k, q_weight, k_weight, positions=None, *, eps=1e-6, offset=0.0, theta=10000.0,
                          style="neox", rotary_dim=None, cos_sin_cache=None, mrope_section=None,
                          mrope_interleaved=False, cu_seqlens=None, seqlen_offsets=None, impl="auto"):
    """Gradients of qk_norm_rope: dq, dk (the gradients of its outputs) and q, k (its inputs, before the call;
    the options as given to it) -> (dq_in, dk_in, dq_weight, dk_weight). One launch for dq_in and dk_in, one more
    for the weight gradients, which are reduced in a fixed order: bitwise identical from run to run."""
    plan, (dq_ptr, dk_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, p_ptr, c_ptr, s_ptr, so_ptr) = _backward_plans.find(
        (dq, dk, q, k, q_weight, k_weight, positions, cos_sin_cache, cu_seqlens, seqlen_offsets),
        (cos_sin_cache is None, eps, offset, theta, style, rotary_dim, impl, _section_key(mrope_section),
         mrope_interleaved, _absent(positions, cu_seqlens, seqlen_offsets)))
    new_dq, new_dk, new_dweights = plan.new_grads
    (dq_in, dqi_ptr), (dk_in, dki_ptr), (dweights, dw_ptr) = new_dq(q), new_dk(k), new_dweights(q_weight)
    if not plan.grid:
        if len(dweights):
            dweights[...] = 0
        return dq_in, dk_in, dweights[0], dweights[1]
    partial, partial_ptr = plan.new_partial(q)
    plan.launch(dq_ptr, dqi_ptr, dk_ptr, dki_ptr, p_ptr or s_ptr, c_ptr, so_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr,
                partial_ptr)
    plan.dw_launch(partial_ptr, dw_ptr)
    return dq_in, dk_in, dweights[0], dweights[1]


# ------------------------------------------------------------------------------------------ planning


def _plan_forward_call(qa, ka, qwa, kwa, pa, ca, qo, ko, sa, soa, mode, _no_cache, eps, offset, theta, style,
                       rotary_dim, impl, section, interleaved, _absent_arrays):
    rotary_dim, rows, source = qk_norm_rope_checks.check_qk_norm_rope(
        qa, ka, qwa, kwa, pa, ca, eps=eps, offset=offset, theta=theta, style=style, rotary_dim=rotary_dim, impl=impl,
        cu_seqlens=sa, seqlen_offsets=soa, mrope_section=section, mrope_interleaved=interleaved)
    return _plan_qk(qa, ka, qo, ko, mode, (pa, ca), ("positions", "cos_sin_cache"), False, planner=_plan_forward,
                    kernels=(SOURCE, POINTERS), weights=(qwa, kwa), positions=rows, cache=ca, style=style,
                    rotary_dim=rotary_dim, theta=theta, eps=eps, offset=offset, impl=impl, source=source)


def _plan_forward(groups, *, weights, n_sm, choices, in_place, **options):
    """plan_qk_norm_rope as _plan_qk calls a planner (choices: the profile's "rope" section; every call writes the
    whole head, in place or not)."""
    profile = profiles.profile_for(groups[0][0].device)
    return plan_qk_norm_rope(groups, weights, n_sm=n_sm, choices=profile.qk_norm_rope, rope_choices=choices, **options)


def _plan_backward_call(dqa, dka, qa, ka, qwa, kwa, pa, ca, sa, soa, _no_cache, eps, offset, theta, style, rotary_dim,
                        impl, section, interleaved, _absent_arrays):
    rotary_dim, rows, source = qk_norm_rope_checks.check_qk_norm_rope(
        qa, ka, qwa, kwa, pa, ca, eps=eps, offset=offset, theta=theta, style=style, rotary_dim=rotary_dim, impl=impl,
        cu_seqlens=sa, seqlen_offsets=soa, mrope_section=section, mrope_interleaved=interleaved)
    qk_norm_rope_checks.check_gradients(dqa, dka, qa, ka)
    head_dim = qa.shape[-1]
    if not (qa.size or ka.size):
        plan = EmptyPlan()
    else:
        dq_in, dk_in = (contiguous_like(a, a.shape, a.dtype) for a in (qa, ka))
        device = qa.device
        profile = profiles.profile_for(device)
        plan = plan_qk_norm_rope([(dqa, dq_in), (dka, dk_in)], (qwa, kwa), positions=rows, cache=ca, style=style,
                                 rotary_dim=rotary_dim, theta=theta, eps=eps, offset=offset, impl=impl,
                                 n_sm=sm_count(device), choices=profile.qk_norm_rope, rope_choices=profile.rope,
                                 source=source, x_inputs=(qa, ka))
        kernel = get_kernel(SOURCE, plan.name, device)
        allow_shared_memory(kernel, plan.shared_mem)
        cap_backward_grid(plan, sm_count(device) * resident_blocks(kernel, BLOCK_THREADS, plan.shared_mem, device))
        plan.launch = Launch(kernel, plan.grid, plan.block, POINTERS, plan.tail, device, qa.kind, plan.shared_mem)
        dw_kernel = get_kernel(DWEIGHT_SOURCE, dweight_kernel_name(qwa.dtype), device)  # rms_norm_dw
        plan.dw_launch = Launch(dw_kernel, -(-2 * head_dim // 32), (32, DW_SPLIT), 2,
                                DW_TAIL.pack(plan.partial_rows, 2 * head_dim), device, qa.kind)
        plan.new_partial = allocator(qa, (plan.partial_rows, 2 * head_dim), "float32")
    plan.new_grads = (allocator(qa, qa.shape, qa.dtype), allocator(ka, ka.shape, ka.dtype),
                      allocator(qwa, (2, head_dim), qwa.dtype))
    return plan


_forward_plans = OpPlans(
    ("q", "k", "q_weight", "k_weight", "positions", "cos_sin_cache", "out[0]", "out[1]", "cu_seqlens",
     "seqlen_offsets"), _plan_forward_call,
    optional=("positions", "cos_sin_cache", "out[0]", "out[1]", "cu_seqlens", "seqlen_offsets"))
_backward_plans = OpPlans(
    ("dq", "dk", "q", "k", "q_weight", "k_weight", "positions", "cos_sin_cache", "cu_seqlens", "seqlen_offsets"),
    _plan_backward_call, optional=("positions", "cos_sin_cache", "cu_seqlens", "seqlen_offsets"))
