// LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(mean((x - mean)^2) + eps), over the last dimension;
// the fused residual add (ADD): residual <- x + residual (rounded to T) first, and that sum is normalized. The
// backward gives dx and per-row-slot partial sums of dweight and dbias, which rms_norm_dw (rmsnorm_bwd.cu) adds in a
// fixed order. Row layout, SHIFT and the row helpers are RMSNorm's (rmsnorm_common.cuh).
// The variance is the mean of squared deviations from the row's mean, a second pass over the row (registers or the
// L2): the one-pass E[x^2] - mean^2 loses every digit where the mean is large against the spread. One reduction of
// moments instead measured slower: each thread's (count, mean, squared deviations) merged by Chan's update 20-25%
// (its divisions made the kernel instruction-bound), each warp's merged in shared memory in one round of barriers
// 16-25% (bf16 [32768, 4096] 80% -> 67% of copy bandwidth: every lane walks the warps' moments twice).
//   T  element type of x / y / residual / dy / dx      W  weight and bias type (float or T)
#include "rmsnorm_common.cuh"

namespace cupyrope {

struct LayerNormParams {  // mirrored by layernorm.py's FWD_TAIL (after the pointers)
    const void* x;
    void* y;
    void* residual;      // ADD: x + residual is written here, then normalized
    const void* weight;  // may be null: no scale
    const void* bias;    // may be null: no shift
    float* mean;         // may be null: not returned (with rstd)
    float* rstd;
    i64 rows, hidden;
    i64 x_stride, y_stride, residual_stride;
    float eps;
    float inv_hidden;  // 1 / hidden: a multiply instead of a division on the row's critical path
};

// Whether column col + e lies inside the row: a shifted row's (SHIFT) first and last chunks hold zeros outside it,
// which add nothing to a sum but would add (0 - mean)^2 to the squares.
template <bool SHIFT, int E, typename I> __device__ __forceinline__ bool counts(I col, int e, I hidden) {
    return !SHIFT || inside<I>(col + e, hidden);
}

// The sum of a row's pairs of values (the backward's two dot sums) over its `width` threads (row_sum's layout: a
// power of two up to 32, else whole warps), to every one of them, in a fixed order: one barrier for both. Every
// thread of the block calls it; scratch holds a pair a warp, and is not the previous call's (whose partials may still
// be being read): callers alternate two arrays, the barrier of each call ordering the reads of the one before.
__device__ __forceinline__ float2 shuffle_sum(float2 v, int offset) {
    return make_float2(v.x + __shfl_xor_sync(0xffffffffu, v.x, offset),
                       v.y + __shfl_xor_sync(0xffffffffu, v.y, offset));
}

__device__ __forceinline__ float2 row_sum_pair(float2 v, int width, float2* scratch) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2)
        if (offset < width) v = shuffle_sum(v, offset);
    if (width <= 32) return v;
    const int warps = width / 32;
    float2* const partials = scratch + threadIdx.y * warps;
    if (lane == 0) partials[threadIdx.x / 32] = v;
    __syncthreads();
    int group;
    const int slot = tree_slot(warps, lane, group);
    v = slot < warps ? partials[slot] : make_float2(0.f, 0.f);
    for (int offset = 1; offset < group; offset *= 2) v = shuffle_sum(v, offset);
    return v;
}

// A chunk of the bias, zeros without one (load_weight_chunk gives ones without a weight): the output's scale and
// shift are then one fma whatever is given.
template <typename W, bool VEC, bool SHIFT, int E, typename I>
__device__ __forceinline__ Pack<W, E> load_bias_chunk(const void* bias, I col, I hidden) {
    return bias ? load_weight_chunk<W, VEC, SHIFT, E>(bias, col, hidden) : filled<W, E>(0.f);
}

template <typename T, typename W, int E>
__device__ __forceinline__ Pack<T, E> ln_output(const Held<T, E>& v, float mean, float rstd, const Pack<W, E>& w,
                                                const Pack<W, E>& b) {
    Pack<T, E> y;
#pragma unroll
    for (int e = 0; e < E; ++e)
        y.v[e] = from_float<T>(fmaf((v.at(e) - mean) * rstd, to_float(w.v[e]), to_float(b.v[e])));
    return y;
}

