// Shared device helpers: dtype conversions, packed 16-byte loads/stores, warp and block reductions.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cupyrope {

typedef long long i64;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// N contiguous elements moved as one access (16 bytes at most per instruction).
template <typename T, int N>
struct alignas((N * sizeof(T)) < 16 ? (N * sizeof(T)) : 16) Pack {
    T v[N];
};

// Load N elements to fp32. VEC: the address is aligned to the pack size, so this is one (or a few)
// 16-byte loads; otherwise N scalar loads, valid at any element address.
template <bool VEC, int N, typename T>
__device__ __forceinline__ void load_float(const T* p, float (&out)[N]) {
    if constexpr (VEC) {
        Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = to_float(pk.v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = to_float(p[i]);
    }
}

// Raw packs: keep loaded data in its storage type (half the registers of fp32 for 16-bit types).
template <bool VEC, int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
    if constexpr (VEC) {
        return *reinterpret_cast<const Pack<T, N>*>(p);
    } else {
        Pack<T, N> pk;
#pragma unroll
        for (int i = 0; i < N; ++i) pk.v[i] = p[i];
        return pk;
    }
}

template <bool VEC, int N, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& pk) {
    if constexpr (VEC) {
        *reinterpret_cast<Pack<T, N>*>(p) = pk;
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) p[i] = pk.v[i];
    }
}

template <bool VEC, int N, typename T>
__device__ __forceinline__ void store_float(T* p, const float (&in)[N]) {
    if constexpr (VEC) {
        Pack<T, N> pk;
#pragma unroll
        for (int i = 0; i < N; ++i) pk.v[i] = from_float<T>(in[i]);
        *reinterpret_cast<Pack<T, N>*>(p) = pk;
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) p[i] = from_float<T>(in[i]);
    }
}

// Sum over groups of WIDTH consecutive lanes (WIDTH a power of two <= 32).
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int offset = WIDTH / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset, WIDTH);
    return v;
}

// Sum over the `width` threads (a power of two) that share threadIdx.y, returned to all of them.
// Up to 32: shuffles only; above: shuffles, then one warp-partial per warp through shared memory.
// Every thread of the block must call it (it may contain __syncthreads).
__device__ __forceinline__ float row_sum(float v, int width, float* scratch /* >= blockDim.x*blockDim.y/32 */) {
    if (width <= 32) {
        switch (width) {
            case 32: return group_sum<32>(v);
            case 16: return group_sum<16>(v);
            case 8: return group_sum<8>(v);
            case 4: return group_sum<4>(v);
            case 2: return group_sum<2>(v);
            default: return v;
        }
    }
    v = group_sum<32>(v);
    const int warps = width / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[threadIdx.y * warps + warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < warps; ++w) total += scratch[threadIdx.y * warps + w];  // fixed order
    return total;
}

// Two sums at once (one pass of barriers): same contract as row_sum; scratch >= 2 * warps.
__device__ __forceinline__ float2 row_sum2(float a, float b, int width, float* scratch) {
    if (width <= 32) return make_float2(row_sum(a, width, scratch), row_sum(b, width, scratch));
    a = group_sum<32>(a);
    b = group_sum<32>(b);
    const int warps = width / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float* slots = scratch + 2 * threadIdx.y * warps;
    __syncthreads();
    if (lane == 0) {
        slots[2 * warp] = a;
        slots[2 * warp + 1] = b;
    }
    __syncthreads();
    float2 total = make_float2(0.f, 0.f);
    for (int w = 0; w < warps; ++w) {  // fixed order
        total.x += slots[2 * w];
        total.y += slots[2 * w + 1];
    }
    return total;
}

}  // namespace cupyrope
