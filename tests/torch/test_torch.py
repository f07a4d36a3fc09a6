"""cupyrope.torch: autograd, torch.library registration, torch.compile, CUDA graphs, modules."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ct = pytest.importorskip("cupyrope.torch")

from cupyrope import reference  # noqa: E402
from helpers import DTYPES, requires_torch_cuda  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GRAD_TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


def hf_rms_norm(x, weight, eps):
    """Hugging Face LlamaRMSNorm.forward, verbatim in substance."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def hf_rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rope(q, k, positions, theta):
    """HF apply_rotary_pos_emb on (T, H, D), with cos/sin from float64 angles."""
    d = q.shape[-1]
    inv = torch.tensor(reference.inv_freq(d, theta), dtype=torch.float64, device=q.device)
    ang = positions.to(torch.float64)[:, None] * inv
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos()[:, None, :].to(q.dtype), emb.sin()[:, None, :].to(q.dtype)
    return q * cos + hf_rotate_half(q) * sin, k * cos + hf_rotate_half(k) * sin


# ------------------------------------------------------------------------------------- CPU (runs in CI)


def test_ops_are_registered_with_fake_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert hasattr(torch.ops.cupyrope, "rope") and hasattr(torch.ops.cupyrope, "rms_norm")
    with FakeTensorMode():
        x = torch.empty(5, 4, 64, device="cuda", dtype=torch.bfloat16)
        pos = torch.empty(5, dtype=torch.int64, device="cuda")
        y = torch.ops.cupyrope.rope(x, pos, None, 1e4, "neox", None, False, None, None, None, False)
        assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == "cuda"
        out, rstd = torch.ops.cupyrope.rms_norm(x, torch.empty(64, device="cuda"), 1e-6, 0.0)
        assert out.shape == x.shape and rstd.shape == (5, 4) and rstd.dtype == torch.float32
        dx, dw = torch.ops.cupyrope.rms_norm_backward(x, x, torch.empty(64, device="cuda"), rstd, 1e-6, 0.0)
        assert dx.shape == x.shape and dw.shape == (64,)


