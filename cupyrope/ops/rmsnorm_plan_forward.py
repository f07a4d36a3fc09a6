"""RMSNorm forward (and fused residual add) planning: which rms_norm_fwd variant a call runs, on what grid
(kernels_src/rmsnorm_fwd.cu).

A row is held in registers whenever its block's threads can hold it: one read of x (and residual), one write of
y. Rows past that are read twice, the second read mostly from the L2 (the fused add keeps its new residual in
shared memory for the second pass: the row cache); rows of 128 KiB and more split over a cluster of blocks on
sm_90+ (rms_norm_fwd_split), each block holding a part of the row in registers.

Batch invariance: a row's threads, chunks a thread and kernel follow from its size, dtype, alignment and the launch
profile only, never from the number of rows, so each row's sum of squares adds the same terms in the same order in
every call (docs/design.md, "Batch invariance").
"""

import dataclasses

from .._runtime.arrays import CTYPE, ITEMSIZE
from .._runtime.choices import choice
from .._runtime.compile import get_kernel
from .._runtime.device import runs_clusters
from .rmsnorm_rows import (MAX_WIDTH, SHARED_OPTIN_LIMIT, SPLIT_SIZES, NormPlan, chunks_span,
                           fit_clusters, flag, plan_rows, row_variant_params, runs_variant, split_parts, take_runs,
                           with_flag)

SOURCE = "rmsnorm_fwd.cu"
# Elements a thread: 16 (one 16-byte chunk of fp32, two of fp16/bf16... up to the register slots) measured best.
FWD_ELEMS_PER_THREAD = 16
# Short rows (ForwardChoices.small_row_bytes): FWD_SMALL_ELEMS_PER_THREAD, i.e. one 16-byte
# chunk a thread where rows are vectorized, whose weight the kernel then loads with x rather than after the
# reduction (one memory round trip less on the critical path of a grid that is mostly latency); 4 elements a thread
# where rows go element by element (8 measured slower in fp32, 2 and 16 in bf16).
FWD_SMALL_ELEMS_PER_THREAD = 4
# Register slots (one 16-byte access when vectorized, one element otherwise) by (vectorized, element
# size): the most that 64 registers hold without spilling (ptxas -v). Scalar slots cover odd hidden sizes up
# to 4096 in registers.
FWD_MAX_SLOTS = {(True, 4): 8, (True, 2): 4, (False, 4): 8, (False, 2): 8}
# The fp32 fused add of 8 chunks a thread spills (ptxas: 132-180 bytes); reading the new residual back from the
# L2 measured faster: [8192, 16384] 982 -> 831 us, [512, 16384] 66 -> 56.
FWD_ADD_MAX_SLOTS = {**FWD_MAX_SLOTS, (True, 4): 4}
# The fp16/bf16 fused add's shifted rows past 2 slots (hidden ~8190-16380) are read twice with the row cache: in 4
# slots the kernel holds x and residual on one block of 416-512 threads an SM (two blocks spill 96 bytes), and read
# twice measured faster: [2048, 12289] 122.8 -> 96.9 us, [8192, 8191] 268.6 -> 239.3, [2048, 8195] 70.3 -> 65.6.
FWD_ADD_SHIFTED_MAX_SLOTS = {**FWD_MAX_SLOTS, (True, 2): 2}
# Threads a 16-byte row may have, by (fused add, element size), where MAX_WIDTH threads cannot hold it in
# registers (else it is read twice; the kernel allows 1024 for 4+ slots: FwdBounds); one block an SM.
# Against reading twice: fp32 [4096, 24576] 410 -> 279 us, odd [4096, 16389] 359 -> 189 (fused add 683 -> 510);
# bf16 [4096, 32768] 206 -> 182-188, odd [2048, 20001] 140 -> 73. The fp16/bf16 fused add keeps reading twice
# with its row cache (odd bf16 [4096, 20001] 415 -> 475 on 1024 threads).
FWD_MAX_WIDTH = {(False, 4): 1024, (True, 4): 1024, (False, 2): 1024, (True, 2): MAX_WIDTH}
# Rows that take up to FWD_MAX_WIDTH threads even where MAX_WIDTH holds them (in 8 chunks), by (fused add,
# element size): fp32 rows of 8K-16K elements as 1024 x 4 measured faster than 512 x 8: [8192, 16384]
# 367 -> 360 us (fused add 734 -> 719), odd fused add [8192, 12291] 736 -> 547; not odd rows of the plain
# forward (800 x 4 3% slower than 416 x 8 at hidden 12291), nor fp16/bf16 (1024 x 2 13-20% slower than 512 x 4
# at hidden 16384).
FWD_WIDE_FIRST = {(False, 4): ("aligned",), (True, 4): ("aligned", "shifted")}
# Threads per block (rows of fewer threads share a block): 128 was best at every shape measured.
FWD_BLOCK_THREADS = 128
# Rows of at least ForwardChoices.split_min_row_bytes split over a cluster, in at least this many blocks by (fused
# add, element size, shifted); none: not split. fp16/bf16 parts on 512 threads (4 blocks or more) measured faster
# than on 1024 (bf16 [2048, 65536]: 75% against 69% of copy bandwidth); the bf16 fused add's part spills. Odd rows
# split the same way: fp32 [2048, 33001] 232 against 284 us read twice, bf16 [1024, 65539] 157 against 164; the fp32
# fused add in parts of 4 slots as aligned rows (8 spill), [1024, 65537] 448 against 513.
FWD_SPLIT_MIN_BLOCKS = {(False, 4, False): 2, (True, 4, False): 2, (False, 2, False): 4, (False, 4, True): 2,
                        (False, 2, True): 4, (True, 4, True): 2}


