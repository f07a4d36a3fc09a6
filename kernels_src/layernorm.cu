// LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(mean((x - mean)^2) + eps), over the last dimension;
// the fused residual add (ADD): residual <- x + residual (rounded to T) first, and that sum is normalized. The
// backward gives dx and per-row-slot partial sums of dweight and dbias, which rms_norm_dw (rmsnorm_bwd.cu) adds in a
// fixed order. Row layout, SHIFT and the row helpers are RMSNorm's (rmsnorm_common.cuh).
// The variance is the mean of squared deviations from the row's mean, a second pass over the row (registers or the
// L2): the one-pass E[x^2] - mean^2 loses every digit where the mean is large against the spread.
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

// Columns col ... col + E - 1 of a row that lie inside it, as a mask over e: the chunks of a shifted row (SHIFT) or
// past a register row's end hold zeros, which add nothing to a sum but do add (0 - mean)^2 to the squares.
template <bool SHIFT, int E, typename I> __device__ __forceinline__ bool counts(I col, int e, I hidden) {
    return !SHIFT || inside<I>(col + e, hidden);
}

template <typename T, typename W, int E>
__device__ __forceinline__ Pack<T, E> ln_output(const LayerNormParams& p, const Pack<T, E>& v, float mean, float rstd,
                                                const Pack<W, E>& w, const Pack<W, E>& b) {
    Pack<T, E> y;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        float value = (to_float(v.v[e]) - mean) * rstd;
        if (p.weight) value *= to_float(w.v[e]);
        if (p.bias) value += to_float(b.v[e]);
        y.v[e] = from_float<T>(value);
    }
    return y;
}

// The bias for E columns (SHIFT: as load_weight_chunk's); unused where p.bias is null.
template <typename W, bool VEC, bool SHIFT, int E, typename I>
__device__ __forceinline__ Pack<W, E> load_bias_chunk(const LayerNormParams& p, I col, I hidden) {
    return load_weight_chunk<W, VEC, SHIFT, E>(p.bias, col, hidden);
}

// Blocks of rows held in registers (NPT > 0): at most 1024 threads, several rows to a block of 128 where rows are
// short. Rows read in passes (NPT == 0) take 512 threads.
template <int NPT>
struct LayerNormBounds {
    static constexpr int threads = NPT >= 4 ? 1024 : 512;
};

// One row a thread row (threadIdx.y) of the block. NPT > 0: the row's chunks stay in registers (one read of x, and of
// residual, one write of y). NPT == 0: three passes over the row (sum, squared deviations, output), the later ones
// mostly from the L2; with ADD they read the new residual, which this thread wrote itself (its own columns: no
// barrier).
template <typename T, typename W, bool VEC, int NPT, bool ADD, bool SHIFT>
__global__ void __launch_bounds__(LayerNormBounds<NPT>::threads) layer_norm_fwd(const LayerNormParams p) {
    static_assert(!SHIFT || VEC, "SHIFT: rows of 16-byte chunks");
    wait_for_previous_grid();
    constexpr int E = VEC ? 16 / sizeof(T) : 1;
    __shared__ float scratch[32];  // row_sum's warp partials
    const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const bool active = row < p.rows;
    const int lane = threadIdx.x, width = blockDim.x, step = width * E;
    const T* const x_row = static_cast<const T*>(p.x) + (active ? row : 0) * p.x_stride;
    T* const y_row = static_cast<T*>(p.y) + (active ? row : 0) * p.y_stride;
    T* const res_row = ADD ? static_cast<T*>(p.residual) + (active ? row : 0) * p.residual_stride : nullptr;
    float sum = 0.f, squares = 0.f, mean, rstd;
    if constexpr (NPT > 0) {
        const int first = first_column<SHIFT, E>(x_row, lane), hidden = (int)p.hidden;
        Pack<T, E> v[NPT];
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (active && col < hidden) {
                v[i] = load_chunk<VEC, SHIFT, E>(x_row, col, hidden);
                if constexpr (ADD) {
                    const Pack<T, E> r = load_chunk<VEC, SHIFT, E>(res_row, col, hidden);
#pragma unroll
                    for (int e = 0; e < E; ++e) v[i].v[e] = from_float<T>(to_float(v[i].v[e]) + to_float(r.v[e]));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (active && col < hidden) {
                if constexpr (ADD) store_chunk<VEC, SHIFT, E>(res_row, col, hidden, v[i]);
#pragma unroll
                for (int e = 0; e < E; ++e) sum += to_float(v[i].v[e]);
            }
        }
        mean = row_sum(sum, width, scratch, true) * p.inv_hidden;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (active && col < hidden) {
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    const float d = to_float(v[i].v[e]) - mean;
                    if (counts<SHIFT, E>(col, e, hidden)) squares = fmaf(d, d, squares);
                }
            }
        }
        rstd = rsqrtf(row_sum(squares, width, scratch) * p.inv_hidden + p.eps);
        if (!active) return;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (col < hidden) {
                const Pack<W, E> w = load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, hidden);
                const Pack<W, E> b = load_bias_chunk<W, VEC, SHIFT, E>(p, col, hidden);
                store_chunk<VEC, SHIFT, E>(y_row, col, hidden, ln_output<T, W, E>(p, v[i], mean, rstd, w, b));
            }
        }
    } else {
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
        mean = row_sum(sum, width, scratch, true) * p.inv_hidden;
        const T* const src = ADD ? res_row : x_row;
        for (i64 col = first; active && col < p.hidden; col += step) {
            const Pack<T, E> v = load_chunk<VEC, SHIFT, E>(src, col, p.hidden);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const float d = to_float(v.v[e]) - mean;
                if (counts<SHIFT, E>(col, e, p.hidden)) squares = fmaf(d, d, squares);
            }
        }
        rstd = rsqrtf(row_sum(squares, width, scratch) * p.inv_hidden + p.eps);
        if (!active) return;
        for (i64 col = first; col < p.hidden; col += step) {
            const Pack<T, E> v = load_chunk<VEC, SHIFT, E>(src, col, p.hidden);
            const Pack<W, E> w = load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, p.hidden);
            const Pack<W, E> b = load_bias_chunk<W, VEC, SHIFT, E>(p, col, p.hidden);
            store_chunk<VEC, SHIFT, E>(y_row, col, p.hidden, ln_output<T, W, E>(p, v, mean, rstd, w, b));
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
// every row) and stored at the end, or (NPT == 0) added to in place, each column by the one thread that owns it.
// rms_norm_dw then adds the partial rows in a fixed order: bitwise deterministic. Rows move in 16-byte chunks or
// element by element (no SHIFT: a slot's rows would not share one shift).