// y for a row's chunks held in registers. AFFINE: weight and bias both given (LayerNorm's usual case), a copy of
// the loop whose loads carry no null checks: those selects were about a fifth of the output's instructions, and rows
// of few chunks a thread are instruction-bound.
template <typename T, typename W, bool VEC, int NPT, bool SHIFT, int E, bool AFFINE>
__device__ __forceinline__ void store_held_row(T* y_row, const Held<T, E> (&v)[NPT], int first, int step, int hidden,
                                               float mean, float rstd, const void* weight, const void* bias) {
    if constexpr (AFFINE) {
        __builtin_assume(weight != nullptr);
        __builtin_assume(bias != nullptr);
    }
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        const int col = first + i * step;
        if (col < hidden) {
            const Pack<W, E> w = load_weight_chunk<W, VEC, SHIFT, E>(weight, col, hidden);
            const Pack<W, E> b = load_bias_chunk<W, VEC, SHIFT, E>(bias, col, hidden);
            store_chunk<VEC, SHIFT, E>(y_row, col, hidden, ln_output<T, W, E>(v[i], mean, rstd, w, b));
        }
    }
}

// Launch bounds by register slots. Rows of 4+ slots (with the planner's 32 elements a thread, all but the shortest
// rows) have up to 1024 threads at 64 registers; long 16-byte rows of 8 slots up to 512 threads (78-82 registers).
// Rows of 1-2 slots have blocks of up to 512 threads, as many resident as RMSNorm's forward asks for (FwdBounds), the
// fused add and shifted rows one block fewer (they spilled 16-64 bytes at those budgets). Rows read in passes
// (NPT == 0) take 512 threads.
template <bool VEC, int NPT, bool ADD, bool SHIFT>
struct LayerNormBounds {
    static constexpr int threads = VEC && NPT >= 8 ? 512 : NPT >= 4 ? 1024 : 512;
    static constexpr int min_blocks = NPT == 1 ? 4 - (ADD || SHIFT) : NPT == 2 ? 3 - (ADD || SHIFT) : 1;
};

