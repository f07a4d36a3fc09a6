"""``patch_transformers(model)``: swap cupyrope into a loaded Hugging Face model, after checking on the CPU that each
replacement computes what the model's own code does."""

import copy
import functools
import inspect
import sys
import types

import torch
from torch import Tensor

from . import torch as ct
from .dropin import apply_multimodal_rotary_pos_emb, apply_rotary_pos_emb, apply_rotary_pos_emb_one_tensor

__all__ = ["patch_transformers"]

class _Skip(Exception):
    """Why one module or function of a model is left as it is."""


def patch_transformers(model: torch.nn.Module, *, rope: bool = True, rms_norm: bool = True,
                       qk_norm_rope: bool = True, add_rms_norm: bool = True) -> dict:
    """Swap cupyrope into a loaded Hugging Face model, in place: each ``*RMSNorm`` submodule becomes a
    ``cupyrope.torch.RMSNorm`` sharing its weight, and the ``apply_rotary_pos_emb`` of each modeling
    module the model uses becomes ``apply_rotary_pos_emb`` above (for every model of that type in the
    process, as Liger's patches do), and transformers 4's ``apply_multimodal_rotary_pos_emb`` (Qwen2-VL) the
    drop-in of that name. With ``qk_norm_rope``, attention layers with per-head q_norm and k_norm (Qwen3,
    Gemma 3) run their norms and rotation as one ``cupyrope.torch.qk_norm_rope`` launch, with positions from the
    layer's ``position_ids`` and cos/sin from the config (``RotaryEmbedding.from_hf_config`` of its layer type).
    With ``add_rms_norm``, pre-norm decoder layers (Llama, Qwen3 and the like: input_layernorm, self_attn,
    post_attention_layernorm, mlp) add the attention output to the residual stream and normalize it in one
    ``cupyrope.torch.add_rms_norm`` launch (and one backward launch), and where the next layer is patched too, the
    MLP output and that layer's input_layernorm in another.

    Nothing is swapped on trust: each candidate is first run on small random CPU inputs next to its
    replacement (RMSNorm: which of ``weight`` or ``1 + weight`` it scales by, with its own eps; RoPE: the
    model's own rotary embedding gives cos/sin, whose layout and rotation style must be matched; QK-norm
    attention, decoder layers: the layer's whole forward, fed the model's own cos/sin), and left alone when they
    disagree. Returns ``{"rms_norm": [module names], "rope": [modeling modules], "qk_norm_rope": [attention module
    names], "add_rms_norm": [decoder layer names], "skipped": [(name, reason)]}``."""
    report = {"rms_norm": [], "rope": [], "qk_norm_rope": [], "add_rms_norm": [], "skipped": []}
    if qk_norm_rope:  # first: it reads the norms as the model has them
        _patch_qk_norm_attention(model, report)
    if add_rms_norm:  # checked with the attention as patched above
        _patch_decoder_layers(model, report)
    if rms_norm:
        _swap_rms_norms(model, report)
    if rope:
        _patch_rope_functions(model, report)
        _patch_multimodal_rope_functions(model, report)
    return report


def _swap_rms_norms(model, report) -> None:
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not type(child).__name__.endswith("RMSNorm") or isinstance(child, ct.RMSNorm):
                continue
            full_name = f"{parent_name}.{name}" if parent_name else name
            try:
                eps, offset = _rms_norm_behaviour(child)
            except _Skip as why:
                report["skipped"].append((full_name, str(why)))
                continue
            new = ct.RMSNorm(child.weight.shape[0], eps=eps, offset=offset, device="meta")
            new.weight = child.weight  # the same Parameter: tied weights and optimizer state stay as they are
            new.train(child.training)
            if hasattr(child, "variance_epsilon"):  # transformers' name, which other code may read
                new.variance_epsilon = eps
            setattr(parent, name, new)
            report["rms_norm"].append(full_name)