def test_core_package_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, cupyrope; assert 'torch' not in sys.modules, 'cupyrope imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_cpu_fallback_rope_gradient_is_the_inverse_rotation(style):
    x = torch.randn(6, 3, 32, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 1000, (6,))
    y = ct.rope(x.float(), pos, style=style)
    np.testing.assert_allclose(y.detach().numpy(), reference.rope(x.detach().numpy(), pos.numpy(), style=style), atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    expected = reference.rope(g.double().numpy(), pos.numpy(), style=style, inverse=True)
    np.testing.assert_allclose(x.grad.numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("source", ["positions", "cos/sin", "one tensor, cos/sin"])
def test_one_launch_gradient_is_the_inverse_rotation(source):
    """_Rotate, which the CUDA path of ct.rope, ct.rope_qk, ct.rope_qk_cos_sin and ct.rope_cos_sin takes, driven by
    the CPU formulas: every tensor's gradient is rotated back, by one call of the same rotation."""
    q = torch.randn(6, 4, 32, dtype=torch.float64, requires_grad=True)
    k = torch.randn(6, 2, 32, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 1000, (6,))
    calls = []
    table = torch.from_numpy(reference.rope_cache(1000, 32))[pos]
    cos_sin = (table[:, None, :16].float(), table[:, None, 16:].float(), None, 1, "gptj")
    if source == "positions":
        def rotate(q, k, positions, cache, theta, style, rotary_dim, inverse):
            calls.append(inverse)
            return tuple(ct._rope_cpu(x.float(), positions, theta, style, rotary_dim, cache, inverse) for x in (q, k))
        tensors, args = (q, k), (ct._where(pos), None, 1e4, "gptj", None)
    elif source == "cos/sin":
        def rotate(q, k, *options):
            calls.append(options[-1])
            return ct._rope_qk_cos_sin_any(q.float(), k.float(), *options)
        tensors, args = (q, k), cos_sin
    else:
        def rotate(x, *options):
            calls.append(options[-1])
            return ct._rope_cos_sin_any(x.float(), *options)
        tensors, args = (q,), cos_sin
    outs = ct._Rotate.apply(rotate, len(tensors), *tensors, *args, False)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = tuple(torch.randn_like(out) for out in outs)
    torch.autograd.backward(outs, grads)
    assert calls == [False, True]  # one forward call, one backward call for all
    for x, out, g in zip(tensors, outs, grads):
        np.testing.assert_allclose(out.detach().numpy(), reference.rope(x.detach().numpy(), pos.numpy(), style="gptj"),
                                   atol=1e-5)
        expected = reference.rope(g.double().numpy(), pos.numpy(), style="gptj", inverse=True)
        np.testing.assert_allclose(x.grad.numpy(), expected, atol=1e-5)


def test_modules_are_drop_in_on_cpu():
    hf_weight = torch.randn(64)
    ours = ct.RMSNorm(64, eps=1e-5)
    ours.load_state_dict({"weight": hf_weight})
    assert list(ours.state_dict()) == ["weight"]
    x = torch.randn(3, 64)
    torch.testing.assert_close(ours(x), hf_rms_norm(x, hf_weight, 1e-5))
    native = torch.nn.RMSNorm(64, eps=1e-5)
    ours.load_state_dict(native.state_dict())
    torch.testing.assert_close(ours(x), native(x))
    gemma = ct.RMSNorm(64, offset=1.0)
    assert torch.all(gemma.weight == 0)
    torch.testing.assert_close(gemma(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_norm_rows_in_memory_order_need_no_copy():
    """Per-head norms: q's heads after view(B, S, H, D).transpose(1, 2) (Gemma 3's q_norm) are taken in memory order,
    one strided run, with no copy; the heads of a fused qkv view are runs of rows, also taken where they lie; rows
    needing a third level of strides are copied."""
    heads = torch.randn(2, 40, 4, 16).transpose(1, 2)
    order = ct._row_order(heads)
    assert order == [0, 2, 1] and ct._in_row_order(heads, order).is_contiguous()
    assert ct._row_order(torch.randn(3, 5, 8)) is None
    strided = torch.randn(30, 24)[:, :16]  # one run, a row stride of 24
    assert ct._rows_in_runs(strided)[0] is strided
    qkv = torch.randn(30, (8 + 2 * 2) * 16)
    q = qkv[:, : 8 * 16].view(30, 8, 16)
    assert ct._row_order(q) is None and ct._rows_in_runs(q)[0] is q
    dy = torch.randn(30, 8, 16)
    assert all(a is b for a, b in zip(ct._rows_in_runs(dy, q, None), (dy, q, None)))
    three = torch.randn(4, 7, 5, 20)[:, ::2, :, :16]  # (4, 4, 5) rows: no two neighbours merge
    assert all(t.is_contiguous() for t in ct._rows_in_runs(three, torch.randn(4, 4, 5, 16)))


@pytest.mark.parametrize("layout", ["transposed", "fused"])
def test_rms_norm_of_head_views_on_cpu(layout):
    """The CPU path takes the same rows: outputs laid out in x's row order, gradients against float64 autograd, and
    the op's fake outputs (torch.compile) strided as the real ones (opcheck)."""
    from torch.library import opcheck

    torch.manual_seed(0)
    base = torch.randn(2, 40, 6 * 16)
    x = base.view(2, 40, 6, 16).transpose(1, 2) if layout == "transposed" else base.view(2, 40, 6, 16)[:, :, :4]
    x = x.detach().requires_grad_()
    w = torch.randn(16, requires_grad=True)
    y = ct.rms_norm(x, w, 1e-6, offset=1.0)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (w64 + 1.0)
    g = torch.randn_like(y)
    y.backward(g)
    y64.backward(g.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-4)
    assert ct._row_order(y) == ct._row_order(x)
    opcheck(torch.ops.cupyrope.rms_norm.default, (x.detach(), w.detach(), 1e-6, 1.0))


def _last_dim_strided(*shape, device="cpu"):
    """A random view whose last dimension is not contiguous (head-major memory, as some models hand their norms)."""
    t = torch.randn(*shape[:-2], shape[-1], shape[-2], device=device).transpose(-1, -2)
    assert t.stride(-1) != 1
    return t


OUT_OF_PLACE_CALLS = {  # name: (call, its tensor arguments' shapes); weights come last and are contiguous
    "rms_norm": (lambda x, w: ct.rms_norm(x, w, 1e-6), [(2, 5, 4, 16), (16,)]),
    "RMSNorm": (lambda x, w: torch.func.functional_call(ct.RMSNorm(16), {"weight": w}, (x,)), [(2, 5, 4, 16), (16,)]),
    "add_rms_norm": (lambda x, r, w: ct.add_rms_norm(x, r, w), [(2, 5, 4, 16), (2, 5, 4, 16), (16,)]),
    "layer_norm": (lambda x, w, b: ct.layer_norm(x, w, b), [(2, 5, 4, 16), (16,), (16,)]),
    "rope": (lambda x: ct.rope(x, torch.arange(5, device=x.device).expand(2, 5)), [(2, 5, 4, 16)]),
    "rope_qk": (lambda q, k: ct.rope_qk(q, k, torch.arange(5, device=q.device).expand(2, 5)),
                [(2, 5, 4, 16), (2, 5, 2, 16)]),
    "qk_norm_rope": (lambda q, k, qw, kw: ct.qk_norm_rope(q, k, qw, kw, torch.arange(5, device=q.device).expand(2, 5)),
                     [(2, 5, 4, 16), (2, 5, 2, 16), (16,), (16,)]),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=(pytest.mark.gpu, requires_torch_cuda))])
@pytest.mark.parametrize("name", OUT_OF_PLACE_CALLS)
def test_out_of_place_ops_take_a_last_dimension_with_a_stride(name, device):
    """Like torch's own modules, the out-of-place functions take activations whose last dimension is strided (they
    copy it): the values and gradients of the same data laid out contiguously, on the CPU as on the GPU."""
    torch.manual_seed(0)
    call, shapes = OUT_OF_PLACE_CALLS[name]
    strided = [_last_dim_strided(*s, device=device).requires_grad_() if len(s) > 1
               else torch.randn(s, device=device, requires_grad=True) for s in shapes]
    plain = [t.detach().contiguous().requires_grad_() for t in strided]
    results = [call(*args) for args in (strided, plain)]
    outputs = [r if isinstance(r, tuple) else (r,) for r in results]
    grads = [torch.randn_like(o) for o in outputs[1]]
    for got, expected in zip(*outputs):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for args, outs in zip((strided, plain), outputs):
        torch.autograd.backward(outs, grads)
    for a, b in zip(strided, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_every_op_traces_on_cpu_tensors_too():
    """torch.compile(fullgraph) of each function on CPU tensors: every op has a CPU kernel (the same
    formulas as the eager CPU fallback), so a model compiles wherever it runs."""
    q, k, pos = torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.randint(0, 100, (5,))
    x, residual, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)

    def step(q, k, pos, x, residual, w):
        q2, k2 = ct.rope_qk(q, k, pos)
        ct.rope_qk_(q, k, pos)
        ct.fused_add_rms_norm(x, residual, w)
        return q2, k2, ct.rms_norm(q2, None), q, k, x, residual

    eager = step(q.clone(), k.clone(), pos, x.clone(), residual.clone(), w)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q.clone(), k.clone(), pos, x.clone(), residual.clone(), w)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(eager[3], eager[0])  # in place == out of place


# ------------------------------------------------------------------------------------------------ GPU

def gpu(test):
    return pytest.mark.gpu(requires_torch_cuda(test))


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_cache", [False, True])
def test_rope_gradient_against_float64_autograd(dtype, use_cache, rng):
    td = TORCH_DTYPES[dtype]
    x = torch.randn(37, 4, 128, device="cuda", dtype=td, requires_grad=True)
    pos = torch.from_numpy(rng.integers(0, 4096, 37)).cuda()
    cache = ct.rope_cache(4096, 96) if use_cache else None
    y = ct.rope(x, pos, rotary_dim=96, cos_sin_cache=cache)
    g = torch.randn_like(y)
    y.backward(g)
    # float64 autograd of the reference formula
    x64 = x.detach().double().requires_grad_()
    ang = pos.double()[:, None] * torch.tensor(reference.inv_freq(96), dtype=torch.float64, device="cuda")
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2, rest = x64[..., :48], x64[..., 48:96], x64[..., 96:]
    y64 = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)
    y64.backward(g.double())
    torch.testing.assert_close(y.double(), y64, atol=GRAD_TOL[dtype] * 4, rtol=GRAD_TOL[dtype])
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=GRAD_TOL[dtype] * 4, rtol=GRAD_TOL[dtype])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_cache", [False, True])
def test_rope_qk_gradient_takes_one_launch_each_way(dtype, use_cache, rng, monkeypatch):
    """ct.rope_qk with autograd: q and k (GQA column slices of a fused qkv leaf) rotated in one launch
    forward and one backward (the inverse rotation of both gradients); v gets a zero gradient."""
    from helpers import assert_matches, fresh_plans

    plans = fresh_plans(monkeypatch)
    t, hq, hk, d, rotary_dim = 19, 8, 2, 128, 96
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=TORCH_DTYPES[dtype], requires_grad=True)
    q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    pos = rng.integers(0, 4096, t)
    cache = ct.rope_cache(4096, rotary_dim) if use_cache else None
    table = cache.cpu().numpy() if use_cache else None
    q_out, k_out = ct.rope_qk(q, k, torch.from_numpy(pos).cuda(), rotary_dim=rotary_dim, cos_sin_cache=cache)
    grads = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), grads)
    assert not plans["rope"].plans  # no per-tensor rope() calls
    assert len(plans["rope_qk"].plans) == 2  # the forward plan and the inverse one
    host = lambda x: x.detach().double().cpu().numpy()  # noqa: E731
    for out, x, g, lo, hi in ((q_out, q, grads[0], 0, hq), (k_out, k, grads[1], hq, hq + hk)):
        options = dict(rotary_dim=rotary_dim, cos_sin_cache=table)
        assert_matches(host(out), reference.rope(host(x), pos, **options), dtype)
        expected_grad = reference.rope(host(g), pos, inverse=True, **options)
        assert_matches(host(qkv.grad[:, lo * d : hi * d]).reshape(t, -1, d), expected_grad, dtype)
    assert torch.all(qkv.grad[:, (hq + hk) * d :] == 0)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("needs", ["x", "weight", "both"])
