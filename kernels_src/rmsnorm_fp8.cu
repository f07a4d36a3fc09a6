// RMSNorm with an FP8 (e4m3fn) output, for FP8-weight serving: y = quantize(x / sqrt(mean(x^2) + eps) * (w + offset)),
// and with ADD the fused residual add first (residual <- x + residual, rounded to T, is what is normalized).
// The normalized value v is the fp32 value rms_norm rounds to T; it is quantized as saturate(v / scale) with one
// rounding to e4m3 (to nearest even; +-Inf and finite values past +-448 saturate to +-448, NaN stays NaN, 0x7F).
// GROUP picks the scale:
//   STATIC_SCALE    the caller's one scale (p.scale, fp32 on the device);
//   TOKEN_SCALE     one a row, written to p.scales: max |v| over the row (bounded by *p.scale_ub when given) / 448;
//   64, 128         one per GROUP consecutive columns of a row (DeepSeek-V3's blocks), p.scales (rows, hidden / GROUP).
// A dynamic scale is at least MIN_SCALE, so that a row or group of zeros quantizes to zeros. Values are multiplied by
// the scale's reciprocal (a static scale's by one division, a dynamic one's by reciprocal_of), folded with rstd into
// one factor.
//
// Row layout as rmsnorm_common.cuh's, except that chunks are always E = 16 / sizeof(T) elements: VEC rows move them
// as 16-byte accesses (and 4- or 8-byte stores of y), the others element by element, so that a group of GROUP columns
// is GROUP / E consecutive lanes of one warp in every kind of row (the planner gives rows at least that many threads).
// NPT > 0: a thread's NPT chunks stay in registers between the passes; NPT == 0: long rows are read again for each
// pass (the sum of squares; with TOKEN_SCALE the row's maximum; the output), mostly from the L2.
#include "rmsnorm_common.cuh"

namespace cupyrope {

struct Fp8NormParams {  // mirrored by rmsnorm_fp8.py's TAIL (after the pointers)
    const void* x;
    void* y;                 // e4m3fn bytes
    void* residual;          // ADD: x + residual is written here, then normalized
    const void* weight;      // may be null: no weight
    const float* scale;      // STATIC_SCALE: the scale
    float* scales;           // dynamic: where the scales go
    const float* scale_ub;   // dynamic, may be null: the bound of the maximum a scale is computed from
    i64 rows, hidden;
    i64 x_stride, y_stride, residual_stride;
    float eps, offset;
    float inv_hidden;  // 1 / hidden, rounded to float (as rms_norm_fwd's)
};

constexpr int STATIC_SCALE = 0;
constexpr int TOKEN_SCALE = 1;
constexpr float E4M3_MAX = 448.f;
constexpr float MIN_SCALE = 1.f / (E4M3_MAX * 512.f);

// v as an e4m3fn byte, saturating (see above): what GPUs before sm_89 run, and the reference the kernel
// e4m3_encode checks against the hardware conversion.
__device__ __forceinline__ unsigned e4m3_by_software(float v) {
    const unsigned sign = (__float_as_uint(v) >> 24) & 0x80u;
    float a = fabsf(v);
    if (a != a) return 0x7fu;
    a = fminf(a, E4M3_MAX);
    if (a < 0.015625f) return sign | (unsigned)__float2int_rn(a * 512.f);  // subnormal steps of 2^-9 (8: 2^-6)
    unsigned bits = __float_as_uint(a);
    bits += 0x7ffffu + ((bits >> 20) & 1u);  // to 3 mantissa bits, nearest even (a carry moves the exponent)
    return sign | (((bits >> 23) - 120u) << 3) | ((bits >> 20) & 7u);
}

// Two values as e4m3fn bytes: low in bits 0-7, high in bits 8-15.
template <bool SOFTWARE = false>
__device__ __forceinline__ unsigned e4m3_pair(float low, float high) {
#if __CUDA_ARCH__ >= 890
    if constexpr (!SOFTWARE) {
        unsigned short pair;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(high), "f"(low));
        return pair;
    }
#endif
    return e4m3_by_software(low) | (e4m3_by_software(high) << 8);
}