def _rms_norm_behaviour(module) -> tuple[float, float]:
    """(eps, offset) with which cupyrope's RMSNorm computes what ``module`` does, or _Skip."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
        raise _Skip("no 1-D weight parameter")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise _Skip("no positive variance_epsilon or eps attribute")
    if module._forward_hooks or module._forward_pre_hooks:
        raise _Skip("has forward hooks (e.g. accelerate's offloading), which a new module would lose")
    try:
        probe = copy.deepcopy(module).to(device="cpu", dtype=torch.float32)
    except Exception as error:  # e.g. weights on the meta device
        raise _Skip(f"cannot be copied to the CPU to check it ({type(error).__name__})") from None
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=g))
        xs = [torch.randn(3, weight.shape[0], generator=g) * scale for scale in (1.0, 1e-3)]  # 1e-3: eps matters
        try:
            expected = [probe(x).float() for x in xs]
        except Exception as error:
            raise _Skip(f"its forward fails on a (3, hidden) input ({type(error).__name__})") from None
        offsets = [offset for offset in (0.0, 1.0)
                   if all(_close(ct.rms_norm(x, probe.weight, float(eps), offset), e) for x, e in zip(xs, expected))]
    if len(offsets) != 1:
        raise _Skip("computes neither x / rms(x) * weight nor x / rms(x) * (1 + weight) with its eps")
    return float(eps), offsets[0]


def _close(got: Tensor, expected: Tensor) -> bool:
    return got.shape == expected.shape and torch.allclose(got.float(), expected.float(), rtol=1e-5, atol=1e-5)


def _patch_rope_functions(model, report) -> None:
    for name, source in _modeling_modules(model, "apply_rotary_pos_emb").items():
        original = source.apply_rotary_pos_emb
        if getattr(original, "func", None) in DROPINS.values():
            continue  # patched already
        dropin = DROPINS[_tensors_rotated(original)]
        try:
            pairs = _model_cos_sin(model, source)
            layouts = [_cos_layout(cos) for cos, _ in pairs]
            styles = {_matching_style(original, dropin, cos, sin, layout) for (cos, sin), layout in zip(pairs, layouts)}
            if len(set(layouts)) != 1 or len(styles) != 1:
                raise _Skip("its rotary embeddings (one per layer type) differ in cos layout or rotation style")
        except _Skip as why:
            report["skipped"].append((f"{name}.apply_rotary_pos_emb", str(why)))
            continue
        source.apply_rotary_pos_emb = functools.partial(dropin, style=styles.pop(), cos_layout=layouts[0])
        report["rope"].append(name)


DROPINS = {2: apply_rotary_pos_emb, 1: apply_rotary_pos_emb_one_tensor}  # by the number of tensors rotated


def _tensors_rotated(original) -> int:
    """How many tensors a modeling module's apply_rotary_pos_emb rotates: 1 for Gemma 3n's and Gemma 4's
    ``(x, cos, sin, unsqueeze_dim)``, else 2 (transformers' ``(q, k, cos, sin, ...)``)."""
    try:
        names = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return 2
    return 1 if names[1:3] == ["cos", "sin"] else 2


def _patch_multimodal_rope_functions(model, report) -> None:
    """transformers 4's ``apply_multimodal_rotary_pos_emb`` (Qwen2-VL, Qwen2.5-VL), swapped where it gives the
    drop-in's results on random inputs with the model's mrope_section."""
    for name, source in _modeling_modules(model, "apply_multimodal_rotary_pos_emb").items():
        original = source.apply_multimodal_rotary_pos_emb
        if original is apply_multimodal_rotary_pos_emb:
            continue  # patched already
        try:
            section = _mrope_section(getattr(model, "config", None))
            g = torch.Generator().manual_seed(0)
            rotary_dim = 2 * sum(section)
            angles = torch.rand(3, 1, 16, rotary_dim // 2, generator=g) * 6.0
            cos, sin = (torch.cat([t, t], -1) for t in (angles.cos(), angles.sin()))  # transformers' two halves
            q, k = torch.randn(1, 4, 16, rotary_dim, generator=g), torch.randn(1, 2, 16, rotary_dim, generator=g)
            try:
                expected = original(q, k, cos, sin, section)
            except Exception as error:
                raise _Skip(f"it fails on (q, k, cos, sin, mrope_section) ({type(error).__name__})") from None
            got = apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)
            if not (isinstance(expected, tuple) and len(expected) == 2 and all(map(_close, got, expected))):
                raise _Skip("its results differ from cupyrope's M-RoPE (contiguous sections)")
        except _Skip as why:
            report["skipped"].append((f"{name}.apply_multimodal_rotary_pos_emb", str(why)))
            continue
        source.apply_multimodal_rotary_pos_emb = apply_multimodal_rotary_pos_emb
        report["rope"].append(name)


def _modeling_modules(model, function: str) -> dict:
    """{name: module} of the modeling modules of the model's submodules that define ``function``."""
    found = {}
    for module in model.modules():
        source = sys.modules.get(type(module).__module__)
        if callable(getattr(source, function, None)):
            found[source.__name__] = source
    return found


def _mrope_section(config) -> list:
    """The model config's M-RoPE sections (its text config's rope_scaling or rope_parameters), or _Skip."""
    for c in (config, getattr(config, "text_config", None)):
        for key in ("rope_scaling", "rope_parameters"):
            params = getattr(c, key, None) or {}
            if isinstance(params, dict) and params.get("mrope_section"):
                return list(params["mrope_section"])
    raise _Skip("no mrope_section in the model's config")


def _cos_sin_of(module, x, positions, layer_types) -> list[tuple[Tensor, Tensor]]:
    """A rotary embedding module's (cos, sin) at ``positions`` for each layer type, in fp32 on the CPU."""
    pairs = []
    with torch.no_grad():
        for layer_type in layer_types:
            args = (x, positions) if layer_type is None else (x, positions, layer_type)
            pairs.append(tuple(t.float().cpu() for t in module(*args)))
    return pairs


def _model_cos_sin(model, source) -> list[tuple[Tensor, Tensor]]:
    """(cos, sin) pairs, (1, 16, rotary_dim) at positions 1-16, from each rotary embedding module of the
    model defined in ``source`` (each layer type of each), in fp32 on the CPU; _Skip unless they are."""
    pairs = []
    for module in model.modules():
        if type(module).__module__ != source.__name__ or not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        tensor = next(iter(module.buffers()), None)
        device = tensor.device if tensor is not None else torch.device("cpu")
        x = torch.zeros(1, device=device)
        positions = torch.arange(1, 17, device=device)[None]
        layer_types = getattr(module, "layer_types", None) or [None]
        try:
            pairs += _cos_sin_of(module, x, positions, layer_types)
        except Exception as error:
            try:  # multimodal RoPE of transformers up to ~5.17: one row of positions each for time, height, width
                pairs += _cos_sin_of(module, x, positions.expand(3, 1, 16), layer_types)
            except Exception:
                raise _Skip(f"its {type(module).__name__} fails on (x, position_ids) ({type(error).__name__})") from None
    if not pairs:
        raise _Skip("no *RotaryEmbedding module of this modeling module in the model to read cos/sin from")
    shapes = {tuple(c.shape) for c, _ in pairs}
    if any(len(shape) != 3 or shape[:2] != (1, 16) for shape in shapes):
        raise _Skip(f"its rotary embeddings give cos of shapes {sorted(shapes)}, expected (1, 16, rotary_dim)")
    return pairs


def _cos_layout(cos: Tensor) -> str:
    half = cos.shape[-1] // 2
    if torch.equal(cos[..., :half], cos[..., half:]):
        return "halves"
    if torch.equal(cos[..., 0::2], cos[..., 1::2]):
        return "interleaved"
    raise _Skip("its cos holds neither two equal halves nor equal neighbours (one value per frequency)")


def _matching_style(original, dropin, cos, sin, layout) -> str:
    """The rotation style ("neox" or "gptj") whose result through ``dropin`` equals ``original``'s on random q and
    k (or one tensor, for the one-tensor form), in both of transformers' call forms (q (B, H, S, D), and (B, S, H, D)
    with unsqueeze_dim=2) and with a head_dim above rotary_dim where ``original`` takes one; _Skip unless exactly
    one matches."""
    g = torch.Generator().manual_seed(0)
    rotary_dim = cos.shape[-1]
    count = 1 if dropin is apply_rotary_pos_emb_one_tensor else 2
    full = (torch.randn(1, 4, 16, rotary_dim, generator=g), torch.randn(1, 2, 16, rotary_dim, generator=g))[:count]
    wide = (torch.randn(1, 4, 16, rotary_dim + 16, generator=g),
            torch.randn(1, 2, 16, rotary_dim + 16, generator=g))[:count]
    cases = [(full, {}), (tuple(t.transpose(1, 2) for t in full), {"unsqueeze_dim": 2}), (wide, {})]
    checked = []  # (tensors, options, original's results) of each call form the original takes
    for index, (tensors, options) in enumerate(cases):
        try:
            checked.append((tensors, options, _as_tuple(original(*tensors, cos, sin, **options))))
        except Exception as error:
            if index == 0:
                form = "(q, k, cos, sin)" if count == 2 else "(x, cos, sin)"
                raise _Skip(f"it fails on {form} ({type(error).__name__})") from None
            # else the model never calls it that way

    def matches(style):
        for tensors, options, expected in checked:
            got = _as_tuple(dropin(*tensors, cos, sin, style=style, cos_layout=layout, **options))
            if len(expected) != count or not all(map(_close, got, expected)):
                return False
        return True

    styles = [style for style in ("neox", "gptj") if matches(style)]
    if len(styles) != 1:
        raise _Skip(f"its results match {'both' if styles else 'neither'} of cupyrope's rotation styles")
    return styles[0]


def _as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


# ------------------------------------------------------------------------------------------ QK-norm attention

QK_NORM_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")  # what the fused forward runs
QK_NORM_ATTENTION_PARTS = (*QK_NORM_ATTENTION_MODULES, "head_dim", "config", "layer_idx", "scaling")


def _check_no_other_parameters(module, parts) -> None:
    """_Skip where the module has parameters outside its submodules `parts`, which a forward made of those parts would
    leave out: a learned scale starting at one passes the forward check and then gets no gradient."""
    others = [name for name, _ in module.named_parameters() if name.split(".", 1)[0] not in parts]
    if others:
        raise _Skip(f"has parameters besides those of {', '.join(parts)}: {', '.join(others)}")


def _qk_norm_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                               past_key_values=None, **kwargs):
    """transformers' Qwen3 / Gemma 3 attention forward, with q_norm, k_norm and the rotation as one
    cupyrope.torch.qk_norm_rope launch. Without position_ids (the fused kernel's positions), the model's own
    forward."""
    positions = kwargs.get("position_ids")
    if positions is None:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    source = sys.modules[type(self).__module__]
    tokens = hidden_states.shape[:-1]
    heads = (*tokens, -1, self.head_dim)
    eps, offset = self.cupyrope_qk_norm
    q, k = ct.qk_norm_rope(self.q_proj(hidden_states).view(heads), self.k_proj(hidden_states).view(heads),
                           self.q_norm.weight, self.k_norm.weight, positions.expand(tokens), eps=eps, offset=offset,
                           **self.cupyrope_rotary.rope_options())
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = self.v_proj(hidden_states).view(heads).transpose(1, 2)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    attention = source.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                             source.eager_attention_forward)
    out, weights = attention(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                             scaling=self.scaling, sliding_window=getattr(self, "sliding_window", None), **kwargs)
    return self.o_proj(out.reshape(*tokens, -1).contiguous()), weights


