"""Recalled plans (cupyrope/_runtime/plan_cache.py) on the CPU: a repeated call with torch tensors must launch
exactly what the fingerprint path would have launched, and anything a fingerprint tells apart must not be
recalled."""

import pytest

torch = pytest.importorskip("torch", reason="recall serves torch tensors only")

import cupyrope  # noqa: E402
from cupyrope._runtime import launch, plan_cache  # noqa: E402
from cupyrope._runtime.plan_cache import RecentCalls  # noqa: E402
from cupyrope.ops import qk_norm_rope, rmsnorm, rope  # noqa: E402
from fakes import stand_in_for_the_gpu  # noqa: E402


def test_the_guard_passes_its_self_test_on_this_torch():
    assert plan_cache._guards_usable(), "torch._C._dynamo.guards.TensorGuards failed the self-test: no recall"


def test_recall_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(plan_cache, "_guard_class", None)
    monkeypatch.setenv("CUPYROPE_RECALL", "0")
    assert not plan_cache._guards_usable()
    calls = RecentCalls()
    _remembered(calls, ("op",), (torch.zeros(4),))
    assert calls.recall(("op",), (torch.zeros(4),)) is None


def _remembered(calls, options, tensors, plan="plan"):
    key = ("key", len(calls._entries))
    calls.remember(options, tensors, [0 if t is None else t.data_ptr() for t in tensors], key, plan)
    return key


def test_recall_tells_apart_what_a_fingerprint_tells_apart():
    calls = RecentCalls()
    q, pos = torch.randn(1, 32, 128, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64)
    _remembered(calls, ("op", 1.0), (q, pos))
    assert calls.recall(("op", 1.0), (torch.ones_like(q), torch.ones_like(pos))) == "plan"  # other memory
    for changed in (torch.empty_strided(q.shape, (5000, 128, 1), dtype=q.dtype),  # other strides
                    q.float(), q[:, :16], q.reshape(32, 128), q.detach().requires_grad_(),
                    q.as_subclass(type("Sub", (torch.Tensor,), {}))):
        assert calls.recall(("op", 1.0), (changed, pos)) is None
    assert calls.recall(("op", 1.0), (q, pos.int())) is None
    assert calls.recall(("op", 2.0), (q, pos)) is None
    assert calls.recall(("op", 1.0), (q, q)) is None


def test_calls_with_misaligned_pointers_are_not_remembered():
    calls = RecentCalls()
    x = torch.randn(2, 130, dtype=torch.bfloat16)
    _remembered(calls, ("op",), (x[:, 1:],))  # 2 bytes past a 16-byte boundary
    assert calls.recall(("op",), (x[:, 1:],)) is None


def test_the_last_few_calls_are_remembered_and_a_guard_built_once():
    calls = RecentCalls()
    tensors = [(torch.randn(n, 64),) for n in range(1, plan_cache.RECENT + 2)]
    keys = [_remembered(calls, ("op",), t, plan=n) for n, t in enumerate(tensors)]
    assert calls.recall(("op",), tensors[0]) is None  # the oldest one is forgotten
    assert [calls.recall(("op",), t) for t in tensors[1:]] == list(range(1, plan_cache.RECENT + 1))
    guard = calls._entries[keys[1]][2]
    calls.remember(("op",), tensors[1], [tensors[1][0].data_ptr()], keys[1], 1)
    assert calls._entries[keys[1]][2] is guard and calls._recent[0][3] == 1


def test_absent_arrays_are_not_recalled_as_present_ones():
    """A call's options say which of its arrays are absent: a remembered call is recalled only with the same
    arrays present (the guard covers the present ones)."""
    calls = RecentCalls()
    x, w = torch.randn(2, 64), torch.randn(64)
    _remembered(calls, ("op", False), (x, w))
    _remembered(calls, ("op", True), (x, None), plan="no weight")
    assert calls.recall(("op", True), (x, None)) == "no weight"
    assert calls.recall(("op", False), (x, w)) == "plan"
    assert calls.recall(("op", False), (x, None)) is None


def _launch_log(monkeypatch, names):
    """Records each launch: its grid, block, constants and its pointers by name (``names``: pointer -> name;
    others are new outputs)."""
    log = []

    def record(launch, *pointers):
        log.append((launch.grid, launch.block, launch.shared_mem, launch.tail,
                     tuple(names.get(p, "new" if p else 0) for p in pointers)))

    monkeypatch.setattr(launch.Launch, "__call__", record)
    return log


