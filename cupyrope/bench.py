"""Benchmarks against the peers: ``python -m cupyrope bench`` and tests/benchmarks (pytest-benchmark).

Two regimes per case:
- GPU time per call: a CUDA graph of many calls replayed, timed with CUDA events; inputs rotate over
  enough copies that their total exceeds twice the L2 cache, so no round re-reads cached data.
- eager time per call: what a Python loop sees (host overhead included), synchronized at the end.
Every provider is checked against the float64 reference once before it is timed; providers that are
not installed are skipped, never faked. Bandwidth is reported against the device-to-device copy
bandwidth measured in the same run. Needs torch with CUDA (the peers are torch libraries).
"""

import collections
import dataclasses
import json
import math
import statistics
import sys
import time

import numpy as np

from . import reference

L2_BYTES = 50 * 2**20  # at least this much L2 (an H100's; the device's own size is read where torch has CUDA)
MAX_COPIES = 64
CHECK_ROWS = 256
# Backward cases: the peers run torch autograd, which cannot be captured in a CUDA graph (timed with events).
BACKWARD_OPS = ("rms_bwd", "add_bwd", "ln_bwd", "qk_norm_rope_bwd")
GRAPH_TARGET_US = 2000.0  # calls per graph chosen so one replay lasts about this long
# Cases whose fastest provider takes less than this a call are timed in interleaved rounds (bench --rounds).
INTERLEAVE_BELOW_US = 50.0


@dataclasses.dataclass
class Case:
    op: str  # "rope", "rms_fwd", "rms_bwd", "add_fwd", "add_bwd", "fp8_static", "fp8_token", "fp8_group",
    # "ln_fwd", "ln_bwd", "qk_norm_rope", "qk_norm_rope_bwd", "rope_qk_positions"
    label: str  # shape, for tables
    dtype: str
    make: object  # () -> dict of inputs (torch tensors)
    bytes_moved: int
    reference: object  # inputs -> float64 numpy result(s) to check against
    size: int  # x-axis of the plot


@dataclasses.dataclass
class Result:
    case: Case
    provider: str
    gpu_us: float
    eager_us: float

    @property
    def gbps(self) -> float:
        return self.case.bytes_moved / self.gpu_us / 1e3


# ---------------------------------------------------------------------------------------------- timing


def copy_bandwidth_gbps(torch) -> float:
    """Device-to-device copy, bytes read + written, median of graph replays."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    # Eager copies (a kernel); a copy captured in a graph becomes a DMA-engine memcpy node, slower.
    us = _event_time_us(torch, [lambda: b.copy_(a)] * 10, replays=5)
    return 2 * a.numel() / us / 1e3


def _holding(fns):
    """fns whose results stay alive until len(fns) later calls: a provider that allocates its output
    then cycles through len(fns) + 1 buffers instead of rewriting one (an output that fits in the L2
    would otherwise absorb its writes, which a real program reading it later does not see)."""
    kept = collections.deque(maxlen=len(fns))
    return [lambda fn=fn: kept.append(fn()) for fn in fns]


def gpu_time_us(torch, fns, calls=None, replays=15, capture=True) -> float:
    """Median GPU time per call of fns (one per input copy, cycled) captured in one CUDA graph; with
    capture=False (autograd-driven peers, whose backward runs on other streams and whose failed
    capture would leave torch's RNG in capture mode) events around an eager loop."""
    fns = _holding(fns)
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    if capture:
        return _graph_time_us(torch, fns, calls, replays)
    return _event_time_us(torch, fns, replays)


def _event_time_us(torch, fns, replays) -> float:
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for fn in fns:
            fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times)