struct LayerNormBwdParams {  // mirrored by layernorm.py's BWD_TAIL (after the pointers)
    const void* dy;
    const void* x;
    const void* weight;  // may be null: g = dy
    const float* mean;
    const float* rstd;
    void* dx;
    float* partial;  // [2][slots][hidden]: dweight's sums, then dbias's; null: neither is asked for
    i64 rows, hidden;
    i64 dy_stride, x_stride, dx_stride;
    i64 slots;  // gridDim.x * blockDim.y
    float inv_hidden;
};

template <int NPT>
struct LayerNormBwdBounds {  // dy, x and two sums a chunk: 2 slots of fp16/bf16 take ~90 registers
    static constexpr int threads = 512;
    static constexpr int min_blocks = NPT >= 2 ? 1 : 2;
};

// The row's dot sums of one chunk: g and g * xhat.
template <typename T, typename W, int E>
__device__ __forceinline__ void add_row_sums(const LayerNormBwdParams& p, const Pack<T, E>& d, const Pack<T, E>& xx,
                                             const Pack<W, E>& w, float mean, float rstd, float& g_sum,
                                             float& gx_sum) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float g = p.weight ? to_float(d.v[e]) * to_float(w.v[e]) : to_float(d.v[e]);
        g_sum += g;
        gx_sum = fmaf(g, (to_float(xx.v[e]) - mean) * rstd, gx_sum);
    }
}

// dx for one chunk (returned); adds dy * xhat and dy to the dweight and dbias sums.
template <typename T, typename W, int E>
__device__ __forceinline__ Pack<T, E> ln_bwd_chunk(const LayerNormBwdParams& p, const Pack<T, E>& d,
                                                   const Pack<T, E>& xx, const Pack<W, E>& w, float mean, float rstd,
                                                   float g_mean, float gx_mean, Pack<float, E>& dw,
                                                   Pack<float, E>& db) {
    Pack<T, E> out;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float dyv = to_float(d.v[e]), xhat = (to_float(xx.v[e]) - mean) * rstd;
        const float g = p.weight ? dyv * to_float(w.v[e]) : dyv;
        out.v[e] = from_float<T>(rstd * (g - g_mean - xhat * gx_mean));
        dw.v[e] = fmaf(dyv, xhat, dw.v[e]);
        db.v[e] += dyv;
    }
    return out;
}

