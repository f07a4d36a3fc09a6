"""Small RMSNorm forward calls: planner settings against Liger, each timed in interleaved rounds (median, min-max).

Usage: python scripts/small_fwd_rounds.py [--decode | --shapes ROWSxHIDDEN,...] [--rounds N] SETTING ...
A SETTING is as in scripts/sweep_norm.py (planner constants, NVRTC=...; "" = the defaults), optionally followed by
"@scalar" for impl="scalar" (rows element by element). Shapes: bf16 [512, 256/512/1024] (the table's S = 128), or
with --decode [1/16/128, 4096/8192] and [512, 8192], or --shapes' list (e.g. 512x130,512x16384); the weight in x's
dtype, as the benchmark suite has it. Liger's column is left out when it is not installed. At a few µs a call, one
timing of each setting in turn puts the GPU's drift between them; rounds in turn, each starting with a different
setting, and the median put it in every column alike (docs/perf-notes.md, sessions 40 and 41).
"""

import statistics
import sys

import torch

import cupyrope
from cupyrope import bench

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sweep_norm import apply, check  # noqa: E402

try:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
except ImportError:
    LigerRMSNormFunction = None

args = sys.argv[1:]
rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 5
settings = [a for i, a in enumerate(args)
            if not a.startswith("--") and (i == 0 or args[i - 1] not in ("--rounds", "--shapes"))] or [""]
if "--shapes" in args:
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args[args.index("--shapes") + 1].split(",")]
elif "--decode" in args:
    shapes = [(r, h) for r in (1, 16, 128) for h in (4096, 8192)] + [(512, 8192)]
else:
    shapes = [(512, h) for h in (256, 512, 1024)]
columns = [s or "default" for s in settings] + (["liger"] if LigerRMSNormFunction else [])
print("| shape | " + " | ".join(columns) + " |\n|" + "---|" * (len(columns) + 1))
for rows, hidden in shapes:
    copies = [(torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16),
               torch.randn(hidden, device="cuda", dtype=torch.bfloat16))
              for _ in range(bench.copies_for(2 * rows * hidden * 2))]
    timed = {}  # column -> (setting, fns)
    for column, full in enumerate(settings):
        setting, _, impl = full.partition("@")
        apply(setting)
        x, w = copies[0]
        check(x, w, None, cupyrope.rms_norm(x, w, 1e-6, impl=impl or "auto"))
        timed[column] = setting, [lambda x=x, w=w, impl=impl or "auto": cupyrope.rms_norm(x, w, 1e-6, impl=impl)
                                  for x, w in copies]
    if LigerRMSNormFunction:
        timed["liger"] = "", [lambda x=x, w=w: LigerRMSNormFunction.apply(x, w, 1e-6) for x, w in copies]
    times = {column: [] for column in timed}
    for turn in range(rounds):
        for column in bench.round_order(list(timed), turn):
            setting, fns = timed[column]
            apply(setting)  # the plan is made with the setting's constants when the graph is captured
            times[column].append(bench.gpu_time_us(torch, fns))
    cells = [f"{statistics.median(t):.3f} ({min(t):.2f}-{max(t):.2f})" for t in times.values()]
    print(f"| [{rows}, {hidden}] | " + " | ".join(cells) + " |", flush=True)
apply("")
