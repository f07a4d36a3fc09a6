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

// Raw packs: keep loaded data in its storage type (half the registers of fp32 for 16-bit types).
// VEC accesses move 32-bit words assembled with integer ops (see store_pack).
template <typename T> __device__ __forceinline__ T from_bits(unsigned bits);
template <> __device__ __forceinline__ float from_bits<float>(unsigned bits) { return __uint_as_float(bits); }
template <> __device__ __forceinline__ __half from_bits<__half>(unsigned bits) {
    return __ushort_as_half((unsigned short)bits);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_bits<__nv_bfloat16>(unsigned bits) {
    return __ushort_as_bfloat16((unsigned short)bits);
}

// Sets 32-bit word k of a pack.
template <typename T, int N>
__device__ __forceinline__ void set_word(Pack<T, N>& pk, int k, unsigned w) {
    if constexpr (sizeof(T) == 4) {
        pk.v[k] = from_bits<T>(w);
    } else {
        pk.v[2 * k] = from_bits<T>(w & 0xffffu);
        pk.v[2 * k + 1] = from_bits<T>(w >> 16);
    }
}

template <bool VEC, int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
    constexpr int WORDS = (int)sizeof(Pack<T, N>) / 4;
    Pack<T, N> pk;
    if constexpr (VEC && WORDS >= 4) {
#pragma unroll
        for (int k = 0; k < WORDS / 4; ++k) {
            const uint4 w = reinterpret_cast<const uint4*>(p)[k];
            set_word(pk, 4 * k, w.x);
            set_word(pk, 4 * k + 1, w.y);
            set_word(pk, 4 * k + 2, w.z);
            set_word(pk, 4 * k + 3, w.w);
        }
    } else if constexpr (VEC && WORDS == 2) {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        set_word(pk, 0, w.x);
        set_word(pk, 1, w.y);
    } else if constexpr (VEC && WORDS == 1) {
        set_word(pk, 0, *reinterpret_cast<const unsigned*>(p));
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) pk.v[i] = p[i];
    }
    return pk;
}