@dataclasses.dataclass(frozen=True)
class ForwardChoices:
    """The RMSNorm forward's measured launch choices: a launch profile's "rms_norm_forward" section.

    small_row_bytes: rows of at most this many bytes take FWD_SMALL_ELEMS_PER_THREAD elements a thread (the
      shortest latency chain: decode-sized calls), longer rows FWD_ELEMS_PER_THREAD. By row size alone, so that
      a row reduces in the same order whatever the number of rows (batch invariance).
    row_cache_max_bytes: the fused add's rows read twice keep their rounded sums in shared memory for the output
      pass (the row cache) where the block's rows take at most this many bytes, instead of reading the new residual
      again (bf16 [4096, 32768] 85% -> 96% of copy bandwidth on an H100; rows of 80-128 KiB, 2 or 1 blocks an SM,
      up to 10% slower with it).
    split_min_row_bytes: rows of at least this many bytes split over a cluster (sm_90+). Below, the second read of
      a row read twice mostly hits the L2 (on an H100 its ~528 rows in flight about fit: fp32 fused add
      [4096, 20480] 96% against 93%, bf16 [4096, 40960] 84% against 59-75%; at 128 KiB bf16 [2048, 65536] 66%
      against 75%, the fp32 fused add [2048, 32768] 85% against 95%).
    fp8_elems_per_thread, fp8_token_elems_per_thread: elements a thread of rms_norm_fp8's 16-byte fp16/bf16 rows
      longer than small_row_bytes, with a static scale or scales by group, and with a scale a row (rmsnorm_plan_fp8.py;
      other rows take FWD_ELEMS_PER_THREAD). On an H200, 32 against 16 (bf16, GPU us): a static scale [8192, 7168]
      47.3 -> 43.5, [32768, 4096] 98.1 -> 94.2, groups of 128 56.5 -> 51.3 and 122.3 -> 107.8 (of 64 alike), [4096,
      4096] 17.5 -> 16.7; but calls of 1-64 rows of 4096 0.3 us slower with a static scale (1.61 -> 1.86 at one row)
      and 0.75 us with groups (1.78 -> 2.53), and a scale a row 51.9 -> 64.3 and 110.1 -> 125.7 (its 4-slot rows
      take 63 registers). The H100's profile takes the H200's values (not measured there).
    """

    small_row_bytes: int = choice(0, 16384)
    row_cache_max_bytes: int = choice(0, SHARED_OPTIN_LIMIT)
    split_min_row_bytes: int = choice(16384, 1 << 30)
    fp8_elems_per_thread: int = choice(8, 64)
    fp8_token_elems_per_thread: int = choice(8, 64)


