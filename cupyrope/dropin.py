"""Drop-in replacements for the RoPE call sites of transformers, Liger, vLLM and FlashInfer, with their
signatures and semantics, on cupyrope's kernels (``cupyrope.patch.patch_transformers`` swaps them into a loaded
Hugging Face model).

Their cos/sin arrive as tensors (transformers) or as a vLLM-layout table (vLLM, FlashInfer). The
kernels read transformers' per-token cos and sin where they lie (``rope_qk_cos_sin``, or ``rope_cos_sin`` for
one tensor: one launch, no table, no positions) and vLLM's table by position.
"""

import functools
from typing import Optional

import torch
from torch import Tensor

from . import torch as ct
from .ops.rope import rope_ as _rope_inplace

__all__ = ["apply_multimodal_rotary_pos_emb", "apply_rotary_pos_emb", "apply_rotary_pos_emb_one_tensor", "rotary_embedding"]

COS_LAYOUTS = ("halves", "interleaved")


def _check_arguments(rotated: dict, cos: Tensor, sin: Tensor, cos_layout: str) -> None:
    """The checks of transformers' arguments; ``rotated`` names the tensors rotated ({"q": q, "k": k} or {"x": x})."""
    for name, t in (*rotated.items(), ("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    first, x = next(iter(rotated.items()))
    if cos.device != x.device:
        raise ValueError(f"cos: expected a tensor on {first}'s device {x.device}, got one on {cos.device}")
    if sin.shape != cos.shape or sin.dtype != cos.dtype or sin.device != cos.device:
        raise ValueError(f"sin: expected the shape, dtype and device of cos, {tuple(cos.shape)} {cos.dtype} on "
                         f"{cos.device}; got {tuple(sin.shape)} {sin.dtype} on {sin.device}")
    if cos_layout not in COS_LAYOUTS:
        raise ValueError(f"cos_layout: expected one of {COS_LAYOUTS}, got {cos_layout!r}")
    rotary_dim = cos.shape[-1] if cos.dim() else 0
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > x.shape[-1]:
        raise ValueError(f"cos: expected a last dimension (the rotary dimension) that is even, >= 2 and at most "
                         f"{first}'s head_dim {x.shape[-1]}; got shape {tuple(cos.shape)}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("cos: gradients with respect to cos and sin are not computed; pass cos.detach() and "
                         "sin.detach(), or build them under torch.no_grad() as transformers does")


@functools.lru_cache(maxsize=256)
def _per_token_shape(shapes: tuple, cos_shape, unsqueeze_dim: int) -> tuple:
    """(shape, at): the shape of a view of cos (and sin) broadcast the way transformers'
    ``cos.unsqueeze(unsqueeze_dim)`` is against the rotated tensors (``shapes``: (name, shape) of each, aligned from
    the right), with their number of dimensions (aligned from the left, as the kernels take it); ``at`` is the
    dimension whose unsqueeze alone gives that shape (the usual case; ~1 µs cheaper than a view), else None. A pure
    function of the shapes: cached, so a repeated call skips the checks."""
    (first, first_shape), ndim = shapes[0], len(cos_shape)
    lead = len(first_shape) - 1
    if not -ndim - 1 <= unsqueeze_dim < ndim or unsqueeze_dim == -1:  # not after cos's last dimension
        raise ValueError(f"unsqueeze_dim: expected a dimension of cos before its last one (cos has {ndim} "
                         f"dimensions), got {unsqueeze_dim}")
    at = unsqueeze_dim % (ndim + 1)
    shape = tuple(cos_shape[:at]) + (1,) + tuple(cos_shape[at:])
    if len(shape) - 1 > lead:
        raise ValueError(f"cos: shape {tuple(cos_shape)} with unsqueeze_dim={unsqueeze_dim} has more leading "
                         f"dimensions than {first} {tuple(first_shape)}")
    padding = lead + 1 - len(shape)
    shape = (1,) * padding + shape
    for name, x_shape in shapes:
        if len(x_shape) != len(first_shape) or any(r not in (1, n) for r, n in zip(shape[:-1], x_shape[:-1])):
            raise ValueError(f"cos: shape {tuple(cos_shape)} with unsqueeze_dim={unsqueeze_dim} does not broadcast "
                             f"to {name}'s leading dimensions {tuple(x_shape[:-1])}")
    return shape, (None if padding else at)


def _per_token_cos_sin(rotated: dict, cos, sin, position_ids, unsqueeze_dim, cos_layout) -> tuple:
    """(cos, sin, options): transformers' cos and sin as views the kernels read in place, aligned from the left
    with the rotated tensors, and the rotary_dim and freq_step that read one value per frequency."""
    _check_arguments(rotated, cos, sin, cos_layout)
    rotary_dim = cos.shape[-1]
    if position_ids is not None and cos.dim() == 2:  # transformers < 4.38: cos (max_position, dim)[position_ids]
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.dtype not in (torch.float32, next(iter(rotated.values())).dtype):
        cos, sin = cos.float(), sin.float()
    shape_of = _per_token_shape.__wrapped__ if ct._compiling() else _per_token_shape  # dynamo traces no caches
    shape, at = shape_of(tuple((name, t.shape) for name, t in rotated.items()), cos.shape, unsqueeze_dim)
    cos, sin = (cos.view(shape), sin.view(shape)) if at is None else (cos.unsqueeze(at), sin.unsqueeze(at))
    if cos.stride() != sin.stride():  # the kernel reads both with one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, dict(rotary_dim=rotary_dim, freq_step=1 if cos_layout == "halves" else 2)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor] = None,
                         unsqueeze_dim: int = 1, *, style: str = "neox", cos_layout: str = "halves"):
    """transformers' ``apply_rotary_pos_emb`` (and Liger's ``liger_rotary_pos_emb``): returns
    ``(q_embed, k_embed)``, out of place and differentiable in q and k.

    ``cos``/``sin`` are the model's rotary embedding output, (batch or 1, seq, rotary_dim) in
    ``cos_layout="halves"`` (transformers' ``cat((freqs, freqs))``; Cohere and GPT-J build
    ``"interleaved"`` ones); ``unsqueeze_dim`` as in transformers (1 for q (B, H, S, D), 2 for
    (B, S, H, D)). ``position_ids`` is used only with transformers < 4.38's (max_position, dim) cos.
    ``style="neox"`` is transformers' rotate_half; ``"gptj"`` pairs features 2i and 2i+1 (Cohere, GLM).
    A rotary_dim below head_dim rotates the first rotary_dim features and passes the rest through.
    Like the kernels in Liger and vLLM it reads one cos and one sin per frequency: the two copies in
    transformers' layout must be equal, which they are in every rotary embedding that builds them."""
    cos, sin, options = _per_token_cos_sin({"q": q, "k": k}, cos, sin, position_ids, unsqueeze_dim, cos_layout)
    return ct.rope_qk_cos_sin(q, k, cos, sin, style=style, **options)


def apply_rotary_pos_emb_one_tensor(x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, *,
                                    style: str = "neox", cos_layout: str = "halves") -> Tensor:
    """The one-tensor ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)`` of transformers' Gemma 3n, Gemma 4 and
    DiffusionGemma, which rotate q and k in separate calls (each right after its norm): returns x rotated, out of
    place and differentiable in x. cos, sin, ``style`` and ``cos_layout`` as in ``apply_rotary_pos_emb``."""
    cos, sin, options = _per_token_cos_sin({"x": x}, cos, sin, None, unsqueeze_dim, cos_layout)
    return ct.rope_cos_sin(x, cos, sin, style=style, **options)


def apply_multimodal_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, mrope_section,
                                    unsqueeze_dim: int = 1):
    """transformers 4's Qwen2-VL / Qwen2.5-VL ``apply_multimodal_rotary_pos_emb``: ``cos``/``sin`` (3, batch, seq,
    rotary_dim) hold the time, height and width rows, and frequency section i (of ``mrope_section``, repeated for
    the two halves) takes row i % 3. The sections are gathered into one per-token cos and sin (a copy of one head's
    size), then rotated as ``apply_rotary_pos_emb`` does: one launch for q and k, out of place, differentiable."""
    if not isinstance(cos, Tensor) or cos.dim() < 2 or cos.shape[0] != 3:
        raise ValueError(f"cos: expected shape (3, ..., rotary_dim) (the time, height and width rows), got "
                         f"{tuple(cos.shape) if isinstance(cos, Tensor) else type(cos).__name__}")
    sections = list(mrope_section) * 2
    if sum(sections) != cos.shape[-1]:
        raise ValueError(f"mrope_section: expected sections adding up to rotary_dim / 2 = {cos.shape[-1] // 2}, got "
                         f"{list(mrope_section)}")
    cos, sin = (torch.cat([part[i % 3] for i, part in enumerate(t.split(sections, dim=-1))], dim=-1)
                for t in (cos, sin))
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def rotary_embedding(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool = True) -> None:
    """vLLM's ``ops.rotary_embedding`` and FlashInfer's ``apply_rope_with_cos_sin_cache_inplace``: rotates
    ``query`` and ``key`` in place. ``positions`` (num_tokens,) or (batch, seq); query/key (...,
    heads * head_size) or (..., heads, head_size) over those leading dimensions; ``key`` may be None;
    ``cos_sin_cache`` (max_position, rotary_dim), cos half then sin half."""
    if not isinstance(positions, Tensor):
        raise TypeError(f"positions: expected a torch.Tensor, got {type(positions).__name__}")
    style = "neox" if is_neox else "gptj"
    options = dict(style=style, rotary_dim=cos_sin_cache.shape[-1], cos_sin_cache=cos_sin_cache)
    q = _heads_view(query, "query", positions, head_size)
    if key is not None:
        ct.rope_qk_(q, _heads_view(key, "key", positions, head_size), positions, **options)
    elif ct._compiling() or not q.is_cuda:
        q.copy_(ct.rope(q, positions, **options))
    else:
        _rope_inplace(q, positions, **options)


def _heads_view(t: Tensor, name: str, positions: Tensor, head_size: int) -> Tensor:
    """(*positions.shape, heads, head_size) view of t, with no copy."""
    lead = tuple(positions.shape)
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    features = t.shape[len(lead):].numel() if t.dim() > len(lead) else 0
    if tuple(t.shape[: len(lead)]) != lead or head_size <= 0 or features == 0 or features % head_size:
        raise ValueError(f"{name}: expected shape {lead} + (heads * head_size,) or {lead} + (heads, head_size) "
                         f"with head_size={head_size} (the leading dimensions are positions'), got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dimension (it is rotated in place), got strides {t.stride()}")
    try:
        return t.view(lead + (features // head_size, head_size))
    except RuntimeError:
        raise ValueError(f"{name}: its strides {t.stride()} do not split into heads of {head_size} without a copy; "
                         "the heads of one token must be evenly spaced and each head contiguous") from None