// One row a thread row (threadIdx.y) of the block. NPT > 0: the row's chunks stay in registers (one read of x, and of
// residual, one write of y). NPT == 0: three passes over the row (below).
template <typename T, typename W, bool VEC, int NPT, bool ADD, bool SHIFT>
__global__ void __launch_bounds__(LayerNormBounds<VEC, NPT, ADD, SHIFT>::threads,
                                  LayerNormBounds<VEC, NPT, ADD, SHIFT>::min_blocks)
    layer_norm_fwd(const LayerNormParams p) {
    static_assert(!SHIFT || VEC, "SHIFT: rows of 16-byte chunks");
    wait_for_previous_grid();
    constexpr int E = VEC ? 16 / sizeof(T) : 1;
    // row_sum's warp partials, one array for each of the row's two sums: one barrier each (the block has one row a
    // thread row, so neither array is written twice).
    __shared__ float sum_scratch[32], squares_scratch[32];
    const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const bool active = row < p.rows;
    const int lane = threadIdx.x, width = blockDim.x, step = width * E;
    const T* const x_row = static_cast<const T*>(p.x) + (active ? row : 0) * p.x_stride;
    T* const y_row = static_cast<T*>(p.y) + (active ? row : 0) * p.y_stride;
    T* const res_row = ADD ? static_cast<T*>(p.residual) + (active ? row : 0) * p.residual_stride : nullptr;
    float sum = 0.f, squares = 0.f, mean, rstd;
    if constexpr (NPT > 0) {
        const int first = first_column<SHIFT, E>(x_row, lane), hidden = (int)p.hidden;
        Held<T, E> v[NPT];
        Held<T, E> r[ADD ? NPT : 1];  // every load of the row is issued before the first residual store
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (active && col < hidden) {
                v[i].hold(load_chunk<VEC, SHIFT, E>(x_row, col, hidden));
                if constexpr (ADD) r[ADD ? i : 0].hold(load_chunk<VEC, SHIFT, E>(res_row, col, hidden));
            }
        }
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (active && col < hidden) {
                if constexpr (ADD) {  // the sum, rounded to T, is what the row normalizes
                    Pack<T, E> total;
#pragma unroll
                    for (int e = 0; e < E; ++e) total.v[e] = from_float<T>(v[i].at(e) + r[ADD ? i : 0].at(e));
                    store_chunk<VEC, SHIFT, E>(res_row, col, hidden, total);
                    v[i].hold(total);
                }
#pragma unroll
                for (int e = 0; e < E; ++e) sum += v[i].at(e);
            }
        }
        mean = row_sum(sum, width, sum_scratch, true) * p.inv_hidden;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (active && col < hidden) {
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    const float d = v[i].at(e) - mean;
                    if (counts<SHIFT, E>(col, e, hidden)) squares = fmaf(d, d, squares);
                }
            }
        }
        rstd = rsqrtf(row_sum(squares, width, squares_scratch, true) * p.inv_hidden + p.eps);
        if (!active) return;
        // Weight and bias are loaded here, after the reductions. Loaded with x, they measured slower at every shape
        // (H200: fp32 [8192, 16384] 310.9 -> 327.1 us; bf16 [32768, 4096] 131.6 -> 372.0, where rows of 4 slots
        // spill). An L1 prefetch of them issued with x measured 8-160% slower.
        if (p.weight && p.bias)
            store_held_row<T, W, VEC, NPT, SHIFT, E, true>(y_row, v, first, step, hidden, mean, rstd, p.weight, p.bias);
        else
            store_held_row<T, W, VEC, NPT, SHIFT, E, false>(y_row, v, first, step, hidden, mean, rstd, p.weight, p.bias);
    } else {
        // Three passes: the sum (with ADD, the new residual written), the squared deviations and the output, the
        // later two mostly from the L2 (with ADD, the new residual, which this thread wrote itself: its own
        // columns, no barrier).
        const i64 first = (i64)lane * E - row_shift<SHIFT, E>(x_row);
        for (i64 col = first; active && col < p.hidden; col += step) {
            Pack<T, E> v = load_chunk<VEC, SHIFT, E>(x_row, col, p.hidden);
            if constexpr (ADD) {
                const Pack<T, E> r = load_chunk<VEC, SHIFT, E>(res_row, col, p.hidden);
#pragma unroll
                for (int e = 0; e < E; ++e) v.v[e] = from_float<T>(to_float(v.v[e]) + to_float(r.v[e]));
                store_chunk<VEC, SHIFT, E>(res_row, col, p.hidden, v);
            }
#pragma unroll
            for (int e = 0; e < E; ++e) sum += to_float(v.v[e]);
        }
        mean = row_sum(sum, width, sum_scratch, true) * p.inv_hidden;
        const T* const src = ADD ? res_row : x_row;
        for (i64 col = first; active && col < p.hidden; col += step) {
            const Pack<T, E> v = load_chunk<VEC, SHIFT, E>(src, col, p.hidden);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const float d = to_float(v.v[e]) - mean;
                if (counts<SHIFT, E>(col, e, p.hidden)) squares = fmaf(d, d, squares);
            }
        }
        rstd = rsqrtf(row_sum(squares, width, squares_scratch, true) * p.inv_hidden + p.eps);
        if (!active) return;
        for (i64 col = first; col < p.hidden; col += step) {
            Held<T, E> v;
            v.hold(load_chunk<VEC, SHIFT, E>(src, col, p.hidden));
            const Pack<W, E> w = load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, p.hidden);
            const Pack<W, E> b = load_bias_chunk<W, VEC, SHIFT, E>(p.bias, col, p.hidden);
            store_chunk<VEC, SHIFT, E>(y_row, col, p.hidden, ln_output<T, W, E>(v, mean, rstd, w, b));
        }
    }
    if (p.rstd && lane == 0) {
        p.mean[row] = mean;
        p.rstd[row] = rstd;
    }
}

// ------------------------------------------------------------------------------------------ backward
// xhat = (x - mean) * rstd, g = dy * w; dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); dweight = sum over rows of
// dy * xhat, dbias = sum over rows of dy. Rows slot s (blockIdx.x * blockDim.y + threadIdx.y) walks rows s, s + the
// grid's slots, ... and owns partial row s of each sum: held in registers (NPT > 0: a thread owns the same columns in
// every row) and stored at the end, or (NPT == 0) added to in place, each column by the one thread that owns it (in
// shared memory where they fit, then stored: fp32 [8192, 16384] 33% -> 59% of copy bandwidth on an H200).
// rms_norm_dw then adds the partial rows in a fixed order, dweight's and dbias's columns in one launch (a slot's
// two partial rows are one row of 2 * hidden): bitwise deterministic. Rows move in 16-byte chunks or
// element by element (no SHIFT: a slot's rows would not share one shift).

