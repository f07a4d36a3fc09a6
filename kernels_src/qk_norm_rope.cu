// QK-norm + RoPE: for each head of q and of k, RMSNorm over head_dim with a per-feature weight (q_weight or
// k_weight), then the rotation, in one launch; and its backward.
//
// A block takes `tokens_per_block` tokens and computes their (token, frequency) cos/sin once into shared memory,
// as rope_kernel does (rope_common.cuh). A head is a row of G = group_threads threads (a power of two <= 32):
// the row's items -- rot_lanes rotating pairs (NEOX: two chunks, f0 and f0 + half; GPTJ: one interleaved chunk),
// then copy_lanes chunks past rot_dim, normalized but not rotated -- go to its threads as lane, lane + G, ...,
// at most MAX_ITEMS a thread, held in registers between the row's sum of squares and its stores. A row's sums
// run over its threads' items in item order, then a shuffle tree over the G threads: a row's result depends on
// its own data and (head_dim, dtype, alignment) only.
// Template parameters: W, the weights' element type (float or T); the others as in rope_common.cuh.
#include "rope_common.cuh"

namespace cupyrope {

// Blocks an SM must hold (the register budget), measured on an H200. The forward keeps two rows' loads in flight a
// thread (56-64 registers; 3 blocks: 10% slower; 5: as fast at 32K tokens, 0.2-0.4 us slower at decode). The
// backward holds one row's dy and x: 3 blocks an SM (80 registers, a few spills) beat 2 (with or without the next
// row loaded ahead) by 8-10%, and 4 (more spills) by 10-30%.
constexpr int FORWARD_MIN_BLOCKS = 4;
constexpr int BACKWARD_MIN_BLOCKS = 3;

template <bool VEC>
constexpr int MAX_ITEMS = VEC ? 1 : 4;  // qk_norm_rope_plan.py: MAX_ITEMS (registers: see the kernels)

// One chunk of a head row in its storage type. 16-byte chunks are held as the four 32-bit words their load
// produced: held as Packs of fp16/bf16 elements, the compiler kept 16-bit halves and re-paired them (a permute a
// half) whenever a row moved from the next pass's registers to the current one's.
template <typename T, int E, bool VEC>
struct Chunk {
    Pack<T, E> pk;
    __device__ __forceinline__ void load(const T* src) { pk = load_pack<VEC, E>(src); }
    __device__ __forceinline__ void set(int j, T v) { pk.v[j] = v; }
    __device__ __forceinline__ float at(int j) const { return to_float(pk.v[j]); }
};

// Half `high` of a 32-bit word of fp16/bf16 values as float (a bf16's high half is already its fp32 bits, masked).
// rmsnorm_common.cuh's half_of shifts a bf16's high half down and back up (two instructions a value where this takes
// one); its kernels were measured with that code and keep it.
template <typename T> __device__ __forceinline__ float word_half(unsigned w, bool high);
template <> __device__ __forceinline__ float word_half<__nv_bfloat16>(unsigned w, bool high) {
    return __uint_as_float(high ? w & 0xffff0000u : w << 16);
}
template <> __device__ __forceinline__ float word_half<__half>(unsigned w, bool high) {
    return __half2float(__ushort_as_half((unsigned short)(high ? w >> 16 : w)));
}

template <typename T, int E>
struct Chunk<T, E, true> {
    static constexpr int WORDS = E * (int)sizeof(T) / 4;
    static_assert(WORDS == 4, "16-byte chunks");
    unsigned w[WORDS];
    __device__ __forceinline__ void load(const T* src) {
        const uint4 u = *reinterpret_cast<const uint4*>(src);
        w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    }
    // Element j: word j (fp32), or half j % 2 of word j / 2 (fp16, bf16: the low half first).
    __device__ __forceinline__ float at(int j) const {
        if constexpr (sizeof(T) == 4) return __uint_as_float(w[j]);
        else return word_half<T>(w[j / 2], j % 2);
    }
};

// One head row's items in one thread.
template <typename T, int STYLE, bool VEC>
struct HeadItems {
    static constexpr int E = ELEMS<T, STYLE, VEC>, EC = COPY_ELEMS<T, VEC>, F = STYLE == NEOX ? E : E / 2;
    static constexpr int N = MAX_ITEMS<VEC>;
    Chunk<T, E, VEC> x1[N], x2[N];  // copy items: their EC elements first in x1