__device__ __forceinline__ unsigned bits_of(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned bits_of(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ unsigned bits_of(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// 32-bit word k of a pack, built with integer ops: a store of such words stays one wide store.
template <typename T, int N>
__device__ __forceinline__ unsigned word_of(const Pack<T, N>& pk, int k) {
    if constexpr (sizeof(T) == 4) return bits_of(pk.v[k]);
    else return bits_of(pk.v[2 * k]) | (bits_of(pk.v[2 * k + 1]) << 16);
}

// Wide stores in PTX: NVVM split plain 16-byte stores of packs into 2- and 4-byte stores in several
// variants (struct copy, memcpy and uint4 stores alike), which cost up to 2.4x in rms_norm_fwd.
// Generic addressing: the same helper writes global and shared memory.
__device__ __forceinline__ void store_words(void* p, uint4 w) {
    asm volatile("st.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w) : "memory");
}
__device__ __forceinline__ void store_words(void* p, uint2 w) {
    asm volatile("st.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(w.x), "r"(w.y) : "memory");
}

template <bool VEC, int N, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& pk) {
    constexpr int WORDS = (int)sizeof(Pack<T, N>) / 4;
    if constexpr (VEC && WORDS >= 4) {
#pragma unroll
        for (int k = 0; k < WORDS / 4; ++k)
            store_words(reinterpret_cast<uint4*>(p) + k, make_uint4(word_of(pk, 4 * k), word_of(pk, 4 * k + 1),
                                                                    word_of(pk, 4 * k + 2), word_of(pk, 4 * k + 3)));
    } else if constexpr (VEC && WORDS == 2) {
        store_words(p, make_uint2(word_of(pk, 0), word_of(pk, 1)));
    } else if constexpr (VEC && WORDS == 1) {
        *reinterpret_cast<unsigned*>(p) = word_of(pk, 0);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) p[i] = pk.v[i];
    }
}

// The shared-memory address (shared state space) of a generic pointer into shared memory, as PTX's shared
// operands take it.
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The alignment of the dynamic shared arrays that copy_async16 fills (the backward kernels' stages). Only 16-byte
// aligned, right after a kernel's static shared arrays, the split backward rows measured up to 20% slower with the
// same SASS (H200 fp32 LayerNorm [8192, 16384]: 487 against 396 us).
constexpr int STAGE_ALIGN = 128;

// Asynchronous 16-byte copies global -> shared (sm_80+: cp.async, which holds no registers while the
// bytes are in flight; older GPUs: an ordinary load and store). A thread's copies are visible to it
// after copy_async_wait<N>(), which waits for all but the N most recently committed groups.
__device__ __forceinline__ void copy_async16(void* shared_dst, const void* global_src) {
#if __CUDA_ARCH__ >= 800
    const unsigned dst = shared_address(shared_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global_src) : "memory");
#else
    *static_cast<uint4*>(shared_dst) = *static_cast<const uint4*>(global_src);
#endif
}

// The same for the first `bytes` (0-16) of the 16 at global_src; the rest of the 16 in shared memory
// is zero-filled and nothing past global_src + bytes is read.
__device__ __forceinline__ void copy_async16_first(void* shared_dst, const void* global_src, int bytes) {
#if __CUDA_ARCH__ >= 800
    const unsigned dst = shared_address(shared_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global_src), "r"(bytes) : "memory");
#else
    unsigned char* d = static_cast<unsigned char*>(shared_dst);
    for (int b = 0; b < 16; ++b) d[b] = b < bytes ? static_cast<const unsigned char*>(global_src)[b] : 0;
#endif
}

// Bytes of dynamic shared memory this launch gave the block.
__device__ __forceinline__ unsigned dynamic_shared_bytes() {
    unsigned bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

__device__ __forceinline__ void copy_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int PENDING>
__device__ __forceinline__ void copy_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

// Thread block clusters (sm_90+): a cluster's blocks run at the same time and can write each other's shared
// memory. CLUSTER_DIMS(n) on a kernel groups its blocks n at a time along x at compile time, so a plain
// cuLaunchKernel launches it; before sm_90 it is empty and such kernels trap (the planners never pick them).
#if __CUDA_ARCH__ >= 900
#define CUPYROPE_CLUSTERS 1
#define CLUSTER_DIMS(n) __cluster_dims__(n, 1, 1)
#else
#define CUPYROPE_CLUSTERS 0
#define CLUSTER_DIMS(n)
#endif

// Programmatic dependent launch (sm_90+; cupyrope/_runtime/launch.py): launched with the attribute, a kernel may
// start while the previous kernel in its stream is still running. Each kernel calls this first: it waits until that
// kernel has completed and its writes are visible (no memory is touched before), then lets the next kernel launch in
// turn, so a grid's launch and block placement overlap the previous grid's last blocks (bf16 [512, 256] forward
// 2.03 -> 1.54 us a call back to back). Launched plainly, both are no-ops (measured: no cost).
__device__ __forceinline__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A cluster barrier for every thread of the cluster's blocks: what a thread wrote to shared memory (its block's
// or a peer's) before it is visible to all threads of the cluster after it.
__device__ __forceinline__ void cluster_sync() {
#if CUPYROPE_CLUSTERS
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned rank = 0;
#if CUPYROPE_CLUSTERS
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#endif
    return rank;
}

// The address of the cluster block `rank`'s copy of the shared variable at `mine` (this block's address of it).
__device__ __forceinline__ unsigned shared_of_rank(const void* mine, unsigned rank) {
    unsigned remote = 0;
#if CUPYROPE_CLUSTERS
    const unsigned local = shared_address(mine);
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
#endif
    return remote;
}

// The exchange of a row's sums between a cluster's blocks (cluster_sum), in each block's shared memory: a slot for each
// block's sums and an mbarrier that completes once all SPLIT have landed, two of each by the parity of the row's turn
// (its place in the cluster's walk). Blocks write their sums into their peers' slots with st.async, which counts
// the bytes on the peer's mbarrier: no fence. A cluster barrier a row (its release waited for every global store
// the block had in flight, and its acquire emptied the L1) stalled the split LayerNorm backward 17% of its time.
template <int SPLIT, typename V>
struct ClusterSums {
    V slots[2][SPLIT];
    unsigned long long landed[2];
};

// Expects the SPLIT blocks' sums (their bytes) at an mbarrier of this block: the arrival its phase counts.
template <int SPLIT, typename V>
__device__ __forceinline__ void expect_cluster_sums(unsigned long long* landed) {
#if CUPYROPE_CLUSTERS
    const unsigned bar = shared_address(landed);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "n"(SPLIT * (int)sizeof(V))
                 : "memory");
#endif
}

// Every block of the cluster calls it once before its first cluster_sum: its mbarriers are set up, expecting the
// first two turns' sums, and the cluster's blocks have all started (their shared memory is there to be written to).
template <int SPLIT, typename V>
__device__ __forceinline__ void cluster_start(ClusterSums<SPLIT, V>& sums) {
#if CUPYROPE_CLUSTERS
    if (threadIdx.x == 0 && threadIdx.y == 0) {
#pragma unroll
        for (int set = 0; set < 2; ++set) {
            const unsigned bar = shared_address(&sums.landed[set]);
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
            expect_cluster_sums<SPLIT, V>(&sums.landed[set]);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // seen by the peers' st.async
    }
    cluster_sync();
#endif
}

// v into slot `slot` of the cluster block `rank`'s copy of the shared ClusterSums, counted on its mbarrier `landed`.
__device__ __forceinline__ void send_cluster_sum(float* slot, unsigned long long* landed, unsigned rank, float v) {
#if CUPYROPE_CLUSTERS
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
                 ::"r"(shared_of_rank(slot, rank)), "f"(v), "r"(shared_of_rank(landed, rank)) : "memory");
#endif
}

__device__ __forceinline__ void send_cluster_sum(float2* slot, unsigned long long* landed, unsigned rank, float2 v) {
#if CUPYROPE_CLUSTERS
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
                 ::"r"(shared_of_rank(slot, rank)), "f"(v.x), "f"(v.y), "r"(shared_of_rank(landed, rank)) : "memory");
#endif
}

// v into the cluster block `rank`'s copy of the shared variable at `mine`, made visible by a cluster barrier.
__device__ __forceinline__ void store_shared_of_rank(float2* mine, unsigned rank, float2 v) {
#if CUPYROPE_CLUSTERS
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(shared_of_rank(mine, rank)), "f"(v.x), "f"(v.y)
                 : "memory");
#endif
}

