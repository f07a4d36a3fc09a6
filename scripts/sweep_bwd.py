"""RMSNorm backward tuning sweep on a GPU: planner settings x shapes (not the benchmark suite).

Usage: python scripts/sweep_bwd.py [--peers] [big|mid|table] SETTING ...
A SETTING is a comma-separated list of rmsnorm planner constants, e.g. "STAGED_LOOKAHEAD_BYTES=65536,STAGED_ROW_THREADS=256";
"old" is the unstaged kernel (STAGED_MIN_ROW_BYTES above every row). Each setting is checked against
torch in fp32 before it is timed (graph replay, inputs rotating past the L2, % of copy bandwidth).
"""

import sys

import torch

import cupyrope
from cupyrope import _arrays, bench, rmsnorm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sweep_norm import check, peers, time_us  # noqa: E402

dev = torch.device("cuda")
BIG = [(32768, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16), (8192, 16384, torch.float32),
       (8192, 4096, torch.float32), (8192, 16384, torch.bfloat16), (4096, 32768, torch.bfloat16),
       (8192, 2048, torch.bfloat16), (8192, 1024, torch.bfloat16), (32768, 4096, torch.float16)]
TABLE = [(4 * s, h, torch.bfloat16) for s in (512, 2048) for h in (1024, 2048, 4096, 8192, 16384)]
MID = [(32768, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16), (8192, 16384, torch.bfloat16),
       (8192, 4096, torch.float32), (8192, 2048, torch.float32), (32768, 4096, torch.float16),
       (8192, 2048, torch.bfloat16), (8192, 1024, torch.bfloat16), (2048, 4096, torch.bfloat16),
       (2048, 8192, torch.bfloat16), (8192, 8192, torch.float32)]


DEFAULTS = {n: getattr(rmsnorm, n) for n in dir(rmsnorm) if n.isupper()}


def apply(setting):
    """rmsnorm's planner constants back to their defaults, then ``setting`` over them; plans cleared."""
    for name, value in DEFAULTS.items():
        setattr(rmsnorm, name, value)
    if setting == "old":
        setting = "STAGED_MIN_ROW_BYTES=1000000000"
    for item in filter(None, setting.split(",")):
        name, value = item.split("=")
        if name not in DEFAULTS:
            raise SystemExit(f"{name}: not a planner constant of cupyrope.rmsnorm")
        setattr(rmsnorm, name, int(value))
    rmsnorm._plans = _arrays.PlanCache()


def main():
    args = sys.argv[1:]
    with_peers = "--peers" in args
    shapes = {"table": TABLE, "mid": MID}.get(next((a for a in args if a in ("big", "mid", "table")), "big"), BIG)
    settings = [a for a in args if not a.startswith("--") and a not in ("big", "mid", "table")] or ["old", ""]
    bw = bench.copy_bandwidth_gbps(torch)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s; backward GPU us and % of it")
    header = ["shape"] + [s or "default" for s in settings] + (["liger"] if with_peers else [])
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    for rows, hidden, dt in shapes:
        nbytes = 2 * rows * hidden * torch.finfo(dt).bits // 8
        copies = []
        for _ in range(bench.copies_for(nbytes)):
            x = torch.randn(rows, hidden, device=dev, dtype=dt)
            copies.append((x, torch.randn(hidden, device=dev, dtype=torch.float32), torch.randn_like(x)))
        times, names = [], []
        for setting in settings:
            apply(setting)
            x, w, dy = copies[0]
            dx, dw = cupyrope.rms_norm_backward(dy, x, w)
            check(x, w, dy, cupyrope.rms_norm(x, w, 1e-6), dx, dw)
            names.append(next(p.name for k, p in rmsnorm._plans._plans.items() if k[0] == "bwd").split("::")[1])
            times.append(time_us(lambda x, w, dy: (lambda: cupyrope.rms_norm_backward(dy, x, w)), copies))
        if with_peers and "liger" in peers():
            times.append(time_us(peers()["liger"][1], copies, capture=False))
        moved = nbytes * 1.5
        cells = [f"{t:.1f} {100 * moved / t / 1e3 / bw:.0f}%" for t in times]
        print(f"| {rows}x{hidden} {str(dt)[6:]} | " + " | ".join(cells) + " |   " + "; ".join(names), flush=True)
    apply("")


if __name__ == "__main__":
    main()
