"""The RMSNorm backward against what its memory traffic allows, on a GPU.

The backward reads two tensors (dy, x) and writes one (dx): a 2-read-1-write stream, whose bandwidth
need not equal the copy's (1 read, 1 write) that the issue's percentages divide by. This times, in one
run and with inputs rotating past the L2 (GPU µs, CUDA-graph replay):
- the copy (the denominator), eager, as the benchmark suite measures it;
- 2-read-1-write kernels with no arithmetic (16-byte loads, dx = dy ^ x): one chunk a thread over a
  full grid; grid-stride loops over one or two resident waves of blocks (static shares); those blocks
  each taking a contiguous range ("blocked"), tiles handed out in order by a counter ("dynamic"),
  blocks held within `lag` bands of each other ("lockstep"); torch's `torch.add`;
- with --finish: when each block of the static grid-stride stream finishes, and on which SM, in
  three runs (the SMs' speeds differ, the same way in every run);
- cupyrope's backward: the whole call, its main kernel alone and its dweight reduction alone (checked
  against torch first, and dweight bitwise equal in two runs).

Usage: python -W ignore scripts/bwd_ceiling.py [--no-streams] [--finish]   (kernel knobs: CUPYROPE_EXTRA_NVRTC_OPTIONS)
"""

import sys

import cupy
import numpy as np
import torch

import cupyrope
from cupyrope import _device, bench, rmsnorm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sweep_bwd import input_copies  # noqa: E402
from sweep_norm import apply, check  # noqa: E402

SHAPES = [(32768, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16), (8192, 16384, torch.float32),
          (32768, 4096, torch.float16), (8192, 4096, torch.bfloat16), (8192, 1024, torch.bfloat16),
          (8192, 1027, torch.bfloat16)]

STREAM_2R1W = r"""
extern "C" __global__ void two_reads_one_write(const uint4* a, const uint4* b, uint4* c, long long n) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const uint4 u = a[i], v = b[i];
        c[i] = make_uint4(u.x ^ v.x, u.y ^ v.y, u.z ^ v.z, u.w ^ v.w);
    }
}
extern "C" __global__ void two_reads_one_write_blocked(const uint4* a, const uint4* b, uint4* c, long long n) {
    const long long per = (n + gridDim.x - 1) / gridDim.x, begin = blockIdx.x * per;
    const long long end = begin + per < n ? begin + per : n;
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const uint4 u = a[i], v = b[i];
        c[i] = make_uint4(u.x ^ v.x, u.y ^ v.y, u.z ^ v.z, u.w ^ v.w);
    }
}
// Tiles of blockDim.x chunks handed out in order by a counter (zeroed before the launch): the blocks
// work on neighbouring tiles at any time, as a full grid's do, however fast each one runs.
extern "C" __global__ void two_reads_one_write_dynamic(const uint4* a, const uint4* b, uint4* c, long long n,
                                                       unsigned* counter) {
    __shared__ unsigned tile;
    for (;;) {
        if (threadIdx.x == 0) tile = atomicAdd(counter, 1u);
        __syncthreads();
        const long long i = (long long)tile * blockDim.x + threadIdx.x;
        __syncthreads();
        if ((long long)tile * blockDim.x >= n) return;
        if (i < n) {
            const uint4 u = a[i], v = b[i];
            c[i] = make_uint4(u.x ^ v.x, u.y ^ v.y, u.z ^ v.z, u.w ^ v.w);
        }
    }
}
// Grid-stride with two chunks a thread in flight (i and i + step loaded before either store).
extern "C" __global__ void two_reads_one_write_ilp2(const uint4* __restrict__ a, const uint4* __restrict__ b,
                                                    uint4* __restrict__ c, long long n) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 2 * step) {
        const bool second = i + step < n;
        const uint4 u = a[i], v = b[i];
        uint4 u2 = u, v2 = v;
        if (second) u2 = a[i + step], v2 = b[i + step];
        c[i] = make_uint4(u.x ^ v.x, u.y ^ v.y, u.z ^ v.z, u.w ^ v.w);
        if (second) c[i + step] = make_uint4(u2.x ^ v2.x, u2.y ^ v2.y, u2.z ^ v2.z, u2.w ^ v2.w);
    }
}
// Grid-stride in bands (one chunk a thread a band, each block a band after the other), a block starting
// band k only once every block has finished band k - lag: the blocks stay within `lag` bands of each
// other. progress counts finished (block, band) pairs (zeroed before the launch; the grid must be
// resident at once).
extern "C" __global__ void two_reads_one_write_lockstep(const uint4* a, const uint4* b, uint4* c, long long n,
                                                        unsigned* progress, int lag) {
    const long long step = (long long)gridDim.x * blockDim.x;
    const unsigned bands = (unsigned)((n + step - 1) / step);
    for (unsigned band = 0; band < bands; ++band) {
        if (band >= (unsigned)lag) {
            if (threadIdx.x == 0) {
                const unsigned need = gridDim.x * (band - lag + 1);
                while (*(volatile unsigned*)progress < need) {}
            }
            __syncthreads();
        }
        const long long i = band * step + (long long)blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) {
            const uint4 u = a[i], v = b[i];
            c[i] = make_uint4(u.x ^ v.x, u.y ^ v.y, u.z ^ v.z, u.w ^ v.w);
        }
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(progress, 1u);
    }
}
// The static grid-stride stream, recording each block's start and end (globaltimer) and its SM.
extern "C" __global__ void two_reads_one_write_timed(const uint4* a, const uint4* b, uint4* c, long long n,
                                                     unsigned long long* out) {
    unsigned long long start, end;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const uint4 u = a[i], v = b[i];
        c[i] = make_uint4(u.x ^ v.x, u.y ^ v.y, u.z ^ v.z, u.w ^ v.w);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned sm;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(end));
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        out[3 * blockIdx.x] = start, out[3 * blockIdx.x + 1] = end, out[3 * blockIdx.x + 2] = sm;
    }
}
"""