def fwd_max_slots(add: bool, shifted: bool) -> dict:
    """The register-slot table of rms_norm_fwd's rows: the planner's and the variant list's one rule."""
    if not add:
        return FWD_MAX_SLOTS
    return FWD_ADD_SHIFTED_MAX_SLOTS if shifted else FWD_ADD_MAX_SLOTS


def plan_forward(x, y, residual, weight, row_strides, rows, hidden, impl="auto", clusters=False, *,
                 choices: ForwardChoices, residual_out=None, runs=False) -> NormPlan:
    """clusters: the GPU runs thread block clusters (sm_90+), so rows past the registers may be split over one
    (plan_forward_split). choices: the launch profile's. residual_out: where the fused add writes x + residual
    (add_rms_norm; None: into residual, in place); row_strides then has four strides (x, y, residual, residual_out)
    and the plan names the kernel's OUT variant (its last template argument). runs: rows in runs (RowLayout; no
    residual), which rms_norm_fwd_runs takes where rows are held in registers (take_runs)."""
    arrays = [x, y, residual, residual_out, weight]
    add = flag(residual is not None)
    weight_dtype = weight.dtype if weight is not None else "float32"
    itemsize = ITEMSIZE[x.dtype]
    small = hidden * itemsize <= choices.small_row_bytes
    elems = FWD_SMALL_ELEMS_PER_THREAD if small else FWD_ELEMS_PER_THREAD
    key = residual is not None, itemsize

    def plan_with(max_slots):
        return plan_rows(SOURCE, "rms_norm_fwd", x.dtype, weight_dtype, arrays, row_strides, rows, hidden, max_slots,
                         elems, FWD_BLOCK_THREADS, [add], impl, can_shift=True, max_width=FWD_MAX_WIDTH[key],
                         wide_first=FWD_WIDE_FIRST.get(key, ()))

    plan = plan_with(FWD_MAX_SLOTS)
    add_slots = fwd_max_slots(residual is not None, plan.shifted)
    if plan.vectorized and plan.slots > add_slots[True, itemsize]:
        plan = plan_with(add_slots)
    if runs:
        return take_runs(plan, hidden)
    long_row = hidden * itemsize >= choices.split_min_row_bytes
    min_blocks = FWD_SPLIT_MIN_BLOCKS.get((*key, plan.shifted)) if long_row else None
    if clusters and min_blocks and plan.vectorized and not plan.slots:  # else read twice
        split = plan_forward_split(x, y, residual, weight, row_strides, rows, hidden, min_blocks, plan.shifted,
                                   choices=choices, residual_out=residual_out)
        plan = split or plan
    if residual_out is not None:  # the OUT variant (in place: OUT's default, false, left out of the name)
        plan.name = with_flag(plan.name, True)
    return plan


def plan_forward_split(x, y, residual, weight, row_strides, rows, hidden, min_blocks, shifted=False, *, choices,
                       residual_out=None):
    """The plan of rms_norm_fwd_split: plan_forward's for the longest part of a row split over the fewest blocks
    (at least min_blocks) whose registers hold the parts (split_parts; shifted: the part's chunks hold a shifted
    row E - 1 elements shorter than they span); its grid one cluster a row (plan_forward_for_device caps it). None
    where no cluster size does."""
    itemsize = ITEMSIZE[x.dtype]
    elems = 16 // itemsize
    weight_dtype = weight.dtype if weight is not None else "float32"
    flags = f"{flag(residual is not None)}, {{}}, {flag(shifted)}"
    for split, chunks in split_parts(hidden, itemsize, min_blocks, shifted):
        part = plan_forward(x, y, residual, weight, row_strides, rows, chunks * elems - (elems - 1 if shifted else 0),
                            choices=choices, residual_out=residual_out)
        compiled = part.slots == split_slots(residual is not None, itemsize) and part.block[1] == 1  # variants()
        if compiled and part.shifted == shifted:
            plan = NormPlan(SOURCE, f"cupyrope::rms_norm_fwd_split<{CTYPE[x.dtype]}, {CTYPE[weight_dtype]}, "
                            f"{part.slots}, {flags.format(split)}>", rows * split, part.block, True, part.slots)
            plan.split, plan.shifted = split, shifted
            return plan
    return None