    // Loads item lane + m * G of the row at `in` for each m (those past the row's lanes are left alone).
    __device__ __forceinline__ void load(const RopeParams& p, const T* in, unsigned lane, unsigned G) {
        const unsigned rot_lanes = (unsigned)p.rot_lanes, lanes = rot_lanes + (unsigned)p.copy_lanes;
#pragma unroll
        for (int m = 0; m < N; ++m) {
            const unsigned i = lane + m * G;
            if (i >= lanes) continue;
            if (i < rot_lanes) {
                const i64 f0 = (i64)i * F;
                x1[m].load(in + (STYLE == NEOX ? f0 : 2 * f0));
                if constexpr (STYLE == NEOX) x2[m].load(in + f0 + p.rot_dim / 2);
            } else if constexpr (VEC) {  // a copy item is a whole chunk
                x1[m].load(in + p.rot_dim + (i64)(i - rot_lanes) * EC);
            } else {
                const Pack<T, EC> c = load_pack<VEC, EC>(in + p.rot_dim + (i64)(i - rot_lanes) * EC);
#pragma unroll
                for (int j = 0; j < EC; ++j) x1[m].set(j, c.v[j]);
            }
        }
    }
};

// The features item i covers: v1 from first1 (E of them, or EC for a copy item), NEOX's v2 from first2.
template <int STYLE, int E, int F, int EC>
__device__ __forceinline__ void item_features(const RopeParams& p, unsigned i, i64& first1, i64& first2) {
    if (i < (unsigned)p.rot_lanes) {
        const i64 f0 = (i64)i * F;
        first1 = STYLE == NEOX ? f0 : 2 * f0;
        first2 = f0 + p.rot_dim / 2;
    } else {
        first1 = p.rot_dim + (i64)(i - (unsigned)p.rot_lanes) * EC;
        first2 = 0;
    }
}

// (w + weight_offset) of the item's features, as v1 and v2 hold them, from the block's copy of a weight
// (stage_weights).
template <int STYLE, bool VEC, int E, int F, int EC>
__device__ __forceinline__ void item_weights(const RopeParams& p, const float* w, unsigned i, float (&w1)[E],
                                             float (&w2)[E]) {
    i64 first1, first2;
    item_features<STYLE, E, F, EC>(p, i, first1, first2);
#pragma unroll
    for (int j = 0; j < E; ++j) w1[j] = w2[j] = 0.f;
    if (i < (unsigned)p.rot_lanes) {
        const Pack<float, E> a = load_pack<VEC, E>(w + first1);
#pragma unroll
        for (int j = 0; j < E; ++j) w1[j] = a.v[j];
        if constexpr (STYLE == NEOX) {
            const Pack<float, E> b = load_pack<VEC, E>(w + first2);
#pragma unroll
            for (int j = 0; j < E; ++j) w2[j] = b.v[j];
        }
    } else {
        const Pack<float, EC> a = load_pack<VEC, EC>(w + first1);
#pragma unroll
        for (int j = 0; j < EC; ++j) w1[j] = a.v[j];
    }
}

// The block's copy of q_weight + weight_offset, then k_weight's, as floats: [2 * head_dim].
template <typename W>
__device__ __forceinline__ void stage_weights(const RopeParams& p, float* weights) {
    for (int j = threadIdx.x; j < 2 * p.head_dim; j += blockDim.x) {
        const W* w = static_cast<const W*>(j < p.head_dim ? p.q_weight : p.k_weight);
        weights[j] = to_float(w[j < p.head_dim ? j : j - p.head_dim]) + p.weight_offset;
    }
}

// The item's values as floats (v2: NEOX rotating items only; a copy item's v1 holds EC of them, the rest 0).
template <typename T, int STYLE, bool VEC, int E, int EC>
__device__ __forceinline__ void item_floats(const RopeParams& p, const Chunk<T, E, VEC>& x1,
                                            const Chunk<T, E, VEC>& x2, unsigned i, float (&v1)[E], float (&v2)[E]) {
    const bool rotating = i < (unsigned)p.rot_lanes;
#pragma unroll
    for (int j = 0; j < E; ++j) {
        v1[j] = rotating || j < EC ? x1.at(j) : 0.f;
        v2[j] = STYLE == NEOX && rotating ? x2.at(j) : 0.f;
    }
}

// Stores item i's values (a copy item: the first EC of v1).
template <typename T, int STYLE, bool VEC, int E, int F, int EC>
__device__ __forceinline__ void store_head_item(const RopeParams& p, unsigned i, const float (&v1)[E],
                                                const float (&v2)[E], T* out) {
    if (i < (unsigned)p.rot_lanes) {
        store_item<T, STYLE, VEC, E>(v1, v2, out, (i64)i * F, p.rot_dim / 2);
    } else {
        Pack<T, EC> y;
#pragma unroll
        for (int j = 0; j < EC; ++j) y.v[j] = from_float<T>(v1[j]);
        store_pack<VEC, EC>(out + p.rot_dim + (i64)(i - (unsigned)p.rot_lanes) * EC, y);
    }
}

// The cos/sin of item i's frequencies in the block's table (its token's row).
template <int STYLE, int F>
__device__ __forceinline__ void item_cos_sin(const RopeParams& p, const float* cos_sin, int t, unsigned i,
                                             Pack<float, F>& c, Pack<float, F>& s) {
    const float* cs = cos_sin + t * p.rot_dim + (i64)i * F;
    c = *reinterpret_cast<const Pack<float, F>*>(cs);
    s = *reinterpret_cast<const Pack<float, F>*>(cs + p.rot_dim / 2);
}

// The row (token of the block, head) of a block row index.
struct HeadRow {
    int t;
    unsigned h;
    bool is_q;
};

__device__ __forceinline__ HeadRow head_row(const RopeParams& p, unsigned row) {
    const unsigned n_heads = (unsigned)p.n_heads;
    const int t = (int)fast_div(row, p.div_lanes);  // qk_norm_rope_plan.py packs n_heads' divisor there
    const unsigned h = row - (unsigned)t * n_heads;
    return {t, h, h < (unsigned)p.n_q_heads};
}

// The mean over a row's head_dim features of terms whose sums over its items each of its G threads holds in v.
// LANES (common.cuh's LanesSum): the backward's shuffle tree is a loop of log2(G) steps, fewer instructions than the
// forward's steps skipped by G (the same additions in the same order: the same bits). Measured on an H200
// (Qwen3-8B): backward 8K tokens 91.5 -> 89.1 us, 32K 320.7 -> 310.4; the forward as fast either way at 8K-32K.
template <int LANES = LANES_SKIP>
__device__ __forceinline__ float row_mean(const RopeParams& p, float v, unsigned G) {
    return lanes_sum_by<LANES>(v, (int)G) * (1.f / (float)p.head_dim);  // a multiply: the reciprocal is invariant
}

// rsqrt(mean(x^2) + eps) of a row whose items' squares this thread summed into `squares`.
template <int LANES = LANES_SKIP>
__device__ __forceinline__ float row_rstd(const RopeParams& p, float squares, unsigned G) {
    return rsqrtf(row_mean<LANES>(p, squares, G) + p.eps);
}

// The sum of squares of this thread's items of a row.
template <typename T, int STYLE, bool VEC>
__device__ __forceinline__ float items_squares(const RopeParams& p, const HeadItems<T, STYLE, VEC>& x, unsigned lane,
                                               unsigned G, bool active) {
    using Items = HeadItems<T, STYLE, VEC>;
    constexpr int E = Items::E, EC = Items::EC;
    const unsigned lanes = (unsigned)(p.rot_lanes + p.copy_lanes);
    float squares = 0.f;
#pragma unroll
    for (int m = 0; m < Items::N; ++m) {
        const unsigned i = lane + m * G;
        if (!active || i >= lanes) continue;
        float v1[E], v2[E];
        item_floats<T, STYLE, VEC, E, EC>(p, x.x1[m], x.x2[m], i, v1, v2);
#pragma unroll
        for (int j = 0; j < E; ++j) squares += v1[j] * v1[j] + v2[j] * v2[j];
    }
    return squares;
}

template <typename T, typename W, typename C, typename P, int STYLE, bool VEC, bool CACHE>
__global__ void __launch_bounds__(BLOCK_THREADS, FORWARD_MIN_BLOCKS) qk_norm_rope_kernel(const RopeParams p) {
    using Items = HeadItems<T, STYLE, VEC>;
    constexpr int E = Items::E, EC = Items::EC, F = Items::F, N = Items::N;
    __shared__ BlockTokens bt;
    __shared__ double inv_freq[CACHE ? 1 : MAX_ROTARY_DIM / 2];
    extern __shared__ __align__(16) float cos_sin[];  // [tokens_per_block][rot_dim], then the weights
    float* weights = cos_sin + p.tokens_per_block * p.rot_dim;
    // The inverse frequencies come from the parameters alone: computed before the wait for the previous kernel,
    // they overlap its end under PDL (no global memory is touched before the wait).
    if constexpr (!CACHE) fill_inv_freq(p, inv_freq);
    wait_for_previous_grid();

    const unsigned first = blockIdx.x * (unsigned)p.tokens_per_block;
    const int count = (int)min((i64)p.tokens_per_block, p.n_tokens - first);
    const unsigned G = (unsigned)p.group_threads, lane = threadIdx.x & (G - 1);
    const unsigned rows = (unsigned)count * (unsigned)p.n_heads, step = blockDim.x / G;
    const unsigned lanes = (unsigned)(p.rot_lanes + p.copy_lanes);
    // A warp's groups go round the rows together (the shuffles): warp_row is the first row of the warp's pass.
    const unsigned warp_first = (threadIdx.x / 32) * (32 / G);
    // The first pass's loads go out before the positions and the cos/sin: at decode their round trips overlap.
    unsigned row = threadIdx.x / G;
    Items x;
    if (row < rows) {
        const HeadRow hr = head_row(p, row);
        i64 offset[4];
        token_offsets(p, first + hr.t, offset);
        x.load(p, static_cast<const T*>(head_of<T>(p, offset, hr.h, hr.t).in), lane, G);
    }
    load_block_tokens<P>(p, first, count, bt);
    stage_weights<W>(p, weights);
    __syncthreads();
    fill_cos_sin<C, P, CACHE>(p, count, bt, inv_freq, cos_sin);
    __syncthreads();
    // Each pass loads the next pass's row before it computes its own: two rows' loads in flight a thread.
    for (unsigned warp_row = warp_first; warp_row < rows; warp_row += step, row += step) {
        const bool active = row < rows;
        const HeadRow hr = head_row(p, active ? row : 0);
        const Item it = head_of<T>(p, bt.offset[hr.t], hr.h, hr.t);
        Items next;
        if (row + step < rows) {
            const HeadRow nr = head_row(p, row + step);
            next.load(p, static_cast<const T*>(head_of<T>(p, bt.offset[nr.t], nr.h, nr.t).in), lane, G);
        }
        const float rstd = row_rstd(p, items_squares(p, x, lane, G, active), G);
        const float* w = weights + (hr.is_q ? 0 : p.head_dim);
#pragma unroll
        for (int m = 0; m < N; ++m) {
            const unsigned i = lane + m * G;
            if (!active || i >= lanes) continue;
            float v1[E], v2[E], w1[E], w2[E];
            item_floats<T, STYLE, VEC, E, EC>(p, x.x1[m], x.x2[m], i, v1, v2);
            item_weights<STYLE, VEC, E, F, EC>(p, w, i, w1, w2);
#pragma unroll
            for (int j = 0; j < E; ++j) v1[j] = v1[j] * rstd * w1[j], v2[j] = v2[j] * rstd * w2[j];
            if (i < (unsigned)p.rot_lanes) {
                Pack<float, F> c, s;
                item_cos_sin<STYLE, F>(p, cos_sin, hr.t, i, c, s);
                rotate_floats<STYLE, E, F>(v1, v2, c, s);
            }
            store_head_item<T, STYLE, VEC, E, F, EC>(p, i, v1, v2, static_cast<T*>(it.out));
        }
        x = next;
    }
}

// A backward item: g = the inverse rotation of dy (cos_sin holds -sin: the plan sets inverse), n = x * rstd, and
// (w + offset), as item_floats lays them out.
template <typename T, int STYLE, bool VEC, int E>
__device__ __forceinline__ void backward_item(const RopeParams& p, const HeadItems<T, STYLE, VEC>& dy,
                                              const HeadItems<T, STYLE, VEC>& x, int m, unsigned i, float rstd,
                                              const float* w, const float* cos_sin, int t, float (&g1)[E], float (&g2)[E],
                                              float (&n1)[E], float (&n2)[E], float (&w1)[E], float (&w2)[E]) {
    using Items = HeadItems<T, STYLE, VEC>;
    constexpr int EC = Items::EC, F = Items::F;
    item_floats<T, STYLE, VEC, E, EC>(p, dy.x1[m], dy.x2[m], i, g1, g2);
    if (i < (unsigned)p.rot_lanes) {
        Pack<float, F> c, s;
        item_cos_sin<STYLE, F>(p, cos_sin, t, i, c, s);
        rotate_floats<STYLE, E, F>(g1, g2, c, s);
    }
    item_floats<T, STYLE, VEC, E, EC>(p, x.x1[m], x.x2[m], i, n1, n2);
#pragma unroll
    for (int j = 0; j < E; ++j) n1[j] *= rstd, n2[j] *= rstd;
    item_weights<STYLE, VEC, E, F, EC>(p, w, i, w1, w2);
}

// Where head row hr of a token starts in the forward's input (q_x or k_x), the token's rows starting at offset there
// (the backward's per-chunk table, beside BlockTokens' rows of dy and dx).
template <typename T>
__device__ __forceinline__ const T* forward_input_row(const RopeParams& p, const i64 (&offset)[2], const HeadRow& hr) {
    return hr.is_q ? static_cast<const T*>(p.q_x) + offset[0] + hr.h * p.q_x_s[3]
                   : static_cast<const T*>(p.k_x) + offset[1] + (hr.h - p.n_q_heads) * p.k_x_s[3];
}

// The backward: dy in q_in / k_in, the forward's inputs in q_x / k_x, dx out in q_out / k_out. Per row:
// g = the inverse rotation of dy, n = x * rstd, g_n = g * (w + offset), dx = rstd * (g_n - n * mean(g_n * n)),
// and dw += g * n. The grid is at most the blocks the GPU holds at once; block b takes token chunks b,
// b + gridDim.x, ... A thread adds its rows' g * n into shared slots of its own (a column of [SLOTS][blockDim.x]:
// one per q or k, half of a pair, item and element; a warp's accesses hit 32 banks), then, once, into sums by row
// group and feature, which go into partial[b] in group order; rms_norm_dw adds the partial rows in a fixed order.
// Deterministic: every addition's order follows from the grid. A chunk's tokens' row offsets in dy, dx (BlockTokens)
// and x (x_offset) are computed once a token, so a row's addresses are a table read and an add: computed a row (a
// token's coordinates by division, then 64-bit strides) they were a fifth of the row loop's instructions (H200,
// Qwen3-8B 32K tokens: 338.8 -> 320.7 us).
template <typename T, typename W, typename C, typename P, int STYLE, bool VEC, bool CACHE>
__global__ void __launch_bounds__(BLOCK_THREADS, BACKWARD_MIN_BLOCKS) qk_norm_rope_bwd_kernel(const RopeParams p) {
    wait_for_previous_grid();
    using Items = HeadItems<T, STYLE, VEC>;
    constexpr int E = Items::E, EC = Items::EC, F = Items::F, N = Items::N;
    __shared__ BlockTokens bt;                     // the chunk's tokens: their rows of dy (in) and dx (out)
    __shared__ i64 x_offset[MAX_BLOCK_TOKENS][2];  // and where their rows start in q_x and k_x
    __shared__ double inv_freq[CACHE ? 1 : MAX_ROTARY_DIM / 2];
    extern __shared__ __align__(16) float dynamic[];  // cos_sin [tokens_per_block][rot_dim], weights, sums
    float* cos_sin = dynamic;
    float* weights = cos_sin + p.tokens_per_block * p.rot_dim;
    const unsigned G = (unsigned)p.group_threads, lane = threadIdx.x & (G - 1);
    const unsigned step = blockDim.x / G, groups = step;
    const unsigned lanes = (unsigned)(p.rot_lanes + p.copy_lanes);
    const i64 width = 2 * p.head_dim;  // a group's sums: q's features, then k's
    constexpr int HALVES = STYLE == NEOX ? 2 : 1, PER_HEAD = HALVES * N * E, SLOTS = 2 * PER_HEAD;
    // [SLOTS][BLOCK_THREADS] (the planner's block): a slot's offset is then an immediate, not an address computed a row
    // and element; after the rows, the sums [groups][width]
    float* slots = weights + width;
#pragma unroll
    for (int k = 0; k < SLOTS; ++k) slots[k * BLOCK_THREADS + threadIdx.x] = 0.f;
    stage_weights<W>(p, weights);
    if constexpr (!CACHE) fill_inv_freq(p, inv_freq);

    const unsigned chunks = (unsigned)((p.n_tokens + p.tokens_per_block - 1) / p.tokens_per_block);
    const unsigned warp_first = (threadIdx.x / 32) * (32 / G);
    for (unsigned chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        const unsigned first = chunk * (unsigned)p.tokens_per_block;
        const int count = (int)min((i64)p.tokens_per_block, p.n_tokens - first);
        const unsigned rows = (unsigned)count * (unsigned)p.n_heads;
        __syncthreads();  // the previous chunk's tokens and cos/sin are read
        load_block_tokens<P>(p, first, count, bt);
        for (int t = threadIdx.x; t < count; t += blockDim.x) {  // once a token: a row's address is then two adds
            i64 coords[3];
            token_coords(p, first + t, coords);
            x_offset[t][0] = offset_of(coords, p.q_x_s), x_offset[t][1] = offset_of(coords, p.k_x_s);
        }
        __syncthreads();
        fill_cos_sin<C, P, CACHE>(p, count, bt, inv_freq, cos_sin);
        __syncthreads();
        unsigned row = threadIdx.x / G;
        for (unsigned warp_row = warp_first; warp_row < rows; warp_row += step, row += step) {
            const bool active = row < rows;
            const HeadRow hr = head_row(p, active ? row : 0);
            const Item it = head_of<T>(p, bt.offset[hr.t], hr.h, hr.t);  // dy in, dx out
            Items dy, x;
            if (active) {
                dy.load(p, static_cast<const T*>(it.in), lane, G);
                x.load(p, forward_input_row<T>(p, x_offset[hr.t], hr), lane, G);
            }
            const float rstd = row_rstd<LANES_LOOP>(p, items_squares(p, x, lane, G, active), G);
            const float* w = weights + (hr.is_q ? 0 : p.head_dim);
            float* my_slots = slots + (hr.is_q ? 0 : PER_HEAD) * BLOCK_THREADS + threadIdx.x;
            float gw1[N][E], gw2[N][E], n1[N][E], n2[N][E];  // g * (w + offset) and n, item by item
            float dot = 0.f;
#pragma unroll
            for (int m = 0; m < N; ++m) {
                const unsigned i = lane + m * G;
                if (!active || i >= lanes) continue;
                float g1[E], g2[E], w1[E], w2[E];
                backward_item<T, STYLE, VEC, E>(p, dy, x, m, i, rstd, w, cos_sin, hr.t, g1, g2, n1[m], n2[m], w1,
                                                   w2);
#pragma unroll
                for (int j = 0; j < E; ++j) {  // g and n are 0 where an item has no feature
                    my_slots[(m * E + j) * BLOCK_THREADS] += g1[j] * n1[m][j];
                    if constexpr (STYLE == NEOX) my_slots[((N + m) * E + j) * BLOCK_THREADS] += g2[j] * n2[m][j];
                    gw1[m][j] = g1[j] * w1[j], gw2[m][j] = g2[j] * w2[j];
                    dot += gw1[m][j] * n1[m][j] + gw2[m][j] * n2[m][j];
                }
            }
            const float mean_dot = row_mean<LANES_LOOP>(p, dot, G);
#pragma unroll
            for (int m = 0; m < N; ++m) {
                const unsigned i = lane + m * G;
                if (!active || i >= lanes) continue;
#pragma unroll
                for (int j = 0; j < E; ++j) {
                    gw1[m][j] = rstd * (gw1[m][j] - n1[m][j] * mean_dot);
                    gw2[m][j] = rstd * (gw2[m][j] - n2[m][j] * mean_dot);
                }
                store_head_item<T, STYLE, VEC, E, F, EC>(p, i, gw1[m], gw2[m], static_cast<T*>(it.out));
            }
        }
    }
    __syncthreads();
    float mine[SLOTS];
#pragma unroll
    for (int k = 0; k < SLOTS; ++k) mine[k] = slots[k * BLOCK_THREADS + threadIdx.x];
    __syncthreads();
    float* sums = slots + (threadIdx.x / G) * width;  // this group's row of [groups][width]
#pragma unroll
    for (int m = 0; m < N; ++m) {  // every feature of a group is one of its threads' items
        const unsigned i = lane + m * G;
        if (i >= lanes) continue;
        i64 first1, first2;
        item_features<STYLE, E, F, EC>(p, i, first1, first2);
        const bool rotating = i < (unsigned)p.rot_lanes;
#pragma unroll
        for (int kq = 0; kq < 2; ++kq) {
#pragma unroll
            for (int j = 0; j < E; ++j) {
                if (rotating || j < EC) sums[kq * p.head_dim + first1 + j] = mine[kq * PER_HEAD + m * E + j];
                if (STYLE == NEOX && rotating)
                    sums[kq * p.head_dim + first2 + j] = mine[kq * PER_HEAD + (N + m) * E + j];
            }
        }
    }
    __syncthreads();
    for (i64 col = threadIdx.x; col < width; col += blockDim.x) {
        float total = 0.f;
        for (unsigned g = 0; g < groups; ++g) total += slots[g * width + col];
        p.partial[blockIdx.x * width + col] = total;
    }
}

}  // namespace cupyrope
