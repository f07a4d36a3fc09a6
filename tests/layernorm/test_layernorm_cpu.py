"""LayerNorm without a GPU: the float64 reference against torch's layer_norm autograd, the plans (row shapes, the
backward's grid and partial rows), the argument checks, and the torch layer's CPU path (the module against
nn.LayerNorm, the same exceptions as the GPU path)."""

import dataclasses
import itertools

import numpy as np
import pytest
from fakes import PLANNING_PROFILE
from helpers import layer_norm_fwd_max_threads, planned_array as arr

from cupyrope import reference
from cupyrope._runtime.arrays import CTYPE, ITEMSIZE
from cupyrope.ops.layernorm_plan import BWD_MAX_SLOTS, FWD_MAX_SLOTS, plan_backward, plan_forward, stage_bytes, variants
from cupyrope.ops.rmsnorm_plan_backward import cap_grid

LN_CHOICES = PLANNING_PROFILE.layer_norm
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("which", ["both", "weight", "bias", "none"])
def test_reference_is_torch_layer_norm(rng, which):
    hidden = 37
    x = rng.standard_normal((3, 5, hidden)) * 3 + 10
    w = rng.standard_normal(hidden) if which in ("both", "weight") else None
    b = rng.standard_normal(hidden) if which in ("both", "bias") else None
    dy = rng.standard_normal(x.shape)
    tx = torch.tensor(x, requires_grad=True)
    tw = None if w is None else torch.tensor(w, requires_grad=True)
    tb = None if b is None else torch.tensor(b, requires_grad=True)
    ty = torch.nn.functional.layer_norm(tx, (hidden,), tw, tb, 1e-5)
    y, mean, rstd = reference.layer_norm(x, w, b, 1e-5, return_stats=True)
    np.testing.assert_allclose(y, ty.detach().numpy(), atol=1e-12)
    np.testing.assert_allclose(mean, x.mean(-1), atol=1e-12)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x.var(-1) + 1e-5), rtol=1e-12)
    ty.backward(torch.tensor(dy))
    dx, dw, db = reference.layer_norm_backward(dy, x, w, b, 1e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), atol=1e-12)
    for got, param in ((dw, tw), (db, tb)):
        assert (got is None) == (param is None)
        if param is not None:
            np.testing.assert_allclose(got, param.grad.numpy(), atol=1e-10)


def test_fused_add_reference_rounds_the_sum_once(rng):
    x, r = rng.standard_normal((4, 16)), rng.standard_normal((4, 16))
    y, s = reference.fused_add_layer_norm(x, r, None, None, dtype="bfloat16")
    np.testing.assert_array_equal(s, reference.round_to(x + r, "bfloat16"))
    np.testing.assert_allclose(y, reference.layer_norm(s), atol=1e-12)


@pytest.mark.parametrize("dtype,hidden,vectorized,shifted,slots,width", [
    ("bfloat16", 4096, True, False, 4, 128),    # 512 chunks: 32 elements a thread
    ("bfloat16", 8192, True, False, 8, 128),    # forward_eight_slots_min_hidden: 8 chunks a thread
    ("bfloat16", 16384, True, False, 8, 256),
    ("bfloat16", 32768, True, False, 8, 512),
    ("bfloat16", 65536, True, False, 0, 512),   # read in passes
    ("float32", 4096, True, False, 4, 256),     # fp32 below the long rows: 4 chunks a thread at most (8 spilled)
    ("float32", 16384, True, False, 8, 512),
    ("float32", 20000, True, False, 0, 512),
    ("float16", 12289, True, True, 4, 416),     # shifted long rows keep 4 slots
    ("float16", 61, False, False, 8, 8),        # odd and short: element by element
    ("float16", 1027, True, True, 4, 64),       # odd rows of 512+ bytes: shifted 16-byte chunks
    ("float16", 2999, True, True, 4, 96),
])
def test_forward_plans(dtype, hidden, vectorized, shifted, slots, width):
    x = arr((100, hidden), dtype, ptr=0x7F0000000000 + (2 if shifted else 0))
    y = arr((100, hidden), dtype, ptr=0x7E0000000000 + (2 if shifted else 0))
    w = arr((hidden,), "float32", ptr=0x7D0000000000 + 4)  # the weight's own alignment does not matter when shifted
    plan = plan_forward(x, y, None, w if shifted else arr((hidden,), "float32"), None, (hidden, hidden), 100, hidden,
                        choices=LN_CHOICES)
    assert (plan.vectorized, plan.shifted, plan.slots) == (vectorized, shifted, slots), plan
    if slots:
        assert plan.block[0] == width or not vectorized, plan
    assert plan.name.startswith("cupyrope::layer_norm_fwd<") and plan.name.endswith(f", {str(shifted).lower()}>")
    assert plan.grid * plan.block[1] >= 100


