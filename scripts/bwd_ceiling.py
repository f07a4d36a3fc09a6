"""The RMSNorm backward against what its memory traffic allows, on a GPU.

The backward reads two tensors (dy, x) and writes one (dx): a 2-read-1-write stream, whose bandwidth
need not equal the copy's (1 read, 1 write) that the issue's percentages divide by. This times, in one
run and with inputs rotating past the L2 (GPU µs, CUDA-graph replay):
- the copy (the denominator), eager, as the benchmark suite measures it;
- 2-read-1-write kernels with no arithmetic (16-byte loads, dx = dy ^ x): one chunk a thread over a
  full grid; the staged backward's own schedule (a row a block, 2 blocks an SM, the next 3 rows
  copied ahead into shared memory by cp.async; with and without two barriers a row); grid-stride loops over one or two resident waves of blocks (static shares); those blocks
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

from cupyrope import _device, bench

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bwd_parts import backward_parts  # noqa: E402
from sweep_bwd import input_copies  # noqa: E402
from sweep_norm import apply  # noqa: E402

SHAPES = [(32768, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16), (8192, 16384, torch.float32),
          (32768, 4096, torch.float16), (8192, 4096, torch.bfloat16), (8192, 1024, torch.bfloat16),
          (8192, 1027, torch.bfloat16)]

STREAM_2R1W = r"""
__device__ __forceinline__ uint4 xor4(uint4 u, uint4 v) { return make_uint4(u.x ^ v.x, u.y ^ v.y, u.z ^ v.z, u.w ^ v.w); }

