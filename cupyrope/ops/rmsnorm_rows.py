"""The row machinery RMSNorm's forward and backward planners share: how a row of `hidden` elements maps onto
threads (threads per row, register slots per thread), whether it moves in 16-byte chunks (aligned, or
"shifted": odd rows at any offset from a 16-byte boundary), and how clusters of blocks split rows too long for one.

A block holds block[1] rows of block[0] threads each. A thread owns chunks lane, lane + width, ... of a row
(16 bytes each when vectorized, else one element), `slots` of them in registers between the row's reduction and
its output; slots 0: the row is read twice (a loop over it).
"""

from .._runtime.arrays import CTYPE, FLOAT_DTYPES, ITEMSIZE
from .._runtime.compile import allow_shared_memory, get_kernel
from .._runtime.device import resident_blocks, resident_clusters, shared_optin, sm_count

REGISTER_SLOTS = (1, 2, 4, 8)  # accesses per thread kept in registers (the kernels' NPT; 0: read twice)
MAX_WIDTH = 512  # threads per row: a 1024-thread row block leaves one block per SM (no overlap)
# Unaligned rows (odd hidden sizes) of at least this many bytes take the shifted 16-byte path (forward and
# backward); shorter ones stay element by element (few chunks a row: the edges dominate).
SHIFT_MIN_ROW_BYTES = 512
# Rows too long for one block (forward: its registers; backward: its shared memory; LayerNorm's backward: its
# registers) split over a cluster of this many blocks (sm_90+): rms_norm_fwd_split, rms_norm_bwd_split,
# layer_norm_bwd_split. The first size whose parts one block holds; 8 is the portable cluster limit.
SPLIT_SIZES = (2, 4, 8)
SHARED_OPTIN_LIMIT = 227 * 1024  # dynamic shared memory one block may have (H100: 227 KiB, A100: 163)
STATIC_SHARED_BYTES = 1024  # the kernels' own shared arrays, counted against the same limit


class NormPlan:
    __slots__ = ("source", "name", "grid", "block", "vectorized", "shifted", "staged", "slots", "extents",
                 "shared_mem", "shared_acc", "reread", "split", "cluster_step", "one_cluster", "cluster_rounds",
                 "out_layouts", "launch", "dw_launch", "new_output", "new_rstd", "new_dx", "new_dweight",
                 "new_partial", "new_scales", "new_stat", "new_params")

    def __init__(self, source, name, grid, block, vectorized, slots):
        self.source = source  # the .cu file of the kernel
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
        self.cluster_rounds = False  # backward: rms_norm_bwd_cluster over rounds of clusters

    def __repr__(self):
        return f"NormPlan({self.name}, grid={self.grid}, block={self.block})"


def flag(value: bool) -> str:
    """A bool as a C++ template argument."""
    return "true" if value else "false"


def with_flag(name: str, value: bool) -> str:
    """A kernel's name with one more bool template argument appended (the forward's OUT, the backward's GRAD)."""
    return f"{name[:-1]}, {flag(value)}>"


def row_variant_params(max_slots):
    """(dtype, weight dtype, vectorized, slots) of every variant of a row kernel (rms_norm_fwd, rms_norm_bwd): the
    weight fp32 or x's dtype, slots 0 (read twice) and the register slots up to max_slots[vectorized, element size]."""
    for dtype in FLOAT_DTYPES:
        for weight in sorted({"float32", dtype}):
            for vec in (False, True):
                for slots in (0, *REGISTER_SLOTS):
                    if slots <= max_slots[vec, ITEMSIZE[dtype]]:
                        yield dtype, weight, vec, slots


def runs_variant(name: str) -> str:
    """A register-row kernel's variant for rows in runs (RowLayout): rms_norm_fwd<T, W, VEC, NPT, ADD false, SHIFT> or
    rms_norm_bwd<T, W, VEC, NPT, SHIFT> becomes rms_norm_fwd_runs / rms_norm_bwd_runs<T, W, VEC, NPT, SHIFT>."""
    kernel, args = name[:-1].split("<", 1)
    args = args.split(", ")
    return f"{kernel}_runs<{', '.join(args[:4] + args[-1:])}>"


