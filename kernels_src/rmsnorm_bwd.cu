// RMSNorm backward: dx, and dweight summed in a fixed order (bitwise deterministic); add_rms_norm's backward adds the
// new residual's gradient to dx (residual_grad). Row layout and SHIFT: rmsnorm_common.cuh.
#include "rmsnorm_common.cuh"

namespace cupyrope {

// Resident 512-thread blocks per SM asked of the compiler for rms_norm_bwd, by register slots (1, else 2).
constexpr int BWD_MIN_BLOCKS_1 = 2;
constexpr int BWD_MIN_BLOCKS_2 = 2;

// ------------------------------------------------------------------------------------ rms_norm_bwd
// dx = rstd * g - x * rstd^3 * mean(g * x), g = dy * (w + offset); dweight = sum over rows of
// dy * x * rstd. Each block walks rows blockIdx.x*rpb + ty, + gridDim.x*rpb, ... and sums dweight
// over them in a fixed order: NPT > 0 in registers (a thread owns the same columns in every row it
// visits); NPT == 0 in shared memory, or for rows too long for it in the block's partial row. SHIFT:
// the planner makes the row step gridDim.x*rpb a multiple of E whenever a rows slot visits more than
// one row, so all its rows share one shift. The rows slots (ty) are then added in order
// into partial[blockIdx.x, :] (through shared memory when blockDim.y > 1), and rms_norm_dw adds the
// partials in a fixed order: bitwise deterministic.

struct NormBwdParams {  // mirrored by rmsnorm.py's BWD_TAIL
    const void* dy;
    const void* x;
    const void* weight;  // may be null: no dweight
    const float* rstd;   // the forward's (rms_norm_backward computes it first where not given)
    void* dx;
    float* partial;      // [gridDim.x (clusters: gridDim.x / CLUSTER), hidden]; unused without weight
    const void* residual_grad;  // may be null; else added to dx (add_rms_norm: x is the new residual, dx its gradient)
    i64 rows, hidden;
    i64 dy_stride, x_stride, dx_stride, residual_grad_stride;
    i64 shared_acc;  // 1: dynamic shared memory holds [blockDim.y, hidden] floats of dweight sums
    float offset;
    float inv_hidden;  // 1 / hidden, as in NormParams
};

// rms_norm_bwd_runs' parameters: rows in runs (row_in_runs).
struct NormBwdRunsParams : NormBwdParams {  // mirrored by rmsnorm.py's BWD_RUNS_TAIL (after BWD_TAIL)
    i64 inner_rows, dy_outer, x_outer, dx_outer;
};

// Row `row` of residual_grad for bwd_chunk: the kernels' GRAD variants (add_rms_norm's backward) take one; the
// others pass a constant null, and their code is what it is without residual_grad (a runtime test of the pointer
// made ptxas spill in the staged and read-twice kernels).
template <bool GRAD, typename T>
__device__ __forceinline__ const T* residual_grad_row(const NormBwdParams& p, i64 row) {
    return GRAD ? static_cast<const T*>(p.residual_grad) + row * p.residual_grad_stride : nullptr;
}

// dx for E columns (returned), plus g (a chunk of residual_grad) where with_grad, before dx's one rounding; adds
// dy * x * rstd to sums.
template <typename T, typename W, int E>
__device__ __forceinline__ Pack<T, E> dx_chunk(const NormBwdParams& p, const Pack<T, E>& d, const Pack<T, E>& xx,
                                               const Pack<W, E>& w, float rstd, float coef, Pack<float, E>& sums,
                                               bool with_grad, const Pack<T, E>& g) {
    Pack<T, E> out;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float xf = to_float(xx.v[e]), df = to_float(d.v[e]);
        const float dx = rstd * df * scale<W, E>(p.weight, p.offset, w, e) - xf * coef;
        out.v[e] = from_float<T>(with_grad ? dx + to_float(g.v[e]) : dx);
        sums.v[e] += df * xf * rstd;
    }
    return out;
}

// dx_chunk for E columns from column col, with the chunk of grad_row there (a row of residual_grad) where given.
template <typename T, typename W, int E, bool VEC = true, bool SHIFT = false, typename I = int>
__device__ __forceinline__ Pack<T, E> bwd_chunk(const NormBwdParams& p, const Pack<T, E>& d, const Pack<T, E>& xx,
                                                const Pack<W, E>& w, float rstd, float coef, Pack<float, E>& sums,
                                                const T* grad_row, I col, I hidden) {
    Pack<T, E> g;
    if (grad_row) g = load_chunk<VEC, SHIFT, E>(grad_row, col, hidden);
    return dx_chunk<T, W, E>(p, d, xx, w, rstd, coef, sums, grad_row != nullptr, g);
}

// The row sum the backward needs from E columns: dot += dy * (w + offset) * x. Every kernel adds a thread's
// chunks in column order and the threads by row_sum's tree (LANES_JUMP: lanes_sum_switch measured faster here),
// and takes coef the same way (row_coef): a row's dx has the same bits whichever kernel the call's size picks
// (batch invariance).
template <typename T, typename W, int E>
__device__ __forceinline__ void add_row_dot(const NormBwdParams& p, const Pack<T, E>& d, const Pack<T, E>& xx,
                                            const Pack<W, E>& w, float& dot) {
#pragma unroll
    for (int e = 0; e < E; ++e) dot += to_float(d.v[e]) * scale<W, E>(p.weight, p.offset, w, e) * to_float(xx.v[e]);
}

// rstd^3 * mean(g * x): dx = rstd * g - x * coef.
__device__ __forceinline__ float row_coef(const NormBwdParams& p, float rstd, float dot) {
    return rstd * rstd * rstd * (dot * p.inv_hidden);
}