def test_rms_norm_gradients_against_float64_autograd(dtype, needs):
    td = TORCH_DTYPES[dtype]
    x = torch.randn(4, 33, 130, device="cuda", dtype=td, requires_grad=needs in ("x", "both"))
    w = torch.randn(130, device="cuda", dtype=td, requires_grad=needs in ("weight", "both"))
    y = ct.rms_norm(x, w, 1e-5, offset=0.5)
    g = torch.randn_like(y)
    y.backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * (w64 + 0.5)
    y64.backward(g.double())
    tol = GRAD_TOL[dtype]
    torch.testing.assert_close(y.double(), y64, atol=tol * 8, rtol=tol)
    if x.requires_grad:
        torch.testing.assert_close(x.grad.double(), x64.grad, atol=tol * 8, rtol=tol)
    else:
        assert x.grad is None
    if w.requires_grad:
        torch.testing.assert_close(w.grad.double(), w64.grad, atol=tol * 30, rtol=tol * 4)
    else:
        assert w.grad is None


def _add_rms_norm_step(x, r, w, eps=1e-5, offset=0.5, residual_dtype=None):
    """(y, s) of add_rms_norm and its float64 autograd twin, both backpropagated from random weights of y and of s
    (the residual stream's next use): returns the cupyrope tensors, their float64 twins, and theirs grads' owners."""
    y, s = ct.add_rms_norm(x, r, w, eps, offset=offset, residual_dtype=residual_dtype)
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    (y.float() * gy.float() + s.float() * gs.float()).sum().backward()
    x64, r64, w64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (x, r, w))
    s64 = x64 + r64
    y64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps) * (w64 + offset)
    (y64 * gy.double() + s64 * gs.double()).sum().backward()
    return (y, s), (y64, s64), (x64, r64, w64)


