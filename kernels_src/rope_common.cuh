// What RoPE's kernels (rope.cu) and QK-norm + RoPE's (qk_norm_rope.cu) share: the parameter struct, where a
// token's rows and position are, the position sources (a position per token, M-RoPE's three rows, varlen
// sequences), the cos/sin of a (token, frequency) and the rotation of a pair.
//
// Template parameters (both files):
//   T      element type of q/k (float, __half, __nv_bfloat16)
//   C      element type of the cos/sin cache (float or T; unused without CACHE)
//   P      position type (int or long long; varlen calls: int, cu_seqlens' type), or TokenRows: cos and sin
//          come as two tensors holding each token's own row (transformers' per-token cos/sin), found with the
//          strides that otherwise locate a token's position; no position is read (see cached_cos_sin)
//   STYLE  NEOX (pairs i, i + r/2) or GPTJ (pairs 2i, 2i + 1)
//   VEC    16-byte accesses (the planner checked alignment) or scalar accesses
//   CACHE  cos/sin from a vLLM-layout cache [max_position, rot_dim] (cos half, then sin half) or, with
//          TokenRows, from the cos and sin tensors; or computed in the kernel from theta, exactly to
//          fp32 rounding.
// The position source of positions of type P is a run-time choice (RopeParams::pos_mode), uniform across the
// grid: one branch where a token's position is read, rather than three times the variants.
#pragma once
#include "common.cuh"