// This thread's chunks of dy and x of one row (none past the last row) into registers; `first` is the
// thread's first column (the same in every row it visits, SHIFT included: see the kernel).
template <typename T, bool VEC, int NPT, bool SHIFT, int E, bool RUNS>
__device__ __forceinline__ void load_bwd_row(const NormBwdParams& p, i64 row, int first, int step, Pack<T, E> (&dyv)[NPT],
                                             Pack<T, E> (&xv)[NPT]) {
    if (row >= p.rows) return;
    using Runs = NormBwdRunsParams;
    const T* dy_row = static_cast<const T*>(p.dy) + (RUNS ? in_runs(p, row, p.dy_stride, &Runs::dy_outer) : row * p.dy_stride);
    const T* x_row = static_cast<const T*>(p.x) + (RUNS ? in_runs(p, row, p.x_stride, &Runs::x_outer) : row * p.x_stride);
    const int hidden = (int)p.hidden;  // rows in registers: see first_column
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        const int col = first + i * step;
        if (col < hidden) {
            dyv[i] = load_chunk<VEC, SHIFT, E>(dy_row, col, hidden);
            xv[i] = load_chunk<VEC, SHIFT, E>(x_row, col, hidden);
        }
    }
}

// rms_norm_bwd's rows (RUNS: rms_norm_bwd_runs', p a NormBwdRunsParams).
template <typename T, typename W, bool VEC, int NPT, bool SHIFT, bool GRAD, bool RUNS>
__device__ __forceinline__ void bwd_rows(const NormBwdParams& p) {
    using Runs = NormBwdRunsParams;
    static_assert(!SHIFT || VEC, "SHIFT: rows of 16-byte chunks");
    constexpr int E = VEC ? 16 / sizeof(T) : 1;
    constexpr int SLOTS = NPT > 0 ? NPT : 1;
    __shared__ float scratch[32];  // row_sum's warp partials
    extern __shared__ __align__(16) float dw_acc[];  // [blockDim.y][acc_row] when shared_acc
    const int lane = threadIdx.x, width = blockDim.x;
    const int step = width * E, hidden = (int)p.hidden;  // hidden: for NPT > 0 (see first_column)
    const i64 rows_per_pass = (i64)gridDim.x * blockDim.y;
    float* const my_partial = p.partial + (i64)blockIdx.x * p.hidden;
    // This rows slot's dweight sums: NPT == 0 per column in here; NPT > 0 in registers, stored here at the
    // end. SHIFT with NPT == 0 in shared memory: from the slot's shift (that of every row it visits, see
    // above), so that a row's chunks are whole 16-byte chunks of the sums too (acc_row: chunks_span).
    const bool acc_shifted = SHIFT && NPT == 0 && p.shared_acc;
    const i64 acc_row = acc_shifted ? chunks_span<true, E>(p.hidden) : p.hidden;
    const int acc_shift = acc_shifted ? row_shift<SHIFT, E>(static_cast<const T*>(p.x) +
                                                            ((i64)blockIdx.x * blockDim.y + threadIdx.y) * p.x_stride)
                                      : 0;
    float* const my_acc = p.shared_acc ? dw_acc + threadIdx.y * acc_row : my_partial;
    Pack<float, E> dw[SLOTS];  // NPT > 0: a thread owns the same columns in every row it visits
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) dw[i] = zeros<E>();
    if (NPT == 0 && p.weight) {  // without shared_acc, blockDim.y == 1: the partial row is ours
        for (i64 col = lane; col < acc_row; col += width) my_acc[col] = 0.f;
        __syncthreads();
    }

    // NPT > 0: registers hold this row's dy and x; with PREFETCH the next row's loads are issued
    // before this row's reduction, so they are in flight through its barriers and stores. Measured:
    // fp32 1-4% faster; fp16/bf16 3-8% slower, and with 2 slots it spills (125 registers wanted), so only
    // fp32 rows of up to 8 elements a thread prefetch.
    constexpr bool PREFETCH = VEC && NPT > 0 && sizeof(T) == 4 && NPT * E <= 8;
    Pack<T, E> dyv[SLOTS], xv[SLOTS];
    const i64 first_row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    // A thread's columns are the same in every row it visits (SHIFT: one shift per rows slot, see above).
    const int first = first_column<SHIFT, E>(
        static_cast<const T*>(p.x) + (RUNS ? in_runs(p, first_row, p.x_stride, &Runs::x_outer) : first_row * p.x_stride),
        lane);
    if constexpr (PREFETCH) load_bwd_row<T, VEC, SLOTS, SHIFT, E, RUNS>(p, first_row, first, step, dyv, xv);
    // SHIFT reads the weight element by element (8 loads a 16-bit chunk): once, kept in registers.
    constexpr bool WEIGHT_ONCE = SHIFT;
    Pack<W, E> wv[SLOTS];
    if constexpr (WEIGHT_ONCE) {
#pragma unroll
        for (int i = 0; i < SLOTS; ++i) {
            const int col = first + i * step;
            if (col < hidden) wv[i] = load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, hidden);
        }
    }
    // The loop bound is uniform across the block (the reductions contain barriers).
    for (i64 base = (i64)blockIdx.x * blockDim.y; base < p.rows; base += rows_per_pass) {
        const i64 row = base + threadIdx.y;
        const bool active = row < p.rows;
        const T* dy_row =
            static_cast<const T*>(p.dy) + (RUNS ? in_runs(p, row, p.dy_stride, &Runs::dy_outer) : row * p.dy_stride);
        const T* x_row = static_cast<const T*>(p.x) + (RUNS ? in_runs(p, row, p.x_stride, &Runs::x_outer) : row * p.x_stride);
        T* dx_row = static_cast<T*>(p.dx) + (RUNS ? in_runs(p, row, p.dx_stride, &Runs::dx_outer) : row * p.dx_stride);
        const T* grad_row = residual_grad_row<GRAD, T>(p, row);
        float dot = 0.f;
        if constexpr (NPT > 0) {
            if constexpr (!PREFETCH) load_bwd_row<T, VEC, SLOTS, SHIFT, E, RUNS>(p, row, first, step, dyv, xv);
#pragma unroll
            for (int i = 0; i < NPT; ++i) {
                const int col = first + i * step;
                if (active && col < hidden) {
                    if constexpr (!WEIGHT_ONCE) {
                        const Pack<W, E> w = load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, hidden);
                        add_row_dot<T, W, E>(p, dyv[i], xv[i], w, dot);
                    } else {
                        add_row_dot<T, W, E>(p, dyv[i], xv[i], wv[i], dot);
                    }
                }
            }
        } else {
            for (i64 col = first; active && col < p.hidden; col += step) {
                const Pack<T, E> d = load_chunk<VEC, SHIFT, E>(dy_row, col, p.hidden);
                const Pack<T, E> xx = load_chunk<VEC, SHIFT, E>(x_row, col, p.hidden);
                add_row_dot<T, W, E>(p, d, xx, load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, p.hidden), dot);
            }
        }
        Pack<T, E> next_dy[SLOTS], next_x[SLOTS];
        if constexpr (PREFETCH) load_bwd_row<T, VEC, SLOTS, SHIFT, E, RUNS>(p, row + rows_per_pass, first, step, next_dy, next_x);
        const float row_dot = row_sum<LANES_JUMP>(dot, width, scratch);
        const float rstd = active ? p.rstd[row] : 0.f;
        const float coef = row_coef(p, rstd, row_dot);

        if (active) {
            if constexpr (NPT > 0) {
    #pragma unroll
                for (int i = 0; i < NPT; ++i) {
                    const int col = first + i * step;
                    if (col < hidden) {
                        if constexpr (!WEIGHT_ONCE)
                            wv[i] = load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, hidden);
                        // SHIFT: columns outside the row were loaded as 0 and add 0 to their sums.
                        store_chunk<VEC, SHIFT, E>(dx_row, col, hidden,
                                                   bwd_chunk<T, W, E, VEC, SHIFT>(p, dyv[i], xv[i], wv[i], rstd, coef,
                                                                                  dw[i], grad_row, col, hidden));
                    }
                }
            } else {
                // SHIFT: sums in the partial row (rows too long for shared memory) are by column, off
                // 16-byte boundaries: one by one. Chunks past the row's ends add 0 to the shifted sums.
                const bool by_column = SHIFT && !p.shared_acc;
                float* const acc_at = my_acc + acc_shift;
                for (i64 col = first; col < p.hidden; col += step) {
                    const Pack<T, E> d = load_chunk<VEC, SHIFT, E>(dy_row, col, p.hidden);
                    const Pack<T, E> xx = load_chunk<VEC, SHIFT, E>(x_row, col, p.hidden);
                    const Pack<W, E> w = load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, p.hidden);
                    Pack<float, E> acc = zeros<E>();
                    if (p.weight)
                        acc = by_column ? load_chunk<false, true, E>(my_acc, col, p.hidden) : load_pack<VEC, E>(acc_at + col);
                    store_chunk<VEC, SHIFT, E>(dx_row, col, p.hidden,
                                               bwd_chunk<T, W, E, VEC, SHIFT>(p, d, xx, w, rstd, coef, acc, grad_row, col,
                                                                              p.hidden));
                    if (!p.weight) continue;
                    if (by_column) store_chunk<false, true, E>(my_acc, col, p.hidden, acc);
                    else store_pack<VEC, E>(acc_at + col, acc);
                }
            }
        }

        if constexpr (PREFETCH) {
#pragma unroll
            for (int i = 0; i < SLOTS; ++i) {
                dyv[i] = next_dy[i];
                xv[i] = next_x[i];
            }
        }
    }
    if (!p.weight) return;  // uniform across the grid
    if constexpr (NPT > 0) {
        // Register sums -> the partial row (one rows slot) or this slot's shared row; every column is
        // written (the chunks cover the row). SHIFT: float columns off 16-byte boundaries, one by one.
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (col < hidden) store_chunk<VEC && !SHIFT, SHIFT, E>(my_acc, col, hidden, dw[i]);
        }
    }
    if (!p.shared_acc) return;
    __syncthreads();
    // partial[block, col] = sum over the block's rows slots, in order.
    for (i64 col = threadIdx.y * width + lane; col < p.hidden; col += width * blockDim.y) {
        float total = 0.f;
        for (int r = 0; r < (int)blockDim.y; ++r) total += dw_acc[r * acc_row + acc_shift + col];
        my_partial[col] = total;
    }
}

