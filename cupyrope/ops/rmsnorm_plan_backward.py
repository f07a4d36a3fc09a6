"""RMSNorm backward planning: which kernel of kernels_src/rmsnorm_bwd.cu a call runs, on what grid.

dx = rstd * g - x * rstd^3 * mean(g * x), g = dy * (w + offset); dweight = sum over rows of dy * x * rstd. Every
kernel runs a grid of resident blocks (or clusters), each walking rows with a grid stride and summing dweight over
its rows in a fixed order; rms_norm_dw then adds the blocks' partial rows in a fixed order, so dweight is bitwise
the same in every run, with no atomics. Which kernel, by row:
- rms_norm_bwd: short rows (many to a block) and fp32 rows of up to 8 elements a thread, in registers;
- rms_norm_bwd_staged: aligned rows of 2 KiB or more (and odd ones of one chunk a thread), one row a block, the
  next rows' dy and x copied ahead into shared memory (cp.async); its LEAN variant (weights held in registers)
  where a block walks few rows;
- rms_norm_bwd_cluster: the staged walk on clusters of blocks (sm_90+) that add their dweight sums across the
  cluster: one cluster for calls of up to 32 rows (one launch, dweight written directly), and rounds of 8-block
  clusters for large calls, whose later rounds start on the SMs that finish first;
- rms_norm_bwd_reread: rows too long for the staged kernel's registers, read twice from their stage;
- rms_norm_bwd_split: rows too long for one block's shared memory, split over a cluster (sm_90+);
- rms_norm_bwd's read-twice loop: what is left (no clusters, or more than 8 parts).
"""

import dataclasses
import itertools
import math

from .._runtime.arrays import CTYPE, FLOAT_DTYPES, ITEMSIZE
from .._runtime.choices import choice
from .._runtime.device import resident_clusters, runs_clusters
from .rmsnorm_rows import (SHARED_OPTIN_LIMIT, SPLIT_SIZES, NormPlan, blocks_per_wave, cap_split_grid, chunks_span,
                           fit_clusters, flag, kernel_for, next_pow2, plan_rows, row_chunks, row_threads,
                           row_variant_params, runs_variant, split_parts, take_runs, whole_steps, with_flag)

