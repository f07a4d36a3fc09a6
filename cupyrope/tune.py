"""``python -m cupyrope tune``: a launch profile measured on this GPU (ops/profiles.py).

Each measured choice of the planners (a field of RopeChoices, QkNormRopeChoices, ForwardChoices, BackwardChoices) has a few candidate
values and a few workloads: the calls, by op, dtype and row size, whose plans the choice changes. Starting from the
profile this GPU runs with now, the tuner takes the choices one at a time: it times every candidate on the choice's
workloads and keeps the one with the lowest geometric mean time, where that beats the current value by more than
KEEP_UNLESS (noise does not move a choice). The result is written beside the kernel cache (profiles.tuned_path),
where later processes on this GPU model find it; the shipped profiles are made by this same command.

Timing: GPU time per call of a CUDA graph of calls replayed (CUDA events, median of replays), inputs rotated over
copies that together exceed twice the L2 cache, so no call reads what the previous one left there; the few-row
backward, whose choice is about host time, by an eager loop. The candidates take turns over ROUNDS rounds, so that
a drift of the GPU's clocks does not favour the one timed first. Nothing is timed except by this command: never on
a user's first call, never inside a capture.

Batch invariance holds for every candidate: the forward's choices select by row size only, RoPE has no reduction,
and the backward's kernels give a row's dx the same bits whichever of them a call's size picks
(tests/api/test_batch_invariance_gpu.py).
"""

import dataclasses
import math
import statistics
import time

import numpy as np

from .bench import copies_for

KEEP_UNLESS = 0.02  # a candidate replaces the current value only if it is this much faster (geometric mean)
GRAPH_US = 3000.0  # calls per graph: about this long a replay
REPLAYS = 9
ROUNDS = 3  # every candidate is timed once a round, in a rotated order; each keeps its median over the rounds


@dataclasses.dataclass
class Workload:
    label: str
    make: object  # () -> list of zero-argument calls (one per input copy)
    eager: bool = False  # host time of an eager loop instead of GPU time in a graph


# ------------------------------------------------------------------------------------------- timing


def gpu_us(cupy, calls) -> float:
    """Median GPU time per call: a graph of the calls (cycled) replayed, timed by events."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for call in calls:
            call()
        start = time.perf_counter()
        for call in calls:
            call()
        stream.synchronize()
        per_call = (time.perf_counter() - start) / len(calls) * 1e6
        n = int(min(4000, max(len(calls), GRAPH_US / max(per_call, 1.0))))
        stream.begin_capture()
        for i in range(n):
            calls[i % len(calls)]()
        graph = stream.end_capture()
        graph.launch(stream)
        times = []
        for _ in range(REPLAYS):
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            begin.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(begin, end) * 1e3 / n)
    return statistics.median(times)


def eager_us(cupy, calls, seconds=0.05) -> float:
    """Time per call of an eager loop (host overhead included), synchronized at the end; median of 5."""
    times = []
    for _ in range(5):
        cupy.cuda.Device().synchronize()
        n, start = 0, time.perf_counter()
        while n < 20 or time.perf_counter() - start < seconds:
            calls[n % len(calls)]()
            n += 1
        cupy.cuda.Device().synchronize()
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------- workloads


def _random(cupy, shape, dtype, rng):
    """Normal values of dtype, drawn on the GPU (bf16: fp32 truncated to its upper half)."""
    from ._runtime.arrays import numpy_dtype

    values = cupy.random.default_rng(int(rng.integers(2**31))).standard_normal(shape, dtype=cupy.float32)
    if dtype == "bfloat16":
        return (values.view(cupy.uint32) >> 16).astype(cupy.uint16).view(numpy_dtype(dtype))
    return values.astype(dtype)


def rope_qk_workload(cupy, rng, tokens, dtype="bfloat16", cache=False, q_heads=32, kv_heads=8, head_dim=128):
    import cupyrope

    def make():
        table = None
        if cache:
            angles = np.arange(8192)[:, None] * 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
            table = cupy.asarray(np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32))
        nbytes = tokens * (q_heads + kv_heads) * head_dim * 2 * 2
        calls = []
        for _ in range(copies_for(nbytes)):
            q = _random(cupy, (tokens, q_heads, head_dim), dtype, rng)
            k = _random(cupy, (tokens, kv_heads, head_dim), dtype, rng)
            positions = cupy.asarray(rng.integers(0, 8192, tokens))
            calls.append(lambda q=q, k=k, p=positions: cupyrope.rope_qk(q, k, p, cos_sin_cache=table))
        return calls

    source = "cache" if cache else "in-kernel"
    return Workload(f"rope_qk {dtype} {tokens}x({q_heads}+{kv_heads})x{head_dim} {source}", make)


def qk_norm_rope_workload(cupy, rng, tokens, backward=False, q_heads=32, kv_heads=8, head_dim=128):
    """Qwen3-8B's QK-norm + RoPE (q and k as views of a fused bf16 qkv buffer), or its backward."""
    import cupyrope

    def make():
        nbytes = tokens * (q_heads + kv_heads) * head_dim * 2 * (3 if backward else 2)
        weights = [_random(cupy, (head_dim,), "bfloat16", rng) for _ in range(2)]
        calls = []
        for _ in range(copies_for(nbytes)):
            qkv = _random(cupy, (tokens, (q_heads + 2 * kv_heads) * head_dim), "bfloat16", rng)
            q = qkv[:, : q_heads * head_dim].reshape(tokens, q_heads, head_dim)
            k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
            positions = cupy.asarray(rng.integers(0, 8192, tokens))
            if backward:
                dq, dk = _random(cupy, q.shape, "bfloat16", rng), _random(cupy, k.shape, "bfloat16", rng)
                calls.append(lambda q=q, k=k, p=positions, dq=dq, dk=dk:
                             cupyrope.qk_norm_rope_backward(dq, dk, q, k, *weights, p))
            else:
                calls.append(lambda q=q, k=k, p=positions: cupyrope.qk_norm_rope(q, k, *weights, p))
        return calls

    return Workload(f"qk_norm_rope{' backward' if backward else ''} bf16 {tokens}x({q_heads}+{kv_heads})x{head_dim}",
                    make)