template <typename T, typename W, bool VEC, int NPT, bool SHIFT, bool GRAD>
__global__ void __launch_bounds__(512, NPT == 1 ? BWD_MIN_BLOCKS_1 : BWD_MIN_BLOCKS_2)
    rms_norm_bwd(const NormBwdParams p) {
    wait_for_previous_grid();
    bwd_rows<T, W, VEC, NPT, SHIFT, GRAD, false>(p);
}

// rms_norm_bwd on rows in runs (row_in_runs), held in registers, without residual_grad.
template <typename T, typename W, bool VEC, int NPT, bool SHIFT>
__global__ void __launch_bounds__(512, NPT == 1 ? BWD_MIN_BLOCKS_1 : BWD_MIN_BLOCKS_2)
    rms_norm_bwd_runs(const NormBwdRunsParams p) {
    static_assert(NPT > 0, "rows held in registers");
    wait_for_previous_grid();
    bwd_rows<T, W, VEC, NPT, SHIFT, false, true>(p);
}

// ----------------------------------------------------------------------- backward, staged rows
// One row per block, for 16-byte chunks of rows (VEC; SHIFT as in rms_norm_bwd). The block walks rows blockIdx.x,
// + gridDim.x, ... and keeps the next STAGES rows' dy and x in flight: cp.async copies them into
// shared memory, where they hold no registers (a register prefetch cost occupancy). A thread
// copies, and later reads, only its own chunks (lane + i * blockDim.x), so the staging needs no
// barriers. The current row moves to registers; its stage is refilled with the row STAGES ahead as
// soon as those values are consumed. dweight sums stay in registers (a thread owns the same columns
// in every row) and go to partial[blockIdx.x, :] at the end, as in rms_norm_bwd.
// SHIFT: chunks follow memory's 16-byte boundaries (rmsnorm_common.cuh); the planner keeps the
// grid a multiple of the elements in 16 bytes, so all rows of a block share one shift. A row's first
// chunk is copied whole from up to 15 bytes before the row (the same aligned 16 bytes, so the same
// allocation), its last chunk only up to the row's end; columns outside the row are zeroed after the
// copy. The weight, read element by element, stays in registers for all rows.
// LEAN (the planner's STAGED_LEAN_MAX_ROWS: blocks that walk few rows with 1 or 2 chunks a thread, fp32
// rows of 4 chunks): the weights kept in registers for all rows (aligned rows too). Measured 5-16% faster where a
// block walks up to ~40 rows (bf16 [2048, 4096], [8192, 1024-2053], odd 1027; 2 chunks: bf16 [2048,
// 8192] 20%) and 2-16% with fp32 rows of 4 chunks (hidden 5120-8192, any length), but 5% slower at bf16
// [32768, 4096] (124 rows a block): there the longer chain stays (a sensitivity to the L2's dirty lines
// left by the previous call, not to instructions).
// Launch bound: 1 chunk a thread, and 2 without LEAN, fit the 64 registers of 1024-thread blocks
// (2 spill 4-12 bytes); LEAN at 2 chunks (92-102 registers: it spilled at 64 and was up to 25% slower),
// 4 and 8 chunks take the 512-thread bound (128 registers). Mirrored by rmsnorm_plan_backward.py's
// STAGED_MAX_THREADS and STAGED_LEAN_MAX_THREADS.
template <int NPT, bool LEAN>
struct StagedMaxThreads {
    static constexpr int value = NPT == 1 || (NPT == 2 && !LEAN) ? 1024 : 512;
};