SOURCE = "rmsnorm_bwd.cu"
# Elements a thread in rms_norm_bwd: fewer, fuller threads for rows of BackwardChoices.long_row_bytes or more.
BWD_ELEMS_PER_THREAD = 8
BWD_ELEMS_PER_THREAD_LONG_ROWS = 16
# rms_norm_bwd's register slots by (vectorized, element size): it keeps dy, x and the dweight sums.
BWD_MAX_SLOTS = {(True, 4): 2, (True, 2): 2, (False, 4): 8, (False, 2): 8}
SHARED_ACC_LIMIT = 160 * 1024  # bytes of per-block dweight sums kept in shared memory
BWD_BLOCK_THREADS = 256  # threads per block of rms_norm_bwd (rows of fewer threads share a block)
DW_SPLIT = 32  # rms_norm_dw's block is (32 columns, DW_SPLIT); mirrors kernels_src/rmsnorm_bwd.cu
THREADS_PER_SM = 2048
# rms_norm_bwd_staged: aligned rows of at least STAGED_MIN_ROW_BYTES, one row a block, the next rows' dy and x
# copied ahead into shared memory. 512 threads a row with 1-2 chunks each, else 1024 threads with 2 (fp16/bf16)
# or 512 with 4 (fp32); a lookahead of about STAGED_LOOKAHEAD_BYTES a block, at most 3 rows.
STAGED_MIN_ROW_BYTES = 2048
STAGED_ROW_THREADS = 512
STAGED_LOOKAHEAD_BYTES = 128 * 1024
# Chunks a thread, by element size: what 128 registers hold without spilling. fp32 skips 2 chunks on 1024
# threads: 4 on 512 with LEAN measured 3-16% faster; fp16/bf16 rows that 2 on 1024 cannot hold, 4 on 512
# cannot either.
STAGED_SLOTS = {4: (1, 4, 8), 2: (1, 2)}
STAGED_MAX_THREADS = {1: 1024, 2: 1024, 4: 512, 8: 512}  # by slots; mirrors StagedMaxThreads<NPT, false>
STAGED_STAGES = (1, 2, 3)
# The tensors a stage holds, by whether residual_grad is given (mirrors rms_norm_bwd.cu's STAGE_TENSORS<GRAD>): dy and
# x; the GRAD variants of rms_norm_bwd_staged and rms_norm_bwd_cluster stage residual_grad beside them (the same
# lookahead in bytes), rather than loading it at dx's store, where each row waited a memory round trip for it.
STAGE_TENSORS = {False: 2, True: 3}
# Rows of several chunks a thread on 1024 threads (a power of two) whose chunks fill less than this share (%)
# of the slots take rms_norm_bwd_reread instead (by element size): bf16 [8192, 8200], 1025 chunks on 1024 x 2,
# 211 -> 169 us; [8192, 10240] (62% full) the same; [8192, 12288] (75%) 233 -> 246. On 512 threads as empty
# (bf16 rows of 4104-4912, Gemma 2's 4608) it was 12-21% slower; fp32 4100 (512 x 4) 14% slower.
STAGED_MIN_FILL_PCT = {2: 60, 4: 0}
# The LEAN variant (weights held in registers) where a resident block walks at most this many rows, by
# chunks a thread: one chunk 5-16% faster up to ~40 rows a block, 5% slower at 124; 2 chunks (on up to 512
# threads: LEAN's launch bound) 20% faster at 8 rows a block, +-1% at 31-124 in bf16; fp32 rows of 4 chunks faster
# at every length measured; 8 chunks no faster.
STAGED_LEAN_MAX_ROWS = {1: 48, 2: 48, 4: math.inf, 8: 0}
STAGED_LEAN_MAX_THREADS = {1: 1024, 2: 512, 4: 512, 8: 512}  # mirrors StagedMaxThreads<NPT, true>
# Calls with a weight of at most BackwardChoices.one_cluster_max_rows rows whose staged plan can take LEAN: one
# launch of rms_norm_bwd_cluster (one cluster of blocks, sm_90+: the first size of CLUSTER_BWD_BLOCKS with a block a
# row, else the last; 16 is a non-portable size, which the kernel opts in to: device.resident_clusters) instead of
# the staged kernel and rms_norm_dw.
CLUSTER_BWD_BLOCKS = (8, 16)
# Large calls: aligned rows that the staged kernel would walk without LEAN (each resident block more than
# STAGED_LEAN_MAX_ROWS rows, 1-2 chunks a thread) run on rms_norm_bwd_cluster instead, in clusters of
# CLUSTER_ROUNDS_BLOCKS blocks, over as many rounds of the clusters the GPU holds at once as give each block about
# CLUSTER_ROUNDS_ROWS rows (by chunks a thread). The SMs stream at different speeds, and a grid of one round gives
# each the same share; with several rounds the blocks of later rounds start on the SMs that finish first. A cluster
# leaves one partial row, so 8-block clusters write fewer partial rows (30 a round on an H100) than single blocks
# over more rounds would. On an H100, GPU us: bf16 [32768, 4096] 300 -> 287 (89% -> 93% of copy bandwidth),
# [65536, 2048] 317 -> 285, [131072, 1024] 328 -> 285, [16384, 4096] 156 -> 151, [32768, 8192] 583 -> 574, fp16
# [16384, 8192] 324 -> 295; fp16 [16384, 6144] 228 -> 230 (its staged plan holds 3 blocks an SM, the clusters 2).
# 2-chunk rows measured 1-2% slower on 16 rows a block, 1-chunk rows 1-2% slower on 8 or 32, and 4-block clusters
# within 1%; the LEAN staged plans (shorter walks) stay faster than any cluster grid (bf16 [8192, 4096] 82 against
# 87 us).
CLUSTER_ROUNDS_BLOCKS = 8
CLUSTER_ROUNDS_ROWS = {1: 16, 2: 32}
# Aligned rows past those (fp16/bf16 over 16384 elements, fp32 over 16384) whose stage fits in shared memory:
# rms_norm_bwd_reread (the current row read twice from its stage, only the dweight sums in registers), by
# element size: REREAD_SLOTS chunks a thread on whole warps, up to REREAD_MAX_THREADS (its launch bound); against
# rms_norm_bwd's read-twice loop (from global memory). One row ahead (REREAD_STAGES): 2-3 stages measured 7-12%
# slower at bf16 18432 and the same at 24576 and 32768, and up to 24% slower for odd rows (bf16 8191: fewer blocks
# fit an SM). Odd rows past the staged kernel's one chunk a thread take it too, the weight copied into shared
# memory after the stage (fp16/bf16 from ~4090 elements, fp32 from ~4095).
REREAD_SLOTS = {4: 8, 2: 4}
REREAD_MAX_THREADS = 1024
REREAD_STAGES = 1
# rms_norm_bwd_split's odd rows on clusters of at least CLASS_WALK_MIN_SPLIT blocks walk their rows class by class
# (rmsnorm_bwd.cu's CLASS_WALK_MIN_SPLIT), at most CLASS_WALK_MAX_THREADS a part (its launch bound: 96 registers,
# no spills; rmsnorm_bwd.cu's CLASS_WALK_MAX_THREADS): up to ~163K elements on 8 blocks, read twice past that.
# On 2 blocks their clusters step over E rows: 66 clusters become 64, and parts up to 1024 threads.
CLASS_WALK_MIN_SPLIT = 4
CLASS_WALK_MAX_THREADS = 640