struct LayerNormBwdParams {  // mirrored by layernorm.py's BWD_TAIL (after the pointers)
    const void* dy;
    const void* x;
    const void* weight;  // may be null: g = dy
    const float* mean;
    const float* rstd;
    void* dx;
    float* partial;  // [slots][2][hidden]: a slot's dweight sums, then its dbias sums; null: neither is asked for
    i64 rows, hidden;
    i64 dy_stride, x_stride, dx_stride;
    i64 slots;  // gridDim.x * blockDim.y
    float inv_hidden;
    int shared_sums;  // NPT == 0: the slots' partial rows in dynamic shared memory while the rows are walked
};

// Two blocks an SM (64 registers) where a thread holds at most 8 elements in 16-byte chunks or one element (each
// holds dy, x and two sums); 16 in 16-byte chunks take 110-128 registers, 8 one by one spilled 8-16 bytes at 64.
// STAGED: 0 unstaged, else the 256-thread blocks an SM the staged rows' registers allow (walk_staged_ln_rows): 2
// (up to 128 registers) or 3 (80: fp16/bf16 rows, which fit them).
template <bool VEC, int NPT, int E, int STAGED>
struct LayerNormBwdBounds {
    static constexpr int threads = STAGED == 3 ? 768 : 512;
    static constexpr int min_blocks = (VEC ? NPT * E <= 8 : NPT <= 1) ? 2 : 1;
};

// The row's dot sums of one chunk: g and g * xhat. Chunks are held as their loads' words (Held: as packs the
// compiler kept each 16-bit element in a register of its own).
template <typename T, typename W, int E>
__device__ __forceinline__ void add_row_sums(const Held<T, E>& d, const Held<T, E>& xx, const Held<W, E>& w,
                                             float mean, float rstd, float& g_sum, float& gx_sum) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float g = d.at(e) * w.at(e);  // w: ones without a weight (load_weight)
        g_sum += g;
        gx_sum = fmaf(g, (xx.at(e) - mean) * rstd, gx_sum);
    }
}

// dx for one chunk (returned): rstd * g + xhat_coef * xhat + shift, i.e. rstd * (g - mean(g) - xhat * mean(g * xhat))
// with the row's coefficients folded (two fmas); adds dy * xhat and dy to the dweight and dbias sums.
template <typename T, typename W, int E>
__device__ __forceinline__ Pack<T, E> ln_bwd_chunk(const Held<T, E>& d, const Held<T, E>& xx, const Held<W, E>& w,
                                                   float mean, float rstd, float xhat_coef, float shift,
                                                   Pack<float, E>& dw, Pack<float, E>& db) {
    Pack<T, E> out;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float dyv = d.at(e), xhat = (xx.at(e) - mean) * rstd;
        out.v[e] = from_float<T>(fmaf(rstd, dyv * w.at(e), fmaf(xhat, xhat_coef, shift)));
        dw.v[e] = fmaf(dyv, xhat, dw.v[e]);
        db.v[e] += dyv;
    }
    return out;
}

// A chunk's weight (ones without one), held as its load's words.
template <typename W, bool VEC, int E>
__device__ __forceinline__ Held<W, E> held_weight(const void* weight, int col) {
    Held<W, E> w;
    w.hold(load_weight<W, VEC, E>(weight, col));
    return w;
}

// A chunk held from its load.
template <bool VEC, typename T, int E>
__device__ __forceinline__ Held<T, E> held_chunk(const T* p) {
    Held<T, E> v;
    v.hold(load_pack<VEC, E>(p));
    return v;
}

// A staged 16-byte chunk read again from shared memory. The asm keeps it a new load: otherwise the compiler held
// the first read's values through the row's reduction.
template <typename T, int E>
__device__ __forceinline__ Held<T, E> reread_chunk(const uint4* slot) {
    static_assert(E * sizeof(T) == 16, "16-byte chunks");
    Held<T, E> v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
                 : "r"(shared_address(slot)));
    return v;
}

// A row's mean and rstd; nothing past the last row.
__device__ __forceinline__ void load_ln_stats(const LayerNormBwdParams& p, i64 row, float& mean, float& rstd) {
    if (row >= p.rows) return;
    mean = p.mean[row];
    rstd = p.rstd[row];
}

// A row's dy and x chunks of this thread into registers; nothing past the last row.
template <typename T, bool VEC, int NPT, int E>
__device__ __forceinline__ void load_ln_bwd_row(const LayerNormBwdParams& p, i64 row, int lane, int step,
                                                Held<T, E> (&dyv)[NPT], Held<T, E> (&xv)[NPT]) {
    if (row >= p.rows) return;
    const T* const dy_row = static_cast<const T*>(p.dy) + row * p.dy_stride;
    const T* const x_row = static_cast<const T*>(p.x) + row * p.x_stride;
    const int hidden = (int)p.hidden;
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        const int col = lane * E + i * step;
        if (col < hidden) {
            dyv[i] = held_chunk<VEC, T, E>(dy_row + col);
            xv[i] = held_chunk<VEC, T, E>(x_row + col);
        }
    }
}

