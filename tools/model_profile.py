"""Where a whole-model step's time goes: the torch profiler over a few steps of one (family, variant, regime) of
`python -m cupyrope bench --op model`. Prints the step's GPU timeline (CUDA events), the GPU's busy time in it
(kernels and copies, summed), time per kernel group and the top kernels, and where the GPU idles inside a step: the
gaps between one kernel's end and the next one's start, by the group of the kernel before and of the kernel after
(in a CUDA graph, what a kind of kernel costs the step beyond its own run time).

    PYTHONPATH=. python tools/model_profile.py --family llama-3 --variant cupyrope --regime train
"""

import argparse
import re
import statistics

import torch

from cupyrope import model_bench

# Kernel name patterns per group, first match wins.
GROUPS = [
    ("cupyrope", r"cupyrope::"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas"),
    ("triton (Liger)", r"^_|triton"),
    ("copies", r"copy|Memcpy|Memset|CatArray|index|gather"),
    ("softmax / loss", r"softmax|nll|cross_entropy"),
    ("elementwise / reduce", r"elementwise|reduce"),
]


def group_of(name: str) -> str:
    return next((group for group, pattern in GROUPS if re.search(pattern, name, re.I)), "other")


def idle_between(spans, steps: int) -> tuple[dict, dict]:
    """({group: µs a step idle before its kernels}, {group: µs a step idle after its kernels}) from the GPU
    activities `spans` [(name, start µs, end µs)] of `steps` steps run one after the other, each with the same number
    of activities; the gap before each step's first activity (the host's, between steps) is left out."""
    spans = sorted(spans, key=lambda span: span[1])
    per_step = len(spans) // steps if steps and len(spans) % steps == 0 else len(spans)
    before, after = {}, {}
    for i in range(1, len(spans)):
        if i % per_step == 0:
            continue
        gap = spans[i][1] - max(end for _, _, end in spans[max(0, i - 4):i])  # overlapping copies and kernels
        if gap > 0:
            before[group_of(spans[i][0])] = before.get(group_of(spans[i][0]), 0.0) + gap / steps
            after[group_of(spans[i - 1][0])] = after.get(group_of(spans[i - 1][0]), 0.0) + gap / steps
    return before, after


def gpu_spans(torch, step, steps: int) -> list:
    """[(name, start µs, end µs)] of every GPU kernel, copy and memset of `steps` calls of step() under the torch
    profiler, the steps separated by a synchronization."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
            torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama-3", choices=list(model_bench.FAMILIES))
    parser.add_argument("--variant", default="cupyrope", choices=list(model_bench.VARIANTS))
    parser.add_argument("--regime", default="train", choices=list(model_bench.REGIMES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    model, config, _ = model_bench.build(args.family, args.variant, "cuda", tiny=False)
    step = model_bench.regime_step(model, config, args.regime, "cuda", tiny=False)
    clock = model_bench._clock(torch, "cuda")
    for _ in range(3):
        step()
    timeline = statistics.median(clock(step) for _ in range(args.steps))
    kernels = model_bench.gpu_kernel_times(torch, step, args.steps)
    busy = sum(total for total, _ in kernels.values())
    print(f"{args.family} {args.variant} {args.regime} on {torch.cuda.get_device_name()}: step {timeline:.2f} ms "
          f"(CUDA events), GPU busy {busy:.2f} ms ({100 * busy / timeline:.0f}%), idle {timeline - busy:.2f} ms")
    groups = {}
    for name, (total, _) in kernels.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + total
    for group, total in sorted(groups.items(), key=lambda item: -item[1]):
        print(f"  {group:22s} {total:8.3f} ms  {100 * total / timeline:5.1f}%")
    print(f"top {args.top} kernels (ms a step, launches a step):")
    for name, (total, count) in sorted(kernels.items(), key=lambda item: -item[1][0])[:args.top]:
        print(f"  {total:8.3f}  {count:4d}  {name[:110]}")
    before, after = idle_between(gpu_spans(torch, step, args.steps), args.steps)
    print(f"GPU idle inside a step, {sum(before.values()):.1f} µs, by the group of the kernel before and after it:")
    for group in sorted(set(before) | set(after), key=lambda g: -before.get(g, 0.0) - after.get(g, 0.0)):
        print(f"  {group:22s} before {before.get(group, 0.0):7.1f} µs  after {after.get(group, 0.0):7.1f} µs")


if __name__ == "__main__":
    main()