def _graph_time_us(torch, fns, calls, replays) -> float:
    if calls is None:
        start = time.perf_counter()
        for i in range(len(fns) * 2):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
        per = (time.perf_counter() - start) / (len(fns) * 2) * 1e6
        calls = int(min(2000, max(len(fns), GRAPH_TARGET_US / max(per, 1.0))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fns[0]()  # warm-up on the capture stream (allocator pools)
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fns[i % len(fns)]()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def eager_time_us(torch, fns, seconds=0.2) -> float:
    """Host loop time per call (launch overhead included), synchronized at the end."""
    fns = _holding(fns)
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or n < 20:
        fns[n % len(fns)]()
        n += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def host_only_us(fn, synchronize, calls=400, repeats=15) -> float:
    """Host time per call with no synchronization inside the timed loop (fewer calls than the launch
    queue holds): what the Python path costs, whether or not the GPU keeps up. Median of `repeats`."""
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    synchronize()
    return statistics.median(times)


def l2_bytes() -> int:
    """The current CUDA device's L2 cache, at least L2_BYTES (the floor where there is no device)."""
    try:
        from ._runtime.compile import import_cupy

        cupy = import_cupy()
        runtime = cupy.cuda.runtime
        return max(L2_BYTES, runtime.deviceGetAttribute(runtime.cudaDevAttrL2CacheSize, cupy.cuda.Device().id))
    except Exception:  # no CuPy, or no CUDA device: the floor
        return L2_BYTES


def copies_for(nbytes: int) -> int:
    """Input copies a case rotates over: enough that their total is at least twice the L2, so no round reads
    what the previous one left in the cache."""
    return max(1, min(MAX_COPIES, math.ceil(2 * l2_bytes() / max(nbytes, 1))))


# ------------------------------------------------------------------------------------------- providers


def _torch_rope_cache_formula(torch, x, cos, sin, positions):
    """HF/vLLM-style eager RoPE from a cos/sin cache (gather, rotate_half)."""
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


NO_PDL = " (no PDL)"  # suffix of cupyrope's providers that launch plainly


def launched_plainly(factory):
    """The provider ``factory`` with its calls launched plainly (``set_pdl(False)``): cupyrope's kernels without the
    overlap that programmatic dependent launch gives back-to-back calls, which the peers' launches do not have."""
    import cupyrope

    def make(d):
        call = factory(d)

        def run():
            previous = cupyrope.set_pdl(False)
            try:
                return call()
            finally:
                cupyrope.set_pdl(previous)

        return run

    return make


def rope_providers(torch):
    """name -> factory(inputs) -> callable returning the rotated x (or (q, k))."""
    import cupyrope

    providers = {}
    for impl in ("vector", "scalar"):
        providers[f"cupyrope {impl}"] = lambda d, impl=impl: (
            lambda: cupyrope.rope(d["x"], d["pos"], out=d["out"], impl=impl))
        providers[f"cupyrope {impl} cache"] = lambda d, impl=impl: (
            lambda: cupyrope.rope(d["x"], d["pos"], out=d["out"], impl=impl, cos_sin_cache=d["cache"]))
    providers["cupyrope vector" + NO_PDL] = launched_plainly(providers["cupyrope vector"])

    def torch_naive(d):
        x, pos = d["x"], d["pos"]
        inv = d["inv_freq"]

        def run():
            ang = pos[:, None].float() * inv
            return _torch_rope_cache_formula(torch, x, ang.cos().to(x.dtype), ang.sin().to(x.dtype),
                                             torch.arange(x.shape[0], device=x.device))

        return run

    providers["torch eager (recompute cos/sin)"] = torch_naive
    providers["torch eager (cos/sin cache)"] = lambda d: (
        lambda: _torch_rope_cache_formula(torch, d["x"], d["cos"], d["sin"], d["pos"]))
    compiled = torch.compile(lambda x, cos, sin, pos: _torch_rope_cache_formula(torch, x, cos, sin, pos))
    providers["torch.compile (cos/sin cache)"] = lambda d: (lambda: compiled(d["x"], d["cos"], d["sin"], d["pos"]))
    def qk(d):
        # q and k as views of one (T, 40, D) buffer: Llama-3-8B's 32 q heads + 8 k heads, one launch.
        x, out = d["x"], d["out"]
        if x.shape[1] != 40:
            raise ValueError("rope_qk case needs 40 heads (32 q + 8 k)")
        q, k, q_out, k_out = x[:, :32], x[:, 32:], out[:, :32], out[:, 32:]

        def run():
            cupyrope.rope_qk(q, k, d["pos"], out=(q_out, k_out))
            return out

        return run

    providers["cupyrope rope_qk"] = qk

    def transformers_layout(d):
        # transformers' call: q and k laid out (B, H, S, D), cos/sin (1, S, D) per token, both halves
        # (prepared outside the timing); a one-head k.
        q = d["x"].unsqueeze(0).transpose(1, 2).contiguous()
        k = torch.zeros(1, 1, q.shape[2], q.shape[3], device="cuda", dtype=q.dtype)
        cos = torch.cat([d["cos"], d["cos"]], -1)[d["pos"]].unsqueeze(0)
        sin = torch.cat([d["sin"], d["sin"]], -1)[d["pos"]].unsqueeze(0)
        return q, k, cos, sin

    def dropin(d):
        from cupyrope.dropin import apply_rotary_pos_emb

        q, k, cos, sin = transformers_layout(d)
        return lambda: apply_rotary_pos_emb(q, k, cos, sin)[0].transpose(1, 2)[0]

    providers["cupyrope dropin (transformers cos/sin)"] = dropin
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        pass
    else:
        def liger(d):  # in place, like Liger's HF patch
            q, k, cos, sin = transformers_layout(d)
            return lambda: LigerRopeFunction.apply(q, k, cos, sin)[0].transpose(1, 2)[0]

        providers["liger"] = liger
    return providers


def _keep_saved_buffers(torch):
    """Compiled graphs whose backward is run again (retain_graph) may not donate their saved buffers."""
    import torch._functorch.config  # an attribute of torch._functorch once imported (torch.compile imports it)

    torch._functorch.config.donated_buffer = False


def autograd_provider(torch, fn, leaves, cotangents):
    """A peer's backward as torch autograd runs it: the inputs named by `leaves` as fresh leaves, fn's outputs made once
    (untimed), each call the leaves' gradients for the cotangents named by `cotangents`. The graph runs again every
    call (retain_graph), so compiled graphs may not donate their saved buffers."""
    _keep_saved_buffers(torch)

    def factory(d):
        inputs = tuple(d[key].detach().requires_grad_() for key in leaves)
        outputs = fn(*inputs)
        return lambda: torch.autograd.grad(outputs, inputs, tuple(d[key] for key in cotangents), retain_graph=True)

    return factory


def rms_providers(torch, backward):
    import cupyrope

    providers = {}
    if backward:
        providers["cupyrope"] = lambda d: (lambda: cupyrope.rms_norm_backward(d["dy"], d["x"], d["w"], d["rstd"]))
        providers["F.rms_norm"] = autograd_provider(
            torch, lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6), ("x", "w"), ("dy",))
    else:
        providers["cupyrope"] = lambda d: (lambda: cupyrope.rms_norm(d["x"], d["w"], 1e-6))  # allocates, like the peers
        providers["F.rms_norm"] = lambda d: (lambda: torch.nn.functional.rms_norm(d["x"], (d["x"].shape[-1],), d["w"], 1e-6))
    providers["cupyrope" + NO_PDL] = launched_plainly(providers["cupyrope"])
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return providers
    if backward:
        # in_place=False: Liger's default writes dx into dy, which every later call and the
        # reference check read (like ours, this allocates dx).
        providers["liger"] = autograd_provider(
            torch, lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False), ("x", "w"), ("dy",))
    else:
        providers["liger"] = lambda d: (lambda: LigerRMSNormFunction.apply(d["x"], d["w"], 1e-6))
    return providers