def _patch_qk_norm_attention(model, report) -> None:
    checked = {}  # (class, layer type, norms' eps and offset): the rotary embedding its check passed with, or why not
    for name, attention in model.named_modules():
        if not all(hasattr(attention, part) for part in QK_NORM_ATTENTION_PARTS) or "forward" in vars(attention):
            continue
        layer_type = getattr(attention, "layer_type", None)
        try:
            _check_no_other_parameters(attention, QK_NORM_ATTENTION_MODULES)
            eps, offset = _qk_norms(attention)
            key = (type(attention), layer_type, eps, offset)
            if key not in checked:
                try:
                    checked[key] = _checked_qk_norm_attention(model, attention, layer_type, eps, offset)
                except _Skip as why:
                    checked[key] = why
            if isinstance(checked[key], _Skip):
                raise checked[key]
        except _Skip as why:
            report["skipped"].append((name, str(why)))
            continue
        device = attention.q_proj.weight.device
        attention.cupyrope_rotary = checked[key].to(device)  # a submodule: moves with the model (no state_dict keys)
        attention.cupyrope_qk_norm = (eps, offset)
        attention.forward = types.MethodType(_qk_norm_attention_forward, attention)
        report["qk_norm_rope"].append(name)


def _qk_norms(attention) -> tuple[float, float]:
    """(eps, offset) of the layer's q_norm and k_norm (the same for both: one kernel call), or _Skip."""
    behaviours = set()
    for norm in (attention.q_norm, attention.k_norm):
        if isinstance(norm, ct.RMSNorm):
            behaviours.add((float(norm.eps), float(norm.offset)))
        elif type(norm).__name__.endswith("RMSNorm"):
            behaviours.add(_rms_norm_behaviour(norm))
        else:
            raise _Skip(f"its q_norm / k_norm is a {type(norm).__name__}, not an RMSNorm")
    if len(behaviours) != 1:
        raise _Skip("its q_norm and k_norm differ in eps or offset")
    return behaviours.pop()


