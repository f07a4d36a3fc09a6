"""LayerNorm planning: which kernel of kernels_src/layernorm.cu a call runs, on what grid.

Rows map onto threads as RMSNorm's do (rmsnorm_rows.plan_rows: threads per row, register slots, 16-byte chunks,
shifted odd rows), so a row's reductions follow from its size, dtype, alignment and the launch profile alone (batch
invariance).
- layer_norm_fwd holds a row in registers where its block's threads can (one read of x, one write of y; long
  16-byte rows up to 8 chunks a thread, from the profile's forward_eight_slots_min_hidden), else makes three passes
  over it (sum, squared deviations, output), the later two mostly from the L2.
- layer_norm_bwd runs a grid of resident blocks whose rows slots walk the rows, each slot keeping its sums of
  dweight and dbias (registers, or for rows too long for them its own partial rows, in shared memory where they
  fit), 16-byte rows of 2 fp16/bf16 slots or 4 fp32 ones copying the next row ahead into shared memory
  (BWD_STAGED; as many blocks an SM as bwd_staged_blocks says); rms_norm_dw (rmsnorm_bwd.cu) then adds the slots'
  partial rows in a fixed order: dweight and dbias are bitwise the same in every run.
- layer_norm_bwd_split takes 16-byte rows longer than one block's registers hold (on GPUs that run clusters): the
  staged walk on a cluster of 2-8 blocks, each with a part of every row, a cluster a rows slot.
"""

import dataclasses

from .._runtime.arrays import CTYPE, ITEMSIZE
from .._runtime.choices import choice
from .rmsnorm_plan_forward import FWD_BLOCK_THREADS
from .rmsnorm_rows import (MAX_WIDTH, SHARED_OPTIN_LIMIT, SPLIT_SIZES, STATIC_SHARED_BYTES, NormPlan, flag, plan_rows,
                           row_threads, row_variant_params, split_parts)

SOURCE = "layernorm.cu"
DW_SOURCE = "rmsnorm_bwd.cu"  # rms_norm_dw adds the partial rows of dweight and of dbias
# Register slots (one 16-byte access when vectorized, one element otherwise) by (vectorized, element size): the
# forward holds x (and its fused add's sum) within 64 registers; fp32 rows past 4 chunks a thread take 1024 threads
# (8 chunks spilled 32-80 bytes).
FWD_MAX_SLOTS = {(True, 4): 4, (True, 2): 4, (False, 4): 8, (False, 2): 8}
# The fused add holds the residual's chunks too: fp16/bf16 element by element in 8 slots spilled 8 bytes, shifted
# fp16/bf16 rows of 4 slots 56 bytes; those rows take fewer slots on more threads, or are read in passes.
FWD_ADD_MAX_SLOTS = {**FWD_MAX_SLOTS, (False, 2): 4}
FWD_ADD_SHIFTED_MAX_SLOTS = {**FWD_ADD_MAX_SLOTS, (True, 2): 2}
FWD_MAX_WIDTH = 1024  # layer_norm_fwd's launch bound for rows of 4+ slots (LayerNormBounds)
# Long 16-byte rows (LayerNormChoices.forward_eight_slots_min_hidden), without the fused add and not shifted: up to 8
# chunks a thread on half the threads, within a 512-thread launch bound (128 registers; 78-82 used).
FWD_LONG_MAX_SLOTS = {**FWD_MAX_SLOTS, (True, 4): 8, (True, 2): 8}
# Elements a thread: as many as the slots hold (4 chunks of fp16/bf16). Two reductions a row make the forward's
# blocks spend longer on each row than RMSNorm's, so fewer threads a row, with more of them resident, keep more bytes
# in flight. Against 16 (RMSNorm's), on an H200: bf16 [32768, 4096] 80% -> 97% of copy bandwidth, [16384, 8192] 73%
# -> 91%, [65536, 1152] 69% -> 77%, fp16 [65536, 768] 71% -> 91%; 8 was slower at every shape measured (63% at
# [32768, 4096]).
FWD_ELEMS_PER_THREAD = 32
# The backward holds dy, x and two sums a slot: 16 elements a thread take 110-128 registers (LayerNormBwdBounds);
# fp32 rows reach 4 slots. Element by element: 8 slots.
BWD_MAX_SLOTS = {(True, 4): 4, (True, 2): 2, (False, 4): 8, (False, 2): 8}
# Elements a thread by element size: two 16-byte chunks. Against one chunk of fp16/bf16 (8), on an H200: bf16
# [32768, 4096] 57% -> 74% of copy bandwidth, [65536, 1152] 54% -> 56%, fp16 [65536, 768] 61% -> 66%; the few-row
# calls of the seed grid 1-1.5 us slower ([2048, 1024], [2048, 2048]). fp32 in 4 chunks (16) was slower: [16384, 4096]
# 93% -> 81%.
BWD_ELEMS_PER_THREAD = {2: 16, 4: 8}
BWD_BLOCK_THREADS = 256
# 16-byte rows in registers that copy the next row into shared memory while one is reduced (layer_norm_bwd's STAGED),
# by (element size, slots). Measured against loading each row when it comes, on an H200: bf16 [16384, 8192] 45% ->
# 73%, [32768, 4096] 52% -> 74%; fp32 rows of 2 slots unstaged hold two blocks an SM, staged 81% against 93%
# ([16384, 4096]). Deeper rings of 3-4 stages measured no faster (within 2%), rows of one slot staged 0-15% slower.
BWD_STAGED = {(2, 1): False, (2, 2): True, (4, 1): False, (4, 2): False, (4, 4): True}