def layer_norm_providers(torch, backward):
    """layer_norm (forward; backward: dx, dweight, dbias) against F.layer_norm eager and compiled, and Liger's."""
    import cupyrope

    def torch_layer_norm(x, w, b):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5)

    peers = {"F.layer_norm": torch_layer_norm, "torch.compile": torch.compile(torch_layer_norm)}
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        peers["liger"] = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
    except ImportError:
        pass

    def forward(fn):
        return lambda d: (lambda: fn(d["x"], d["w"], d["b"]))

    def autograd(fn):
        return autograd_provider(torch, fn, ("x", "w", "b"), ("dy",))

    if backward:
        def ours(d):
            return lambda: cupyrope.layer_norm_backward(d["dy"], d["x"], d["w"], d["b"], d["mean"], d["rstd"])
    else:
        ours = forward(lambda x, w, b: cupyrope.layer_norm(x, w, b, 1e-5))
    providers = {"cupyrope": ours, **{name: (autograd if backward else forward)(fn) for name, fn in peers.items()}}
    providers["cupyrope" + NO_PDL] = launched_plainly(ours)
    return providers


def _torch_add_rms_norm(torch, x, r, w, eps=1e-6):
    """The residual add + RMSNorm as a decoder layer writes it in torch: (y, s)."""
    s = x + r
    return torch.nn.functional.rms_norm(s, (s.shape[-1],), w, eps), s


def add_providers(torch, backward):
    """add_rms_norm (forward: (y, s); backward: dx, the gradient of x and of the residual) against the residual add
    and F.rms_norm in torch, eager and compiled, and Liger's fused add RMSNorm."""
    import cupyrope

    providers = {}
    compiled = torch.compile(lambda x, r, w: _torch_add_rms_norm(torch, x, r, w))
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError:
        LigerFusedAddRMSNormFunction = None
    peers = {"x + r, F.rms_norm": lambda x, r, w: _torch_add_rms_norm(torch, x, r, w),
             "torch.compile": compiled}
    if LigerFusedAddRMSNormFunction is not None:  # in_place=False: its default writes the residual into x's memory
        peers["liger"] = lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6, 0.0, "llama", False)
    if backward:
        providers["cupyrope"] = lambda d: (lambda: cupyrope.rms_norm_backward(d["dy"], d["s"], d["w"], d["rstd"],
                                                                              residual_grad=d["ds"]))

        providers.update({name: autograd_provider(torch, fn, ("x", "r", "w"), ("dy", "ds"))
                          for name, fn in peers.items()})
    else:
        providers["cupyrope"] = lambda d: (lambda: cupyrope.add_rms_norm(d["x"], d["r"], d["w"], 1e-6))
        providers.update({name: (lambda d, fn=fn: (lambda: fn(d["x"], d["r"], d["w"]))) for name, fn in peers.items()})
    providers["cupyrope" + NO_PDL] = launched_plainly(providers["cupyrope"])
    return providers


FP8_OPS = ("fp8_static", "fp8_token", "fp8_group")  # a static scale, one a row, one per group of 128
FP8_STATIC_SCALE = 0.02