template <typename T, typename W, bool VEC, int NPT>
__global__ void __launch_bounds__(LayerNormBwdBounds<NPT>::threads, LayerNormBwdBounds<NPT>::min_blocks)
    layer_norm_bwd(const LayerNormBwdParams p) {
    wait_for_previous_grid();
    constexpr int E = VEC ? 16 / sizeof(T) : 1;
    constexpr int SLOTS = NPT > 0 ? NPT : 1;
    __shared__ float scratch[32];
    const int lane = threadIdx.x, width = blockDim.x, step = width * E;
    const i64 slot = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    float* const dw_row = p.partial ? p.partial + slot * p.hidden : nullptr;
    float* const db_row = p.partial ? p.partial + (p.slots + slot) * p.hidden : nullptr;
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
    // The loop bound is uniform across the block (the reductions contain barriers).
    for (i64 base = (i64)blockIdx.x * blockDim.y; base < p.rows; base += p.slots) {
        const i64 row = base + threadIdx.y;
        const bool active = row < p.rows;
        const T* const dy_row = static_cast<const T*>(p.dy) + (active ? row : 0) * p.dy_stride;
        const T* const x_row = static_cast<const T*>(p.x) + (active ? row : 0) * p.x_stride;
        T* const dx_row = static_cast<T*>(p.dx) + (active ? row : 0) * p.dx_stride;
        const float mean = active ? p.mean[row] : 0.f, rstd = active ? p.rstd[row] : 0.f;
        float g_sum = 0.f, gx_sum = 0.f;
        Pack<T, E> dyv[SLOTS], xv[SLOTS];
        if constexpr (NPT > 0) {
#pragma unroll
            for (int i = 0; i < NPT; ++i) {
                const int col = lane * E + i * step;
                if (active && col < hidden) {
                    dyv[i] = load_pack<VEC, E>(dy_row + col);
                    xv[i] = load_pack<VEC, E>(x_row + col);
                }
            }
#pragma unroll
            for (int i = 0; i < NPT; ++i) {
                const int col = lane * E + i * step;
                if (active && col < hidden)
                    add_row_sums<T, W, E>(p, dyv[i], xv[i], load_weight<W, VEC, E>(p.weight, col), mean, rstd, g_sum,
                                          gx_sum);
            }
        } else {
            for (i64 col = (i64)lane * E; active && col < p.hidden; col += step)
                add_row_sums<T, W, E>(p, load_pack<VEC, E>(dy_row + col), load_pack<VEC, E>(x_row + col),
                                      load_weight<W, VEC, E>(p.weight, col), mean, rstd, g_sum, gx_sum);
        }
        const float g_mean = row_sum(g_sum, width, scratch) * p.inv_hidden;
        const float gx_mean = row_sum(gx_sum, width, scratch) * p.inv_hidden;
        if (!active) continue;  // the next pass's rows are past the end too: only barriers remain
        if constexpr (NPT > 0) {
#pragma unroll
            for (int i = 0; i < NPT; ++i) {
                const int col = lane * E + i * step;
                if (col < hidden)
                    store_pack<VEC, E>(dx_row + col, ln_bwd_chunk<T, W, E>(p, dyv[i], xv[i],
                                                                           load_weight<W, VEC, E>(p.weight, col), mean,
                                                                           rstd, g_mean, gx_mean, dw[i], db[i]));
            }
        } else {
            for (i64 col = (i64)lane * E; col < p.hidden; col += step) {
                Pack<float, E> w_sums = dw_row ? load_pack<VEC, E>(dw_row + col) : zeros<E>();
                Pack<float, E> b_sums = dw_row ? load_pack<VEC, E>(db_row + col) : zeros<E>();
                store_pack<VEC, E>(dx_row + col, ln_bwd_chunk<T, W, E>(p, load_pack<VEC, E>(dy_row + col),
                                                                       load_pack<VEC, E>(x_row + col),
                                                                       load_weight<W, VEC, E>(p.weight, col), mean,
                                                                       rstd, g_mean, gx_mean, w_sums, b_sums));
                if (dw_row) {
                    store_pack<VEC, E>(dw_row + col, w_sums);
                    store_pack<VEC, E>(db_row + col, b_sums);
                }
            }
        }
    }
    if constexpr (NPT > 0) {
        if (!dw_row) return;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = lane * E + i * step;
            if (col < hidden) {
                store_pack<VEC, E>(dw_row + col, dw[i]);
                store_pack<VEC, E>(db_row + col, db[i]);
            }
        }
    }
}

}  // namespace cupyrope
