"""RMSNorm forward, backward and fused residual add: argument checks -> plan -> launch."""

import itertools
import math
import struct

from . import _arrays, _launch
from ._arrays import (CTYPE, FLOAT_DTYPES, EmptyPlan, check_not_overlapping, describe, describe_optional, fingerprint,
                      fingerprint_optional)
from ._compile import allow_shared_memory, get_kernel
from ._device import resident_blocks, resident_clusters, runs_clusters, shared_optin, sm_count
from ._layout import _merge

SOURCE = "rms_norm.cu"
REGISTER_SLOTS = (1, 2, 4, 8)  # NPT: accesses per thread kept in registers (0: two-pass loop)
MAX_WIDTH = 512  # threads per row: a 1024-thread row block leaves one block per SM (no overlap)
# Elements per thread, measured best on an H100 (docs/perf-notes.md; scripts/sweep_norm.py sets them).
FWD_ELEMS_PER_THREAD = 16
# Small inputs (rows of up to FWD_SMALL_ROW_BYTES, FWD_SMALL_ELEMENTS in all): FWD_SMALL_ELEMS_PER_THREAD,
# i.e. one 16-byte chunk a thread where rows are vectorized, whose weight the kernel then loads with x
# rather than after the reduction (one memory round trip less on the critical path of a grid that is
# mostly latency); 4 elements a thread where rows go element by element (8 measured slower in fp32, 2
# and 16 in bf16: docs/perf-notes.md v10).
FWD_SMALL_ROW_BYTES = 4096
FWD_SMALL_ELEMENTS = 1 << 22
FWD_SMALL_ELEMS_PER_THREAD = 4
BWD_ELEMS_PER_THREAD = 8
BWD_ELEMS_PER_THREAD_LONG_ROWS = 16  # rows of 8 KB or more: fewer, fuller threads per row
LONG_ROW_BYTES = 8192
# Register slots (one 16-byte access when vectorized, one element otherwise) by (vectorized, element
# size): the most that 64 registers hold without spilling (ptxas -v; the backward also keeps dy and
# the dweight sums). Scalar slots cover odd hidden sizes up to 4096 in registers.
FWD_MAX_SLOTS = {(True, 4): 8, (True, 2): 4, (False, 4): 8, (False, 2): 8}
# The fp32 fused add of 8 chunks a thread spills (ptxas: 132-180 bytes); its two-pass loop, which reads
# the new residual back from the L2, measured faster: [8192, 16384] 982 -> 831 us, [512, 16384] 66 -> 56
# (docs/perf-notes.md v15). Shifted rows: FWD_ADD_SHIFTED_MAX_SLOTS.
FWD_ADD_MAX_SLOTS = {**FWD_MAX_SLOTS, (True, 4): 4}
# The fp16/bf16 fused add's shifted rows past 2 slots (hidden ~8190-16380) are read twice with the row cache: in 4
# slots the kernel holds x and residual on one block of 416-512 threads an SM (two blocks spill 96 bytes), and read
# twice measured faster: [2048, 12289] 122.8 -> 96.9 us, [8192, 8191] 268.6 -> 239.3, [2048, 8195] 70.3 -> 65.6
# (docs/perf-notes.md v28b).
FWD_ADD_SHIFTED_MAX_SLOTS = {**FWD_MAX_SLOTS, (True, 2): 2}


def fwd_max_slots(add: bool, shifted: bool) -> dict:
    """The register-slot table of rms_norm_fwd's rows: the planner's and all_variants' one rule."""
    if not add:
        return FWD_MAX_SLOTS
    return FWD_ADD_SHIFTED_MAX_SLOTS if shifted else FWD_ADD_MAX_SLOTS