// The tensors a stage holds: dy and x, and with GRAD (in rms_norm_bwd_staged and rms_norm_bwd_cluster) residual_grad.
template <bool GRAD>
constexpr int STAGE_TENSORS = GRAD ? 3 : 2;

// A thread's slot for chunk i of a tensor of a stage: [STAGES][TENSORS][NPT][blockDim.x] chunks (STAGE_TENSORS).
template <int NPT, int TENSORS = 2>
__device__ __forceinline__ uint4* stage_slot(uint4* staged, int stage, int tensor, int i) {
    return staged + ((stage * TENSORS + tensor) * NPT + i) * blockDim.x + threadIdx.x;
}

// Column of a thread's chunk i. Aligned rows take their own expressions (lane * E here, plain 16-byte copies and
// stores below) rather than SHIFT's with a shift of 0: ptxas allocated registers differently for those and the
// aligned variants measured 1-3% slower.
template <bool SHIFT, int E>
__device__ __forceinline__ int staged_column(int first, int lane, int i, int step) {
    return SHIFT ? first + i * step : lane * E + i * step;
}

// Starts copying this thread's chunk at `col` of a row into its slot: aligned rows 16 bytes; SHIFT only what lies
// before the row's end.
template <bool SHIFT, typename T>
__device__ __forceinline__ void stage_chunk(uint4* slot, const T* row, int col, int hidden) {
    constexpr int E = 16 / sizeof(T);
    if (SHIFT && col + E > hidden) copy_async16_first(slot, row + col, (hidden - col) * (int)sizeof(T));
    else copy_async16(slot, row + col);
}

// Starts copying this thread's chunks of row `row`'s dy and x (nothing past the last row) into `stage`, as one
// commit group (an empty one past the last row, so every thread's group count stays the same); TENSORS 3: the
// group stays open for stage_grad. `first`: the thread's first column (rows are < 2^31 elements: planner).
template <typename T, int NPT, bool SHIFT, int TENSORS = 2>
__device__ __forceinline__ void stage_row(const NormBwdParams& p, uint4* staged, i64 row, int stage, int first) {
    constexpr int E = 16 / sizeof(T);
    if (row < p.rows) {
        const T* dy_row = static_cast<const T*>(p.dy) + row * p.dy_stride;
        const T* x_row = static_cast<const T*>(p.x) + row * p.x_stride;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            // Aligned rows: their own expression (see staged_column).
            const int col = SHIFT ? first + i * blockDim.x * E : (i * blockDim.x + threadIdx.x) * E;
            if (col < p.hidden) {
                stage_chunk<SHIFT>(stage_slot<NPT, TENSORS>(staged, stage, 0, i), dy_row, col, (int)p.hidden);
                stage_chunk<SHIFT>(stage_slot<NPT, TENSORS>(staged, stage, 1, i), x_row, col, (int)p.hidden);
            }
        }
    }
    if (TENSORS == 2) copy_async_commit();
}

// The rest of stage_row's group for a stage of three tensors: row `row`'s residual_grad, then the commit. Copied
// once the stage's residual_grad has been read (after dx's stores), where dy and x go as soon as they are in
// registers; staged rather than loaded at dx's store, where each row waited a memory round trip for it.
template <typename T, int NPT, bool SHIFT>
__device__ __forceinline__ void stage_grad(const NormBwdParams& p, uint4* staged, i64 row, int stage, int first) {
    constexpr int E = 16 / sizeof(T);
    if (row < p.rows) {
        const T* grad_row = static_cast<const T*>(p.residual_grad) + row * p.residual_grad_stride;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = SHIFT ? first + i * blockDim.x * E : (i * blockDim.x + threadIdx.x) * E;  // stage_row's
            if (col < p.hidden)
                stage_chunk<SHIFT>(stage_slot<NPT, STAGE_TENSORS<true>>(staged, stage, 2, i), grad_row, col, (int)p.hidden);
        }
    }
    copy_async_commit();
}

// The rstd of the rows a block walks one at a time (first_row, + row_step, ...), each loaded a row ahead so that
// it is not on its row's critical path.
struct RstdAhead {
    float next;
    __device__ __forceinline__ RstdAhead(const NormBwdParams& p, i64 first_row)
        : next(first_row < p.rows ? p.rstd[first_row] : 0.f) {}
    __device__ __forceinline__ float take(const NormBwdParams& p, i64 row, i64 row_step) {  // once a row, in order
        const float current = next;
        if (row + row_step < p.rows) next = p.rstd[row + row_step];
        return current;
    }
};

// A staged chunk back from shared memory; SHIFT: its columns outside the row read as 0.
template <bool SHIFT, typename T, int E>
__device__ __forceinline__ Pack<T, E> unstage_chunk(const uint4* slot, int col, int hidden) {
    Pack<T, E> pk = load_pack<true, E>(reinterpret_cast<const T*>(slot));
    if (SHIFT && (col < 0 || col + E > hidden)) {
#pragma unroll
        for (int e = 0; e < E; ++e)
            if (!inside(col + e, hidden)) pk.v[e] = from_float<T>(0.f);
    }
    return pk;
}