@dataclasses.dataclass(frozen=True)
class BackwardChoices:
    """The RMSNorm backward's measured launch choices: a launch profile's "rms_norm_backward" section.

    long_row_bytes: rms_norm_bwd takes BWD_ELEMS_PER_THREAD_LONG_ROWS elements a thread on rows of at least this
      many bytes (fewer, fuller threads), BWD_ELEMS_PER_THREAD below.
    one_cluster_max_rows: calls of at most this many rows (with a weight, on sm_90+) take one launch of one
      cluster, which also writes dweight. On an H100, up to 8 rows on 8 blocks it is 0.2-0.8 us faster on the GPU
      and ~10 us faster eager (one launch and one allocation fewer); 9-32 rows on 16 blocks 10-15 us faster eager,
      and on the GPU within 0.1 us of the two launches but at bf16 [32, 1024] (4.5 against 4.0 us) and fp32
      [16, 8192] (7.2 against 6.6). From 64 rows the one cluster's SMs take longer than the two launches' whole
      grid (bf16 [64, 4096] 8.3 against 6.6 us). The kernel is tested up to 64 rows (4 a block).
    grad_lean_max_rows: with residual_grad (add_rms_norm's backward), staged rows of one chunk a thread take the
      LEAN walk where each resident block walks at most this many rows; past it, rounds of clusters
      (STAGED_LEAN_MAX_ROWS is the plain backward's limit). On an H200, residual_grad staged with dy and x: LEAN at
      any length, bf16 [32768, 4096] 263.8 us against 318.2 on rounds of clusters (8-32 rows a block: 307-341) and
      285.2 staged without LEAN; [65536, 2048] 260.9 against 296.9. The H100's profile keeps the plain limit (not
      measured there).
    """

    long_row_bytes: int = choice(0, 1 << 20)
    one_cluster_max_rows: int = choice(0, 4 * CLUSTER_BWD_BLOCKS[-1])
    grad_lean_max_rows: int = choice(0, 1 << 20)


