"""Reduce (..., head_dim) tensors and their broadcast positions to the kernels' canonical view:
up to three token dimensions (each with a position stride) times one head dimension.

Leading dimensions where ``positions`` has size 1 are head dimensions (cos/sin are shared across
them); the others are token dimensions. Dimensions merge when every tensor's strides allow it, so a
contiguous tensor collapses to (tokens, heads) and (B, H, S, D) with positions (B, 1, S) becomes two
token dimensions and one head dimension, with no copies. Head dimensions that cannot merge into one
run are demoted to token dimensions whose position stride is 0 (correct, only less sharing).
"""

MAX_TOKEN_DIMS = 3


class Layout:
    __slots__ = ("token_sizes", "token_strides", "pos_strides", "heads", "head_strides")

    def __init__(self, token_sizes, token_strides, pos_strides, heads, head_strides):
        self.token_sizes = token_sizes  # 3 sizes, outermost first
        self.token_strides = token_strides  # one 3-tuple per tensor
        self.pos_strides = pos_strides  # 3-tuple
        self.heads = heads  # one count per group
        self.head_strides = head_strides  # one stride per tensor

    @property
    def n_tokens(self) -> int:
        a, b, c = self.token_sizes
        return a * b * c


def _merges(dims) -> bool:
    """dims: (size, strides) outermost first; True when they form one run for every tensor."""
    return all(
        all(so == inner_size * si for so, si in zip(outer_strides, inner_strides))
        for (_, outer_strides), (inner_size, inner_strides) in zip(dims, dims[1:])
    )


def _merge(dims):
    merged = []
    for size, strides in dims:
        if merged:
            prev_size, prev_strides = merged[-1]
            if all(ps == size * s for ps, s in zip(prev_strides, strides)):
                merged[-1] = (prev_size * size, strides)
                continue
        merged.append((size, strides))
    return merged


def canonical_layout(groups, pos_shape, pos_strides, arg_name="x") -> Layout:
    """groups: [(leading_shape, [element strides of each tensor with that shape]), ...] -- q's tensors,
    then k's. Groups share token dimensions and may differ in head dimensions (GQA)."""
    ndim = len(groups[0][0])
    if len(pos_shape) > ndim:
        raise ValueError(
            f"positions: expected at most {ndim} dimensions (the leading dimensions of {arg_name}, "
            f"{tuple(groups[0][0])}), got shape {tuple(pos_shape)}"
        )
    pad = ndim - len(pos_shape)
    pshape = tuple(pos_shape) + (1,) * pad
    pstride = tuple(pos_strides) + (0,) * pad

    for j in range(ndim):
        if pshape[j] != 1 and any(shape[j] != pshape[j] for shape, _ in groups):
            raise ValueError(
                f"positions: shape {tuple(pos_shape)} does not match the leading dimensions of {arg_name}, "
                f"{tuple(groups[0][0])} (aligned from the left; size-1 dimensions broadcast)"
            )

    def group_dims(g, indices):
        shape, strides = groups[g]
        return [(shape[j], tuple(s[j] for s in strides)) for j in indices if shape[j] != 1]

    head_idx = [j for j in range(ndim) if pshape[j] == 1 and any(shape[j] != 1 for shape, _ in groups)]
    keep = len(head_idx)
    while keep > 1 and not all(_merges(group_dims(g, head_idx[-keep:])) for g in range(len(groups))):
        keep -= 1
    demoted = head_idx[: len(head_idx) - keep]
    for j in demoted:
        sizes = sorted({shape[j] for shape, _ in groups})
        if len(sizes) != 1:
            raise ValueError(
                f"{arg_name}: dimension {j} has sizes {sizes} across q and k and cannot be merged with "
                "their head dimension; give q and k the same size there"
            )

    token_idx = [j for j in range(ndim) if pshape[j] != 1 or j in demoted]
    token_dims = [
        (groups[0][0][j], tuple(s[j] for _, strides in groups for s in strides) + (pstride[j] if j not in demoted else 0,))
        for j in token_idx
        if groups[0][0][j] != 1
    ]
    tokens = _merge(token_dims)
    if len(tokens) > MAX_TOKEN_DIMS:
        raise ValueError(
            f"{arg_name}: its leading dimensions reduce to {len(tokens)} token dimensions that cannot be "
            f"merged (at most {MAX_TOKEN_DIMS} are supported); pass a contiguous tensor"
        )
    n_tensors = sum(len(strides) for _, strides in groups)
    tokens = [(1, (0,) * (n_tensors + 1))] * (MAX_TOKEN_DIMS - len(tokens)) + tokens

    heads, head_strides = [], []
    for g, (_, strides) in enumerate(groups):
        run = _merge(group_dims(g, head_idx[len(head_idx) - keep :]))
        heads.append(run[0][0] if run else 1)
        head_strides.extend(run[0][1] if run else (0,) * len(strides))
    return Layout(
        tuple(t[0] for t in tokens),
        [tuple(t[1][i] for t in tokens) for i in range(n_tensors)],
        tuple(t[1][n_tensors] for t in tokens),
        heads,
        head_strides,
    )
