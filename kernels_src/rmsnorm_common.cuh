// RMSNorm's row machinery, shared by the forward (rmsnorm_fwd.cu) and the backward (rmsnorm_bwd.cu).
//
// Layout: a block holds ROWS_PER_BLOCK = blockDim.y rows, THREADS_PER_ROW = blockDim.x (a power of two up to a
// warp, else whole warps; up to 1024) threads per row. Thread `lane` owns chunks lane, lane + blockDim.x, ... of E
// elements (E = 16 bytes when VEC, else 1). NPT > 0: the NPT chunks stay in registers between the reduction and
// the output (one read, one write); NPT == 0: rows too large for registers are read twice (the second read mostly
// hits the L2).
// SHIFT (VEC): rows that are not 16-byte aligned (odd hidden sizes). Chunks follow the 16-byte boundaries of
// memory, not the row: chunk c of a row that starts s elements past a boundary covers columns c*E - s ... c*E - s
// + E - 1, so whole chunks move as one 16-byte access and only the first and last chunk of a row go element by
// element. The planner checked that every array's rows share x's offset from the boundary; the weight, whose own
// alignment is unrelated, is read element by element (cached) or from the 16-byte units it straddles.
//   T  element type of x / y / residual / dy / dx      W  weight type (float or T)
#pragma once
#include "common.cuh"