namespace cupyrope {

constexpr int NEOX = 0;
constexpr int GPTJ = 1;
constexpr int BLOCK_THREADS = 256;
constexpr int MAX_BLOCK_TOKENS = 64;  // rope_plan.py keeps tokens_per_block * rot_dim * 4 bytes <= 32 KiB
constexpr int MAX_ROTARY_DIM = 1024;  // rope_checks.py checks it

// RopeParams::pos_mode (rope_plan.py: POSITION_MODES)
constexpr int POS_PLAIN = 0;   // positions[token]
constexpr int POS_MROPE = 1;   // M-RoPE: positions[section of the frequency][token]
constexpr int POS_VARLEN = 2;  // token - cu_seqlens[its sequence] + seq_offsets[its sequence]

struct TokenRows {};  // the position type of the variants reading per-token cos and sin tensors
template <typename P> constexpr bool TOKEN_ROWS = false;
template <> constexpr bool TOKEN_ROWS<TokenRows> = true;

struct RopeParams {  // mirrored by rope_plan.py's _TAIL (all 8-byte fields but the last two)
    const void* q_in;
    void* q_out;
    const void* k_in;
    void* k_out;
    union { const void* positions; const void* cos; };  // cos: TokenRows variants; cu_seqlens: POS_VARLEN
    union { const void* cache; const void* sin; };      // sin: TokenRows variants
    const void* seq_offsets;  // POS_VARLEN: each sequence's first position (int32 or int64), or null (0)
    // qk_norm_rope.cu only (rope.cu's plans pack them as null).
    const void* q_weight;
    const void* k_weight;
    const void* q_x;  // backward: the forward's inputs (q_in and k_in then hold the output gradients)
    const void* k_x;
    float* partial;   // backward: [gridDim.x, 2 * head_dim] weight-gradient sums, q's then k's
    // What the direct kernel reads on its way to the position load comes first: few constant-cache lines.
    i64 n_tokens;  // < 2^32 (rope_plan.py checks): token indices are 32-bit
    i64 n1, n2;    // sizes of the two inner token dimensions (the outer one is implied)
    i64 pos_s[3];  // TokenRows: the element strides of the token dimensions in cos and in sin
    i64 pos_mode;  // POS_PLAIN, POS_MROPE, POS_VARLEN
    i64 mrope_stride;       // POS_MROPE: elements between the position rows
    i64 mrope_sections[3];  // POS_MROPE: frequencies of the t, h and w sections
    i64 mrope_interleaved;  // POS_MROPE: Qwen3-VL's assignment (h at f % 3 == 1, w at f % 3 == 2; see mrope_row)
    i64 n_seqs, offsets_64; // POS_VARLEN: sequences (cu_seqlens holds n_seqs + 1), seq_offsets is int64
    // Divisors of the direct kernel's index math as (magic | shift << 32), see fast_div: items a token
    // (heads x lanes), the two inner token dimensions, lanes a head.
    i64 div_token_items, div_n2, div_n1, div_lanes;
    i64 q_in_s[4], q_out_s[4], k_in_s[4], k_out_s[4];  // element strides: 3 token dims, then heads
    i64 q_x_s[4], k_x_s[4];                             // the same of q_x, k_x (backward)
    union { i64 cache_stride; i64 freq_stride; };  // freq_stride: TokenRows, between frequencies in cos/sin
    // rows_in_packs: TokenRows, the direct kernel reads an item's cos and its sin as one pack each (rope_plan.py:
    // frequencies contiguous, rows pack-aligned)
    union { i64 max_position; i64 rows_in_packs; };
    i64 n_q_heads, n_heads, tokens_per_block;
    i64 rot_dim, rot_lanes, copy_lanes;  // copy_lanes: lanes moving features past rot_dim
    double log_step;  // ln(theta) * -2 / rot_dim: inv_freq(f) = exp(f * log_step)
    i64 inverse;
    i64 head_dim, group_threads;  // qk_norm_rope: threads a head (a power of two <= 32)
    float eps, weight_offset;     // qk_norm_rope: y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)
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

// The position of a token that has none: a varlen token outside every sequence (cu_seqlens out of range or not
// increasing). Its rotated features become NaN, like those of a position outside a cos/sin cache.
constexpr i64 NO_POSITION = (i64)(-9223372036854775807LL - 1);

// A token's positions: one, or M-RoPE's three (time, height, width).
struct TokenPos {
    i64 v[3];
};

// The M-RoPE row (0 time, 1 height, 2 width) whose position frequency f takes: contiguous sections (Qwen2-VL,
// Qwen2.5-VL), or Qwen3-VL's interleaving (h at f % 3 == 1 below 3 * sections[1], w at f % 3 == 2 below
// 3 * sections[2], t elsewhere). Other position modes have one row.
__device__ __forceinline__ int mrope_row(const RopeParams& p, int f) {
    if (p.pos_mode != POS_MROPE) return 0;
    if (p.mrope_interleaved) {
        const int r = f % 3;
        return r == 1 && f < 3 * p.mrope_sections[1] ? 1 : r == 2 && f < 3 * p.mrope_sections[2] ? 2 : 0;
    }
    return f < p.mrope_sections[0] ? 0 : f < p.mrope_sections[0] + p.mrope_sections[1] ? 1 : 2;
}

__device__ __forceinline__ i64 position_of(const TokenPos& tp, const RopeParams& p, int f) {
    return tp.v[mrope_row(p, f)];
}

// Varlen: the position of token t of a packed batch, t - cu_seqlens[s] + seq_offsets[s] for the sequence s with
// cu_seqlens[s] <= t < cu_seqlens[s + 1], found by bisection (log2(n_seqs) loads; work linear in tokens).
// Any cu_seqlens stays in bounds: the bisection reads entries 0..n_seqs only, and a token whose s fails the test
// (outside every sequence, or cu_seqlens not increasing there) gets NO_POSITION.
__device__ __forceinline__ i64 varlen_position(const RopeParams& p, i64 t) {
    const int* starts = static_cast<const int*>(p.positions);
    int lo = 0, hi = (int)p.n_seqs;  // the last s with starts[s] <= t lies in [lo, hi)
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if ((i64)__ldg(starts + mid) <= t) lo = mid;
        else hi = mid;
    }
    const i64 begin = __ldg(starts + lo), end = __ldg(starts + lo + 1);
    if (t < begin || t >= end) return NO_POSITION;
    i64 offset = 0;
    if (p.seq_offsets) {
        offset = p.offsets_64 ? __ldg(static_cast<const long long*>(p.seq_offsets) + lo)
                              : (i64)__ldg(static_cast<const int*>(p.seq_offsets) + lo);
    }
    return t - begin + offset;
}

// The token dimension indices (outermost first) of token `token`.
template <bool FAST = false>
__device__ __forceinline__ void token_coords(const RopeParams& p, unsigned token, i64 (&t)[3]) {
    // 32-bit index math: a 64-bit division would dominate the kernel's registers.
    const unsigned n1 = (unsigned)p.n1, n2 = (unsigned)p.n2;
    if constexpr (FAST) {
        const unsigned rest = fast_div(token, p.div_n2), outer = fast_div(rest, p.div_n1);
        t[2] = token - rest * n2, t[1] = rest - outer * n1, t[0] = outer;
    } else {
        const unsigned rest = token / n2;
        t[2] = token - rest * n2, t[1] = rest % n1, t[0] = rest / n1;
    }
}

__device__ __forceinline__ i64 offset_of(const i64 (&t)[3], const i64* strides) {
    return t[0] * strides[0] + t[1] * strides[1] + t[2] * strides[2];
}

// The rows of a token: where they start in q_in, q_out, k_in, k_out (offset), and the index of its
// position (TokenRows: where its row starts in cos and sin).
template <bool FAST = false>
__device__ __forceinline__ i64 token_offsets(const RopeParams& p, unsigned token, i64 (&offset)[4]) {
    i64 t[3];
    token_coords<FAST>(p, token, t);
    offset[0] = offset_of(t, p.q_in_s);
    offset[1] = offset_of(t, p.q_out_s);
    offset[2] = offset_of(t, p.k_in_s);
    offset[3] = offset_of(t, p.k_out_s);
    return offset_of(t, p.pos_s);
}

// The positions of token `token`, whose position index (token_offsets) is `at`.
template <typename P>
__device__ __forceinline__ TokenPos token_position(const RopeParams& p, unsigned token, i64 at) {
    TokenPos tp;
    if constexpr (TOKEN_ROWS<P>) {
        tp.v[0] = at;
    } else {
        const P* positions = static_cast<const P*>(p.positions);
        if (p.pos_mode == POS_VARLEN) {
            tp.v[0] = varlen_position(p, token);
        } else {
            tp.v[0] = (i64)positions[at];
            if (p.pos_mode == POS_MROPE) {
                tp.v[1] = (i64)positions[at + p.mrope_stride];
                tp.v[2] = (i64)positions[at + 2 * p.mrope_stride];
            }
        }
    }
    return tp;
}

// Where token `token`'s rows start in q_in, q_out, k_in, k_out, and its positions.
template <typename P, bool FAST = false>
__device__ __forceinline__ TokenPos token_rows(const RopeParams& p, unsigned token, i64 (&offset)[4]) {
    return token_position<P>(p, token, token_offsets<FAST>(p, token, offset));
}

struct BlockTokens {  // per token of the block: where its rows start in q_in, q_out, k_in, k_out
    i64 offset[MAX_BLOCK_TOKENS][4];
    TokenPos position[MAX_BLOCK_TOKENS];
};

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

// theta^(-2f/rot_dim) in double as exp(f * log_step): as accurate as pow (exp's 1 ulp plus the
// rounding of f * log_step, both far below fp32's resolution of the angle) at a third of the work.
__device__ __forceinline__ double inv_freq_of(const RopeParams& p, int f) { return exp((double)f * p.log_step); }

// The in-kernel cos/sin of frequency f at pos (NaN for NO_POSITION: a varlen token outside every sequence).
__device__ __forceinline__ void computed_cos_sin(const RopeParams& p, i64 pos, double inv_freq, float& s, float& c) {
    exact_sincos(pos, inv_freq, s, c);
    if (p.pos_mode == POS_VARLEN && pos == NO_POSITION) s = c = __int_as_float(0x7fc00000);
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

// TokenRows: the F cos and F sin of frequencies f0.. of the token whose rows start at `row` in cos and sin; two packs
// where the planner found them contiguous and aligned (0.4 us faster at decode than F loads of each), else one by one.
template <typename C, int F, bool VEC>
__device__ __forceinline__ void token_rows_cos_sin(const RopeParams& p, i64 row, i64 f0, Pack<float, F>& c,
                                                   Pack<float, F>& s) {
    const C* cos = static_cast<const C*>(p.cos) + row;
    const C* sin = static_cast<const C*>(p.sin) + row;
    if (p.rows_in_packs) {
        const Pack<C, F> cc = load_pack<VEC, F>(cos + f0), ss = load_pack<VEC, F>(sin + f0);
#pragma unroll
        for (int i = 0; i < F; ++i) c.v[i] = to_float(cc.v[i]), s.v[i] = to_float(ss.v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < F; ++i) {
            const i64 at = (f0 + i) * p.freq_stride;
            c.v[i] = to_float(cos[at]), s.v[i] = to_float(sin[at]);
        }
    }
}

// cos_sin[t * rot_dim + f] = cos, cos_sin[t * rot_dim + rot_dim/2 + f] = sin (sin negated if inverse).
template <typename C, typename P, bool CACHE>
__device__ __forceinline__ void fill_cos_sin(const RopeParams& p, int count, const BlockTokens& bt,
                                             const double* inv_freq, float* cos_sin) {
    const int half = (int)p.rot_dim / 2;
    for (int j = threadIdx.x; j < count * half; j += blockDim.x) {
        const int t = j / half, f = j - t * half;
        const i64 pos = position_of(bt.position[t], p, f);
        float c, s;
        if constexpr (CACHE) {
            cached_cos_sin<C, P>(p, pos, f, half, c, s);
        } else {
            computed_cos_sin(p, pos, inv_freq[f], s, c);
        }
        cos_sin[t * p.rot_dim + f] = c;
        cos_sin[t * p.rot_dim + half + f] = p.inverse ? -s : s;
    }
}

// The in-kernel inverse frequencies of the block kernels' shared table.
__device__ __forceinline__ void fill_inv_freq(const RopeParams& p, double* inv_freq) {
    for (int f = threadIdx.x; f < p.rot_dim / 2; f += blockDim.x) inv_freq[f] = inv_freq_of(p, f);
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

// (a, b) rotated by (c, s), each rounding explicit: a compiler free to fuse either product would round the same pair
// differently in different kernels (the block and direct kernels must agree bit for bit: batch invariance).
__device__ __forceinline__ void rotate_pair(float& a, float& b, float c, float s) {
    const float x = a, y = b;
    a = __fmaf_rn(x, c, -__fmul_rn(y, s));
    b = __fmaf_rn(y, c, __fmul_rn(x, s));
}

// Rotates one item's pairs by (c, s): v1 holds features f0.. (NEOX: v2 those at f0 + half); GPTJ: v1 holds the
// pairs of frequencies f0.. interleaved.
template <int STYLE, int E, int F>
__device__ __forceinline__ void rotate_floats(float (&v1)[E], float (&v2)[E], const Pack<float, F>& c,
                                              const Pack<float, F>& s) {
    if constexpr (STYLE == NEOX) {
#pragma unroll
        for (int i = 0; i < E; ++i) rotate_pair(v1[i], v2[i], c.v[i], s.v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < F; ++i) rotate_pair(v1[2 * i], v1[2 * i + 1], c.v[i], s.v[i]);
    }
}

// Stores a rotated item: v1 at f0 (GPTJ: 2 * f0), NEOX's v2 at f0 + half.
template <typename T, int STYLE, bool VEC, int E>
__device__ __forceinline__ void store_item(const float (&v1)[E], const float (&v2)[E], T* out, i64 f0, i64 half) {
    Pack<T, E> y1, y2;
#pragma unroll
    for (int i = 0; i < E; ++i) y1.v[i] = from_float<T>(v1[i]);
    if constexpr (STYLE == NEOX) {
#pragma unroll
        for (int i = 0; i < E; ++i) y2.v[i] = from_float<T>(v2[i]);
        store_pack<VEC, E>(out + f0, y1);
        store_pack<VEC, E>(out + f0 + half, y2);
    } else {
        store_pack<VEC, E>(out + 2 * f0, y1);
    }
}

// Rotates one item's pairs by (c, s) and stores it (x1, x2 as rotate_floats' v1, v2).
template <typename T, int STYLE, bool VEC, int E, int F>
__device__ __forceinline__ void rotate_store(const Pack<T, E>& x1, const Pack<T, E>& x2, const Pack<float, F>& c,
                                             const Pack<float, F>& s, T* out, i64 f0, i64 half) {
    float v1[E], v2[E];
#pragma unroll
    for (int i = 0; i < E; ++i) {
        v1[i] = to_float(x1.v[i]);
        v2[i] = STYLE == NEOX ? to_float(x2.v[i]) : 0.f;
    }
    rotate_floats<STYLE, E, F>(v1, v2, c, s);
    store_item<T, STYLE, VEC, E>(v1, v2, out, f0, half);
}

template <typename T, int STYLE, bool VEC>
constexpr int ELEMS = VEC ? 16 / sizeof(T) : (STYLE == GPTJ ? 2 : 1);  // elements per access
template <typename T, bool VEC>
constexpr int COPY_ELEMS = VEC ? 16 / sizeof(T) : 1;  // elements per copy access

}  // namespace cupyrope
