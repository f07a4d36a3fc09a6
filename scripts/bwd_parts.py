"""Where the RMSNorm backward's time goes, on a GPU: the whole call, its main kernel alone and the
dweight reduction (rms_norm_dw) alone, in GPU µs (graph replay, inputs rotating past the L2), for
several caps on the main kernel's resident blocks per SM (fewer blocks: fewer dweight partials).

Usage: python scripts/bwd_parts.py [--small] [CAP ...]   (CAP: blocks an SM at most; "0" = the planner's own grid;
--small: calls of 1-2048 rows, where the second launch is a large part of the time)
"""

import sys

import torch

import cupyrope
from cupyrope import _device, bench, rmsnorm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sweep_bwd import input_copies  # noqa: E402
from sweep_norm import apply, check  # noqa: E402

dev = torch.device("cuda")
SHAPES = [(8192, 1027, torch.bfloat16), (8192, 1024, torch.bfloat16), (8192, 2048, torch.bfloat16),
          (2048, 4096, torch.bfloat16), (32768, 1027, torch.bfloat16), (8192, 1027, torch.float32),
          (2048, 1024, torch.bfloat16), (32768, 4096, torch.bfloat16), (8192, 4096, torch.float32),
          (8192, 16384, torch.float32)]
SMALL_SHAPES = [(1, 4096, torch.bfloat16), (16, 4096, torch.bfloat16), (128, 4096, torch.bfloat16),
                (512, 256, torch.bfloat16), (512, 1024, torch.bfloat16), (512, 4096, torch.bfloat16),
                (2048, 1024, torch.bfloat16)]
_own_blocks_per_wave = rmsnorm._blocks_per_wave


def capped(cap):
    def blocks_per_wave(kernel, plan, device):
        own = _own_blocks_per_wave(kernel, plan, device)
        return min(own, cap * _device.sm_count(device)) if cap else own
    return blocks_per_wave


def backward_parts(copies, hidden):
    """(whole call, main kernel, rms_norm_dw) GPU µs of the backward over copies of (x, weight, dy), and
    its plan, for the planner's current rules (a one-cluster plan: the whole call, 0); checked against torch first,
    and dweight bitwise equal in two calls."""
    x, w, dy = copies[0]
    dx, dw = cupyrope.rms_norm_backward(dy, x, w)
    check(x, w, dy, cupyrope.rms_norm(x, w, 1e-6), (dx, dw))
    assert torch.equal(cupyrope.rms_norm_backward(dy, x, w)[1], dw), "dweight differs between two calls"
    plan = next(p for k, p in rmsnorm._plans._plans.items() if k[0] == "bwd")
    whole = bench.gpu_time_us(torch, [lambda x=x, w=w, dy=dy: cupyrope.rms_norm_backward(dy, x, w)
                                      for x, w, dy in copies])
    if plan.one_cluster:  # one launch (rms_norm_bwd_cluster): the whole call is its kernel
        return whole, whole, 0.0, plan
    partial = torch.empty(plan.grid, hidden, device=dev)
    dxs = [torch.empty_like(c[0]) for c in copies]
    main_us = bench.gpu_time_us(torch, [lambda c=c, d=d: plan.launch(c[2].data_ptr(), c[0].data_ptr(), c[1].data_ptr(),
                                                                     0, d.data_ptr(), partial.data_ptr())
                                        for c, d in zip(copies, dxs)])
    dw_us = bench.gpu_time_us(torch, [lambda: plan.dw_launch(partial.data_ptr(), dw.data_ptr())])
    return whole, main_us, dw_us, plan


def main():
    small = "--small" in sys.argv
    caps = [int(a) for a in sys.argv[1:] if a != "--small"] or ([0] if small else [0, 8, 4, 2])
    bw = bench.copy_bandwidth_gbps(torch)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s; GPU µs: whole / main kernel / dw kernel")
    print("| shape | " + " | ".join(f"cap {c or 'none'}" for c in caps) + " |\n|" + "---|" * (len(caps) + 1), flush=True)
    for rows, hidden, dt in SMALL_SHAPES if small else SHAPES:
        nbytes, copies = input_copies(rows, hidden, dt)
        cells = []
        for cap in caps:
            apply("")
            rmsnorm._blocks_per_wave = capped(cap)
            whole, main_us, dw_us, plan = backward_parts(copies, hidden)
            pct = 100 * nbytes * 1.5 / whole / 1e3 / bw
            cells.append(f"{whole:.1f} ({pct:.0f}%) / {main_us:.1f} / {dw_us:.1f} [{plan.grid}]")
        print(f"| {rows}x{hidden} {str(dt)[6:]} | " + " | ".join(cells) + f" |  {plan.name.split('::')[1]} {plan.block}",
              flush=True)
    rmsnorm._blocks_per_wave = _own_blocks_per_wave
    apply("")


if __name__ == "__main__":
    main()