// The maximum of v over the LANES consecutive lanes of a group (LANES a power of two up to 32, aligned in the warp).
// WHOLE_WARP: every lane of the warp calls it (a full-mask shuffle); else only the group's lanes do.
template <int LANES, bool WHOLE_WARP>
__device__ __forceinline__ float group_max(float v) {
    const unsigned lane = (threadIdx.x + threadIdx.y * blockDim.x) % 32;
    const unsigned mask = WHOLE_WARP || LANES == 32 ? 0xffffffffu : ((1u << LANES) - 1) << (lane / LANES * LANES);
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(mask, v, offset));
    return v;
}

// The sum and the maximum of (sum, m) over groups of `width` lanes (a power of two up to 32), to all of them: both
// shuffled under one test of each step (the sum's tree is lanes_sum's: the same bits).
__device__ __forceinline__ float2 lanes_sum_max(float sum, float m, int width) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        if (offset < width) {
            sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
        }
    }
    return make_float2(sum, m);
}

// A row's sum (row_sum's tree: the same bits) and maximum over its `width` threads, to all of them, with one barrier
// for both (as row_sum: every thread of the block calls it; scratch holds 64 floats; first_use as row_sum's). The
// warps' partials are combined by a shuffle tree, each lane reading one (tree_slot; a loop over the maxima in every
// lane took ~50 instructions a row).
__device__ __forceinline__ float2 row_sum_max(float sum, float m, int width, float* scratch, bool first_use) {
    if (width <= 32) return lanes_sum_max(sum, m, width);
    sum = group_sum<32>(sum);
    m = group_max<32, true>(m);
    const int warps = width / 32, lane = threadIdx.x % 32;
    float* const sums = scratch + threadIdx.y * warps;
    float* const maxima = scratch + 32 + threadIdx.y * warps;
    if (!first_use) __syncthreads();  // the previous row's partials may still be read
    if (lane == 0) {
        sums[threadIdx.x / 32] = sum;
        maxima[threadIdx.x / 32] = m;
    }
    __syncthreads();
    int group;
    const int slot = tree_slot(warps, lane, group);
    return lanes_sum_max(slot < warps ? sums[slot] : 0.f, slot < warps ? maxima[slot] : 0.f, group);
}

// A dynamic scale from the maximum |v| it covers and the bound of that maximum (scale_ub; none: Inf). amax is rstd
// times the maximum product x (w + offset): NaN where a row holding Inf has rstd 0, which counts as 0 (its normalized
// values are NaN, which no maximum counts, and zeros), not as the bound fminf would give.
__device__ __forceinline__ float scale_of(float amax, float bound) {
    return fmaxf(fminf(fmaxf(amax, 0.f), bound) / E4M3_MAX, MIN_SCALE);
}

// 1 / a dynamic scale, as what quantizes multiplies by: the hardware's reciprocal (within 1 ulp; 1 / Inf = 0), not a
// rounded division with its range check and slow path, which held a branch in each group (the output is checked
// within 2e-6 of the float64 quotient, where an FP8 rounding boundary lies that close). A scale is at least MIN_SCALE
// and its reciprocal at most 448 * 512: neither is subnormal, which the instruction would flush.
__device__ __forceinline__ float reciprocal_of(float scale) {
    float inverse;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inverse) : "f"(scale));
    return inverse;
}

// E elements of a row from column col (VEC: one 16-byte access; else element by element, 0 past the row's end). Not
// rmsnorm_common.cuh's load_chunk with its SHIFT edge test: that compiled these rows 20-25% longer (sass_digest).
template <bool VEC, int E, typename T>
__device__ __forceinline__ Pack<T, E> load_elems(const T* row, i64 col, i64 hidden) {
    if constexpr (VEC) {
        return load_pack<true, E>(row + col);
    } else {
        Pack<T, E> pk;
#pragma unroll
        for (int e = 0; e < E; ++e) pk.v[e] = col + e < hidden ? row[col + e] : from_float<T>(0.f);
        return pk;
    }
}