def _model_rotary(model, attention, layer_type):
    """The model's rotary embedding module for the layer (of the attention's modeling module), or _Skip."""
    for module in model.modules():
        if type(module).__module__ == type(attention).__module__ and type(module).__name__.endswith("RotaryEmbedding"):
            if layer_type in (getattr(module, "layer_types", None) or [layer_type]):
                return module
    raise _Skip("no *RotaryEmbedding module of its modeling module in the model to read cos/sin from")


def _checked_qk_norm_attention(model, attention, layer_type, eps, offset):
    """cupyrope's RoPE for the layer (from its config and layer type), after checking that the fused forward gives
    the layer's own output on random CPU inputs (fp32, the model's cos/sin, random norm weights); _Skip if not."""
    try:
        rotary = ct.RotaryEmbedding.from_hf_config(attention.config, layer_type=layer_type)
    except Exception as error:  # e.g. a config whose head_dim varies by layer (Gemma 4), which transformers refuses
        raise _Skip(f"cupyrope cannot build its RoPE from the config ({type(error).__name__}: {error})") from None
    if rotary.mrope_section is not None:
        raise _Skip("M-RoPE: its layers receive text positions, not the three position rows its cos/sin come from")
    # The table's first and last positions: scaled RoPE (llama3, yarn) differs most where low frequencies turn far.
    positions = torch.stack([torch.arange(6), torch.arange(rotary.max_position - 6, rotary.max_position)])
    probe, states, cos_sin = _probe_inputs(model, attention, attention, layer_type, (attention.q_norm, attention.k_norm),
                                           attention.q_proj.weight.shape[1], positions)
    probe.cupyrope_rotary, probe.cupyrope_qk_norm = rotary, (eps, offset)
    differs = "its forward differs from cupyrope's qk_norm_rope with the config's RoPE"
    inv_freq = getattr(_model_rotary(model, attention, layer_type), "inv_freq", None)
    if isinstance(inv_freq, Tensor) and inv_freq.dtype not in (torch.float32, torch.float64):
        differs += (f" (its rotary embedding's inv_freq is {inv_freq.dtype}, which rounds every angle: model.to(dtype) "
                    "converts it, from_pretrained(..., dtype=...) keeps it float32)")
    _check_same_forward(lambda: probe(states, cos_sin, None, position_ids=positions)[0],
                        lambda: _qk_norm_attention_forward(probe, states, cos_sin, None, position_ids=positions)[0],
                        differs)
    return rotary