def _staged_row(itemsize: int, hidden: int, shifted: bool):
    """How rms_norm_bwd_staged takes a row of `hidden` elements by the rule above: (chunks, slots, threads), slots 0
    where the row goes to rms_norm_bwd_reread instead; None where the row is too short to stage. shifted: rows that
    are not 16-byte aligned (SHIFT), one chunk a thread only (the weight stays in registers as well)."""
    if hidden * itemsize < STAGED_MIN_ROW_BYTES:
        return None
    chunks = row_chunks(hidden, itemsize, shifted)
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
    width = row_threads(per_thread) if slots == 1 else next_pow2(per_thread)
    if width == 1024 and 100 * chunks < STAGED_MIN_FILL_PCT[itemsize] * slots * width:  # mostly empty: reread
        return chunks, 0, 0
    return chunks, slots, width


def _staged_variant(dtype, weight_dtype, slots: int, shifted: bool) -> str:
    """The template arguments the staged kernels share, with `{stages}` for _staged_plan to fill."""
    return f"{CTYPE[dtype]}, {CTYPE[weight_dtype]}, {slots}, {{stages}}, {flag(shifted)}"


def _plan_staged(dtype, weight_dtype, rows, hidden, shared_limit, shifted=False, lean=False, grad=False):
    """The plan of rms_norm_bwd_staged (threads, slots and stages by _staged_row), of rms_norm_bwd_reread where the
    row goes there, or None where neither applies. lean: the LEAN variant (see lean_staged). grad: the GRAD variant,
    whose stages hold residual_grad too (STAGE_TENSORS)."""
    row = _staged_row(ITEMSIZE[dtype], hidden, shifted)
    if row is None:
        return None
    chunks, slots, width = row
    if not slots:
        return _plan_reread(dtype, weight_dtype, rows, chunks, shared_limit, shifted)
    lean = lean and width <= STAGED_LEAN_MAX_THREADS[slots]
    return _staged_plan(f"cupyrope::rms_norm_bwd_staged<{_staged_variant(dtype, weight_dtype, slots, shifted)}, "
                        f"{flag(lean)}>", rows, width, slots, shared_limit, shifted, grad=grad)


def _plan_clusters(dtype, weight_dtype, rows, hidden, shared_limit, shifted, blocks, grad=False):
    """The plan of rms_norm_bwd_cluster on clusters of `blocks` for rows that rms_norm_bwd_staged can take with its
    LEAN variant (each block's dweight sums after its stages; its grid for the caller to set), or None where it
    cannot, or the sums do not fit."""
    row = _staged_row(ITEMSIZE[dtype], hidden, shifted)
    if row is None:
        return None
    _, slots, width = row
    if not (slots and STAGED_LEAN_MAX_ROWS[slots] and width <= STAGED_LEAN_MAX_THREADS[slots]):
        return None
    sums = hidden * 4
    plan = _staged_plan(f"cupyrope::rms_norm_bwd_cluster<{_staged_variant(dtype, weight_dtype, slots, shifted)}, "
                        f"{blocks}>", rows, width, slots, shared_limit - sums, shifted, grad=grad)
    if plan:
        plan.shared_mem += sums
        plan.split = blocks
    return plan


def _plan_one_cluster(dtype, weight_dtype, rows, hidden, shared_limit, shifted=False, grad=False):
    """_plan_clusters' plan as one cluster of cluster_bwd_blocks(rows), which writes dweight itself."""
    plan = _plan_clusters(dtype, weight_dtype, rows, hidden, shared_limit, shifted, cluster_bwd_blocks(rows), grad)
    if plan:
        plan.grid, plan.one_cluster = plan.split, True
    return plan