// A row's 16-byte dy and x chunks of this thread copied into its stage (cp.async: no registers held while they are
// in flight): chunk i's dy at mine[2 * i * threads], its x at mine[(2 * i + 1) * threads]. One commit group, empty
// past the last row.
template <typename T, int NPT, int E>
__device__ __forceinline__ void stage_ln_bwd_row(const LayerNormBwdParams& p, i64 row, int lane, int step, uint4* mine,
                                                 int threads) {
    if (row < p.rows) {
        const T* const dy_row = row_base<true>(static_cast<const T*>(p.dy) + row * p.dy_stride);
        const T* const x_row = row_base<true>(static_cast<const T*>(p.x) + row * p.x_stride);
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = lane * E + i * step;
            if (col < (int)p.hidden) {
                copy_async16(mine + 2 * i * threads, dy_row + col);
                copy_async16(mine + (2 * i + 1) * threads, x_row + col);
            }
        }
    }
    copy_async_commit();
}

// The rows of a slot of 16-byte rows in registers (STAGED): blockIdx.x * blockDim.y + threadIdx.y, + p.slots, ...
// Each row's dy and x come from a stage in shared memory, where the next row's are copied (cp.async) while this one
// is reduced and written; the chunks are read from the stage again for dx rather than held through the reduction,
// and the weights are held for all rows (fp16/bf16 rows of 2 chunks: 80 registers, no spills in the loop, three
// 256-thread blocks an SM). The row's pointers are computed once (row_base). dw, db: the slot's sums.
// base: the block's first rows slot less threadIdx.y (blockIdx.x * blockDim.y, or a split row's cluster). SPLIT > 1:
// p is the block's part of a row split over a cluster (layer_norm_bwd_split), whose two dot sums are added over the
// cluster (cluster_sum, a turn a row).
// fp32 split rows add their dot sums over the cluster behind a cluster barrier (cluster_sum's FENCED), fp16/bf16 ones
// through the mbarriers.
template <typename T>
constexpr bool FENCED_SPLIT = sizeof(T) == 4;

template <typename T, typename W, int NPT, int E, int SPLIT = 1>
__device__ __forceinline__ void walk_staged_ln_rows(const LayerNormBwdParams& p, i64 base, float2 (&scratch)[2][32],
                                                    ClusterSums<SPLIT, float2>& cluster, uint4* stage,
                                                    Pack<float, E> (&dw)[NPT], Pack<float, E> (&db)[NPT]) {
    const int lane = threadIdx.x, step = blockDim.x * E, hidden = (int)p.hidden;
    const int threads = blockDim.x * blockDim.y, stage_size = 2 * NPT * threads;
    uint4* const mine = stage + threadIdx.y * blockDim.x + lane;
    Held<W, E> wv[NPT];
#pragma unroll
    for (int i = 0; i < NPT; ++i)
        if (lane * E + i * step < hidden) wv[i] = held_weight<W, true, E>(p.weight, lane * E + i * step);
    const i64 first = base + threadIdx.y;
    float mean = 0.f, rstd = 0.f;
    load_ln_stats(p, first, mean, rstd);
    stage_ln_bwd_row<T, NPT, E>(p, first, lane, step, mine, threads);
    int current = 0;  // the stage holding this row, and the scratch arrays of its sums
    unsigned turn = 0;  // the row's place in the walk (cluster_sum)
    // The loop bound is uniform across the block (the reduction has a barrier) and, SPLIT, across the cluster.
#pragma unroll 1
    for (; base < p.rows; base += p.slots) {
        const i64 row = base + threadIdx.y;
        const bool active = row < p.rows;
        float next_mean = 0.f, next_rstd = 0.f;
        load_ln_stats(p, row + p.slots, next_mean, next_rstd);
        stage_ln_bwd_row<T, NPT, E>(p, row + p.slots, lane, step, mine + (current ^ 1) * stage_size, threads);
        copy_async_wait<1>();  // this row's group is in; the next row's stays in flight
        const uint4* const here = mine + current * stage_size;
        float g_sum = 0.f, gx_sum = 0.f;
#pragma unroll
        for (int i = 0; i < NPT; ++i)
            if (active && lane * E + i * step < hidden)
                add_row_sums<T, W, E>(reread_chunk<T, E>(here + 2 * i * threads),
                                      reread_chunk<T, E>(here + (2 * i + 1) * threads), wv[i], mean, rstd, g_sum,
                                      gx_sum);
        // fp32 parts: the cluster barrier (cluster_sum's FENCED), in the slot set of the row's stage
        const float2 sums = cluster_sum<SPLIT, FENCED_SPLIT<T>>(
            row_sum_pair(make_float2(g_sum, gx_sum), blockDim.x, scratch[current]), cluster,
            FENCED_SPLIT<T> ? current : turn++);
        const float xhat_coef = -rstd * (sums.y * p.inv_hidden), shift = -rstd * (sums.x * p.inv_hidden);
        if (active) {
            T* const dx_row = row_base<true>(static_cast<T*>(p.dx) + row * p.dx_stride);
#pragma unroll
            for (int i = 0; i < NPT; ++i) {
                const int col = lane * E + i * step;
                if (col < hidden)
                    store_pack<true, E>(dx_row + col,
                                        ln_bwd_chunk<T, W, E>(reread_chunk<T, E>(here + 2 * i * threads),
                                                              reread_chunk<T, E>(here + (2 * i + 1) * threads), wv[i],
                                                              mean, rstd, xhat_coef, shift, dw[i], db[i]));
            }
        }
        mean = next_mean;
        rstd = next_rstd;
        current ^= 1;
    }
    copy_async_wait<0>();  // no copy outlives the block
}