@dataclasses.dataclass(frozen=True)
class LayerNormChoices:
    """LayerNorm's measured launch choices: a launch profile's "layer_norm" section.

    backward_three_blocks_min_rows: fp16/bf16 staged backward rows take the variant of three 256-thread blocks an SM
      (80 registers) where a block holds at least this many rows, else the one of two (up to 128 registers;
      bwd_staged_blocks). On an H200, three against two: bf16 [65536, 1152] (2 rows a block) 148.2 -> 129.9 us, fp16
      [65536, 768] (4) 87.7 -> 84.2, but bf16 [32768, 4096] (a row a block) 205.4 -> 216.7 and [2048, 4096] 20.9 ->
      22.2; [16384, 8192] (512-thread rows, one block an SM either way) 211.2 both. The H100's profile takes the
      H200's value (not measured there).
    forward_eight_slots_min_hidden: 16-byte rows of at least this many elements, without the fused add and not
      shifted, hold up to 8 chunks a thread (FWD_LONG_MAX_SLOTS) on half the threads of 4: a row's two reductions
      then span fewer warps. On an H200, 8 against 4 slots: bf16 [16384, 8192] 140.3 -> 133.3 us, [8192, 16384]
      148.5 -> 136.4, fp32 [8192, 16384] 311.1 -> 297.4, bf16 [4096, 32768] 186.6 -> 187.7; shorter rows gain
      less or lose: bf16 [65536, 1152] 93.5 -> 89.3, but [32768, 4096] 132.2 -> 133.0, [32768, 2048] 67.4 ->
      68.4, [65536, 768] 52.7 -> 54.3, fp32 [16384, 4096] 131.9 -> 133.1. The H100's profile takes the H200's
      value (not measured there).
    """

    backward_three_blocks_min_rows: int = choice(1, 1 << 10)
    forward_eight_slots_min_hidden: int = choice(1, 1 << 30)


def bwd_staged_blocks(itemsize: int, rows_per_block: int, choices: LayerNormChoices) -> int:
    """The staged backward's variant (its STAGED): the 256-thread blocks an SM its launch bound leaves registers for,
    3 or 2 (fp32 rows: 2)."""
    return 3 if itemsize == 2 and rows_per_block >= choices.backward_three_blocks_min_rows else 2