def take_runs(plan, hidden: int):
    """A row plan renamed to its runs kernel (runs_variant), or a ValueError where its rows are read twice (no runs
    kernel reads rows twice)."""
    if not plan.slots:
        raise ValueError(f"x: rows in runs (such as heads of a fused qkv view) are taken where a row fits the "
                         f"kernels' registers; rows of {hidden} elements do not: pass a contiguous array")
    plan.name = runs_variant(plan.name)
    return plan


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_threads(n: int) -> int:
    """Threads for n chunks: a power of two up to a warp (shuffle reductions), else whole warps (a
    power of two would leave up to half of them idle: 130 chunks on 256 threads)."""
    return next_pow2(n) if n <= 32 else -(-n // 32) * 32


def row_shape(hidden: int, elems: int, chunks_per_thread: int = 1, max_slots: int = 8,
              max_width: int = MAX_WIDTH, wide_first: bool = False) -> tuple[int, int]:
    """(threads per row, register slots per thread; 0 = read twice) for a row of ``hidden`` elements
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


def vectorizable(arrays, row_strides, hidden, dtype) -> bool:
    """16-byte accesses need hidden a multiple of 16 bytes and every pointer (weight too) and row
    stride 16-byte aligned."""
    elems = 16 // ITEMSIZE[dtype]
    return (
        hidden % elems == 0
        and all(a.ptr % 16 == 0 for a in arrays if a is not None)
        and all(s % elems == 0 for s in row_strides)
    )


def shiftable(arrays, row_strides, hidden, dtype) -> bool:
    """Rows that are not 16-byte aligned still move in 16-byte chunks (the kernels' SHIFT) when every
    array's row starts at the same offset from a 16-byte boundary as the first array's, in every row. A 0 among
    row_strides (rows in runs: RowLayout.plan_strides) asks for every row at the first row's offset."""
    itemsize = ITEMSIZE[dtype]
    elems = 16 // itemsize
    x = arrays[0]
    return (
        hidden * itemsize >= SHIFT_MIN_ROW_BYTES
        and x.ptr % itemsize == 0
        and all((a.ptr - x.ptr) % 16 == 0 for a in arrays if a is not None)
        and all((s - row_strides[0]) % elems == 0 for s in row_strides)
    )


def shifted_span(hidden: int, itemsize: int) -> int:
    """Elements a shifted row's 16-byte chunks cover at most: up to E - 1 more than the row (the part
    before its first 16-byte boundary)."""
    return hidden + 16 // itemsize - 1


def row_chunks(hidden: int, itemsize: int, shifted: bool) -> int:
    """16-byte chunks a row moves in (shifted: from the boundary before the row)."""
    return -(-(shifted_span(hidden, itemsize) if shifted else hidden) * itemsize // 16)


def chunks_span(hidden: int, itemsize: int, shifted: bool) -> int:
    """Elements a 16-byte row's chunks cover (shifted: from the boundary before the row), in whole chunks:
    a row of the row cache or of the shifted backward's shared dweight sums (the kernels' chunks_span)."""
    elems = 16 // itemsize
    return -(-(shifted_span(hidden, itemsize) if shifted else hidden) // elems) * elems


def plan_rows(source, kernel, dtype, weight_dtype, arrays, row_strides, rows, hidden, max_slots, elems_per_thread,
              block_threads, extra, impl, can_shift=False, max_width=MAX_WIDTH, wide_first=(), params=1):
    """The plan of a row kernel (rms_norm_fwd, rms_norm_bwd, layer_norm_fwd, ...) whose template arguments are (T, W,
    VEC, NPT, *extra[, SHIFT]). can_shift: the kernel takes a last SHIFT parameter; the last `params` arrays are
    per-column parameters (the weight; LayerNorm's bias too), which shifted rows read at any alignment. max_slots:
    register slots by (vectorized, element size). max_width, wide_first (the kinds of 16-byte row, "aligned" or
    "shifted", that widen first): see row_shape."""
    itemsize = ITEMSIZE[dtype]

    def shape(vec, span, kind="aligned"):  # (width, slots) for a row of `span` elements
        elems = 16 // itemsize if vec else 1
        return row_shape(span, elems, max(1, elems_per_thread // elems), max_slots[vec, itemsize],
                         max_width if vec else MAX_WIDTH, vec and kind in wide_first)

    vectorized = impl != "scalar" and vectorizable(arrays, row_strides, hidden, dtype)
    shifted = (can_shift and not vectorized and impl != "scalar"
               and shiftable(arrays[:len(arrays) - params], row_strides, hidden, dtype))
    if shifted:
        # Rows read twice (slots 0) move in 16-byte chunks too, unless element by element holds them in
        # registers (shifted rows span up to E - 1 more elements, in fewer slots).
        width, slots = shape(True, shifted_span(hidden, itemsize), "shifted")
        shifted = vectorized = slots > 0 or not shape(False, hidden)[1]
    if impl == "vector" and not vectorized:
        raise ValueError("impl: 'vector' needs hidden a multiple of 16 bytes and 16-byte aligned rows")
    if not shifted:
        width, slots = shape(vectorized, hidden)
    rows_per_block = max(1, block_threads // width)
    blocks = -(-rows // rows_per_block)
    flags = [*extra, flag(shifted)] if can_shift else extra
    args = ", ".join([CTYPE[dtype], CTYPE[weight_dtype], flag(vectorized), str(slots), *flags])
    plan = NormPlan(source, f"cupyrope::{kernel}<{args}>", blocks, (width, rows_per_block), vectorized, slots)
    plan.shifted = shifted
    return plan


# --------------------------------------------------------------------------------------- clusters


def split_parts(hidden: int, itemsize: int, min_blocks: int = 1, shifted: bool = False):
    """(blocks, 16-byte chunks of the longest part) for each cluster size of SPLIT_SIZES from min_blocks: a row's
    chunks (shifted: as many as a row of any shift spans) split into parts of whole chunks, the last one shorter
    (the kernels' cluster_part)."""
    chunks = row_chunks(hidden, itemsize, shifted)
    return [(split, -(-chunks // split)) for split in SPLIT_SIZES if split >= min_blocks]


def whole_steps(count: int, step: int) -> int:
    """count rounded down to a multiple of step, at least step (blocks or clusters past the last row add zero
    partials)."""
    return max(step, count // step * step)


def cap_split_grid(plan, max_clusters: int, rows: int) -> int:
    """A split plan's grid: one cluster a row, at most max_clusters (at least one), each of plan.split blocks;
    where clusters walk several rows, a multiple of plan.cluster_step clusters (the shifted backward's, see
    rmsnorm_plan_backward.cap_grid)."""
    clusters = max(1, min(rows, max_clusters))
    return plan.split * (whole_steps(clusters, plan.cluster_step) if clusters < rows else clusters)


def fit_clusters(plan, kernel, rows: int, device: int) -> bool:
    """A split plan's grid becomes the clusters the GPU holds at once: its clusters walk the rows, and one left
    for a second wave would double its rows' time. False where the driver cannot place a cluster."""
    clusters = resident_clusters(kernel, plan.split, plan.block[0], plan.shared_mem, device)
    plan.grid = cap_split_grid(plan, clusters, rows)
    return clusters > 0


# ------------------------------------------------------------------------------------------ device


def shared_limit(device: int) -> int:
    """Dynamic shared memory a plan may give one block on device: its opt-in less the static arrays."""
    return shared_optin(device) - STATIC_SHARED_BYTES


def kernel_for(plan, device: int):
    """The plan's kernel on device, allowed the plan's dynamic shared memory."""
    kernel = get_kernel(plan.source, plan.name, device)
    allow_shared_memory(kernel, plan.shared_mem)
    return kernel


def blocks_per_wave(kernel, plan, device) -> int:
    """Blocks of the plan the device's SMs hold at once (registers and shared memory decide)."""
    return sm_count(device) * resident_blocks(kernel, plan.block[0] * plan.block[1], plan.shared_mem, device)