def rms_workload(cupy, rng, rows, hidden, dtype="bfloat16", op="forward", eager=False):
    import cupyrope

    def make():
        nbytes = rows * hidden * (2 if dtype != "float32" else 4) * (4 if op == "add backward" else 3)
        calls = []
        weight = _random(cupy, (hidden,), dtype, rng)
        for _ in range(1 if eager else copies_for(nbytes)):
            x, other = _random(cupy, (rows, hidden), dtype, rng), _random(cupy, (rows, hidden), dtype, rng)
            if op == "forward":
                calls.append(lambda x=x, y=other: cupyrope.rms_norm(x, weight, out=y))
            elif op == "fused add":
                calls.append(lambda x=x, r=other: cupyrope.fused_add_rms_norm(x, r, weight))
            else:  # "backward", or with residual_grad (add_rms_norm's) "add backward"
                _, rstd = cupyrope.rms_norm(x, weight, return_rstd=True)
                grad = _random(cupy, (rows, hidden), dtype, rng) if op == "add backward" else None
                calls.append(lambda x=x, dy=other, rstd=rstd, grad=grad:
                             cupyrope.rms_norm_backward(dy, x, weight, rstd, residual_grad=grad))
        return calls

    return Workload(f"rms_norm {op} {dtype} [{rows}, {hidden}]", make, eager)


def layer_norm_workload(cupy, rng, rows, hidden, dtype="bfloat16", backward=False):
    import cupyrope

    def make():
        nbytes = rows * hidden * (2 if dtype != "float32" else 4) * (3 if backward else 2)
        calls = []
        weight, bias = _random(cupy, (hidden,), dtype, rng), _random(cupy, (hidden,), dtype, rng)
        for _ in range(copies_for(nbytes)):
            x, other = _random(cupy, (rows, hidden), dtype, rng), _random(cupy, (rows, hidden), dtype, rng)
            if backward:
                _, mean, rstd = cupyrope.layer_norm(x, weight, bias, return_stats=True)
                calls.append(lambda x=x, dy=other, mean=mean, rstd=rstd:
                             cupyrope.layer_norm_backward(dy, x, weight, bias, mean, rstd))
            else:
                calls.append(lambda x=x, y=other: cupyrope.layer_norm(x, weight, bias, out=y))
        return calls

    return Workload(f"layer_norm{' backward' if backward else ''} {dtype} [{rows}, {hidden}]", make)