// Waits until the phase of parity `phase` of this block's mbarrier `landed` has completed. The default acquire at
// CTA scope orders the shared-memory slots that the completed phase counted; at cluster scope it would also empty
// the L1 each row, for global data that no peer writes.
__device__ __forceinline__ void wait_landed(unsigned long long* landed, unsigned phase) {
#if CUPYROPE_CLUSTERS
    const unsigned bar = shared_address(landed);
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "WAIT_LANDED_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra WAIT_LANDED_%=;\n\t}" ::"r"(bar), "r"(phase) : "memory");
#endif
}

// The cluster block `rank`'s copy of the shared float at `mine` (this block's address of it).
__device__ __forceinline__ float load_shared_of_rank(const float* mine, unsigned rank) {
    float v = 0.f;
#if CUPYROPE_CLUSTERS
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(shared_of_rank(mine, rank)) : "memory");
#endif
    return v;
}

__device__ __forceinline__ float add(float a, float b) { return a + b; }
__device__ __forceinline__ float2 add(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }

// The sum over the SPLIT blocks of a cluster (each with a part of a row) of their `sums` (the same in all of a
// block's threads; blocks of one row of threads), for the row of the cluster's turn `turn` (0, 1, ... along its
// walk; cluster_start first): every block sends its sums to slot [its rank] of every block's set turn % 2, waits
// until its own set has all SPLIT, then adds them in rank order: the same floats in every block, every run. A block
// sends into a set again (two turns on) only once it holds this block's sums of the turn between, which this block
// sends only after the barrier below on that turn, which its threads pass only after reading this turn's set. The
// thread that re-arms the set for two turns on does so before it reaches that barrier. SPLIT 1: sums.
// FENCED: plain stores into the peers' slots, then a cluster barrier (the mbarriers unused), which the fp32 LayerNorm
// backward's split rows use: H200, [8192, 16384] 395.8 us against 415.8 with the mbarriers, though [4096, 32768]
// 416.8 against 410.8 and [512, 16384] 38.5 against 35.7 (its bf16 rows ran 292 -> 262 and RMSNorm's split backward
// 578 -> 490 with the mbarriers).
template <int SPLIT, bool FENCED = false, typename V>
__device__ __forceinline__ V cluster_sum(V sums, ClusterSums<SPLIT, V>& cluster, unsigned turn) {
    if constexpr (SPLIT == 1) {
        return sums;
    } else {
        const unsigned set = turn & 1;
        if constexpr (FENCED) {
            if (threadIdx.x < SPLIT) store_shared_of_rank(&cluster.slots[set][cluster_rank()], threadIdx.x, sums);
            cluster_sync();
        } else {
            __syncthreads();  // every thread has read the set of two turns back (and the caller's scratch of this turn)
            if (threadIdx.x < SPLIT)
                send_cluster_sum(&cluster.slots[set][cluster_rank()], &cluster.landed[set], threadIdx.x, sums);
            wait_landed(&cluster.landed[set], (turn >> 1) & 1);
            if (threadIdx.x == 0 && threadIdx.y == 0) expect_cluster_sums<SPLIT, V>(&cluster.landed[set]);
        }
        V total = cluster.slots[set][0];
#pragma unroll
        for (int r = 1; r < SPLIT; ++r) total = add(total, cluster.slots[set][r]);
        return total;
    }
}