template <bool VEC, int E, typename T>
__device__ __forceinline__ void store_elems(T* row, i64 col, i64 hidden, const Pack<T, E>& pk) {
    if constexpr (VEC) {
        store_pack<true, E>(row + col, pk);
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e)
            if (col + e < hidden) row[col + e] = pk.v[e];
    }
}

// E quantized values from col as bytes: VEC one 4- or 8-byte store, else byte by byte within the row.
template <bool VEC, int E>
__device__ __forceinline__ void store_fp8(unsigned char* row, i64 col, i64 hidden, const float (&q)[E]) {
    unsigned words[E / 4];
#pragma unroll
    for (int k = 0; k < E / 4; ++k)
        words[k] = e4m3_pair(q[4 * k], q[4 * k + 1]) | (e4m3_pair(q[4 * k + 2], q[4 * k + 3]) << 16);
    if constexpr (VEC && E == 8) {
        store_words(row + col, make_uint2(words[0], words[1]));
    } else if constexpr (VEC) {
        *reinterpret_cast<unsigned*>(row + col) = words[0];
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e)
            if (col + e < hidden) row[col + e] = (unsigned char)(words[e / 4] >> (8 * (e % 4)));
    }
}

// Calls f(i, col, in_row) for each of a thread's NPT > 0 register slots of a row, col the slot's first column and
// in_row whether it lies in the row (every lane calls f as often: warp-wide shuffles may follow).
template <int NPT, int E, typename F>
__device__ __forceinline__ void for_slots(int lane, int width, i64 hidden, F f) {
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        const i64 col = (i64)(lane + i * width) * E;
        f(i, col, col < hidden);
    }
}

// Calls f(i, col) for a thread's chunks of a row: i its register slot (NPT > 0; 0 when read again), col its first
// column.
template <int NPT, int E, typename F>
__device__ __forceinline__ void for_chunks(int lane, int width, i64 hidden, F f) {
    if constexpr (NPT > 0) {
        for_slots<NPT, E>(lane, width, hidden, [f](int i, i64 col, bool in_row) {
            if (in_row) f(i, col);
        });
    } else {
        for (i64 col = (i64)lane * E; col < hidden; col += (i64)width * E) f(0, col);
    }
}

// Whether a block walks rows (the planner's grid then holds the blocks the GPU runs at once: rmsnorm_plan_fp8.py's
// walks_rows) and loads each thread's chunks of its next row while this one is reduced and quantized: rows of up to 2
// register slots without the fused add (whose residual store would have to wait for the next row's loads). One block
// a row left the row's chain (loads, reduction, weight loads, quantization, stores) exposed; walking with the next
// row in flight measured on an H200 (bf16, static scale) [32768, 4096] 77% -> 89% of copy bandwidth, [8192, 7168]
// 63% -> 83%, [4096, 4096] 64% -> 76%, groups of 128 [8192, 7168] 55% -> 61%; one scale a row (its products held)
// [32768, 4096] 133.6 -> 132.1 us, [8192, 7168] 71.7 -> 65.8. Rows of 4+ slots keep a block a row: holding two rows
// would spill.
template <int NPT, bool ADD>
__device__ constexpr bool prefetches_rows() {
    return NPT > 0 && NPT <= 2 && !ADD;
}

