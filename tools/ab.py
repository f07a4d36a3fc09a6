"""A/B of cupyrope variants on benchmark cases, in one device call. A variant is a source tree (a directory holding
cupyrope/ and kernels_src/: this checkout, or another revision's) and, optionally, module attributes set before
anything is planned (a planner's knob). Each (round, variant) runs in a process of its own, the variants taking
turns, a different one first each round; each case is checked against float64 and timed as the benchmark suite
times it (bench.run_case: GPU µs per call by CUDA-graph replay, the L2 flushed by rotating inputs). Prints each case's
median per variant, its runs, and its ratio to the first variant. Compare variants of one run only. --budget SECONDS
stops starting processes once the next would not finish in time (judged by the longest so far) and prints what it has,
so that a device call's time limit never takes the whole table with it; each process's end is logged on stderr.

Usage, from a checkout on a GPU machine (PYTHONPATH may add the peers' site directory):
  python tools/ab.py --rounds 3 --cases add_bwd:32768x4096,rms_bwd:32768x4096,qk_norm_rope:8192 \\
      base=/tmp/base new=. \\
      'lean=.:cupyrope.ops.rmsnorm_plan_backward.STAGED_LEAN_MAX_ROWS={1: 10**9, 2: 48, 4: math.inf, 8: 0}'
A case is OP:SHAPE[:DTYPE]: rms_fwd, rms_bwd, add_fwd, add_bwd, ln_fwd and ln_bwd at ROWSxHIDDEN (bfloat16 unless
DTYPE is given); fp8_static, fp8_token and fp8_group at ROWSxHIDDEN (bf16 in); qk_norm_rope and qk_norm_rope_bwd
at TOKENS (Qwen3-8B's heads). --peers times the peers too, in the first variant's processes.
A tree of another revision: `git archive REV cupyrope kernels_src | tar -x -C DIR` (DIR made first).
"""

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import time


def parse_variant(text: str) -> dict:
    """NAME=TREE[:MODULE.ATTR=EXPRESSION[;...]] as {"name", "tree", "settings": [(module, attr, expression)]}."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected NAME=TREE[:MODULE.ATTR=EXPRESSION[;...]]")
    tree, _, settings = rest.partition(":")
    parsed = []
    for setting in filter(None, (s.strip() for s in settings.split(";"))):
        target, sep, expression = setting.partition("=")
        module, _, attr = target.strip().rpartition(".")
        if not sep or not module or not attr:
            raise argparse.ArgumentTypeError(f"setting {setting!r}: expected MODULE.ATTR=EXPRESSION")
        parsed.append((module, attr, expression))
    if not os.path.isdir(os.path.join(tree, "cupyrope")):
        raise argparse.ArgumentTypeError(f"variant {name}: {tree!r} holds no cupyrope/")
    return {"name": name, "tree": os.path.abspath(tree), "settings": parsed}


def case_and_providers(bench, torch, spec: str):
    """A benchmark case and its providers from OP:SHAPE[:DTYPE]."""
    op, shape, *rest = spec.split(":")
    if op in ("qk_norm_rope", "qk_norm_rope_bwd"):
        return bench.qk_case(torch, int(shape), op), bench.qk_norm_rope_providers(torch, op.endswith("_bwd"))
    rows, hidden = (int(n) for n in shape.split("x"))
    if op in ("fp8_static", "fp8_token", "fp8_group"):
        return bench.fp8_case(torch, rows, hidden, op), bench.fp8_providers(torch, op)
    kinds = {"rms": (bench.rms_case, bench.rms_providers), "add": (bench.add_case, bench.add_providers),
             "ln": (bench.layer_norm_case, bench.layer_norm_providers)}
    kind, _, direction = op.partition("_")
    if kind not in kinds or direction not in ("fwd", "bwd"):
        raise ValueError(f"case {spec!r}: unknown op {op!r}")
    make_case, providers = kinds[kind]
    backward = direction == "bwd"
    return make_case(torch, rows, hidden, rest[0] if rest else "bfloat16", backward), providers(torch, backward)


def worker(variant: dict, cases: list, peers: bool) -> None:
    """One (round, variant): its settings applied, every case timed; a JSON line a result on stdout."""
    import importlib

    for module, attr, expression in variant["settings"]:
        setattr(importlib.import_module(module), attr, eval(expression, {"math": math}))
    import torch

    from cupyrope import bench

    for spec in cases:
        case, providers = case_and_providers(bench, torch, spec)
        chosen = {name: p for name, p in providers.items()
                  if name == "cupyrope" or (peers and not name.startswith("cupyrope"))}
        for result in bench.run_case(torch, case, chosen):
            name = variant["name"] if result.provider == "cupyrope" else result.provider
            print(json.dumps({"variant": name, "case": spec, "us": result.gpu_us}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", type=parse_variant, help="NAME=TREE[:MODULE.ATTR=EXPRESSION[;...]]")
    parser.add_argument("--cases", required=True, help="comma-separated OP:SHAPE[:DTYPE]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peers", action="store_true", help="time the peers too (in the first variant's processes)")
    parser.add_argument("--budget", type=float, help="seconds: start no process that would end past them")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if args.worker:
        worker(json.loads(args.worker), cases, args.peers)
        return
    names = [v["name"] for v in args.variants]
    if not names or len(set(names)) != len(names):
        parser.error("give one or more variants, each of its own name")
    times = collections.defaultdict(list)  # (case, variant) -> GPU µs, a round each
    start, longest = time.monotonic(), 0.0
    turns = [(turn, args.variants[(turn + i) % len(args.variants)])
             for turn in range(args.rounds) for i in range(len(args.variants))]
    for turn, variant in turns:
        began = time.monotonic()
        if args.budget and began - start + longest > args.budget:
            print(f"budget of {args.budget:.0f} s: stopped before round {turn + 1}, {variant['name']}", file=sys.stderr)
            break
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [variant["tree"], os.environ.get("PYTHONPATH")])))
        command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(variant),
                   "--cases", args.cases] + (["--peers"] if args.peers and variant is args.variants[0] else [])
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                result = json.loads(line)
                times[result["case"], result["variant"]].append(result["us"])
        longest = max(longest, time.monotonic() - began)
        print(f"round {turn + 1}, {variant['name']}: exit {run.returncode} after {time.monotonic() - began:.0f} s",
              file=sys.stderr, flush=True)
        if run.returncode:
            print(run.stderr[-2000:], file=sys.stderr)
    for spec in cases:
        first = times.get((spec, names[0]))
        for (case, name), runs in times.items():
            if case == spec:
                median = statistics.median(runs)
                ratio = f"{median / statistics.median(first):.3f}x" if first else ""
                print(f"{spec:28s} {name:20s} {median:9.2f} us  {ratio:7s} runs {' '.join(f'{t:.2f}' for t in runs)}")


if __name__ == "__main__":
    main()
