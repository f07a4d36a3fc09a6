"""Batch invariance on the GPU: a row's output bits do not depend on how many rows its call has or where the row
sits in it. Each case runs one large call, then calls of fewer rows (crossing the planners' row-count boundaries:
small calls, direct kernels, one cluster, rounds of clusters, one or two waves) on the same rows in a shuffled
order, and compares bits. Odd rows (not a multiple of 16 bytes) keep their offset from a 16-byte boundary when
shuffled: that offset is part of a row's layout (docs/design.md, "Batch invariance")."""

import numpy as np
import pytest

import cupyrope
from cupyrope._runtime.arrays import ITEMSIZE
from helpers import DTYPES, random_host, requires_gpu, to_device

pytestmark = [pytest.mark.gpu, requires_gpu]

ROW_COUNTS = [1, 2, 3, 8, 9, 31, 32, 33, 64, 65, 131, 132, 264, 265, 1000, 2048, 4096, 8192, 16384, 32768]
MAX_ELEMENTS = 1 << 25
HIDDEN = [64, 130, 1027, 2048, 4096, 5120, 8192, 12288, 16384, 20001, 32768, 65536, 131072]


def shuffled_rows(rows, n, hidden, itemsize, rng):
    """Which of a rows-row call's rows an n-row call takes, position by position: distinct rows in a random order,
    each at a position with its own offset from a 16-byte boundary (contiguous rows from an aligned base: row i
    starts i * hidden * itemsize bytes past it)."""
    if n == rows:
        return np.arange(rows)
    period = 16 // np.gcd(16, hidden * itemsize)
    index = np.empty(n, dtype=np.int64)
    for offset in range(period):
        positions = np.arange(offset, n, period)
        index[positions] = rng.choice(np.arange(offset, rows, period), len(positions), replace=False)
    return index


def row_counts(hidden):
    return [n for n in ROW_COUNTS if n * hidden <= MAX_ELEMENTS]


def host_bits(array, rows):
    """A CuPy array's bytes, one row of them per row."""
    import cupy

    return cupy.asnumpy(array).view(np.uint8).reshape(rows, -1)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_are_batch_invariant(rng, dtype, hidden):
    counts = row_counts(hidden)
    rows = counts[-1]
    itemsize = ITEMSIZE[dtype]
    weight_dtype = "float32" if hidden % 2 else dtype
    x_host = random_host((rows, hidden), dtype, rng)
    r_host = random_host((rows, hidden), dtype, rng)
    dy_host = random_host((rows, hidden), dtype, rng)
    w_host = random_host((hidden,), weight_dtype, rng)
    w = to_device(w_host, weight_dtype, "cupy")

    def run(index):
        x, r, dy = (to_device(a[index], dtype, "cupy") for a in (x_host, r_host, dy_host))
        y, rstd = cupyrope.rms_norm(x, w, return_rstd=True)
        dx_given, _ = cupyrope.rms_norm_backward(dy, x, w, rstd=rstd, offset=0.5)
        dx_recomputed, _ = cupyrope.rms_norm_backward(dy, x, w, offset=0.5)
        add_y, add_s = cupyrope.add_rms_norm(x, r, w)  # out of place: before the in-place call below
        dx_residual, _ = cupyrope.rms_norm_backward(dy, add_s, w, offset=0.5, residual_grad=r)
        cupyrope.fused_add_rms_norm(x, r, w)
        outputs = {"y": y, "rstd": rstd, "dx (rstd given)": dx_given, "dx (rstd recomputed)": dx_recomputed,
                   "fused add x": x, "fused add residual": r, "add_rms_norm y": add_y, "add_rms_norm s": add_s,
                   "dx with residual_grad": dx_residual}
        return {name: host_bits(a, len(index)) for name, a in outputs.items()}

    big = run(np.arange(rows))
    failures = []
    # The backward's recomputed rstd is the forward's: dx the same bits with rstd given or not.
    if bad := int(np.count_nonzero(np.any(big["dx (rstd given)"] != big["dx (rstd recomputed)"], axis=-1))):
        failures.append(f"dx: {bad} of {rows} rows differ between rstd given and rstd recomputed")
    # Out of place and in place: the same additions and norm, the same bits.
    for out_of_place, in_place in (("add_rms_norm y", "fused add x"), ("add_rms_norm s", "fused add residual")):
        if bad := int(np.count_nonzero(np.any(big[out_of_place] != big[in_place], axis=-1))):
            failures.append(f"{out_of_place}: {bad} of {rows} rows differ from {in_place}")
    for n in [n for n in counts if n < rows]:
        index = shuffled_rows(rows, n, hidden, itemsize, rng)
        small = run(index)
        for name in big:
            if bad := int(np.count_nonzero(np.any(big[name][index] != small[name], axis=-1))):
                failures.append(f"{name}: {bad} of {n} rows differ from the {rows}-row call")
    assert not failures, "\n".join(failures)