// Weights of chunk i: HOLD keeps them in registers (wv: read once, SHIFT element by element); otherwise
// they are loaded again per row (vector loads from L1).
template <bool HOLD, int E, typename W, int N>
__device__ __forceinline__ Pack<W, E> staged_weight(const NormBwdParams& p, const Pack<W, E> (&wv)[N], int i, int col) {
    return HOLD ? wv[HOLD ? i : 0] : load_weight<W, true, E>(p.weight, col);
}

// A staged kernel's dweight sums (none without a weight) into the block's partial row, my_partial. SHIFT: float
// columns off 16-byte boundaries, one by one; `accumulate` adds them to what the row holds (rms_norm_bwd_split's
// odd rows, from their second class on). `hidden` as the kernel holds it (i64 or int: either kernel's SASS kept).
template <bool SHIFT, int NPT, int E, typename I>
__device__ __forceinline__ void store_staged_partial(const NormBwdParams& p, float* my_partial, const Pack<float, E> (&dw)[NPT],
                                                     int first, int lane, int step, I hidden, bool accumulate = false) {
    if (!p.weight) return;
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        const int col = staged_column<SHIFT, E>(first, lane, i, step);
        if (col < hidden) {
            if constexpr (SHIFT) {
                Pack<float, E> sums = dw[i];
                if (accumulate) {
                    const Pack<float, E> held = load_chunk<false, true, E>(my_partial, col, (int)hidden);
#pragma unroll
                    for (int e = 0; e < E; ++e) sums.v[e] += held.v[e];
                }
                store_chunk<false, true, E>(my_partial, col, (int)hidden, sums);
            } else {
                store_pack<true, E>(my_partial + col, dw[i]);
            }
        }
    }
}

// The block's rows (blockIdx.x, + gridDim.x, ...): dx written, dw[i] the dweight sums of chunk i from column
// `first` (set here: the same in every row of the block, SHIFT with its one shift), staged through `staged`
// ([STAGES][dy, x, GRAD: residual_grad][NPT][blockDim.x] chunks of dynamic shared memory).
template <typename T, typename W, int NPT, int STAGES, bool SHIFT, bool LEAN, bool GRAD, int E>
__device__ __forceinline__ void walk_staged_rows(const NormBwdParams& p, float* scratch, uint4* staged, int& first,
                                                 Pack<float, E> (&dw)[NPT]) {
    constexpr int TENSORS = STAGE_TENSORS<GRAD>;
    const int lane = threadIdx.x, width = blockDim.x;
    const int step = width * E, hidden = (int)p.hidden;
    const i64 row_step = gridDim.x;
    first = first_column<SHIFT, E>(static_cast<const T*>(p.x) + (i64)blockIdx.x * p.x_stride, lane);
    constexpr bool HOLD = SHIFT || LEAN;  // the weights stay in registers for all rows
    Pack<W, E> wv[HOLD ? NPT : 1];
#pragma unroll
    for (int i = 0; i < NPT; ++i) dw[i] = zeros<E>();
    if constexpr (HOLD) {
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = staged_column<SHIFT, E>(first, lane, i, step);
            if (col < p.hidden) wv[HOLD ? i : 0] = load_weight_chunk<W, true, SHIFT, E>(p.weight, col, hidden);
        }
    }

#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
        stage_row<T, NPT, SHIFT, TENSORS>(p, staged, blockIdx.x + s * row_step, s, first);
        if constexpr (GRAD) stage_grad<T, NPT, SHIFT>(p, staged, blockIdx.x + s * row_step, s, first);
    }
    RstdAhead given(p, blockIdx.x);
    int stage = 0;
    // The loop bound is uniform across the block (one row per block; the reduction has barriers).
#pragma unroll 1
    for (i64 row = blockIdx.x; row < p.rows; row += row_step) {
        const float rstd = given.take(p, row, row_step);
        copy_async_wait<STAGES - 1>();  // this row's group is complete
        Pack<T, E> dyv[NPT], xv[NPT];
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = staged_column<SHIFT, E>(first, lane, i, step);
            if (col < p.hidden) {
                dyv[i] = unstage_chunk<SHIFT, T, E>(stage_slot<NPT, TENSORS>(staged, stage, 0, i), col, hidden);
                xv[i] = unstage_chunk<SHIFT, T, E>(stage_slot<NPT, TENSORS>(staged, stage, 1, i), col, hidden);
                const Pack<W, E> w = staged_weight<HOLD, E>(p, wv, i, col);
                add_row_dot<T, W, E>(p, dyv[i], xv[i], w, dot);
            }
        }
        // The shared reads above precede this refill in program order, and a copy's write lands
        // only after its global read: the slots are free.
        stage_row<T, NPT, SHIFT, TENSORS>(p, staged, row + STAGES * row_step, stage, first);
        const int current = stage;  // GRAD: its residual_grad is read below
        stage = stage + 1 == STAGES ? 0 : stage + 1;
        const float coef = row_coef(p, rstd, row_sum<LANES_JUMP>(dot, width, scratch));
        T* dx_row = static_cast<T*>(p.dx) + row * p.dx_stride;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = staged_column<SHIFT, E>(first, lane, i, step);
            if (col < p.hidden) {
                const Pack<W, E> w = staged_weight<HOLD, E>(p, wv, i, col);
                Pack<T, E> g;  // GRAD: this row's residual_grad (outside a shifted row: not stored)
                if constexpr (GRAD)
                    g = load_pack<true, E>(reinterpret_cast<const T*>(stage_slot<NPT, TENSORS>(staged, current, 2, i)));
                if constexpr (SHIFT)
                    store_chunk<true, true, E>(dx_row, col, hidden, dx_chunk<T, W, E>(p, dyv[i], xv[i], w, rstd, coef,
                                                                                     dw[i], GRAD, g));
                else
                    store_pack<true, E>(dx_row + col, dx_chunk<T, W, E>(p, dyv[i], xv[i], w, rstd, coef, dw[i], GRAD, g));
            }
        }
        if constexpr (GRAD) stage_grad<T, NPT, SHIFT>(p, staged, row + STAGES * row_step, current, first);
    }
    copy_async_wait<0>();  // no copy may outlive the block
}