def rms_norm_fp8_workload(cupy, rng, rows, hidden, static=False, group_size=None):
    """rms_norm_fp8 of bf16 rows: a static scale, scales by groups of group_size columns, or (neither) a scale a row."""
    import cupyrope

    def make():
        nbytes = rows * hidden * 3
        weight = _random(cupy, (hidden,), "bfloat16", rng)
        options = ({"scale": cupy.asarray([0.05], dtype=cupy.float32)} if static else
                   {"group_size": group_size} if group_size else {})
        calls = []
        for _ in range(copies_for(nbytes)):
            x = _random(cupy, (rows, hidden), "bfloat16", rng)
            calls.append(lambda x=x: cupyrope.rms_norm_fp8(x, weight, **options))
        return calls

    scales = "static" if static else f"group {group_size}" if group_size else "token"
    return Workload(f"rms_norm_fp8 {scales} bf16 [{rows}, {hidden}]", make)


def choices_to_tune(cupy, rng):
    """(section, choice, candidates, workloads) in the order they are tuned."""
    rope_large = [rope_qk_workload(cupy, rng, 32768), rope_qk_workload(cupy, rng, 32768, cache=True),
                  rope_qk_workload(cupy, rng, 4096, "float32")]
    rope_mid = [rope_qk_workload(cupy, rng, n) for n in (256, 1024)]
    rope_small = [rope_qk_workload(cupy, rng, n) for n in (1, 16, 64, 128)]
    rope_small_cached = [rope_qk_workload(cupy, rng, n, cache=True) for n in (1, 64, 512)]
    fwd_short = [rms_workload(cupy, rng, rows, hidden, dtype) for rows, hidden, dtype in
                 [(1, 2048, "bfloat16"), (32, 2048, "bfloat16"), (32768, 2048, "bfloat16"), (16384, 1024, "float32"),
                  (1, 4096, "bfloat16"), (32768, 4096, "bfloat16"), (32768, 1024, "bfloat16")]]
    fwd_read_twice = [rms_workload(cupy, rng, 4096, 32768, "bfloat16", "fused add"),
                      rms_workload(cupy, rng, 4096, 20480, "float32", "fused add"),
                      rms_workload(cupy, rng, 2048, 40960, "bfloat16", "fused add")]
    fwd_long = [rms_workload(cupy, rng, 2048, 65536, "bfloat16"), rms_workload(cupy, rng, 4096, 40960, "bfloat16"),
                rms_workload(cupy, rng, 2048, 32768, "float32", "fused add")]
    bwd_register = [rms_workload(cupy, rng, rows, hidden, dtype, "backward") for rows, hidden, dtype in
                    [(8192, 2048, "float32"), (8192, 1027, "bfloat16"), (4096, 8191, "float32")]]
    bwd_few = [rms_workload(cupy, rng, rows, 4096, "bfloat16", "backward", eager=True) for rows in (4, 16, 32)]
    bwd_add_long = [rms_workload(cupy, rng, rows, hidden, "bfloat16", "add backward") for rows, hidden in
                    [(32768, 4096), (65536, 2048), (16384, 4096)]]
    qk_forward = [qk_norm_rope_workload(cupy, rng, tokens) for tokens in (1024, 8192, 32768)]
    qk_backward = [qk_norm_rope_workload(cupy, rng, tokens, backward=True) for tokens in (1024, 8192, 32768)]
    ln_forward = [layer_norm_workload(cupy, rng, rows, hidden, dtype) for rows, hidden, dtype in
                  [(65536, 1152, "bfloat16"), (32768, 4096, "bfloat16"), (16384, 8192, "bfloat16"),
                   (8192, 16384, "bfloat16"), (16384, 4096, "float32"), (8192, 16384, "float32")]]
    ln_backward = [layer_norm_workload(cupy, rng, rows, hidden, dtype, backward=True) for rows, hidden, dtype in
                   [(65536, 1152, "bfloat16"), (65536, 768, "float16"), (32768, 4096, "bfloat16"),
                    (2048, 4096, "bfloat16")]]
    fp8_shapes = [(32768, 4096), (8192, 7168)]
    fp8_static_group = [rms_norm_fp8_workload(cupy, rng, rows, hidden, **scales) for scales in
                        ({"static": True}, {"group_size": 128}, {"group_size": 64}) for rows, hidden in fp8_shapes]
    fp8_token = [rms_norm_fp8_workload(cupy, rng, rows, hidden) for rows, hidden in fp8_shapes]
    return [
        ("rope", "items_per_block", (256, 384, 512, 640, 896, 1280), rope_large + rope_mid),
        ("rope", "blocks_per_sm", (1, 2, 3, 4), rope_large + rope_mid),
        ("rope", "direct_max_tokens", (0, 16, 32, 64, 128), rope_small),
        ("rope", "direct_threads", (32, 64, 128, 256), rope_small),
        ("rope", "direct_with_cache", (False, True), rope_small_cached + rope_large[1:2]),
        ("qk_norm_rope", "forward_threads_per_block", (256, 512, 1024, 2048, 4096), qk_forward),
        ("qk_norm_rope", "backward_threads_per_block", (256, 512, 1024, 2048), qk_backward),
        ("rms_norm_forward", "small_row_bytes", (0, 2048, 4096, 8192), fwd_short),
        ("rms_norm_forward", "row_cache_max_bytes", (0, 32768, 65536, 98304, 131072), fwd_read_twice),
        ("rms_norm_forward", "split_min_row_bytes", (65536, 98304, 131072, 262144), fwd_long),
        ("rms_norm_forward", "fp8_elems_per_thread", (16, 32), fp8_static_group),
        ("rms_norm_forward", "fp8_token_elems_per_thread", (16, 32), fp8_token),
        ("rms_norm_backward", "long_row_bytes", (4096, 8192, 16384), bwd_register),
        ("rms_norm_backward", "one_cluster_max_rows", (0, 8, 16, 32), bwd_few),
        ("rms_norm_backward", "grad_lean_max_rows", (48, 96, 1 << 20), bwd_add_long),
        ("layer_norm", "backward_three_blocks_min_rows", (1, 2, 1024), ln_backward),
        ("layer_norm", "forward_eight_slots_min_hidden", (1024, 4096, 8192, 16384, 1 << 30), ln_forward),
    ]


