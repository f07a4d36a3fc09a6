"""RMSNorm backward tuning sweep on a GPU: planner settings x shapes (not the benchmark suite).

Usage: python scripts/sweep_bwd.py [--peers] [--xw] [--rstd] [--eager] [big|mid|table|odd|lean|wide|two|two16|small|ab|rounds] SETTING ...
(--xw: the weight in x's dtype, as the benchmark suite has it; default fp32; --rstd: rstd given, as the benchmark suite
and the torch layer's autograd pass it; default recomputed; --eager: each setting's eager µs a call too, after its GPU
time)
(odd: odd hidden sizes and ones whose chunks are not a power of two)
A SETTING is a comma-separated list of rmsnorm planner constants, e.g. "STAGED_LOOKAHEAD_BYTES=65536,STAGED_ROW_THREADS=256";
"old" is the unstaged kernel (STAGED_MIN_ROW_BYTES above every row). Each setting is checked against
torch in fp32 before it is timed (graph replay, inputs rotating past the L2, % of copy bandwidth).
"""

import itertools
import sys

import torch

import cupyrope
from cupyrope import bench, rmsnorm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sweep_norm import apply, check, peers, time_us  # noqa: E402

dev = torch.device("cuda")
BIG = [(32768, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16), (8192, 16384, torch.float32),
       (8192, 4096, torch.float32), (8192, 16384, torch.bfloat16), (4096, 32768, torch.bfloat16),
       (8192, 2048, torch.bfloat16), (8192, 1024, torch.bfloat16), (32768, 4096, torch.float16)]
TABLE = [(4 * s, h, torch.bfloat16) for s in (512, 2048) for h in (1024, 2048, 4096, 8192, 16384)]
MID = [(32768, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16), (8192, 16384, torch.bfloat16),
       (8192, 4096, torch.float32), (8192, 2048, torch.float32), (32768, 4096, torch.float16),
       (8192, 2048, torch.bfloat16), (8192, 1024, torch.bfloat16), (2048, 4096, torch.bfloat16),
       (2048, 8192, torch.bfloat16), (8192, 8192, torch.float32)]

ODD = [(8192, 1027, torch.float32), (8192, 1027, torch.bfloat16), (8192, 1027, torch.float16),
       (2048, 1027, torch.bfloat16), (512, 1027, torch.bfloat16), (32768, 1027, torch.bfloat16),
       (8192, 4099, torch.bfloat16), (8192, 8191, torch.bfloat16), (8192, 2051, torch.float32),
       (8192, 301, torch.bfloat16), (8192, 3072, torch.bfloat16), (8192, 5120, torch.bfloat16),
       (8192, 7168, torch.bfloat16), (8192, 3072, torch.float32), (8192, 5120, torch.float32),
       (8192, 2053, torch.bfloat16), (2048, 2053, torch.bfloat16)]

# One 16-byte chunk a thread (the staged kernel's LEAN rule): blocks walking ~2 to ~250 rows.
LEAN = [(r, h, torch.bfloat16) for h in (1024, 2048, 4096) for r in (2048, 8192, 32768)]
LEAN += [(16384, 4096, torch.bfloat16), (4096, 4096, torch.bfloat16), (8192, 1027, torch.bfloat16),
         (32768, 1027, torch.bfloat16), (8192, 3072, torch.bfloat16), (32768, 4096, torch.float16)]

# Two or more chunks a thread (the LEAN rule by slots): fp32 rows of 5-16K, fp16/bf16 rows of 8-32K.
WIDE = [(r, h, torch.float32) for h in (5120, 8192) for r in (2048, 8192, 32768)]
WIDE += [(8192, 6144, torch.float32), (8192, 16384, torch.float32), (4096, 16384, torch.float32),
         (8192, 16384, torch.bfloat16), (16384, 16384, torch.bfloat16), (8192, 14336, torch.bfloat16),
         (2048, 8192, torch.bfloat16), (8192, 16384, torch.float16)]

# fp16/bf16 rows of 2 chunks a thread on up to 512 threads (LEAN there: no spill under its 512-thread bound),
# and rows of 1 chunk that 256 threads would take as 2.
TWO = [(r, 4096, torch.bfloat16) for r in (8192, 16384, 32768)] + [(r, 8192, torch.bfloat16) for r in (2048, 8192, 16384)]
TWO += [(8192, 3072, torch.bfloat16), (8192, 6144, torch.bfloat16), (32768, 4096, torch.float16),
        (16384, 8192, torch.float16)]

