// RMSNorm: y = x / sqrt(mean(x^2) + eps) * (w + offset), over the last dimension.
//
// Layout: a block holds ROWS_PER_BLOCK = blockDim.y rows, THREADS_PER_ROW = blockDim.x (a power of
// two up to a warp, else whole warps; up to 1024) threads per row. Thread `lane` owns chunks lane, lane + blockDim.x, ... of E elements
// (E = 16 bytes when VEC, else 1). NPT > 0: the NPT chunks stay in registers between the reduction
// and the output (one read, one write); NPT == 0: rows too large for registers are read twice (the
// second read mostly hits L2), except for the fused add where the launch gives the block's rows in
// dynamic shared memory (the planner's row cache): its rounded sums wait there for the output pass.
// SHIFT (VEC; forward and backward): rows that are not 16-byte aligned (odd hidden sizes). Chunks follow
// the 16-byte boundaries of memory, not the row: chunk c of a row that starts s elements past a
// boundary covers columns c*E - s ... c*E - s + E - 1, so whole chunks move as one 16-byte access
// and only the first and last chunk of a row go element by element. The planner checked that every
// array's rows share x's offset from the boundary; the weight is read element by element (cached).
//   T  element type of x / y / residual / dy / dx      W  weight type (float or T)
//   ADD  fused_add_rms_norm: residual <- x + residual (rounded to T), then normalize residual into x.
#include "common.cuh"

namespace cupyrope {

struct NormParams {  // mirrored by rmsnorm.py's _FWD_TAIL (after the pointers)
    const void* x;
    void* y;
    void* residual;
    const void* weight;  // may be null: no weight
    float* rstd;         // may be null: not returned
    i64 rows, hidden;
    i64 x_stride, y_stride, residual_stride;
    float eps, offset;
    float inv_hidden;  // 1 / hidden, rounded to float: a multiply instead of a division on the row's critical path
};

// Weight for E columns, raw (VEC: the planner checked the weight is 16-byte aligned); no weight: 1.
template <typename W, bool VEC, int E>
__device__ __forceinline__ Pack<W, E> load_weight(const void* weight, i64 col) {
    if (weight) return load_pack<VEC, E>(static_cast<const W*>(weight) + col);
    Pack<W, E> one;
#pragma unroll
    for (int e = 0; e < E; ++e) one.v[e] = from_float<W>(1.f);
    return one;
}

// to_float, or with BY_SHIFT bf16 -> fp32 as an integer shift (exact either way). cuda_bf16.h converts by
// inline PTX, which the compiler cannot see through: both halves of a loaded 32-bit word then take a
// register each, shifted down at the load and up again at use. Measured (docs/perf-notes.md v13): the
// forward's vectorized rows of 2+ chunks a thread 0.5-2% faster by shifts; one chunk a thread ~0.1 us
// slower and the staged backward ~1% slower; the fused add spilled more (ptxas). Only the former use it.
template <bool BY_SHIFT> __device__ __forceinline__ float as_float(float v) { return v; }
template <bool BY_SHIFT> __device__ __forceinline__ float as_float(__half v) { return to_float(v); }
template <bool BY_SHIFT> __device__ __forceinline__ float as_float(__nv_bfloat16 v) {
    return BY_SHIFT ? __uint_as_float((unsigned)__bfloat16_as_ushort(v) << 16) : to_float(v);
}

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

// A thread's sum of squares in the forward's rows of 1-2 chunks a thread, as RMS_FWD_SUM_CHAINS independent
// partial sums added pairwise at the end: one chain of 8-16 dependent FMAs sat on a small call's critical path
// (ncu, session 35: bf16 [16, 4096] ran ~160 cycles longer than Liger's kernel, whose sum is a tree). Rows of 4+
// chunks a thread keep one chain: they are bandwidth-bound, and the extra registers spilled at their 64-register
// budgets (fp32 8 chunks: 4 -> 32 bytes; the fused add 240 -> 500). 1: one chain everywhere (before).
#ifndef RMS_FWD_SUM_CHAINS
#define RMS_FWD_SUM_CHAINS 4
#endif
static_assert((RMS_FWD_SUM_CHAINS & (RMS_FWD_SUM_CHAINS - 1)) == 0, "RMS_FWD_SUM_CHAINS: a power of two");
template <int NPT>
struct SquareSums {
    static constexpr int C = NPT <= 2 ? RMS_FWD_SUM_CHAINS : 1;
    float part[C] = {};
    // Adds v * v to chain j (a constant in the unrolled loops that call it).
    __device__ __forceinline__ void add(int j, float v) { part[j % C] = fmaf(v, v, part[j % C]); }
    // The chains added pairwise (in place: called once, at the end).
    __device__ __forceinline__ float total() {
#pragma unroll
        for (int width = C / 2; width > 0; width /= 2) {
#pragma unroll
            for (int j = 0; j < width; ++j) part[j] += part[j + width];
        }
        return part[0];
    }
};

template <typename T, typename W, bool VEC, int E, bool BY_SHIFT = false>
__device__ __forceinline__ Pack<T, E> output(const NormParams& p, const Pack<T, E>& v, float rstd, const Pack<W, E>& w) {
    Pack<T, E> y;
#pragma unroll
    for (int e = 0; e < E; ++e)
        y.v[e] = from_float<T>(as_float<BY_SHIFT>(v.v[e]) * rstd * scale<W, E, BY_SHIFT>(p.weight, p.offset, w, e));
    return y;
}

// Vectorized fp16/bf16 rows of 2+ chunks a thread (not the fused add) hold each chunk as its four
// 32-bit words, half the registers of eight converted floats: shifted rows 5-13% faster (v14), aligned
// rows as fast, and 5-10% faster on one- and two-wave grids together with their weight loaded early
// (v16; docs/perf-notes.md). Element 2k of a chunk is the low half of word k, element 2k + 1 the high
// half. 0: the Pack path for every row.
#ifndef RMS_FWD_WORDS
#define RMS_FWD_WORDS 1
#endif
// Half `high` (0: element 2k, 1: element 2k + 1) of a 32-bit word as float.
template <typename T> __device__ __forceinline__ float half_of(unsigned word, bool high) {
    return as_float<true>(from_bits<T>(high ? word >> 16 : word));
}
// The same value through a byte permute in inline PTX, which ptxas does not fold into half_of's
// operations: the output cannot reuse the floats the sum of squares converted (8 registers a chunk held
// through the reduction) and keeps the words instead.
template <typename T> __device__ __forceinline__ float half_again(unsigned word, bool high);
template <> __device__ __forceinline__ float half_again<__nv_bfloat16>(unsigned word, bool high) {
    unsigned bits;  // the half moved to the top 16 bits: its fp32
    if (high) asm("prmt.b32 %0, %1, 0, 0x3244;" : "=r"(bits) : "r"(word));
    else asm("prmt.b32 %0, %1, 0, 0x1044;" : "=r"(bits) : "r"(word));
    return __uint_as_float(bits);
}
template <> __device__ __forceinline__ float half_again<__half>(unsigned word, bool high) {
    unsigned bits;  // the half moved to the low 16 bits, then converted
    if (high) asm("prmt.b32 %0, %1, 0, 0x4432;" : "=r"(bits) : "r"(word));
    else asm("prmt.b32 %0, %1, 0, 0x4410;" : "=r"(bits) : "r"(word));
    return half_of<__half>(bits, false);
}
template <typename T> __device__ __forceinline__ unsigned pair_of(float low, float high);
template <> __device__ __forceinline__ unsigned pair_of<__nv_bfloat16>(float low, float high) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<const unsigned*>(&pair);
}
template <> __device__ __forceinline__ unsigned pair_of<__half>(float low, float high) {
    const __half2 pair = __floats2half2_rn(low, high);
    return *reinterpret_cast<const unsigned*>(&pair);
}

