// Rotary position embedding (RoPE) for q and k in one launch.
//
// A block takes `tokens_per_block` tokens. Phase 1: every (token, frequency) cos/sin of those tokens
// is computed (or read from the cache) exactly once, into shared memory. Phase 2: the block's threads
// stream independent items (token, head, lane) -- all q heads, then all k heads -- each item one
// 16-byte chunk of a head (or one pair when scalar), several items in flight per thread.
// Small calls (decode) and calls with a cos/sin cache (pack-aligned: rope_plan.py) take rope_direct_kernel
// instead: one item a thread, no shared memory (see there).
// Template parameters pick the variant:
//   T      element type of q/k (float, __half, __nv_bfloat16)
//   C      element type of the cos/sin cache (float or T; unused without CACHE)
//   P      position type (int or long long), or TokenRows: cos and sin come as two tensors holding
//          each token's own row (transformers' per-token cos/sin), found with the strides that
//          otherwise locate a token's position; no position is read (see cached_cos_sin)
//   STYLE  NEOX (pairs i, i + r/2) or GPTJ (pairs 2i, 2i + 1)
//   VEC    16-byte accesses (the planner checked alignment) or scalar accesses
//   CACHE  cos/sin from a vLLM-layout cache [max_position, rot_dim] (cos half, then sin half) or, with
//          TokenRows, from the cos and sin tensors; or computed in the kernel from theta, exactly to
//          fp32 rounding.
#include "common.cuh"