// Resident 512-thread blocks per SM asked of the compiler (its register budget): rows of up to 2 register slots 3
// (NPT 0 holds no row), 2 where the next row is in flight (56-63 registers), rows of 4+ slots hold more and keep the
// compiler's budget. 3 measured 15-18% faster than the compiler's own budget with dynamic scales (H200, bf16
// [32768, 4096] one scale a row 203 -> 173 us, groups of 128 188 -> 162) and the same with a static scale.
template <int NPT, bool ADD>
__device__ constexpr int fp8_min_blocks() {
    return prefetches_rows<NPT, ADD>() ? 2 : NPT <= 2 ? 3 : 1;
}

// With a static scale or groups, weights are loaded after the reduction, as each chunk is quantized: loaded with x and
// held through it, they measured 12-18% slower with a static scale (H200, bf16 [32768, 4096] 128 -> 152 us;
// [8192, 7168] 72 -> 85). One scale a row needs them in the first pass, for the row's maximum.
// WEIGHTED: p.weight is given. rms_norm_fp8 picks the instance at run time, so that no chunk selects between its
// weights and ones: a select a chunk measured 5% of the static kernel's time (H200, bf16 [32768, 4096] static
// 104.7 -> 99.4 us, groups of 128 148.9 -> 144.0, one scale a row 133.6 -> 130.8).
template <typename T, typename W, bool VEC, int NPT, bool ADD, int GROUP, bool WEIGHTED>
__device__ __forceinline__ void fp8_norm_rows(const Fp8NormParams& p, float* scratch) {
    constexpr int E = 16 / sizeof(T);
    static_assert(GROUP <= TOKEN_SCALE || (GROUP % E == 0 && GROUP / E <= 32), "a group: whole chunks of one warp");
    constexpr bool PREFETCH = prefetches_rows<NPT, ADD>();
    // One scale a row, rows held: the first pass's products x (w + offset) are held rather than x, so the output is
    // one multiply an element, with no second weight load, unpacking or offset add (H200, bf16: [32768, 4096]
    // 153.3 -> 133.6 us, [8192, 7168] 80.0 -> 71.7).
    constexpr bool HOLDS_PRODUCTS = NPT > 0 && GROUP == TOKEN_SCALE;
    // The scalars first, so that their loads overlap the row's.
    const float static_scale = GROUP == STATIC_SCALE ? *p.scale : 1.f;
    const float* const scale_ub = p.scale_ub;
    const float bound = GROUP != STATIC_SCALE && scale_ub ? *scale_ub : __int_as_float(0x7f800000);  // Inf
    const W* const weight = static_cast<const W*>(p.weight);
    const float weight_offset = WEIGHTED ? p.offset : 0.f;  // no weight: ones (below), and no offset
    const float inverse = 1.f / static_scale;  // STATIC_SCALE's 1 / scale
    const int lane = threadIdx.x, width = blockDim.x;
    const i64 grid_rows = (i64)gridDim.x * blockDim.y;

    // PREFETCH: a thread's chunks of row r, loaded while the row before is quantized.
    Held<T, E> ahead[PREFETCH ? NPT : 1];
    const auto load_ahead = [&](i64 r) {
        if (r >= p.rows) return;
        const T* const next_row = row_base<true>(static_cast<const T*>(p.x) + r * p.x_stride);
        for_chunks<PREFETCH ? NPT : 1, E>(lane, width, p.hidden, [&](int i, i64 col) {
            ahead[i].hold(load_elems<VEC, E>(next_row, col, p.hidden));
        });
    };
    if constexpr (PREFETCH) load_ahead((i64)blockIdx.x * blockDim.y + threadIdx.y);

    // The loop bound is uniform across the block (the reductions contain barriers).
    bool first_row = true;
    for (i64 base = (i64)blockIdx.x * blockDim.y; base < p.rows; base += grid_rows) {
        const i64 row = base + threadIdx.y;
        const bool active = row < p.rows;  // inactive threads still join the row reductions
        const i64 hidden = active ? p.hidden : 0;  // no chunks
        const T* const x_row = row_base<true>(static_cast<const T*>(p.x) + row * p.x_stride);
        T* const res_row = ADD ? row_base<true>(static_cast<T*>(p.residual) + row * p.residual_stride) : nullptr;
        const T* const src = ADD ? res_row : x_row;  // what is normalized
        unsigned char* const y_row = row_base<true>(static_cast<unsigned char*>(p.y) + row * p.y_stride);
        float* const scales_row = GROUP > TOKEN_SCALE ? row_base<true>(p.scales + row * (p.hidden / GROUP)) : nullptr;

        // The weight's chunk at col: ones without a weight, so that its scale is one multiply whatever is given.
        const auto weight_chunk = [&](i64 col) {
            if constexpr (WEIGHTED) return load_elems<VEC, E>(weight, col, hidden);
            else return filled<W, E>(1.f);
        };
        const auto chunk_max = [](const float (&v)[E]) {
            float m = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) m = fmaxf(m, fabsf(v[e]));
            return m;
        };

        Held<T, E> held[NPT > 0 && !HOLDS_PRODUCTS ? NPT : 1];
        float products[HOLDS_PRODUCTS ? NPT : 1][E];  // x (w + offset), which the output only scales
        float sum_sq = 0.f;
        float xw_max = 0.f;  // TOKEN_SCALE: max |x (w + offset)|, which rstd > 0 scales to the row's max |v|
        for_chunks<NPT, E>(lane, width, hidden, [&](int i, i64 col) {
            Held<T, E> v;
            if constexpr (PREFETCH) {
                v = ahead[i];
            } else {
                Pack<T, E> pk = load_elems<VEC, E>(x_row, col, hidden);
                if constexpr (ADD) {
                    const Pack<T, E> r = load_elems<VEC, E>(res_row, col, hidden);
#pragma unroll
                    for (int e = 0; e < E; ++e) pk.v[e] = from_float<T>(to_float(pk.v[e]) + to_float(r.v[e]));
                    store_elems<VEC, E>(res_row, col, hidden, pk);
                }
                v.hold(pk);
            }
            if constexpr (NPT > 0 && !HOLDS_PRODUCTS) held[i] = v;
#pragma unroll
            for (int e = 0; e < E; ++e) sum_sq = fmaf(v.at(e), v.at(e), sum_sq);
            if constexpr (GROUP == TOKEN_SCALE) {
                const Pack<W, E> w = weight_chunk(col);
                float xw[E];
#pragma unroll
                for (int e = 0; e < E; ++e) xw[e] = v.at(e) * (as_float<true>(w.v[e]) + weight_offset);
                xw_max = fmaxf(xw_max, chunk_max(xw));
                if constexpr (HOLDS_PRODUCTS) {
#pragma unroll
                    for (int e = 0; e < E; ++e) products[i][e] = xw[e];
                }
            }
        });
        if constexpr (PREFETCH) load_ahead(row + grid_rows);
        float rstd, row_inverse = inverse;  // row_inverse: 1 / the row's scale (STATIC_SCALE, TOKEN_SCALE)
        if constexpr (GROUP == TOKEN_SCALE) {  // the row's sum and maximum in one reduction
            const float2 reduced = row_sum_max(sum_sq, xw_max, width, scratch, first_row);
            rstd = inverse_rms(reduced.x, p.inv_hidden, p.eps);
            const float scale = scale_of(rstd * reduced.y, bound);
            if (active && lane == 0) p.scales[row] = scale;
            row_inverse = reciprocal_of(scale);
        } else {
            rstd = inverse_rms(row_sum(sum_sq, width, scratch, first_row), p.inv_hidden, p.eps);
        }
        first_row = false;

        // Chunk (i, col)'s products x (w + offset) times coef: with coef = rstd, the normalized values as rms_norm
        // computes them before its rounding; with the row's 1 / scale folded into coef, their quantized values; with
        // coef = 1 (groups), the products, which the group's scale and rstd then multiply.
        const auto normalized = [&](int i, i64 col, float coef, float (&v)[E]) {
            if constexpr (HOLDS_PRODUCTS) {
#pragma unroll
                for (int e = 0; e < E; ++e) v[e] = products[i][e] * coef;
                return;
            }
            Held<T, E> s;
            if constexpr (NPT > 0) s = held[i];
            else s.hold(load_elems<VEC, E>(src, col, hidden));
            const Pack<W, E> w = weight_chunk(col);
#pragma unroll
            for (int e = 0; e < E; ++e) v[e] = s.at(e) * coef * (as_float<true>(w.v[e]) + weight_offset);
        };

        // A row's scale is folded into the coefficient. A group's maximum is taken over the products x (w + offset),
        // which rstd > 0 scales to the maximum of its normalized values (the same bits: rounding is monotone), and
        // its scale is folded into rstd (one multiply an element, not two).
        const float coef = GROUP > TOKEN_SCALE ? 1.f : rstd * row_inverse;
        // Chunk (i, col) quantized and stored. in_row false: a slot past the row, which joins its group's maximum
        // (zeros) and stores nothing.
        const auto quantize = [&](int i, i64 col, bool in_row) {
            float v[E] = {};
            if (in_row) normalized(i, col, coef, v);
            if constexpr (GROUP > TOKEN_SCALE) {  // the group's lanes are all here: a group lies in the row or past it
                const float scale = scale_of(rstd * group_max<GROUP / E, (NPT > 0)>(chunk_max(v)), bound);
                if (!in_row) return;
                if (col % GROUP == 0) scales_row[col / GROUP] = scale;
                const float group_coef = rstd * reciprocal_of(scale);
#pragma unroll
                for (int e = 0; e < E; ++e) v[e] *= group_coef;
            }
            store_fp8<VEC, E>(y_row, col, hidden, v);
        };
        if constexpr (GROUP > TOKEN_SCALE && NPT > 0) {
            // Every lane takes part in each slot's group maximum, so that its shuffles are the whole warp's: with the
            // group's lanes as the mask, under the slot's branch, each compiled to a shuffle in a collective region
            // (H200, bf16 groups of 128: [32768, 4096] 144.0 -> 141.9 us, [4096, 4096] 20.7 -> 19.9).
            for_slots<NPT, E>(lane, width, hidden, quantize);
        } else {
            for_chunks<NPT, E>(lane, width, hidden, [&](int i, i64 col) { quantize(i, col, true); });
        }
        if constexpr (!PREFETCH) break;  // the grid has a block for each of the rows' slots
    }
}