def test_add_rms_norm_on_cpu_against_float64_autograd():
    x, r = torch.randn(3, 7, 64, requires_grad=True), torch.randn(3, 7, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    x_before, r_before = x.detach().clone(), r.detach().clone()
    (y, s), (y64, s64), (x64, r64, w64) = _add_rms_norm_step(x, r, w)
    torch.testing.assert_close(s.double(), s64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    for got, expected in ((x.grad, x64.grad), (r.grad, r64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(x.detach(), x_before) and torch.equal(r.detach(), r_before)
    module = ct.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(w)
    my, ms = module(x, r)
    torch.testing.assert_close(ms, s)
    torch.testing.assert_close(my, ct.add_rms_norm(x, r, w, 1e-5)[0])
    from torch.library import opcheck

    opcheck(torch.ops.cupyrope.add_rms_norm.default, (x.detach(), r.detach().requires_grad_(), w, 1e-6, 0.0))
    compiled = torch.compile(lambda a, b, c: ct.add_rms_norm(a, b, c), fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(x, r, w), ct.add_rms_norm(x, r, w)):
        torch.testing.assert_close(a, b)


def _check_fp32_stream(x, r, w):
    """add_rms_norm with residual_dtype=torch.float32 (fp16/bf16 x and weight) against float64 autograd: s in fp32
    (x + residual not rounded to x's dtype), y within one rounding to x's dtype, the gradients of x and residual
    the same values (x's rounded once), dweight a fp32 sum rounded once."""
    r_before = r.detach().clone()
    (y, s), (y64, s64), (x64, r64, w64) = _add_rms_norm_step(x, r, w, residual_dtype=torch.float32)
    assert (y.dtype, s.dtype) == (x.dtype, torch.float32)
    assert torch.equal(s, x.detach().float() + r.detach().float())  # one fp32 add, no rounding to x's dtype
    unit = 2.0 ** -(8 if x.dtype == torch.bfloat16 else 11)  # half an ulp of x's dtype, relative
    torch.testing.assert_close(y.double(), y64, rtol=1.01 * unit, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1.01 * unit, atol=1e-4)
    r_unit = 1e-4 if r.dtype == torch.float32 else unit  # residual's gradient in residual's dtype
    torch.testing.assert_close(r.grad.double(), r64.grad, rtol=1.01 * r_unit, atol=1e-4)
    assert r.grad.dtype == r.dtype and torch.equal(x.grad, r.grad.to(x.dtype))
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1.01 * unit, atol=1e-3 * w64.grad.abs().max().item())
    assert torch.equal(r.detach(), r_before)


@pytest.mark.parametrize("residual", ["float32", "bfloat16"])
def test_add_rms_norm_keeps_an_fp32_residual_stream_on_cpu(residual):
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16, requires_grad=True)
    r = (4 * torch.randn(3, 7, 64)).to(TORCH_DTYPES[residual]).requires_grad_()
    w = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    _check_fp32_stream(x, r, w)
    module = ct.RMSNorm(64, eps=1e-5, offset=0.5, dtype=torch.bfloat16, residual_dtype=torch.float32)
    with torch.no_grad():
        module.weight.copy_(w)
    for a, b in zip(module(x, r), ct.add_rms_norm(x, r, w, 1e-5, offset=0.5, residual_dtype=torch.float32)):
        assert torch.equal(a, b)
    compiled = torch.compile(lambda a, b, c: ct.add_rms_norm(a, b, c, residual_dtype=torch.float32), fullgraph=True,
                             backend="aot_eager")
    for a, b in zip(compiled(x, r, w), ct.add_rms_norm(x, r, w, residual_dtype=torch.float32)):
        assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("residual", ["float32", "same"])
def test_add_rms_norm_keeps_an_fp32_residual_stream(dtype, residual):
    td = TORCH_DTYPES[dtype]
    x = torch.randn(4, 33, 130, device="cuda", dtype=td, requires_grad=True)
    r = (4 * torch.randn(4, 33, 130, device="cuda")).to(torch.float32 if residual == "float32" else td)
    w = torch.randn(130, device="cuda", dtype=td, requires_grad=True)
    _check_fp32_stream(x, r.requires_grad_(), w)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("needs", ["x", "residual", "weight", "all"])
def test_add_rms_norm_gradients_against_float64_autograd(dtype, needs):
    td = TORCH_DTYPES[dtype]
    x = torch.randn(4, 33, 130, device="cuda", dtype=td, requires_grad=needs in ("x", "all"))
    r = torch.randn(4, 33, 130, device="cuda", dtype=td, requires_grad=needs in ("residual", "all"))
    w = torch.randn(130, device="cuda", dtype=td, requires_grad=needs in ("weight", "all"))
    (y, s), (y64, s64), (x64, r64, w64) = _add_rms_norm_step(x, r, w)
    tol = GRAD_TOL[dtype]
    torch.testing.assert_close(s.double(), s64, atol=tol * 8, rtol=tol)
    torch.testing.assert_close(y.double(), y64, atol=tol * 8, rtol=tol)
    for t, t64, scale in ((x, x64, 8), (r, r64, 8), (w, w64, 30)):
        if t.requires_grad:
            torch.testing.assert_close(t.grad.double(), t64.grad, atol=tol * scale, rtol=tol * (4 if scale > 8 else 1))
        else:
            assert t.grad is None
    if x.requires_grad and r.requires_grad:
        assert torch.equal(x.grad, r.grad)


@gpu
def test_add_rms_norm_under_compile_and_opcheck():
    torch._dynamo.reset()
    x = torch.randn(16, 512, device="cuda", requires_grad=True)
    r = torch.randn(16, 512, device="cuda", requires_grad=True)
    w = torch.randn(512, device="cuda", requires_grad=True)
    from torch.library import opcheck

    opcheck(torch.ops.cupyrope.add_rms_norm.default, (x, r, w, 1e-6, 0.0))

    def step(x, r, w):
        y, s = ct.add_rms_norm(x, r, w, 1e-6)
        return (y * 2 + s).square().mean()

    torch.compile(step, fullgraph=True)(x, r, w).backward()
    grads = [t.grad.clone() for t in (x, r, w)]
    for t in (x, r, w):
        t.grad = None
    step(x, r, w).backward()
    for got, t in zip(grads, (x, r, w)):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=1e-5)


@gpu
def test_opcheck():
    from torch.library import opcheck

    x = torch.randn(9, 4, 64, device="cuda", requires_grad=True)
    pos = torch.randint(0, 1000, (9,), device="cuda")
    opcheck(torch.ops.cupyrope.rope.default, (x, pos, None, 1e4, "neox", None, False, None, None, None, False))
    cu = torch.tensor([0, 4, 9], device="cuda", dtype=torch.int32)
    opcheck(torch.ops.cupyrope.rope.default, (x, None, None, 1e4, "neox", None, False, cu, None, None, False))
    mrope = torch.randint(0, 1000, (3, 9), device="cuda")
    opcheck(torch.ops.cupyrope.rope.default, (x, mrope, None, 1e4, "neox", None, False, None, None, [8, 12, 12], True))
    w = torch.randn(64, device="cuda", requires_grad=True)
    opcheck(torch.ops.cupyrope.rms_norm.default, (x, w, 1e-6, 0.0))
    heads = torch.randn(2, 9, 4 * 64, device="cuda").view(2, 9, 4, 64).transpose(1, 2).requires_grad_()
    opcheck(torch.ops.cupyrope.rms_norm.default, (heads, w, 1e-6, 0.0))  # rows in memory order, outputs in x's
    fused = torch.randn(9, 8 * 64, device="cuda")[:, : 4 * 64].view(9, 4, 64).requires_grad_()
    opcheck(torch.ops.cupyrope.rms_norm.default, (fused, w, 1e-6, 0.0))  # rows over two runs: copied
    q, k = torch.randn(9, 4, 64, device="cuda"), torch.randn(9, 2, 64, device="cuda")
    opcheck(torch.ops.cupyrope.rope_qk_.default, (q, k, pos, None, 1e4, "neox", None, None, None, None, False))
    qw = torch.randn(64, device="cuda", requires_grad=True)
    kw = torch.randn(64, device="cuda", requires_grad=True)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    options = (1e-6, 0.0, 1e4, "neox", None, None, None, None, None, False)
    opcheck(torch.ops.cupyrope.qk_norm_rope.default, (qr, kr, qw, kw, pos, *options))
    opcheck(torch.ops.cupyrope.qk_norm_rope_.default, (q.clone(), k.clone(), qw.detach(), kw.detach(), pos, *options))
    r = torch.randn(9, 4, 64, device="cuda")
    opcheck(torch.ops.cupyrope.fused_add_rms_norm_.default, (x.detach().clone(), r, w.detach(), 1e-6, 0.0))


class Block(torch.nn.Module):
    """A Llama-style attention block: RMSNorm, q/k/v projections, RoPE, causal GQA attention, residual."""

    def __init__(self, hidden=256, heads=4, kv_heads=2, use_cupyrope=True):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm = ct.RMSNorm(hidden, eps=1e-5)
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.k = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.rotary = ct.RotaryEmbedding(self.head_dim, 4096, theta=500000.0)
        self.use_cupyrope = use_cupyrope

    def forward(self, x, positions):
        t = x.shape[0]
        h = self.norm(x) if self.use_cupyrope else hf_rms_norm(x, self.norm.weight, 1e-5)
        q = self.q(h).view(t, self.heads, self.head_dim)
        k = self.k(h).view(t, self.kv_heads, self.head_dim)
        v = self.v(h).view(t, self.kv_heads, self.head_dim)
        q, k = self.rotary(q, k, positions) if self.use_cupyrope else hf_rope(q, k, positions, 500000.0)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return x + self.o(attn.transpose(0, 1).reshape(t, -1))


@gpu
def test_rms_norm_of_transposed_heads_forward_and_backward():
    """Gemma 3's q_norm: the heads of view(B, S, H, D).transpose(1, 2), taken in memory order with no copy (the
    gradient flows back through the transpose); its outputs' fake strides match (opcheck)."""
    torch.manual_seed(0)
    norm = ct.RMSNorm(16, 1e-6, offset=1.0).cuda()
    torch.nn.init.normal_(norm.weight)
    base = torch.randn(2, 40, 4 * 16, device="cuda")
    xa, xb = base.clone().requires_grad_(), base.clone().requires_grad_()
    heads_a, heads_b = (x.view(2, 40, 4, 16).transpose(1, 2) for x in (xa, xb))
    assert not heads_a.is_contiguous()
    ya = norm(heads_a)
    yb = ct._rms_norm_cpu(heads_b, norm.weight.detach(), 1e-6, 1.0)[0]  # the formula, in torch ops
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # inference takes its own path
        torch.testing.assert_close(norm(heads_a), yb, rtol=1e-5, atol=1e-5)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_block_matches_hf_formulas_forward_and_backward(dtype):
    torch.manual_seed(0)
    td = TORCH_DTYPES[dtype]
    ours = Block().cuda().to(td)
    hf = Block(use_cupyrope=False).cuda().to(td)
    hf.load_state_dict(ours.state_dict())
    x = torch.randn(50, 256, device="cuda", dtype=td)
    pos = torch.arange(50, device="cuda") + 1000
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa, pos), hf(xb, pos)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(ya, yb, **tol)
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    for (name, pa), pb in zip(ours.named_parameters(), hf.parameters()):
        scale = pb.grad.abs().max().item()
        torch.testing.assert_close(pa.grad / scale, pb.grad / scale, **tol, msg=name)