// A rows slot's dweight and dbias sums of its register slots into its partial rows (columns below hidden).
template <bool VEC, int NPT, int E, typename I>
__device__ __forceinline__ void store_held_sums(float* dw_row, float* db_row, const Pack<float, E> (&dw)[NPT],
                                                const Pack<float, E> (&db)[NPT], int lane, int step, I hidden) {
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        const int col = lane * E + i * step;
        if (col < hidden) {
            store_pack<VEC, E>(dw_row + col, dw[i]);
            store_pack<VEC, E>(db_row + col, db[i]);
        }
    }
}

template <typename T, typename W, bool VEC, int NPT, int STAGED>
__global__ void __launch_bounds__(LayerNormBwdBounds<VEC, NPT, 16 / sizeof(T), STAGED>::threads,
                                 LayerNormBwdBounds<VEC, NPT, 16 / sizeof(T), STAGED>::min_blocks)
    layer_norm_bwd(const LayerNormBwdParams p) {
    constexpr int E = VEC ? 16 / sizeof(T) : 1;
    static_assert(!STAGED || (VEC && NPT > 0 && (STAGED == 2 || (STAGED == 3 && E == 8))),
                  "STAGED: 16-byte rows in registers, 2 or 3 blocks (fp16/bf16) an SM");
    wait_for_previous_grid();
    constexpr int SLOTS = NPT > 0 ? NPT : 1;
    // row_sum_pair's warp partials, a pair of arrays used by turns (rows alternate): one barrier a row.
    __shared__ float2 scratch[2][32];
    extern __shared__ __align__(STAGE_ALIGN) uint4 stage[];
    const int lane = threadIdx.x, width = blockDim.x, step = width * E;
    const i64 slot = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    float* const dw_out = p.partial ? p.partial + 2 * slot * p.hidden : nullptr;
    float* const db_out = p.partial ? dw_out + p.hidden : nullptr;
    // NPT == 0: the slot's partial rows are added to in shared memory where the planner gave room (shared_sums),
    // and copied out at the end; else in place in p.partial.
    const bool shared_sums = NPT == 0 && p.shared_sums && dw_out;
    float* const dw_row = shared_sums ? reinterpret_cast<float*>(stage) + 2 * threadIdx.y * p.hidden : dw_out;
    float* const db_row = shared_sums ? dw_row + p.hidden : db_out;
    Pack<float, E> dw[SLOTS], db[SLOTS];
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) dw[i] = db[i] = zeros<E>();
    if (NPT == 0 && dw_row) {  // zeroed by the thread that adds to each chunk (its own columns: no barrier)
        for (i64 col = (i64)lane * E; col < p.hidden; col += step) {
            store_pack<VEC, E>(dw_row + col, zeros<E>());
            store_pack<VEC, E>(db_row + col, zeros<E>());
        }
    }
    const int hidden = (int)p.hidden;  // register rows: int columns (see first_column)
    if constexpr (STAGED) {
        ClusterSums<1, float2> unused;
        walk_staged_ln_rows<T, W, NPT, E>(p, (i64)blockIdx.x * blockDim.y, scratch, unused, stage, dw, db);
    } else {
        // NPT > 0: registers hold the row's dy and x. Rows of one slot, but for fp16/bf16 16-byte ones (those spilled
        // 24-40 bytes, up to 19% slower), and element-by-element rows of several (80 -> 96 registers; H200: fp32
        // [8192, 1027] 44.7 -> 40.0 us, [16384, 2049] 174.6 -> 147.6, bf16 [32768, 1027] 149.9 -> 146.1) load the
        // next row and its mean and rstd into registers while this one is reduced (PREFETCH).
        constexpr bool PREFETCH = NPT == 1 ? !(VEC && sizeof(T) == 2) : NPT > 1 && !VEC;
        int current = 0;  // the scratch array of this row's sums
        Held<T, E> dyv[SLOTS], xv[SLOTS];
        float mean = 0.f, rstd = 0.f;
        if constexpr (PREFETCH) {
            load_ln_stats(p, slot, mean, rstd);
            load_ln_bwd_row<T, VEC, SLOTS, E>(p, slot, lane, step, dyv, xv);
        }
        // The loop bound is uniform across the block (the reductions contain barriers).
        for (i64 base = (i64)blockIdx.x * blockDim.y; base < p.rows; base += p.slots) {
            const i64 row = base + threadIdx.y;
            const bool active = row < p.rows;
            const T* const dy_row = static_cast<const T*>(p.dy) + (active ? row : 0) * p.dy_stride;
            const T* const x_row = static_cast<const T*>(p.x) + (active ? row : 0) * p.x_stride;
            T* const dx_row = static_cast<T*>(p.dx) + (active ? row : 0) * p.dx_stride;
            float g_sum = 0.f, gx_sum = 0.f;
            float next_mean = 0.f, next_rstd = 0.f;
            if constexpr (PREFETCH) load_ln_stats(p, row + p.slots, next_mean, next_rstd);
            if constexpr (NPT > 0) {
                if constexpr (!PREFETCH) {
                    load_ln_bwd_row<T, VEC, SLOTS, E>(p, row, lane, step, dyv, xv);
                    load_ln_stats(p, row, mean, rstd);
                }
#pragma unroll
                for (int i = 0; i < NPT; ++i) {
                    const int col = lane * E + i * step;
                    if (active && col < hidden)
                        add_row_sums<T, W, E>(dyv[i], xv[i], held_weight<W, VEC, E>(p.weight, col), mean, rstd,
                                              g_sum, gx_sum);
                }
            } else {
                load_ln_stats(p, row, mean, rstd);
#pragma unroll (sizeof(T) == 4 ? 4 : 1)
                for (i64 col = (i64)lane * E; active && col < p.hidden; col += step)
                    add_row_sums<T, W, E>(held_chunk<VEC, T, E>(dy_row + col), held_chunk<VEC, T, E>(x_row + col),
                                          held_weight<W, VEC, E>(p.weight, col), mean, rstd, g_sum, gx_sum);
            }
            Held<T, E> next_dy[SLOTS], next_x[SLOTS];
            if constexpr (PREFETCH) load_ln_bwd_row<T, VEC, SLOTS, E>(p, row + p.slots, lane, step, next_dy, next_x);
            const float2 sums = row_sum_pair(make_float2(g_sum, gx_sum), width, scratch[current]);
            const float xhat_coef = -rstd * (sums.y * p.inv_hidden), shift = -rstd * (sums.x * p.inv_hidden);
            if (active && NPT > 0) {
#pragma unroll
                for (int i = 0; i < SLOTS; ++i) {
                    const int col = lane * E + i * step;
                    if (col < hidden)
                        store_pack<VEC, E>(dx_row + col,
                                           ln_bwd_chunk<T, W, E>(dyv[i], xv[i], held_weight<W, VEC, E>(p.weight, col),
                                                                 mean, rstd, xhat_coef, shift, dw[i], db[i]));
                }
            } else if (active) {
#pragma unroll (sizeof(T) == 4 ? 4 : 1)
                for (i64 col = (i64)lane * E; col < p.hidden; col += step) {
                    Pack<float, E> w_sums = dw_row ? load_pack<VEC, E>(dw_row + col) : zeros<E>();
                    Pack<float, E> b_sums = dw_row ? load_pack<VEC, E>(db_row + col) : zeros<E>();
                    store_pack<VEC, E>(dx_row + col,
                                       ln_bwd_chunk<T, W, E>(held_chunk<VEC, T, E>(dy_row + col),
                                                             held_chunk<VEC, T, E>(x_row + col),
                                                             held_weight<W, VEC, E>(p.weight, col), mean, rstd,
                                                             xhat_coef, shift, w_sums, b_sums));
                    if (dw_row) {
                        store_pack<VEC, E>(dw_row + col, w_sums);
                        store_pack<VEC, E>(db_row + col, b_sums);
                    }
                }
            }
            if constexpr (PREFETCH) {
#pragma unroll
                for (int i = 0; i < SLOTS; ++i) {
                    dyv[i] = next_dy[i];
                    xv[i] = next_x[i];
                }
                mean = next_mean;
                rstd = next_rstd;
            }
            current ^= 1;
        }
    }
    if constexpr (NPT == 0) {
        if (!shared_sums) return;
        for (i64 col = (i64)lane * E; col < p.hidden; col += step) {  // this thread's own columns: no barrier
            store_pack<VEC, E>(dw_out + col, load_pack<VEC, E>(dw_row + col));
            store_pack<VEC, E>(db_out + col, load_pack<VEC, E>(db_row + col));
        }
    } else if (dw_row) {
        store_held_sums<VEC>(dw_row, db_row, dw, db, lane, step, hidden);
    }
}

