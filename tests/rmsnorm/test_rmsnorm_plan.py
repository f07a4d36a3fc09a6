"""RMSNorm's plans (kernel, variant, grid, block) are pure functions of shapes, dtypes, strides and alignment:
checked here without a GPU."""

import functools

import pytest
from fakes import PLANNING_PROFILE
from helpers import PLAN_BASE as BASE
from helpers import planned_array as arr

from cupyrope._runtime.arrays import ITEMSIZE
from cupyrope.ops import all_variants, rmsnorm_rows
from cupyrope.ops import rmsnorm_plan_backward as backward
from cupyrope.ops import rmsnorm_plan_forward as forward
from cupyrope.ops import rmsnorm_plan_fp8 as fp8
from cupyrope.ops.rmsnorm_plan_backward import cap_grid
from cupyrope.ops.rmsnorm_rows import row_shape, with_flag

H100 = PLANNING_PROFILE  # the plans below are an H100's
plan_forward = functools.partial(forward.plan_forward, choices=H100.rms_norm_forward)
plan_backward = functools.partial(backward.plan_backward, choices=H100.rms_norm_backward)


@pytest.mark.parametrize(
    "hidden,elems,chunks,max_slots,width,slots",
    [(4096, 8, 1, 4, 512, 1), (16384, 4, 2, 8, 512, 8), (32768, 8, 1, 4, 512, 0),
     (65536, 8, 1, 4, 512, 0), (65536, 4, 2, 8, 512, 0), (61, 1, 8, 8, 8, 8), (1, 1, 8, 8, 1, 1), (32, 4, 2, 8, 4, 2),
     (1027, 1, 8, 8, 160, 8), (1027, 8, 1, 4, 160, 1), (5120, 8, 2, 4, 320, 2), (9000, 8, 2, 4, 288, 4)],
)
def test_rms_norm_row_shape(hidden, elems, chunks, max_slots, width, slots):
    assert row_shape(hidden, elems, chunks, max_slots) == (width, slots)


def test_rms_norm_plans():
    x, y = arr((8192, 4096)), arr((8192, 4096), ptr=BASE + 2**28)
    p = plan_forward(x, y, None, arr((4096,), ptr=BASE + 2**29), (4096, 4096), 8192, 4096)
    assert p.vectorized and p.block == (256, 1) and p.grid == 8192  # 16 bf16 (two 16-byte chunks) a thread
    assert p.name == "cupyrope::rms_norm_fwd<__nv_bfloat16, __nv_bfloat16, true, 2, false, false>"
    # A weight that is not 16-byte aligned is read element by element; x and y still move 16 bytes.
    misaligned_weight = arr((4096,), "float32", ptr=BASE + 4)
    assert plan_forward(x, y, None, misaligned_weight, (4096, 4096), 8192, 4096).shifted


def test_rms_norm_odd_rows_move_in_shifted_chunks():
    odd, out = arr((7, 1027)), arr((7, 1027), ptr=BASE + 2**20)
    weight = arr((1027,), "float32", ptr=BASE + 2**21 + 4)  # the weight's alignment does not matter
    p = plan_forward(odd, out, None, weight, (1027, 1027), 8192, 1027)
    assert p.vectorized and p.shifted and p.name.endswith("float, true, 1, false, true>")
    # 1027 bf16 + up to 7 elements before the first boundary: 130 chunks; a short row (<= small_row_bytes): one
    # chunk a thread (the weight is loaded with x), whole warps.
    assert p.block == (160, 1) and p.slots == 1
    # A longer row: two chunks a thread.
    long = plan_forward(arr((7, 4099)), arr((7, 4099), ptr=BASE + 2**20), None, weight, (4099, 4099), 7, 4099)
    assert long.name.endswith("float, true, 2, false, true>") and long.block == (288, 1)
    assert not plan_forward(odd, out, None, weight, (1027, 1027), 7, 1027, impl="scalar").vectorized
    # Rows of out start at another offset from a 16-byte boundary than x's: element by element.
    assert not plan_forward(odd, arr((7, 1027), ptr=BASE + 2), None, None, (1027, 1027), 7, 1027).vectorized
    assert not plan_forward(odd, out, None, None, (1027, 1028), 7, 1027).vectorized
    # Fused add: residual must share x's offsets too.
    add = plan_forward(odd, odd, out, None, (1027, 1027, 1035), 7, 1027)
    assert add.shifted and add.name.endswith("true, true>")
    # Short rows stay element by element.
    short = plan_forward(arr((7, 61)), arr((7, 61)), None, None, (61, 61), 7, 61)
    assert not short.vectorized and short.block == (16, 8) and short.slots == 4  # small: 4 elements a thread
    # The backward shifts too (the staged kernel: see test_rms_norm_backward_plans); one rows slot a
    # block: its dweight sums stay in registers.
    b = plan_backward(odd, odd, out, weight, (1027,) * 3, 7, 1027, n_sm=132)
    assert b.shifted and b.name.endswith("float, 1, 3, true, false, false>") and b.block == (160, 1)


@pytest.mark.parametrize("dtype,hidden,add", [
    ("bfloat16", 40001, False), ("float16", 32763, False), ("float32", 33001, False),
    ("bfloat16", 20001, True), ("float32", 33001, True), ("bfloat16", 65535, True)])
