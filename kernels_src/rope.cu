// Rotary position embedding (RoPE) for q and k in one launch.
//
// A block takes `tokens_per_block` tokens. Phase 1: every (token, frequency) cos/sin of those tokens
// is computed (or read from the cache) exactly once, into shared memory. Phase 2: the block's threads
// stream independent items (token, head, lane) -- all q heads, then all k heads -- each item one
// 16-byte chunk of a head (or one pair when scalar), several items in flight per thread.
// Template parameters pick the variant:
//   T      element type of q/k (float, __half, __nv_bfloat16)
//   C      element type of the cos/sin cache (float or T; unused without CACHE)
//   P      position type (int or long long)
//   STYLE  NEOX (pairs i, i + r/2) or GPTJ (pairs 2i, 2i + 1)
//   VEC    16-byte accesses (the planner checked alignment) or scalar accesses
//   CACHE  cos/sin from a vLLM-layout cache [max_position, rot_dim] (cos half, then sin half), or
//          computed in the kernel from theta, exactly to fp32 rounding.
#include "common.cuh"

namespace cupyrope {

constexpr int NEOX = 0;
constexpr int GPTJ = 1;
// Tuning knob (docs/perf-notes.md): items whose loads are issued before the first store.
#ifndef ROPE_ITEM_UNROLL
#define ROPE_ITEM_UNROLL 1
#endif
#ifndef ROPE_MIN_BLOCKS  // blocks per SM the register budget must allow
#define ROPE_MIN_BLOCKS 6
#endif
constexpr int UNROLL = ROPE_ITEM_UNROLL;
constexpr int BLOCK_THREADS = 256;
constexpr int MAX_BLOCK_TOKENS = 64;  // rope.py keeps tokens_per_block * rot_dim * 4 bytes <= 32 KiB
constexpr int MAX_ROTARY_DIM = 1024;  // rope.py checks it

struct RopeParams {  // mirrored by rope.py's _PARAMS (all 8-byte fields: no padding)
    const void* q_in;
    void* q_out;
    const void* k_in;
    void* k_out;
    const void* positions;
    const void* cache;
    i64 n_tokens;  // < 2^32 (rope.py checks): token indices are 32-bit
    i64 n1, n2;    // sizes of the two inner token dimensions (the outer one is implied)
    i64 q_in_s[4], q_out_s[4], k_in_s[4], k_out_s[4];  // element strides: 3 token dims, then heads
    i64 pos_s[3];
    i64 cache_stride, max_position;
    i64 n_q_heads, n_heads, tokens_per_block;
    i64 rot_dim, rot_lanes, copy_lanes;  // copy_lanes: lanes copying features past rot_dim (0 in place)
    double theta;
    i64 inverse;
};

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

template <typename P>
__device__ __forceinline__ void load_block_tokens(const RopeParams& p, unsigned first, int count, BlockTokens& bt) {
    for (int t = threadIdx.x; t < count; t += blockDim.x) {
        // 32-bit index math: a 64-bit division would dominate the kernel's registers.
        const unsigned token = first + t, n1 = (unsigned)p.n1, n2 = (unsigned)p.n2;
        const unsigned rest = token / n2;
        const i64 t2 = token - rest * n2, t1 = rest % n1, t0 = rest / n1;
        bt.offset[t][0] = t0 * p.q_in_s[0] + t1 * p.q_in_s[1] + t2 * p.q_in_s[2];
        bt.offset[t][1] = t0 * p.q_out_s[0] + t1 * p.q_out_s[1] + t2 * p.q_out_s[2];
        bt.offset[t][2] = t0 * p.k_in_s[0] + t1 * p.k_in_s[1] + t2 * p.k_in_s[2];
        bt.offset[t][3] = t0 * p.k_out_s[0] + t1 * p.k_out_s[1] + t2 * p.k_out_s[2];
        bt.position[t] = (i64) static_cast<const P*>(p.positions)[t0 * p.pos_s[0] + t1 * p.pos_s[1] + t2 * p.pos_s[2]];
    }
}

// cos_sin[t * rot_dim + f] = cos, cos_sin[t * rot_dim + rot_dim/2 + f] = sin (sin negated if inverse).
template <typename C, bool CACHE>
__device__ __forceinline__ void fill_cos_sin(const RopeParams& p, int count, const BlockTokens& bt,
                                             const double* inv_freq, float* cos_sin) {
    const int half = (int)p.rot_dim / 2;
    for (int j = threadIdx.x; j < count * half; j += blockDim.x) {
        const int t = j / half, f = j - t * half;
        const i64 pos = bt.position[t];
        float c, s;
        if constexpr (CACHE) {
            if (pos >= 0 && pos < p.max_position) {
                const C* row = static_cast<const C*>(p.cache) + pos * p.cache_stride;
                c = to_float(row[f]);
                s = to_float(row[half + f]);
            } else {  // documented: rotated features of out-of-range positions become NaN
                c = s = __int_as_float(0x7fc00000);
            }
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

template <typename T>
__device__ __forceinline__ Item locate(const RopeParams& p, const BlockTokens& bt, unsigned item, unsigned lanes,
                                       unsigned& lane) {
    const unsigned row = item / lanes;
    lane = item - row * lanes;
    const unsigned n_heads = (unsigned)p.n_heads;
    const int t = (int)(row / n_heads);
    const i64 h = row - (unsigned)t * n_heads;
    const bool is_q = h < p.n_q_heads;
    const i64 kh = h - p.n_q_heads;
    const T* in = is_q ? static_cast<const T*>(p.q_in) + bt.offset[t][0] + h * p.q_in_s[3]
                       : static_cast<const T*>(p.k_in) + bt.offset[t][2] + kh * p.k_in_s[3];
    T* out = is_q ? static_cast<T*>(p.q_out) + bt.offset[t][1] + h * p.q_out_s[3]
                  : static_cast<T*>(p.k_out) + bt.offset[t][3] + kh * p.k_out_s[3];
    return {in, out, t};
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
            T* out = static_cast<T*>(it[u].out);
            Pack<T, E> y1, y2;
            if constexpr (STYLE == NEOX) {
#pragma unroll
                for (int i = 0; i < E; ++i) {
                    const float v1 = to_float(x1[u].v[i]), v2 = to_float(x2[u].v[i]);
                    y1.v[i] = from_float<T>(v1 * c.v[i] - v2 * s.v[i]);
                    y2.v[i] = from_float<T>(v2 * c.v[i] + v1 * s.v[i]);
                }
                store_pack<VEC, E>(out + f0[u], y1);
                store_pack<VEC, E>(out + f0[u] + half, y2);
            } else {
#pragma unroll
                for (int i = 0; i < F; ++i) {
                    const float even = to_float(x1[u].v[2 * i]), odd = to_float(x1[u].v[2 * i + 1]);
                    y1.v[2 * i] = from_float<T>(even * c.v[i] - odd * s.v[i]);
                    y1.v[2 * i + 1] = from_float<T>(odd * c.v[i] + even * s.v[i]);
                }
                store_pack<VEC, E>(out + 2 * f0[u], y1);
            }
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

template <typename T, typename C, typename P, int STYLE, bool VEC, bool CACHE>
__global__ void __launch_bounds__(BLOCK_THREADS, ROPE_MIN_BLOCKS) rope_kernel(const RopeParams p) {
    constexpr int E = VEC ? 16 / sizeof(T) : (STYLE == GPTJ ? 2 : 1);  // elements per access
    constexpr int EC = VEC ? 16 / sizeof(T) : 1;                         // elements per copy access
    __shared__ BlockTokens bt;
    __shared__ double inv_freq[CACHE ? 1 : MAX_ROTARY_DIM / 2];
    extern __shared__ __align__(16) float cos_sin[];  // [tokens_per_block][rot_dim]

    const unsigned first = blockIdx.x * (unsigned)p.tokens_per_block;
    const int count = (int)min((i64)p.tokens_per_block, p.n_tokens - first);
    if constexpr (!CACHE) {
        for (int f = threadIdx.x; f < p.rot_dim / 2; f += blockDim.x)
            inv_freq[f] = pow(p.theta, (double)(-2 * f) / (double)p.rot_dim);
    }
    load_block_tokens<P>(p, first, count, bt);
    __syncthreads();
    fill_cos_sin<C, CACHE>(p, count, bt, inv_freq, cos_sin);
    __syncthreads();
    const unsigned rows = (unsigned)count * (unsigned)p.n_heads;
    rotate_items<T, STYLE, VEC, E>(p, bt, cos_sin, rows * (unsigned)p.rot_lanes);
    if (p.copy_lanes) copy_items<T, VEC, EC>(p, bt, rows * (unsigned)p.copy_lanes);
}

}  // namespace cupyrope