def _plan_reread(dtype, weight_dtype, rows, chunks, shared_limit, shifted=False, max_threads=REREAD_MAX_THREADS):
    """The plan of rms_norm_bwd_reread (see REREAD_SLOTS) for rows of `chunks` 16-byte chunks (row_chunks), or
    None where it does not fit. Shifted rows keep a copy of the weight after the stages (from the block's shift:
    the chunks' span)."""
    itemsize = ITEMSIZE[dtype]
    slots = REREAD_SLOTS[itemsize]
    width = row_threads(-(-chunks // slots))
    if width > max_threads:
        return None
    weight_bytes = chunks * (16 // itemsize) * ITEMSIZE[weight_dtype] if shifted else 0
    plan = _staged_plan(f"cupyrope::rms_norm_bwd_reread<{CTYPE[dtype]}, {CTYPE[weight_dtype]}, {slots}, {{stages}}, "
                        f"{flag(shifted)}>", rows, width, slots, shared_limit - weight_bytes, shifted,
                        REREAD_STAGES)
    if plan:
        plan.reread = True
        plan.shared_mem += weight_bytes
    return plan


def _plan_backward_split(dtype, weight_dtype, rows, hidden, shared_limit, shifted=False):
    """The plan of rms_norm_bwd_split: rms_norm_bwd_reread's plan for the longest part of a row split over the
    fewest blocks that hold the parts (split_parts; shifted: a part's chunks as the reread kernel's shifted row,
    with the weight's copy); its grid one cluster a row (cap_split_grid caps it). None where no cluster size does.
    Shifted rows on 2 blocks: the clusters step over E rows (a cluster's rows share one shift); on more, they walk
    the rows class by class (CLASS_WALK_MIN_SPLIT)."""
    itemsize = ITEMSIZE[dtype]
    column_parts = dict(split_parts(hidden, itemsize))  # parts of whole E-column chunks (cluster_columns)
    for split, chunks in split_parts(hidden, itemsize, shifted=shifted):
        walk = shifted and split >= CLASS_WALK_MIN_SPLIT
        if walk:  # parts of columns, each at the row's shift: one chunk more
            chunks = column_parts[split] + 1
        part = _plan_reread(dtype, weight_dtype, rows, chunks, shared_limit, shifted,
                            CLASS_WALK_MAX_THREADS if walk else REREAD_MAX_THREADS)
        if part:
            name = (f"cupyrope::rms_norm_bwd_split<{CTYPE[dtype]}, {CTYPE[weight_dtype]}, {part.slots}, {split}, "
                    f"{flag(shifted)}>")
            plan = NormPlan(SOURCE, name, rows * split, part.block, True, part.slots)
            plan.staged = plan.reread = True
            plan.shifted = shifted
            plan.cluster_step = 16 // itemsize if shifted and not walk else 1  # rows of one shift (cap_grid)
            plan.shared_mem, plan.split = part.shared_mem, split
            return plan
    return None


def _staged_plan(name, rows, width, slots, shared_limit, shifted, max_stages=None, grad=False):
    """A plan of a staged kernel (one row per block, the next rows' dy and x in shared memory, and with grad their
    residual_grad: STAGE_TENSORS), `name` with `{stages}` where its stage count goes: about
    STAGED_LOOKAHEAD_BYTES of rows ahead, at most max_stages (default STAGED_STAGES[-1]) and what shared memory
    holds; None where not even one stage fits."""
    stage_bytes = STAGE_TENSORS[grad] * slots * width * 16
    lookahead = max(1, STAGED_LOOKAHEAD_BYTES // stage_bytes)
    stages = min(max_stages or STAGED_STAGES[-1], lookahead, shared_limit // stage_bytes)
    if stages < 1:
        return None
    plan = NormPlan(SOURCE, name.format(stages=stages), rows, (width, 1), True, slots)
    plan.shifted, plan.staged = shifted, True
    plan.shared_mem = stages * stage_bytes
    return plan


def plan_backward(dy, x, dx, weight, row_strides, rows, hidden, n_sm, impl="auto",
                  shared_limit=SHARED_OPTIN_LIMIT, lean=False, clusters=False, rounds=False, *,
                  choices: BackwardChoices, residual_grad=None, runs=False) -> NormPlan:
    """choices: the launch profile's. lean: a staged plan takes the LEAN variant (the caller decides, see
    lean_staged). clusters: the GPU runs thread block clusters (sm_90+), so rows past rms_norm_bwd_reread may be
    split over one. rounds: aligned staged rows take rms_norm_bwd_cluster over rounds of clusters where it can (the
    caller decides, see takes_cluster_rounds; resident_grid sets the grid). residual_grad: the array added to dx
    (add_rms_norm's backward), or None; with it, row_strides has its stride last, and the plan the kernel's GRAD
    variant (its last template argument: every kernel's same rows and launch, and a load more a chunk). runs: rows in
    runs (RowLayout; no residual_grad), which rms_norm_bwd_runs takes where rows are held in registers (take_runs)."""
    plan = _plan_rows_kernel(dy, x, dx, weight, row_strides, rows, hidden, n_sm, impl, shared_limit, lean, clusters,
                             rounds, choices, residual_grad, runs)
    if runs:
        return take_runs(plan, hidden)
    plan.name = with_flag(plan.name, residual_grad is not None)
    return plan


def _plan_rows_kernel(dy, x, dx, weight, row_strides, rows, hidden, n_sm, impl, shared_limit, lean, clusters, rounds,
                      choices, residual_grad, runs) -> NormPlan:
    """plan_backward's plan, its kernel named without GRAD."""
    weight_dtype = weight.dtype if weight is not None else "float32"
    long_rows = hidden * ITEMSIZE[x.dtype] >= choices.long_row_bytes
    elems = BWD_ELEMS_PER_THREAD_LONG_ROWS if long_rows else BWD_ELEMS_PER_THREAD
    rows_arrays = [dy, x, dx] + ([] if residual_grad is None else [residual_grad])
    plan = plan_rows(SOURCE, "rms_norm_bwd", x.dtype, weight_dtype, [*rows_arrays, weight], row_strides, rows, hidden,
                     BWD_MAX_SLOTS, elems, BWD_BLOCK_THREADS, [], impl, can_shift=True)
    # rms_norm_bwd's own register prefetch (fp32 rows of up to 8 elements a thread: its PREFETCH)
    # measured a little faster than staging; everywhere else aligned rows are staged.
    prefetches = plan.vectorized and plan.slots and ITEMSIZE[x.dtype] == 4 and plan.slots * 4 <= 8
    grad = residual_grad is not None
    if plan.vectorized and not prefetches and not runs:
        if clusters and weight is not None and rows <= choices.one_cluster_max_rows:  # one launch, where it applies
            one = _plan_one_cluster(x.dtype, weight_dtype, rows, hidden, shared_limit, plan.shifted, grad)
            if one:
                return one
        if rounds and weight is not None and not plan.shifted:
            many = _plan_clusters(x.dtype, weight_dtype, rows, hidden, shared_limit, False, CLUSTER_ROUNDS_BLOCKS,
                                  grad)
            if many:
                many.cluster_rounds = True
                return many
        plan = _plan_staged(x.dtype, weight_dtype, rows, hidden, shared_limit, plan.shifted, lean, grad) or plan
    if clusters and plan.vectorized and not (plan.staged or plan.slots or runs):  # else read twice
        plan = _plan_backward_split(x.dtype, weight_dtype, rows, hidden, shared_limit, plan.shifted) or plan
    # One resident wave of blocks, each walking rows with a grid stride: few dweight partials.
    threads = plan.block[0] * plan.block[1]
    if plan.split > 1:  # estimate: a block an SM (resident_grid asks the driver)
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
    span = chunks_span(hidden, ITEMSIZE[x.dtype], True) if plan.shifted and not plan.slots else hidden
    plan.shared_mem = rows_slots * span * 4 if weight is not None else 0
    if plan.shared_mem > min(SHARED_ACC_LIMIT, shared_limit) or (plan.slots and rows_slots == 1):
        plan.shared_mem = 0
    plan.shared_acc = plan.shared_mem > 0
    assert plan.shared_mem or rows_slots == 1 or weight is None, "rows slots would share one partial row"
    return plan


def lean_staged(plan, rows: int, max_rows=None) -> bool:
    """Whether a staged plan whose grid is its resident blocks should take the LEAN variant: each block
    walking at most max_rows rows (default STAGED_LEAN_MAX_ROWS), on at most STAGED_LEAN_MAX_THREADS (by chunks a
    thread)."""
    if not plan.staged or plan.reread or plan.split > 1:
        return False
    limit = STAGED_LEAN_MAX_ROWS[plan.slots] if max_rows is None else max_rows
    return rows <= limit * plan.grid and plan.block[0] <= STAGED_LEAN_MAX_THREADS[plan.slots]


def takes_cluster_rounds(plan, weighted: bool, device: int) -> bool:
    """Whether a staged plan (its grid its resident blocks) that lean_staged leaves without LEAN should be
    re-planned on rounds of clusters (CLUSTER_ROUNDS_BLOCKS): aligned rows, a weight, a GPU that runs clusters."""
    if not (plan.staged and weighted) or plan.reread or plan.split > 1 or plan.shifted:
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


def cap_grid(plan, max_blocks: int, rows: int, dtype) -> int:
    """A grid whose blocks walk rows (the backwards', rms_norm_fp8's): at most max_blocks (at least 1), the blocks
    the GPU holds at once. Shifted rows (the RMSNorm backward's): a rows slot that visits several
    rows (grid step of blocks x rows per block) keeps its columns' dweight sums in registers (rows read
    twice: in shared memory, from the row's shift), so every row it visits must start at the same offset
    from a 16-byte boundary: the step becomes a multiple of the elements in 16 bytes (the offset repeats
    with that period)."""
    grid = max(1, min(plan.grid, max_blocks))
    rows_per_block = plan.block[1]
    if plan.shifted and grid * rows_per_block < rows:
        grid = whole_steps(grid, max(1, 16 // ITEMSIZE[dtype] // rows_per_block))
    return grid


def resident_grid(plan, rows: int, device: int, dtype):
    """plan's kernel on the device; the plan's grid becomes one wave: as many blocks (split plans: clusters,
    fit_clusters) as the SMs hold at once (the planner's estimate counts threads only). More would only add
    dweight partials. None where the driver cannot place a cluster."""
    kernel = kernel_for(plan, device)
    if plan.one_cluster:
        return kernel if resident_clusters(kernel, plan.grid, plan.block[0], plan.shared_mem, device) else None
    if plan.cluster_rounds:
        resident = resident_clusters(kernel, plan.split, plan.block[0], plan.shared_mem, device)
        plan.grid = cluster_rounds_grid(plan, resident, rows)
        return kernel if resident else None
    if plan.split > 1:
        return kernel if fit_clusters(plan, kernel, rows, device) else None
    plan.grid = cap_grid(plan, blocks_per_wave(kernel, plan, device), rows, dtype)
    return kernel


def fitted_to_device(plan_with, rows: int, device: int, dtype):
    """(plan, its kernel): plan_with(clusters=...)'s plan where the device runs clusters, its grid fitted to what the
    device holds at once (resident_grid), else, where the driver places none of its clusters, the plan without
    clusters. RMSNorm's and LayerNorm's backward calls."""
    plan = plan_with(clusters=runs_clusters(device))
    kernel = resident_grid(plan, rows, device, dtype)
    if kernel is None:
        plan = plan_with(clusters=False)
        kernel = resident_grid(plan, rows, device, dtype)
    return plan, kernel


def plan_backward_for_device(dy, x, dx, weight, row_strides, rows, hidden, n_sm, impl, shared_limit, device,
                             choices, residual_grad=None, runs=False):
    """(plan, its kernel) of a checked backward call on the device: plan_backward's, with its grid fitted to what
    the device holds at once, then re-planned where that grid decides (lean_staged, takes_cluster_rounds) or where
    no cluster fits."""
    planning = (dy, x, dx, weight, row_strides, rows, hidden, n_sm, impl, shared_limit)
    options = {"choices": choices, "residual_grad": residual_grad, "runs": runs}
    # where no cluster fits: rows read twice, or two launches
    plan, kernel = fitted_to_device(lambda clusters: plan_backward(*planning, clusters=clusters, **options), rows,
                                    device, x.dtype)
    grad_rows = choices.grad_lean_max_rows if residual_grad is not None and plan.slots == 1 else None
    if lean_staged(plan, rows, grad_rows):  # decided on the default variant's resident grid
        plan = plan_backward(*planning, lean=True, **options)
        kernel = resident_grid(plan, rows, device, x.dtype)
    elif takes_cluster_rounds(plan, weight is not None, device):
        many = plan_backward(*planning, clusters=True, rounds=True, **options)
        many_kernel = resident_grid(many, rows, device, x.dtype) if many.cluster_rounds else None
        if many_kernel:  # else no cluster fits: the staged plan
            plan, kernel = many, many_kernel
    return plan, kernel


def _register_kernel(dtype, weight, vec, slots, shift) -> str:
    """rms_norm_bwd's name without GRAD (runs_variant makes rms_norm_bwd_runs' from it)."""
    return f"cupyrope::rms_norm_bwd<{CTYPE[dtype]}, {CTYPE[weight]}, {flag(vec)}, {slots}, {flag(shift)}>"


def dweight_kernel_name(weight_dtype: str) -> str:
    return f"cupyrope::rms_norm_dw<{CTYPE[weight_dtype]}>"


def variants():
    """Every backward kernel the planner can ask for: each row kernel with and without GRAD, and rms_norm_dw."""
    for source, name in _variants_without_grad():
        if name.startswith("cupyrope::rms_norm_dw"):
            yield source, name
        else:
            yield source, with_flag(name, False)
            yield source, with_flag(name, True)
    for dtype, weight, vec, slots in row_variant_params(BWD_MAX_SLOTS):  # rows in runs: held in registers
        for shift in ((False, True) if vec else (False,)) if slots else ():
            yield SOURCE, runs_variant(_register_kernel(dtype, weight, vec, slots, shift))


def _variants_without_grad():
    for dtype, weight, vec, slots in row_variant_params(BWD_MAX_SLOTS):
        for shift in (False, True) if vec else (False,):
            yield SOURCE, _register_kernel(dtype, weight, vec, slots, shift)
    for dtype in FLOAT_DTYPES:
        itemsize = ITEMSIZE[dtype]
        for weight in sorted({"float32", dtype}):
            for slots in STAGED_SLOTS[itemsize]:
                for stages in STAGED_STAGES:
                    shifts = (False, True) if slots == 1 else (False,)  # SHIFT: one chunk a thread
                    leans = (False, True) if STAGED_LEAN_MAX_ROWS[slots] else (False,)
                    for shift, lean in itertools.product(shifts, leans):
                        yield SOURCE, (f"cupyrope::rms_norm_bwd_staged<{CTYPE[dtype]}, {CTYPE[weight]}, {slots}, "
                                       f"{stages}, {flag(shift)}, {flag(lean)}>")
                    if STAGED_LEAN_MAX_ROWS[slots]:
                        for shift, blocks in itertools.product(shifts, CLUSTER_BWD_BLOCKS):
                            yield SOURCE, (f"cupyrope::rms_norm_bwd_cluster<{CTYPE[dtype]}, {CTYPE[weight]}, "
                                           f"{slots}, {stages}, {flag(shift)}, {blocks}>")
            reread = f"{CTYPE[dtype]}, {CTYPE[weight]}, {REREAD_SLOTS[itemsize]}"
            for shift in (False, True):
                yield SOURCE, f"cupyrope::rms_norm_bwd_reread<{reread}, {REREAD_STAGES}, {flag(shift)}>"
            for split, shift in itertools.product(SPLIT_SIZES, (False, True)):
                yield SOURCE, f"cupyrope::rms_norm_bwd_split<{reread}, {split}, {flag(shift)}>"
        yield SOURCE, dweight_kernel_name(dtype)