def stream_times(copies, kernels, n_sm):
    """GPU µs of the 2-read-1-write kernels over (dy, x) -> dx: a full grid, grid-stride loops over resident
    waves of blocks, and those blocks each taking a contiguous range ("blocked")."""
    outs = [torch.empty_like(c[0]) for c in copies]
    n = copies[0][0].numel() * copies[0][0].element_size() // 16
    times = {}
    stride, blocked, dynamic, ilp2, lockstep, _ = kernels
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for label, kernel, grid, block in (("full grid", stride, -(-n // 256), 256), ("1 wave x 256", stride, n_sm * 8, 256),
                                       ("2 waves x 256", stride, n_sm * 16, 256), ("1 wave x 512", stride, n_sm * 4, 512),
                                       ("blocked 1 wave x 256", blocked, n_sm * 8, 256),
                                       ("blocked 1 wave x 512", blocked, n_sm * 4, 512),
                                       ("dynamic 1 wave x 256", dynamic, n_sm * 8, 256),
                                       ("dynamic 1 wave x 512", dynamic, n_sm * 4, 512),
                                       ("grid-stride 2 in flight, 1 wave x 256", ilp2, n_sm * 8, 256),
                                       *((f"lockstep lag {lag}, 1 wave x 256", (lockstep, lag), n_sm * 8, 256)
                                         for lag in (1, 2, 4, 8, 1 << 30))):
        def launch(c, o, kernel=kernel, grid=grid, block=block):
            args = (c[2].data_ptr(), c[0].data_ptr(), o.data_ptr(), cupy.int64(n))
            if kernel is dynamic:
                counter.zero_()
                args += (counter.data_ptr(),)
            elif isinstance(kernel, tuple):
                kernel, lag = kernel
                counter.zero_()
                args += (counter.data_ptr(), cupy.int32(lag))
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                kernel((grid,), (block,), args)
        launch(copies[0], outs[0])
        torch.cuda.synchronize()
        assert torch.equal(outs[0].view(torch.int16), copies[0][2].view(torch.int16) ^ copies[0][0].view(torch.int16))
        times[label] = bench.gpu_time_us(torch, [lambda c=c, o=o: launch(c, o) for c, o in zip(copies, outs)])
    times["torch.add"] = bench.gpu_time_us(torch, [lambda c=c, o=o: torch.add(c[2], c[0], out=o)
                                                   for c, o in zip(copies, outs)])
    return times


def finish_times(copies, kernel, n_sm):
    """Per-block finish times of the static grid-stride stream (one resident wave of 256-thread blocks)
    in three runs, and how alike the SMs' finish times are from run to run."""
    grid, n = n_sm * 8, copies[0][0].numel() * copies[0][0].element_size() // 16
    out = torch.zeros(3 * grid, dtype=torch.int64, device="cuda")
    runs = []
    for run in range(3):
        x, _, dy = copies[run % len(copies)]
        kernel((grid,), (256,), (dy.data_ptr(), x.data_ptr(), torch.empty_like(x).data_ptr(), cupy.int64(n),
                                 out.data_ptr()))
        o = out.view(grid, 3).cpu().numpy().astype(np.float64)
        done = (o[:, 1] - o[:, 0].min()) / 1e3
        per_sm = {}
        for sm, t in zip(o[:, 2].astype(int), done):
            per_sm[sm] = max(per_sm.get(sm, 0.0), t)
        runs.append(per_sm)
        q = np.percentile(done, [0, 10, 50, 90, 100])
        print(f"  static stream, run {run}: blocks finish at " + " / ".join(f"{v:.1f}" for v in q)
              + " µs (min / p10 / median / p90 / max)")
    sms = sorted(runs[0])
    for r in range(1, len(runs)):
        corr = np.corrcoef([runs[0][s] for s in sms], [runs[r][s] for s in sms])[0, 1]
        print(f"  correlation of the SMs' finish times, run 0 and run {r}: {corr:.2f}")


def backward_times(copies, hidden):
    """(whole, main kernel, dweight kernel) GPU µs and the plan, for the planner's current rules."""
    x, w, dy = copies[0]
    dx, dw = cupyrope.rms_norm_backward(dy, x, w)
    check(x, w, dy, cupyrope.rms_norm(x, w, 1e-6), (dx, dw))
    assert torch.equal(cupyrope.rms_norm_backward(dy, x, w)[1], dw), "dweight differs between two runs"
    plan = next(p for k, p in rmsnorm._plans._plans.items() if k[0] == "bwd")
    whole = bench.gpu_time_us(torch, [lambda x=x, w=w, dy=dy: cupyrope.rms_norm_backward(dy, x, w)
                                      for x, w, dy in copies])
    partial = torch.empty(plan.grid, hidden, device="cuda")
    dxs = [torch.empty_like(c[0]) for c in copies]
    main = bench.gpu_time_us(torch, [lambda c=c, d=d: plan.launch(c[2].data_ptr(), c[0].data_ptr(), c[1].data_ptr(), 0,
                                                                  d.data_ptr(), partial.data_ptr())
                                     for c, d in zip(copies, dxs)])
    dw_us = bench.gpu_time_us(torch, [lambda: plan.dw_launch(partial.data_ptr(), dw.data_ptr())])
    return whole, main, dw_us, plan


def main():
    module = cupy.RawModule(code=STREAM_2R1W)
    kernels = [module.get_function(n) for n in ("two_reads_one_write", "two_reads_one_write_blocked",
                                                       "two_reads_one_write_dynamic", "two_reads_one_write_ilp2",
                                                       "two_reads_one_write_lockstep", "two_reads_one_write_timed")]
    streams = "--no-streams" not in sys.argv
    n_sm = _device.sm_count(0)
    bw = bench.copy_bandwidth_gbps(torch)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s (read + write); GPU µs, % of copy bandwidth")
    for rows, hidden, dt in SHAPES:
        nbytes, copies = input_copies(rows, hidden, dt)
        moved = nbytes * 1.5  # dy and x read, dx written

        def pct(us):
            return f"{us:.1f} ({100 * moved / us / 1e3 / bw:.1f}%)"
        if "--finish" in sys.argv:
            print(f"{rows}x{hidden} {str(dt)[6:]}:")
            finish_times(copies, kernels[-1], n_sm)
        cells = [f"{label} {pct(us)}" for label, us in stream_times(copies, kernels, n_sm).items()] if streams else []
        apply("")
        whole, main_us, dw_us, plan = backward_times(copies, hidden)
        cells.append(f"cupyrope [{plan.grid} blocks] {pct(whole)} = main kernel {main_us:.1f} + dweight kernel {dw_us:.1f}")
        print(f"{rows}x{hidden} {str(dt)[6:]} {plan.name.split('::')[1]} {plan.block}:\n  " + "\n  ".join(cells),
              flush=True)
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
