"""A/B of RoPE GPU time between source trees, on one GPU in one run (tuning, not the benchmark suite).

Usage: python scripts/rope_ab.py [--rounds 3] [--compile] [--big] TREE [TREE ...]
Each TREE is a directory holding cupyrope/ and kernels_src/ (e.g. "." and a copy of an older commit made
with `git archive OLD cupyrope kernels_src | tar -x -C /tmp/old`), optionally followed by @ and NVRTC
options for its kernels (".@-DKNOB=1"). Rounds alternate the trees, each in its
own process (the package name is the same), so a tree's numbers are spread over the run as the others'
are. Every call is checked against the float64 reference before it is timed. Cases: bf16 decode
[T, 32 (+8) heads, 128] at T = 1, 8, 64 (q alone and q+k in one launch; cos/sin computed in the kernel
and from an fp32 and a bf16 cache; impl vector and scalar); --big adds [32768, 32 (+8), 128]; --compile adds
torch.compile of the cos/sin-cache formula (the benchmark suite's peer) with bf16 and fp32 tables. Prints one row per case: the
median over rounds per tree, then every round's value.
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys, warnings
import numpy as np, torch
import cupyrope
from cupyrope import bench, reference
warnings.filterwarnings("ignore")
big, with_compile = sys.argv[1] == "1", sys.argv[2] == "1"
dev, D = torch.device("cuda"), 128
cache = cupyrope.rope_cache(32768, D, kind="torch")
cache_bf16 = cupyrope.rope_cache(32768, D, dtype="bfloat16", kind="torch")  # vLLM keeps its cache in x's dtype
results = {}


def inputs(tokens, heads):
    nbytes = 2 * tokens * heads * D * 2
    made = []
    for _ in range(bench.copies_for(nbytes)):
        x = torch.randn(tokens, heads, D, device=dev, dtype=torch.bfloat16)
        made.append({"x": x, "out": torch.empty_like(x), "pos": torch.randint(0, 32768, (tokens,), device=dev)})
    return made


def call(qk, table, impl):
    if qk:
        def run(d):
            x, out = d["x"], d["out"]
            cupyrope.rope_qk(x[:, :32], x[:, 32:], d["pos"], out=(out[:, :32], out[:, 32:]), cos_sin_cache=table,
                             impl=impl)
            return out
        return run
    return lambda d: cupyrope.rope(d["x"], d["pos"], out=d["out"], cos_sin_cache=table, impl=impl)


def check(d, result, tol):  # the first 64 tokens (the float64 reference of 32768 tokens takes too long)
    expected = reference.rope(bench._host(torch, d["x"][:64]), d["pos"][:64].cpu().numpy())
    err = np.abs(bench._host(torch, result[:64]) - expected).max() / max(1.0, np.abs(expected).max())
    assert err <= tol, f"error {err:.3g}"


for tokens in [1, 8, 64] + ([32768] if big else []):
    for qk in (False, True):
        made = inputs(tokens, 40 if qk else 32)
        for source, table in (("theta", None), ("cache", cache), ("bf16 cache", cache_bf16)):
            for impl in ("vector", "scalar"):
                fn = call(qk, table, impl)
                made[0]["out"].fill_(float("nan"))
                check(made[0], fn(made[0]), 2**-5 if table is cache_bf16 else 2**-7)  # bf16 cos/sin: coarser
                name = f"T={tokens} {'q+k' if qk else 'q'} {source} {impl}"
                results[name] = bench.gpu_time_us(torch, [lambda d=d: fn(d) for d in made])
        if with_compile and not qk:  # both with cos/sin tables of x's dtype (bf16) and of fp32
            for dtype in (torch.bfloat16, torch.float32):
                cos, sin = cache[:, : D // 2].to(dtype).contiguous(), cache[:, D // 2:].to(dtype).contiguous()
                compiled = torch.compile(  # rounded to x's dtype, as the kernels store it
                    lambda x, c, s, p: bench._torch_rope_cache_formula(torch, x, c, s, p).to(x.dtype))
                name = f"T={tokens} q torch.compile, {'bf16' if dtype == torch.bfloat16 else 'fp32'} tables"
                results[name] = bench.gpu_time_us(torch, [lambda d=d: compiled(d["x"], cos, sin, d["pos"]) for d in made])
print("RESULT " + json.dumps(results))
'''


def run_tree(tree: str, big: bool, with_compile: bool) -> dict:
    tree, _, options = tree.partition("@")  # TREE@-DKNOB=1 -DOTHER=2: kernel knobs for that process
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "CUPYROPE_EXTRA_NVRTC_OPTIONS": options}
    done = subprocess.run([sys.executable, "-c", CHILD, str(int(big)), str(int(with_compile))], env=env,
                          capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{tree}: no result\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def main(argv):
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    big, with_compile = "--big" in argv, "--compile" in argv
    trees = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--rounds")]
    runs = {tree: [] for tree in trees}
    for r in range(rounds):
        for tree in trees:
            # torch.compile's numbers come from the first tree's first process (they do not depend on the tree)
            runs[tree].append(run_tree(tree, big, with_compile and tree == trees[0] and r == 0))
        print(f"after round {r + 1}:")  # a table each round: a run cut short still reports
        report(trees, runs)


def report(trees, runs):
    import torch

    print(f"{torch.cuda.get_device_name()}; GPU µs per call (CUDA-graph replay), median of the rounds; then each "
          "round", flush=True)
    print("| case | " + " | ".join(trees) + " | rounds |")
    print("|---|" + "---|" * (len(trees) + 1))
    for case in runs[trees[0]][0]:
        values = [[run[case] for run in runs[tree] if case in run] for tree in trees]
        medians = [statistics.median(v) if v else None for v in values]
        each = "; ".join(" / ".join(f"{x:.2f}" for x in v) for v in values if v)
        print(f"| {case} | " + " | ".join("" if m is None else f"{m:.2f}" for m in medians) + f" | {each} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