def _probe_inputs(model, module, attention, layer_type, norms, hidden, positions):
    """(an fp32 CPU copy of module whose copies of `norms` have random weights, random hidden states (2, S, hidden),
    the model's own cos/sin for the attention's layer type at positions (2, S)), or _Skip."""
    names = {id(norm): name for name, norm in module.named_modules()}
    try:
        probe = copy.deepcopy(module).to(device="cpu", dtype=torch.float32)
    except Exception as error:
        raise _Skip(f"cannot be copied to the CPU to check it ({type(error).__name__})") from None
    g = torch.Generator().manual_seed(0)
    states = torch.randn(2, positions.shape[-1], hidden, generator=g)
    rotary_module = _model_rotary(model, attention, layer_type)
    device = next(iter(rotary_module.buffers()), torch.zeros(0)).device
    args = (torch.zeros(1, device=device), positions.to(device))
    with torch.no_grad():
        for norm in norms:
            weight = probe.get_submodule(names[id(norm)]).weight
            weight.copy_(torch.randn(weight.shape, generator=g) * 0.5)
        try:
            per_type = getattr(rotary_module, "layer_types", None) is not None
            cos_sin = rotary_module(*args, layer_type) if per_type else rotary_module(*args)
        except Exception as error:
            raise _Skip(f"its rotary embedding fails on (x, position_ids) ({type(error).__name__})") from None
    return probe, states, tuple(c.float().cpu() for c in cos_sin)


