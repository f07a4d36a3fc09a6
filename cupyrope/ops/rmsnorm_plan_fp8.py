"""RMSNorm with an FP8 output (rms_norm_fp8) planning: which kernel variant a call runs, on what grid
(kernels_src/rmsnorm_fp8.cu).

Rows map onto threads as the forward's (rmsnorm_rows.row_shape, with the profile's small_row_bytes; longer 16-byte
fp16/bf16 rows take the profile's FP8 elements a thread by scale mode, ForwardChoices): a row is held in registers
whenever its threads can, else read again for each pass. The kernel always moves E = 16-byte chunks (element by
element where rows are not 16-byte aligned), so that a quantization group of 64 or 128 columns is GROUP / E
consecutive lanes; rows get at least that many threads.

Batch invariance: the row's threads, slots and variant follow from its size, dtype, alignment, quantization mode and
the launch profile, never from the number of rows.
"""

from .._runtime.arrays import CTYPE, FLOAT_DTYPES, ITEMSIZE
from .rmsnorm_plan_forward import FWD_BLOCK_THREADS, FWD_ELEMS_PER_THREAD, FWD_SMALL_ELEMS_PER_THREAD, ForwardChoices
from .rmsnorm_rows import REGISTER_SLOTS, NormPlan, flag, row_shape, vectorizable

SOURCE = "rmsnorm_fp8.cu"
# The kernel's GROUP besides the group sizes: the caller's one scale, or one scale a row.
STATIC_SCALE, TOKEN_SCALE = 0, 1
GROUP_SIZES = (64, 128)
# Register slots (16-byte chunks held between the passes) by element size: the forward's vectorized ones.
FP8_MAX_SLOTS = {4: 8, 2: 4}


def walks_rows(plan: NormPlan, residual) -> bool:
    """Whether the kernel's blocks walk rows with the next one in flight (rmsnorm_fp8.cu's prefetches_rows: rows of
    1-2 register slots, no fused add), so that the grid is the blocks the GPU holds at once."""
    return 0 < plan.slots <= 2 and residual is None


def kernel_group(scale_given: bool, group_size) -> int:
    """The kernel's GROUP for a call: STATIC_SCALE, TOKEN_SCALE or the group size."""
    return STATIC_SCALE if scale_given else group_size or TOKEN_SCALE


def plan_fp8(x, y, residual, weight, row_strides, rows, hidden, group, impl="auto", *,
             choices: ForwardChoices) -> NormPlan:
    """The plan of an rms_norm_fp8 launch. row_strides: x's, y's (in bytes: FP8 elements) and residual's (None:
    no residual). group: kernel_group's."""
    itemsize = ITEMSIZE[x.dtype]
    elems = 16 // itemsize
    x_stride, y_stride, residual_stride = row_strides
    strides = [x_stride] if residual is None else [x_stride, residual_stride]
    vectorized = (impl != "scalar" and vectorizable([x, residual, weight], strides, hidden, x.dtype)
                  and y.ptr % elems == 0 and y_stride % elems == 0)
    if impl == "vector" and not vectorized:
        raise ValueError("impl: 'vector' needs hidden a multiple of 16 bytes of x, 16-byte aligned rows of x "
                         "(residual, weight) and y rows aligned to 16 / x's element size bytes")
    if hidden * itemsize <= choices.small_row_bytes:
        per_thread = FWD_SMALL_ELEMS_PER_THREAD
    elif itemsize == 2 and vectorized:
        per_thread = choices.fp8_token_elems_per_thread if group == TOKEN_SCALE else choices.fp8_elems_per_thread
    else:
        per_thread = FWD_ELEMS_PER_THREAD
    width, slots = row_shape(hidden, elems, max(1, per_thread // elems), FP8_MAX_SLOTS[itemsize])
    lanes = group // elems if group > TOKEN_SCALE else 1  # a group's lanes: all in one row
    if width < lanes:
        chunks = hidden // elems
        width, slots = lanes, next(s for s in REGISTER_SLOTS if s * lanes >= chunks)
    rows_per_block = max(1, FWD_BLOCK_THREADS // width)
    weight_dtype = weight.dtype if weight is not None else "float32"
    args = ", ".join([CTYPE[x.dtype], CTYPE[weight_dtype], flag(vectorized), str(slots), flag(residual is not None),
                      str(group)])
    return NormPlan(SOURCE, f"cupyrope::rms_norm_fp8<{args}>", -(-rows // rows_per_block), (width, rows_per_block),
                    vectorized, slots)


def variants():
    """Every rms_norm_fp8 kernel the planner can ask for, and the conversion kernels of the tests."""
    for dtype in FLOAT_DTYPES:
        for weight in sorted({"float32", dtype}):
            for vec in (False, True):
                for slots in (0, *(s for s in REGISTER_SLOTS if s <= FP8_MAX_SLOTS[ITEMSIZE[dtype]])):
                    for add in (False, True):
                        for group in (STATIC_SCALE, TOKEN_SCALE, *GROUP_SIZES):
                            yield SOURCE, (f"cupyrope::rms_norm_fp8<{CTYPE[dtype]}, {CTYPE[weight]}, {flag(vec)}, "
                                           f"{slots}, {flag(add)}, {group}>")
    for software in (False, True):
        yield SOURCE, f"cupyrope::e4m3_encode<{flag(software)}>"