def test_backward_plan_caps_grid_and_counts_partial_rows():
    x = arr((100000, 1024), "bfloat16")
    plan = plan_backward(x, x, x, arr((1024,), "bfloat16"), None, (1024, 1024, 1024), 100000, 1024,
                         choices=LN_CHOICES)
    assert plan.vectorized and plan.slots == 2 and plan.block == (64, 4), plan
    assert plan.name == "cupyrope::layer_norm_bwd<__nv_bfloat16, __nv_bfloat16, true, 2, 3>"  # rows 4 a block: 3 blocks an SM
    plan.grid = cap_grid(plan, 132 * 4, 100000, "bfloat16")
    assert plan.grid * plan.block[1] == 132 * 4 * 4 and plan.grid == 528
    # two stages of dy and x, 2 chunks a thread
    assert plan.staged and plan.shared_mem == stage_bytes(plan) == 2 * 2 * 2 * 16 * 256
    fp32 = arr((100, 4096), "float32")
    unstaged = plan_backward(fp32, fp32, fp32, arr((4096,), "float32"), None, (4096,) * 3, 100, 4096,
                             choices=LN_CHOICES)
    assert unstaged.slots == 2 and not unstaged.staged and unstaged.shared_mem == 0, unstaged  # two blocks an SM
    assert unstaged.name.endswith(", 2, 0>")
    small = plan_backward(x, x, x, None, arr((1024,), "float32"), (1024, 1024, 1024), 3, 1024, choices=LN_CHOICES)
    assert "float>" not in small.name and ", float, " in small.name  # W follows the bias without a weight
    small.grid = cap_grid(small, 528, 3, "bfloat16")
    assert small.grid * small.block[1] == 4 and small.grid == 1  # a slot past the rows leaves a zero row


@pytest.mark.parametrize("hidden,with_params,limit,shared", [
    (16384, True, 226 * 1024, True), (16384, False, 226 * 1024, False), (65536, True, 226 * 1024, False),
    (16384, True, 98 * 1024, False),  # a GPU of 99 KiB a block (Ada, consumer Ampere)
])
def test_backward_rows_in_passes_sum_in_shared_memory_where_they_fit(hidden, with_params, limit, shared):
    x = arr((100, hidden), "float32")
    weight = arr((hidden,), "float32") if with_params else None
    plan = plan_backward(x, x, x, weight, None, (hidden,) * 3, 100, hidden, shared_limit=limit, choices=LN_CHOICES)
    assert plan.slots == 0 and plan.block == (512, 1), plan
    assert plan.shared_acc == shared  # dweight's and dbias's partial rows: 2 x hidden fp32 (no sums without params)
    assert plan.shared_mem == (2 * hidden * 4 if shared else 0)


def test_backward_stages_rows_where_shared_memory_holds_them():
    x = arr((100, 8192), "bfloat16")  # 2 chunks a thread on 512 threads: 64 KiB of stages
    staged = plan_backward(x, x, x, None, None, (8192,) * 3, 100, 8192, shared_limit=226 * 1024,
                           choices=LN_CHOICES)
    assert staged.staged and staged.shared_mem == 64 * 1024 and staged.name.endswith(", 2, 2>"), staged
    small = plan_backward(x, x, x, None, None, (8192,) * 3, 100, 8192, shared_limit=63 * 1024,  # Turing: 64 KiB
                          choices=LN_CHOICES)
    assert not small.staged and small.shared_mem == 0 and small.name.endswith(", 2, 0>"), small