template <typename T, typename W, int NPT, int STAGES, bool SHIFT, bool LEAN, bool GRAD>
__global__ void __launch_bounds__(StagedMaxThreads<NPT, LEAN>::value, 1) rms_norm_bwd_staged(const NormBwdParams p) {
    wait_for_previous_grid();
    constexpr int E = 16 / sizeof(T);
    __shared__ float scratch[32];  // row_sum's warp partials
    extern __shared__ __align__(STAGE_ALIGN) uint4 staged[];  // [STAGES][dy, x, GRAD: residual_grad][NPT][blockDim.x]
    int first;
    Pack<float, E> dw[NPT];
    walk_staged_rows<T, W, NPT, STAGES, SHIFT, LEAN, GRAD>(p, scratch, staged, first, dw);
    store_staged_partial<SHIFT>(p, p.partial + (i64)blockIdx.x * p.hidden, dw, first, threadIdx.x, blockDim.x * E, p.hidden);
}

// ------------------------------------------------------------------ backward, blocks in clusters
// rms_norm_bwd_staged's LEAN walk on clusters of CLUSTER blocks (sm_90+), each block keeping its dweight sums in
// its own shared memory, after the stages. After a cluster barrier, the cluster's threads each add columns across
// the blocks' sums in rank order (distributed shared memory), so a cluster leaves one row of sums, not CLUSTER:
// - one cluster (calls of few rows, a launch profile's one_cluster_max_rows): that row is dweight (W*, hidden values,
//   in p.partial), in one launch instead of rms_norm_bwd_staged and rms_norm_dw; the same additions, in the same
//   order, as rms_norm_dw over the staged kernel's CLUSTER partial rows (bitwise equal);
// - several (large calls, CLUSTER_ROUNDS_ROWS): cluster c's row is partial row c for rms_norm_dw. The grid is
//   several rounds of the clusters the GPU holds at once, so the SMs that stream faster take more of the rows,
//   with no more partial rows than a one-wave staged grid.
// Deterministic either way: a block's rows, and the order of every addition, follow from the grid alone.
template <typename T, typename W, int NPT, int STAGES, bool SHIFT, int CLUSTER, bool GRAD>
__global__ void CLUSTER_DIMS(CLUSTER) __launch_bounds__(StagedMaxThreads<NPT, true>::value, 1)
    rms_norm_bwd_cluster(const NormBwdParams p) {
    wait_for_previous_grid();
#if CUPYROPE_CLUSTERS
    constexpr int E = 16 / sizeof(T);
    __shared__ float scratch[32];  // row_sum's warp partials
    extern __shared__ __align__(STAGE_ALIGN) uint4 staged[];  // the stages, then this block's dweight sums: [hidden] floats
    float* sums = reinterpret_cast<float*>(staged + STAGES * STAGE_TENSORS<GRAD> * NPT * blockDim.x);
    int first;
    Pack<float, E> dw[NPT];
    walk_staged_rows<T, W, NPT, STAGES, SHIFT, true, GRAD>(p, scratch, staged, first, dw);
    const int hidden = (int)p.hidden;
    store_staged_partial<SHIFT>(p, sums, dw, first, threadIdx.x, blockDim.x * E, hidden);
    cluster_sync();  // every block's sums are in its shared memory
    const bool one = gridDim.x == CLUSTER;  // else each cluster's partial row
    W* dweight = reinterpret_cast<W*>(p.partial);
    float* partial = p.partial + (i64)(blockIdx.x / CLUSTER) * hidden;
    for (int col = (blockIdx.x % CLUSTER) * blockDim.x + threadIdx.x; col < hidden; col += CLUSTER * blockDim.x) {
        float total = 0.f;
#pragma unroll
        for (int r = 0; r < CLUSTER; ++r) total += load_shared_of_rank(sums + col, r);
        if (one)
            dweight[col] = from_float<W>(total);
        else
            partial[col] = total;
    }
    cluster_sync();  // no block exits while a peer may still read its shared memory
#else
    __trap();  // no clusters before sm_90: the planner never launches it there
#endif
}

// ------------------------------------------------------------------ backward, rows read twice from shared
// Rows that rms_norm_bwd_staged cannot hold in registers with their dweight sums (aligned fp16/bf16 rows of
// 16K-32K elements: 4 chunks a thread; fp32 of 16K-~29K: 8; SHIFT: odd ones from 512 chunks), on up to 1024
// threads. One row per block and STAGES rows copied ahead (the planner's REREAD_STAGES: one; more measured
// slower), as in rms_norm_bwd_staged (same stages, same copies), but the current row stays in its stage and
// is read twice from it: for the row sums, then for dx; the stage is refilled after that. Registers hold only
// the dweight sums (a thread owns the same columns in every row); the weight is loaded per row (L1). The
// SHIFT: every row of the block starts at the same offset from a 16-byte boundary (planner), and the weight is
// copied once into shared memory after the stages, from that offset, so that each chunk's weights are one
// aligned read there instead of E element loads from global memory (registers cannot hold them: spills; element
// loads from global memory measured 13-29% slower).
template <bool SHIFT, typename W, int E>
__device__ __forceinline__ Pack<W, E> reread_weight(const NormBwdParams& p, const W* shifted_weight, int col, int shift) {
    if constexpr (SHIFT) {
        if (p.weight) return load_pack<true, E>(shifted_weight + col + shift);
    }
    return load_weight<W, true, E>(p.weight, col);
}