// A row's base pointer, computed once per thread. Without the barrier NVVM folds row * stride into
// every chunk's address (64-bit row * stride + col, then scaled) and recomputes it per chunk under the
// chunk's predicate: ~9 instructions a chunk for loads and again for stores (docs/perf-notes.md v15).
// The pointers are global memory (CuPy and torch allocations), which the assumption keeps visible
// to the compiler (its loads stay LDG).
template <bool HELD, typename P> __device__ __forceinline__ P* row_base(P* row) {
    if constexpr (HELD) {
        asm("mov.b64 %0, %0;" : "+l"(row));
        __builtin_assume(__isGlobal(row));
    }
    return row;
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
// Mirrored by rmsnorm.py's _chunks_span.
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

// 1: the forward and fused add of shifted fp16/bf16 rows take an fp32 weight's chunks away from the row's ends from the
// 16-byte units they straddle (straddling_weight, straddles()); 0: element by element everywhere.
#ifndef RMS_WEIGHT_STRADDLE
#define RMS_WEIGHT_STRADDLE 1
#endif
// 1: ... and a 16-bit weight's, where straddles() takes it, from the 32-bit words they straddle (word_straddling_weight).
#ifndef RMS_WEIGHT_WORDS
#define RMS_WEIGHT_WORDS 1
#endif

// Whether the forward's shifted rows (rms_norm_fwd, rms_norm_fwd_split; with or without the fused add) load weights
// through straddling_weight or word_straddling_weight instead of E scalar loads a chunk, by where they measured faster:
// - an fp32 weight of fp16/bf16 rows (docs/perf-notes.md v27): 6-20% at hidden 2053-40001 (forward), up to 11% (fused
//   add); not for one chunk a thread (small inputs: ~0.4 us slower at [512, 1027]: the lanes at the row's ends wait
//   for two rounds of loads);
// - a weight of the rows' fp16/bf16 dtype (v28): 2-7% for rows read twice (NPT 0) and rows split over a cluster; 1-4%
//   slower for rows held in registers by one block (hidden 1027-8191), which keep scalar loads.
// fp32 rows keep scalar loads (straddling_weight<4> measured 2-9% slower for long odd fp32 rows, v28), and so does the
// backward (no faster: it loads its weights once a block).
template <typename T, typename W, int NPT, int SPLIT>
__device__ constexpr bool straddles() {
    if (sizeof(T) != 2 || NPT == 1) return false;
    return sizeof(W) == 4 ? RMS_WEIGHT_STRADDLE : RMS_WEIGHT_WORDS && (NPT == 0 || SPLIT > 1);
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

// Tuning knobs (docs/perf-notes.md; swept with CUPYROPE_EXTRA_NVRTC_OPTIONS by scripts/sweep_norm.py).
// Weight bytes per thread loaded with x and kept in registers through the reduction: RMS_FWD_EARLY_BYTES
// for the plain forward's aligned vectorized rows, RMS_WEIGHT_EARLY_BYTES for the fused add and
// shifted rows (early, the fused add spilled and ran 3x slower; shifted rows, which load the weight
// element by element, 5-10% slower). The other weights are loaded after the reduction, each right
// before its store (RMS_WEIGHT_BATCH 0) or all before the first (1). A weight load behind a store
// (which may alias it) waits for that store: late weights add a memory round trip a chunk to a row's
// chain, which single- and two-wave grids pay in full (v16: bf16 [512, 16384] 15.3 -> 13.9 us).
#ifndef RMS_FWD_EARLY_BYTES
#define RMS_FWD_EARLY_BYTES 64
#endif
#ifndef RMS_WEIGHT_EARLY_BYTES
#define RMS_WEIGHT_EARLY_BYTES 16
#endif
#ifndef RMS_WEIGHT_BATCH
#define RMS_WEIGHT_BATCH 0
#endif
// Resident 512-thread blocks per SM asked of the compiler (register budget) by register slots:
// occupancy mattered more than keeping everything in registers in every measurement so far.
#ifndef RMS_FWD_MIN_BLOCKS_1
#define RMS_FWD_MIN_BLOCKS_1 4
#endif
#ifndef RMS_FWD_MIN_BLOCKS_2
#define RMS_FWD_MIN_BLOCKS_2 3
#endif
#ifndef RMS_FWD_MIN_BLOCKS_4
#define RMS_FWD_MIN_BLOCKS_4 2
#endif
// The fused add's (v27b): it holds x and residual, and at the forward's budgets its shifted rows spilled (24-48
// bytes at 1-2 slots); one block fewer an SM measured up to 30% faster there (docs/perf-notes.md v27b). fp16/bf16
// rows of 4 slots are aligned (the planner reads shifted ones twice: FWD_ADD_SHIFTED_MAX_SLOTS, v28b) and keep the
// forward's budget: half of it (RMS_FWD_MIN_BLOCKS_4 = 1 for 512-thread blocks) was 2-3% faster from 2048 rows but
// 4-9% slower at 512.
#ifndef RMS_ADD_MIN_BLOCKS_1
#define RMS_ADD_MIN_BLOCKS_1 3
#endif
#ifndef RMS_ADD_MIN_BLOCKS_2
#define RMS_ADD_MIN_BLOCKS_2 2
#endif
// 1: the forward holds its row pointers (row_base) where that measured faster; 0: nowhere (v14).
#ifndef RMS_FWD_HELD
#define RMS_FWD_HELD 1
#endif
// Chunks a thread loads at once in the forward's loops over rows read twice (NPT == 0). The backward's
// take one: two spill at its 64 registers and measured up to 3x slower (docs/perf-notes.md v21).
#ifndef RMS_FWD_TWO_PASS_CHUNKS
#define RMS_FWD_TWO_PASS_CHUNKS 2
#endif
#ifndef RMS_BWD_MIN_BLOCKS_1
#define RMS_BWD_MIN_BLOCKS_1 2
#endif
#ifndef RMS_BWD_MIN_BLOCKS_2
#define RMS_BWD_MIN_BLOCKS_2 2
#endif
#ifndef RMS_BWD_PREFETCH  // 1: the backward loads the next row's dy and x before this row's reduction
#define RMS_BWD_PREFETCH 1
#endif
#ifndef RMS_BWD_SHIFT_WEIGHT_ONCE  // 1: the shifted backward keeps its weights in registers for all its rows
#define RMS_BWD_SHIFT_WEIGHT_ONCE 1
#endif
#ifndef RMS_BWD_KEEP_WEIGHT  // 1: the backward keeps the weight from its first pass; 0: loads it again
#define RMS_BWD_KEEP_WEIGHT 0
#endif

// Whether the forward loads a row's weight with x (see RMS_FWD_EARLY_BYTES). One chunk a thread (the
// planner's choice for small inputs): up to 32 bytes, but for the fused add of shifted rows (an fp32
// weight there spills at 32 registers).
template <typename W, bool VEC, int NPT, int E, bool ADD, bool SHIFT>
__device__ constexpr bool weight_early() {
    constexpr int bytes = NPT * E * (int)sizeof(W);
    if (NPT == 1 && !(ADD && SHIFT)) return bytes <= 32;
    return bytes <= (VEC && !ADD && !SHIFT ? RMS_FWD_EARLY_BYTES : RMS_WEIGHT_EARLY_BYTES);
}

// Launch bounds by register slots. Blocks have at most 512 threads (rmsnorm.py: MAX_WIDTH,
// FWD_BLOCK_THREADS), but rows of 4+ slots may have 1024 (FWD_MAX_WIDTH: long rows); those ask for
// half as many blocks, which leaves their register budget unchanged (the fp16/bf16 fused add's rows stay
// at 512 threads: FWD_MAX_WIDTH).
static_assert(RMS_FWD_MIN_BLOCKS_4 % 2 == 0, "RMS_FWD_MIN_BLOCKS_4 counts 512-thread blocks: even");
template <int NPT, bool ADD>
struct FwdBounds {
    static constexpr bool wide = NPT >= 4;
    static constexpr int threads = wide ? 1024 : 512;
    static constexpr int min_blocks = NPT == 1   ? (ADD ? RMS_ADD_MIN_BLOCKS_1 : RMS_FWD_MIN_BLOCKS_1)
                                      : NPT == 2 ? (ADD ? RMS_ADD_MIN_BLOCKS_2 : RMS_FWD_MIN_BLOCKS_2)
                                                 : RMS_FWD_MIN_BLOCKS_4 / (wide ? 2 : 1);  // NPT 0: 512 threads
};

// The sum of v over the row's threads and, SPLIT > 1 (rms_norm_fwd_split), over the cluster's blocks (the
// scratch of one row and the next: the cluster barrier between them orders its reads before its writes).
// LANES: row_sum's.
template <int SPLIT, int LANES>
__device__ __forceinline__ float split_row_sum(float v, int width, float* scratch, float (&cluster_slots)[SPLIT]) {
    return cluster_sum<SPLIT>(row_sum<LANES>(v, width, scratch, true), cluster_slots);
}

// Row `row` of rms_norm_fwd (SPLIT 1; threadIdx.y's row of the block), or of rms_norm_fwd_split (SPLIT > 1: p
// describes the block's part of the rows, in registers; cluster_slots: see there).
template <typename T, typename W, bool VEC, int NPT, bool ADD, bool SHIFT, int SPLIT>
__device__ __forceinline__ void norm_row(const NormParams& p, i64 row, float (&cluster_slots)[SPLIT]) {
    static_assert(!SHIFT || VEC, "SHIFT: rows of 16-byte chunks");
    static_assert(SPLIT == 1 || (VEC && NPT > 0), "SPLIT: rows of 16-byte chunks in registers");
    constexpr int E = VEC ? 16 / sizeof(T) : 1;
    __shared__ float scratch[32];
    const bool active = row < p.rows;  // inactive threads still join the block reduction
    const int lane = threadIdx.x, width = blockDim.x;
    const int step = width * E;
    float sum_sq = 0.f;

    constexpr bool EARLY = weight_early<W, VEC, NPT, E, ADD, SHIFT>();
    constexpr bool STRADDLE = straddles<T, W, NPT, SPLIT>();
    // How the row's sum runs at up to 32 threads and over 2-4 warps (row_sum's LANES), by kind of row; each
    // other choice measured slower there (docs/perf-notes.md v33). Rows of 4+ chunks a thread rarely take 32 threads
    // or fewer, but that code still takes registers from the rest: vectorized ones (not the fused add) ran bf16
    // [512, 16384] 13.8 -> 14.1 us with lanes_sum (13.8 with the loop); element-by-element ones [512, 130] 1.78 ->
    // 1.85 (1.78 with the switch and the compare chain). The fused add of 4 chunks ran 373 -> 381 us with the loop.
    constexpr int LANES = ADD || NPT < 4 ? LANES_SKIP : VEC ? LANES_LOOP : LANES_JUMP;
    // A branch of its own: the words must be what the loads produce and the loop holds. The Pack path
    // below with only its output converting from word_of(v[i], k) kept 54-56 registers (v14 review).
    if constexpr (RMS_FWD_WORDS && sizeof(T) == 2 && VEC && NPT >= 2 && !ADD) {  // see RMS_FWD_WORDS
        const T* const x_row = row_base<RMS_FWD_HELD != 0>(static_cast<const T*>(p.x) + row * p.x_stride);
        T* const y_row = row_base<RMS_FWD_HELD != 0>(static_cast<T*>(p.y) + row * p.y_stride);
        const int first = first_column<SHIFT, E>(x_row, lane), hidden = (int)p.hidden;
        unsigned words[NPT][4] = {};  // chunks outside the row stay 0 and add nothing to the sum
        // EARLY: the weight's chunks held as loaded words too (held as Packs: 64 instead of 56 registers
        // at 4 bf16 chunks; the compiler splits the halves at the load).
        constexpr int WEIGHT_WORDS = E * sizeof(W) / 4;
        unsigned weight_words[EARLY ? NPT : 1][WEIGHT_WORDS];
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (active && col < hidden) {
                const Pack<T, E> v = load_chunk<VEC, SHIFT, E>(x_row, col, hidden);
#pragma unroll
                for (int k = 0; k < 4; ++k) words[i][k] = word_of(v, k);
                if constexpr (EARLY) {
                    const Pack<W, E> w = load_weight_chunk<W, VEC, SHIFT, E, STRADDLE>(p.weight, col, hidden);
#pragma unroll
                    for (int k = 0; k < WEIGHT_WORDS; ++k) weight_words[EARLY ? i : 0][k] = word_of(w, k);
                }
            }
        }
        SquareSums<NPT> squares;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                squares.add(i * 8 + 2 * k, half_of<T>(words[i][k], false));
                squares.add(i * 8 + 2 * k + 1, half_of<T>(words[i][k], true));
            }
        }
        sum_sq = squares.total();
        const float rstd = inverse_rms(split_row_sum<SPLIT, LANES>(sum_sq, width, scratch, cluster_slots), p.inv_hidden, p.eps);
        if (!active) return;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (col < hidden) {
                Pack<W, E> w;
                if constexpr (EARLY) {
#pragma unroll
                    for (int k = 0; k < WEIGHT_WORDS; ++k) set_word(w, k, weight_words[EARLY ? i : 0][k]);
                } else {
                    w = load_weight_chunk<W, VEC, SHIFT, E, STRADDLE>(p.weight, col, hidden);
                }
                Pack<T, E> y;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float low = half_again<T>(words[i][k], false) * rstd;
                    const float high = half_again<T>(words[i][k], true) * rstd;
                    set_word(y, k, pair_of<T>(low * scale<W, E, true>(p.weight, p.offset, w, 2 * k),
                                             high * scale<W, E, true>(p.weight, p.offset, w, 2 * k + 1)));
                }
                store_chunk<VEC, SHIFT, E>(y_row, col, hidden, y);
            }
        }
        if (p.rstd && lane == 0) p.rstd[row] = rstd;
    } else if constexpr (NPT > 0) {
        constexpr bool BY_SHIFT = VEC && NPT >= 2 && !ADD;  // bf16 conversions: see as_float
        // Held row pointers (row_base) where they measured faster (docs/perf-notes.md v15): rows moved
        // element by element, and the fused add of shifted rows or of fp16/bf16 rows of 4+ chunks a
        // thread, where the old addressing spilled (up to 19% faster). Elsewhere they changed nothing or
        // were slower: 1% for the 2-chunk fused add, 11-14% for the fp32 fused add of 4+ chunks.
        constexpr bool HELD =
            RMS_FWD_HELD && (!VEC || (ADD && NPT >= 2 && (SHIFT || (NPT >= 4 && sizeof(T) == 2))));
        const T* const x_row = row_base<HELD>(static_cast<const T*>(p.x) + row * p.x_stride);
        T* const y_row = row_base<HELD>(static_cast<T*>(p.y) + row * p.y_stride);
        T* const res_row = ADD ? row_base<HELD>(static_cast<T*>(p.residual) + row * p.residual_stride) : nullptr;
        const int first = first_column<SHIFT, E>(x_row, lane), hidden = (int)p.hidden;
        Pack<T, E> v[NPT];
        Pack<W, E> w[NPT];
        Pack<T, E> r[ADD ? NPT : 1];
        // Every load of the row is issued before the first residual store (a store orders later loads).
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (active && col < hidden) {
                if constexpr (EARLY) w[i] = load_weight_chunk<W, VEC, SHIFT, E, STRADDLE>(p.weight, col, hidden);
                v[i] = load_chunk<VEC, SHIFT, E>(x_row, col, hidden);
                if constexpr (ADD) r[ADD ? i : 0] = load_chunk<VEC, SHIFT, E>(res_row, col, hidden);
            }
        }
        SquareSums<NPT> squares;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (active && col < hidden) {
                if constexpr (ADD) {
#pragma unroll
                    for (int e = 0; e < E; ++e)
                        v[i].v[e] = from_float<T>(as_float<BY_SHIFT>(v[i].v[e]) + as_float<BY_SHIFT>(r[ADD ? i : 0].v[e]));
                    store_chunk<VEC, SHIFT, E>(res_row, col, hidden, v[i]);
                }
#pragma unroll
                for (int e = 0; e < E; ++e) squares.add(i * E + e, as_float<BY_SHIFT>(v[i].v[e]));
            }
        }
        sum_sq = squares.total();
        const float rstd = inverse_rms(split_row_sum<SPLIT, LANES>(sum_sq, width, scratch, cluster_slots), p.inv_hidden, p.eps);
        if (!active) return;
        if constexpr (!EARLY && RMS_WEIGHT_BATCH) {
#pragma unroll
            for (int i = 0; i < NPT; ++i) {
                const int col = first + i * step;
                if (col < hidden) w[i] = load_weight_chunk<W, VEC, SHIFT, E, STRADDLE>(p.weight, col, hidden);
            }
        }
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (col < hidden) {
                if constexpr (!EARLY && !RMS_WEIGHT_BATCH)
                    w[i] = load_weight_chunk<W, VEC, SHIFT, E, STRADDLE>(p.weight, col, hidden);
                store_chunk<VEC, SHIFT, E>(y_row, col, hidden, output<T, W, VEC, E, BY_SHIFT>(p, v[i], rstd, w[i]));
            }
        }
        if (p.rstd && lane == 0) p.rstd[row] = rstd;
    } else {
        // Rows read twice. SHIFT: 16-byte chunks from the boundary before the row, the first and last
        // element by element (as above, with 64-bit columns). ADD: the new residual waits for the output
        // pass in the row cache, where the launch gave the block's rows (rmsnorm.row_cache_bytes: each
        // row slot's chunks from c * E, chunks_span); else it is read back.
        extern __shared__ __align__(16) unsigned char row_cache_bytes[];
        const T* const x_row = static_cast<const T*>(p.x) + row * p.x_stride;
        T* const y_row = static_cast<T*>(p.y) + row * p.y_stride;
        T* const res_row = ADD ? static_cast<T*>(p.residual) + row * p.residual_stride : nullptr;
        const int shift = row_shift<SHIFT, E>(x_row);
        const i64 first = (i64)lane * E - shift, cache_row = chunks_span<SHIFT, E>(p.hidden);
        T* const row_cache = reinterpret_cast<T*>(row_cache_bytes) + threadIdx.y * cache_row + shift;
        const bool cached = ADD && dynamic_shared_bytes() >= blockDim.y * cache_row * sizeof(T);
        // U chunks a thread at a time: their loads issued together, then their arithmetic and stores.
        constexpr int U = RMS_FWD_TWO_PASS_CHUNKS;
        for (i64 base = first; active && base < p.hidden; base += U * step) {
            Pack<T, E> v[U], r[ADD ? U : 1];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64 col = base + u * step;
                if (col >= p.hidden) break;
                v[u] = load_chunk<VEC, SHIFT, E>(x_row, col, p.hidden);
                if constexpr (ADD) r[ADD ? u : 0] = load_chunk<VEC, SHIFT, E>(res_row, col, p.hidden);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64 col = base + u * step;
                if (col >= p.hidden) break;
                if constexpr (ADD) {
#pragma unroll
                    for (int e = 0; e < E; ++e)
                        v[u].v[e] = from_float<T>(to_float(v[u].v[e]) + to_float(r[ADD ? u : 0].v[e]));
                    store_chunk<VEC, SHIFT, E>(res_row, col, p.hidden, v[u]);
                    if (cached) store_pack<VEC, E>(row_cache + col, v[u]);
                }
#pragma unroll
                for (int e = 0; e < E; ++e) sum_sq += to_float(v[u].v[e]) * to_float(v[u].v[e]);
            }
        }
        const float rstd = inverse_rms(row_sum(sum_sq, width, scratch, true), p.inv_hidden, p.eps);
        if (!active) return;
        if (p.rstd && lane == 0) p.rstd[row] = rstd;
        // With ADD, the normalized values are the rounded sums this thread just stored in residual. The
        // row cache holds what this thread summed: each thread reads back only its own columns, so no
        // barrier.
        const T* const src = ADD ? res_row : x_row;
        for (i64 base = first; base < p.hidden; base += U * step) {
            Pack<T, E> v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64 col = base + u * step;
                if (col >= p.hidden) break;
                if (cached) v[u] = load_pack<VEC, E>(row_cache + col);
                else v[u] = load_chunk<VEC, SHIFT, E>(src, col, p.hidden);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {  // the weight (cached) as it is used: fewer registers held
                const i64 col = base + u * step;
                if (col >= p.hidden) break;
                const Pack<W, E> w = load_weight_chunk<W, VEC, SHIFT, E, STRADDLE>(p.weight, col, p.hidden);
                store_chunk<VEC, SHIFT, E>(y_row, col, p.hidden, output<T, W, VEC, E>(p, v[u], rstd, w));
            }
        }
    }
}