// The columns of a row that the block of this cluster rank holds when the SPLIT blocks split it (rms_norm_fwd_split,
// rms_norm_bwd_split's aligned rows): whole E-element chunks, hidden / E / SPLIT of them rounded up, the last part
// shorter (or empty). Returns its length; `offset` gets its first column. SHIFT (the forward's rows `shift` elements
// past a 16-byte boundary): the parts split the chunks from that boundary, as many as a row of any shift spans
// (rmsnorm_rows.py's row_chunks), so that block 0's part is `shift` elements shorter and every other part starts on a
// boundary.
template <int E, int SPLIT, bool SHIFT = false>
__device__ __forceinline__ i64 cluster_part(i64 hidden, i64& offset, int shift = 0) {
    if constexpr (SHIFT) {
        const i64 part = ((hidden + 2 * E - 2) / E + SPLIT - 1) / SPLIT * E;
        const i64 start = cluster_rank() * part - shift;
        offset = max(i64(0), start);
        return max(i64(0), min(start + part, hidden) - offset);
    } else {
        const i64 part = (hidden / E + SPLIT - 1) / SPLIT * E;
        offset = cluster_rank() * part;
        return max(i64(0), min(part, hidden - offset));
    }
}

// The columns of an odd row that the block of this cluster rank holds in rms_norm_bwd_split: whole E-column chunks
// counted from the row's first column, hidden / E / SPLIT of them rounded up (the last part shorter, or empty), so
// every part starts at the row's shift and holds the same columns whatever it is. Returns its length; `offset`
// gets its first column. A part spans one 16-byte chunk more than its columns (rmsnorm_plan_backward.py's _plan_backward_split).
template <int E, int SPLIT>
__device__ __forceinline__ i64 cluster_columns(i64 hidden, i64& offset) {
    const i64 part = ((hidden + E - 1) / E + SPLIT - 1) / SPLIT * E;
    offset = cluster_rank() * part;
    return max(i64(0), min(part, hidden - offset));
}

// N elements to and from fp32, through load_pack / store_pack (VEC: 16-byte accesses at a
// pack-aligned address; otherwise element by element, valid at any element address).
template <bool VEC, int N, typename T>
__device__ __forceinline__ void load_float(const T* p, float (&out)[N]) {
    const Pack<T, N> pk = load_pack<VEC, N>(p);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(pk.v[i]);
}

template <bool VEC, int N, typename T>
__device__ __forceinline__ void store_float(T* p, const float (&in)[N]) {
    Pack<T, N> pk;
#pragma unroll
    for (int i = 0; i < N; ++i) pk.v[i] = from_float<T>(in[i]);
    store_pack<VEC, N>(p, pk);
}

// Sum over groups of WIDTH consecutive lanes (WIDTH a power of two <= 32).
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int offset = WIDTH / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset, WIDTH);
    return v;
}

