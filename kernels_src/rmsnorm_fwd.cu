// RMSNorm forward: y = x / sqrt(mean(x^2) + eps) * (w + offset), over the last dimension; and the fused
// residual add (ADD): residual <- x + residual (rounded to T), or with OUT residual_out <- x + residual (add_rms_norm,
// out of place), then that sum normalized into y. OUT is a template flag, so that the in-place kernels hold one
// residual row pointer as before (a second one cost the bf16 fused add of 4 chunks a thread 8 more bytes of spills).
// Row layout and SHIFT: rmsnorm_common.cuh. Rows read twice (NPT == 0) with ADD keep their rounded sums in dynamic
// shared memory where the launch gives the block's rows (the planner's row cache) for the output pass.
#include "rmsnorm_common.cuh"

namespace cupyrope {

struct NormParams {  // mirrored by rmsnorm.py's FWD_TAIL (after the pointers)
    const void* x;
    void* y;
    void* residual;
    void* residual_out;  // ADD with OUT: where x + residual goes (else into residual)
    const void* weight;  // may be null: no weight
    float* rstd;         // may be null: not returned
    i64 rows, hidden;
    i64 x_stride, y_stride, residual_stride, residual_out_stride;
    float eps, offset;
    float inv_hidden;  // 1 / hidden, rounded to float: a multiply instead of a division on the row's critical path
};

// rms_norm_fwd_runs' parameters: rows in runs (row_in_runs).
struct NormRunsParams : NormParams {  // mirrored by rmsnorm.py's FWD_RUNS_TAIL (after FWD_TAIL)
    i64 inner_rows, x_outer, y_outer;
};

// A thread's sum of squares in the forward's rows of 1-2 chunks a thread, as SUM_CHAINS independent partial sums
// added pairwise at the end: one chain of 8-16 dependent FMAs sits on a small call's critical path (ncu: bf16
// [16, 4096] ran ~160 cycles longer with one). Rows of 4+ chunks a thread keep one chain: they are bandwidth-bound,
// and the extra registers spilled at their 64-register budgets (fp32 8 chunks: 4 -> 32 bytes; the fused add
// 240 -> 500).
constexpr int SUM_CHAINS = 4;  // a power of two
template <int NPT>
struct SquareSums {
    static constexpr int C = NPT <= 2 ? SUM_CHAINS : 1;
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

// Vectorized fp16/bf16 rows of 2+ chunks a thread (the fused add's aligned ones only: ADD_WORDS_EARLY_BYTES) hold
// each chunk as its four 32-bit words, half the registers of eight converted floats: shifted rows 5-13% faster,
// aligned rows as fast, and 5-10% faster on one- and two-wave grids together with their weight loaded early.
// Element 2k of a chunk is the low half of word k, element 2k + 1 the high half.
// half_of (rmsnorm_common.cuh) reads them.
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

// Whether the forward's shifted rows (rms_norm_fwd, rms_norm_fwd_split; with or without the fused add) load weights
// through straddling_weight or word_straddling_weight instead of E scalar loads a chunk, by where they measured faster:
// - an fp32 weight of fp16/bf16 rows: 6-20% at hidden 2053-40001 (forward), up to 11% (fused add); not for one
//   chunk a thread (small inputs: ~0.4 us slower at [512, 1027]: the lanes at the row's ends wait for two rounds
//   of loads);
// - a weight of the rows' fp16/bf16 dtype: 2-7% for rows read twice (NPT 0) and rows split over a cluster; 1-4%
//   slower for rows held in registers by one block (hidden 1027-8191), which keep scalar loads.
// fp32 rows keep scalar loads (straddling_weight<4> measured 2-9% slower for long odd fp32 rows), and so does the
// backward (no faster: it loads its weights once a block).
template <typename T, typename W, int NPT, int SPLIT>
__device__ constexpr bool straddles() {
    if (sizeof(T) != 2 || NPT == 1) return false;
    return sizeof(W) == 4 || NPT == 0 || SPLIT > 1;
}

// Weight bytes per thread loaded with x and kept in registers through the reduction: FWD_EARLY_BYTES for the plain
// forward's aligned vectorized rows, ADD_WORDS_EARLY_BYTES for the fused add's rows held as words,
// WEIGHT_EARLY_BYTES for the other fused-add rows and shifted rows (early, the fused add of converted elements
// spilled and ran 3x slower; shifted rows, which load the weight element by element, 5-10% slower). The other
// weights are loaded after the reduction, each right before its store. A weight load behind a store (which may
// alias it) waits for that store: late weights add a memory round trip a chunk to a row's chain, which single- and
// two-wave grids pay in full (early: bf16 [512, 16384] 15.3 -> 13.9 us).
constexpr int FWD_EARLY_BYTES = 64;
constexpr int WEIGHT_EARLY_BYTES = 16;
// Resident 512-thread blocks per SM asked of the compiler (register budget) by register slots: occupancy mattered
// more than keeping everything in registers in every measurement.
constexpr int FWD_MIN_BLOCKS_1 = 4;
constexpr int FWD_MIN_BLOCKS_2 = 3;
constexpr int FWD_MIN_BLOCKS_4 = 2;
// The fused add's: it holds x and residual, and at the forward's budgets its shifted rows spilled (24-48 bytes at
// 1-2 slots); one block fewer an SM measured up to 30% faster there. fp16/bf16 rows of 4 slots are aligned (the
// planner reads shifted ones twice: FWD_ADD_SHIFTED_MAX_SLOTS) and keep the forward's budget: half of it was 2-3%
// faster from 2048 rows but 4-9% slower at 512.
constexpr int ADD_MIN_BLOCKS_1 = 3;
constexpr int ADD_MIN_BLOCKS_2 = 2;
// The fused add's aligned fp16/bf16 rows of 2+ chunks a thread are held as words too (x's, then the rounded sums':
// see half_again), their weight loaded with x up to ADD_WORDS_EARLY_BYTES. Against holding converted elements with
// the weight loaded late, bf16 add_rms_norm on an H200: [32768, 4096] 271.7 -> 260.8 us, [16384, 8192] 278.8 ->
// 258.2, [8192, 7168] 127.8 -> 113.2, [64, 4096] 3.4 -> 2.2, [1, 4096] 2.1 -> 1.4 (the weight early: 0.3-0.6 us of
// that at 1-64 rows, 1-2% at large ones; 48 registers, none spilled; budgets of three blocks an SM measured the
// same).
constexpr int ADD_WORDS_EARLY_BYTES = 32;
// Chunks a thread loads at once in the loops over rows read twice (NPT == 0). The backward's take one: two spill
// at its 64 registers and measured up to 3x slower.
constexpr int TWO_PASS_CHUNKS = 2;

// Whether the forward loads a row's weight with x (see FWD_EARLY_BYTES). One chunk a thread (the
// planner's choice for small inputs): up to 32 bytes, but for the fused add of shifted rows (an fp32
// weight there spills at 32 registers).
template <typename W, bool VEC, int NPT, int E, bool ADD, bool SHIFT>
__device__ constexpr bool weight_early() {
    constexpr int bytes = NPT * E * (int)sizeof(W);
    if (NPT == 1 && !(ADD && SHIFT)) return bytes <= 32;
    if (ADD && VEC && !SHIFT && E == 8 && NPT >= 2) return bytes <= ADD_WORDS_EARLY_BYTES;  // held as words
    return bytes <= (VEC && !ADD && !SHIFT ? FWD_EARLY_BYTES : WEIGHT_EARLY_BYTES);
}

// Launch bounds by register slots. Blocks have at most 512 threads (rmsnorm_rows.py's MAX_WIDTH,
// FWD_BLOCK_THREADS), but rows of 4+ slots may have 1024 (FWD_MAX_WIDTH: long rows); those ask for
// half as many blocks, which leaves their register budget unchanged (the fp16/bf16 fused add's rows stay
// at 512 threads: FWD_MAX_WIDTH).
static_assert(FWD_MIN_BLOCKS_4 % 2 == 0, "FWD_MIN_BLOCKS_4 counts 512-thread blocks: even");
template <int NPT, bool ADD>
struct FwdBounds {
    static constexpr bool wide = NPT >= 4;
    static constexpr int threads = wide ? 1024 : 512;
    static constexpr int min_blocks = NPT == 1   ? (ADD ? ADD_MIN_BLOCKS_1 : FWD_MIN_BLOCKS_1)
                                      : NPT == 2 ? (ADD ? ADD_MIN_BLOCKS_2 : FWD_MIN_BLOCKS_2)
                                                 : FWD_MIN_BLOCKS_4 / (wide ? 2 : 1);  // NPT 0: 512 threads
};

// The sum of v over the row's threads and, SPLIT > 1 (rms_norm_fwd_split), over the cluster's blocks at the cluster's
// turn `turn` (the scratch of one row and the next: cluster_sum's barrier between them orders its reads before its
// writes). LANES: row_sum's.
template <int SPLIT, int LANES>
__device__ __forceinline__ float split_row_sum(float v, int width, float* scratch, ClusterSums<SPLIT, float>& cluster,
                                               unsigned turn) {
    return cluster_sum<SPLIT>(row_sum<LANES>(v, width, scratch, true), cluster, turn);
}

// Where row `row` of x, y, the residual (ADD) and the sum (OUT: residual_out, else the residual) start; HELD: as
// row_base's held pointers.
template <typename T>
struct FwdRowPointers {
    const T* x;
    T* y;
    T* residual;
    T* sum;
};
template <typename T, bool HELD, bool ADD, bool OUT, bool RUNS>
__device__ __forceinline__ FwdRowPointers<T> row_pointers(const NormParams& p, i64 row) {
    using Runs = NormRunsParams;
    const T* const x = row_base<HELD>(
        static_cast<const T*>(p.x) + (RUNS ? in_runs(p, row, p.x_stride, &Runs::x_outer) : row * p.x_stride));
    T* const y = row_base<HELD>(
        static_cast<T*>(p.y) + (RUNS ? in_runs(p, row, p.y_stride, &Runs::y_outer) : row * p.y_stride));
    T* const residual = ADD ? row_base<HELD>(static_cast<T*>(p.residual) + row * p.residual_stride) : nullptr;
    T* const sum = OUT ? row_base<HELD>(static_cast<T*>(p.residual_out) + row * p.residual_out_stride) : residual;
    return {x, y, residual, sum};
}

// Row `row` of rms_norm_fwd (SPLIT 1; threadIdx.y's row of the block), or of rms_norm_fwd_split (SPLIT > 1: p
// describes the block's part of the rows, in registers; cluster and turn: see there).
template <typename T, typename W, bool VEC, int NPT, bool ADD, bool SHIFT, int SPLIT, bool OUT, bool RUNS = false>
__device__ __forceinline__ void norm_row(const NormParams& p, i64 row, ClusterSums<SPLIT, float>& cluster,
                                         unsigned turn = 0) {
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
    // other choice measured slower there. Rows of 4+ chunks a thread rarely take 32 threads
    // or fewer, but that code still takes registers from the rest: vectorized ones (not the fused add) ran bf16
    // [512, 16384] 13.8 -> 14.1 us with lanes_sum (13.8 with the loop); element-by-element ones [512, 130] 1.78 ->
    // 1.85 (1.78 with the switch and the compare chain). The fused add of 4 chunks ran 373 -> 381 us with the loop.
    constexpr int LANES = ADD || NPT < 4 ? LANES_SKIP : VEC ? LANES_LOOP : LANES_JUMP;
    // Rows held as words (see half_of): a branch of its own, so that the words are what the loads produce and the
    // loop holds (the Pack path below with only its output converting from word_of(v[i], k) kept 54-56 registers).
    if constexpr (sizeof(T) == 2 && VEC && NPT >= 2 && (!ADD || !SHIFT)) {
        const auto [x_row, y_row, res_row, sum_row] = row_pointers<T, true, ADD, OUT, RUNS>(p, row);
        const int first = first_column<SHIFT, E>(x_row, lane), hidden = (int)p.hidden;
        unsigned words[NPT][4] = {};  // chunks outside the row stay 0 and add nothing to the sum
        unsigned residual_words[ADD ? NPT : 1][4];
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
                if constexpr (ADD) {
                    const Pack<T, E> r = load_chunk<VEC, SHIFT, E>(res_row, col, hidden);
#pragma unroll
                    for (int k = 0; k < 4; ++k) residual_words[ADD ? i : 0][k] = word_of(r, k);
                }
                if constexpr (EARLY) {
                    const Pack<W, E> w = load_weight_chunk<W, VEC, SHIFT, E, STRADDLE>(p.weight, col, hidden);
#pragma unroll
                    for (int k = 0; k < WEIGHT_WORDS; ++k) weight_words[EARLY ? i : 0][k] = word_of(w, k);
                }
            }
        }
        if constexpr (ADD) {  // the sums, rounded to T, replace x's words (every load above is issued)
#pragma unroll
            for (int i = 0; i < NPT; ++i) {
                const int col = first + i * step;
                if (active && col < hidden) {
                    Pack<T, E> sum;
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const unsigned r = residual_words[ADD ? i : 0][k];
                        words[i][k] = pair_of<T>(half_of<T>(words[i][k], false) + half_of<T>(r, false),
                                                 half_of<T>(words[i][k], true) + half_of<T>(r, true));
                        set_word(sum, k, words[i][k]);
                    }
                    store_chunk<VEC, SHIFT, E>(sum_row, col, hidden, sum);
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
        const float rstd = inverse_rms(split_row_sum<SPLIT, LANES>(sum_sq, width, scratch, cluster, turn), p.inv_hidden, p.eps);
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
        // Held row pointers (row_base) where they measured faster: rows moved element by element, and the fused
        // add of shifted rows, where the plain addressing spilled (up to 19% faster). Elsewhere they changed
        // nothing or were slower: 1% for the 2-chunk fused add, 11-14% for the fp32 fused add of 4+ chunks.
        constexpr bool HELD = !VEC || (ADD && NPT >= 2 && SHIFT);
        const auto [x_row, y_row, res_row, sum_row] = row_pointers<T, HELD, ADD, OUT, RUNS>(p, row);
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
                    store_chunk<VEC, SHIFT, E>(sum_row, col, hidden, v[i]);
                }
#pragma unroll
                for (int e = 0; e < E; ++e) squares.add(i * E + e, as_float<BY_SHIFT>(v[i].v[e]));
            }
        }
        sum_sq = squares.total();
        const float rstd = inverse_rms(split_row_sum<SPLIT, LANES>(sum_sq, width, scratch, cluster, turn), p.inv_hidden, p.eps);
        if (!active) return;
#pragma unroll
        for (int i = 0; i < NPT; ++i) {
            const int col = first + i * step;
            if (col < hidden) {
                if constexpr (!EARLY) w[i] = load_weight_chunk<W, VEC, SHIFT, E, STRADDLE>(p.weight, col, hidden);
                store_chunk<VEC, SHIFT, E>(y_row, col, hidden, output<T, W, VEC, E, BY_SHIFT>(p, v[i], rstd, w[i]));
            }
        }
        if (p.rstd && lane == 0) p.rstd[row] = rstd;
    } else {
        // Rows read twice. SHIFT: 16-byte chunks from the boundary before the row, the first and last
        // element by element (as above, with 64-bit columns). ADD: the new residual waits for the output
        // pass in the row cache, where the launch gave the block's rows (row_cache_bytes in the planner: each
        // row slot's chunks from c * E, chunks_span); else it is read back.
        extern __shared__ __align__(16) unsigned char row_cache_bytes[];
        const T* const x_row = static_cast<const T*>(p.x) + row * p.x_stride;
        T* const y_row = static_cast<T*>(p.y) + row * p.y_stride;
        T* const res_row = ADD ? static_cast<T*>(p.residual) + row * p.residual_stride : nullptr;
        T* const sum_row = OUT ? static_cast<T*>(p.residual_out) + row * p.residual_out_stride : res_row;
        const int shift = row_shift<SHIFT, E>(x_row);
        const i64 first = (i64)lane * E - shift, cache_row = chunks_span<SHIFT, E>(p.hidden);
        T* const row_cache = reinterpret_cast<T*>(row_cache_bytes) + threadIdx.y * cache_row + shift;
        const bool cached = ADD && dynamic_shared_bytes() >= blockDim.y * cache_row * sizeof(T);
        // U chunks a thread at a time: their loads issued together, then their arithmetic and stores.
        constexpr int U = TWO_PASS_CHUNKS;
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
                    store_chunk<VEC, SHIFT, E>(sum_row, col, p.hidden, v[u]);
                    if (cached) store_pack<VEC, E>(row_cache + col, v[u]);
                }