template <typename T, typename W, bool VEC, int NPT, bool ADD, bool SHIFT>
__global__ void __launch_bounds__(FwdBounds<NPT, ADD>::threads, FwdBounds<NPT, ADD>::min_blocks) rms_norm_fwd(const NormParams p) {
    wait_for_previous_grid();
    float no_cluster[1];  // unused: one block sums its rows
    norm_row<T, W, VEC, NPT, ADD, SHIFT, 1>(p, (i64)blockIdx.x * blockDim.y + threadIdx.y, no_cluster);
}

// Narrows the rows that `p` describes to this block's part when a cluster splits them (cluster_part; SHIFT: rows
// `shift` elements past a 16-byte boundary): its pointers moved to the part's first column, its length; inv_hidden
// stays the whole row's, and only the block holding column 0 writes rstd. (In place: a copy returned compiled the
// aligned split's loop differently.)
template <typename T, typename W, bool ADD, int SPLIT, bool SHIFT>
__device__ __forceinline__ void narrow_to_part(NormParams& p, int shift) {
    i64 offset;
    const i64 length = cluster_part<16 / sizeof(T), SPLIT, SHIFT>(p.hidden, offset, shift);
    p.x = static_cast<const T*>(p.x) + offset;
    p.y = static_cast<T*>(p.y) + offset;
    if (ADD) p.residual = static_cast<T*>(p.residual) + offset;
    if (p.weight) p.weight = static_cast<const W*>(p.weight) + offset;
    p.hidden = length;
    if (offset) p.rstd = nullptr;
}