// The same over groups of `width` lanes, a power of two up to 32 known only at run time: group_sum<width>'s
// shuffles (offsets width / 2 ... 1), each step skipped by the width. lanes_sum_switch's jump table puts a
// constant-bank load and an indirect branch between a small call's loads and its stores: bf16 [512, 32] 1.58 ->
// 1.51 us, [512, 256] 2.02 -> 1.96 with this.
__device__ __forceinline__ float lanes_sum(float v, int width) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
        if (offset < width) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// The same as a loop of log2(width) steps: fewer instructions and registers (see norm_row).
__device__ __forceinline__ float lanes_sum_loop(float v, int width) {
#pragma unroll 1
    for (int offset = width / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// The same by a switch over the width (a jump table): what the backward's kernels keep (row_sum<LANES_JUMP>;
// with lanes_sum: bf16 [1024, 131072] 377 -> 404 us, fp16 [4096, 65536] 619 -> 629-651), and the forward's
// element-by-element rows of 4+ elements a thread (see norm_row).
__device__ __forceinline__ float lanes_sum_switch(float v, int width) {
    switch (width) {
        case 32: return group_sum<32>(v);
        case 16: return group_sum<16>(v);
        case 8: return group_sum<8>(v);
        case 4: return group_sum<4>(v);
        case 2: return group_sum<2>(v);
        default: return v;
    }
}

// Which of the three a kernel takes (row_sum's LANES): lanes_sum, lanes_sum_loop, lanes_sum_switch (JUMP also sums
// the partials of 2-4 warps by partials_sum's compare chain, for the rows where it measured faster).
enum LanesSum { LANES_SKIP, LANES_LOOP, LANES_JUMP };
template <int LANES>
__device__ __forceinline__ float lanes_sum_by(float v, int width) {
    if constexpr (LANES == LANES_LOOP) return lanes_sum_loop(v, width);
    else if constexpr (LANES == LANES_JUMP) return lanes_sum_switch(v, width);
    else return lanes_sum(v, width);
}

// Which of the warps' partials (2 <= warps <= 32) a lane reads for a shuffle tree that combines them: `group` (set
// here) is the tree's width, warps rounded up to a power of two (a row of 4 warps takes 2 steps, not 4), and lane
// reads partial lane % group where that is < warps; the lanes past the partials take a neutral value (0 for a sum:
// any depth gives the same bits).
__device__ __forceinline__ int tree_slot(int warps, int lane, int& group) {
    group = 1 << (32 - __clz(warps - 1));
    return lane & (group - 1);
}

// The sum of the warps' partials (2 <= warps <= 32), to every lane, by a shuffle tree (tree_slot).
// CHAIN: rows of 2 or 4 warps take their tree by a compare first (row_sum's LANES_JUMP).
template <bool CHAIN = false>
__device__ __forceinline__ float partials_sum(const float* partials, int warps, int lane) {
    if (CHAIN && warps <= 2) return group_sum<2>(partials[lane % 2]);
    if (CHAIN && warps <= 4) return group_sum<4>(lane % 4 < warps ? partials[lane % 4] : 0.f);
    int group;
    const int slot = tree_slot(warps, lane, group);
    return lanes_sum(slot < warps ? partials[slot] : 0.f, group);
}

// Sum over the `width` threads (a power of two up to 32, else whole warps: at most 1024) that share
// threadIdx.y, returned to all of them. Up to 32: shuffles only; above: shuffles, then the warps'
// partials through shared memory, summed again by shuffles (each lane reads one partial: a dozen
// instructions where a loop over the partials took ~50, which every warp runs after its loads
// return). Every lane ends with the bitwise same value, the same in every run (a fixed tree).
// Every thread of the block must call it (it may contain __syncthreads).
// first_use: scratch has not been used by this block before (no barrier needed ahead of its writes).
// LANES: how rows of up to 32 threads sum, and for LANES_JUMP the partials too (LanesSum).
template <int LANES = LANES_SKIP>
__device__ __forceinline__ float row_sum(float v, int width, float* scratch /* >= blockDim.x*blockDim.y/32 */,
                                         bool first_use = false) {
    if (width <= 32) return lanes_sum_by<LANES>(v, width);
    v = group_sum<32>(v);
    const int warps = width / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float* partials = scratch + threadIdx.y * warps;
    if (!first_use) __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) partials[warp] = v;
    __syncthreads();
    return partials_sum<LANES == LANES_JUMP>(partials, warps, lane);
}

}  // namespace cupyrope