@gpu
def test_rotary_embedding_with_llama31_scaling_on_gpu(rng):
    from types import SimpleNamespace

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = SimpleNamespace(hidden_size=4096, num_attention_heads=32, head_dim=None, max_position_embeddings=20000,
                             rope_theta=500000.0, rope_scaling=scaling)
    rotary = ct.RotaryEmbedding.from_hf_config(config).cuda()
    assert rotary.cos_sin_cache.is_cuda
    q, k = torch.randn(9, 32, 128, device="cuda"), torch.randn(9, 8, 128, device="cuda")
    pos_host = rng.integers(0, 20000, 9)
    q_out, k_out = rotary(q, k, torch.from_numpy(pos_host).cuda())
    table = reference.round_to(reference.rope_cache(20000, 128, 500000.0, scaling), "float32")
    for out, x in ((q_out, q), (k_out, k)):
        expected = reference.rope(x.cpu().double().numpy(), pos_host, cos_sin_cache=table)
        np.testing.assert_allclose(out.cpu().double().numpy(), expected, rtol=1e-5, atol=1e-5)


@gpu
def test_hf_transformers_modules_swap_in():
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf = modeling.LlamaRMSNorm(512, eps=1e-5).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(hf.weight)
    ours = ct.RMSNorm(512, eps=1e-5).cuda().to(torch.bfloat16)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(7, 512, device="cuda", dtype=torch.bfloat16)
    # HF rounds x/rms to bf16 before the weight multiply; we round once: one bf16 ulp apart at most.
    torch.testing.assert_close(ours(x), hf(x), atol=0.0625, rtol=2**-7)


@gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_fullgraph(mode):
    torch._dynamo.reset()
    block = Block().cuda()
    x = torch.randn(64, 256, device="cuda")
    pos = torch.arange(64, device="cuda")
    expected = block(x, pos)
    compiled = torch.compile(block, fullgraph=True, mode=mode)  # fullgraph: any graph break raises
    for _ in range(3):
        got = compiled(x, pos)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    explanation = torch._dynamo.explain(block)(x, pos)
    assert explanation.graph_break_count == 0, explanation.break_reasons

    def train_step(inp):
        return block(inp, pos).square().mean()

    xg = x.clone().requires_grad_()
    torch.compile(train_step, fullgraph=True, mode=mode)(xg).backward()
    xe = x.clone().requires_grad_()
    train_step(xe).backward()
    torch.testing.assert_close(xg.grad, xe.grad, atol=1e-5, rtol=1e-4)


@gpu
def test_inplace_ops_and_modules_under_compile_and_graphs():
    torch._dynamo.reset()
    q = torch.randn(16, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(16, device="cuda")
    rot = ct.RotaryEmbedding(64, 1024, use_cache=True).cuda()
    eq, ek = rot(q, k, pos)

    @torch.compile(fullgraph=True)
    def step(q, k, pos):
        return rot(q, k, pos, inplace=True)

    q2, k2 = q.clone(), k.clone()
    step(q2, k2, pos)
    torch.testing.assert_close(q2, eq)
    torch.testing.assert_close(k2, ek)
    x, r = torch.randn(16, 512, device="cuda"), torch.randn(16, 512, device="cuda")
    w = torch.randn(512, device="cuda")
    ex = hf_rms_norm(x + r, w, 1e-6)
    x2, r2 = x.clone(), r.clone()
    torch.compile(ct.fused_add_rms_norm, fullgraph=True)(x2, r2, w, 1e-6)
    torch.testing.assert_close(r2, x + r)
    torch.testing.assert_close(x2, ex, atol=1e-5, rtol=1e-5)