// Rows too long for one block's registers, which rms_norm_fwd reads twice (the planner splits fp32 ones: over 32768
// elements, the fused add's from 24576; fp16/bf16 from 65536; FWD_SPLIT_*) on clusters of SPLIT blocks (sm_90+), each
// walking rows (cluster, + clusters, ...: the grid is what the GPU holds at once, as a cluster waits for SPLIT free
// SMs of one GPC): the block of rank r holds columns [r * part, (r + 1) * part) of a row in registers, part = the
// row's 16-byte chunks / SPLIT rounded up (the last part may be shorter); only the sum of squares crosses blocks
// (cluster_sum: two slot sets by row parity, as in reread_rows). Rank 0 writes rstd. SHIFT (odd rows): each row's
// parts from its own shift (cluster_part), block 0's in shifted chunks, the others' from 16-byte boundaries.
template <typename T, typename W, int NPT, bool ADD, int SPLIT, bool SHIFT>
__global__ void CLUSTER_DIMS(SPLIT) __launch_bounds__(FwdBounds<NPT, ADD>::threads, FwdBounds<NPT, ADD>::min_blocks)
    rms_norm_fwd_split(const NormParams p) {
    wait_for_previous_grid();
#if CUPYROPE_CLUSTERS
    NormParams mine = p;  // the block's part of the rows (SHIFT: each row's own, below)
    narrow_to_part<T, W, ADD, SPLIT, false>(mine, 0);
    __shared__ float cluster_slots[2][SPLIT];
    cluster_sync();  // the cluster's blocks have all started: their shared memory is there to be written to
    int parity = 0;
#pragma unroll 1
    for (i64 row = blockIdx.x / SPLIT; row < p.rows; row += gridDim.x / SPLIT, parity ^= 1) {
        if constexpr (SHIFT) {
            NormParams row_part = p;
            const int shift = row_shift<true, 16 / sizeof(T)>(static_cast<const T*>(p.x) + row * p.x_stride);
            narrow_to_part<T, W, ADD, SPLIT, true>(row_part, shift);
            norm_row<T, W, true, NPT, ADD, true, SPLIT>(row_part, row, cluster_slots[parity]);
        } else {
            norm_row<T, W, true, NPT, ADD, false, SPLIT>(mine, row, cluster_slots[parity]);
        }
    }
#else
    __trap();  // no clusters before sm_90: the planner never launches it there
#endif
}