#pragma unroll
                for (int e = 0; e < E; ++e) sum_sq += to_float(v[u].v[e]) * to_float(v[u].v[e]);
            }
        }
        const float rstd = inverse_rms(row_sum(sum_sq, width, scratch, true), p.inv_hidden, p.eps);
        if (!active) return;
        if (p.rstd && lane == 0) p.rstd[row] = rstd;
        // With ADD, the normalized values are the rounded sums this thread just stored (sum_row). The
        // row cache holds what this thread summed: each thread reads back only its own columns, so no
        // barrier.
        const T* const src = ADD ? sum_row : x_row;
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

template <typename T, typename W, bool VEC, int NPT, bool ADD, bool SHIFT, bool OUT = false>
__global__ void __launch_bounds__(FwdBounds<NPT, ADD>::threads, FwdBounds<NPT, ADD>::min_blocks) rms_norm_fwd(const NormParams p) {
    wait_for_previous_grid();
    ClusterSums<1, float> no_cluster;  // unused: one block sums its rows
    norm_row<T, W, VEC, NPT, ADD, SHIFT, 1, OUT>(p, (i64)blockIdx.x * blockDim.y + threadIdx.y, no_cluster);
}

// rms_norm_fwd on rows in runs (row_in_runs), held in registers, without the fused add.
template <typename T, typename W, bool VEC, int NPT, bool SHIFT>
__global__ void __launch_bounds__(FwdBounds<NPT, false>::threads, FwdBounds<NPT, false>::min_blocks)
    rms_norm_fwd_runs(const NormRunsParams p) {
    static_assert(NPT > 0, "rows held in registers");
    wait_for_previous_grid();
    ClusterSums<1, float> no_cluster;
    norm_row<T, W, VEC, NPT, false, SHIFT, 1, false, true>(p, (i64)blockIdx.x * blockDim.y + threadIdx.y, no_cluster);
}