# Threads a 16-byte row may have, by (fused add, element size), where MAX_WIDTH threads cannot hold it in
# registers (else the two-pass loop; the kernel allows 1024 for 4+ slots: FwdBounds); one block an SM.
# Measured against the two-pass loop (docs/perf-notes.md v19, v20): fp32 [4096, 24576] 410 -> 279 us, odd
# [4096, 16389] 359 -> 189 (fused add 683 -> 510); bf16 [4096, 32768] 206 -> 182-188, odd [2048, 20001]
# 140 -> 73. The fp16/bf16 fused add keeps the two-pass loop with its row cache (odd bf16 [4096, 20001]
# 415 -> 475 on 1024 threads).
FWD_MAX_WIDTH = {(False, 4): 1024, (True, 4): 1024, (False, 2): 1024, (True, 2): MAX_WIDTH}
# Rows that take up to FWD_MAX_WIDTH threads even where MAX_WIDTH holds them (in 8 chunks), by (fused add,
# element size): fp32 rows of 8K-16K elements as 1024 x 4 (Liger's launch shape) measured faster than
# 512 x 8: [8192, 16384] 367 -> 360 us (fused add 734 -> 719), odd fused add [8192, 12291] 736 -> 547; not
# odd rows of the plain forward (800 x 4 3% slower than 416 x 8 at hidden 12291), nor fp16/bf16 (1024 x 2
# 13-20% slower than 512 x 4 at hidden 16384).
FWD_WIDE_FIRST = {(False, 4): ("aligned",), (True, 4): ("aligned", "shifted")}
# The fused add's rows read twice (slots 0) keep their rounded sums in shared memory for the output pass
# (the row cache) where the block's rows take at most this many bytes, instead of reading the new residual
# again: bf16 [4096, 32768] 85% -> 96% of copy bandwidth. Rows of 80-128 KiB (2 or 1 blocks an SM) measured
# up to 10% slower with it (docs/perf-notes.md v18). The plain forward had one too (v18b) until v20 held
# every row it served in registers; it was removed in v21.
ROW_CACHE_MAX_BYTES = 64 * 1024
BWD_MAX_SLOTS = {(True, 4): 2, (True, 2): 2, (False, 4): 8, (False, 2): 8}
SHARED_ACC_LIMIT = 160 * 1024  # bytes of per-block dweight sums kept in shared memory
# Threads per block (rows of fewer threads share a block): 128 was best for the forward at every
# sweep shape, the backward prefers 256 for short rows (scripts/sweep_norm.py, docs/perf-notes.md).
FWD_BLOCK_THREADS = 128
BWD_BLOCK_THREADS = 256
DW_SPLIT = 32  # rms_norm_dw's block is (32 columns, DW_SPLIT); mirrors kernels_src/rms_norm.cu
THREADS_PER_SM = 2048
# Staged backward (rms_norm_bwd_staged, docs/perf-notes.md v9): aligned rows of at least
# STAGED_MIN_ROW_BYTES, one row per block, the next rows' dy and x copied ahead into shared memory.
# Measured on an H100 (scripts/sweep_bwd.py): 512 threads a row with 1-2 chunks each, else 1024 threads
# with 2 (fp16/bf16) or 512 with 4 (fp32); lookahead of about STAGED_LOOKAHEAD_BYTES a block, at most 3 rows.
STAGED_MIN_ROW_BYTES = 2048
STAGED_ROW_THREADS = 512
STAGED_LOOKAHEAD_BYTES = 128 * 1024
# Chunks a thread, by element size: what 128 registers hold without spilling. fp32 skips 2 chunks on 1024
# threads: 4 on 512 with LEAN measured 3-16% faster (session 20); fp16/bf16 rows that 2 on 1024 cannot
# hold, 4 on 512 cannot either.
STAGED_SLOTS = {4: (1, 4, 8), 2: (1, 2)}
STAGED_MAX_THREADS = {1: 1024, 2: 1024, 4: 512, 8: 512}  # by slots; mirrors StagedMaxThreads<NPT, false>
STAGED_STAGES = (1, 2, 3)
# Rows of several chunks a thread on 1024 threads (a power of two) whose chunks fill less than this share (%)
# of the slots take rms_norm_bwd_reread instead (by element size): bf16 [8192, 8200], 1025 chunks on 1024 x 2,
# 211 -> 169 us; [8192, 10240] (62% full) the same; [8192, 12288] (75%) 233 -> 246. On 512 threads as empty
# (bf16 rows of 4104-4912, Gemma 2's 4608) it was 12-21% slower; fp32 4100 (512 x 4) 14% slower (v23b).
STAGED_MIN_FILL_PCT = {2: 60, 4: 0}
# The LEAN variant (shorter row chain, weights held) where a resident block walks at most this many rows,
# by chunks a thread: one chunk 5-16% faster up to ~40 rows a block, 5% slower at 124 (session 19); 2
# chunks (on up to 512 threads: LEAN's launch bound) 20% faster at 8 rows a block, ±1% at 31-124 in
# bf16; fp32 rows of 4 chunks faster at every length measured; 8 chunks no faster (session 20).
STAGED_LEAN_MAX_ROWS = {1: 48, 2: 48, 4: math.inf, 8: 0}
STAGED_LEAN_MAX_THREADS = {1: 1024, 2: 512, 4: 512, 8: 512}  # mirrors StagedMaxThreads<NPT, true>
# Backward calls with a weight of at most CLUSTER_BWD_MAX_ROWS rows whose staged plan can take LEAN: one launch of
# rms_norm_bwd_cluster (one cluster of blocks, sm_90+: the first size of CLUSTER_BWD_BLOCKS with a block a row, else the
# last) instead of the staged kernel and rms_norm_dw. Up to 8 rows on 8 blocks it is 0.2-0.8 us faster on the GPU and
# ~10 us faster eager (one launch and one allocation fewer); 9-32 rows on 16 blocks (a non-portable size, which the
# kernel opts in to: _device.resident_clusters) 10-15 us faster eager, and on the GPU within 0.1 us of the two launches
# but at bf16 [32, 1024] (4.5 against 4.0 us) and fp32 [16, 8192] (7.2 against 6.6). From 64 rows the one cluster's
# SMs take longer than the two launches' whole grid (bf16 [64, 4096] 8.3 against 6.6 us; sessions 37-39).
CLUSTER_BWD_BLOCKS = (8, 16)
CLUSTER_BWD_MAX_ROWS = 32
# Large calls (v35, session 44): aligned rows that the staged kernel would walk with its long chain (each resident block
# more than STAGED_LEAN_MAX_ROWS rows, 1-2 chunks a thread) run on rms_norm_bwd_cluster instead, in clusters of
# CLUSTER_ROUNDS_BLOCKS blocks, over as many rounds of the clusters the GPU holds at once as give each block about
# CLUSTER_ROUNDS_ROWS rows (by chunks a thread): the blocks of later rounds start on the SMs that finish first (the SMs
# stream at different speeds, session 18), and a cluster leaves one partial row, so 8-block clusters write fewer
# partial rows (30 a round on an H100) than blocks in 2-4 fewer rounds would. One H100, GPU us (docs/perf-notes.md,
# v35): bf16 [32768, 4096] 300 -> 287 (89% -> 93% of copy bandwidth), [65536, 2048] 317 -> 285, [131072, 1024] 328 ->
# 285, [16384, 4096] 156 -> 151, [32768, 8192] 583 -> 574, fp16 [16384, 8192] 324 -> 295; fp16 [16384, 6144] 228 ->
# 230 (its staged plan holds 3 blocks an SM, the clusters 2). 2-chunk rows measured 1-2% slower on 16 rows a block,
# 1-chunk rows 1-2% slower on 8 or 32, and 4-block clusters within 1%; the LEAN staged plans (shorter walks) stay
# faster than any cluster grid (bf16 [8192, 4096] 82 against 87 us). CLUSTER_ROUNDS_BLOCKS = 0 turns it off (sweeps).
CLUSTER_ROUNDS_BLOCKS = 8
CLUSTER_ROUNDS_ROWS = {1: 16, 2: 32}
# Aligned rows past those (fp16/bf16 over 16384 elements, fp32 over 16384) whose stage fits in shared memory:
# rms_norm_bwd_reread (the current row read twice from its stage, only the dweight sums in registers), by
# element size: REREAD_SLOTS chunks a thread on whole warps, up to REREAD_MAX_THREADS (its launch bound).
# Before it, these rows took rms_norm_bwd's two-pass loop (rows read twice from global memory). One row
# ahead (REREAD_STAGES): 2-3 stages measured 7-12% slower at bf16 18432 and the same at 24576 and 32768
# (v22), and up to 24% slower for odd rows (bf16 8191: fewer blocks fit an SM; v23).
# Odd rows (v23, SHIFT) past the staged kernel's one chunk a thread take it too, the weight copied into shared
# memory after the stage (fp16/bf16 from ~4090 elements, fp32 from ~4095, which rms_norm_bwd's registers held).
REREAD_SLOTS = {4: 8, 2: 4}
REREAD_MAX_THREADS = 1024
# rms_norm_bwd_split's odd rows on clusters of at least CLASS_WALK_MIN_SPLIT blocks walk their rows class by class
# (v26, rms_norm.cu's CLASS_WALK_MIN_SPLIT), at most CLASS_WALK_MAX_THREADS a part (its launch bound: 96 registers,
# no spills; rms_norm.cu's RMS_CLASS_WALK_MAX_THREADS): up to ~163K elements on 8 blocks, read twice past that.
# On 2 blocks their clusters step over E rows (v25): 66 clusters become 64, and parts up to 1024 threads.
CLASS_WALK_MIN_SPLIT = 4
CLASS_WALK_MAX_THREADS = 640
REREAD_STAGES = 1
# Rows too long for one block (forward: its registers; backward: its shared memory) split over a cluster of this
# many blocks (sm_90+): rms_norm_fwd_split, rms_norm_bwd_split. The first size whose parts one block holds; 8 is the
# portable cluster limit.
SPLIT_SIZES = (2, 4, 8)
# The forward splits rows from 128 KiB: below, the two-pass loop's second read of a row mostly hits the L2 (its
# ~528 rows in flight about fit; read twice against split: fp32 fused add [4096, 20480] 96% against 93% of copy
# bandwidth, bf16 [4096, 40960] 84% against 59-75%, [4096, 49152] 75% against 67%; at 128 KiB bf16 [2048, 65536]
# 66% against 75%, the fp32 fused add [2048, 32768] 85% against 95%). The fewest blocks a cluster by (fused add,
# element size, shifted); none: not split. fp16/bf16 parts on 512 threads (4 blocks or more) measured faster than
# on 1024 (bf16 [2048, 65536]: 75% against 69%); the bf16 fused add's part spills, and the fp16 one gained 4% (not
# taken). docs/perf-notes.md, v24b. Odd rows (v25b, shifted) split the same way: fp32 [2048, 33001] 232 against 284
# us read twice, bf16 [1024, 65539] 157 against 164 (bf16 [2048, 40001], 80 KiB: 195 against 164); the fp32 fused
# add in parts of 4 slots as aligned rows (8 spill: [2048, 33001] 553 against 487), [1024, 65537] 448 against 513.
FWD_SPLIT_MIN_BLOCKS = {(False, 4, False): 2, (True, 4, False): 2, (False, 2, False): 4, (False, 4, True): 2,
                        (False, 2, True): 4, (True, 4, True): 2}
FWD_SPLIT_MIN_ROW_BYTES = 128 * 1024
SHARED_OPTIN_LIMIT = 227 * 1024  # dynamic shared memory one block may have (H100/A100: 227 / 163 KiB)
STATIC_SHARED_BYTES = 1024  # the kernels' own shared arrays, counted against the same limit
# Unaligned rows (odd hidden sizes) of at least this many bytes take the shifted 16-byte path
# (forward and backward); shorter ones stay element by element (few chunks a row: the edges dominate).
SHIFT_MIN_ROW_BYTES = 512

# Mirror NormParams, NormBwdParams and DweightParams in kernels_src/rms_norm.cu: pointers, then these.
_FWD_TAIL = struct.Struct("<5q3f")  # ..., then _scalars()
_BWD_TAIL = struct.Struct("<6q3f")
_DW_TAIL = struct.Struct("<2q")


def _scalars(eps, offset, hidden) -> tuple[float, float, float]:
    """The float parameters that end both kernels' structs: eps, offset, 1 / hidden."""
    return float(eps), float(offset), 1 / hidden