// ------------------------------------------------------------------------------------------ backward
// dx = rstd * g - x * rstd^3 * mean(g * x), g = dy * (w + offset); dweight = sum over rows of
// dy * x * rstd. Each block walks rows blockIdx.x*rpb + ty, + gridDim.x*rpb, ... and sums dweight
// over them in a fixed order: NPT > 0 in registers (a thread owns the same columns in every row it
// visits); NPT == 0 in shared memory, or for rows too long for it in the block's partial row. SHIFT:
// the planner makes the row step gridDim.x*rpb a multiple of E whenever a rows slot visits more than
// one row, so all its rows share one shift. The rows slots (ty) are then added in order
// into partial[blockIdx.x, :] (through shared memory when blockDim.y > 1), and rms_norm_dw adds the
// partials in a fixed order: bitwise deterministic.

struct NormBwdParams {  // mirrored by rmsnorm.py's _BWD_TAIL
    const void* dy;
    const void* x;
    const void* weight;  // may be null: no dweight
    const float* rstd;   // may be null: recomputed
    void* dx;
    float* partial;      // [gridDim.x (clusters: gridDim.x / CLUSTER), hidden]; unused without weight
    i64 rows, hidden;
    i64 dy_stride, x_stride, dx_stride;
    i64 shared_acc;  // 1: dynamic shared memory holds [blockDim.y, hidden] floats of dweight sums
    float eps, offset;
    float inv_hidden;  // 1 / hidden, as in NormParams
};

// dx for E columns (returned); adds dy * x * rstd to sums.
template <typename T, typename W, int E>
__device__ __forceinline__ Pack<T, E> bwd_chunk(const NormBwdParams& p, const Pack<T, E>& d, const Pack<T, E>& xx,
                                                const Pack<W, E>& w, float rstd, float coef, Pack<float, E>& sums) {
    Pack<T, E> out;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float xf = to_float(xx.v[e]), df = to_float(d.v[e]);
        out.v[e] = from_float<T>(rstd * df * scale<W, E>(p.weight, p.offset, w, e) - xf * coef);
        sums.v[e] += df * xf * rstd;
    }
    return out;
}

// The row sums the backward needs from E columns: sum_sq += x^2, dot += dy * (w + offset) * x.
template <typename T, typename W, int E>
__device__ __forceinline__ void add_row_sums(const NormBwdParams& p, const Pack<T, E>& d, const Pack<T, E>& xx,
                                             const Pack<W, E>& w, float& sum_sq, float& dot) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float xf = to_float(xx.v[e]);
        sum_sq += xf * xf;
        dot += to_float(d.v[e]) * scale<W, E>(p.weight, p.offset, w, e) * xf;
    }
}

template <int E>
__device__ __forceinline__ Pack<float, E> zeros() {
    Pack<float, E> z;
#pragma unroll
    for (int e = 0; e < E; ++e) z.v[e] = 0.f;
    return z;
}

