"""Arrays in, pointers and descriptions out; outputs allocated like the input or checked not to overlap it; plan
fingerprints (no GPU: CPU tensors and array stand-ins)."""

from types import SimpleNamespace

import pytest

from cupyrope._runtime import checks
from cupyrope._runtime.arrays import Array, allocator, fingerprint


def test_outputs_are_allocated_like_the_input_or_checked_not_to_overlap_it():
    torch = pytest.importorskip("torch")

    def wrap(t):  # what describe() gives for a tensor (CPU here: the host-side logic only)
        return Array(t, "torch", t.data_ptr(), str(t.dtype).removeprefix("torch."), t.shape, t.stride(), 0)

    def check(x, out):  # what a plan keeps (computed once), then the per-call check
        checks.check_out_per_call(SimpleNamespace(out_layouts=checks.out_layouts(x, out)), x.ptr, out.ptr)

    base = torch.zeros(8, 64, dtype=torch.bfloat16)
    x = wrap(base[:4])
    new, ptr = allocator(x, x.shape, x.dtype)(x.obj)
    assert new.shape == (4, 64) and new.dtype == torch.bfloat16 and ptr == new.data_ptr() != x.ptr
    assert new.is_contiguous()
    strided = wrap(base[:, :32])  # a strided input still gets a contiguous result
    new, ptr = allocator(strided, strided.shape, strided.dtype)(strided.obj)
    assert new.shape == (8, 32) and new.is_contiguous() and ptr == new.data_ptr()
    check(x, wrap(base[:4]))  # another view of x's own elements: in place
    check(x, wrap(base[4:]))  # disjoint rows of one buffer
    with pytest.raises(ValueError, match="out: overlaps x"):
        check(x, wrap(base[2:6]))
    with pytest.raises(ValueError, match="out: overlaps x"):  # x's address, other strides: not in place
        check(wrap(base[:8, :8]), wrap(base.as_strided((8, 8), (1, 8))))
    assert checks.output_mode(None, x) == checks.NEW and checks.output_mode(x, x) == checks.IN_PLACE
    assert checks.output_mode(base, x) == checks.OUT


def test_fingerprint_tells_apart_everything_a_plan_depends_on():
    """Plans are cached by fingerprint: two arrays share one only if one plan serves both."""
    from fakes import FakeCupyArray as A

    base = fingerprint(A((6, 4, 64)), "x")
    moved = fingerprint(A((6, 4, 64), ptr=0x7F0000000000 + 4096), "x")  # elsewhere, same alignment
    assert moved[0] == base[0] and moved[1] == base[1] + 4096
    others = [
        A((6, 4, 64), "float16"),
        A((6, 4, 32)),
        A((6, 4, 64), strides=(512, 64, 1)),  # strided heads
        A((6, 4, 64), ptr=0x7F0000000000 + 8),  # not 16-byte aligned
        A((6, 4, 64), device=1),
    ]
    keys = {fingerprint(a, "x")[0] for a in others} | {base[0]}
    assert len(keys) == len(others) + 1
    with pytest.raises(TypeError, match="x: expected a cupy.ndarray or a CUDA torch.Tensor"):
        fingerprint([1.0], "x")
