// Rotary position embedding (RoPE) for q and k in one launch.
//
// A block takes `tokens_per_block` tokens. Phase 1: every (token, frequency) cos/sin of those tokens
// is computed (or read from the cache) exactly once, into shared memory. Phase 2: the block's threads
// stream independent items (token, head, lane) -- all q heads, then all k heads -- each item one
// 16-byte chunk of a head (or one pair when scalar), several items in flight per thread.
// Small calls (decode) and calls with a cos/sin cache (pack-aligned: rope_plan.py) take rope_direct_kernel
// instead: one item a thread, no shared memory (see there).
// Template parameters: see rope_common.cuh.
#include "rope_common.cuh"

namespace cupyrope {

// Items a thread of the block kernel loads before its first store: one measured fastest (the block's many threads
// keep enough loads in flight).
constexpr int UNROLL = 1;
constexpr int MIN_BLOCKS = 6;  // blocks of the block kernel per SM the register budget must allow
constexpr int DIRECT_MAX_THREADS = 256;  // the most threads a block a launch profile's direct_threads may ask for

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

template <typename T, typename C, typename P, int STYLE, bool VEC, bool CACHE>
__global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS) rope_kernel(const RopeParams p) {
    wait_for_previous_grid();
    constexpr int E = ELEMS<T, STYLE, VEC>, EC = COPY_ELEMS<T, VEC>;
    __shared__ BlockTokens bt;
    __shared__ double inv_freq[CACHE ? 1 : MAX_ROTARY_DIM / 2];
    extern __shared__ __align__(16) float cos_sin[];  // [tokens_per_block][rot_dim]

    const unsigned first = blockIdx.x * (unsigned)p.tokens_per_block;
    const int count = (int)min((i64)p.tokens_per_block, p.n_tokens - first);
    if constexpr (!CACHE) fill_inv_freq(p, inv_freq);
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
    const TokenPos tp = token_rows<P, true>(p, token, offset);
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
        const int f = (int)(f0 + k);
        computed_cos_sin(p, position_of(tp, p, f), inv_freq_of(p, f), sk, ck);
        if (p.inverse) sk = -sk;
        const int first = (threadIdx.x & 31) - k;
#pragma unroll
        for (int i = 0; i < F; ++i) {
            c.v[i] = __shfl_sync(rotating, ck, first + i);
            s.v[i] = __shfl_sync(rotating, sk, first + i);
        }
        if (k != 0) return;
    } else {
        if constexpr (TOKEN_ROWS<P>) {
            token_rows_cos_sin<C, F, VEC>(p, tp.v[0], f0, c, s);
        } else if (CACHE && p.pos_mode != POS_MROPE) {  // M-RoPE: a pack may span two rows
            cache_cos_sin<C, F, VEC>(p, tp.v[0], f0, half, c, s);
        } else {
#pragma unroll
            for (int i = 0; i < F; ++i) {
                const int f = (int)f0 + i;
                if constexpr (CACHE) {
                    cached_cos_sin<C, P>(p, position_of(tp, p, f), f, (int)half, c.v[i], s.v[i]);
                } else {
                    computed_cos_sin(p, position_of(tp, p, f), inv_freq_of(p, f), s.v[i], c.v[i]);
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
