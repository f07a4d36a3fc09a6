// Rotary position embedding (RoPE) for q and k in one launch.
//
// Work unit = (token, head group). The lanes of a unit split the rotated features of one head; each
// lane computes cos/sin for its frequencies once and reuses them for every head of its group (all q
// heads, then all k heads). Template parameters pick the variant:
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
constexpr int HEAD_UNROLL = 2;  // heads loaded before the first store: independent loads in flight

struct RopeParams {  // mirrored by rope.py's _PARAMS (all 8-byte fields: no padding)
    const void* q_in;
    void* q_out;
    const void* k_in;
    void* k_out;
    const void* positions;
    const void* cache;
    i64 n_units;  // tokens * head_groups
    i64 n1, n2;   // sizes of the two inner token dimensions (the outer one is implied)
    i64 q_in_s[4], q_out_s[4], k_in_s[4], k_out_s[4];  // element strides: 3 token dims, then heads
    i64 pos_s[3];
    i64 cache_stride, max_position;
    i64 n_q_heads, n_heads, head_groups;
    i64 rot_dim, rot_lanes, copy_lanes;  // copy_lanes: lanes copying features past rot_dim (0 in place)
    double theta;
    i64 inverse;
};

// cos/sin of pos * theta^(-2f/rot_dim), equal to the exact values to fp32 rounding at any position up
// to 2^24: angle and range reduction in double (2*pi split in two parts), then fp32 sincosf on the
// reduced angle plus a first-order correction for the part of it that fp32 cannot hold.
__device__ __forceinline__ void exact_sincos(i64 pos, i64 f, i64 rot_dim, double theta, float& s, float& c) {
    const double inv_freq = pow(theta, (double)(-2 * f) / (double)rot_dim);
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

struct TokenOffsets {
    i64 q_in, q_out, k_in, k_out;
};

template <typename T>
struct HeadPtrs {
    const T* in;
    T* out;
};

template <typename T>
__device__ __forceinline__ HeadPtrs<T> head_ptrs(const RopeParams& p, const TokenOffsets& o, i64 h) {
    if (h < p.n_q_heads) {
        return {static_cast<const T*>(p.q_in) + o.q_in + h * p.q_in_s[3],
                static_cast<T*>(p.q_out) + o.q_out + h * p.q_out_s[3]};
    }
    h -= p.n_q_heads;
    return {static_cast<const T*>(p.k_in) + o.k_in + h * p.k_in_s[3],
            static_cast<T*>(p.k_out) + o.k_out + h * p.k_out_s[3]};
}

template <typename T, typename C, int STYLE, bool VEC, bool CACHE, int E, int F>
__device__ __forceinline__ void rotate_lane(const RopeParams& p, const TokenOffsets& o, i64 pos, int lane,
                                            int group) {
    const i64 f0 = (i64)lane * F;
    float c[F], s[F];
    if constexpr (CACHE) {
        if (pos >= 0 && pos < p.max_position) {
            const C* row = static_cast<const C*>(p.cache) + pos * p.cache_stride;
            load_float<VEC, F>(row + f0, c);
            load_float<VEC, F>(row + p.rot_dim / 2 + f0, s);
        } else {  // documented: rotated features of out-of-range positions become NaN
#pragma unroll
            for (int i = 0; i < F; ++i) c[i] = s[i] = __int_as_float(0x7fc00000);
        }
    } else {
#pragma unroll
        for (int i = 0; i < F; ++i) exact_sincos(pos, f0 + i, p.rot_dim, p.theta, s[i], c[i]);
    }
    if (p.inverse) {
#pragma unroll
        for (int i = 0; i < F; ++i) s[i] = -s[i];
    }
    // Element offsets of this lane's two operands inside a head.
    const i64 a = STYLE == NEOX ? f0 : 2 * f0;
    const i64 b = STYLE == NEOX ? f0 + p.rot_dim / 2 : 0;

    for (i64 h0 = group; h0 < p.n_heads; h0 += HEAD_UNROLL * p.head_groups) {
        Pack<T, E> x1[HEAD_UNROLL], x2[HEAD_UNROLL];
        HeadPtrs<T> ptrs[HEAD_UNROLL];
#pragma unroll
        for (int u = 0; u < HEAD_UNROLL; ++u) {
            const i64 h = h0 + u * p.head_groups;
            if (h < p.n_heads) {
                ptrs[u] = head_ptrs<T>(p, o, h);
                x1[u] = load_pack<VEC, E>(ptrs[u].in + a);
                if constexpr (STYLE == NEOX) x2[u] = load_pack<VEC, E>(ptrs[u].in + b);
            }
        }
#pragma unroll
        for (int u = 0; u < HEAD_UNROLL; ++u) {
            if (h0 + u * p.head_groups >= p.n_heads) continue;
            Pack<T, E> y1, y2;
            if constexpr (STYLE == NEOX) {
#pragma unroll
                for (int i = 0; i < E; ++i) {
                    const float v1 = to_float(x1[u].v[i]), v2 = to_float(x2[u].v[i]);
                    y1.v[i] = from_float<T>(v1 * c[i] - v2 * s[i]);
                    y2.v[i] = from_float<T>(v2 * c[i] + v1 * s[i]);
                }
                store_pack<VEC, E>(ptrs[u].out + b, y2);
            } else {
#pragma unroll
                for (int i = 0; i < F; ++i) {
                    const float even = to_float(x1[u].v[2 * i]), odd = to_float(x1[u].v[2 * i + 1]);
                    y1.v[2 * i] = from_float<T>(even * c[i] - odd * s[i]);
                    y1.v[2 * i + 1] = from_float<T>(odd * c[i] + even * s[i]);
                }
            }
            store_pack<VEC, E>(ptrs[u].out + a, y1);
        }
    }
}

// Out of place with rot_dim < head_dim: features past rot_dim are copied unchanged.
template <typename T, bool VEC, int EC>
__device__ __forceinline__ void copy_lane(const RopeParams& p, const TokenOffsets& o, int lane, int group) {
    const i64 offset = p.rot_dim + (i64)lane * EC;
    for (i64 h0 = group; h0 < p.n_heads; h0 += HEAD_UNROLL * p.head_groups) {
        Pack<T, EC> v[HEAD_UNROLL];
        HeadPtrs<T> ptrs[HEAD_UNROLL];
#pragma unroll
        for (int u = 0; u < HEAD_UNROLL; ++u) {
            const i64 h = h0 + u * p.head_groups;
            if (h < p.n_heads) {
                ptrs[u] = head_ptrs<T>(p, o, h);
                v[u] = load_pack<VEC, EC>(ptrs[u].in + offset);
            }
        }
#pragma unroll
        for (int u = 0; u < HEAD_UNROLL; ++u) {
            if (h0 + u * p.head_groups < p.n_heads) store_pack<VEC, EC>(ptrs[u].out + offset, v[u]);
        }
    }
}

template <typename T, typename C, typename P, int STYLE, bool VEC, bool CACHE>
__global__ void __launch_bounds__(256, 2) rope_kernel(const RopeParams p) {
    constexpr int E = VEC ? 16 / sizeof(T) : (STYLE == GPTJ ? 2 : 1);  // elements per access
    constexpr int F = STYLE == NEOX ? E : E / 2;                         // frequencies per lane
    constexpr int EC = VEC ? 16 / sizeof(T) : 1;                         // elements per copy access

    const i64 unit = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (unit >= p.n_units) return;
    const i64 token = unit / p.head_groups;
    const int group = (int)(unit - token * p.head_groups);
    const i64 t2 = token % p.n2;
    const i64 rest = token / p.n2;
    const i64 t1 = rest % p.n1;
    const i64 t0 = rest / p.n1;
    const TokenOffsets o{t0 * p.q_in_s[0] + t1 * p.q_in_s[1] + t2 * p.q_in_s[2],
                         t0 * p.q_out_s[0] + t1 * p.q_out_s[1] + t2 * p.q_out_s[2],
                         t0 * p.k_in_s[0] + t1 * p.k_in_s[1] + t2 * p.k_in_s[2],
                         t0 * p.k_out_s[0] + t1 * p.k_out_s[1] + t2 * p.k_out_s[2]};
    const P* positions = static_cast<const P*>(p.positions);
    const i64 pos = (i64)positions[t0 * p.pos_s[0] + t1 * p.pos_s[1] + t2 * p.pos_s[2]];

    const int lanes = (int)(p.rot_lanes + p.copy_lanes);
    for (int lane = threadIdx.x; lane < lanes; lane += blockDim.x) {
        if (lane < p.rot_lanes) {
            rotate_lane<T, C, STYLE, VEC, CACHE, E, F>(p, o, pos, lane, group);
        } else {
            copy_lane<T, VEC, EC>(p, o, lane - (int)p.rot_lanes, group);
        }
    }
}

}  // namespace cupyrope