def _check_same_forward(own, fused, differs: str) -> None:
    """own() (the module's forward) and fused() (cupyrope's) give the same tensor up to fp32 roundings, or _Skip
    (`differs` says why where they disagree)."""
    with torch.no_grad():
        try:
            expected = own()
        except Exception as error:
            raise _Skip(f"its forward fails on random inputs ({type(error).__name__})") from None
        try:
            got = fused()
        except Exception as error:
            raise _Skip(f"the fused forward fails on its inputs ({type(error).__name__}: {error})") from None
    if not isinstance(expected, Tensor):
        raise _Skip(f"its forward returns a {type(expected).__name__}, not a tensor")
    scale = float(expected.abs().max())
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5 * scale):
        raise _Skip(differs)


# ------------------------------------------------------------------------------------------ decoder layers

DECODER_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _fused_add_decoder_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                               use_cache=False, position_embeddings=None, **kwargs):
    """transformers' pre-norm decoder layer forward (Llama, Qwen3), with the attention output's residual add and
    post_attention_layernorm as one cupyrope.torch.add_rms_norm launch; and where the next layer is patched too (see
    _link_decoder_layers), the MLP output's residual add and that layer's input_layernorm as another, whose normalized
    output the next layer takes instead of normalizing its input again."""
    normed = _handed_off(self, hidden_states)
    residual = hidden_states
    hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states) if normed is None else normed,
                                      attention_mask=attention_mask, position_ids=position_ids,
                                      past_key_values=past_key_values, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    eps, offset = self.cupyrope_add_norm
    hidden_states, residual = ct.add_rms_norm(hidden_states, residual, self.post_attention_layernorm.weight, eps,
                                              offset=offset)
    out = self.mlp(hidden_states)
    following = self.__dict__.get("cupyrope_next_layer")  # in __dict__: not a submodule
    # Gradient checkpointing recomputes a layer with its input detached, where a hand-off would find no taker and
    # keep an activation alive; torch.compile traces the plain sum.
    if following is None or ct._compiling() or (self.training and getattr(self, "gradient_checkpointing", False)):
        return residual + out
    layer, eps, offset = following
    normed, hidden_states = ct.add_rms_norm(out, residual, layer.input_layernorm.weight, eps, offset=offset)
    layer.__dict__["cupyrope_handoff"] = (hidden_states, hidden_states._version, normed)
    return hidden_states