// Grid-stride (every block an equal static share). times != null: each block's start and end
// (globaltimer) and its SM go to times[3 * block ...].
extern "C" __global__ void grid_stride(const uint4* a, const uint4* b, uint4* c, long long n,
                                       unsigned long long* times) {
    unsigned long long start, end;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) c[i] = xor4(a[i], b[i]);
    if (!times) return;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned sm;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(end));
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        times[3 * blockIdx.x] = start, times[3 * blockIdx.x + 1] = end, times[3 * blockIdx.x + 2] = sm;
    }
}
// Grid-stride with two chunks a thread in flight (i and i + step loaded before either store).
extern "C" __global__ void grid_stride_2(const uint4* __restrict__ a, const uint4* __restrict__ b,
                                         uint4* __restrict__ c, long long n) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 2 * step) {
        const bool second = i + step < n;
        const uint4 u = a[i], v = b[i];
        uint4 u2 = u, v2 = v;
        if (second) u2 = a[i + step], v2 = b[i + step];
        c[i] = xor4(u, v);
        if (second) c[i + step] = xor4(u2, v2);
    }
}
// Each block a contiguous range.
extern "C" __global__ void blocked(const uint4* a, const uint4* b, uint4* c, long long n) {
    const long long per = (n + gridDim.x - 1) / gridDim.x, begin = blockIdx.x * per;
    const long long end = begin + per < n ? begin + per : n;
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) c[i] = xor4(a[i], b[i]);
}
// Tiles of blockDim.x chunks handed out in order by a counter (zeroed before the launch): the blocks
// work on neighbouring tiles at any time, as a full grid's do, however fast each one runs.
extern "C" __global__ void dynamic(const uint4* a, const uint4* b, uint4* c, long long n, unsigned* counter) {
    __shared__ unsigned tile;
    for (;;) {
        if (threadIdx.x == 0) tile = atomicAdd(counter, 1u);
        __syncthreads();
        const long long first = (long long)tile * blockDim.x, i = first + threadIdx.x;
        __syncthreads();
        if (first >= n) return;
        if (i < n) c[i] = xor4(a[i], b[i]);
    }
}
// Grid-stride in bands (one chunk a thread a band, each block a band after the other), a block starting
// band k only once every block has finished band k - lag: the blocks stay within `lag` bands of each
// other. progress counts finished (block, band) pairs (zeroed before the launch; the grid must be
// resident at once).
extern "C" __global__ void lockstep(const uint4* a, const uint4* b, uint4* c, long long n, unsigned* progress,
                                    int lag) {
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
        if (i < n) c[i] = xor4(a[i], b[i]);
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(progress, 1u);
    }
}
// The staged backward's memory schedule with no arithmetic: a row of blockDim.x chunks a block, rows
// blockIdx.x, + gridDim.x, ...; each thread cp.async-copies its chunk of the next 3 rows' a and b into
// shared memory, reads the current one back, refills its stage, passes `barriers` __syncthreads (the
// backward's row reduction has two) and stores.
__device__ __forceinline__ void stage_copy(uint4* dst, const uint4* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}
extern "C" __global__ void staged(const uint4* a, const uint4* b, uint4* c, long long n, int barriers) {
    constexpr int STAGES = 3;
    extern __shared__ uint4 buf[];  // [STAGES][a, b][blockDim.x]
    const int t = threadIdx.x, w = blockDim.x;
    const long long rows = n / w;
    for (int s = 0; s < STAGES; ++s) {
        const long long r = blockIdx.x + (long long)s * gridDim.x;
        if (r < rows) stage_copy(buf + (2 * s) * w + t, a + r * w + t), stage_copy(buf + (2 * s + 1) * w + t, b + r * w + t);
        asm volatile("cp.async.commit_group;");
    }
    int s = 0;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        asm volatile("cp.async.wait_group 2;" ::: "memory");
        const uint4 u = buf[(2 * s) * w + t], v = buf[(2 * s + 1) * w + t];
        const long long next = r + STAGES * (long long)gridDim.x;
        if (next < rows) stage_copy(buf + (2 * s) * w + t, a + next * w + t), stage_copy(buf + (2 * s + 1) * w + t, b + next * w + t);
        asm volatile("cp.async.commit_group;");
        s = s + 1 == STAGES ? 0 : s + 1;
        for (int k = 0; k < barriers; ++k) __syncthreads();
        c[r * w + t] = xor4(u, v);
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}
"""
KERNELS = ("grid_stride", "grid_stride_2", "blocked", "dynamic", "lockstep", "staged")


def stream_variants(n, n_sm, counter, row_chunks):
    """(label, kernel, grid, block, extra arguments, zero the counter first) of each stream timed."""
    null = cupy.uint64(0)  # grid_stride's times
    wave = [("1 wave x 256", n_sm * 8, 256), ("1 wave x 512", n_sm * 4, 512)]
    # The staged backward's geometry for rows of 8-16 KiB (a row a block, one 16-byte chunk a thread, 2
    # blocks an SM; the backward itself takes 512 threads x 2 chunks for 16 KiB rows).
    staged = [] if not 512 <= row_chunks <= 1024 else (
        [(f"grid-stride, 2 blocks an SM x {row_chunks}", "grid_stride", n_sm * 2, row_chunks, (null,), False)]
        + [(f"staged rows, {b} blocks an SM x {row_chunks}, {k} barriers a row", "staged", n_sm * b, row_chunks,
            (cupy.int32(k),), False) for b, k in ((2, 0), (2, 2), (4, 0)) if b * row_chunks <= 2048])
    return ([("full grid", "grid_stride", -(-n // 256), 256, (null,), False)] + staged
            + [(label, "grid_stride", g, b, (null,), False) for label, g, b in wave]
            + [("2 waves x 256", "grid_stride", n_sm * 16, 256, (null,), False),
               ("grid-stride 2 in flight, 1 wave x 256", "grid_stride_2", n_sm * 8, 256, (), False)]
            + [(f"blocked {label}", "blocked", g, b, (), False) for label, g, b in wave]
            + [(f"dynamic {label}", "dynamic", g, b, (counter,), True) for label, g, b in wave]
            + [(f"lockstep lag {lag}, 1 wave x 256", "lockstep", n_sm * 8, 256, (counter, cupy.int32(lag)), True)
               for lag in (1, 2, 4, 8, 1 << 30)])


def stream_times(copies, kernels, n_sm):
    """GPU µs of each 2-read-1-write stream of stream_variants over (dy, x) -> dx, and of torch.add."""
    outs = [torch.empty_like(c[0]) for c in copies]
    n = copies[0][0].numel() * copies[0][0].element_size() // 16
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    times = {}
    row_chunks = copies[0][0].shape[-1] * copies[0][0].element_size() // 16
    for label, name, grid, block, extra, counted in stream_variants(n, n_sm, counter.data_ptr(), row_chunks):
        shared = 3 * 2 * 16 * block if name == "staged" else 0
        if shared:
            kernels[name].max_dynamic_shared_size_bytes = shared

        def launch(c, o, kernel=kernels[name], grid=grid, block=block, extra=extra, counted=counted, shared=shared):
            if counted:
                counter.zero_()
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                kernel((grid,), (block,), (c[2].data_ptr(), c[0].data_ptr(), o.data_ptr(), cupy.int64(n), *extra),
                       shared_mem=shared)
        launch(copies[0], outs[0])
        torch.cuda.synchronize()
        assert torch.equal(outs[0].view(torch.int16), copies[0][2].view(torch.int16) ^ copies[0][0].view(torch.int16))
        times[label] = bench.gpu_time_us(torch, [lambda c=c, o=o: launch(c, o) for c, o in zip(copies, outs)])
    times["torch.add"] = bench.gpu_time_us(torch, [lambda c=c, o=o: torch.add(c[2], c[0], out=o)
                                                   for c, o in zip(copies, outs)])
    return times


def finish_times(copies, kernel, n_sm):
    """Per-block finish times of the grid_stride stream (one resident wave of 256-thread blocks)
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


def main():
    module = cupy.RawModule(code=STREAM_2R1W)
    kernels = {name: module.get_function(name) for name in KERNELS}
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
            finish_times(copies, kernels["grid_stride"], n_sm)
        cells = [f"{label} {pct(us)}" for label, us in stream_times(copies, kernels, n_sm).items()] if streams else []
        apply("")
        whole, main_us, dw_us, plan = backward_parts(copies, hidden)
        cells.append(f"cupyrope [{plan.grid} blocks] {pct(whole)} = main kernel {main_us:.1f} + dweight kernel {dw_us:.1f}")
        print(f"{rows}x{hidden} {str(dt)[6:]} {plan.name.split('::')[1]} {plan.block}:\n  " + "\n  ".join(cells),
              flush=True)
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