def weight_dtype(weight, bias) -> str:
    """The kernels' W: the weight's dtype, else the bias's (the checks made them one), else float32 (unused)."""
    param = weight if weight is not None else bias
    return param.dtype if param is not None else "float32"


def plan_forward(x, y, residual, weight, bias, row_strides, rows, hidden, impl="auto", *, choices: LayerNormChoices):
    """layer_norm_fwd<T, W, VEC, NPT, ADD, SHIFT> for rows of `hidden` elements; residual: the fused add's (in
    place). row_strides: x's, y's (and residual's). choices: the device's launch profile's LayerNormChoices."""
    arrays = [x, y, residual, weight, bias]

    def plan_with(max_slots, elems=FWD_ELEMS_PER_THREAD):
        # 1024 threads for rows of 4 slots, 512 for the others (LayerNormBounds)
        max_width = FWD_MAX_WIDTH if max_slots[True, ITEMSIZE[x.dtype]] == 4 else MAX_WIDTH
        return plan_rows(SOURCE, "layer_norm_fwd", x.dtype, weight_dtype(weight, bias), arrays, row_strides, rows,
                         hidden, max_slots, elems, FWD_BLOCK_THREADS, [flag(residual is not None)], impl,
                         can_shift=True, max_width=max_width, params=2)

    if residual is None and hidden >= choices.forward_eight_slots_min_hidden:
        plan = plan_with(FWD_LONG_MAX_SLOTS, 2 * FWD_ELEMS_PER_THREAD)
        if plan.vectorized and not plan.shifted and plan.slots:
            return plan
    plan = plan_with(FWD_MAX_SLOTS)
    if residual is not None:
        add_slots = fwd_max_slots(True, plan.shifted)
        if plan.slots > add_slots[plan.vectorized, ITEMSIZE[x.dtype]]:
            plan = plan_with(add_slots)
    return plan


def fwd_max_slots(add: bool, shifted: bool) -> dict:
    """The register-slot table of layer_norm_fwd's rows: the planner's and the variant list's one rule."""
    if not add:
        return FWD_MAX_SLOTS
    return FWD_ADD_SHIFTED_MAX_SLOTS if shifted else FWD_ADD_MAX_SLOTS


def plan_backward(dy, x, dx, weight, bias, row_strides, rows, hidden, impl="auto",
                  shared_limit=SHARED_OPTIN_LIMIT - STATIC_SHARED_BYTES, clusters=False, *,
                  choices: LayerNormChoices):
    """layer_norm_bwd<T, W, VEC, NPT, STAGED> (STAGED: 0, or the staged kernel's blocks an SM) for rows of `hidden`
    elements, with its dynamic shared memory
    (plan.shared_mem: the staged rows, or the partial rows of rows read in passes), at most shared_limit bytes (the
    device's: rmsnorm_rows.shared_limit; rows it cannot stage go unstaged, partial rows it cannot hold stay in global
    memory); its grid is as many blocks as rows need, which RMSNorm's cap_grid then caps at the blocks the GPU holds
    at once: its rows slots (grid x rows a block) walk several rows each and are the partial rows.
    clusters: the GPU runs thread block clusters (sm_90+), so 16-byte rows that one block's registers cannot hold take
    layer_norm_bwd_split where a cluster size does (its grid: one cluster a row, which resident_grid caps)."""
    arrays = [dy, x, dx, weight]
    plan = plan_rows(SOURCE, "layer_norm_bwd", x.dtype, weight_dtype(weight, bias), arrays, row_strides, rows, hidden,
                     BWD_MAX_SLOTS, BWD_ELEMS_PER_THREAD[ITEMSIZE[x.dtype]], BWD_BLOCK_THREADS, [], impl)
    if clusters and plan.vectorized and not plan.slots:
        split = plan_backward_split(x.dtype, weight_dtype(weight, bias), rows, hidden, shared_limit)
        if split:
            return split
    staged = plan.vectorized and plan.slots > 0 and BWD_STAGED[ITEMSIZE[x.dtype], plan.slots] and \
        stage_bytes(plan) <= shared_limit
    plan.staged = bwd_staged_blocks(ITEMSIZE[x.dtype], plan.block[1], choices) if staged else 0
    plan.name = f"{plan.name[:-1]}, {plan.staged}>"

    sums = 2 * hidden * 4 * plan.block[1]  # rows read in passes: dweight's and dbias's partial rows
    plan.shared_acc = not plan.slots and (weight is not None or bias is not None) and sums <= shared_limit
    plan.shared_mem = stage_bytes(plan) if plan.staged else sums if plan.shared_acc else 0
    return plan