template <typename T, typename W, bool VEC, int NPT, bool ADD, int GROUP>
__global__ void __launch_bounds__(512, (fp8_min_blocks<NPT, ADD>())) rms_norm_fp8(const Fp8NormParams p) {
    wait_for_previous_grid();
    __shared__ float scratch[64];  // row_sum_max's sums and maxima
    if (p.weight) fp8_norm_rows<T, W, VEC, NPT, ADD, GROUP, true>(p, scratch);
    else fp8_norm_rows<T, W, VEC, NPT, ADD, GROUP, false>(p, scratch);
}

// The e4m3 conversion on its own, for the tests: y[i] = the byte of x[i], by the hardware's conversion (sm_89+) or
// with SOFTWARE by e4m3_by_software (what older GPUs run), so that both can be checked on one GPU.
struct EncodeParams {  // mirrored by the test's launch
    const float* x;
    unsigned char* y;
    i64 n;
};

template <bool SOFTWARE>
__global__ void e4m3_encode(const EncodeParams p) {
    const i64 i = 2 * ((i64)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= p.n) return;
    const unsigned pair = e4m3_pair<SOFTWARE>(p.x[i], i + 1 < p.n ? p.x[i + 1] : 0.f);
    p.y[i] = (unsigned char)pair;
    if (i + 1 < p.n) p.y[i + 1] = (unsigned char)(pair >> 8);
}

}  // namespace cupyrope