namespace cupyrope {

constexpr int NEOX = 0;
constexpr int GPTJ = 1;
// Items a thread of the block kernel loads before its first store: one measured fastest (the block's many threads
// keep enough loads in flight).
constexpr int UNROLL = 1;
constexpr int MIN_BLOCKS = 6;  // blocks of the block kernel per SM the register budget must allow
constexpr int BLOCK_THREADS = 256;
constexpr int DIRECT_MAX_THREADS = 256;  // the most threads a block a launch profile's direct_threads may ask for
constexpr int MAX_BLOCK_TOKENS = 64;  // rope_plan.py keeps tokens_per_block * rot_dim * 4 bytes <= 32 KiB
constexpr int MAX_ROTARY_DIM = 1024;  // rope_checks.py checks it

struct TokenRows {};  // the position type of the variants reading per-token cos and sin tensors
template <typename P> constexpr bool TOKEN_ROWS = false;
template <> constexpr bool TOKEN_ROWS<TokenRows> = true;

struct RopeParams {  // mirrored by rope_plan.py's _TAIL (all 8-byte fields: no padding)
    const void* q_in;
    void* q_out;
    const void* k_in;
    void* k_out;
    union { const void* positions; const void* cos; };  // cos: TokenRows variants
    union { const void* cache; const void* sin; };      // sin: TokenRows variants
    // What the direct kernel reads on its way to the position load comes first: few constant-cache lines.
    i64 n_tokens;  // < 2^32 (rope_plan.py checks): token indices are 32-bit
    i64 n1, n2;    // sizes of the two inner token dimensions (the outer one is implied)
    i64 pos_s[3];  // TokenRows: the element strides of the token dimensions in cos and in sin
    // Divisors of the direct kernel's index math as (magic | shift << 32), see fast_div: items a token
    // (heads x lanes), the two inner token dimensions, lanes a head.
    i64 div_token_items, div_n2, div_n1, div_lanes;
    i64 q_in_s[4], q_out_s[4], k_in_s[4], k_out_s[4];  // element strides: 3 token dims, then heads
    union { i64 cache_stride; i64 freq_stride; };  // freq_stride: TokenRows, between frequencies in cos/sin
    i64 max_position;
    i64 n_q_heads, n_heads, tokens_per_block;
    i64 rot_dim, rot_lanes, copy_lanes;  // copy_lanes: lanes copying features past rot_dim (0 in place)
    double log_step;  // ln(theta) * -2 / rot_dim: inv_freq(f) = exp(f * log_step)
    i64 inverse;
};

// n / d for n < 2^31 with d's (magic, shift) from rope_plan.py's fast_divisor: a multiply, an add and a
// shift where a 32-bit division by a run-time value costs ~20 dependent instructions. The direct
// kernel's index math comes before its first load.
__device__ __forceinline__ unsigned fast_div(unsigned n, i64 divisor) {
    return (__umulhi(n, (unsigned)divisor) + n) >> (unsigned)(divisor >> 32);
}

// cos/sin of pos * inv_freq (inv_freq = theta^(-2f/rot_dim) in double), equal to the exact values to
// fp32 rounding at any position up to 2^24: angle and range reduction in double (2*pi split in two
// parts), then fp32 sincosf on the reduced angle plus a first-order correction for the part of it
// that fp32 cannot hold.
__device__ __forceinline__ void exact_sincos(i64 pos, double inv_freq, float& s, float& c) {
    const double angle = (double)pos * inv_freq;
    const double turns = rint(angle * 0.15915494309189535);
    double r = fma(-turns, 6.283185307179586, angle);
    r = fma(-turns, 2.4492935982947064e-16, r);
    const float r_hi = (float)r;
    const float r_lo = (float)(r - (double)r_hi);
    float s_hi, c_hi;
    sincosf(r_hi, &s_hi, &c_hi);
    s = fmaf(c_hi, r_lo, s_hi);
    c = fmaf(-s_hi, r_lo, c_hi);
}

struct BlockTokens {  // per token of the block: where its rows start in q_in, q_out, k_in, k_out
    i64 offset[MAX_BLOCK_TOKENS][4];
    i64 position[MAX_BLOCK_TOKENS];
};

// Where token `token`'s rows start in q_in, q_out, k_in, k_out, and its position (TokenRows: where its
// row starts in cos and sin).
template <typename P, bool FAST = false>
__device__ __forceinline__ i64 token_rows(const RopeParams& p, unsigned token, i64 (&offset)[4]) {
    // 32-bit index math: a 64-bit division would dominate the kernel's registers.
    const unsigned n1 = (unsigned)p.n1, n2 = (unsigned)p.n2;
    i64 t0, t1, t2;
    if constexpr (FAST) {
        const unsigned rest = fast_div(token, p.div_n2), outer = fast_div(rest, p.div_n1);
        t2 = token - rest * n2, t1 = rest - outer * n1, t0 = outer;
    } else {
        const unsigned rest = token / n2;
        t2 = token - rest * n2, t1 = rest % n1, t0 = rest / n1;
    }
    offset[0] = t0 * p.q_in_s[0] + t1 * p.q_in_s[1] + t2 * p.q_in_s[2];
    offset[1] = t0 * p.q_out_s[0] + t1 * p.q_out_s[1] + t2 * p.q_out_s[2];
    offset[2] = t0 * p.k_in_s[0] + t1 * p.k_in_s[1] + t2 * p.k_in_s[2];
    offset[3] = t0 * p.k_out_s[0] + t1 * p.k_out_s[1] + t2 * p.k_out_s[2];
    const i64 at = t0 * p.pos_s[0] + t1 * p.pos_s[1] + t2 * p.pos_s[2];
    if constexpr (TOKEN_ROWS<P>) return at;
    else return (i64) static_cast<const P*>(p.positions)[at];
}

template <typename P>
__device__ __forceinline__ void load_block_tokens(const RopeParams& p, unsigned first, int count, BlockTokens& bt) {
    for (int t = threadIdx.x; t < count; t += blockDim.x) bt.position[t] = token_rows<P>(p, first + t, bt.offset[t]);
}

// The cache's F cos and F sin of frequencies f0.. at pos (vLLM layout: cos half, then sin half), as two packs
// where VEC (the planner checked the cache's alignment: a bf16 cache's 16 two-byte loads of a 16-byte item cost
// up to 0.2 us at decode). A position out of range reads row 0 (the checks make sure the cache has one) and its
// values become NaN (documented): loading a valid row and selecting afterwards keeps the loads free of a branch on
// the position, up to 0.1 us faster at decode.
template <typename C, int F, bool VEC>
__device__ __forceinline__ void cache_cos_sin(const RopeParams& p, i64 pos, i64 f0, i64 half, Pack<float, F>& c,
                                              Pack<float, F>& s) {
    const bool in_range = pos >= 0 && pos < p.max_position;
    const C* row = static_cast<const C*>(p.cache) + (in_range ? pos : 0) * p.cache_stride;
    const Pack<C, F> cc = load_pack<VEC, F>(row + f0), ss = load_pack<VEC, F>(row + half + f0);
    const float nan = __int_as_float(0x7fc00000);
#pragma unroll
    for (int i = 0; i < F; ++i) {
        c.v[i] = in_range ? to_float(cc.v[i]) : nan;
        s.v[i] = in_range ? to_float(ss.v[i]) : nan;
    }
}

// The cos/sin of frequency f at pos: from the cache, or TokenRows: pos is where the token's row starts in
// cos and sin (in range by construction: the shapes were checked).
template <typename C, typename P>
__device__ __forceinline__ void cached_cos_sin(const RopeParams& p, i64 pos, int f, int half, float& c, float& s) {
    if constexpr (TOKEN_ROWS<P>) {
        const i64 at = pos + f * p.freq_stride;
        c = to_float(static_cast<const C*>(p.cos)[at]);
        s = to_float(static_cast<const C*>(p.sin)[at]);
    } else {
        Pack<float, 1> cp, sp;
        cache_cos_sin<C, 1, false>(p, pos, f, half, cp, sp);
        c = cp.v[0], s = sp.v[0];
    }
}

// theta^(-2f/rot_dim) in double as exp(f * log_step): as accurate as pow (exp's 1 ulp plus the
// rounding of f * log_step, both far below fp32's resolution of the angle) at a third of the work.
__device__ __forceinline__ double inv_freq_of(const RopeParams& p, int f) { return exp((double)f * p.log_step); }

// cos_sin[t * rot_dim + f] = cos, cos_sin[t * rot_dim + rot_dim/2 + f] = sin (sin negated if inverse).
template <typename C, typename P, bool CACHE>
__device__ __forceinline__ void fill_cos_sin(const RopeParams& p, int count, const BlockTokens& bt,
                                             const double* inv_freq, float* cos_sin) {
    const int half = (int)p.rot_dim / 2;
    for (int j = threadIdx.x; j < count * half; j += blockDim.x) {
        const int t = j / half, f = j - t * half;
        const i64 pos = bt.position[t];
        float c, s;
        if constexpr (CACHE) {
            cached_cos_sin<C, P>(p, pos, f, half, c, s);
        } else {
            exact_sincos(pos, inv_freq[f], s, c);
        }
        cos_sin[t * p.rot_dim + f] = c;
        cos_sin[t * p.rot_dim + half + f] = p.inverse ? -s : s;
    }
}

// Item -> (token of the block, head, lane); head < n_q_heads is a q head, else a k head.
struct Item {
    const void* in;
    void* out;
    int token;
};

// Head h of a token whose rows start at offset (token_rows): a q head, or k head h - n_q_heads.
template <typename T>
__device__ __forceinline__ Item head_of(const RopeParams& p, const i64 (&offset)[4], i64 h, int t) {
    const bool is_q = h < p.n_q_heads;
    const i64 kh = h - p.n_q_heads;
    const T* in = is_q ? static_cast<const T*>(p.q_in) + offset[0] + h * p.q_in_s[3]
                       : static_cast<const T*>(p.k_in) + offset[2] + kh * p.k_in_s[3];
    T* out = is_q ? static_cast<T*>(p.q_out) + offset[1] + h * p.q_out_s[3]
                  : static_cast<T*>(p.k_out) + offset[3] + kh * p.k_out_s[3];
    return {in, out, t};
}

template <typename T>
__device__ __forceinline__ Item locate(const RopeParams& p, const BlockTokens& bt, unsigned item, unsigned lanes,
                                       unsigned& lane) {
    const unsigned row = item / lanes;
    lane = item - row * lanes;
    const unsigned n_heads = (unsigned)p.n_heads;
    const int t = (int)(row / n_heads);
    const i64 h = row - (unsigned)t * n_heads;
    return head_of<T>(p, bt.offset[t], h, t);
}

// Rotates one item's pairs by (c, s) and stores it: x1 holds features f0.. (NEOX: x2 those at f0 + half);
// GPTJ: x1 holds the pairs of frequencies f0.. interleaved.
template <typename T, int STYLE, bool VEC, int E, int F>
__device__ __forceinline__ void rotate_store(const Pack<T, E>& x1, const Pack<T, E>& x2, const Pack<float, F>& c,
                                             const Pack<float, F>& s, T* out, i64 f0, i64 half) {
    Pack<T, E> y1, y2;
    if constexpr (STYLE == NEOX) {
#pragma unroll
        for (int i = 0; i < E; ++i) {
            const float v1 = to_float(x1.v[i]), v2 = to_float(x2.v[i]);
            y1.v[i] = from_float<T>(v1 * c.v[i] - v2 * s.v[i]);
            y2.v[i] = from_float<T>(v2 * c.v[i] + v1 * s.v[i]);
        }
        store_pack<VEC, E>(out + f0, y1);
        store_pack<VEC, E>(out + f0 + half, y2);
    } else {
#pragma unroll
        for (int i = 0; i < F; ++i) {
            const float even = to_float(x1.v[2 * i]), odd = to_float(x1.v[2 * i + 1]);
            y1.v[2 * i] = from_float<T>(even * c.v[i] - odd * s.v[i]);
            y1.v[2 * i + 1] = from_float<T>(odd * c.v[i] + even * s.v[i]);
        }
        store_pack<VEC, E>(out + 2 * f0, y1);
    }
}

template <typename T, int STYLE, bool VEC, int E>
__device__ __forceinline__ void rotate_items(const RopeParams& p, const BlockTokens& bt, const float* cos_sin,
                                             unsigned items) {
    constexpr int F = STYLE == NEOX ? E : E / 2;  // frequencies per item
    const unsigned lanes = (unsigned)p.rot_lanes;
    const i64 half = p.rot_dim / 2;
#pragma unroll 1
    for (unsigned base = threadIdx.x; base < items; base += UNROLL * blockDim.x) {
        Pack<T, E> x1[UNROLL], x2[UNROLL];
        Item it[UNROLL];
        i64 f0[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const unsigned item = base + u * blockDim.x;
            if (item < items) {
                unsigned lane;
                it[u] = locate<T>(p, bt, item, lanes, lane);
                f0[u] = (i64)lane * F;
                const T* in = static_cast<const T*>(it[u].in);
                x1[u] = load_pack<VEC, E>(in + (STYLE == NEOX ? f0[u] : 2 * f0[u]));
                if constexpr (STYLE == NEOX) x2[u] = load_pack<VEC, E>(in + f0[u] + half);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (base + u * blockDim.x >= items) continue;
            const float* cs = cos_sin + it[u].token * p.rot_dim + f0[u];
            const Pack<float, F> c = *reinterpret_cast<const Pack<float, F>*>(cs);
            const Pack<float, F> s = *reinterpret_cast<const Pack<float, F>*>(cs + half);
            rotate_store<T, STYLE, VEC, E, F>(x1[u], x2[u], c, s, static_cast<T*>(it[u].out), f0[u], half);
        }
    }
}

// Out of place with rot_dim < head_dim: features past rot_dim are copied unchanged.
template <typename T, bool VEC, int EC>
__device__ __forceinline__ void copy_items(const RopeParams& p, const BlockTokens& bt, unsigned items) {
    const unsigned lanes = (unsigned)p.copy_lanes;
#pragma unroll 1
    for (unsigned base = threadIdx.x; base < items; base += UNROLL * blockDim.x) {
        Pack<T, EC> v[UNROLL];
        T* out[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const unsigned item = base + u * blockDim.x;
            if (item < items) {
                unsigned lane;
                const Item it = locate<T>(p, bt, item, lanes, lane);
                const i64 offset = p.rot_dim + (i64)lane * EC;
                v[u] = load_pack<VEC, EC>(static_cast<const T*>(it.in) + offset);
                out[u] = static_cast<T*>(it.out) + offset;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (base + u * blockDim.x < items) store_pack<VEC, EC>(out[u], v[u]);
    }
}

template <typename T, int STYLE, bool VEC>
constexpr int ELEMS = VEC ? 16 / sizeof(T) : (STYLE == GPTJ ? 2 : 1);  // elements per access
template <typename T, bool VEC>
constexpr int COPY_ELEMS = VEC ? 16 / sizeof(T) : 1;  // elements per copy access

template <typename T, typename C, typename P, int STYLE, bool VEC, bool CACHE>
__global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS) rope_kernel(const RopeParams p) {
    wait_for_previous_grid();
    constexpr int E = ELEMS<T, STYLE, VEC>, EC = COPY_ELEMS<T, VEC>;
    __shared__ BlockTokens bt;
    __shared__ double inv_freq[CACHE ? 1 : MAX_ROTARY_DIM / 2];
    extern __shared__ __align__(16) float cos_sin[];  // [tokens_per_block][rot_dim]

    const unsigned first = blockIdx.x * (unsigned)p.tokens_per_block;
    const int count = (int)min((i64)p.tokens_per_block, p.n_tokens - first);
    if constexpr (!CACHE) {
        for (int f = threadIdx.x; f < p.rot_dim / 2; f += blockDim.x)
            inv_freq[f] = inv_freq_of(p, f);
    }
    load_block_tokens<P>(p, first, count, bt);
    __syncthreads();
    fill_cos_sin<C, P, CACHE>(p, count, bt, inv_freq, cos_sin);
    __syncthreads();
    const unsigned rows = (unsigned)count * (unsigned)p.n_heads;
    rotate_items<T, STYLE, VEC, E>(p, bt, cos_sin, rows * (unsigned)p.rot_lanes);
    if (p.copy_lanes) copy_items<T, VEC, EC>(p, bt, rows * (unsigned)p.copy_lanes);
}

// Small calls (decode), and calls with a cos/sin cache: no shared memory, no barrier. The block kernel
// runs its position load, the cos/sin and the x loads one after the other (three memory round trips,
// which a call of a few tokens pays in full); here a thread issues its x and position loads together
// and reads (or computes) the cos/sin of its own item. Heads no longer share computed cos/sin, so with
// in-kernel cos/sin this pays only while the call is small (a launch profile's direct_max_tokens).
// Items: (token, head, lane) with lanes = rot_lanes rotating, then copy_lanes copying. One thread an
// item, except for in-kernel cos/sin of 16-byte items: there G = F threads share one, each computing
// one frequency's cos/sin (an exp and a sincos: 8 in one thread measured 1.7x slower at decode), and
// the group's first thread gathers them by shuffles and moves the item.
template <typename T, typename C, typename P, int STYLE, bool VEC, bool CACHE>
__global__ void __launch_bounds__(DIRECT_MAX_THREADS) rope_direct_kernel(const RopeParams p) {
    wait_for_previous_grid();
    constexpr int E = ELEMS<T, STYLE, VEC>, EC = COPY_ELEMS<T, VEC>;
    constexpr int F = STYLE == NEOX ? E : E / 2;  // frequencies per item
    constexpr unsigned G = VEC && !CACHE ? F : 1;   // threads per item (a power of two, <= 8)
    const unsigned rot_lanes = (unsigned)p.rot_lanes, lanes = rot_lanes + (unsigned)p.copy_lanes;
    const unsigned thread = blockIdx.x * blockDim.x + threadIdx.x;  // rope_plan.py keeps it < 2^31
    const unsigned item = thread / G, k = thread % G;
    // The token first, in one division: the position load waits for it and nothing else.
    const unsigned token = fast_div(item, p.div_token_items);
    const unsigned in_token = item - token * (lanes * (unsigned)p.n_heads);
    const unsigned head = fast_div(in_token, p.div_lanes), lane = in_token - head * lanes;
    unsigned rotating = 0;  // the lanes of this warp whose item rotates (a group is all in or all out)
    if constexpr (G > 1) rotating = __ballot_sync(0xffffffffu, token < p.n_tokens && lane < rot_lanes);
    if (token >= p.n_tokens) return;
    i64 offset[4];
    const i64 pos = token_rows<P, true>(p, token, offset);
    const Item it = head_of<T>(p, offset, head, 0);
    const T* in = static_cast<const T*>(it.in);
    T* out = static_cast<T*>(it.out);
    if (lane >= rot_lanes) {  // out of place with rot_dim < head_dim: a chunk past rot_dim, copied
        const i64 at = p.rot_dim + (i64)(lane - rot_lanes) * EC;
        if (k == 0) store_pack<VEC, EC>(out + at, load_pack<VEC, EC>(in + at));
        return;
    }
    const i64 f0 = (i64)lane * F, half = p.rot_dim / 2;
    Pack<T, E> x1, x2;
    if (k == 0) {
        x1 = load_pack<VEC, E>(in + (STYLE == NEOX ? f0 : 2 * f0));
        if constexpr (STYLE == NEOX) x2 = load_pack<VEC, E>(in + f0 + half);
    }
    Pack<float, F> c, s;
    if constexpr (G > 1) {
        float ck, sk;
        exact_sincos(pos, inv_freq_of(p, (int)(f0 + k)), sk, ck);
        if (p.inverse) sk = -sk;
        const int first = (threadIdx.x & 31) - k;
#pragma unroll
        for (int i = 0; i < F; ++i) {
            c.v[i] = __shfl_sync(rotating, ck, first + i);
            s.v[i] = __shfl_sync(rotating, sk, first + i);
        }
        if (k != 0) return;
    } else {
        if constexpr (CACHE && !TOKEN_ROWS<P>) {
            cache_cos_sin<C, F, VEC>(p, pos, f0, half, c, s);
        } else {
#pragma unroll
            for (int i = 0; i < F; ++i) {
                if constexpr (CACHE) {
                    cached_cos_sin<C, P>(p, pos, (int)f0 + i, (int)half, c.v[i], s.v[i]);
                } else {
                    exact_sincos(pos, inv_freq_of(p, (int)f0 + i), s.v[i], c.v[i]);
                }
            }
        }
        if (p.inverse) {
#pragma unroll
            for (int i = 0; i < F; ++i) s.v[i] = -s.v[i];
        }
    }
    rotate_store<T, STYLE, VEC, E, F>(x1, x2, c, s, out, f0, half);
}

}  // namespace cupyrope