// This thread's chunks of dy and x of one row (none past the last row) into registers; `first` is the
// thread's first column (the same in every row it visits, SHIFT included: see the kernel).
template <typename T, bool VEC, int NPT, bool SHIFT, int E>
__device__ __forceinline__ void load_bwd_row(const NormBwdParams& p, i64 row, int first, int step, Pack<T, E> (&dyv)[NPT],
                                             Pack<T, E> (&xv)[NPT]) {
    if (row >= p.rows) return;
    const T* dy_row = static_cast<const T*>(p.dy) + row * p.dy_stride;
    const T* x_row = static_cast<const T*>(p.x) + row * p.x_stride;
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

template <typename T, typename W, bool VEC, int NPT, bool SHIFT>
__global__ void __launch_bounds__(512, NPT == 1 ? RMS_BWD_MIN_BLOCKS_1 : RMS_BWD_MIN_BLOCKS_2)
    rms_norm_bwd(const NormBwdParams p) {
    wait_for_previous_grid();
    static_assert(!SHIFT || VEC, "SHIFT: rows of 16-byte chunks");
    constexpr int E = VEC ? 16 / sizeof(T) : 1;
    constexpr int SLOTS = NPT > 0 ? NPT : 1;
    __shared__ __align__(8) float scratch[64];  // row_sum2 reads it as float2
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
    // before this row's reduction, so they are in flight through its barriers and stores. Measured
    // (docs/perf-notes.md, v8): fp32 1-4% faster; fp16/bf16 3-8% slower, and with 2 slots it spills
    // (125 registers wanted), so only fp32 rows of up to 8 elements a thread prefetch.
    constexpr bool PREFETCH = RMS_BWD_PREFETCH && VEC && NPT > 0 && sizeof(T) == 4 && NPT * E <= 8;
    Pack<T, E> dyv[SLOTS], xv[SLOTS];
    const i64 first_row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    // A thread's columns are the same in every row it visits (SHIFT: one shift per rows slot, see above).
    const int first = first_column<SHIFT, E>(static_cast<const T*>(p.x) + first_row * p.x_stride, lane);
    if constexpr (PREFETCH) load_bwd_row<T, VEC, SLOTS, SHIFT, E>(p, first_row, first, step, dyv, xv);
    // SHIFT reads the weight element by element (8 loads a 16-bit chunk): once, kept in registers.
    constexpr bool WEIGHT_ONCE = SHIFT && RMS_BWD_SHIFT_WEIGHT_ONCE;
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
        const T* dy_row = static_cast<const T*>(p.dy) + row * p.dy_stride;
        const T* x_row = static_cast<const T*>(p.x) + row * p.x_stride;
        T* dx_row = static_cast<T*>(p.dx) + row * p.dx_stride;
        float sum_sq = 0.f, dot = 0.f;
        if constexpr (NPT > 0) {
            if constexpr (!PREFETCH) load_bwd_row<T, VEC, SLOTS, SHIFT, E>(p, row, first, step, dyv, xv);
#pragma unroll
            for (int i = 0; i < NPT; ++i) {
                const int col = first + i * step;
                if (active && col < hidden) {
                    if constexpr (!WEIGHT_ONCE) {
                        const Pack<W, E> w = load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, hidden);
                        if constexpr (RMS_BWD_KEEP_WEIGHT) wv[i] = w;
                        add_row_sums<T, W, E>(p, dyv[i], xv[i], w, sum_sq, dot);
                    } else {
                        add_row_sums<T, W, E>(p, dyv[i], xv[i], wv[i], sum_sq, dot);
                    }
                }
            }
        } else {
            for (i64 col = first; active && col < p.hidden; col += step) {
                const Pack<T, E> d = load_chunk<VEC, SHIFT, E>(dy_row, col, p.hidden);
                const Pack<T, E> xx = load_chunk<VEC, SHIFT, E>(x_row, col, p.hidden);
                add_row_sums<T, W, E>(p, d, xx, load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, p.hidden), sum_sq, dot);
            }
        }
        Pack<T, E> next_dy[SLOTS], next_x[SLOTS];
        if constexpr (PREFETCH) load_bwd_row<T, VEC, SLOTS, SHIFT, E>(p, row + rows_per_pass, first, step, next_dy, next_x);
        const float2 sums = row_sum2(sum_sq, dot, width, scratch);
        const float rstd = p.rstd ? (active ? p.rstd[row] : 0.f) : inverse_rms(sums.x, p.inv_hidden, p.eps);
        const float coef = rstd * rstd * rstd * (sums.y * p.inv_hidden);

        if (active) {
            if constexpr (NPT > 0) {
    #pragma unroll
                for (int i = 0; i < NPT; ++i) {
                    const int col = first + i * step;
                    if (col < hidden) {
                        if constexpr (!RMS_BWD_KEEP_WEIGHT && !WEIGHT_ONCE)
                            wv[i] = load_weight_chunk<W, VEC, SHIFT, E>(p.weight, col, hidden);
                        // SHIFT: columns outside the row were loaded as 0 and add 0 to their sums.
                        store_chunk<VEC, SHIFT, E>(dx_row, col, hidden,
                                                   bwd_chunk<T, W, E>(p, dyv[i], xv[i], wv[i], rstd, coef, dw[i]));
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
                    store_chunk<VEC, SHIFT, E>(dx_row, col, p.hidden, bwd_chunk<T, W, E>(p, d, xx, w, rstd, coef, acc));
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

// ----------------------------------------------------------------------- backward, staged rows
// One row per block, for 16-byte chunks of rows (VEC; SHIFT as in rms_norm_bwd). The block walks rows blockIdx.x,
// + gridDim.x, ... and keeps the next STAGES rows' dy and x in flight: cp.async copies them into
// shared memory, where they hold no registers (v8's register prefetch cost occupancy). A thread
// copies, and later reads, only its own chunks (lane + i * blockDim.x), so the staging needs no
// barriers. The current row moves to registers; its stage is refilled with the row STAGES ahead as
// soon as those values are consumed. dweight sums stay in registers (a thread owns the same columns
// in every row) and go to partial[blockIdx.x, :] at the end, as in rms_norm_bwd.
// SHIFT: chunks follow memory's 16-byte boundaries (see the top of this file); the planner keeps the
// grid a multiple of the elements in 16 bytes, so all rows of a block share one shift. A row's first
// chunk is copied whole from up to 15 bytes before the row (the same aligned 16 bytes, so the same
// allocation), its last chunk only up to the row's end; columns outside the row are zeroed after the
// copy. The weight, read element by element, stays in registers for all rows.
// LEAN (the planner's STAGED_LEAN_MAX_ROWS: blocks that walk few rows with 1 or 2 chunks a thread, fp32
// rows of 4 chunks): a shorter row: rstd by rsqrt and 1/hidden, the warps' partials added by a shuffle
// tree, the weights kept in registers for all rows (aligned rows too). Measured 5-16% faster where a
// block walks up to ~40 rows (bf16 [2048, 4096], [8192, 1024-2053], odd 1027; 2 chunks: bf16 [2048,
// 8192] 20%) and 2-16% with fp32 rows of 4 chunks (hidden 5120-8192, any length), but 5% slower at bf16
// [32768, 4096] (124 rows a block): there the longer chain stays (a sensitivity to the L2's dirty lines
// left by the previous call, not to instructions; docs/perf-notes.md, session 19).
// Launch bound: 1 chunk a thread, and 2 with the long chain, fit the 64 registers of 1024-thread blocks
// (2 spill 4-12 bytes); LEAN at 2 chunks (92-102 registers: it spilled at 64 and was up to 25% slower),
// 4 and 8 chunks take the 512-thread bound (128 registers). Mirrored by rmsnorm.py's STAGED_MAX_THREADS
// and STAGED_LEAN_MAX_THREADS.
template <int NPT, bool LEAN>
struct StagedMaxThreads {
    static constexpr int value = NPT == 1 || (NPT == 2 && !LEAN) ? 1024 : 512;
};

template <int NPT>
__device__ __forceinline__ uint4* stage_slot(uint4* staged, int stage, int tensor, int i) {
    return staged + ((stage * 2 + tensor) * NPT + i) * blockDim.x + threadIdx.x;
}

// Column of a thread's chunk i. Aligned rows keep the expressions this kernel had before SHIFT
// (lane * E here, plain 16-byte copies and stores below): ptxas otherwise allocated registers
// differently and the aligned variants measured 1-3% slower (docs/perf-notes.md v12); their SASS is
// now identical to v11's.
template <bool SHIFT, int E>
__device__ __forceinline__ int staged_column(int first, int lane, int i, int step) {
    return SHIFT ? first + i * step : lane * E + i * step;
}

// Copies the 16 bytes of a shifted chunk at `col`, but only what lies before the row's end.
template <typename T>
__device__ __forceinline__ void stage_chunk(uint4* slot, const T* row, int col, int hidden) {
    constexpr int E = 16 / sizeof(T);
    if (col + E > hidden) copy_async16_first(slot, row + col, (hidden - col) * (int)sizeof(T));
    else copy_async16(slot, row + col);
}

// Starts copying this thread's chunks of row `row` (nothing past the last row) into `stage`, as one
// commit group (an empty one past the last row, so every thread's group count stays the same).
// `first`: the thread's first column (rows are < 2^31 elements: planner).
template <typename T, int NPT, bool SHIFT>
__device__ __forceinline__ void stage_row(const NormBwdParams& p, uint4* staged, i64 row, int stage, int first) {
    constexpr int E = 16 / sizeof(T);
    if (row < p.rows) {
        const T* dy_row = static_cast<const T*>(p.dy) + row * p.dy_stride;
        const T* x_row = static_cast<const T*>(p.x) + row * p.x_stride;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            // Aligned rows: this kernel's expression before SHIFT (see staged_column).
            const int col = SHIFT ? first + i * blockDim.x * E : (i * blockDim.x + threadIdx.x) * E;
            if (col < p.hidden) {
                if constexpr (SHIFT) {
                    stage_chunk(stage_slot<NPT>(staged, stage, 0, i), dy_row, col, (int)p.hidden);
                    stage_chunk(stage_slot<NPT>(staged, stage, 1, i), x_row, col, (int)p.hidden);
                } else {
                    copy_async16(stage_slot<NPT>(staged, stage, 0, i), dy_row + col);
                    copy_async16(stage_slot<NPT>(staged, stage, 1, i), x_row + col);
                }
            }
        }
    }
    copy_async_commit();
}

// The given rstd (p.rstd; 0 without) of the rows a block walks one at a time (first_row, + row_step, ...),
// each loaded a row ahead so that it is not on its row's critical path.
struct RstdAhead {
    float next;
    __device__ __forceinline__ RstdAhead(const NormBwdParams& p, i64 first_row)
        : next(p.rstd && first_row < p.rows ? p.rstd[first_row] : 0.f) {}
    __device__ __forceinline__ float take(const NormBwdParams& p, i64 row, i64 row_step) {  // once a row, in order
        const float current = next;
        if (p.rstd && row + row_step < p.rows) next = p.rstd[row + row_step];
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
// ([STAGES][dy, x][NPT][blockDim.x] chunks of dynamic shared memory).
template <typename T, typename W, int NPT, int STAGES, bool SHIFT, bool LEAN, int E>
__device__ __forceinline__ void walk_staged_rows(const NormBwdParams& p, float* scratch, uint4* staged, int& first,
                                                 Pack<float, E> (&dw)[NPT]) {
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
    for (int s = 0; s < STAGES; ++s) stage_row<T, NPT, SHIFT>(p, staged, blockIdx.x + s * row_step, s, first);
    RstdAhead given(p, blockIdx.x);
    int stage = 0;
    // The loop bound is uniform across the block (one row per block; the reduction has barriers).
#pragma unroll 1
    for (i64 row = blockIdx.x; row < p.rows; row += row_step) {
        const float given_rstd = given.take(p, row, row_step);
        copy_async_wait<STAGES - 1>();  // this row's group is complete
        Pack<T, E> dyv[NPT], xv[NPT];
        float sum_sq = 0.f, dot = 0.f;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = staged_column<SHIFT, E>(first, lane, i, step);
            if (col < p.hidden) {
                dyv[i] = unstage_chunk<SHIFT, T, E>(stage_slot<NPT>(staged, stage, 0, i), col, hidden);
                xv[i] = unstage_chunk<SHIFT, T, E>(stage_slot<NPT>(staged, stage, 1, i), col, hidden);
                const Pack<W, E> w = staged_weight<HOLD, E>(p, wv, i, col);
                add_row_sums<T, W, E>(p, dyv[i], xv[i], w, sum_sq, dot);
            }
        }
        // The shared reads above precede this refill in program order, and a copy's write lands
        // only after its global read: the slot is free.
        stage_row<T, NPT, SHIFT>(p, staged, row + STAGES * row_step, stage, first);
        stage = stage + 1 == STAGES ? 0 : stage + 1;
        const float2 sums = row_sum2<LEAN>(sum_sq, dot, width, scratch);
        // Not LEAN: IEEE division and sqrt, and the loop over the warps' partials (row_sum2<false>): the
        // shorter chain of rms_norm_bwd (rsqrt, shuffle tree, int columns) made this kernel 3-11% slower
        // at bf16 [32768, 4096] and [8192, 16384] and fp32 [8192, 5120] (docs/perf-notes.md v11).
        const float rstd = p.rstd ? given_rstd
                           : LEAN ? inverse_rms(sums.x, p.inv_hidden, p.eps)
                                  : 1.f / sqrtf(sums.x / (float)p.hidden + p.eps);
        const float coef = rstd * rstd * rstd * (LEAN ? sums.y * p.inv_hidden : sums.y / (float)p.hidden);
        T* dx_row = static_cast<T*>(p.dx) + row * p.dx_stride;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = staged_column<SHIFT, E>(first, lane, i, step);
            if (col < p.hidden) {
                const Pack<W, E> w = staged_weight<HOLD, E>(p, wv, i, col);
                if constexpr (SHIFT)
                    store_chunk<true, true, E>(dx_row, col, hidden, bwd_chunk<T, W, E>(p, dyv[i], xv[i], w, rstd, coef, dw[i]));
                else
                    store_pack<true, E>(dx_row + col, bwd_chunk<T, W, E>(p, dyv[i], xv[i], w, rstd, coef, dw[i]));
            }
        }
    }
    copy_async_wait<0>();  // no copy may outlive the block
}

template <typename T, typename W, int NPT, int STAGES, bool SHIFT, bool LEAN>
__global__ void __launch_bounds__(StagedMaxThreads<NPT, LEAN>::value, 1) rms_norm_bwd_staged(const NormBwdParams p) {
    wait_for_previous_grid();
    constexpr int E = 16 / sizeof(T);
    __shared__ __align__(8) float scratch[64];  // row_sum2 reads it as float2
    extern __shared__ __align__(16) uint4 staged[];  // [STAGES][dy, x][NPT][blockDim.x]
    int first;
    Pack<float, E> dw[NPT];
    walk_staged_rows<T, W, NPT, STAGES, SHIFT, LEAN>(p, scratch, staged, first, dw);
    store_staged_partial<SHIFT>(p, p.partial + (i64)blockIdx.x * p.hidden, dw, first, threadIdx.x, blockDim.x * E, p.hidden);
}

// ------------------------------------------------------------------ backward, blocks in clusters
// rms_norm_bwd_staged's LEAN walk on clusters of CLUSTER blocks (sm_90+), each block keeping its dweight sums in
// its own shared memory, after the stages. After a cluster barrier, the cluster's threads each add columns across
// the blocks' sums in rank order (distributed shared memory), so a cluster leaves one row of sums, not CLUSTER:
// - one cluster (calls of few rows, the planner's CLUSTER_BWD_MAX_ROWS): that row is dweight (W*, hidden values,
//   in p.partial), in one launch instead of rms_norm_bwd_staged and rms_norm_dw; the same additions, in the same
//   order, as rms_norm_dw over the staged kernel's CLUSTER partial rows (bitwise equal);
// - several (large calls, CLUSTER_ROUNDS_ROWS): cluster c's row is partial row c for rms_norm_dw. The grid is
//   several rounds of the clusters the GPU holds at once, so the SMs that stream faster take more of the rows,
//   with no more partial rows than a one-wave staged grid.
// Deterministic either way: a block's rows, and the order of every addition, follow from the grid alone.
template <typename T, typename W, int NPT, int STAGES, bool SHIFT, int CLUSTER>
__global__ void CLUSTER_DIMS(CLUSTER) __launch_bounds__(StagedMaxThreads<NPT, true>::value, 1)
    rms_norm_bwd_cluster(const NormBwdParams p) {
    wait_for_previous_grid();
#if CUPYROPE_CLUSTERS
    constexpr int E = 16 / sizeof(T);
    __shared__ __align__(8) float scratch[64];
    extern __shared__ __align__(16) uint4 staged[];  // the stages, then this block's dweight sums: [hidden] floats
    float* sums = reinterpret_cast<float*>(staged + STAGES * 2 * NPT * blockDim.x);
    int first;
    Pack<float, E> dw[NPT];
    walk_staged_rows<T, W, NPT, STAGES, SHIFT, true>(p, scratch, staged, first, dw);
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
// row's chain is LEAN's (rsqrt, shuffle tree); a first version inside the staged kernel, with its long
// chain, was 4-17% slower (docs/perf-notes.md v22).
// SHIFT: every row of the block starts at the same offset from a 16-byte boundary (planner), and the weight is
// copied once into shared memory after the stages, from that offset, so that each chunk's weights are one
// aligned read there instead of E element loads from global memory (registers cannot hold them: spills).
#ifndef RMS_REREAD_SHIFT_WEIGHT_GLOBAL  // 1: SHIFT reads the weight element by element from global memory (13-29% slower)
#define RMS_REREAD_SHIFT_WEIGHT_GLOBAL 0
#endif
template <bool SHIFT, typename W, int E>
__device__ __forceinline__ Pack<W, E> reread_weight(const NormBwdParams& p, const W* shifted_weight, int col, int shift) {
    if constexpr (SHIFT) {
#if RMS_REREAD_SHIFT_WEIGHT_GLOBAL
        return load_weight_chunk<W, true, true, E>(p.weight, col, (int)p.hidden);
#endif
        if (p.weight) return load_pack<true, E>(shifted_weight + col + shift);
    }
    return load_weight<W, true, E>(p.weight, col);
}

// Rows first_row, + row_step, ... below p.rows: rms_norm_bwd_reread's (SPLIT 1), or rms_norm_bwd_split's (SPLIT > 1:
// a cluster's; p describes the block's part of them, p.partial its part of the cluster's partial row; the row sums
// are added over the cluster). `accumulate`: the dweight sums are added to the partial row (SHIFT only).
template <typename T, typename W, int NPT, int STAGES, bool SHIFT, int SPLIT>
__device__ __forceinline__ void reread_rows(const NormBwdParams& p, i64 first_row, i64 row_step, bool accumulate = false) {
    constexpr int E = 16 / sizeof(T);
    __shared__ __align__(8) float scratch[64];  // row_sum2 reads it as float2
    __shared__ float2 cluster_slots[2][SPLIT];  // SPLIT > 1: the row sums of the cluster's blocks (cluster_sum)
    extern __shared__ __align__(16) uint4 staged[];  // [STAGES][dy, x][NPT][blockDim.x]; SHIFT: then the weight
    const int lane = threadIdx.x, width = blockDim.x;
    const int step = width * E, hidden = (int)p.hidden;
    const int shift = row_shift<SHIFT, E>(static_cast<const T*>(p.x) + first_row * p.x_stride);
    const int first = SHIFT ? lane * E - shift : 0;  // aligned rows: the expressions of v22 (same SASS)
#pragma unroll
    for (int s = 0; s < STAGES; ++s) stage_row<T, NPT, SHIFT>(p, staged, first_row + s * row_step, s, first);
    if constexpr (SPLIT > 1) cluster_sync();  // the cluster's blocks have all started: their shared memory is there
    // SHIFT: column c's weight at c + shift. A thread copies only its own chunks' weights, which only it reads
    // (no barrier), all loads at once (a block-strided loop over the row measured 4-8% slower).
    W* const shifted_weight = reinterpret_cast<W*>(staged + STAGES * 2 * NPT * width);
    if (SHIFT && p.weight && !RMS_REREAD_SHIFT_WEIGHT_GLOBAL) {
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
    int stage = 0, parity = 0;
    // The loop bound is uniform across the block (one row per block; the reduction has barriers) and, SPLIT,
    // across the cluster.
#pragma unroll 1
    for (i64 row = first_row; row < p.rows; row += row_step) {
        const float given_rstd = given.take(p, row, row_step);
        copy_async_wait<STAGES - 1>();  // this row's group is complete
        float sum_sq = 0.f, dot = 0.f;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = staged_column<SHIFT, E>(first, lane, i, step);
            if (col < hidden)
                add_row_sums<T, W, E>(p, unstage_chunk<SHIFT, T, E>(stage_slot<NPT>(staged, stage, 0, i), col, hidden),
                                      unstage_chunk<SHIFT, T, E>(stage_slot<NPT>(staged, stage, 1, i), col, hidden),
                                      reread_weight<SHIFT, W, E>(p, shifted_weight, col, shift), sum_sq, dot);
        }
        // Two slot sets by row parity: a block writes a set again (two rows on) only after the next row's
        // cluster barrier, which its peers pass only after reading the set.
        const float2 sums = cluster_sum<SPLIT>(row_sum2(sum_sq, dot, width, scratch), cluster_slots[parity]);
        parity ^= 1;
        const float rstd = p.rstd ? given_rstd : inverse_rms(sums.x, p.inv_hidden, p.eps);
        const float coef = rstd * rstd * rstd * (sums.y * p.inv_hidden);
        T* dx_row = static_cast<T*>(p.dx) + row * p.dx_stride;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = staged_column<SHIFT, E>(first, lane, i, step);
            if (col < hidden) {
                // bwd_chunk's result passed straight to the store: through a local variable (or a helper that
                // takes it), ptxas scheduled the aligned kernel differently; v22's SASS is kept.
                const uint4 *dy_slot = stage_slot<NPT>(staged, stage, 0, i), *x_slot = stage_slot<NPT>(staged, stage, 1, i);
                if constexpr (SHIFT)
                    store_chunk<true, true, E>(dx_row, col, hidden,
                                               bwd_chunk<T, W, E>(p, unstage_chunk<SHIFT, T, E>(dy_slot, col, hidden),
                                                                  unstage_chunk<SHIFT, T, E>(x_slot, col, hidden),
                                                                  reread_weight<SHIFT, W, E>(p, shifted_weight, col, shift),
                                                                  rstd, coef, dw[i]));
                else
                    store_pack<true, E>(dx_row + col, bwd_chunk<T, W, E>(p, unstage_chunk<SHIFT, T, E>(dy_slot, col, hidden),
                                                                         unstage_chunk<SHIFT, T, E>(x_slot, col, hidden),
                                                                         reread_weight<SHIFT, W, E>(p, shifted_weight, col, shift),
                                                                         rstd, coef, dw[i]));
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

template <typename T, typename W, int NPT, int STAGES, bool SHIFT>
__global__ void __launch_bounds__(1024, 1) rms_norm_bwd_reread(const NormBwdParams p) {
    wait_for_previous_grid();
    reread_rows<T, W, NPT, STAGES, SHIFT, 1>(p, blockIdx.x, gridDim.x);
}

// ----------------------------------------------------------------- backward, rows split over a cluster
// Rows too long for one block's shared memory (aligned fp16/bf16 over 32K elements, fp32 over ~29K; SHIFT, odd
// rows: past what a stage and the weight's copy hold, fp16/bf16 over ~28.6K, fp32 over ~18.9K: the two-pass loop
// of rms_norm_bwd read them twice from global memory) on a cluster of SPLIT blocks (sm_90+), each the reread
// kernel on its part of every row: the block of rank r takes columns [r * part, (r + 1) * part), part = the row's
// 16-byte chunks / SPLIT rounded up (the last part may be shorter), with one stage, and keeps its dweight sums for
// those columns of the cluster's partial row. Only the two row sums cross blocks (cluster_sum).
// SHIFT: the dweight sums hold a thread's columns for one shift (offset of the row from a 16-byte boundary), and a
// row's shift repeats every E rows. On 2 blocks (v25) the clusters step over a multiple of E rows (the planner's
// cluster_step), so a cluster's rows share one shift; the parts split the chunks a row of any shift spans
// (cluster_part): block 0's keeps the shift, the others start on a boundary. From CLASS_WALK_MIN_SPLIT blocks (v26;
// rounding their fewer clusters down to a multiple of E left SMs idle) the clusters walk the rows class by class
// (rows r = k mod E, class_run): cluster c takes places [c, c + 1) * rows / clusters of the order class 0's rows,
// then class 1's, ..., crossing few classes; at each new class the block adds its sums to its columns of the
// partial row and starts again (reread_rows' `accumulate`). Its parts are whole E-column chunks, each at the row's
// shift (cluster_columns), so that a block's columns stay the same across classes, on at most
// RMS_CLASS_WALK_MAX_THREADS (96 registers at 640: at 64, for 1024 threads, the walk's row bound pushed dweight
// sums out to local memory).
constexpr int CLASS_WALK_MIN_SPLIT = 4;  // rmsnorm.py's
#ifndef RMS_CLASS_WALK_MAX_THREADS
#define RMS_CLASS_WALK_MAX_THREADS 640  // rmsnorm.py's CLASS_WALK_MAX_THREADS
#endif

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

template <typename T, typename W, int NPT, int SPLIT, bool SHIFT>
__global__ void CLUSTER_DIMS(SPLIT) __launch_bounds__(walks_classes(SHIFT, SPLIT) ? RMS_CLASS_WALK_MAX_THREADS : 1024, 1)
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
    if (p.weight) mine.weight = static_cast<const W*>(p.weight) + offset;
    mine.hidden = length;
    const i64 cluster = blockIdx.x / SPLIT, clusters = gridDim.x / SPLIT;
    mine.partial = p.partial + cluster * p.hidden + offset;
    if constexpr (WALK) {
        const int rows = (int)p.rows;  // < 2^31: rows of over 18K elements
        int place = (int)(cluster * rows / clusters);
        const int end = (int)((cluster + 1) * rows / clusters);
        bool accumulate = false;
        do {  // once at least: a cluster with no rows (the planner makes none) writes zero sums
            const ClassRun run = class_run<E>(place, end, rows);
            mine.rows = run.first_row + (run.count - 1) * E + 1;  // past the run's last row
            reread_rows<T, W, NPT, 1, SHIFT, SPLIT>(mine, run.first_row, E, accumulate);
            accumulate = true;
            place += run.count;
        } while (place < end);
    } else {  // SHIFT: block 0's part keeps the rows' shift, the others none
        reread_rows<T, W, NPT, 1, SHIFT, SPLIT>(mine, cluster, clusters);
    }
#else
    __trap();  // no clusters before sm_90: the planner never launches it there
#endif
}

struct DweightParams {  // mirrored by rmsnorm.py's _DW_TAIL
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