// Rows first_row, + row_step, ... below p.rows: rms_norm_bwd_reread's (SPLIT 1), or rms_norm_bwd_split's (SPLIT > 1:
// a cluster's; p describes the block's part of them, p.partial its part of the cluster's partial row; the row sums
// are added over the cluster, `turn` counting the cluster's rows: cluster_sum). `accumulate`: the dweight sums are added
// to the partial row (SHIFT only).
template <typename T, typename W, int NPT, int STAGES, bool SHIFT, int SPLIT, bool GRAD>
__device__ __forceinline__ void reread_rows(const NormBwdParams& p, i64 first_row, i64 row_step,
                                            ClusterSums<SPLIT, float>& cluster, unsigned& turn, bool accumulate = false) {
    constexpr int E = 16 / sizeof(T);
    __shared__ float scratch[32];  // row_sum's warp partials
    extern __shared__ __align__(STAGE_ALIGN) uint4 staged[];  // [STAGES][dy, x][NPT][blockDim.x]; SHIFT: then the weight
    const int lane = threadIdx.x, width = blockDim.x;
    const int step = width * E, hidden = (int)p.hidden;
    const int shift = row_shift<SHIFT, E>(static_cast<const T*>(p.x) + first_row * p.x_stride);
    const int first = SHIFT ? lane * E - shift : 0;  // aligned rows: their own expressions (see staged_column)
#pragma unroll
    for (int s = 0; s < STAGES; ++s) stage_row<T, NPT, SHIFT>(p, staged, first_row + s * row_step, s, first);
    // SHIFT: column c's weight at c + shift. A thread copies only its own chunks' weights, which only it reads
    // (no barrier), all loads at once (a block-strided loop over the row measured 4-8% slower).
    W* const shifted_weight = reinterpret_cast<W*>(staged + STAGES * 2 * NPT * width);
    if (SHIFT && p.weight) {
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = staged_column<SHIFT, E>(first, lane, i, step);
            if (col < hidden)
                store_pack<true, E>(shifted_weight + col + shift, load_weight_chunk<W, true, true, E>(p.weight, col, hidden));
        }
    }
    Pack<float, E> dw[NPT];
#pragma unroll
    for (int i = 0; i < NPT; ++i) dw[i] = zeros<E>();
    RstdAhead given(p, first_row);
    int stage = 0;
    // The loop bound is uniform across the block (one row per block; the reduction has barriers) and, SPLIT,
    // across the cluster.
#pragma unroll 1
    for (i64 row = first_row; row < p.rows; row += row_step) {
        const float rstd = given.take(p, row, row_step);
        copy_async_wait<STAGES - 1>();  // this row's group is complete
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = staged_column<SHIFT, E>(first, lane, i, step);
            if (col < hidden)
                add_row_dot<T, W, E>(p, unstage_chunk<SHIFT, T, E>(stage_slot<NPT>(staged, stage, 0, i), col, hidden),
                                     unstage_chunk<SHIFT, T, E>(stage_slot<NPT>(staged, stage, 1, i), col, hidden),
                                     reread_weight<SHIFT, W, E>(p, shifted_weight, col, shift), dot);
        }
        const float row_dot = cluster_sum<SPLIT>(row_sum<LANES_JUMP>(dot, width, scratch), cluster, turn++);
        const float coef = row_coef(p, rstd, row_dot);
        T* dx_row = static_cast<T*>(p.dx) + row * p.dx_stride;
        const T* grad_row = residual_grad_row<GRAD, T>(p, row);
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = staged_column<SHIFT, E>(first, lane, i, step);
            if (col < hidden) {
                // bwd_chunk's result passed straight to the store: through a local variable (or a helper that
                // takes it), ptxas scheduled the aligned kernel differently, and slower.
                const uint4 *dy_slot = stage_slot<NPT>(staged, stage, 0, i), *x_slot = stage_slot<NPT>(staged, stage, 1, i);
                if constexpr (SHIFT)
                    store_chunk<true, true, E>(dx_row, col, hidden,
                                               bwd_chunk<T, W, E, true, true>(p, unstage_chunk<SHIFT, T, E>(dy_slot, col, hidden),
                                                                  unstage_chunk<SHIFT, T, E>(x_slot, col, hidden),
                                                                  reread_weight<SHIFT, W, E>(p, shifted_weight, col, shift),
                                                                  rstd, coef, dw[i], grad_row, col, hidden));
                else
                    store_pack<true, E>(dx_row + col, bwd_chunk<T, W, E>(p, unstage_chunk<SHIFT, T, E>(dy_slot, col, hidden),
                                                                         unstage_chunk<SHIFT, T, E>(x_slot, col, hidden),
                                                                         reread_weight<SHIFT, W, E>(p, shifted_weight, col, shift),
                                                                         rstd, coef, dw[i], grad_row, col, hidden));
            }
        }
        // The shared reads above precede this refill in program order, and a copy's write lands only after
        // its global read: the stage is free.
        stage_row<T, NPT, SHIFT>(p, staged, row + STAGES * row_step, stage, first);
        stage = stage + 1 == STAGES ? 0 : stage + 1;
    }
    copy_async_wait<0>();  // no copy may outlive the block
    store_staged_partial<SHIFT>(p, SPLIT > 1 ? p.partial : p.partial + first_row * p.hidden, dw, first, lane, step, hidden,
                                accumulate);
}

template <typename T, typename W, int NPT, int STAGES, bool SHIFT, bool GRAD>
__global__ void __launch_bounds__(1024, 1) rms_norm_bwd_reread(const NormBwdParams p) {
    wait_for_previous_grid();
    ClusterSums<1, float> no_cluster;  // unused: a block holds whole rows
    unsigned turn = 0;
    reread_rows<T, W, NPT, STAGES, SHIFT, 1, GRAD>(p, blockIdx.x, gridDim.x, no_cluster, turn);
}

// ----------------------------------------------------------------- backward, rows split over a cluster
// Rows too long for one block's shared memory (aligned fp16/bf16 over 32K elements, fp32 over ~29K; SHIFT, odd
// rows: past what a stage and the weight's copy hold, fp16/bf16 over ~28.6K, fp32 over ~18.9K: the two-pass loop
// of rms_norm_bwd read them twice from global memory) on a cluster of SPLIT blocks (sm_90+), each the reread
// kernel on its part of every row: the block of rank r takes columns [r * part, (r + 1) * part), part = the row's
// 16-byte chunks / SPLIT rounded up (the last part may be shorter), with one stage, and keeps its dweight sums for
// those columns of the cluster's partial row. Only the row's dot crosses blocks (cluster_sum).
// SHIFT: the dweight sums hold a thread's columns for one shift (offset of the row from a 16-byte boundary), and a
// row's shift repeats every E rows. On 2 blocks the clusters step over a multiple of E rows (the planner's
// cluster_step), so a cluster's rows share one shift; the parts split the chunks a row of any shift spans
// (cluster_part): block 0's keeps the shift, the others start on a boundary. From CLASS_WALK_MIN_SPLIT blocks
// (rounding their fewer clusters down to a multiple of E would leave SMs idle) the clusters walk the rows class by class
// (rows r = k mod E, class_run): cluster c takes places [c, c + 1) * rows / clusters of the order class 0's rows,
// then class 1's, ..., crossing few classes; at each new class the block adds its sums to its columns of the
// partial row and starts again (reread_rows' `accumulate`). Its parts are whole E-column chunks, each at the row's
// shift (cluster_columns), so that a block's columns stay the same across classes, on at most
// CLASS_WALK_MAX_THREADS (96 registers at 640: at 64, for 1024 threads, the walk's row bound pushed dweight
// sums out to local memory).
constexpr int CLASS_WALK_MIN_SPLIT = 4;  // rmsnorm_plan_backward.py's
constexpr int CLASS_WALK_MAX_THREADS = 640;  // rmsnorm_plan_backward.py's