// ------------------------------------------------------------------ backward, rows split over a cluster
// 16-byte rows longer than the staged walk's registers hold on one block (past BWD_MAX_SLOTS chunks on 512 threads)
// on a cluster of SPLIT blocks (sm_90+): the block of rank r takes the columns cluster_part gives it of every row its
// cluster walks, as the staged walk does a whole row, with its own two stages; only the row's two dot sums cross
// blocks. Cluster c walks rows c, c + the clusters, ... and each block keeps the sums of its columns of the cluster's
// partial rows (c). Against the same rows read in passes (layer_norm_bwd, NPT 0), on an H200: fp32 [8192, 16384]
// 637 -> 404 us, bf16 [8192, 16384] 432 -> 292, [4096, 32768] 930 -> 323, [2048, 65536] 992 -> 331; three stages
// measured no faster (within 1%), parts of at most 256 threads (more blocks an SM) 5% slower in fp32.
template <typename T, typename W, int NPT, int SPLIT>
__global__ void CLUSTER_DIMS(SPLIT) __launch_bounds__(512, 1) layer_norm_bwd_split(const LayerNormBwdParams p) {
    wait_for_previous_grid();
#if CUPYROPE_CLUSTERS
    constexpr int E = 16 / sizeof(T);
    __shared__ float2 scratch[2][32];  // row_sum_pair's warp partials, by row parity
    __shared__ ClusterSums<SPLIT, float2> cluster_sums;  // the blocks' dot sums (cluster_sum)
    extern __shared__ __align__(STAGE_ALIGN) uint4 stage[];
    i64 offset;
    const i64 length = cluster_part<E, SPLIT>(p.hidden, offset);
    LayerNormBwdParams mine = p;  // the block's part of the rows; inv_hidden stays the whole row's
    mine.dy = static_cast<const T*>(p.dy) + offset;
    mine.x = static_cast<const T*>(p.x) + offset;
    mine.dx = static_cast<T*>(p.dx) + offset;
    if (p.weight) mine.weight = static_cast<const W*>(p.weight) + offset;
    mine.hidden = length;
    const i64 cluster = blockIdx.x / SPLIT;
    Pack<float, E> dw[NPT], db[NPT];
#pragma unroll
    for (int i = 0; i < NPT; ++i) dw[i] = db[i] = zeros<E>();
    if constexpr (FENCED_SPLIT<T>) cluster_sync();  // the cluster's blocks have all started
    else cluster_start(cluster_sums);
    walk_staged_ln_rows<T, W, NPT, E, SPLIT>(mine, cluster, scratch, cluster_sums, stage, dw, db);
    if (!p.partial) return;
    float* const dw_row = p.partial + 2 * cluster * p.hidden + offset;  // the cluster's partial rows
    store_held_sums<true>(dw_row, dw_row + p.hidden, dw, db, threadIdx.x, blockDim.x * E, length);
#else
    __trap();  // no clusters before sm_90: the planner never launches it there
#endif
}

}  // namespace cupyrope
