"""Where a whole-model step's time goes: the torch profiler over a few steps of one (family, variant, regime) of
`python -m cupyrope bench --op model`. Prints the step's GPU timeline (CUDA events), the GPU's busy time in it
(kernels and copies, summed), time per kernel group and the top kernels.

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


if __name__ == "__main__":
    main()