// The rows that follow place `place` (below `end`) in the order of rows 0, E, 2E, ..., then 1, E + 1, ... (class k:
// the rows r = k mod E, q + 1 of them for k < rows mod E, else q = rows / E) within one class: the first one
// and how many (0 where place >= end).
struct ClassRun {
    int first_row, count;
};
template <int E>
__device__ __forceinline__ ClassRun class_run(int place, int end, int rows) {
    if (place >= end) return {0, 0};
    const int q = rows / E, longer = rows % E;  // classes 0 .. longer - 1 have q + 1 rows
    int k, i;
    if (place < longer * (q + 1)) {
        k = place / (q + 1), i = place % (q + 1);
    } else {
        k = longer + (place - longer * (q + 1)) / q, i = (place - longer * (q + 1)) % q;
    }
    const int class_rows = q + (k < longer);
    return {k + i * E, min(end - place, class_rows - i)};
}

__host__ __device__ constexpr bool walks_classes(bool shift, int split) { return shift && split >= CLASS_WALK_MIN_SPLIT; }

template <typename T, typename W, int NPT, int SPLIT, bool SHIFT, bool GRAD>
__global__ void CLUSTER_DIMS(SPLIT) __launch_bounds__(walks_classes(SHIFT, SPLIT) ? CLASS_WALK_MAX_THREADS : 1024, 1)
    rms_norm_bwd_split(const NormBwdParams p) {
    wait_for_previous_grid();
#if CUPYROPE_CLUSTERS
    constexpr int E = 16 / sizeof(T);
    constexpr bool WALK = walks_classes(SHIFT, SPLIT);
    const int shift = row_shift<SHIFT, E>(static_cast<const T*>(p.x) + blockIdx.x / SPLIT * p.x_stride);  // not WALK
    i64 offset;
    const i64 length = WALK ? cluster_columns<E, SPLIT>(p.hidden, offset) : cluster_part<E, SPLIT, SHIFT>(p.hidden, offset, shift);
    NormBwdParams mine = p;  // the block's part of the rows; inv_hidden stays the whole row's
    mine.dy = static_cast<const T*>(p.dy) + offset;
    mine.x = static_cast<const T*>(p.x) + offset;
    mine.dx = static_cast<T*>(p.dx) + offset;
    if (GRAD) mine.residual_grad = static_cast<const T*>(p.residual_grad) + offset;
    if (p.weight) mine.weight = static_cast<const W*>(p.weight) + offset;
    mine.hidden = length;
    const i64 cluster = blockIdx.x / SPLIT, clusters = gridDim.x / SPLIT;
    mine.partial = p.partial + cluster * p.hidden + offset;
    __shared__ ClusterSums<SPLIT, float> sums;  // the row sums of the cluster's blocks (cluster_sum)
    cluster_start(sums);
    unsigned turn = 0;  // the cluster's rows so far, over all its runs
    if constexpr (WALK) {
        const int rows = (int)p.rows;  // < 2^31: rows of over 18K elements
        int place = (int)(cluster * rows / clusters);
        const int end = (int)((cluster + 1) * rows / clusters);
        bool accumulate = false;
        do {  // once at least: a cluster with no rows (the planner makes none) writes zero sums
            const ClassRun run = class_run<E>(place, end, rows);
            mine.rows = run.first_row + (run.count - 1) * E + 1;  // past the run's last row
            reread_rows<T, W, NPT, 1, SHIFT, SPLIT, GRAD>(mine, run.first_row, E, sums, turn, accumulate);
            accumulate = true;
            place += run.count;
        } while (place < end);
    } else {  // SHIFT: block 0's part keeps the rows' shift, the others none
        reread_rows<T, W, NPT, 1, SHIFT, SPLIT, GRAD>(mine, cluster, clusters, sums, turn);
    }
#else
    __trap();  // no clusters before sm_90: the planner never launches it there
#endif
}

struct DweightParams {  // mirrored by rmsnorm.py's DW_TAIL
    const float* partial;
    void* dweight;
    i64 blocks, hidden;
};

// dweight[c] = sum over blocks b of partial[b, c] in a fixed order: with a (32, DW_SPLIT) block,
// thread row ty adds b = ty, ty + DW_SPLIT, ... in order, then the DW_SPLIT sums are added in ty
// order. Many partials are read in parallel (a serial loop over them took up to 50 us).
constexpr int DW_SPLIT = 32;

template <typename W>
__global__ void __launch_bounds__(32 * DW_SPLIT) rms_norm_dw(const DweightParams p) {
    wait_for_previous_grid();
    __shared__ float sums[DW_SPLIT][33];
    const i64 col = (i64)blockIdx.x * 32 + threadIdx.x;
    float total = 0.f;
    if (col < p.hidden)
        for (i64 b = threadIdx.y; b < p.blocks; b += DW_SPLIT) total += p.partial[b * p.hidden + col];
    sums[threadIdx.y][threadIdx.x] = total;
    __syncthreads();
    if (threadIdx.y != 0 || col >= p.hidden) return;
    total = 0.f;
    for (int r = 0; r < DW_SPLIT; ++r) total += sums[r][threadIdx.x];
    static_cast<W*>(p.dweight)[col] = from_float<W>(total);
}

}  // namespace cupyrope