@pytest.mark.parametrize("dtype,hidden,split,width", [
    ("float32", 16384, 2, 512), ("bfloat16", 16384, 2, 512), ("float32", 20000, 4, 320), ("bfloat16", 40000, 8, 320),
    ("float32", 65536, 8, 512), ("bfloat16", 65536, 8, 512),
])
def test_backward_splits_long_rows_over_a_cluster(dtype, hidden, split, width):
    """16-byte rows that one block's registers cannot hold take the fewest cluster blocks whose parts the staged
    walk holds (4 fp32 / 2 fp16-bf16 chunks a thread on up to 512 threads), with two stages of dy and x each; without
    clusters, rows past 8 parts, or odd rows, they are read in passes."""
    x = arr((300, hidden), dtype)
    plan = plan_backward(x, x, x, arr((hidden,), dtype), None, (hidden,) * 3, 300, hidden,
                         shared_limit=226 * 1024, clusters=True, choices=LN_CHOICES)
    slots = BWD_MAX_SLOTS[True, ITEMSIZE[dtype]]
    assert plan.split == split and plan.block == (width, 1) and plan.slots == slots, plan
    assert plan.name == f"cupyrope::layer_norm_bwd_split<{CTYPE[dtype]}, {CTYPE[dtype]}, {slots}, {split}>"
    assert plan.shared_mem == 2 * 2 * slots * 16 * width and plan.grid == 300 * split
    assert (width - 32) * slots < -(-hidden * ITEMSIZE[dtype] // 16) / split <= width * slots  # the fewest threads
    small = plan_backward(x, x, x, None, None, (hidden,) * 3, 300, hidden, shared_limit=63 * 1024, clusters=True,
                          choices=LN_CHOICES)
    # as many blocks or more, with smaller stages, or (past 8 blocks) rows in passes
    assert small.shared_mem <= 63 * 1024 and (small.split >= split or small.slots == 0), small
    assert plan_backward(x, x, x, None, None, (hidden,) * 3, 300, hidden, choices=LN_CHOICES).slots == 0
    odd = arr((300, hidden + 1), dtype)
    assert plan_backward(odd, odd, odd, None, None, (hidden + 1,) * 3, 300, hidden + 1, clusters=True,
                         choices=LN_CHOICES).split == 1
    longest = arr((300, 131072), "bfloat16")  # 16384 chunks: 2048 a block of 8
    assert plan_backward(longest, longest, longest, None, None, (131072,) * 3, 300, 131072, clusters=True,
                         choices=LN_CHOICES).slots == 0
    held = arr((300, 8192), dtype)  # in one block's registers
    assert plan_backward(held, held, held, None, None, (8192,) * 3, 300, 8192, clusters=True,
                         choices=LN_CHOICES).split == 1


@pytest.mark.parametrize("resident", [66, 0])
def test_backward_call_walks_split_rows_on_the_clusters_the_gpu_holds(monkeypatch, resident):
    """layer_norm_backward's call on a stand-in H100: fp32 rows of 16384 on as many 2-block clusters as the GPU holds
    at once, each a rows slot (the kernel's row step) with one pair of partial rows for rms_norm_dw to add; where the
    driver places none, the rows are read in passes on the resident blocks."""
    from fakes import stand_in_for_the_device

    from cupyrope.ops import layernorm

    stand_in_for_the_device(monkeypatch.setattr, blocks_per_wave=132, resident_clusters=lambda split: resident)
    x, w = arr((5000, 16384), "float32"), arr((16384,), "float32")
    plan = layernorm._plan_backward_call(x, x, w, None, None, None, False, True, True, True, 1e-5, "auto")
    slots = layernorm.BWD_TAIL.unpack(plan.launch.tail)[5]
    partial_rows = layernorm.DW_TAIL.unpack(plan.dw_launch.tail)[0]
    if resident:
        assert plan.split == 2 and plan.grid == 2 * resident and slots == partial_rows == resident, plan
        assert plan.launch.shared_mem == 2 * 2 * 4 * 16 * 512
    else:
        assert plan.split == 1 and plan.slots == 0 and plan.grid == 132 and slots == partial_rows == 132, plan


@pytest.mark.parametrize("dtype,hidden,rows_a_block,staged", [
    ("bfloat16", 1024, 4, 3), ("float16", 1152, 2, 3), ("bfloat16", 4096, 1, 2), ("bfloat16", 8192, 1, 2),
    ("float32", 8192, 1, 2), ("float32", 4096, 1, 0),
])
def test_backward_staged_blocks_follow_the_rows_a_block(dtype, hidden, rows_a_block, staged):
    """fp16/bf16 staged rows of at least the profile's backward_three_blocks_min_rows rows a block (2) take the variant
    of three blocks an SM (80 registers), rows a block each and fp32 rows the one of two; fp32 rows of 2 slots are
    not staged. The profile moves the line: 1 stages every fp16/bf16 row on three, 1024 none."""
    x = arr((5000, hidden), dtype)

    def plan_with(min_rows):
        choices = dataclasses.replace(LN_CHOICES, backward_three_blocks_min_rows=min_rows)
        return plan_backward(x, x, x, arr((hidden,), dtype), None, (hidden,) * 3, 5000, hidden, choices=choices)

    plan = plan_with(LN_CHOICES.backward_three_blocks_min_rows)
    assert LN_CHOICES.backward_three_blocks_min_rows == 2
    assert plan.block[1] == rows_a_block and plan.staged == staged, plan
    assert plan.name.endswith(f", {staged}>") and plan.block[0] * plan.block[1] <= (768 if staged == 3 else 512)
    if staged:
        assert plan_with(1).staged == (3 if dtype != "float32" else 2) and plan_with(1024).staged == 2


def test_every_planned_kernel_is_a_variant_within_its_launch_bound():
    """Every plan names a compiled variant, on blocks its launch bound allows: 1024 threads for forward rows of 4+
    slots but 16-byte rows of 8, else 512 (LayerNormBounds, LayerNormBwdBounds)."""
    names = {name for _, name in variants()}
    for dtype in ("float32", "float16", "bfloat16"):
        for hidden in (1, 7, 64, 100, 1000, 1027, 2048, 4096, 5000, 8191, 8192, 12288, 16384, 20000, 32768, 65536):
            for shift in (0, 2):
                x = arr((9, hidden), dtype, ptr=0x7F0000000000 + shift)
                w = arr((hidden,), dtype)
                for residual in (None, x):
                    fwd = plan_forward(x, x, residual, w, w, (hidden,) * 3, 9, hidden, choices=LN_CHOICES)
                    assert fwd.name in names, fwd
                    assert fwd.block[0] * fwd.block[1] <= layer_norm_fwd_max_threads(fwd), fwd
                for limit, clusters in itertools.product((227 * 1024, 48 * 1024), (False, True)):
                    # an H100's shared memory a block, and the least there is; with clusters, long rows split
                    bwd = plan_backward(x, x, arr((9, hidden), dtype), w, w, (hidden,) * 3, 9, hidden,
                                        shared_limit=limit - 1024, clusters=clusters, choices=LN_CHOICES)
                    assert bwd.name in names, bwd
                    assert bwd.block[0] * bwd.block[1] <= 512 and bwd.shared_mem <= limit - 1024, bwd
    assert max(FWD_MAX_SLOTS.values()) == 8 and BWD_MAX_SLOTS[True, 2] == 2


def test_cpu_module_matches_nn_layer_norm(rng):
    from cupyrope.torch import LayerNorm, fused_add_layer_norm, layer_norm

    ref = torch.nn.LayerNorm(48)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = LayerNorm(48)
    ours.load_state_dict(ref.state_dict())
    x = torch.tensor(rng.standard_normal((2, 3, 48)) * 2 + 5, dtype=torch.float32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = ref(x), ours(x2)
    torch.testing.assert_close(y2, y)
    dy = torch.randn_like(y)
    y.backward(dy)
    y2.backward(dy)
    for got, want in ((x2.grad, x.grad), (ours.weight.grad, ref.weight.grad), (ours.bias.grad, ref.bias.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert LayerNorm(48, bias=False).state_dict().keys() == torch.nn.LayerNorm(48, bias=False).state_dict().keys()
    assert not LayerNorm(48, elementwise_affine=False).state_dict()
    xs, rs = x.detach().clone(), torch.ones_like(x).detach()
    fused_add_layer_norm(xs, rs, ref.weight.detach(), ref.bias.detach())
    torch.testing.assert_close(rs, x.detach() + 1)
    torch.testing.assert_close(xs, layer_norm(x.detach() + 1, ref.weight.detach(), ref.bias.detach()))


def test_cpu_path_raises_the_gpu_paths_errors():
    from cupyrope.torch import LayerNorm, layer_norm

    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="bias: expected shape \\(16,\\)"):
        layer_norm(x, torch.ones(16), torch.zeros(8))
    with pytest.raises(TypeError, match="bias: expected dtype float32 \\(like weight\\)"):
        layer_norm(x.half(), torch.ones(16), torch.zeros(16, dtype=torch.float16))
    with pytest.raises(ValueError, match="eps: expected a finite number > 0"):
        layer_norm(x, eps=-1.0)
    with pytest.raises(ValueError, match="normalized_shape"):
        LayerNorm((4, 16))
    with pytest.raises(TypeError, match="x: expected dtype"):
        layer_norm(x.long())


def test_torch_ops_pass_opcheck_on_cpu(rng):
    """The registered ops' schemas, fake kernels (torch.compile) and autograd, on CPU tensors."""
    from torch.library import opcheck

    from cupyrope.torch import layer_norm  # importing it registers the ops

    x = torch.tensor(rng.standard_normal((3, 5, 40)) + 2, dtype=torch.float32)
    w, b = torch.randn(40), torch.randn(40)
    opcheck(torch.ops.cupyrope.layer_norm.default, (x, w, b, 1e-5))
    opcheck(torch.ops.cupyrope.layer_norm.default, (x.clone().requires_grad_(), None, b.clone().requires_grad_(), 1e-5))
    _, mean, rstd = torch.ops.cupyrope.layer_norm(x, w, b, 1e-5)
    opcheck(torch.ops.cupyrope.layer_norm_backward.default, (torch.randn_like(x), x, w, None, mean, rstd, 1e-5))
    opcheck(torch.ops.cupyrope.fused_add_layer_norm_.default, (x.clone(), torch.randn_like(x), w, b, 1e-5))
    torch.testing.assert_close(layer_norm(x, w, b), torch.ops.cupyrope.layer_norm(x, w, b, 1e-5)[0], rtol=0, atol=0)