def plan_backward_split(dtype, weight_dtype, rows, hidden, shared_limit):
    """layer_norm_bwd_split<T, W, NPT, SPLIT>: a 16-byte row split over the fewest blocks (split_parts) whose parts
    the staged walk's BWD_MAX_SLOTS chunks a thread hold on at most MAX_WIDTH threads, with its two stages in
    shared_limit; None where no cluster size does."""
    slots = BWD_MAX_SLOTS[True, ITEMSIZE[dtype]]
    for split, chunks in split_parts(hidden, ITEMSIZE[dtype]):
        width = row_threads(-(-chunks // slots))
        if width > MAX_WIDTH:
            continue
        name = f"cupyrope::layer_norm_bwd_split<{CTYPE[dtype]}, {CTYPE[weight_dtype]}, {slots}, {split}>"
        plan = NormPlan(SOURCE, name, rows * split, (width, 1), True, slots)
        plan.split, plan.staged = split, True
        plan.shared_mem = stage_bytes(plan)  # two stages: three measured no faster
        if plan.shared_mem <= shared_limit:
            return plan
    return None


def stage_bytes(plan) -> int:
    """The two stages of a staged backward block: dy's and x's 16-byte chunks, plan.slots of each a thread."""
    return 2 * 2 * plan.slots * 16 * plan.block[0] * plan.block[1]


def variants():
    """Every LayerNorm kernel the planners can ask for (rms_norm_dw, which adds its sums, is RMSNorm's)."""
    for dtype, weight, vec, slots in row_variant_params(FWD_LONG_MAX_SLOTS):
        itemsize = ITEMSIZE[dtype]
        if slots > FWD_MAX_SLOTS[vec, itemsize]:  # long rows: aligned, without the fused add
            yield SOURCE, f"cupyrope::layer_norm_fwd<{CTYPE[dtype]}, {CTYPE[weight]}, true, {slots}, false, false>"
            continue
        for add in (False, True):
            for shift in (False, True) if vec else (False,):
                if slots <= fwd_max_slots(add, shift)[vec, itemsize]:
                    yield SOURCE, (f"cupyrope::layer_norm_fwd<{CTYPE[dtype]}, {CTYPE[weight]}, {flag(vec)}, {slots}, "
                                   f"{flag(add)}, {flag(shift)}>")
        if slots <= BWD_MAX_SLOTS[vec, itemsize]:
            # rows staged where the device's shared memory holds their stages (fp16/bf16 at 2 or 3 blocks an SM, fp32
            # at 2), else not
            if not (vec and slots and BWD_STAGED[itemsize, slots]):
                options = (0,)
            else:
                options = (0, 2, 3) if itemsize == 2 else (0, 2)
            for staged in options:
                yield SOURCE, (f"cupyrope::layer_norm_bwd<{CTYPE[dtype]}, {CTYPE[weight]}, {flag(vec)}, {slots}, "
                               f"{staged}>")
            if vec and slots == BWD_MAX_SLOTS[vec, itemsize]:  # the staged walk's parts of rows split over a cluster
                for split in SPLIT_SIZES:
                    yield SOURCE, (f"cupyrope::layer_norm_bwd_split<{CTYPE[dtype]}, {CTYPE[weight]}, {slots}, "
                                   f"{split}>")