// Narrows the rows that `p` describes to this block's part when a cluster splits them (cluster_part; SHIFT: rows
// `shift` elements past a 16-byte boundary): its pointers moved to the part's first column, its length; inv_hidden
// stays the whole row's, and only the block holding column 0 writes rstd. (In place: a copy returned compiled the
// aligned split's loop differently.)
template <typename T, typename W, bool ADD, int SPLIT, bool SHIFT, bool OUT>
__device__ __forceinline__ void narrow_to_part(NormParams& p, int shift) {
    i64 offset;
    const i64 length = cluster_part<16 / sizeof(T), SPLIT, SHIFT>(p.hidden, offset, shift);
    p.x = static_cast<const T*>(p.x) + offset;
    p.y = static_cast<T*>(p.y) + offset;
    if (ADD) p.residual = static_cast<T*>(p.residual) + offset;
    if (OUT) p.residual_out = static_cast<T*>(p.residual_out) + offset;
    if (p.weight) p.weight = static_cast<const W*>(p.weight) + offset;
    p.hidden = length;
    if (offset) p.rstd = nullptr;
}

// Rows too long for one block's registers, which rms_norm_fwd reads twice (the planner splits fp32 ones: over 32768
// elements, the fused add's from 24576; fp16/bf16 from 65536; FWD_SPLIT_*) on clusters of SPLIT blocks (sm_90+), each
// walking rows (cluster, + clusters, ...: the grid is what the GPU holds at once, as a cluster waits for SPLIT free
// SMs of one GPC): the block of rank r holds columns [r * part, (r + 1) * part) of a row in registers, part = the
// row's 16-byte chunks / SPLIT rounded up (the last part may be shorter); only the sum of squares crosses blocks
// (cluster_sum, a turn a row). Rank 0 writes rstd. SHIFT (odd rows): each row's
// parts from its own shift (cluster_part), block 0's in shifted chunks, the others' from 16-byte boundaries.
template <typename T, typename W, int NPT, bool ADD, int SPLIT, bool SHIFT, bool OUT = false>
__global__ void CLUSTER_DIMS(SPLIT) __launch_bounds__(FwdBounds<NPT, ADD>::threads, FwdBounds<NPT, ADD>::min_blocks)
    rms_norm_fwd_split(const NormParams p) {
    wait_for_previous_grid();
#if CUPYROPE_CLUSTERS
    NormParams mine = p;  // the block's part of the rows (SHIFT: each row's own, below)
    narrow_to_part<T, W, ADD, SPLIT, false, OUT>(mine, 0);
    __shared__ ClusterSums<SPLIT, float> cluster;
    cluster_start(cluster);
    unsigned turn = 0;
#pragma unroll 1
    for (i64 row = blockIdx.x / SPLIT; row < p.rows; row += gridDim.x / SPLIT, ++turn) {
        if constexpr (SHIFT) {
            NormParams row_part = p;
            const int shift = row_shift<true, 16 / sizeof(T)>(static_cast<const T*>(p.x) + row * p.x_stride);
            narrow_to_part<T, W, ADD, SPLIT, true, OUT>(row_part, shift);
            norm_row<T, W, true, NPT, ADD, true, SPLIT, OUT>(row_part, row, cluster, turn);
        } else {
            norm_row<T, W, true, NPT, ADD, false, SPLIT, OUT>(mine, row, cluster, turn);
        }
    }
#else
    __trap();  // no clusters before sm_90: the planner never launches it there
#endif
}

}  // namespace cupyrope