def test_rms_norm_long_odd_rows_are_read_twice_in_shifted_chunks(dtype, hidden, add):
    # Odd rows that registers cannot hold: the two-pass loop in 16-byte chunks, forward, fused add
    # and backward, 512 threads a row; element by element where x's and out's offsets differ. The backward
    # keeps its dweight sums in shared memory up to SHARED_ACC_LIMIT, else in the partial row.
    x, y = arr((64, hidden), dtype), arr((64, hidden), dtype, ptr=BASE + 2**36)
    residual = arr((64, hidden), dtype, ptr=BASE + 2**37) if add else None
    weight, strides = arr((hidden,), "float32", ptr=BASE + 2**38 + 4), (hidden,) * (3 if add else 2)
    p = plan_forward(x, y, residual, weight, strides, 64, hidden)
    assert (p.block, p.slots, p.vectorized, p.shifted) == ((512, 1), 0, True, True), p
    assert p.name.endswith(f"{str(add).lower()}, true>") and p.name in {n for _, n in all_variants()}
    other = arr((64, hidden), dtype, ptr=BASE + 2**36 + ITEMSIZE[dtype])
    assert not plan_forward(x, other, residual, weight, strides, 64, hidden).vectorized
    b = plan_backward(x, x, y, weight, (hidden,) * 3, 4096, hidden, n_sm=131)
    if (dtype, hidden) == ("bfloat16", 20001):  # stage and weight fit in shared memory
        assert b.reread and b.shifted, b
        return
    assert (b.block, b.slots, b.shifted, b.staged) == ((512, 1), 0, True, False) and b.name.endswith(", 0, true, false>"), b
    elems = 16 // ITEMSIZE[dtype]
    assert b.grid == 4 * 131 // elems * elems  # one shift a block: its dweight sums sit from it in shared memory
    span = -(-(hidden + elems - 1) // elems) * elems
    assert b.shared_mem == (span * 4 if span * 4 <= backward.SHARED_ACC_LIMIT else 0), b


def test_rms_norm_odd_rows_held_element_by_element_stay_there():
    # fp32 rows of 4095: 16-byte chunks need 4097 elements, past the backward's 512 x 2 x 4 in registers;
    # element by element, 512 x 8 hold them: those stay in registers rather than being read twice.
    x = arr((64, 4095), "float32")
    b = plan_backward(x, x, arr((64, 4095), "float32", ptr=BASE + 2**36), None, (4095,) * 3, 64, 4095, n_sm=132)
    assert (b.vectorized, b.slots) == (False, 8), b


@pytest.mark.parametrize("n_sm, rows, hidden, dtype, cap, grid", [
    (132, 8192, 1027, "bfloat16", None, 1584),  # 160-thread blocks: 132 x 12, a multiple of 8 rows already
    (132, 8192, 1027, "bfloat16", 132 * 3, 392),  # 3 blocks an SM (occupancy): 396 -> a multiple of 8
    (131, 8192, 4099, "bfloat16", None, 1568),  # rms_norm_bwd_reread's 160 threads: 131 x 12 = 1572 -> 1568
    (131, 8192, 1027, "float32", None, 1572),  # 1572 blocks: a multiple of 4 fp32 rows
    (131, 100, 4099, "bfloat16", None, 100),  # a row per block: no row is revisited, no rounding
    (5, 8192, 301, "bfloat16", 15, 14),  # 64 threads, 4 rows a block: a step of 8 rows needs an even grid
])
def test_rms_norm_shifted_backward_grid_revisits_rows_of_one_shift(n_sm, rows, hidden, dtype, cap, grid):
    # A shifted rows slot keeps its dweight sums in registers: all the rows it visits (grid x rows per
    # block apart) must share one offset from a 16-byte boundary, so the step is a multiple of 16 bytes' elements.
    item = 2 if dtype == "bfloat16" else 4
    x = arr((rows, hidden), dtype, ptr=BASE + item)
    b = plan_backward(x, x, arr((rows, hidden), dtype, ptr=BASE + 2**28 + item), arr((hidden,), "float32"),
                      (hidden,) * 3, rows, hidden, n_sm=n_sm)
    if cap is not None:  # the launcher's second cap (blocks the SMs hold at once)
        b.grid = cap_grid(b, cap, rows, dtype)
    assert b.shifted and b.grid == grid
    step = b.grid * b.block[1]
    assert step >= rows or step % (16 // item) == 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_forward_rows_reduce_the_same_way_whatever_the_row_count(monkeypatch, dtype, add):
    # Batch invariance: the kernel and the row's threads (which fix a row's order of summation) depend on the row,
    # never on how many rows the call has: one wave or two, a small call or a large one, split or not.
    monkeypatch.setattr(rmsnorm_rows, "sm_count", lambda device: 132)
    monkeypatch.setattr(forward, "runs_clusters", lambda device: True)
    monkeypatch.setattr(forward, "get_kernel", lambda source, name, device: name)
    monkeypatch.setattr(rmsnorm_rows, "resident_blocks", lambda *args: 2)
    monkeypatch.setattr(rmsnorm_rows, "resident_clusters", lambda *args: 16)
    for hidden in (64, 130, 1024, 1027, 2048, 4096, 8192, 12291, 16384, 32768, 65536, 131072):
        shapes = set()
        for rows in (1, 2, 8, 33, 132, 264, 512, 4096, 65536):
            x, y = arr((rows, hidden), dtype), arr((rows, hidden), dtype, ptr=BASE + 2**34)
            residual = arr((rows, hidden), dtype, ptr=BASE + 2**35) if add else None
            plan = forward.plan_forward_for_device(x, y, residual, arr((hidden,)), (hidden,) * 3, rows, hidden,
                                                   "auto", 0, H100.rms_norm_forward)
            shapes.add((plan.name, plan.block[0]))
        assert len(shapes) == 1, (hidden, shapes)


def test_rms_norm_backward_plans():
    x, y = arr((8192, 4096)), arr((8192, 4096), ptr=BASE + 2**28)
    b = plan_backward(x, x, y, arr((4096,), "float32"), (4096,) * 3, 8192, 4096, n_sm=132)
    # Aligned bf16 rows are staged: 512 threads x one 16-byte chunk, 3 rows ahead (3 x 16 KiB of dy and x).
    assert b.staged and b.name == "cupyrope::rms_norm_bwd_staged<__nv_bfloat16, float, 1, 3, false, false, false>"
    assert b.block == (512, 1) and b.shared_mem == 3 * 2 * 8192 and b.grid <= 132 * 4
    # fp32 rows of up to 8 elements a thread keep rms_norm_bwd's register prefetch.
    f = arr((8192, 4096), "float32")
    r = plan_backward(f, f, f, arr((4096,), "float32"), (4096,) * 3, 8192, 4096, n_sm=132)
    assert not r.staged and r.name.startswith("cupyrope::rms_norm_bwd<float, float, true, 2,")
    assert r.block[1] == 1 and r.slots and r.shared_mem == 0  # register sums go straight to the partial row
    # fp32 [*, 16384]: 512 threads x 8 chunks, one row ahead (128 KiB); fp32 [*, 8192]: 512 x 4, two ahead.
    wide = arr((64, 16384), "float32")
    w = plan_backward(wide, wide, wide, arr((16384,), "float32"), (16384,) * 3, 64, 16384, n_sm=132)
    assert w.name.endswith("<float, float, 8, 1, false, false, false>") and w.block == (512, 1) and w.shared_mem == 128 * 1024
    mid = arr((64, 8192), "float32")
    m = plan_backward(mid, mid, mid, None, (8192,) * 3, 64, 8192, n_sm=132)
    assert m.name.endswith("<float, float, 4, 2, false, false, false>") and m.block == (512, 1) and m.grid == 64
    # Less shared memory than a stage: not staged.
    n = plan_backward(wide, wide, wide, None, (16384,) * 3, 64, 16384, n_sm=132, shared_limit=100 * 1024)
    assert not n.staged and n.slots == 0
    # Odd bf16 rows of one chunk a thread are staged too (SHIFT): 1027 elements and up to 7 before the
    # row's first 16-byte boundary take 130 chunks (160 threads); the grid stays a multiple of 8 so that
    # all rows of a block share one shift. fp32 ones keep the register prefetch; longer odd rows rms_norm_bwd.
    odd = arr((8192, 1027))
    o = plan_backward(odd, odd, odd, arr((1027,), "float32"), (1027,) * 3, 8192, 1027, n_sm=132)
    assert o.name == "cupyrope::rms_norm_bwd_staged<__nv_bfloat16, float, 1, 3, true, false, false>" and o.shifted
    assert o.block == (160, 1) and o.grid % 8 == 0 and o.shared_mem == 3 * 2 * 160 * 16
    odd32 = arr((8192, 1027), "float32")
    o32 = plan_backward(odd32, odd32, odd32, None, (1027,) * 3, 8192, 1027, n_sm=132)
    assert o32.shifted and not o32.staged and o32.grid % 4 == 0
    long_odd = arr((8192, 4099))  # past one chunk a thread: rows read twice from their stage
    lo = plan_backward(long_odd, long_odd, long_odd, None, (4099,) * 3, 8192, 4099, n_sm=132)
    assert lo.shifted and lo.reread and lo.slots == 4
    small = arr((8192, 64))
    s = plan_backward(small, small, small, arr((64,)), (64,) * 3, 8192, 64, n_sm=132)
    assert not s.staged and s.block[1] > 1 and s.shared_mem == s.block[1] * 64 * 4  # rows slots' sums, in order
    huge = arr((64, 65536), "float32")
    h = plan_backward(huge, huge, huge, arr((65536,), "float32"), (65536,) * 3, 64, 65536, n_sm=132)
    assert h.slots == 0 and h.block[1] == 1 and h.shared_mem == 0  # sums go to the partial row instead


def test_rms_norm_backward_lean_rule():
    # The LEAN staged variant: one chunk a thread and at most STAGED_LEAN_MAX_ROWS rows a resident block.
    x = arr((8192, 4096))
    b = plan_backward(x, x, x, arr((4096,)), (4096,) * 3, 8192, 4096, n_sm=132)
    limit = backward.STAGED_LEAN_MAX_ROWS[1]
    b.grid = -(-8192 // limit)
    assert backward.lean_staged(b, 8192)
    b.grid -= 1  # a block would walk more rows than the limit
    assert not backward.lean_staged(b, 8192)
    lean = plan_backward(x, x, x, arr((4096,)), (4096,) * 3, 8192, 4096, n_sm=132, lean=True)
    assert lean.name == "cupyrope::rms_norm_bwd_staged<__nv_bfloat16, __nv_bfloat16, 1, 3, false, true, false>"
    assert lean.block == b.block and lean.shared_mem == b.shared_mem
    # Two chunks a thread on up to 512 threads too (LEAN's launch bound), not on 1024; nor the unstaged kernel.
    wide = arr((64, 8192))
    two = plan_backward(wide, wide, wide, None, (8192,) * 3, 64, 8192, n_sm=132)
    assert two.staged and two.slots == 2 and two.block == (512, 1) and backward.lean_staged(two, 64)
    two_lean = plan_backward(wide, wide, wide, None, (8192,) * 3, 64, 8192, n_sm=132, lean=True)
    assert two_lean.name.endswith(", 2, 3, false, true, false>") and two_lean.block == (512, 1)
    wider = arr((64, 16384))
    two = plan_backward(wider, wider, wider, None, (16384,) * 3, 64, 16384, n_sm=132)
    assert two.staged and two.slots == 2 and two.block == (1024, 1) and not backward.lean_staged(two, 64)
    two_lean = plan_backward(wider, wider, wider, None, (16384,) * 3, 64, 16384, n_sm=132, lean=True)
    assert two_lean.name == two.name  # past the 512-thread bound: never LEAN
    f = arr((64, 4096), "float32")
    assert not backward.lean_staged(plan_backward(f, f, f, None, (4096,) * 3, 64, 4096, n_sm=132), 64)
    # fp32 rows of 5-8K: 4 chunks on 512 threads (not 2 on 1024), LEAN however many rows a block walks.
    for hidden in (5120, 8192):
        f = arr((32768, hidden), "float32")
        p = plan_backward(f, f, f, arr((hidden,), "float32"), (hidden,) * 3, 32768, hidden, n_sm=132)
        assert p.staged and p.slots == 4 and p.block == (512, 1), p
        p.grid = 1
        assert backward.lean_staged(p, 32768)
    # Every LEAN name the planner can give is a compiled variant.
    names = {name for _, name in all_variants()}
    for dtype in ("float32", "float16", "bfloat16"):
        for hidden in (1024, 1027, 2048, 5120, 8192, 16384):
            plan = backward._plan_staged(dtype, "float32", 64, hidden, 227 * 1024, hidden % 2 == 1, lean=True)
            assert plan is None or not backward.STAGED_LEAN_MAX_ROWS[plan.slots] or all(
                with_flag(plan.name, grad) in names for grad in (False, True))


def backward_plan_for_device(rows, hidden, choices, grad, dtype="bfloat16"):
    """plan_backward_for_device's plan of a weighted call on the stand-in device (132 SMs, 227 KiB of shared memory),
    with residual_grad where grad."""
    x, w = arr((rows, hidden), dtype), arr((hidden,))
    plan, _ = backward.plan_backward_for_device(x, x, x, w, (hidden,) * (4 if grad else 3), rows, hidden, 132, "auto",
                                                227 * 1024, 0, choices, x if grad else None)
    return plan


def test_rms_norm_backward_grad_lean_rule(monkeypatch):
    # With residual_grad (add_rms_norm's backward), staged rows of one chunk a thread take LEAN up to the profile's
    # grad_lean_max_rows rows a resident block, past it rounds of clusters; without residual_grad, and for rows of 2
    # chunks a thread, the plain rule (STAGED_LEAN_MAX_ROWS) stays.
    import dataclasses

    from fakes import stand_in_for_the_device

    stand_in_for_the_device(monkeypatch.setattr, blocks_per_wave=264)

    def plan(rows, hidden, grad_lean_max_rows, grad=True):
        choices = dataclasses.replace(PLANNING_PROFILE.rms_norm_backward, grad_lean_max_rows=grad_lean_max_rows)
        return backward_plan_for_device(rows, hidden, choices, grad)

    lean = plan(32768, 4096, 1 << 20)  # 124-125 rows a block
    assert lean.name == "cupyrope::rms_norm_bwd_staged<__nv_bfloat16, __nv_bfloat16, 1, 3, false, true, true>", lean
    assert lean.shared_mem == 3 * 3 * 8192 and not lean.cluster_rounds
    assert plan(32768, 4096, 125).name == lean.name
    for rounds in (plan(32768, 4096, 124), plan(32768, 4096, 1 << 20, grad=False)):
        assert rounds.cluster_rounds and rounds.name.startswith("cupyrope::rms_norm_bwd_cluster<"), rounds
    assert plan(32768, 4096, 124).shared_mem == 3 * 3 * 8192 + 4096 * 4  # three tensors a stage, then the sums
    assert plan(16384, 8192, 1 << 20).cluster_rounds  # 2 chunks a thread: the plain rule


def test_rms_norm_backward_forced_rounds_walk_as_the_plain_call(monkeypatch):
    # What test_backward_residual_grad_clusters (GPU) relies on: with rounds of clusters forced at small sizes and
    # grad_lean_max_rows lowered with the plain limit, the residual_grad call walks as the plain call does (the
    # cluster kernel, the same grid), so that dweight is summed in one order and is bitwise the same.
    import dataclasses

    from fakes import stand_in_for_the_device

    stand_in_for_the_device(monkeypatch.setattr, blocks_per_wave=264)
    monkeypatch.setattr(backward, "STAGED_LEAN_MAX_ROWS", {**backward.STAGED_LEAN_MAX_ROWS, 1: 2, 2: 2})
    monkeypatch.setattr(backward, "CLUSTER_ROUNDS_ROWS", {1: 3, 2: 3})
    choices = dataclasses.replace(PLANNING_PROFILE.rms_norm_backward, one_cluster_max_rows=0, grad_lean_max_rows=2)
    for rows, hidden, dtype in ((2003, 4096, "bfloat16"), (1500, 8192, "float16")):
        with_grad, plain = (backward_plan_for_device(rows, hidden, choices, grad, dtype) for grad in (True, False))
        assert with_grad.name.startswith("cupyrope::rms_norm_bwd_cluster<") and with_grad.name.endswith(", true>")
        assert with_grad.cluster_rounds and plain.cluster_rounds, (with_grad, plain)
        assert (with_grad.grid, with_grad.block) == (plain.grid, plain.block), (with_grad, plain)


def test_rms_norm_backward_reread_plans():
    # Aligned rows past what the staged kernel holds in registers with their dweight sums (fp16/bf16 over
    # 16384 elements, fp32 over 16384) take rms_norm_bwd_reread where a stage fits in shared memory: 4 (8 for
    # fp32) chunks a thread on whole warps up to 1024 threads, the row read twice from its stage.
    names = {name for _, name in all_variants()}

    def plan(hidden, dtype="bfloat16", weight="float32", **kw):
        x = arr((8192, hidden), dtype)
        return plan_backward(x, x, x, arr((hidden,), weight), (hidden,) * 3, 8192, hidden, n_sm=132, **kw)

    p = plan(32768)  # 1024 x 4, one 128 KiB stage
    assert p.reread and p.staged and p.name == "cupyrope::rms_norm_bwd_reread<__nv_bfloat16, float, 4, 1, false, false>", p
    assert p.block == (1024, 1) and p.shared_mem == 128 * 1024 and p.name in names
    assert not backward.lean_staged(p, 8192) and plan(32768, lean=True).name == p.name  # never LEAN
    assert plan(32768, weight="bfloat16").name == "cupyrope::rms_norm_bwd_reread<__nv_bfloat16, __nv_bfloat16, 4, 1, false, false>"
    p = plan(18432, "float16")  # 2304 chunks: 576 threads x 4, one 72 KiB stage
    assert p.reread and p.block == (576, 1) and p.shared_mem == 72 * 1024 and p.name in names, p
    p = plan(20480, "float32")  # 5120 chunks: 640 x 8, one 160 KiB stage
    assert p.reread and p.block == (640, 1) and p.shared_mem == 160 * 1024 and p.name in names, p
    assert plan(16384).slots == 2 and not plan(16384).reread  # 1024 x 2 in registers
    # fp16/bf16 rows that would fill less than STAGED_MIN_FILL_PCT of 1024 x 2 slots: 8200 (1025 chunks, 50%)
    # and 9216 (56%) take the reread kernel; 10240 (62%) stays, and so do 512-thread blocks as empty (4608).
    assert plan(8200).reread and plan(8200).block == (288, 1) and plan(9216).reread and not plan(10240).reread
    assert not plan(8200, "float32").reread  # fp32: 512 x 8 (measured faster than the reread kernel at 4100)
    assert plan(4608).staged and plan(4608).block == (512, 1) and not plan(4608).reread  # 56% of 512 x 2: staged
    assert plan(16384, "float32").slots == 8 and not plan(16384, "float32").reread  # 512 x 8
    # A stage past shared memory (fp32 32768: 256 KiB; bf16 65536), a smaller GPU: rms_norm_bwd.
    for p in (plan(32768, "float32"), plan(65536), plan(32768, shared_limit=100 * 1024)):
        assert not p.staged and p.slots == 0 and p.name.startswith("cupyrope::rms_norm_bwd<"), p


def test_rms_norm_backward_split_plans():
    # Aligned rows past rms_norm_bwd_reread: on a GPU with clusters, split over the fewest blocks (2, 4, 8)
    # whose parts of whole 16-byte chunks (the last may be shorter) the reread kernel holds in one stage; the
    # grid one cluster a row, at most the SMs' worth (one 1024-thread block an SM). Rows the reread
    # kernel holds, GPUs without clusters and rows past 8 parts keep their plans.
    names = {name for _, name in all_variants()}

    def plan(hidden, dtype="bfloat16", weight="float32", rows=8192, ptr=BASE, clusters=True, **kw):
        x = arr((rows, hidden), dtype, ptr=ptr)
        return plan_backward(x, x, x, arr((hidden,), weight), (hidden,) * 3, rows, hidden, n_sm=132,
                             clusters=clusters, **kw)

    p = plan(65536)  # two parts of 32768: 1024 threads x 4 chunks, a 128 KiB stage each
    assert p.split == 2 and p.name == "cupyrope::rms_norm_bwd_split<__nv_bfloat16, float, 4, 2, false, false>", p
    assert p.block == (1024, 1) and p.shared_mem == 128 * 1024 and p.grid == 132 and p.reread and p.name in names
    p = plan(40968, "float16", weight="float16")  # 5121 chunks: parts of 2561 and 2560, 672 threads x 4
    assert p.split == 2 and p.block == (672, 1) and p.name in names, p
    p = plan(32768, "float32")  # the reread kernel's stage would be 256 KiB: two parts of 16384, 512 x 8
    assert p.split == 2 and p.block == (512, 1) and p.shared_mem == 128 * 1024 and p.name in names, p
    p = plan(65544, "float32", rows=5)  # 16386 chunks: 2 parts of 8193 need 1025 threads; 4 parts of 4097
    assert p.split == 4 and p.block == (544, 1) and p.grid == 4 * 5 and p.name in names, p
    assert plan(131072).split == 4 and plan(262144).split == 8 and plan(262144).grid == 8 * 16
    assert plan(32768).reread and plan(32768).split == 1  # one block holds it
    assert plan(65536, clusters=False).slots == 0 and plan(65536, clusters=False).split == 1  # no clusters
    for p in (plan(524288), plan(65536, impl="scalar"), plan(30001, ptr=BASE + 2, clusters=False)):
        assert p.split == 1 and p.slots == 0 and p.name.startswith("cupyrope::rms_norm_bwd<"), p  # past 8, scalar, none
    # Odd rows past the shifted reread kernel, with the weight's copy after the stage. On 2 blocks:
    # the chunks a row of any shift spans, split; clusters in steps of E rows (a cluster's rows share one shift),
    # unless each cluster takes one row. On 4 or 8 (the clusters walk the rows class by class, any count): the
    # row's E-column chunks split, every part at the row's shift, so spanning one chunk more, on at most 640 threads.
    p = plan(30001, ptr=BASE + 2)  # 3751 chunks: parts of 1876 on 480 threads x 4, stage 60 KiB + weight 58.6
    assert p.split == 2 and p.name == "cupyrope::rms_norm_bwd_split<__nv_bfloat16, float, 4, 2, true, false>", p
    assert p.shifted and p.block == (480, 1) and p.shared_mem == 61440 + 1876 * 8 * 4 and p.grid == 2 * 64, p
    assert p.name in names and p.cluster_step == 8
    p = plan(20001, "float32", ptr=BASE + 4)  # 5001 chunks: parts of 2501 on 320 x 8; 66 clusters -> 64
    assert p.split == 2 and p.shifted and p.block == (320, 1) and p.grid == 2 * 64 and p.name in names, p
    p = plan(50001, ptr=BASE + 2, weight="bfloat16")  # 6252 chunks: parts of 3126 on 800 threads (up to 1024)
    assert p.split == 2 and p.block == (800, 1) and p.grid == 2 * 64, p
    p = plan(65539, ptr=BASE + 2, weight="bfloat16")  # 8193 column chunks: 2 parts need 1025 threads; 4 of 2049 (+ 1)
    assert p.split == 4 and p.shifted and p.block == (544, 1) and p.grid == 4 * 33 and p.cluster_step == 1, p
    assert p.shared_mem == 2 * 4 * 544 * 16 + 2050 * 8 * 2 and p.name in names
    assert plan(65539, ptr=BASE + 2, rows=5).grid == 4 * 5  # one row a cluster
    p = plan(100001, ptr=BASE + 2)  # 12501 column chunks: 4 parts of 3126 (+ 1) need 800 threads (> 640); 8 of 1563
    assert p.split == 8 and p.block == (416, 1) and p.grid == 8 * 16, p
    assert plan(150001, ptr=BASE + 2).split == 8 and plan(150001, ptr=BASE + 2).block == (608, 1)  # 8 parts of 2344 (+ 1)
    assert plan(200001, ptr=BASE + 2).split == 1  # 8 parts need 800 threads: read twice
    assert plan(28001, ptr=BASE + 2).split == 1 and plan(28001, ptr=BASE + 2).reread  # the reread kernel holds it


def test_rms_norm_forward_split_plans():
    # Aligned forward rows past one block's registers, from 128 KiB: on a GPU with clusters, split over the
    # fewest blocks (2, 4, 8; fp16/bf16 at least 4) whose parts (whole 16-byte chunks, the last may be shorter)
    # fit registers (fp32 8 slots, the fused add's 4; fp16/bf16 4). The fp16/bf16 fused add, rows under 128 KiB
    # (the fp32 fused add's 96 KiB, bf16 49152), rows in registers, no clusters, past 8 parts: not split. Odd rows:
    # the chunks a row of any shift spans, split the same way.
    names = {name for _, name in all_variants()}

    def plan(hidden, dtype="float32", add=False, rows=64, ptr=BASE, clusters=True):
        x = arr((rows, hidden), dtype, ptr=ptr)
        y = arr((rows, hidden), dtype, ptr=ptr + 2**32)
        residual = arr((rows, hidden), dtype, ptr=ptr + 2**33) if add else None
        return plan_forward(x, y, residual, arr((hidden,), "float32"), (hidden,) * 3, rows, hidden, clusters=clusters)

    p = plan(65536)  # two parts of 32768: 1024 threads x 8 chunks
    assert p.split == 2 and p.name == "cupyrope::rms_norm_fwd_split<float, float, 8, false, 2, false>", p
    assert p.block == (1024, 1) and p.grid == 2 * 64 and p.name in names
    p = plan(65536, add=True)  # the fused add: 4 slots, four parts of 16384
    assert p.split == 4 and p.block == (1024, 1) and p.name == "cupyrope::rms_norm_fwd_split<float, float, 4, true, 4, false>"
    p = plan(65544)  # 16386 chunks: 2 parts of 8193 pass 1024 x 8; 4 of 4097 (the last 4095)
    assert p.split == 4 and p.slots == 8 and p.name in names, p
    assert plan(32776).split == 2 and plan(32776).block == (544, 1)  # 8194 chunks: parts of 4097
    assert plan(32768, add=True).split == 2 and plan(24576, add=True).split == 1  # 128 KiB and 96 KiB rows
    p = plan(65536, "bfloat16")  # four parts of 16384: 512 threads x 4 (two would fit 1024 x 4)
    assert p.split == 4 and p.block == (512, 1) and p.name == "cupyrope::rms_norm_fwd_split<__nv_bfloat16, float, 4, false, 4, false>"
    assert plan(65544, "float16").split == 4 and plan(65544, "float16").block == (544, 1)  # parts of 2049 chunks
    assert plan(131072, "bfloat16").split == 4 and plan(262144, "bfloat16").split == 8  # parts of 32768
    assert plan(32768).split == 1 and plan(32768).slots == 8 and plan(16384, add=True).slots == 4  # registers
    for p in (plan(49152, "bfloat16"), plan(65536, "bfloat16", add=True), plan(65536, clusters=False),
              plan(1 << 20), plan(65539, "bfloat16", add=True, ptr=BASE + 2), plan(300001, ptr=BASE + 4)):
        assert p.split == 1 and p.slots == 0, p  # 96 KiB, fp16/bf16 fused add (odd too), no clusters, past 8 parts
    assert all(p.name in names for p in (plan(65544, "float16"), plan(262144, "bfloat16")))
    p = plan(40001, ptr=BASE + 4)  # 10001 chunks from the boundary: two parts of 5001, 640 threads x 8
    assert p.split == 2 and p.shifted and p.name == "cupyrope::rms_norm_fwd_split<float, float, 8, false, 2, true>", p
    assert p.block == (640, 1) and p.grid == 2 * 64 and p.name in names
    p = plan(33001, add=True, ptr=BASE + 4)  # the fused add's odd rows: 4 slots a part, as aligned ones
    assert p.split == 4 and p.block == (544, 1) and p.name == "cupyrope::rms_norm_fwd_split<float, float, 4, true, 4, true>"
    p = plan(65539, "bfloat16", ptr=BASE + 2)  # 8193 chunks: four parts of 2049, 544 threads x 4
    assert p.split == 4 and p.block == (544, 1) and p.name in names, p
    assert plan(40001, "bfloat16", ptr=BASE + 2).slots == 0  # 80 KiB: read twice
    assert plan(131075, "float16", ptr=BASE + 2).split == 8
    assert plan(32761, "bfloat16", ptr=BASE + 2).slots == 4 and plan(32765, ptr=BASE + 4).slots == 8  # registers


def test_rms_norm_backward_reread_plans_for_odd_rows():
    # Odd rows (SHIFT) past the staged kernel's one chunk a thread (512 chunks): rms_norm_bwd_reread, the
    # stage sized on the chunks' span (from the 16-byte boundary before the row), then the weight copied from
    # the block's shift (the span, in the weight's dtype); one row ahead; the grid a multiple of E (one shift a
    # block). Where stage and weight do not fit, the two-pass loop.
    names = {name for _, name in all_variants()}

    def plan(hidden, dtype="bfloat16", weight="float32", **kw):
        x = arr((8192, hidden), dtype, ptr=BASE + ITEMSIZE[dtype])
        return plan_backward(x, x, x, arr((hidden,), weight), (hidden,) * 3, 8192, hidden, n_sm=132, **kw)

    p = plan(4099)  # up to 4106 elements: 514 chunks, 129 threads x 4 -> 160; 20 KiB of stage, then 4112 weights
    assert p.reread and p.shifted and p.name == "cupyrope::rms_norm_bwd_reread<__nv_bfloat16, float, 4, 1, true, false>", p
    assert p.block == (160, 1) and p.shared_mem == 2 * 4 * 160 * 16 + 4112 * 4 and p.grid % 8 == 0 and p.name in names
    assert plan(4089).name.startswith("cupyrope::rms_norm_bwd_staged<")  # 512 chunks: one a thread
    p = plan(28001, weight="bfloat16")  # 896 threads: 112 KiB of stage, then the weight's 28008 bf16
    assert p.reread and p.block == (896, 1) and p.shared_mem == 2 * 4 * 896 * 16 + 28008 * 2 and p.name in names, p
    p = plan(4099, "float32")  # 1026 chunks: 160 threads x 8
    assert p.reread and p.block == (160, 1) and p.grid % 4 == 0 and p.name in names, p
    assert plan(2051, "float32").slots == 2 and not plan(2051, "float32").staged  # fp32: the register prefetch
    # Past shared memory: bf16 30001 with an fp32 weight (stage 120 KiB + weight 117 KiB), fp32 20001, 32763
    # elements past 1024 threads x 4 chunks, a smaller GPU.
    for p in (plan(30001), plan(20001, "float32"), plan(32763, weight="bfloat16"), plan(20001, shared_limit=100 * 1024)):
        assert p.shifted and not p.staged and p.slots == 0 and p.name.startswith("cupyrope::rms_norm_bwd<"), p


def test_fused_add_row_cache_plan():
    # Rows read twice (slots 0) keep their sums in shared memory where the block's rows fit; rows held in
    # registers, and rows past the cap or past what the GPU gives a block, take none. Shifted rows (odd
    # hidden sizes) take their chunks' span: from the 16-byte boundary before the row, whole chunks.
    def cache(hidden, dtype, shared_limit=227 * 1024 - 1024):
        x = arr((64, hidden), dtype)
        plan = plan_forward(x, x, x, arr((hidden,), "float32"), (hidden,) * 3, 64, hidden)
        return plan.slots, plan.shifted, forward.row_cache_bytes(plan, hidden, dtype, shared_limit, H100.rms_norm_forward)

    assert cache(32768, "bfloat16") == (0, False, 65536)
    assert cache(20001, "float16") == (0, True, 20008 * 2) and cache(32761, "bfloat16") == (0, True, 65536)
    assert cache(32762, "bfloat16") == (0, True, 0)  # its span, 32776 elements, is past 64 KiB
    assert cache(16384, "float32")[::2] == (4, 0) and cache(16384, "bfloat16")[2] == 0  # in registers
    assert cache(20000, "float32") == (0, False, 0) and cache(33001, "float32") == (0, True, 0)  # past 64 KiB
    assert cache(32768, "bfloat16", shared_limit=48 * 1024) == (0, False, 0)  # past what the GPU gives a block


@pytest.mark.parametrize("dtype,hidden,add,threads,slots,shifted", [
    ("float32", 8192, False, 512, 4, False), ("float32", 9000, False, 576, 4, False),
    ("float32", 16384, False, 1024, 4, False), ("float32", 24576, False, 768, 8, False),
    ("float32", 32768, False, 1024, 8, False), ("float32", 65536, False, 512, 0, False),
    ("float32", 16384, True, 1024, 4, False), ("float32", 32768, True, 512, 0, False),
    ("float32", 4099, False, 288, 4, True), ("float32", 12291, False, 416, 8, True),
    ("float32", 12291, True, 800, 4, True), ("float32", 20001, False, 640, 8, True),
    ("bfloat16", 16384, False, 512, 4, False), ("bfloat16", 24576, False, 768, 4, False),
    ("bfloat16", 32768, False, 1024, 4, False), ("bfloat16", 40000, False, 512, 0, False),
    ("bfloat16", 32768, True, 512, 0, False), ("bfloat16", 12291, False, 416, 4, True),
    ("bfloat16", 20001, False, 640, 4, True), ("float16", 12291, True, 512, 0, True),
    ("bfloat16", 8191, True, 512, 0, True), ("bfloat16", 6151, True, 416, 2, True)])
def test_rms_norm_forward_takes_wide_rows(dtype, hidden, add, threads, slots, shifted):
    # Rows that 512 threads cannot hold in registers take up to 1024 threads (not the fp16/bf16
    # fused add), and fp32 rows that 512 threads hold in 8 chunks take them too (not shifted plain ones).
    x, y = arr((4096, hidden), dtype), arr((4096, hidden), dtype, ptr=BASE + 2**36)
    residual = arr((4096, hidden), dtype, ptr=BASE + 2**37) if add else None
    strides = (hidden,) * (3 if add else 2)
    plan = plan_forward(x, y, residual, arr((hidden,), "float32", ptr=BASE + 2**38), strides, 4096, hidden)
    assert (plan.block, plan.slots, plan.shifted) == ((threads, 1), slots, shifted)
    assert plan.name in {name for _, name in all_variants()}


@pytest.mark.parametrize("optin_kib", [64, 99, 163, 227])  # T4; A10/L4/RTX 4090/V100-class; A100; H100
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_backward_plans_fit_the_gpus_shared_memory(optin_kib, dtype):
    limit = optin_kib * 1024 - 1024  # what the launcher passes: the opt-in less the kernels' static arrays
    for hidden in (61, 1027, 4096, 8191, 16383, 16384, 20000, 32767, 49152, 65536):
        for rows in (1, 8192):
            x = arr((rows, hidden), dtype)
            p = plan_backward(x, x, x, arr((hidden,), "float32"), (hidden,) * 3, rows, hidden, n_sm=40,
                              shared_limit=limit)
            assert p.shared_mem <= limit, (hidden, rows, p.name, p.shared_mem)


def test_rms_norm_backward_one_cluster_rule():
    # Calls of up to one_cluster_max_rows rows with a weight whose staged plan can take LEAN: one launch of
    # rms_norm_bwd_cluster (8 blocks up to 8 rows, then 16; its dweight sums after the stages), where the GPU runs
    # clusters.
    limit = H100.rms_norm_backward.one_cluster_max_rows
    assert limit == 32
    x, w = arr((limit, 4096)), arr((4096,), "float32")
    for rows, blocks in ((1, 8), (8, 8), (9, 16), (16, 16), (17, 16), (limit, 16)):
        one = plan_backward(x, x, x, w, (4096,) * 3, rows, 4096, n_sm=132, clusters=True)
        assert one.name == f"cupyrope::rms_norm_bwd_cluster<__nv_bfloat16, float, 1, 3, false, {blocks}, false>", one
        assert one.one_cluster and one.grid == blocks and one.block == (512, 1)
        assert one.shared_mem == 3 * 2 * 8192 + 4096 * 4
    two = plan_backward(x, x, x, w, (4096,) * 3, limit + 1, 4096, n_sm=132, clusters=True)  # more rows
    assert two.name.startswith("cupyrope::rms_norm_bwd_staged<") and not two.one_cluster
    for other in (plan_backward(x, x, x, w, (4096,) * 3, 1, 4096, n_sm=132),  # no clusters (before sm_90)
                  plan_backward(x, x, x, None, (4096,) * 3, 1, 4096, n_sm=132, clusters=True)):  # no dweight
        assert other.name.startswith("cupyrope::rms_norm_bwd_staged<") and not other.one_cluster
    # Odd rows (SHIFT: the 8-block step keeps each block's rows on one shift), 2 chunks a thread on 512 threads,
    # fp32 rows of 4; not rows of 2 chunks on 1024 threads (no LEAN variant), nor rows read twice.
    odd = arr((5, 1027))
    assert plan_backward(odd, odd, odd, w, (1027,) * 3, 5, 1027, n_sm=132, clusters=True).name.endswith(
        "<__nv_bfloat16, float, 1, 3, true, 8, false>")
    for dtype, hidden, slots in (("bfloat16", 8192, 2), ("float32", 8192, 4)):
        a = arr((3, hidden), dtype)
        p = plan_backward(a, a, a, arr((hidden,), dtype), (hidden,) * 3, 3, hidden, n_sm=132, clusters=True)
        assert p.one_cluster and p.slots == slots and p.block == (512, 1), p
    for dtype, hidden in (("bfloat16", 16384), ("bfloat16", 32768), ("float32", 16384)):
        a = arr((3, hidden), dtype)
        p = plan_backward(a, a, a, arr((hidden,), dtype), (hidden,) * 3, 3, hidden, n_sm=132, clusters=True)
        assert not p.one_cluster, p
    # Every name it can give is a compiled variant.
    names = {name for _, name in all_variants()}
    for dtype in ("float32", "float16", "bfloat16"):
        for hidden in (512, 1024, 1027, 2048, 5120, 8192, 16384):
            plan = backward._plan_one_cluster(dtype, "float32", 64, hidden, 227 * 1024, hidden % 2 == 1)
            assert plan is None or all(with_flag(plan.name, grad) in names for grad in (False, True)), plan
    # Rows the staged kernel would read twice (rms_norm_bwd_reread) give no one-cluster plan.
    for dtype, hidden in (("bfloat16", 8200), ("bfloat16", 20000)):
        assert backward._plan_one_cluster(dtype, "float32", 3, hidden, 227 * 1024) is None


def test_rms_norm_backward_cluster_rounds_rule(monkeypatch):
    # Large calls whose staged plan takes the long chain re-plan (rounds=True) on rms_norm_bwd_cluster in clusters of
    # CLUSTER_ROUNDS_BLOCKS: aligned rows of 1-2 chunks a thread with a weight, on a GPU that runs clusters.
    blocks = backward.CLUSTER_ROUNDS_BLOCKS
    assert blocks == 8 and backward.CLUSTER_ROUNDS_ROWS == {1: 16, 2: 32}
    names = {name for _, name in all_variants()}
    x, w = arr((32768, 4096)), arr((4096,))
    staged = plan_backward(x, x, x, w, (4096,) * 3, 32768, 4096, n_sm=132, clusters=True)
    staged.grid = 264  # its resident wave: 124 rows a block, past the LEAN limit
    assert not backward.lean_staged(staged, 32768)
    for clusters in (True, False):  # sm_90+, or before
        monkeypatch.setattr(backward, "runs_clusters", lambda device, clusters=clusters: clusters)
        assert backward.takes_cluster_rounds(staged, True, 0) == clusters
    assert not backward.takes_cluster_rounds(staged, False, 0)  # no weight
    many = plan_backward(x, x, x, w, (4096,) * 3, 32768, 4096, n_sm=132, clusters=True, rounds=True)
    assert many.name == "cupyrope::rms_norm_bwd_cluster<__nv_bfloat16, __nv_bfloat16, 1, 3, false, 8, false>", many
    assert many.name in names and many.cluster_rounds and many.split == blocks and not many.one_cluster
    assert many.block == (512, 1) and many.shared_mem == 3 * 2 * 8192 + 4096 * 4
    assert not backward.lean_staged(many, 32768) and not backward.takes_cluster_rounds(many, True, 0)
    # The grid: rounds of the resident clusters giving each block at most ~16 rows of 1 chunk a thread (30 clusters
    # of 8 on an H100: 32768 rows in 9 rounds, 16384 in 5), ~32 of 2, at most a cluster for each 8 rows.
    assert backward.cluster_rounds_grid(many, 30, 32768) == 8 * 30 * 9
    assert backward.cluster_rounds_grid(many, 30, 16384) == 8 * 30 * 5
    assert backward.cluster_rounds_grid(many, 30, 3840) == 8 * 30
    assert backward.cluster_rounds_grid(many, 30, 100) == 8 * 13
    # Never one cluster: the kernel would take it for the one-cluster call and write dweight, not a partial row.
    assert backward.cluster_rounds_grid(many, 30, 5) == backward.cluster_rounds_grid(many, 1, 5) == 8 * 2
    wide = arr((16384, 8192), "float16")
    two = plan_backward(wide, wide, wide, arr((8192,), "float32"), (8192,) * 3, 16384, 8192, n_sm=132, rounds=True)
    assert two.name == "cupyrope::rms_norm_bwd_cluster<__half, float, 2, 3, false, 8, false>" and two.name in names, two
    assert backward.cluster_rounds_grid(two, 30, 16384) == 8 * 30 * 3
    # Not: without a weight, odd rows (shifted), fp32 rows of 8 chunks (no LEAN variant), rows read twice.
    for a, weight, hidden in ((x, None, 4096), (arr((32768, 4095)), w, 4095), (arr((8192, 16384), "float32"),
                                                                                arr((16384,), "float32"), 16384),
                              (arr((8192, 20000)), arr((20000,)), 20000)):
        p = plan_backward(a, a, a, weight, (hidden,) * 3, a.shape[0], hidden, n_sm=132, clusters=True, rounds=True)
        assert not p.cluster_rounds and not p.name.startswith("cupyrope::rms_norm_bwd_cluster<"), p
        assert not backward.takes_cluster_rounds(p, weight is not None, 0)


plan_fp8 = functools.partial(fp8.plan_fp8, choices=H100.rms_norm_forward)


@pytest.mark.parametrize(
    "dtype,hidden,group,vectorized,block,slots",
    [("bfloat16", 4096, fp8.TOKEN_SCALE, True, (256, 1), 2),  # fp8_token_elems_per_thread: two 16-byte chunks
     ("bfloat16", 4096, fp8.STATIC_SCALE, True, (128, 1), 4),  # fp8_elems_per_thread: four
     ("bfloat16", 7168, 128, True, (224, 1), 4),
     ("bfloat16", 2048, fp8.STATIC_SCALE, True, (256, 1), 1),  # a short row (small_row_bytes): one chunk a thread
     ("bfloat16", 128, 128, True, (16, 8), 1),  # a group's 16 lanes, though 8 threads would hold the row
     ("float32", 128, 128, True, (32, 4), 1),  # fp32: 4 elements a chunk, a group is a whole warp
     ("bfloat16", 64, 64, True, (8, 16), 1),
     ("bfloat16", 1027, fp8.TOKEN_SCALE, False, (160, 1), 1),  # odd rows: 8-element chunks, element by element
     ("bfloat16", 4100, fp8.STATIC_SCALE, False, (288, 1), 2),  # odd rows keep 16 elements a thread in every mode
     ("bfloat16", 32768, fp8.STATIC_SCALE, True, (512, 1), 0),  # read again
     ("float32", 16384, 64, True, (512, 1), 8)],
)
def test_rms_norm_fp8_plans(dtype, hidden, group, vectorized, block, slots):
    """Rows map as the forward's, in 16-byte chunks whatever the alignment, with a group's lanes in one row."""
    x, y = arr((300, hidden), dtype), arr((300, hidden), "uint8", ptr=BASE + 2**28)
    plan = plan_fp8(x, y, None, None, (hidden, hidden, 0), 300, hidden, group)
    assert (plan.vectorized, plan.block, plan.slots) == (vectorized, block, slots)
    assert plan.grid == -(-300 // block[1])
    lanes = group // (16 // ITEMSIZE[dtype]) if group > fp8.TOKEN_SCALE else 1
    assert plan.block[0] % lanes == 0
    assert (fp8.SOURCE, plan.name) in set(all_variants())


@pytest.mark.parametrize(
    "dtype,hidden,group,residual,walks",
    [("bfloat16", 2048, fp8.STATIC_SCALE, False, True),  # 1 slot: the next row in flight
     ("bfloat16", 4096, fp8.STATIC_SCALE, False, False),  # 4 slots
     ("bfloat16", 7168, 128, False, False),
     ("bfloat16", 1027, fp8.STATIC_SCALE, False, True),  # element by element
     ("bfloat16", 4096, fp8.TOKEN_SCALE, False, True),  # one scale a row: its products held, the next row in flight
     ("bfloat16", 4096, fp8.STATIC_SCALE, True, False),  # the fused add stores the residual
     ("float32", 16384, 64, False, False),  # 8 slots: the next row would spill
     ("bfloat16", 32768, fp8.STATIC_SCALE, False, False)],  # read again
)
def test_rms_norm_fp8_walks_rows_with_the_next_in_flight(dtype, hidden, group, residual, walks):
    """walks_rows (the grid capped at the resident blocks) is the kernel's prefetches_rows: rows of 1-2 slots without
    the fused add, whatever the scales."""
    x, y = arr((300, hidden), dtype), arr((300, hidden), "uint8", ptr=BASE + 2**28)
    r = arr((300, hidden), dtype, ptr=BASE + 2**29) if residual else None
    plan = plan_fp8(x, y, r, None, (hidden, hidden, hidden if residual else 0), 300, hidden, group)
    assert fp8.walks_rows(plan, r) == walks, plan
    assert f", {str(residual).lower()}, {group}>" in plan.name


def test_rms_norm_fp8_alignment():
    """16-byte accesses need x (and residual, weight) 16-byte aligned and y's rows aligned to a chunk's bytes; a
    misaligned out or x moves element by element; impl='vector' then refuses."""
    x, r = arr((8, 4096)), arr((8, 4096), ptr=BASE + 2**27)
    y = arr((8, 4096), "uint8", ptr=BASE + 2**28)
    assert plan_fp8(x, y, r, None, (4096, 4096, 4096), 8, 4096, 64).vectorized
    odd_out = arr((8, 4096), "uint8", ptr=BASE + 2**28 + 4)
    assert not plan_fp8(x, odd_out, r, None, (4096, 4096, 4096), 8, 4096, 64).vectorized
    odd_x = arr((8, 4096), ptr=BASE + 2)
    assert not plan_fp8(odd_x, y, None, None, (4096, 4096, 0), 8, 4096, 64).vectorized
    with pytest.raises(ValueError, match="impl: 'vector' needs"):
        plan_fp8(odd_x, y, None, None, (4096, 4096, 0), 8, 4096, 64, "vector")


def test_rows_in_runs_take_the_runs_kernels():
    """q's heads as a (T, H, D) view of a fused qkv tensor: runs of H rows, a qkv row apart. rms_norm and its backward
    take them through rms_norm_fwd_runs / rms_norm_bwd_runs (rows held in registers); 16-byte chunks where every
    stride allows them, element by element otherwise (no shifted rows unless every row shares one shift)."""
    from cupyrope.ops.rmsnorm_checks import row_layout

    def views(head_dim, dtype="bfloat16", tokens=1000, heads=32, width=48):
        q = arr((tokens, heads, head_dim), dtype, strides=(width * head_dim, head_dim, 1))
        return q, arr((tokens, heads, head_dim), dtype, ptr=BASE + 2**32)

    q, y = views(128)
    layout = row_layout([q, y], ["x", "out"])
    assert (layout.inner_rows, layout.strides, layout.outer) == (32, (128, 128), (48 * 128, 32 * 128))
    assert layout.strides_of(0, 1, None) == (128, 128, 0) and layout.runs_of(0, 1) == (32, 48 * 128, 32 * 128)
    f = plan_forward(q, y, None, None, layout.plan_strides(), 32000, 128, runs=True)
    assert f.name == "cupyrope::rms_norm_fwd_runs<__nv_bfloat16, float, true, 1, false>" and f.vectorized
    b = plan_backward(y, q, y, arr((128,)), layout.plan_strides(), 32000, 128, n_sm=132, runs=True)
    assert b.name.startswith("cupyrope::rms_norm_bwd_runs<__nv_bfloat16, __nv_bfloat16, true, ") and not b.staged
    assert {f.name, b.name} <= set(name for _, name in all_variants())
    odd_q, odd_y = views(100)  # strides of 100 elements: not 16-byte multiples, and rows of several shifts
    odd = row_layout([odd_q, odd_y], ["x", "out"])
    plan = plan_forward(odd_q, odd_y, None, None, odd.plan_strides(), 32000, 100, runs=True)
    assert not plan.vectorized and not plan.shifted and plan.name.startswith("cupyrope::rms_norm_fwd_runs<")
    long_q, long_y = views(65536, "float32", tokens=2, heads=2, width=3)
    long = row_layout([long_q, long_y], ["x", "out"])
    with pytest.raises(ValueError, match="x: rows in runs .* rows of 65536 elements do not"):
        plan_forward(long_q, long_y, None, None, long.plan_strides(), 4, 65536, runs=True)
    with pytest.raises(ValueError, match="x: its rows .* must be evenly strided"):
        row_layout([q, y], ["x", "out"], runs=False)
    many = arr((2**20, 2**12 + 1, 2), "float32", strides=(2**13 + 4, 2, 1))  # runs of rows numbering 2^32 and more
    with pytest.raises(ValueError, match="below 2\\^32"):
        row_layout([many], ["x"])