def _handed_off(layer, hidden_states):
    """The input_layernorm output the layer before handed this layer with hidden_states, its output, if that is what
    the layer got, unchanged since (the same tensor, no in-place write); else None. Taken once."""
    handoff = layer.__dict__.pop("cupyrope_handoff", None)
    if handoff is None or ct._compiling() or handoff[0] is not hidden_states or handoff[1] != hidden_states._version:
        return None
    return handoff[2]


def _link_decoder_layers(model, patched) -> None:
    """Each patched decoder layer whose next sibling in their module list (the layer the model's loop hands its output
    to) is patched too, with an input_layernorm cupyrope computes, normalizes its output for that layer in its final
    residual add (_fused_add_decoder_forward). patched: {name: layer}."""
    for name, layer in patched.items():
        parent, dot, index = name.rpartition(".")
        following = patched.get(f"{parent}{dot}{int(index) + 1}") if index.isdigit() else None
        if following is None:
            continue
        try:
            layer.__dict__["cupyrope_next_layer"] = (following, *_norm_behaviour(following.input_layernorm,
                                                                                "input_layernorm"))
        except _Skip:
            pass


def _patch_decoder_layers(model, report) -> None:
    checked = {}  # (class, norm's eps and offset): None where its check passed, else why not
    patched = {}
    for name, layer in model.named_modules():
        if not all(hasattr(layer, part) for part in DECODER_LAYER_PARTS) or "forward" in vars(layer):
            continue
        try:
            extra = [part for part, _ in layer.named_children() if part not in DECODER_LAYER_PARTS]
            if extra:  # e.g. Gemma 3's and GLM-4's extra norms, Phi-3's residual dropouts
                raise _Skip(f"has submodules besides {', '.join(DECODER_LAYER_PARTS)}: {', '.join(extra)}")
            _check_no_other_parameters(layer, DECODER_LAYER_PARTS)  # e.g. Doge's learned residual scales
            eps, offset = _norm_behaviour(layer.post_attention_layernorm, "post_attention_layernorm")
            key = (type(layer), eps, offset)
            if key not in checked:
                try:
                    checked[key] = _check_decoder_layer(model, layer, eps, offset)
                except _Skip as why:
                    checked[key] = why
            if checked[key] is not None:
                raise checked[key]
        except _Skip as why:
            report["skipped"].append((name, str(why)))
            continue
        layer.cupyrope_add_norm = (eps, offset)
        layer.forward = types.MethodType(_fused_add_decoder_forward, layer)
        report["add_rms_norm"].append(name)
        patched[name] = layer
    _link_decoder_layers(model, patched)


def _norm_behaviour(norm, role: str) -> tuple[float, float]:
    """(eps, offset) with which cupyrope computes a decoder layer's norm (its `role`), or _Skip."""
    if isinstance(norm, ct.RMSNorm):
        return float(norm.eps), float(norm.offset)
    if type(norm).__name__.endswith("RMSNorm"):
        return _rms_norm_behaviour(norm)
    raise _Skip(f"its {role} is a {type(norm).__name__}, not an RMSNorm")


def _check_decoder_layer(model, layer, eps, offset) -> None:
    """Whether the fused forward gives the layer's own output on random CPU inputs (fp32, the model's cos/sin, random
    norm weights); _Skip if not."""
    positions = torch.arange(6).expand(2, 6)
    probe, states, cos_sin = _probe_inputs(model, layer, layer.self_attn, getattr(layer.self_attn, "layer_type", None),
                                           (layer.input_layernorm, layer.post_attention_layernorm),
                                           layer.post_attention_layernorm.weight.shape[0], positions)
    probe.cupyrope_add_norm = (eps, offset)
    _check_same_forward(lambda: probe(states, position_ids=positions, position_embeddings=cos_sin),
                        lambda: _fused_add_decoder_forward(probe, states, position_ids=positions,
                                                           position_embeddings=cos_sin),
                        "its forward differs from input_layernorm, self_attn, add_rms_norm and mlp in that order")