# fp16 rows of 2 chunks a thread at every walk length (LEAN measured 6% faster at 124 rows a block once).
TWO16 = [(r, h, torch.float16) for h in (6144, 8192) for r in (2048, 8192, 16384, 32768)]
TWO16 += [(16384, 8192, torch.bfloat16), (32768, 8192, torch.bfloat16)]

# An old tree against a new one (PYTHONPATH): one shape of each of the staged kernel's main variants.
AB = [(32768, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16), (8192, 16384, torch.float32),
      (8192, 1024, torch.bfloat16), (32768, 4096, torch.float16)]

# Rounds of clusters (CLUSTER_ROUNDS_*, v35): where the staged kernel's long chain ran, near its threshold, and past.
ROUNDS = [(13000, 4096, torch.bfloat16), (12800, 8192, torch.bfloat16), (16384, 4096, torch.bfloat16),
          (32768, 4096, torch.bfloat16), (65536, 4096, torch.bfloat16), (65536, 2048, torch.bfloat16),
          (131072, 1024, torch.bfloat16), (16384, 8192, torch.bfloat16), (32768, 8192, torch.bfloat16),
          (16384, 6144, torch.float16), (32768, 4096, torch.float16), (16384, 8192, torch.float16),
          (20000, 3072, torch.bfloat16)]

# Small calls (the one-cluster rule, CLUSTER_BWD_MAX_ROWS): 1-256 rows.
SMALL = [(r, h, torch.bfloat16) for h in (1024, 4096, 8192) for r in (1, 8, 16, 32, 64, 128, 256)]
SMALL += [(r, 8192, torch.float32) for r in (1, 16, 64)] + [(r, 2053, torch.float16) for r in (8, 64)]


def backward(x, w, dy):
    return lambda: cupyrope.rms_norm_backward(dy, x, w)


def backward_given_rstd(x, w, dy):
    rstd = cupyrope.rms_norm(x, w, return_rstd=True)[1]
    return lambda: cupyrope.rms_norm_backward(dy, x, w, rstd)


def input_copies(rows, hidden, dt, weight_dtype=torch.float32):
    """(bytes of x and dy, enough (x, weight, dy) copies to defeat the L2)."""
    nbytes = 2 * rows * hidden * torch.finfo(dt).bits // 8
    copies = []
    for _ in range(bench.copies_for(nbytes)):
        x = torch.randn(rows, hidden, device=dev, dtype=dt)
        copies.append((x, torch.randn(hidden, device=dev, dtype=weight_dtype), torch.randn_like(x)))
    return nbytes, copies


def main():
    args = sys.argv[1:]
    with_peers = "--peers" in args
    sets = {"big": BIG, "table": TABLE, "mid": MID, "odd": ODD, "lean": LEAN, "wide": WIDE, "two": TWO, "two16": TWO16,
            "small": SMALL, "ab": AB, "rounds": ROUNDS}
    shapes = sets[next((a for a in args if a in sets), "big")]
    settings = [a for a in args if not a.startswith("--") and a not in sets] or ["old", ""]
    backward_call = backward_given_rstd if "--rstd" in args else backward
    bw = bench.copy_bandwidth_gbps(torch)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s; backward GPU us and % of it")
    header = ["shape"] + [s or "default" for s in settings] + (["liger"] if with_peers else [])
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    for rows, hidden, dt in shapes:
        nbytes, copies = input_copies(rows, hidden, dt, dt if "--xw" in args else torch.float32)
        times, names, eager = [], [], []
        for setting in settings:
            apply(setting)
            x, w, dy = copies[0]
            dx, dw = cupyrope.rms_norm_backward(dy, x, w)
            check(x, w, dy, cupyrope.rms_norm(x, w, 1e-6), (dx, dw))
            names.append(next(p.name for k, p in rmsnorm._plans._plans.items() if k[0] == "bwd").split("::")[1])
            times.append(time_us(backward_call, copies))
            if "--eager" in args:
                eager.append(bench.eager_time_us(torch, [backward_call(x, w, dy)]))
        if with_peers and "liger" in peers():
            times.append(time_us(peers()["liger"][1], copies, capture=False))
        moved = nbytes * 1.5
        cells = [f"{t:.1f} {100 * moved / t / 1e3 / bw:.0f}%" for t in times]
        cells = [c + (f" ({e:.1f} eager)" if e else "") for c, e in itertools.zip_longest(cells, eager)]
        print(f"| {rows}x{hidden} {str(dt)[6:]} | " + " | ".join(cells) + " |   " + "; ".join(names), flush=True)
    apply("")


if __name__ == "__main__":
    main()