def split_slots(add: bool, itemsize: int) -> int:
    """The register slots of the forward's split variants: the most a block's 16-byte row has (the fused add's
    fewer, FWD_ADD_MAX_SLOTS, for odd rows too: their 8 slots spill)."""
    return (FWD_ADD_MAX_SLOTS if add else FWD_MAX_SLOTS)[True, itemsize]


def plan_forward_for_device(x, y, residual, weight, row_strides, rows, hidden, impl, device, choices,
                            residual_out=None, runs=False) -> NormPlan:
    """plan_forward's plan, split over a cluster where the GPU runs clusters and places one, else read twice."""
    planning = (x, y, residual, weight, row_strides, rows, hidden, impl)
    plan = plan_forward(*planning, clusters=runs_clusters(device), choices=choices, residual_out=residual_out,
                        runs=runs)
    if plan.split > 1 and not fit_clusters(plan, get_kernel(SOURCE, plan.name, device), rows, device):
        plan = plan_forward(*planning, choices=choices, residual_out=residual_out, runs=runs)  # read twice
    return plan


def row_cache_bytes(plan, hidden: int, dtype, shared_limit: int, choices: ForwardChoices) -> int:
    """Dynamic shared memory of a fused-add plan: its block's rows, where they are read twice (slots 0)
    and fit (choices.row_cache_max_bytes, and what the GPU gives a block); else 0 (read again). A row takes its
    chunks' span (shifted rows: from the 16-byte boundary before the row), rounded up to whole chunks."""
    itemsize = ITEMSIZE[dtype]
    span = chunks_span(hidden, itemsize, plan.shifted) if plan.vectorized else hidden
    nbytes = plan.block[1] * span * itemsize
    return nbytes if not plan.slots and nbytes <= min(choices.row_cache_max_bytes, shared_limit) else 0


def variants():
    """Every forward kernel the planner can ask for (the fused add's in place and, OUT, out of place)."""
    for dtype, weight, vec, slots in row_variant_params(FWD_MAX_SLOTS):
        itemsize = ITEMSIZE[dtype]
        for add in (False, True):
            for shift in (False, True) if vec else (False,):
                if slots > fwd_max_slots(add, shift)[vec, itemsize]:
                    continue  # never planned: read twice instead
                name = (f"cupyrope::rms_norm_fwd<{CTYPE[dtype]}, {CTYPE[weight]}, {flag(vec)}, {slots}, "
                        f"{flag(add)}, {flag(shift)}>")
                yield from ((SOURCE, n) for n in ([name, with_flag(name, True)] if add else [name]))
                if slots and not add:
                    yield SOURCE, runs_variant(name)
                min_blocks = FWD_SPLIT_MIN_BLOCKS.get((add, itemsize, shift))
                if vec and min_blocks and slots == split_slots(add, itemsize):  # parts: long rows
                    for split in (s for s in SPLIT_SIZES if s >= min_blocks):
                        name = (f"cupyrope::rms_norm_fwd_split<{CTYPE[dtype]}, {CTYPE[weight]}, {slots}, "
                                f"{flag(add)}, {split}, {flag(shift)}>")
                        yield from ((SOURCE, n) for n in ([name, with_flag(name, True)] if add else [name]))