namespace cupyrope {

// E values of T, each v (a missing weight's ones, a missing bias's zeros).
template <typename T, int E>
__device__ __forceinline__ Pack<T, E> filled(float v) {
    Pack<T, E> pk;
#pragma unroll
    for (int e = 0; e < E; ++e) pk.v[e] = from_float<T>(v);
    return pk;
}

// E float sums at zero (the backwards' dweight and dbias sums).
template <int E>
__device__ __forceinline__ Pack<float, E> zeros() {
    return filled<float, E>(0.f);
}

// Weight for E columns, raw (VEC: the planner checked the weight is 16-byte aligned); no weight: 1.
template <typename W, bool VEC, int E>
__device__ __forceinline__ Pack<W, E> load_weight(const void* weight, i64 col) {
    if (weight) return load_pack<VEC, E>(static_cast<const W*>(weight) + col);
    return filled<W, E>(1.f);
}

// to_float, or with BY_SHIFT bf16 -> fp32 as an integer shift (exact either way). cuda_bf16.h converts by
// inline PTX, which the compiler cannot see through: both halves of a loaded 32-bit word then take a
// register each, shifted down at the load and up again at use. Measured: the
// forward's vectorized rows of 2+ chunks a thread 0.5-2% faster by shifts; one chunk a thread ~0.1 us
// slower and the staged backward ~1% slower; the fused add spilled more (ptxas). Only the former use it.
template <bool BY_SHIFT> __device__ __forceinline__ float as_float(float v) { return v; }
template <bool BY_SHIFT> __device__ __forceinline__ float as_float(__half v) { return to_float(v); }
template <bool BY_SHIFT> __device__ __forceinline__ float as_float(__nv_bfloat16 v) {
    return BY_SHIFT ? __uint_as_float((unsigned)__bfloat16_as_ushort(v) << 16) : to_float(v);
}

// Half `high` (0: element 2k, 1: element 2k + 1) of a 32-bit word of fp16/bf16 values as float: rows held as the
// words their 16-byte loads produced (rmsnorm_fwd.cu's word-held rows, Held below).
template <typename T> __device__ __forceinline__ float half_of(unsigned word, bool high) {
    return as_float<true>(from_bits<T>(high ? word >> 16 : word));
}

// A chunk of a row as its load produced it: a 16-byte chunk as its four 32-bit words (fp16/bf16 elements held as packs
// kept each 16-bit half in a register of its own: 8-40 bytes of spills at LayerNorm's forward budgets), a chunk of
// one element as itself. at(e): element e as float.
template <typename T, int E, bool WORDS = E * sizeof(T) == 16>
struct Held {
    Pack<T, E> pk;
    __device__ __forceinline__ void hold(const Pack<T, E>& v) { pk = v; }
    __device__ __forceinline__ float at(int e) const { return to_float(pk.v[e]); }
};
template <typename T, int E>
struct Held<T, E, true> {
    unsigned w[4];
    __device__ __forceinline__ void hold(const Pack<T, E>& v) {
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = word_of(v, k);
    }
    __device__ __forceinline__ float at(int e) const {
        if constexpr (sizeof(T) == 4) return __uint_as_float(w[e]);
        else return half_of<T>(w[e / 2], e % 2);
    }
};

// weight + offset (no weight: 1, whatever the offset).
template <typename W, int E, bool BY_SHIFT = false>
__device__ __forceinline__ float scale(const void* weight, float offset, const Pack<W, E>& w, int e) {
    return weight ? as_float<BY_SHIFT>(w.v[e]) + offset : 1.f;
}

// 1 / sqrt(sum_sq / hidden + eps). The hardware's approximate rsqrt (relative error < 2^-22) and a
// multiply by 1 / hidden: IEEE division, sqrt and reciprocal are each a dozen dependent instructions
// (with a slow-path branch), and this chain sits between a row's loads and its stores.
__device__ __forceinline__ float inverse_rms(float sum_sq, float inv_hidden, float eps) {
    return rsqrtf(sum_sq * inv_hidden + eps);
}

// A row's base pointer, computed once per thread. Without the barrier NVVM folds row * stride into
// every chunk's address (64-bit row * stride + col, then scaled) and recomputes it per chunk under the
// chunk's predicate: ~9 instructions a chunk for loads and again for stores.
// The pointers are global memory (CuPy and torch allocations), which the assumption keeps visible
// to the compiler (its loads stay LDG).
template <bool HELD, typename P> __device__ __forceinline__ P* row_base(P* row) {
    if constexpr (HELD) {
        asm("mov.b64 %0, %0;" : "+l"(row));
        __builtin_assume(__isGlobal(row));
    }
    return row;
}

// Where row `row` starts in an array whose rows lie in runs: entry row % inner_rows, `stride` apart, of run
// row / inner_rows, the runs `outer` apart. Per-head views such as q's heads, (tokens, heads, head_dim) inside a fused
// qkv tensor, are such runs (their rows are not one evenly strided run). The kernels that take them (rms_norm_fwd_runs,
// rms_norm_bwd_runs) have parameter structs of their own, extending their op's: a wider struct for every kernel changed
// the others' code and measured up to 39% slower (the staged backward spilled). The division is 32-bit (the planner
// keeps such rows below 2^32); every array's offset of one row shares it.
__device__ __forceinline__ i64 row_in_runs(i64 row, i64 stride, i64 outer, i64 inner_rows) {
    const unsigned r = (unsigned)row, n = (unsigned)inner_rows;
    return (i64)(r / n) * outer + (i64)(r % n) * stride;
}

// Where row `row` starts, in runs, in the array of `stride` whose outer stride is Runs' member `outer`: p is a
// rows-in-runs kernel's struct Runs, which extends P (its op's) with inner_rows and the outer strides. Callers write
// `RUNS ? in_runs(...) : row * stride` in place: one function for both forms changed the split forward's code.
template <typename Runs, typename P>
__device__ __forceinline__ i64 in_runs(const P& p, i64 row, i64 stride, i64 Runs::*outer) {
    const Runs& runs = static_cast<const Runs&>(p);
    return row_in_runs(row, stride, runs.*outer, runs.inner_rows);
}

// Rows held in registers (NPT > 0) have at most 1024 threads x 8 slots x 8 elements, so their
// column indices are ints (I = int): 64-bit indices cost a dozen extra instructions a chunk (wide
// multiplies and compares, recomputed under each chunk's predicate), which every warp runs after its
// loads. Rows read twice (NPT == 0) may be longer: i64. Columns col ... col + E - 1 of a row (SHIFT: col
// may be negative and the chunk may end past `hidden`; the part outside the row reads as 0 and is
// never written).
template <typename I> __device__ __forceinline__ bool inside(I col, I hidden) { return col >= 0 && col < hidden; }

// Elements from a row's start back to the previous 16-byte boundary (SHIFT), else 0.
template <bool SHIFT, int E, typename T> __device__ __forceinline__ int row_shift(const T* row) {
    return SHIFT ? (int)(reinterpret_cast<size_t>(row) / sizeof(T) % E) : 0;
}

// Elements a row's chunks cover from the 16-byte boundary at or before its start (SHIFT: up to E - 1
// before it), in whole chunks: a row of the row cache or of the shifted backward's shared dweight sums.
// Mirrored by rmsnorm_rows.py's chunks_span.
template <bool SHIFT, int E> __device__ __forceinline__ i64 chunks_span(i64 hidden) {
    return (hidden + (SHIFT ? E - 1 : 0) + E - 1) / E * E;
}

// First column of thread `lane`'s first chunk; SHIFT: minus the row's shift.
template <bool SHIFT, int E, typename T>
__device__ __forceinline__ int first_column(const T* row, int lane) {
    return lane * E - row_shift<SHIFT, E>(row);
}

template <bool VEC, bool SHIFT, int E, typename T, typename I>
__device__ __forceinline__ Pack<T, E> load_chunk(const T* row, I col, I hidden) {
    if constexpr (SHIFT) {
        if (col < 0 || col + E > hidden) {
            Pack<T, E> pk;
#pragma unroll
            for (int e = 0; e < E; ++e) pk.v[e] = inside<I>(col + e, hidden) ? row[col + e] : from_float<T>(0.f);
            return pk;
        }
    }
    return load_pack<VEC, E>(row + col);
}

template <bool VEC, bool SHIFT, int E, typename T, typename I>
__device__ __forceinline__ void store_chunk(T* row, I col, I hidden, const Pack<T, E>& pk) {
    if constexpr (SHIFT) {
        if (col < 0 || col + E > hidden) {
#pragma unroll
            for (int e = 0; e < E; ++e)
                if (inside<I>(col + e, hidden)) row[col + e] = pk.v[e];
            return;
        }
    }
    store_pack<VEC, E>(row + col, pk);
}

// An fp32 weight's E values from column col (w 16-byte aligned): the 16-byte units they touch as vector loads
// (neighbouring threads load the same units: L1 hits), then moved down by col's offset in its unit (0-3 values)
// through selects, instead of E scalar loads. The offset is the same for all threads of a row: the selects do not
// diverge. Reads columns col - col % 4 ... col - col % 4 + E + 3.
template <int E, typename I>
__device__ __forceinline__ Pack<float, E> straddling_weight(const float* w, I col) {
    static_assert(E % 4 == 0, "whole 16-byte units");
    const int offset = (int)(col % 4);
    Pack<float, 4> units[E / 4 + 1];
#pragma unroll
    for (int u = 0; u <= E / 4; ++u) units[u] = load_pack<true, 4>(w + (col - offset) + 4 * u);
    const auto unit_value = [&](int i) { return units[i / 4].v[i % 4]; };
    Pack<float, E> pk;  // selects: an in-place move of the values became a local-memory memmove
#pragma unroll
    for (int k = 0; k < E; ++k) {
        const float even = offset & 1 ? unit_value(k + 1) : unit_value(k);
        const float odd = offset & 1 ? unit_value(k + 3) : unit_value(k + 2);
        pk.v[k] = offset & 2 ? odd : even;
    }
    return pk;
}

// A 16-bit weight's E values from w (4-byte aligned where `odd` is 0, 2 bytes past that where it is 1): the E / 2 + odd
// 32-bit words they touch, each value pair funnel-shifted out of two neighbouring words by odd (the same for all
// threads of a row: nothing diverges), instead of E scalar loads and their bounds checks. Reads w - odd ... w + E - 1
// + odd.
template <int E, typename W>
__device__ __forceinline__ Pack<W, E> word_straddling_weight(const W* w, int odd) {
    static_assert(sizeof(W) == 2 && E % 2 == 0, "16-bit values in whole words");
    const unsigned* words = reinterpret_cast<const unsigned*>(w - odd);
    unsigned u[E / 2 + 1];
#pragma unroll
    for (int k = 0; k < E / 2; ++k) u[k] = words[k];
    u[E / 2] = odd ? words[E / 2] : 0u;
    Pack<W, E> pk;
#pragma unroll
    for (int k = 0; k < E / 2; ++k) set_word(pk, k, __funnelshift_r(u[k], u[k + 1], 16 * odd));
    return pk;
}

// The weight for columns col ... col + E - 1 of a row (SHIFT: as load_chunk's; 0 outside the row). STRADDLE: see
// straddles().
template <typename W, bool VEC, bool SHIFT, int E, bool STRADDLE = false, typename I>
__device__ __forceinline__ Pack<W, E> load_weight_chunk(const void* weight, I col, I hidden) {
    if constexpr (SHIFT) {  // the weight's own alignment is unrelated to the row's
        if (!weight) return load_weight<W, false, E>(weight, col);
        const W* w = static_cast<const W*>(weight);
        if constexpr (STRADDLE && sizeof(W) == 4) {
            if (col >= 0 && col - col % 4 + E + 4 <= hidden && (reinterpret_cast<size_t>(w) & 15) == 0)
                return straddling_weight<E>(w, col);
        } else if constexpr (STRADDLE) {  // a 16-bit weight (2-byte aligned): odd = w + col's offset in its word
            const int odd = (int)((reinterpret_cast<size_t>(w) / 2 + col) & 1);
            if (col >= odd && col + E + odd <= hidden) return word_straddling_weight<E>(w + col, odd);
        }
        Pack<W, E> pk;  // element by element
#pragma unroll
        for (int e = 0; e < E; ++e) pk.v[e] = inside<I>(col + e, hidden) ? w[col + e] : from_float<W>(0.f);
        return pk;
    }
    return load_weight<W, VEC, E>(weight, col);
}

}  // namespace cupyrope