def _calls():
    """Decode-size calls of every op that recalls, each varied in what a plan depends on."""
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    q, k = torch.randn(1, 32, 128, dtype=bf16), torch.randn(1, 8, 128, dtype=bf16)
    pos = torch.zeros(1, dtype=torch.int64)
    qkv = torch.randn(3, 48 * 128 + 8, dtype=bf16)  # fused qkv rows: q and k are strided; +8: room for q_off
    q_slice, k_slice = qkv[:, : 32 * 128].view(3, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(3, 8, 128)
    q_off = qkv[:, 8 : 8 + 32 * 128].view(3, 32, 128)  # 16 bytes in
    q_odd = qkv[:, 1 : 1 + 32 * 128].view(3, 32, 128)  # 2 bytes past a boundary
    pos3, k3 = torch.tensor([0, 5, 9], dtype=torch.int32), torch.randn(3, 8, 128, dtype=bf16)
    cache, cache16 = torch.randn(64, 128), torch.randn(64, 128, dtype=bf16)
    cos, sin = torch.randn(1, 1, 128, dtype=bf16), torch.randn(1, 1, 128, dtype=bf16)
    x, w, w32 = torch.randn(4, 4096, dtype=bf16), torch.randn(4096, dtype=bf16), torch.randn(4096)
    residual, y, x_rows = torch.randn_like(x), torch.empty_like(x), torch.randn(4, 4104, dtype=bf16)[:, :4096]
    dy, rstd = torch.randn_like(x), torch.rand(4) + 0.5
    mrope3, cu, offsets = torch.zeros(3, 1, dtype=torch.int64), torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([4, 9])
    qw, kw, qw32 = torch.randn(128, dtype=bf16), torch.randn(128, dtype=bf16), torch.randn(128)
    # Like q and x but 2 bytes past a 16-byte boundary: only the pointer tells them apart.
    q_moved = torch.randn(1 + q.numel(), dtype=bf16)[1:].view(q.shape)
    x_moved = torch.randn(1 + x.numel(), dtype=bf16)[1:].view(x.shape)
    arrays = dict(q=q, k=k, pos=pos, q_slice=q_slice, k_slice=k_slice, q_off=q_off, q_odd=q_odd, pos3=pos3, k3=k3,
                  cache=cache, cache16=cache16, cos=cos, sin=sin, x=x, w=w, w32=w32, residual=residual, y=y,
                  x_rows=x_rows, q_moved=q_moved, x_moved=x_moved, dy=dy, rstd=rstd, mrope3=mrope3, cu=cu,
                  offsets=offsets, qw=qw, kw=kw, qw32=qw32)
    calls = [
        lambda: cupyrope.rope_qk(q, k, pos),
        lambda: cupyrope.rope_qk(q_moved, k, pos, cos_sin_cache=cache),  # vector with q, scalar here
        lambda: cupyrope.rope_qk(q, k, pos, cos_sin_cache=cache),
        lambda: cupyrope.rope_qk(q, k, pos, cos_sin_cache=cache16),
        lambda: cupyrope.rope_qk(q, k, pos, out="new"),
        lambda: cupyrope.rope_qk(q, k, pos, theta=500000.0),
        lambda: cupyrope.rope_qk(q, k, pos, style="gptj", rotary_dim=64, inverse=True),
        lambda: cupyrope.rope_qk(q_slice, k_slice, pos3),
        lambda: cupyrope.rope_qk(q_off, k3, pos3),
        lambda: cupyrope.rope_qk(q_odd, k3, pos3),
        lambda: cupyrope.rope_qk(q.float(), k.float(), pos),  # new tensors every time
        lambda: cupyrope.rope_qk(q, k, pos.int()),
        lambda: cupyrope.rope_qk(q, q, pos),  # overlapping: refused
        lambda: cupyrope.rope_qk(q, k, mrope3, mrope_section=[16, 24, 24]),
        lambda: cupyrope.rope_qk(q, k, mrope3, mrope_section=[24, 20, 20], mrope_interleaved=True),
        lambda: cupyrope.rope_qk(q_slice, k_slice, cu_seqlens=cu),
        lambda: cupyrope.rope_qk(q_slice, k_slice, cu_seqlens=cu, seqlen_offsets=offsets),
        lambda: cupyrope.rope_qk(q, k, mrope3),  # (3, 1) positions for (1, H, D): refused
        lambda: cupyrope.qk_norm_rope(q, k, qw, kw, pos),
        lambda: cupyrope.qk_norm_rope(q, k, qw, kw, pos, out="new"),
        lambda: cupyrope.qk_norm_rope(q, k, qw, kw, pos, eps=1e-5, offset=1.0),
        lambda: cupyrope.qk_norm_rope(q_slice, k_slice, qw, kw, pos3, cos_sin_cache=cache),
        lambda: cupyrope.qk_norm_rope(q_slice, k_slice, qw, kw, cu_seqlens=cu),
        lambda: cupyrope.qk_norm_rope(q, k, qw32, qw32, pos),
        lambda: cupyrope.qk_norm_rope(q, k, qw, qw32, pos),  # weights of two dtypes: refused
        lambda: cupyrope.rope_qk_cos_sin(q, k, cos, sin),
        lambda: cupyrope.rope_qk_cos_sin(q, k, cos, sin, out="new"),
        lambda: cupyrope.rope_cos_sin(q, cos, sin),
        lambda: cupyrope.rope_cos_sin(q, cos, sin, out=q),
        lambda: cupyrope.rope(q, pos),
        lambda: cupyrope.rope(q, pos, out=q),
        lambda: cupyrope.rope(q_moved, pos, cos_sin_cache=cache, out=q_moved),
        lambda: cupyrope.rope(q_off, pos3, out=q_off),
        lambda: cupyrope.rope(q, pos, cos_sin_cache=cache, out=q),
        lambda: cupyrope.rope(q, pos, cos_sin_cache=cache),
        lambda: cupyrope.rope(q, pos, out=q_moved),  # a caller's out (recalled too)
        lambda: cupyrope.rms_norm(x, w),
        lambda: cupyrope.rms_norm(x_moved, w),
        lambda: cupyrope.rms_norm(x),
        lambda: cupyrope.rms_norm(x, w32),
        lambda: cupyrope.rms_norm(x, None, out=x),
        lambda: cupyrope.rms_norm(x, w, out=y),
        lambda: cupyrope.rms_norm(x, w, return_rstd=True),
        lambda: cupyrope.rms_norm(x_rows, w, eps=1e-5),
        lambda: cupyrope.rms_norm(x, w, offset=1.0),
        lambda: cupyrope.fused_add_rms_norm(x, residual, w),
        lambda: cupyrope.fused_add_rms_norm(x_moved, residual, w),
        lambda: cupyrope.fused_add_rms_norm(x_rows, residual, w),
        lambda: cupyrope.fused_add_rms_norm(x, residual, None),
        lambda: cupyrope.fused_add_rms_norm(x, x, w),  # overlapping: refused
        lambda: cupyrope.rms_norm_backward(dy, x, w),
        lambda: cupyrope.rms_norm_backward(dy, x, w, rstd),
        lambda: cupyrope.rms_norm_backward(dy, x),
        lambda: cupyrope.rms_norm_backward(dy, x, w32, eps=1e-5),
        lambda: cupyrope.rms_norm_backward(dy, x, w, offset=1.0),
        lambda: cupyrope.rms_norm_backward(dy, x_moved, w),  # x 2 bytes past a boundary, dy not: scalar
        lambda: cupyrope.rms_norm_backward(dy, x_rows, w, rstd),
        lambda: cupyrope.rms_norm_backward(x, x, w),  # one tensor twice: never remembered
        lambda: cupyrope.rms_norm_backward(dy, x, w, rstd[:2]),  # rstd of the wrong shape: refused
    ]
    return arrays, calls


def _run(calls, log):
    """Each call three times, twice in a row then after all the others (recall's hits and misses): what it
    launched or the error it raised."""
    outcomes = []
    for order in (calls, calls, calls[::-1]):
        for call in order:
            start = len(log)
            try:
                call()
                outcomes.append(tuple(log[start:]))
            except (TypeError, ValueError) as error:
                outcomes.append(repr(error))
    return outcomes


OP_PLANS = ((rope, "_rope_plans"), (rope, "_rope_qk_plans"), (rope, "_rope_cos_sin_plans"), (rope, "_rope_cos_sin_one_plans"),
            (qk_norm_rope, "_forward_plans"), (rmsnorm, "_forward_plans"), (rmsnorm, "_fused_add_plans"),
            (rmsnorm, "_backward_plans"))


def _fresh_plans(monkeypatch, recall: bool):
    monkeypatch.setattr(plan_cache, "_guard_class", None if recall else False)
    for module, name in OP_PLANS:
        plans = getattr(module, name)
        monkeypatch.setattr(module, name, plans.emptied())


def test_recalled_calls_launch_what_fingerprints_launch(monkeypatch):
    stand_in_for_the_gpu(monkeypatch.setattr)
    arrays, calls = _calls()
    log = _launch_log(monkeypatch, {array.data_ptr(): name for name, array in reversed(arrays.items())})
    _fresh_plans(monkeypatch, recall=False)
    fingerprinted = _run(calls, log)
    assert sum(isinstance(o, str) for o in fingerprinted) == 15  # the five refused calls, each three times
    _fresh_plans(monkeypatch, recall=True)
    recalled = _run(calls, log)
    assert recalled == fingerprinted
    for module, name in OP_PLANS:
        assert getattr(module, name).recent._recent, f"no call of {name} was remembered"