# -------------------------------------------------------------------------------------------- tuning


def with_choice(profile, section: str, name: str, value):
    return dataclasses.replace(profile, **{section: dataclasses.replace(getattr(profile, section), **{name: value})})


def time_candidate(cupy, profile, workloads, inputs) -> list[float]:
    """Time per call of each workload, planned with profile."""
    from .ops.profiles import planning_with

    with planning_with(profile):
        return [(eager_us if w.eager else gpu_us)(cupy, inputs[w.label]) for w in workloads]


def tune(device: int = 0, say=print, seed: int = 0):
    """The tuned profile of the GPU ``device`` (profiles.Profile) and its measurements ({section.choice: {value:
    geometric mean time relative to the starting value}})."""
    from ._runtime.compile import import_cupy
    from ._runtime.device import gpu_model
    from .ops import profiles

    cupy = import_cupy()
    rng = np.random.default_rng(seed)
    with cupy.cuda.Device(device):
        gpu = gpu_model(device)
        profile = profiles.profile_for(device)
        say(f"tuning {gpu.name} (sm_{gpu.compute_capability.replace('.', '')}, {gpu.sm_count} SMs) from "
            f"{profiles.describe_profile(device)}")
        plan = choices_to_tune(cupy, rng)
        measured = {}
        for i, (section, name, candidates, workloads) in enumerate(plan, 1):
            started = time.perf_counter()
            inputs = {w.label: w.make() for w in workloads}
            cupy.cuda.Device().synchronize()  # the inputs are ready before any timing starts
            current = getattr(getattr(profile, section), name)
            values = [current, *(v for v in candidates if v != current)]
            times = {value: [] for value in values}
            for turn in range(ROUNDS):
                for value in values[turn % len(values):] + values[:turn % len(values)]:
                    times[value].append(time_candidate(cupy, with_choice(profile, section, name, value), workloads,
                                                       inputs))
            medians = {value: [statistics.median(t) for t in zip(*rounds)] for value, rounds in times.items()}
            scores = {value: math.exp(statistics.fmean(math.log(t / b) for t, b in zip(medians[value],
                                                                                       medians[current])))
                      for value in values}
            best = min(scores, key=scores.get)
            if scores[best] < 1.0 - KEEP_UNLESS:
                profile = with_choice(profile, section, name, best)
            chosen = getattr(getattr(profile, section), name)
            measured[f"{section}.{name}"] = {str(v).lower(): round(s, 4) for v, s in scores.items()}
            shown = ", ".join(f"{str(v).lower()}: {s:.3f}" for v, s in scores.items())
            say(f"[{i}/{len(plan)}] {section}.{name} = {str(chosen).lower()}  ({shown}; "
                f"{time.perf_counter() - started:.0f} s)")
            del inputs
            cupy.get_default_memory_pool().free_all_blocks()
    return dataclasses.replace(profile, gpu=gpu), measured