class NormPlan:
    __slots__ = ("name", "grid", "block", "vectorized", "shifted", "staged", "small", "slots", "extents", "shared_mem",
                 "shared_acc", "reread", "split", "cluster_step", "one_cluster", "cluster_rounds", "out_layouts", "launch",
                 "dw_launch", "new_output", "new_rstd", "new_dx", "new_dweight", "new_partial")

    def __init__(self, name, grid, block, vectorized, slots):
        self.name = name
        self.grid = grid
        self.block = block
        self.vectorized = vectorized
        self.slots = slots
        self.shifted = False  # rows not 16-byte aligned, moved in 16-byte chunks all the same (SHIFT)
        self.shared_mem = 0
        self.shared_acc = False  # backward: dynamic shared memory holds the rows slots' dweight sums
        self.staged = False
        self.reread = False  # backward: rms_norm_bwd_reread (staged too: one row a block, rows copied ahead)
        self.split = 1  # blocks a row is split over (a cluster: rms_norm_fwd_split, rms_norm_bwd_split)
        self.cluster_step = 1  # split: the cluster count a multiple of this where clusters walk several rows
        self.one_cluster = False  # backward: rms_norm_bwd_cluster, one launch that writes dweight itself
        self.cluster_rounds = False  # backward: rms_norm_bwd_cluster over rounds of clusters (CLUSTER_ROUNDS_BLOCKS)
        self.small = False  # forward: planned as a small input (FWD_SMALL_ELEMS_PER_THREAD)

    def __repr__(self):
        return f"NormPlan({self.name}, grid={self.grid}, block={self.block})"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_threads(n: int) -> int:
    """Threads for n chunks: a power of two up to a warp (shuffle reductions), else whole warps (a
    power of two would leave up to half of them idle: 130 chunks on 256 threads)."""
    return _next_pow2(n) if n <= 32 else -(-n // 32) * 32


def row_shape(hidden: int, elems: int, chunks_per_thread: int = 1, max_slots: int = 8,
              max_width: int = MAX_WIDTH, wide_first: bool = False) -> tuple[int, int]:
    """(threads per row, register slots per thread; 0 = two-pass loop) for a row of ``hidden`` elements
    moved ``elems`` at a time: about ``chunks_per_thread`` 16-byte chunks a thread. Up to ``max_width``
    threads where MAX_WIDTH cannot hold the row, and with ``wide_first`` where it needs 4+ slots there."""
    chunks = -(-hidden // elems)
    threads = row_threads(-(-chunks // min(chunks_per_thread, max_slots)))
    # More threads per row when the register slots cannot hold the row at this width.
    width = min(threads, MAX_WIDTH)
    needed = -(-chunks // width)
    if needed > max_slots or (wide_first and needed >= 4):
        width = min(threads, max_width)
        needed = -(-chunks // width)
    if needed > max_slots:
        return MAX_WIDTH, 0
    slots = next(s for s in REGISTER_SLOTS if s >= needed)
    return row_threads(-(-chunks // slots)), slots  # as few threads as fill those slots


def _vectorizable(arrays, row_strides, hidden, dtype) -> bool:
    """16-byte accesses need hidden a multiple of 16 bytes and every pointer (weight too) and row
    stride 16-byte aligned."""
    elems = 16 // _arrays.ITEMSIZE[dtype]
    return (
        hidden % elems == 0
        and all(a.ptr % 16 == 0 for a in arrays if a is not None)
        and all(s % elems == 0 for s in row_strides)
    )


def _shiftable(arrays, row_strides, hidden, dtype) -> bool:
    """Rows that are not 16-byte aligned still move in 16-byte chunks (the kernels' SHIFT) when every
    array's row starts at the same offset from a 16-byte boundary as the first array's, in every row."""
    itemsize = _arrays.ITEMSIZE[dtype]
    elems = 16 // itemsize
    x = arrays[0]
    return (
        hidden * itemsize >= SHIFT_MIN_ROW_BYTES
        and x.ptr % itemsize == 0
        and all((a.ptr - x.ptr) % 16 == 0 for a in arrays if a is not None)
        and all((s - row_strides[0]) % elems == 0 for s in row_strides)
    )


def _shifted_span(hidden: int, itemsize: int) -> int:
    """Elements a shifted row's 16-byte chunks cover at most: up to E - 1 more than the row (the part
    before its first 16-byte boundary)."""
    return hidden + 16 // itemsize - 1


def _row_chunks(hidden: int, itemsize: int, shifted: bool) -> int:
    """16-byte chunks a row moves in (shifted: from the boundary before the row)."""
    return -(-(_shifted_span(hidden, itemsize) if shifted else hidden) * itemsize // 16)


def _chunks_span(hidden: int, itemsize: int, shifted: bool) -> int:
    """Elements a 16-byte row's chunks cover (shifted: from the boundary before the row), in whole chunks:
    a row of the row cache or of the shifted backward's shared dweight sums (the kernel's chunks_span)."""
    elems = 16 // itemsize
    return -(-(_shifted_span(hidden, itemsize) if shifted else hidden) // elems) * elems


def _plan(kernel, dtype, weight_dtype, arrays, row_strides, rows, hidden, max_slots, elems_per_thread, block_threads,
          extra, impl, can_shift=False, max_width=MAX_WIDTH, wide_first=()):
    """can_shift: the kernel takes a last SHIFT parameter; arrays[-1] is the weight. max_width, wide_first
    (the kinds of 16-byte row, "aligned" or "shifted", that widen first): see row_shape."""
    itemsize = _arrays.ITEMSIZE[dtype]

    def shape(vec, span, kind="aligned"):  # (width, slots) for a row of `span` elements
        elems = 16 // itemsize if vec else 1
        return row_shape(span, elems, max(1, elems_per_thread // elems), max_slots[vec, itemsize],
                         max_width if vec else MAX_WIDTH, vec and kind in wide_first)

    vectorized = impl != "scalar" and _vectorizable(arrays, row_strides, hidden, dtype)
    shifted = can_shift and not vectorized and impl != "scalar" and _shiftable(arrays[:-1], row_strides, hidden, dtype)
    if shifted:
        # Rows read twice (slots 0) move in 16-byte chunks too, unless element by element holds them in
        # registers (shifted rows span up to E - 1 more elements, in fewer slots).
        width, slots = shape(True, _shifted_span(hidden, itemsize), "shifted")
        shifted = vectorized = slots > 0 or not shape(False, hidden)[1]
    if impl == "vector" and not vectorized:
        raise ValueError("impl: 'vector' needs hidden a multiple of 16 bytes and 16-byte aligned rows")
    if not shifted:
        width, slots = shape(vectorized, hidden)
    rows_per_block = max(1, block_threads // width)
    blocks = -(-rows // rows_per_block)
    flags = [*extra, "true" if shifted else "false"] if can_shift else extra
    args = ", ".join([CTYPE[dtype], CTYPE[weight_dtype], "true" if vectorized else "false", str(slots), *flags])
    plan = NormPlan(f"cupyrope::{kernel}<{args}>", blocks, (width, rows_per_block), vectorized, slots)
    plan.shifted = shifted
    return plan


def plan_forward(x, y, residual, weight, row_strides, rows, hidden, impl="auto", elems=None, clusters=False) -> NormPlan:
    """elems: elements a thread (default: the rule above). clusters: the GPU runs thread block clusters (sm_90+),
    so rows past the registers may be split over one (_plan_forward_split)."""
    arrays = [x, y, residual, weight]
    add = "true" if residual is not None else "false"
    weight_dtype = weight.dtype if weight is not None else "float32"
    itemsize = _arrays.ITEMSIZE[x.dtype]
    small = hidden * itemsize <= FWD_SMALL_ROW_BYTES and rows * hidden <= FWD_SMALL_ELEMENTS
    elems = elems or (FWD_SMALL_ELEMS_PER_THREAD if small else FWD_ELEMS_PER_THREAD)
    key = residual is not None, itemsize

    def plan_with(max_slots):
        return _plan("rms_norm_fwd", x.dtype, weight_dtype, arrays, row_strides, rows, hidden, max_slots,
                     elems, FWD_BLOCK_THREADS, [add], impl, can_shift=True, max_width=FWD_MAX_WIDTH[key],
                     wide_first=FWD_WIDE_FIRST.get(key, ()))

    plan = plan_with(FWD_MAX_SLOTS)
    add_slots = fwd_max_slots(residual is not None, plan.shifted)
    if plan.vectorized and plan.slots > add_slots[True, itemsize]:
        plan = plan_with(add_slots)
    long_row = hidden * itemsize >= FWD_SPLIT_MIN_ROW_BYTES
    min_blocks = FWD_SPLIT_MIN_BLOCKS.get((*key, plan.shifted)) if long_row else None
    if clusters and min_blocks and plan.vectorized and not plan.slots:  # else read twice
        split = _plan_forward_split(x, y, residual, weight, row_strides, rows, hidden, min_blocks, plan.shifted)
        plan = split or plan
    plan.small = small
    return plan


def _split_parts(hidden: int, itemsize: int, min_blocks: int = 1, shifted: bool = False):
    """(blocks, 16-byte chunks of the longest part) for each cluster size of SPLIT_SIZES from min_blocks: a row's
    chunks (shifted: as many as a row of any shift spans) split into parts of whole chunks, the last one shorter
    (the kernels' cluster_part)."""
    chunks = _row_chunks(hidden, itemsize, shifted)
    return [(split, -(-chunks // split)) for split in SPLIT_SIZES if split >= min_blocks]


def _plan_forward_split(x, y, residual, weight, row_strides, rows, hidden, min_blocks, shifted=False):
    """The plan of rms_norm_fwd_split: plan_forward's for the longest part of a row split over the fewest blocks
    (at least min_blocks) whose registers hold the parts (_split_parts; shifted: the part's chunks hold a shifted
    row E - 1 elements shorter than they span); its grid one cluster a row (plan_forward_for_device caps it). None
    where no cluster size does."""
    itemsize = _arrays.ITEMSIZE[x.dtype]
    elems = 16 // itemsize
    weight_dtype = weight.dtype if weight is not None else "float32"
    flags = f"{'true' if residual is not None else 'false'}, {{}}, {'true' if shifted else 'false'}"
    for split, chunks in _split_parts(hidden, itemsize, min_blocks, shifted):
        part = plan_forward(x, y, residual, weight, row_strides, rows, chunks * elems - (elems - 1 if shifted else 0))
        compiled = part.slots == _split_slots(residual is not None, itemsize) and part.block[1] == 1  # all_variants
        if compiled and part.shifted == shifted:
            plan = NormPlan(f"cupyrope::rms_norm_fwd_split<{CTYPE[x.dtype]}, {CTYPE[weight_dtype]}, {part.slots}, "
                            f"{flags.format(split)}>", rows * split, part.block, True, part.slots)
            plan.split, plan.shifted = split, shifted
            return plan
    return None


def _split_slots(add: bool, itemsize: int) -> int:
    """The register slots of the forward's split variants: the most a block's 16-byte row has (the fused add's
    fewer, FWD_ADD_MAX_SLOTS, for odd rows too: their 8 slots spill)."""
    return (FWD_ADD_MAX_SLOTS if add else FWD_MAX_SLOTS)[True, itemsize]


def _blocks_per_wave(kernel, plan, device) -> int:
    """Blocks of the plan the device's SMs hold at once (registers and shared memory decide)."""
    return sm_count(device) * resident_blocks(kernel, plan.block[0] * plan.block[1], plan.shared_mem, device)


def _waves(plan, device) -> int:
    """How many rounds of resident blocks the plan's grid takes on the device."""
    return -(-plan.grid // _blocks_per_wave(get_kernel(SOURCE, plan.name, device), plan, device))


def plan_forward_for_device(x, y, residual, weight, row_strides, rows, hidden, impl, device) -> NormPlan:
    """plan_forward's plan, or the one with twice the elements a thread where that one takes a single
    wave of blocks instead of two (the second, partial wave costs a whole row's latency: bf16 [512, 8192]
    on an H100, 512 blocks of 512 threads at 3 an SM; 256 threads with 4 chunks fit 4 an SM)."""
    plan = plan_forward(x, y, residual, weight, row_strides, rows, hidden, impl, clusters=runs_clusters(device))
    if plan.split > 1:
        if _fit_clusters(plan, get_kernel(SOURCE, plan.name, device), rows, device):
            return plan
        plan = plan_forward(x, y, residual, weight, row_strides, rows, hidden, impl)  # no cluster fits: read twice
    if plan.small or not plan.slots or _waves(plan, device) != 2:
        return plan
    wider = plan_forward(x, y, residual, weight, row_strides, rows, hidden, impl, elems=2 * FWD_ELEMS_PER_THREAD)
    return wider if wider.name != plan.name and wider.slots and _waves(wider, device) == 1 else plan


def _staged_row(itemsize: int, hidden: int, shifted: bool):
    """How rms_norm_bwd_staged takes a row of `hidden` elements by the rule above: (chunks, slots, threads), slots 0
    where the row goes to rms_norm_bwd_reread instead; None where the row is too short to stage. shifted: rows that
    are not 16-byte aligned (SHIFT), one chunk a thread only (the weight stays in registers as well)."""
    if hidden * itemsize < STAGED_MIN_ROW_BYTES:
        return None
    chunks = _row_chunks(hidden, itemsize, shifted)
    # One chunk a thread up to STAGED_ROW_THREADS, then 2 on up to 1024 threads (fp16/bf16), then 4 or 8.
    limits = {s: STAGED_ROW_THREADS if s == 1 else STAGED_MAX_THREADS[s] for s in STAGED_SLOTS[itemsize]}
    if shifted:
        limits = {1: limits[1]}
    slots = next((s for s, limit in limits.items() if s * limit >= chunks), None)
    if slots is None:
        return chunks, 0, 0
    # Several chunks a thread: a power of two of threads. Fewer threads measured +5% at bf16 [8192, 5120]
    # (320 x 2) but -10% at fp32 [8192, 5120] (640 x 2, whose 3 stages leave one block an SM).
    per_thread = -(-chunks // slots)
    width = row_threads(per_thread) if slots == 1 else _next_pow2(per_thread)
    if width == 1024 and 100 * chunks < STAGED_MIN_FILL_PCT[itemsize] * slots * width:  # mostly empty: reread
        return chunks, 0, 0
    return chunks, slots, width


def _staged_variant(dtype, weight_dtype, slots: int, shifted: bool) -> str:
    """The template arguments the staged kernels share, with `{stages}` for _staged_plan to fill."""
    return f"{CTYPE[dtype]}, {CTYPE[weight_dtype]}, {slots}, {{stages}}, {'true' if shifted else 'false'}"


def _plan_staged(dtype, weight_dtype, rows, hidden, shared_limit, shifted=False, lean=False):
    """The plan of rms_norm_bwd_staged (threads, slots and stages by _staged_row), of rms_norm_bwd_reread where the
    row goes there, or None where neither applies. lean: the LEAN variant (see lean_staged)."""
    row = _staged_row(_arrays.ITEMSIZE[dtype], hidden, shifted)
    if row is None:
        return None
    chunks, slots, width = row
    if not slots:
        return _plan_reread(dtype, weight_dtype, rows, chunks, shared_limit, shifted)
    lean = lean and width <= STAGED_LEAN_MAX_THREADS[slots]
    return _staged_plan(f"cupyrope::rms_norm_bwd_staged<{_staged_variant(dtype, weight_dtype, slots, shifted)}, "
                        f"{'true' if lean else 'false'}>", rows, width, slots, shared_limit, shifted)


def _plan_clusters(dtype, weight_dtype, rows, hidden, shared_limit, shifted, blocks):
    """The plan of rms_norm_bwd_cluster on clusters of `blocks` for rows that rms_norm_bwd_staged can take with its
    LEAN variant (each block's dweight sums after its stages; its grid for the caller to set), or None where it
    cannot, or the sums do not fit."""
    row = _staged_row(_arrays.ITEMSIZE[dtype], hidden, shifted)
    if row is None:
        return None
    _, slots, width = row
    if not (slots and STAGED_LEAN_MAX_ROWS[slots] and width <= STAGED_LEAN_MAX_THREADS[slots]):
        return None
    sums = hidden * 4
    plan = _staged_plan(f"cupyrope::rms_norm_bwd_cluster<{_staged_variant(dtype, weight_dtype, slots, shifted)}, "
                        f"{blocks}>", rows, width, slots, shared_limit - sums, shifted)
    if plan:
        plan.shared_mem += sums
        plan.split = blocks
    return plan


def _plan_one_cluster(dtype, weight_dtype, rows, hidden, shared_limit, shifted=False):
    """_plan_clusters' plan as one cluster of cluster_bwd_blocks(rows), which writes dweight itself."""
    plan = _plan_clusters(dtype, weight_dtype, rows, hidden, shared_limit, shifted, cluster_bwd_blocks(rows))
    if plan:
        plan.grid, plan.one_cluster = plan.split, True
    return plan


def _plan_reread(dtype, weight_dtype, rows, chunks, shared_limit, shifted=False, max_threads=REREAD_MAX_THREADS):
    """The plan of rms_norm_bwd_reread (see REREAD_SLOTS) for rows of `chunks` 16-byte chunks (_row_chunks), or
    None where it does not fit. Shifted rows keep a copy of the weight after the stages (from the block's shift:
    the chunks' span)."""
    itemsize = _arrays.ITEMSIZE[dtype]
    slots = REREAD_SLOTS[itemsize]
    width = row_threads(-(-chunks // slots))
    if width > max_threads:
        return None
    weight_bytes = chunks * (16 // itemsize) * _arrays.ITEMSIZE[weight_dtype] if shifted else 0
    plan = _staged_plan(f"cupyrope::rms_norm_bwd_reread<{CTYPE[dtype]}, {CTYPE[weight_dtype]}, {slots}, {{stages}}, "
                        f"{'true' if shifted else 'false'}>", rows, width, slots, shared_limit - weight_bytes, shifted,
                        REREAD_STAGES)
    if plan:
        plan.reread = True
        plan.shared_mem += weight_bytes
    return plan


def _plan_backward_split(dtype, weight_dtype, rows, hidden, shared_limit, shifted=False):
    """The plan of rms_norm_bwd_split: rms_norm_bwd_reread's plan for the longest part of a row split over the
    fewest blocks that hold the parts (_split_parts; shifted: a part's chunks as the reread kernel's shifted row,
    with the weight's copy); its grid one cluster a row (cap_split_grid caps it). None where no cluster size does.
    Shifted rows on 2 blocks: the clusters step over E rows (a cluster's rows share one shift); on more, they walk
    the rows class by class (CLASS_WALK_MIN_SPLIT)."""
    itemsize = _arrays.ITEMSIZE[dtype]
    column_parts = dict(_split_parts(hidden, itemsize))  # parts of whole E-column chunks (cluster_columns)
    for split, chunks in _split_parts(hidden, itemsize, shifted=shifted):
        walk = shifted and split >= CLASS_WALK_MIN_SPLIT
        if walk:  # parts of columns, each at the row's shift: one chunk more
            chunks = column_parts[split] + 1
        part = _plan_reread(dtype, weight_dtype, rows, chunks, shared_limit, shifted,
                            CLASS_WALK_MAX_THREADS if walk else REREAD_MAX_THREADS)
        if part:
            name = (f"cupyrope::rms_norm_bwd_split<{CTYPE[dtype]}, {CTYPE[weight_dtype]}, {part.slots}, {split}, "
                    f"{'true' if shifted else 'false'}>")
            plan = NormPlan(name, rows * split, part.block, True, part.slots)
            plan.staged = plan.reread = True
            plan.shifted = shifted
            plan.cluster_step = 16 // itemsize if shifted and not walk else 1  # rows of one shift (cap_grid)
            plan.shared_mem, plan.split = part.shared_mem, split
            return plan
    return None


def _staged_plan(name, rows, width, slots, shared_limit, shifted, max_stages=None):
    """A plan of a staged kernel (one row per block, the next rows' dy and x in shared memory), `name` with
    `{stages}` where its stage count goes: about STAGED_LOOKAHEAD_BYTES of rows ahead, at most max_stages
    (default STAGED_STAGES[-1]) and what shared memory holds; None where not even one stage fits."""
    stage_bytes = 2 * slots * width * 16
    lookahead = max(1, STAGED_LOOKAHEAD_BYTES // stage_bytes)
    stages = min(max_stages or STAGED_STAGES[-1], lookahead, shared_limit // stage_bytes)
    if stages < 1:
        return None
    plan = NormPlan(name.format(stages=stages), rows, (width, 1), True, slots)
    plan.shifted, plan.staged = shifted, True
    plan.shared_mem = stages * stage_bytes
    return plan


def plan_backward(dy, x, dx, weight, row_strides, rows, hidden, n_sm, impl="auto",
                  shared_limit=SHARED_OPTIN_LIMIT, lean=False, clusters=False, rounds=False) -> NormPlan:
    """lean: a staged plan takes the LEAN variant (the caller decides, see lean_staged). clusters: the GPU
    runs thread block clusters (sm_90+), so rows past rms_norm_bwd_reread may be split over one. rounds: aligned
    staged rows take rms_norm_bwd_cluster over rounds of clusters where it can (the caller decides, see
    takes_cluster_rounds; _resident_grid sets the grid)."""
    weight_dtype = weight.dtype if weight is not None else "float32"
    long_rows = hidden * _arrays.ITEMSIZE[x.dtype] >= LONG_ROW_BYTES
    elems = BWD_ELEMS_PER_THREAD_LONG_ROWS if long_rows else BWD_ELEMS_PER_THREAD
    plan = _plan("rms_norm_bwd", x.dtype, weight_dtype, [dy, x, dx, weight], row_strides, rows, hidden,
                 BWD_MAX_SLOTS, elems, BWD_BLOCK_THREADS, [], impl, can_shift=True)
    # rms_norm_bwd's own register prefetch (fp32 rows of up to 8 elements a thread: its PREFETCH)
    # measured a little faster than staging; everywhere else aligned rows are staged.
    prefetches = plan.vectorized and plan.slots and _arrays.ITEMSIZE[x.dtype] == 4 and plan.slots * 4 <= 8
    if plan.vectorized and not prefetches:
        if clusters and weight is not None and rows <= CLUSTER_BWD_MAX_ROWS:  # one launch, where it applies
            one = _plan_one_cluster(x.dtype, weight_dtype, rows, hidden, shared_limit, plan.shifted)
            if one:
                return one
        if rounds and weight is not None and not plan.shifted:
            many = _plan_clusters(x.dtype, weight_dtype, rows, hidden, shared_limit, False, CLUSTER_ROUNDS_BLOCKS)
            if many:
                many.cluster_rounds = True
                return many
        plan = _plan_staged(x.dtype, weight_dtype, rows, hidden, shared_limit, plan.shifted, lean) or plan
    if clusters and plan.vectorized and not (plan.staged or plan.slots):  # else read twice
        plan = _plan_backward_split(x.dtype, weight_dtype, rows, hidden, shared_limit, plan.shifted) or plan
    # One resident wave of blocks, each walking rows with a grid stride: few dweight partials.
    threads = plan.block[0] * plan.block[1]
    if plan.split > 1:  # estimate: a block an SM (_resident_grid asks the driver)
        plan.grid = cap_split_grid(plan, n_sm // plan.split, rows)
        return plan
    plan.grid = cap_grid(plan, n_sm * max(1, THREADS_PER_SM // threads), rows, x.dtype)
    if plan.staged:  # its shared memory is the stages; dweight sums stay in registers
        return plan
    # dweight sums of each rows slot, added in order at the end: in shared memory, except with one
    # slot and the sums in registers (written straight to the partial row), or rows too long for it
    # (one slot, the sums kept in the partial row), or more than this GPU lets a block have (GPUs other
    # than A100/H100 allow 64-99 KiB).
    rows_slots = plan.block[1]
    # Shifted rows read twice keep their sums from the row's shift: their chunks' span.
    span = _chunks_span(hidden, _arrays.ITEMSIZE[x.dtype], True) if plan.shifted and not plan.slots else hidden
    plan.shared_mem = rows_slots * span * 4 if weight is not None else 0
    if plan.shared_mem > min(SHARED_ACC_LIMIT, shared_limit) or (plan.slots and rows_slots == 1):
        plan.shared_mem = 0
    plan.shared_acc = plan.shared_mem > 0
    assert plan.shared_mem or rows_slots == 1 or weight is None, "rows slots would share one partial row"
    return plan


def lean_staged(plan, rows: int) -> bool:
    """Whether a staged plan whose grid is its resident blocks should take the LEAN variant: each block
    walking at most STAGED_LEAN_MAX_ROWS rows, on at most STAGED_LEAN_MAX_THREADS (by chunks a thread)."""
    if not plan.staged or plan.reread or plan.split > 1:
        return False
    return rows <= STAGED_LEAN_MAX_ROWS[plan.slots] * plan.grid and plan.block[0] <= STAGED_LEAN_MAX_THREADS[plan.slots]


def takes_cluster_rounds(plan, weighted: bool, device: int) -> bool:
    """Whether a staged plan (its grid its resident blocks) that lean_staged leaves on the long chain should be
    re-planned on rounds of clusters (CLUSTER_ROUNDS_BLOCKS): aligned rows, a weight, a GPU that runs clusters."""
    if not (CLUSTER_ROUNDS_BLOCKS and plan.staged and weighted) or plan.reread or plan.split > 1 or plan.shifted:
        return False
    return runs_clusters(device)


def cluster_rounds_grid(plan, resident: int, rows: int) -> int:
    """The grid of a plan on rounds of clusters: as many rounds of the `resident` clusters the GPU holds at once as
    give each block about CLUSTER_ROUNDS_ROWS[plan.slots] rows, at most a cluster for each plan.split rows. At least
    two clusters: rms_norm_bwd_cluster takes a grid of one cluster for the one-cluster call (dweight written in place of
    partial rows)."""
    rounds = max(1, -(-rows // (resident * plan.split * CLUSTER_ROUNDS_ROWS[plan.slots])))
    return plan.split * max(2, min(resident * rounds, -(-rows // plan.split)))


def cluster_bwd_blocks(rows: int) -> int:
    """The blocks of rms_norm_bwd_cluster's one cluster for a call of `rows` rows: the first size with a block a row."""
    return next((blocks for blocks in CLUSTER_BWD_BLOCKS if blocks >= rows), CLUSTER_BWD_BLOCKS[-1])


def cap_split_grid(plan, max_clusters: int, rows: int) -> int:
    """A split plan's grid: one cluster a row, at most max_clusters (at least one), each of plan.split blocks; where
    clusters walk several rows, a multiple of plan.cluster_step clusters (the shifted backward's, see cap_grid)."""
    clusters = max(1, min(rows, max_clusters))
    return plan.split * (_whole_steps(clusters, plan.cluster_step) if clusters < rows else clusters)


def _fit_clusters(plan, kernel, rows: int, device: int) -> bool:
    """A split plan's grid becomes the clusters the GPU holds at once: its clusters walk the rows, and one left
    for a second wave would double its rows' time. False where the driver cannot place a cluster."""
    clusters = resident_clusters(kernel, plan.split, plan.block[0], plan.shared_mem, device)
    plan.grid = cap_split_grid(plan, clusters, rows)
    return clusters > 0


def cap_grid(plan, max_blocks: int, rows: int, dtype) -> int:
    """The backward's grid: at most max_blocks (at least 1). Shifted rows: a rows slot that visits several
    rows (grid step of blocks x rows per block) keeps its columns' dweight sums in registers (rows read
    twice: in shared memory, from the row's shift), so every row it visits must start at the same offset
    from a 16-byte boundary: the step becomes a multiple of the elements in 16 bytes (the offset repeats
    with that period)."""
    grid = max(1, min(plan.grid, max_blocks))
    rows_per_block = plan.block[1]
    if plan.shifted and grid * rows_per_block < rows:
        grid = _whole_steps(grid, max(1, 16 // _arrays.ITEMSIZE[dtype] // rows_per_block))
    return grid


def _whole_steps(count: int, step: int) -> int:
    """count rounded down to a multiple of step, at least step (blocks or clusters past the last row add zero
    partials)."""
    return max(step, count // step * step)


def all_variants():
    for dtype in FLOAT_DTYPES:
        for weight in sorted({"float32", dtype}):
            for vec in ("false", "true"):
                size = (vec == "true", _arrays.ITEMSIZE[dtype])
                for slots in (0, *REGISTER_SLOTS):
                    w = f"{CTYPE[dtype]}, {CTYPE[weight]}, {vec}, {slots}"
                    shifts = ("false", "true") if vec == "true" else ("false",)
                    if slots <= FWD_MAX_SLOTS[size]:
                        for add in ("false", "true"):
                            for shift in shifts:
                                if slots > fwd_max_slots(add == "true", shift == "true")[size]:
                                    continue  # never planned: read twice instead
                                yield SOURCE, f"cupyrope::rms_norm_fwd<{w}, {add}, {shift}>"
                                min_blocks = FWD_SPLIT_MIN_BLOCKS.get((add == "true", size[1], shift == "true"))
                                if vec == "true" and min_blocks and slots == _split_slots(add == "true", size[1]):
                                    for split in (s for s in SPLIT_SIZES if s >= min_blocks):  # parts: long rows
                                        yield SOURCE, (f"cupyrope::rms_norm_fwd_split<{CTYPE[dtype]}, {CTYPE[weight]}, "
                                                       f"{slots}, {add}, {split}, {shift}>")
                    if slots <= BWD_MAX_SLOTS[size]:
                        for shift in shifts:
                            yield SOURCE, f"cupyrope::rms_norm_bwd<{w}, {shift}>"
            for slots in STAGED_SLOTS[_arrays.ITEMSIZE[dtype]]:
                for stages in STAGED_STAGES:
                    shifts = ("false", "true") if slots == 1 else ("false",)  # SHIFT: one chunk a thread
                    leans = ("false", "true") if STAGED_LEAN_MAX_ROWS[slots] else ("false",)
                    for shift, lean in itertools.product(shifts, leans):
                        yield SOURCE, (f"cupyrope::rms_norm_bwd_staged<{CTYPE[dtype]}, {CTYPE[weight]}, {slots}, "
                                       f"{stages}, {shift}, {lean}>")
                    if STAGED_LEAN_MAX_ROWS[slots]:
                        for shift, blocks in itertools.product(shifts, CLUSTER_BWD_BLOCKS):
                            yield SOURCE, (f"cupyrope::rms_norm_bwd_cluster<{CTYPE[dtype]}, {CTYPE[weight]}, {slots}, "
                                           f"{stages}, {shift}, {blocks}>")
            reread = f"{CTYPE[dtype]}, {CTYPE[weight]}, {REREAD_SLOTS[_arrays.ITEMSIZE[dtype]]}"
            for shift in ("false", "true"):
                yield SOURCE, f"cupyrope::rms_norm_bwd_reread<{reread}, {REREAD_STAGES}, {shift}>"
            for split, shift in itertools.product(SPLIT_SIZES, ("false", "true")):
                yield SOURCE, f"cupyrope::rms_norm_bwd_split<{reread}, {split}, {shift}>"
        yield SOURCE, f"cupyrope::rms_norm_dw<{CTYPE[dtype]}>"


# ---------------------------------------------------------------------------------------------- checks


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps: expected a finite number > 0, got {eps!r}")


def _check_offset(offset):
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"offset: expected a finite number, got {offset!r}")


def _check_like(a, like, like_name, name, dtype=None):
    _arrays.check_same_device(like, a, like_name, name)
    expected = dtype or like.dtype
    if a.dtype != expected:
        raise TypeError(f"{name}: expected dtype {expected} (like {like_name}), got {a.dtype}")
    if tuple(a.shape) != tuple(like.shape):
        raise ValueError(f"{name}: expected shape {tuple(like.shape)} (like {like_name}), got {tuple(a.shape)}")
    _arrays.check_last_dim_contiguous(a, name)
    return a


def _check_weight(w, like, like_name):
    if w is None:
        return None
    _arrays.check_same_device(like, w, like_name, "weight")
    if w.dtype not in ("float32", like.dtype):
        raise TypeError(f"weight: expected dtype float32 or {like.dtype} (like {like_name}), got {w.dtype}")
    if tuple(w.shape) != (like.shape[-1],):
        raise ValueError(f"weight: expected shape ({like.shape[-1]},) (the hidden size of {like_name}), got {tuple(w.shape)}")
    _arrays.check_last_dim_contiguous(w, "weight")
    return w


def _row_strides(arrays, names):
    """One row stride per array, or a ValueError when the leading dimensions are not one strided run."""
    lead = arrays[0].shape[:-1]
    dims = [(n, tuple(a.strides[j] for a in arrays)) for j, n in enumerate(lead) if n != 1]
    merged = _merge(dims)
    if len(merged) > 1:
        raise ValueError(
            f"{names[0]}: its rows (all dimensions but the last) must be evenly strided, got strides "
            f"{arrays[0].strides} for shape {arrays[0].shape}; pass a contiguous array"
        )
    return merged[0][1] if merged else tuple(arrays[0].shape[-1] for _ in arrays)


def _rows(shape) -> int:
    return math.prod(shape[:-1])


# ------------------------------------------------------------------------------------------ public API

_plans = _arrays.PlanCache()


def rms_norm(x, weight=None, eps=1e-6, *, offset=0.0, out=None, return_rstd=False, impl="auto"):
    """y = x / sqrt(mean(x^2) + eps) * (weight + offset) over the last dimension of x (..., hidden).

    weight: (hidden,), float32 or x's dtype; None means no scale. offset=1.0 gives Gemma's (1 + w).
    Accumulates in fp32 and returns x's dtype. Returns y, or (y, rstd) with rstd fp32 of shape (...).
    out: where to write y (x's shape and dtype; out=x normalizes in place).
    """
    plan = recall_options = None
    if (out is None or out is x) and type(x) in _arrays._TORCH_TYPES:  # may be recalled (_recall.py)
        recall_options = ("fwd", weight is None, out is None, eps, offset, return_rstd, impl)
        tensors = (x,) if weight is None else (x, weight)
        plan = _plans.recent["fwd"].recall(recall_options, tensors)
    if plan is not None:
        x_ptr, w_ptr = x.data_ptr(), 0 if weight is None else weight.data_ptr()
        o_ptr = 0 if out is None else x_ptr
    if plan is None or (x_ptr | w_ptr) & 15:
        x_key, x_ptr = fingerprint(x, "x")
        w_key, w_ptr = fingerprint_optional(weight, "weight")
        o_key, o_ptr = fingerprint_optional(out, "out")
        key = ("fwd", x_key, w_key, o_key, o_ptr == x_ptr, eps, offset, return_rstd, impl)
        plan = _plans.get(key)
        if plan is None:
            plan = _plan_forward_call(describe(x, "x"), describe_optional(weight, "weight"),
                                      describe_optional(out, "out"), eps, offset, return_rstd, impl)
            _plans.put(key, plan)
        if recall_options:
            _plans.recent["fwd"].remember(recall_options, tensors, (x_ptr, w_ptr), key, plan)
    out, out_ptr = _arrays.output(x, x_ptr, out, o_ptr, plan)
    rstd, rstd_ptr = plan.new_rstd(x) if return_rstd else (None, 0)
    if plan.grid:
        plan.launch(x_ptr, out_ptr, 0, w_ptr, rstd_ptr)
    return (out, rstd) if return_rstd else out


def fused_add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, impl="auto"):
    """vLLM's in-place fused residual add: residual <- x + residual (rounded to x's dtype), then
    x <- rms_norm(residual, weight, eps). Each tensor is read once and written once (rows over 64 KiB read
    the new residual a second time, mostly from the L2). Returns (x, residual)."""
    plan = recall_options = None
    if type(x) in _arrays._TORCH_TYPES:  # a repeated call may be recalled (_recall.py)
        recall_options = ("add", weight is None, eps, offset, impl)
        tensors = (x, residual) if weight is None else (x, residual, weight)
        plan = _plans.recent["add"].recall(recall_options, tensors)
    if plan is not None:
        x_ptr, r_ptr, w_ptr = x.data_ptr(), residual.data_ptr(), 0 if weight is None else weight.data_ptr()
    if plan is None or (x_ptr | r_ptr | w_ptr) & 15:
        x_key, x_ptr = fingerprint(x, "x")
        r_key, r_ptr = fingerprint(residual, "residual")
        w_key, w_ptr = fingerprint_optional(weight, "weight")
        key = ("add", x_key, r_key, w_key, eps, offset, impl)
        plan = _plans.get(key)
        if plan is None:
            plan = _plan_fused_add_call(describe(x, "x"), describe(residual, "residual"),
                                        describe_optional(weight, "weight"), eps, offset, impl)
            _plans.put(key, plan)
        if recall_options:
            _plans.recent["add"].remember(recall_options, tensors, (x_ptr, r_ptr, w_ptr), key, plan)
    if plan.grid:
        _arrays.check_disjoint(x_ptr, plan.extents[0], r_ptr, plan.extents[1], "x", "residual", "pass separate memory")
        plan.launch(x_ptr, x_ptr, r_ptr, w_ptr, 0)
    return x, residual


def rms_norm_backward(dy, x, weight=None, rstd=None, eps=1e-6, offset=0.0, *, impl="auto"):
    """Gradients of rms_norm: returns (dx, dweight); dweight is None when weight is None.

    rstd (fp32, shape x.shape[:-1], as returned by rms_norm(..., return_rstd=True)) is recomputed when
    not given. dweight is reduced in a fixed order: bitwise identical from run to run, no atomics."""
    plan = recall_options = None
    if type(dy) in _arrays._TORCH_TYPES:  # may be recalled (_recall.py)
        recall_options = ("bwd", weight is None, rstd is None, eps, offset, impl)
        tensors = (dy, x) if weight is None else (dy, x, weight)  # no generator: ~0.6 µs a call less
        if rstd is not None:
            tensors += (rstd,)
        plan = _plans.recent["bwd"].recall(recall_options, tensors)
    if plan is not None:
        d_ptr, x_ptr = dy.data_ptr(), x.data_ptr()
        w_ptr, r_ptr = 0 if weight is None else weight.data_ptr(), 0 if rstd is None else rstd.data_ptr()
    if plan is None or (d_ptr | x_ptr | w_ptr | r_ptr) & 15:
        d_key, d_ptr = fingerprint(dy, "dy")
        x_key, x_ptr = fingerprint(x, "x")
        w_key, w_ptr = fingerprint_optional(weight, "weight")
        r_key, r_ptr = fingerprint_optional(rstd, "rstd")
        key = ("bwd", d_key, x_key, w_key, r_key, eps, offset, impl)
        plan = _plans.get(key)
        if plan is None:
            plan = _plan_backward_call(describe(dy, "dy"), describe(x, "x"), describe_optional(weight, "weight"),
                                       describe_optional(rstd, "rstd"), eps, offset, impl)
            _plans.put(key, plan)
        if recall_options:
            _plans.recent["bwd"].remember(recall_options, tensors, (d_ptr, x_ptr, w_ptr, r_ptr), key, plan)
    dx, dx_ptr = plan.new_dx(x)
    dweight, dweight_ptr = plan.new_dweight(weight) if weight is not None else (None, 0)
    if not plan.grid:
        if dweight is not None and len(dweight):
            dweight[...] = 0
        return dx, dweight
    if weight is None:
        plan.launch(d_ptr, x_ptr, 0, r_ptr, dx_ptr, 0)
        return dx, None
    if plan.one_cluster:  # its last pointer is dweight
        plan.launch(d_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, dweight_ptr)
        return dx, dweight
    partial, partial_ptr = plan.new_partial(x)
    plan.launch(d_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, partial_ptr)
    plan.dw_launch(partial_ptr, dweight_ptr)
    return dx, dweight


def _plan_forward_call(xa, wa, oa, eps, offset, return_rstd, impl):
    _check_eps(eps)
    _check_offset(offset)
    _arrays.check_impl(impl)
    _arrays.check_float_input(xa, "x", "hidden")
    _check_weight(wa, xa, "x")
    if oa is not None:
        _check_like(oa, xa, "x", "out")
        check_not_overlapping(xa, oa, "x", "out", same_allowed=True)
    if xa.size:
        ya = oa if oa is not None else _arrays.contiguous_like(xa, xa.shape, xa.dtype)
        rows, hidden = _rows(xa.shape), xa.shape[-1]
        strides = _row_strides([xa, ya], ["x", "out"])
        plan = plan_forward_for_device(xa, ya, None, wa, strides, rows, hidden, impl, xa.device)
        plan.out_layouts = _arrays.out_layouts(xa, oa)
        tail = _FWD_TAIL.pack(rows, hidden, strides[0], strides[1], 0, *_scalars(eps, offset, hidden))
        plan.launch = _launch.Launch(_kernel(plan, xa.device), plan.grid, plan.block, 5, tail, xa.device, xa.kind,
                                     plan.shared_mem)
    else:
        plan = EmptyPlan()
    plan.new_output = _arrays.allocator(xa, xa.shape, xa.dtype)
    plan.new_rstd = _arrays.allocator(xa, xa.shape[:-1], "float32") if return_rstd else None
    return plan


def _plan_fused_add_call(xa, ra, wa, eps, offset, impl):
    _check_eps(eps)
    _check_offset(offset)
    _arrays.check_impl(impl)
    _arrays.check_float_input(xa, "x", "hidden")
    _check_like(ra, xa, "x", "residual")
    check_not_overlapping(xa, ra, "x", "residual")
    _check_weight(wa, xa, "x")
    if not xa.size:
        return EmptyPlan()
    rows, hidden = _rows(xa.shape), xa.shape[-1]
    strides = _row_strides([xa, ra], ["x", "residual"])
    plan = plan_forward_for_device(xa, xa, ra, wa, (strides[0], strides[0], strides[1]), rows, hidden, impl, xa.device)
    plan.shared_mem = row_cache_bytes(plan, hidden, xa.dtype, _shared_limit(xa.device))
    tail = _FWD_TAIL.pack(rows, hidden, strides[0], strides[0], strides[1], *_scalars(eps, offset, hidden))
    plan.extents = (_arrays.layout_key(xa), _arrays.layout_key(ra))
    plan.launch = _launch.Launch(_kernel(plan, xa.device), plan.grid, plan.block, 5, tail, xa.device, xa.kind,
                                 plan.shared_mem)
    return plan


def row_cache_bytes(plan, hidden: int, dtype, shared_limit: int) -> int:
    """Dynamic shared memory of a fused-add plan: its block's rows, where they are read twice (slots 0)
    and fit (ROW_CACHE_MAX_BYTES, and what the GPU gives a block); else 0 (read again). A row takes its
    chunks' span (shifted rows: from the 16-byte boundary before the row), rounded up to whole chunks."""
    itemsize = _arrays.ITEMSIZE[dtype]
    span = _chunks_span(hidden, itemsize, plan.shifted) if plan.vectorized else hidden
    nbytes = plan.block[1] * span * itemsize
    return nbytes if not plan.slots and nbytes <= min(ROW_CACHE_MAX_BYTES, shared_limit) else 0


def _shared_limit(device: int) -> int:
    """Dynamic shared memory a plan may give one block on device: its opt-in less the static arrays."""
    return shared_optin(device) - STATIC_SHARED_BYTES


def _kernel(plan, device: int):
    """plan's kernel on device, allowed the plan's dynamic shared memory."""
    kernel = get_kernel(SOURCE, plan.name, device)
    allow_shared_memory(kernel, plan.shared_mem, device)
    return kernel


def _resident_grid(plan, rows, xa):
    """plan's kernel on x's device; the plan's grid becomes one wave: as many blocks (split plans: clusters,
    _fit_clusters) as the SMs hold at once (the planner's estimate counts threads only). More would only add
    dweight partials. None where the driver cannot place a cluster."""
    kernel = _kernel(plan, xa.device)
    if plan.one_cluster:
        return kernel if resident_clusters(kernel, plan.grid, plan.block[0], plan.shared_mem, xa.device) else None
    if plan.cluster_rounds:
        resident = resident_clusters(kernel, plan.split, plan.block[0], plan.shared_mem, xa.device)
        plan.grid = cluster_rounds_grid(plan, resident, rows)
        return kernel if resident else None
    if plan.split > 1:
        return kernel if _fit_clusters(plan, kernel, rows, xa.device) else None
    plan.grid = cap_grid(plan, _blocks_per_wave(kernel, plan, xa.device), rows, xa.dtype)
    return kernel


def _plan_backward_call(da, xa, wa, ra, eps, offset, impl):
    _check_eps(eps)
    _check_offset(offset)
    _arrays.check_impl(impl)
    _arrays.check_float_input(xa, "x", "hidden")
    _check_like(da, xa, "x", "dy")
    _check_weight(wa, xa, "x")
    if ra is not None:
        _arrays.check_same_device(xa, ra, "x", "rstd")
        if ra.dtype != "float32":
            raise TypeError(f"rstd: expected dtype float32, got {ra.dtype}")
        if tuple(ra.shape) != tuple(xa.shape[:-1]):
            raise ValueError(f"rstd: expected shape {tuple(xa.shape[:-1])} (x's rows), got {tuple(ra.shape)}")
        if not _arrays.is_contiguous(ra) and ra.size > 1:
            raise ValueError(f"rstd: expected a contiguous array, got strides {tuple(ra.strides)}")
    rows, hidden = _rows(xa.shape), xa.shape[-1]
    if xa.size:
        dxa = _arrays.contiguous_like(xa, xa.shape, xa.dtype)
        strides = _row_strides([da, xa, dxa], ["dy", "x", "dx"])
        planning = (da, xa, dxa, wa, strides, rows, hidden, sm_count(xa.device), impl, _shared_limit(xa.device))
        plan = plan_backward(*planning, clusters=runs_clusters(xa.device))
        tail = _BWD_TAIL.pack(rows, hidden, strides[0], strides[1], strides[2], int(plan.shared_acc),
                              *_scalars(eps, offset, hidden))
        kernel = _resident_grid(plan, rows, xa)
        if kernel is None:  # no cluster fits: rows read twice, or two launches
            plan = plan_backward(*planning)
            kernel = _resident_grid(plan, rows, xa)
        if lean_staged(plan, rows):  # decided on the default variant's resident grid
            plan = plan_backward(*planning, lean=True)
            kernel = _resident_grid(plan, rows, xa)
        elif takes_cluster_rounds(plan, wa is not None, xa.device):
            many = plan_backward(*planning, clusters=True, rounds=True)
            many_kernel = _resident_grid(many, rows, xa) if many.cluster_rounds else None
            if many_kernel:  # else no cluster fits: the staged plan
                plan, kernel = many, many_kernel
        plan.launch = _launch.Launch(kernel, plan.grid, plan.block, 6, tail, xa.device, xa.kind, plan.shared_mem)
        if wa is not None and not plan.one_cluster:
            partials = plan.grid // plan.split  # one partial row a block, or a cluster
            dw_kernel = get_kernel(SOURCE, f"cupyrope::rms_norm_dw<{CTYPE[wa.dtype]}>", xa.device)
            plan.dw_launch = _launch.Launch(dw_kernel, -(-hidden // 32), (32, DW_SPLIT), 2,
                                            _DW_TAIL.pack(partials, hidden), xa.device, xa.kind)
            plan.new_partial = _arrays.allocator(xa, (partials, hidden), "float32")
    else:
        plan = EmptyPlan()
    plan.new_dx = _arrays.allocator(xa, xa.shape, xa.dtype)
    # Like the weight (its shape and dtype): torch's empty_like, the cheapest allocation (no shape or device
    # arguments to parse).
    plan.new_dweight = _arrays.allocator(wa, (hidden,), wa.dtype) if wa is not None else None
    return plan