def token_failures(run, tokens, counts, rng):
    """How the calls of `counts` tokens (random ones, shuffled) differ in bits from the one call of all `tokens`:
    run(index) gives the bits of those tokens, a row each."""
    big = run(np.arange(tokens))
    failures = []
    for n in counts:
        index = rng.permutation(rng.choice(tokens, n, replace=False))
        if bad := int(np.count_nonzero(np.any(big[index] != run(index), axis=-1))):
            failures.append(f"{bad} of {n} tokens differ from the {tokens}-token call")
    return failures


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_tokens_are_batch_invariant(rng, dtype, cache):
    import cupy

    heads, head_dim, tokens = 8, 128, 32768
    x_host = random_host((tokens, heads, head_dim), dtype, rng)
    positions_host = rng.integers(0, 65536, tokens)
    cos_sin = cupyrope.rope_cache(65536, head_dim) if cache else None

    def run(index):
        x = to_device(x_host[index], dtype, "cupy")
        positions = cupy.asarray(positions_host[index])
        q = cupyrope.rope(x, positions, cos_sin_cache=cos_sin)
        return host_bits(q, len(index))

    failures = token_failures(run, tokens, [1, 2, 7, 32, 63, 64, 65, 128, 1000, 4096, 16384], rng)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_tokens_are_batch_invariant(rng, dtype, cache):
    """A token's q and k (forward) and dq and dk (backward) bits, whatever the call's token count: the forward's blocks
    of a few tokens and the backward's grid, fit to the GPU, hold different tokens at different sizes."""
    import cupy

    q_heads, k_heads, head_dim, tokens = 8, 2, 128, 16384
    q_host, dq_host = (random_host((tokens, q_heads, head_dim), dtype, rng) for _ in range(2))
    k_host, dk_host = (random_host((tokens, k_heads, head_dim), dtype, rng) for _ in range(2))
    weights = [to_device(random_host((head_dim,), dtype, rng), dtype, "cupy") for _ in range(2)]
    positions_host = rng.integers(0, 65536, tokens)
    cos_sin = cupyrope.rope_cache(65536, head_dim) if cache else None

    def run(index):
        q, k, dq, dk = (to_device(a[index], dtype, "cupy") for a in (q_host, k_host, dq_host, dk_host))
        positions = cupy.asarray(positions_host[index])
        outputs = cupyrope.qk_norm_rope(q, k, *weights, positions, cos_sin_cache=cos_sin, out="new")
        grads = cupyrope.qk_norm_rope_backward(dq, dk, q, k, *weights, positions, cos_sin_cache=cos_sin)[:2]
        return np.concatenate([host_bits(a, len(index)) for a in (*outputs, *grads)], axis=1)

    failures = token_failures(run, tokens, [1, 2, 7, 32, 63, 64, 65, 128, 1000, 4096], rng)
    assert not failures, "\n".join(failures)