def _torch_rms_norm_fp8(torch, x, w, op, scale, eps=1e-6):
    """RMSNorm then FP8 quantization as two torch steps (vLLM's unfused path): (y, scales), or y for a static
    scale."""
    y = torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps).float()
    if op == "fp8_static":
        return (y / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    groups = y.unflatten(-1, (-1, 128)) if op == "fp8_group" else y.unsqueeze(-2)
    scales = (groups.abs().amax(-1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
    q = (groups / scales).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2)
    return q, scales.squeeze(-1) if op == "fp8_group" else scales.squeeze(-1).squeeze(-1)


def fp8_providers(torch, op):
    """rms_norm_fp8 in one of its modes against RMSNorm then quantization in torch, eager and compiled."""
    import cupyrope

    compiled = torch.compile(lambda x, w, scale: _torch_rms_norm_fp8(torch, x, w, op, scale))

    def cupyrope_call(d):
        options = {"scale": d["scale"]} if op == "fp8_static" else {"group_size": 128} if op == "fp8_group" else {}
        return lambda: cupyrope.rms_norm_fp8(d["x"], d["w"], 1e-6, **options)

    providers = {
        "cupyrope": cupyrope_call,
        "F.rms_norm, quantize": lambda d: (lambda: _torch_rms_norm_fp8(torch, d["x"], d["w"], op, d["scale"])),
        "torch.compile": lambda d: (lambda: compiled(d["x"], d["w"], d["scale"])),
    }
    providers["cupyrope" + NO_PDL] = launched_plainly(providers["cupyrope"])
    return providers


def fp8_case(torch, rows, hidden, op):
    """rms_norm_fp8 (bf16 in) at (rows, hidden): bytes x read, y written (one a value) and the scales."""

    def make():
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        return {"x": x, "w": w, "scale": torch.tensor([FP8_STATIC_SCALE], device="cuda")}

    def ref(d):
        return reference.rms_norm(_host(torch, d["x"][:CHECK_ROWS]), _host(torch, d["w"]), 1e-6)

    scales = {"fp8_static": 0, "fp8_token": rows, "fp8_group": rows * hidden // 128}[op]
    return Case(op, f"{rows}x{hidden}", "bfloat16", make, 3 * rows * hidden + 4 * scales + 2 * hidden, ref,
                rows * hidden)


def fp8_cases(torch, full=False):
    shapes = [(32768, 4096), (8192, 7168), (4096, 4096), (64, 4096), (1, 4096)]
    if full:
        shapes += [(t, h) for h in (2048, 8192) for t in (16, 1024, 8192)]
    return [fp8_case(torch, r, h, op) for op in FP8_OPS for r, h in shapes]


def _dequantized(torch, out, op, scale):
    """An FP8 provider's output as float64 values (codes times their scales)."""
    if op == "fp8_static":
        return _host(torch, out.float()) * float(scale)
    y, scales = out
    values = _host(torch, y.float())
    scales = _host(torch, scales)
    if op == "fp8_group":
        return (values.reshape(*values.shape[:-1], -1, 128) * scales[..., None]).reshape(values.shape)
    return values * scales[..., None]


QWEN3_8B = (32, 8, 128)  # q heads, kv heads, head_dim


def _qk_views(torch, d):
    """q and k of a case's fused qkv buffer: (T, Hq, D) and (T, Hk, D) column views."""
    hq, hk, dim = QWEN3_8B
    qkv = d["qkv"]
    return qkv[:, : hq * dim].view(-1, hq, dim), qkv[:, hq * dim:(hq + hk) * dim].view(-1, hk, dim)


def _torch_qk_norm_rope(torch, q, k, qw, kw, cos, sin, positions, eps=1e-6):
    """The float reference in torch (what torch.compile fuses): RMSNorm per head in fp32, then RoPE from a cos/sin
    cache, rounded once."""
    outputs = []
    for x, w in ((q, qw), (k, kw)):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        outputs.append(_torch_rope_cache_formula(torch, y, cos, sin, positions).to(x.dtype))
    return outputs


def qk_norm_rope_providers(torch, backward):
    import cupyrope

    providers = {}
    compiled = torch.compile(lambda q, k, qw, kw, cos, sin, pos: _torch_qk_norm_rope(torch, q, k, qw, kw, cos, sin, pos))
    if backward:
        _keep_saved_buffers(torch)

        def ours(d):
            q, k = _qk_views(torch, d)
            return lambda: cupyrope.qk_norm_rope_backward(d["dq"], d["dk"], q, k, d["qw"], d["kw"], d["pos"])

        def compiled_autograd(d):
            q, k = (t.detach().requires_grad_() for t in _qk_views(torch, d))
            qw, kw = (t.detach().requires_grad_() for t in (d["qw"], d["kw"]))
            outputs = compiled(q, k, qw, kw, d["cos"], d["sin"], d["pos"])
            return lambda: torch.autograd.grad(outputs, (q, k, qw, kw), (d["dq"], d["dk"]), retain_graph=True)

        providers["cupyrope"] = ours
        providers["torch.compile (float reference)"] = compiled_autograd
        return providers

    def ours(d):
        q, k = _qk_views(torch, d)
        return lambda: cupyrope.qk_norm_rope(q, k, d["qw"], d["kw"], d["pos"], out=(d["q_out"], d["k_out"]))

    def two_calls(d, own_buffers=True):
        """Own buffers: q and k copied out of qkv first (untimed), the best case for the two calls; else rms_norm
        takes the heads where they lie in qkv (rows in runs)."""
        q, k = (t.contiguous() if own_buffers else t for t in _qk_views(torch, d))

        def run():
            cupyrope.rms_norm(q, d["qw"], 1e-6, out=d["q_out"])
            cupyrope.rms_norm(k, d["kw"], 1e-6, out=d["k_out"])
            return cupyrope.rope_qk(d["q_out"], d["k_out"], d["pos"])

        return run

    def torch_compiled(d):
        q, k = _qk_views(torch, d)
        return lambda: compiled(q, k, d["qw"], d["kw"], d["cos"], d["sin"], d["pos"])

    providers["cupyrope"] = ours
    providers["cupyrope" + NO_PDL] = launched_plainly(ours)
    providers["cupyrope rms_norm x2 + rope_qk"] = two_calls
    providers["cupyrope rms_norm x2 (qkv views) + rope_qk"] = lambda d: two_calls(d, own_buffers=False)
    providers["torch.compile (float reference)"] = torch_compiled
    return providers


def position_source_providers(torch):
    """rope_qk on Qwen3-8B's q and k with one position a token, M-RoPE's three rows, and varlen cu_seqlens."""
    import cupyrope

    def rope_qk(where, **options):
        def factory(d):
            q, k = _qk_views(torch, d)
            arrays = {key: d[value] for key, value in where.items()}
            return lambda: cupyrope.rope_qk(q, k, out=(d["q_out"], d["k_out"]), **arrays, **options)
        return factory

    return {"cupyrope positions": rope_qk({"positions": "pos"}),
            "cupyrope M-RoPE": rope_qk({"positions": "mrope_pos"}, mrope_section=[16, 24, 24]),
            "cupyrope varlen": rope_qk({"cu_seqlens": "cu_seqlens"})}


def qk_case(torch, tokens, op, label=None):
    """Qwen3-8B's q and k as views of a fused bf16 qkv buffer at `tokens` tokens; op: "qk_norm_rope",
    "qk_norm_rope_bwd" or "rope_qk_positions" (the positions of sequences of 1024 tokens, as positions, M-RoPE rows
    that are equal (text) and cu_seqlens)."""
    import cupyrope

    hq, hk, dim = QWEN3_8B

    def make():
        qkv = torch.randn(tokens, (hq + 2 * hk) * dim, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(tokens, device="cuda") % 1024
        table = cupyrope.rope_cache(32768, dim, kind="torch")
        d = {"qkv": qkv, "pos": pos, "qw": 1 + 0.1 * torch.randn(dim, device="cuda", dtype=torch.bfloat16),
             "kw": 1 + 0.1 * torch.randn(dim, device="cuda", dtype=torch.bfloat16),
             "q_out": torch.empty(tokens, hq, dim, device="cuda", dtype=torch.bfloat16),
             "k_out": torch.empty(tokens, hk, dim, device="cuda", dtype=torch.bfloat16),
             "cos": table[:, : dim // 2], "sin": table[:, dim // 2:],
             "mrope_pos": pos.expand(3, tokens).contiguous(),
             "cu_seqlens": torch.arange(0, tokens + 1024, 1024, device="cuda", dtype=torch.int32).clamp(max=tokens)}
        if op == "qk_norm_rope_bwd":
            d["dq"], d["dk"] = torch.randn_like(d["q_out"]), torch.randn_like(d["k_out"])
        return d

    def ref(d):
        rows = min(tokens, CHECK_ROWS)
        q, k = (_host(torch, t[:rows]) for t in _qk_views(torch, d))
        pos = d["pos"][:rows].cpu().numpy()
        qw, kw = _host(torch, d["qw"]), _host(torch, d["kw"])
        if op == "qk_norm_rope_bwd":
            dq, dk = _host(torch, d["dq"][:rows]), _host(torch, d["dk"][:rows])
            grads = reference.qk_norm_rope_backward(dq, dk, q, k, qw, kw, pos)
            return np.concatenate(grads[:2], axis=1)
        if op == "rope_qk_positions":
            return np.concatenate([reference.rope(q, pos), reference.rope(k, pos)], axis=1)
        return np.concatenate(reference.qk_norm_rope(q, k, qw, kw, pos), axis=1)

    heads_bytes = tokens * (hq + hk) * dim * 2
    nbytes = (3 if op == "qk_norm_rope_bwd" else 2) * heads_bytes + tokens * 8
    return Case(op, label or f"Qwen3-8B q+k T={tokens}", "bfloat16", make, nbytes, ref, tokens * (hq + hk) * dim)


def qk_cases(torch, full=False):
    counts = (1, 16, 64, 256, 1024, 4096, 8192, 16384, 32768) if full else (1, 64, 1024, 8192, 32768)
    cases = [qk_case(torch, t, "qk_norm_rope") for t in counts]
    cases += [qk_case(torch, t, "qk_norm_rope_bwd") for t in (8192, 32768)]
    cases += [qk_case(torch, t, "rope_qk_positions") for t in (8192, 32768)]
    return cases


# --------------------------------------------------------------------------------------------- shapes


def _host(torch, t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def rope_case(torch, tokens, heads, head_dim, dtype, label=None):
    td = getattr(torch, dtype)
    import cupyrope

    def make():
        x = torch.randn(tokens, heads, head_dim, device="cuda", dtype=td)
        pos = torch.randint(0, 32768, (tokens,), device="cuda")
        table = cupyrope.rope_cache(32768, head_dim, kind="torch")
        inv = torch.tensor(reference.inv_freq(head_dim), device="cuda", dtype=torch.float32)
        return {"x": x, "pos": pos, "out": torch.empty_like(x), "cache": table,
                "cos": table[:, : head_dim // 2].to(td), "sin": table[:, head_dim // 2 :].to(td), "inv_freq": inv}

    def ref(d):  # sampled tokens keep the float64 check affordable
        return reference.rope(_host(torch, d["x"][:CHECK_ROWS]), d["pos"][:CHECK_ROWS].cpu().numpy())

    nbytes = 2 * tokens * heads * head_dim * (2 if dtype != "float32" else 4) + tokens * 8
    return Case("rope", label or f"{tokens}x{heads}x{head_dim}", dtype, make, nbytes, ref, tokens * heads * head_dim)


def rms_case(torch, rows, hidden, dtype, backward, label=None):
    td = getattr(torch, dtype)
    import cupyrope

    def make():
        x = torch.randn(rows, hidden, device="cuda", dtype=td)
        w = torch.randn(hidden, device="cuda", dtype=td)
        dy = torch.randn_like(x)
        _, rstd = cupyrope.rms_norm(x, w, 1e-6, return_rstd=True)
        return {"x": x, "w": w, "dy": dy, "rstd": rstd, "out": torch.empty_like(x)}

    def ref(d):
        # Sampled rows keep the float64 check affordable; dweight needs every row (small cases only).
        x, w, dy = d["x"][:CHECK_ROWS], d["w"], d["dy"][:CHECK_ROWS]
        if backward:
            dx, dw = reference.rms_norm_backward(_host(torch, dy), _host(torch, x), _host(torch, w))
            return dx, (dw if rows <= CHECK_ROWS else None)
        return reference.rms_norm(_host(torch, x), _host(torch, w), 1e-6)

    item = 2 if dtype != "float32" else 4
    nbytes = (3 if backward else 2) * rows * hidden * item + hidden * item
    op = "rms_bwd" if backward else "rms_fwd"
    return Case(op, label or f"{rows}x{hidden}", dtype, make, nbytes, ref, rows * hidden)


def layer_norm_case(torch, rows, hidden, dtype, backward, label=None):
    """layer_norm at (rows, hidden): forward bytes x read, y written; backward dy, x read, dx written (the weight,
    bias and the statistics besides)."""
    td = getattr(torch, dtype)
    import cupyrope

    def make():
        x = torch.randn(rows, hidden, device="cuda", dtype=td) + 3
        w = torch.randn(hidden, device="cuda", dtype=td)
        b = torch.randn(hidden, device="cuda", dtype=td)
        _, mean, rstd = cupyrope.layer_norm(x, w, b, 1e-5, return_stats=True)
        return {"x": x, "w": w, "b": b, "dy": torch.randn_like(x), "mean": mean, "rstd": rstd}

    def ref(d):
        x, w, b = (_host(torch, d[k]) for k in ("x", "w", "b"))
        if backward:
            dx, dw, db = reference.layer_norm_backward(_host(torch, d["dy"][:CHECK_ROWS]), x[:CHECK_ROWS], w, b)
            return dx, (dw if rows <= CHECK_ROWS else None), (db if rows <= CHECK_ROWS else None)
        return reference.layer_norm(x[:CHECK_ROWS], w, b, 1e-5)

    item = 2 if dtype != "float32" else 4
    nbytes = (3 if backward else 2) * rows * hidden * item + 2 * hidden * item
    op = "ln_bwd" if backward else "ln_fwd"
    return Case(op, label or f"{rows}x{hidden}", dtype, make, nbytes, ref, rows * hidden)


def add_case(torch, rows, hidden, dtype, backward, label=None):
    """add_rms_norm at (rows, hidden): forward bytes x, residual read and y, s written; backward dy, ds (the new
    residual's gradient) and s read, dx written."""
    td = getattr(torch, dtype)
    import cupyrope

    def make():
        x, r = torch.randn(rows, hidden, device="cuda", dtype=td), torch.randn(rows, hidden, device="cuda", dtype=td)
        w = torch.randn(hidden, device="cuda", dtype=td)
        _, s, rstd = cupyrope.add_rms_norm(x, r, w, 1e-6, return_rstd=True)
        return {"x": x, "r": r, "w": w, "s": s, "rstd": rstd, "dy": torch.randn_like(x), "ds": torch.randn_like(x)}

    def ref(d):
        x, r = (_host(torch, d[key][:CHECK_ROWS]) for key in ("x", "r"))
        w = _host(torch, d["w"])
        y, s = reference.add_rms_norm(x, r, w, 1e-6, dtype=dtype)
        if backward:
            dy, ds = _host(torch, d["dy"][:CHECK_ROWS]), _host(torch, d["ds"][:CHECK_ROWS])
            return reference.rms_norm_backward(dy, s, w, 1e-6, residual_grad=ds)[0]
        return np.concatenate([y, s], axis=1)

    item = 2 if dtype != "float32" else 4
    op = "add_bwd" if backward else "add_fwd"
    return Case(op, label or f"{rows}x{hidden}", dtype, make, 4 * rows * hidden * item + hidden * item, ref,
                rows * hidden)


def add_cases(torch, full=False):
    shapes = [(32768, 4096), (16384, 8192), (8192, 7168), (4096, 2048), (64, 4096), (1, 4096)]
    if full:
        shapes += [(t, h) for h in (2048, 4096, 8192) for t in (16, 256, 1024, 8192)]
    return [add_case(torch, r, h, "bfloat16", bwd) for bwd in (False, True) for r, h in shapes]


def rope_cases(torch, full=False):
    cases = [rope_case(torch, 32768, 32, 128, "bfloat16", "Llama q 32768x32x128"),
             rope_case(torch, 32768, 40, 128, "bfloat16", "Llama-3-8B q+k T=32768"),
             rope_case(torch, 65536, 32, 128, "float16"),
             rope_case(torch, 1, 32, 128, "bfloat16", "decode 1x32x128")]
    if full:
        cases += [rope_case(torch, n, 32, m, "float32", f"seed {n}x32x{m}") for n in (512, 1024, 2048, 4096, 8192)
                  for m in (128, 256)]
        cases += [rope_case(torch, t, 40, 128, "bfloat16", f"Llama-3-8B q+k T={t}") for t in (1, 16, 256, 4096)]
        cases += [rope_case(torch, 2048 * b, 32, 128, "bfloat16", f"batch {b}x2048") for b in (1, 2, 4, 8, 16)]
    return cases


RMS_S = (128, 512, 2048)
RMS_H = (32, 61, 64, 128, 130, 256, 512, 1024, 1027, 2048, 4096, 8192, 16384)


def rms_cases(torch, full=False):
    big = [(32768, 4096, "bfloat16"), (8192, 16384, "float32"), (8192, 1027, "float32"), (16384, 8192, "bfloat16"),
           (1, 4096, "bfloat16")]
    cases = [rms_case(torch, r, h, dt, bwd) for bwd in (False, True) for r, h, dt in big]
    if full:
        cases += [rms_case(torch, 4 * s, h, "bfloat16", bwd, f"[4,{s},{h}]") for bwd in (False, True) for s in RMS_S
                  for h in RMS_H]
        cases += [rms_case(torch, t, h, "bfloat16", bwd, f"[{t},{h}]") for bwd in (False, True) for h in (4096, 8192)
                  for t in (1, 16, 128, 1024, 8192)]
    return cases


def layer_norm_cases(torch, full=False):
    """The RMSNorm cases' shapes (full: its seed grid too), and CLIP/SigLIP-sized rows."""
    big = [(32768, 4096, "bfloat16"), (8192, 16384, "float32"), (8192, 1027, "float32"), (16384, 8192, "bfloat16"),
           (65536, 1152, "bfloat16"), (1, 4096, "bfloat16")]
    cases = [layer_norm_case(torch, r, h, dt, bwd) for bwd in (False, True) for r, h, dt in big]
    if full:
        cases += [layer_norm_case(torch, 4 * s, h, "bfloat16", bwd, f"[4,{s},{h}]") for bwd in (False, True)
                  for s in RMS_S for h in RMS_H]
    return cases


# --------------------------------------------------------------------------------------------- running


def check(case, provider, inputs, fn, torch):
    """Run a provider once and compare with the float64 reference (a wrong but fast result cannot win)."""
    out = fn()
    expected = case.reference(inputs)
    if case.op.startswith("qk_norm_rope") or case.op == "rope_qk_positions":  # (q, k, ...): their heads side by side
        rows = expected.shape[0]
        got = np.concatenate([_host(torch, out[0][:rows]), _host(torch, out[1][:rows])], axis=1)
        ok = np.allclose(got, expected, rtol=0.02, atol=0.02 * np.abs(expected).max())
    elif case.op == "add_fwd":  # (y, s) side by side
        rows = expected.shape[0]
        got = np.concatenate([_host(torch, out[0][:rows]), _host(torch, out[1][:rows])], axis=1)
        ok = np.allclose(got, expected, rtol=0.02, atol=0.02 * np.abs(expected).max())
    elif case.op == "add_bwd":  # dx (the peers' autograd: (dx, dresidual, dweight))
        got = _host(torch, out[0][: expected.shape[0]])
        ok = np.allclose(got, expected, rtol=0.05, atol=0.05 * np.abs(expected).max())
    elif case.op.startswith("fp8_"):  # within two FP8 steps (3 mantissa bits) of the unquantized values
        rows = expected.shape[0]
        got = _dequantized(torch, out, case.op, inputs["scale"])[:rows]
        scale = np.abs(expected).max()
        if case.op == "fp8_static":
            expected = np.clip(expected, -448 * FP8_STATIC_SCALE, 448 * FP8_STATIC_SCALE)
        ok = np.allclose(got, expected, rtol=0.13, atol=0.01 * scale)
    elif case.op in ("rms_bwd", "ln_bwd"):  # (dx, dweight[, dbias]); None: a sum the sampled rows cannot check
        got = [_host(torch, out[0][:CHECK_ROWS]), *(_host(torch, t) for t in out[1:len(expected)])]
        ok = all(e is None or np.allclose(g, e, rtol=0.05, atol=0.05 * np.abs(e).max()) for g, e in zip(got, expected))
    else:
        got = _host(torch, out[: expected.shape[0]])
        ok = np.allclose(got, expected, rtol=0.02, atol=0.02 * np.abs(expected).max())
    if not ok:
        raise AssertionError(f"{provider} gives wrong results for {case.op} {case.label} {case.dtype}")


def round_order(names: list, turn: int) -> list:
    """The order in which interleaved round `turn` times `names`: each round starts one further along."""
    first = turn % len(names)
    return names[first:] + names[:first]


def _skipped(name, case, error):
    print(f"  skipped {name} on {case.label}: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)


def run_case(torch, case, providers, rounds=1):
    """Every provider checked, then timed; calls shorter than INTERLEAVE_BELOW_US are timed `rounds` times, the
    providers taking turns (a different one first each round), and each keeps its median: at a few µs a call the
    GPU's and the host's speeds drift by more than the providers differ (one timing of each, in turn, puts the
    drift between them)."""
    first = case.make()
    copies = [first] + [case.make() for _ in range(copies_for(case.bytes_moved) - 1)]
    timed = {}  # name -> (fns, graph capture)
    for name, factory in providers.items():
        try:
            fns = [factory(d) for d in copies]
            check(case, name, copies[0], fns[0], torch)
            autograd = case.op in BACKWARD_OPS and not name.startswith("cupyrope")
            timed[name] = fns, not autograd
        except AssertionError as error:
            if name.startswith("cupyrope"):
                raise
            print(f"  excluded {name} on {case.label}: {error}", file=sys.stderr)  # wrong answers never rank
        except Exception as error:  # a peer that cannot run this case (unsupported shape or dtype)
            _skipped(name, case, error)
    samples = {name: [] for name in timed}  # name -> [(GPU µs, eager µs)] a round
    for turn in range(rounds if timed else 0):  # no provider could run this case: nothing to time
        for name in round_order([name for name in timed if name in samples], turn):
            fns, capture = timed[name]
            try:
                samples[name].append((gpu_time_us(torch, fns, capture=capture), eager_time_us(torch, fns)))
            except Exception as error:  # a peer that fails when timed (e.g. cannot be captured in a graph)
                if name.startswith("cupyrope"):
                    raise
                del samples[name]
                _skipped(name, case, error)
        if not samples or min(gpu for runs in samples.values() for gpu, _ in runs) >= INTERLEAVE_BELOW_US:
            break
    results = []
    for name, runs in samples.items():
        results.append(Result(case, name, statistics.median(g for g, _ in runs), statistics.median(e for _, e in runs)))
        r = results[-1]
        print(f"  {case.op} {case.label} {case.dtype} | {name} | GPU {r.gpu_us:.1f} us | eager {r.eager_us:.1f} us "
              f"| {r.gbps:.0f} GB/s" + (f" | median of {len(runs)}" if len(runs) > 1 else ""), flush=True)
    return results


def table(rows, copy_gbps):
    """Markdown table: one row per case and provider, speedup of cupyrope over the best peer."""
    lines = ["| op | shape | dtype | provider | GPU us/call | eager us/call | GB/s | % of copy BW | speedup vs best peer |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_case = {}
    for r in rows:
        by_case.setdefault((r["op"], r["label"], r["dtype"]), []).append(r)
    for (op, label, dtype), rs in by_case.items():
        best_peer = min((r["gpu_us"] for r in rs if not r["provider"].startswith("cupyrope")), default=None)
        for r in rs:
            mine = r["provider"].startswith("cupyrope")
            speedup = f"{best_peer / r['gpu_us']:.2f}x" if best_peer and mine else ""
            lines.append(f"| {op} | {label} | {dtype} | {r['provider']} | {r['gpu_us']:.1f} | {r['eager_us']:.1f} | "
                         f"{r['gbps']:.0f} | {100 * r['gbps'] / copy_gbps:.0f}% | {speedup} |")
    return "\n".join(lines)


def rows_of(results):
    """Plain records of the results (what --json writes and --from-json reads back)."""
    return [{"op": r.case.op, "label": r.case.label, "dtype": r.case.dtype, "size": r.case.size,
             "bytes": r.case.bytes_moved, "provider": r.provider, "gpu_us": r.gpu_us, "eager_us": r.eager_us,
             "gbps": r.gbps} for r in results]


def plot(rows, path):
    """GB/s against size, one panel per op, one line per provider (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for provider in sorted({r["provider"] for r in rows if r["op"] == op}):
            rs = sorted((r for r in rows if r["op"] == op and r["provider"] == provider), key=lambda r: r["size"])
            ax.plot([r["size"] for r in rs], [r["gbps"] for r in rs], marker="o", label=provider)
        ax.set_xscale("log")
        ax.set_title(op)
        ax.set_xlabel("elements")
        ax.set_ylabel("GB/s (GPU time, CUDA graph)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _write_plot(rows, path):
    try:
        plot(rows, path)
        print(f"plot: {path}")
    except ImportError:
        print("no plot: matplotlib is not installed (pip install \"cupyrope[bench]\", or render the --json file "
              "elsewhere with: python -m cupyrope bench --from-json FILE --plot PNG)")


def environment(torch) -> str:
    import cupy

    import cupyrope

    return (f"{time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, cupyrope {cupyrope.__version__}, "
            f"torch {torch.__version__}, CuPy {cupy.__version__}, CUDA {torch.version.cuda}")


def _report(rows, copy_gbps, args):
    print(table(rows, copy_gbps))
    if args.plot:
        _write_plot(rows, args.plot)


def main(args) -> int:
    if args.from_json:  # re-render a saved run (no GPU needed)
        with open(args.from_json) as f:
            saved = json.load(f)
        print(saved["environment"])
        _report(saved["results"], saved["copy_gbps"], args)
        return 0
    from ._runtime.compile import device_count

    device_count()  # NoGPUError where there is no GPU or driver
    if args.op == "model":  # whole models, each variant in a process of its own
        from .model_bench import main as model_main

        return model_main(args)
    try:
        import torch
    except ImportError:
        print("cupyrope bench: needs torch with CUDA (the peers are torch libraries): install it as pytorch.org says "
              "for your CUDA version", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print(f"cupyrope bench: this torch ({torch.__version__}) has no CUDA support; install a CUDA build",
              file=sys.stderr)
        return 1
    copy_gbps = copy_bandwidth_gbps(torch)
    env = f"{environment(torch)}; device copy bandwidth {copy_gbps:.0f} GB/s (read + write)"
    print(env)
    results = []
    if args.op in ("rope", "all"):
        providers = rope_providers(torch)
        for case in rope_cases(torch, args.full):
            results += run_case(torch, case, providers, args.rounds)
    if args.op in ("rmsnorm", "all"):
        for case in rms_cases(torch, args.full):
            results += run_case(torch, case, rms_providers(torch, case.op == "rms_bwd"), args.rounds)
    if args.op in ("add_rms_norm", "all"):
        for case in add_cases(torch, args.full):
            results += run_case(torch, case, add_providers(torch, case.op == "add_bwd"), args.rounds)
    if args.op in ("rms_norm_fp8", "all"):
        for case in fp8_cases(torch, args.full):
            results += run_case(torch, case, fp8_providers(torch, case.op), args.rounds)
    if args.op in ("layer_norm", "all"):
        for case in layer_norm_cases(torch, args.full):
            results += run_case(torch, case, layer_norm_providers(torch, case.op == "ln_bwd"), args.rounds)
    if args.op in ("qk_norm_rope", "all"):
        for case in qk_cases(torch, args.full):
            providers = (position_source_providers(torch) if case.op == "rope_qk_positions"
                         else qk_norm_rope_providers(torch, case.op == "qk_norm_rope_bwd"))
            results += run_case(torch, case, providers, args.rounds)
    rows = rows_of(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "copy_gbps": copy_gbps, "results": rows}, f, indent=1)
    _report(rows, copy_gbps, args)
    return 0
