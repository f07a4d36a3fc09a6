"""cupyrope.patch.patch_transformers: on a stand-in for a transformers modeling module (CI, no transformers), on tiny
real models where transformers is installed, and on CUDA."""

import copy
import sys
import types

import pytest

torch = pytest.importorskip("torch")
patch = pytest.importorskip("cupyrope.patch")

from helpers import assert_close, requires_torch_cuda, rotate_half  # noqa: E402


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**31)))


# patch_transformers on a stand-in for a transformers modeling module (no transformers needed).

def _fake_modeling(apply_fn=None):
    """A module shaped like transformers.models.llama.modeling_llama: RMSNorm classes, a rotary
    embedding module and an apply_rotary_pos_emb global that the attention looks up at call time."""
    module = types.ModuleType("fake_modeling_for_cupyrope_tests")
    sys.modules[module.__name__] = module
    nn = torch.nn

    class FakeRMSNorm(nn.Module):  # Llama's
        def __init__(self, hidden, eps=1e-5):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(hidden)), eps

        def forward(self, x):
            h = x.float()
            return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)

    class FakeGemmaRMSNorm(nn.Module):  # Gemma's (1 + weight)
        def __init__(self, hidden, eps=1e-6):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.zeros(hidden)), eps

        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    class FakeLayerRMSNorm(FakeRMSNorm):  # a name that fits, a computation that does not (mean-centred)
        def forward(self, x):
            return super().forward(x - x.mean(-1, keepdim=True))

    class FakeRotaryEmbedding(nn.Module):
        def __init__(self, dim, theta=10000.0):
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

        @torch.no_grad()
        def forward(self, x, position_ids):
            freqs = position_ids[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), -1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # transformers' Llama code
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    class FakeAttentionModel(nn.Module):
        def __init__(self, hidden=64, heads=4, kv_heads=2, head_dim=16):
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
            self.norm, self.gemma_norm, self.odd_norm = FakeRMSNorm(hidden), FakeGemmaRMSNorm(hidden), FakeLayerRMSNorm(hidden)
            self.q_norm = FakeRMSNorm(head_dim, eps=1e-6)
            self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim)
            self.rotary_emb = FakeRotaryEmbedding(head_dim)

        def forward(self, x, position_ids):
            b, s, _ = x.shape
            h = self.gemma_norm(self.odd_norm(self.norm(x)))
            q, k, _ = self.qkv(h).split([self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2, -1)
            q = self.q_norm(q.view(b, s, -1, self.head_dim)).transpose(1, 2)
            k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
            cos, sin = self.rotary_emb(x, position_ids)
            q, k = sys.modules[module.__name__].apply_rotary_pos_emb(q, k, cos, sin)
            return torch.cat((q.flatten(1), k.flatten(1)), -1)

    def apply_one_tensor(x, cos, sin, unsqueeze_dim=1):  # transformers' Gemma 3n and Gemma 4 code
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return x * cos + rotate_half(x) * sin

    class FakeOneTensorRopeModel(FakeAttentionModel):  # Gemma 4's attention: q and k rotated apart, (B, S, H, D)
        def forward(self, x, position_ids):
            b, s, _ = x.shape
            q, k, _ = self.qkv(self.norm(x)).split([self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2, -1)
            cos, sin = self.rotary_emb(x, position_ids)
            apply = sys.modules[module.__name__].apply_rotary_pos_emb
            q = apply(self.q_norm(q.view(b, s, -1, self.head_dim)), cos, sin, unsqueeze_dim=2)
            k = apply(k.view(b, s, -1, self.head_dim), cos, sin, unsqueeze_dim=2)
            return torch.cat((q.flatten(1), k.flatten(1)), -1)

    def eager_attention_forward(attention, q, k, v, mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2), None

    class FakeQKNormAttention(nn.Module):  # transformers' Qwen3Attention, in substance
        def __init__(self, hidden=64, heads=4, kv_heads=2, head_dim=16, norm=FakeRMSNorm, rope_first=False,
                     rope_parameters=None):
            super().__init__()
            self.config = types.SimpleNamespace(
                head_dim=head_dim, hidden_size=hidden, num_attention_heads=heads, max_position_embeddings=128,
                rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
                _attn_implementation="eager")
            self.head_dim, self.layer_idx, self.scaling, self.attention_dropout = head_dim, 0, head_dim**-0.5, 0.0
            self.rope_first = rope_first  # a layer that rotates before its norms: not what qk_norm_rope computes
            self.q_proj, self.o_proj = nn.Linear(hidden, heads * head_dim), nn.Linear(heads * head_dim, hidden)
            self.k_proj, self.v_proj = nn.Linear(hidden, kv_heads * head_dim), nn.Linear(hidden, kv_heads * head_dim)
            self.q_norm, self.k_norm = norm(head_dim, eps=1e-6), norm(head_dim, eps=1e-6)

        def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
            k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
            v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
            if self.rope_first:
                q, k = sys.modules[module.__name__].apply_rotary_pos_emb(q, k, *position_embeddings)
            q, k = self.q_norm(q), self.k_norm(k)
            if not self.rope_first:
                q, k = sys.modules[module.__name__].apply_rotary_pos_emb(q, k, *position_embeddings)
            out, weights = eager_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights

    class FakeQKNormModel(nn.Module):
        def __init__(self, **options):
            super().__init__()
            self.rotary_emb, self.self_attn = FakeRotaryEmbedding(16), FakeQKNormAttention(**options)

        def forward(self, x, position_ids):
            return self.self_attn(x, self.rotary_emb(x, position_ids), None, position_ids=position_ids)[0]

    class FakeDecoderLayer(nn.Module):  # transformers' LlamaDecoderLayer / Qwen3DecoderLayer
        def __init__(self, hidden=64, normed_residual=False, **options):
            super().__init__()
            self.normed_residual = normed_residual  # a residual taken after the norm: not what add_rms_norm computes
            self.input_layernorm, self.post_attention_layernorm = FakeRMSNorm(hidden), FakeRMSNorm(hidden)
            self.self_attn = FakeQKNormAttention(hidden=hidden, **options)
            self.mlp = nn.Sequential(nn.Linear(hidden, 96), nn.SiLU(), nn.Linear(96, hidden))

        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                    position_embeddings=None, **kwargs):
            residual = hidden_states
            hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                              attention_mask=attention_mask, position_ids=position_ids,
                                              past_key_values=past_key_values, use_cache=use_cache,
                                              position_embeddings=position_embeddings, **kwargs)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            if self.normed_residual:
                residual = hidden_states
            return residual + self.mlp(hidden_states)

    class FakeDecoderModel(nn.Module):
        def __init__(self, **options):
            super().__init__()
            self.rotary_emb = FakeRotaryEmbedding(16)
            self.layers = nn.ModuleList([FakeDecoderLayer(**options) for _ in range(2)])

        def forward(self, x, position_ids):
            cos_sin = self.rotary_emb(x, position_ids)
            for layer in self.layers:
                x = layer(x, position_ids=position_ids, position_embeddings=cos_sin)
            return x

    for cls in (FakeRMSNorm, FakeGemmaRMSNorm, FakeLayerRMSNorm, FakeRotaryEmbedding, FakeAttentionModel,
                FakeOneTensorRopeModel, FakeQKNormAttention, FakeQKNormModel, FakeDecoderLayer, FakeDecoderModel):
        cls.__module__ = module.__name__
        setattr(module, cls.__name__, cls)
    module.apply_rotary_pos_emb = apply_fn or apply_rotary_pos_emb
    module.apply_one_tensor = apply_one_tensor
    module.eager_attention_forward = eager_attention_forward
    module.ALL_ATTENTION_FUNCTIONS = types.SimpleNamespace(get_interface=lambda name, default: default)
    return module


@pytest.fixture
def fake_model(gen):
    created = []

    def make(apply_fn=None, model="FakeAttentionModel", **options):
        module = _fake_modeling(apply_fn)
        created.append(module.__name__)
        model = getattr(module, model)(**options)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        return module, model

    yield make
    for name in created:
        sys.modules.pop(name, None)


def test_patch_transformers_swaps_what_it_has_checked(fake_model, gen):
    module, model = fake_model()
    x, position_ids = torch.randn(2, 7, 64, generator=gen), torch.arange(3, 10)[None].expand(2, -1)
    norm_weight = model.norm.weight
    with torch.no_grad():
        before = model(x, position_ids)
        report = patch.patch_transformers(model)
        after = model(x, position_ids)
    assert sorted(report["rms_norm"]) == ["gemma_norm", "norm", "q_norm"]
    assert report["rope"] == [module.__name__]
    assert [name for name, _ in report["skipped"]] == ["odd_norm"]
    assert "neither" in report["skipped"][0][1]
    assert model.norm.weight is norm_weight  # shared, not copied
    assert (model.norm.eps, model.norm.offset, model.norm.variance_epsilon) == (1e-5, 0.0, 1e-5)
    assert model.gemma_norm.offset == 1.0 and model.gemma_norm.eps == 1e-6
    assert module.apply_rotary_pos_emb.keywords == {"style": "neox", "cos_layout": "halves"}
    assert_close(after, before, "float32")
    again = patch.patch_transformers(model)  # idempotent
    assert again["rms_norm"] == [] and again["rope"] == []


def test_patch_transformers_leaves_a_rope_it_cannot_match(fake_model):
    def negated_sin(q, k, cos, sin, unsqueeze_dim=1):  # rotates the other way: no style of ours matches
        cos, sin = cos.unsqueeze(unsqueeze_dim), -sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    module, model = fake_model(negated_sin)
    report = patch.patch_transformers(model, rms_norm=False)
    assert report["rope"] == [] and report["rms_norm"] == []
    assert module.apply_rotary_pos_emb is negated_sin
    assert report["skipped"] == [(f"{module.__name__}.apply_rotary_pos_emb", "its results match neither of cupyrope's rotation styles")]


def test_patch_transformers_swaps_a_one_tensor_rope(fake_model, gen):
    """Gemma 3n's and Gemma 4's apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim): checked in that form and swapped
    for the one-tensor drop-in; the model computes what it did."""
    module, model = fake_model(model="FakeOneTensorRopeModel")
    module.apply_rotary_pos_emb = original = module.apply_one_tensor
    x, position_ids = torch.randn(2, 7, 64, generator=gen), torch.arange(3, 10)[None].expand(2, -1)
    with torch.no_grad():
        before = model(x, position_ids)
        report = patch.patch_transformers(model, rms_norm=False)
        after = model(x, position_ids)
    assert report["rope"] == [module.__name__] and report["skipped"] == []
    assert module.apply_rotary_pos_emb.func is patch.apply_rotary_pos_emb_one_tensor
    assert module.apply_rotary_pos_emb.keywords == {"style": "neox", "cos_layout": "halves"}
    assert module.apply_rotary_pos_emb is not original
    assert_close(after, before, "float32")
    assert patch.patch_transformers(model, rms_norm=False)["rope"] == []  # idempotent


def test_patch_transformers_leaves_a_one_tensor_rope_it_cannot_match(fake_model):
    def negated_sin(x, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), -sin.unsqueeze(unsqueeze_dim)
        return x * cos + rotate_half(x) * sin

    module, model = fake_model(negated_sin, model="FakeOneTensorRopeModel")
    report = patch.patch_transformers(model, rms_norm=False)
    assert report["rope"] == [] and module.apply_rotary_pos_emb is negated_sin
    assert report["skipped"] == [(f"{module.__name__}.apply_rotary_pos_emb",
                                  "its results match neither of cupyrope's rotation styles")]


def test_patch_transformers_reads_multimodal_rope_from_three_position_rows(fake_model, gen):
    # transformers up to ~5.17: Qwen2-VL's and Qwen3-VL's rotary embeddings take (3, batch, seq) positions
    # only (time, height, width rows) and fold them into one cos/sin; a (batch, seq) probe fails there.
    module, model = fake_model()
    one_row = model.rotary_emb.forward

    def three_rows(x, position_ids):
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise IndexError("expected (3, batch, seq) positions")
        return one_row(x, position_ids[0])  # stand-in for the fold: the time row

    model.rotary_emb.forward = three_rows
    x, t = torch.randn(2, 7, 64, generator=gen), torch.arange(3, 10)[None].expand(2, -1)
    position_ids = torch.stack([t, t // 2, t % 3])
    with torch.no_grad():
        before = model(x, position_ids)
        report = patch.patch_transformers(model)
        after = model(x, position_ids)
    assert report["rope"] == [module.__name__]
    assert_close(after, before, "float32")


def test_patch_transformers_leaves_a_rope_whose_embedding_it_cannot_run(fake_model):
    module, model = fake_model()

    def broken(x, position_ids):
        raise IndexError("no positions fit")

    model.rotary_emb.forward = broken
    original = module.apply_rotary_pos_emb
    report = patch.patch_transformers(model, rms_norm=False)
    assert report["rope"] == [] and module.apply_rotary_pos_emb is original
    assert report["skipped"] == [(f"{module.__name__}.apply_rotary_pos_emb",
                                  "its FakeRotaryEmbedding fails on (x, position_ids) (IndexError)")]


def test_patch_transformers_leaves_hooked_modules(fake_model):
    _, model = fake_model()
    model.norm.register_forward_pre_hook(lambda module, args: None)
    report = patch.patch_transformers(model, rope=False)
    assert "norm" not in report["rms_norm"]
    assert ("norm", "has forward hooks (e.g. accelerate's offloading), which a new module would lose") in report["skipped"]


def test_patch_transformers_fuses_a_checked_qk_norm_attention(fake_model, gen):
    """A Qwen3-shaped attention: q_norm, k_norm and the rotation become one qk_norm_rope call, with the layer's
    norm weights (shared) and the config's RoPE; outputs and gradients as before, the state dict's keys too."""
    module, model = fake_model(model="FakeQKNormModel")
    keys = list(model.state_dict())
    x, position_ids = torch.randn(2, 7, 64, generator=gen), torch.arange(3, 10)[None]  # (1, S): expanded
    grads = []
    for patched in (False, True):
        if patched:
            report = patch.patch_transformers(model)
            assert report["qk_norm_rope"] == ["self_attn"], report
            assert "forward" in vars(model.self_attn) and model.self_attn.cupyrope_qk_norm == (1e-6, 0.0)
        xg = x.clone().requires_grad_()
        model.zero_grad()
        out = model(xg, position_ids)
        out.square().sum().backward()
        grads.append((out.detach(), xg.grad, model.self_attn.q_norm.weight.grad.clone(),
                      model.self_attn.k_proj.weight.grad.clone()))
    for before, after in zip(*grads):  # fp32 roundings, relative to each tensor's largest values
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5 * float(before.abs().max()))
    assert list(model.state_dict()) == keys
    with torch.no_grad():  # no position_ids: the layer's own forward
        cos_sin = model.rotary_emb(x, position_ids)
        own = grads[0][0]
        torch.testing.assert_close(model.self_attn(x, cos_sin, None)[0], own, rtol=1e-4, atol=1e-5 * float(own.abs().max()))
    assert patch.patch_transformers(model)["qk_norm_rope"] == []  # idempotent


@pytest.mark.parametrize("options,reason", [
    ({"rope_first": True}, "its forward differs from cupyrope's qk_norm_rope with the config's RoPE"),
    ({"norm": "FakeLayerRMSNorm"}, "computes neither x / rms(x) * weight nor x / rms(x) * (1 + weight) with its eps"),
    # A config whose llama3 scaling its rotary embedding does not apply: far positions tell them apart.
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
     "its forward differs from cupyrope's qk_norm_rope with the config's RoPE"),
])
def test_patch_transformers_leaves_a_qk_norm_attention_it_cannot_match(fake_model, options, reason):
    module, _ = fake_model()
    options = {key: getattr(module, value) if key == "norm" else value for key, value in options.items()}
    _, model = fake_model(model="FakeQKNormModel", **options)
    report = patch.patch_transformers(model, rope=False, rms_norm=False)
    assert report["qk_norm_rope"] == [] and report["skipped"] == [("self_attn", reason)]
    assert "forward" not in vars(model.self_attn)


def test_patch_transformers_skips_a_qk_norm_attention_whose_config_refuses_a_read(fake_model):
    """A config that raises an exception of its own on a read (transformers' heterogeneous configs, Gemma 4's head_dim
    varying by layer, raise one that is neither a ValueError nor an AttributeError): the layer is left as it is, with
    the reason, and the rest of the model is patched."""

    class PerLayerError(Exception):
        pass

    class PerLayerConfig(types.SimpleNamespace):
        def __getattribute__(self, name):
            if name == "head_dim":
                raise PerLayerError("head_dim varies by layer")
            return super().__getattribute__(name)

    _, model = fake_model(model="FakeQKNormModel")
    model.self_attn.config = PerLayerConfig(**vars(model.self_attn.config))
    report = patch.patch_transformers(model, rope=False)
    assert report["qk_norm_rope"] == [] and "forward" not in vars(model.self_attn)
    assert report["skipped"] == [("self_attn", "cupyrope cannot build its RoPE from the config (PerLayerError: head_dim "
                                               "varies by layer)")]
    assert report["rms_norm"] == ["self_attn.q_norm", "self_attn.k_norm"]


def test_patch_transformers_names_a_rounded_inv_freq_where_a_qk_norm_attention_differs(fake_model):
    """Where the fused forward differs and the rotary embedding's inv_freq is not fp32 (model.to(torch.bfloat16)
    rounds it, and with it every angle), the reason says so."""
    _, model = fake_model(model="FakeQKNormModel", rope_first=True)
    model.rotary_emb.to(torch.bfloat16)
    report = patch.patch_transformers(model, rope=False, rms_norm=False)
    assert report["qk_norm_rope"] == [] and len(report["skipped"]) == 1
    name, reason = report["skipped"][0]
    assert name == "self_attn" and "inv_freq is torch.bfloat16" in reason and "from_pretrained" in reason


def test_patch_transformers_fuses_qwen3_attention_as_loaded_not_after_to_bfloat16():
    """transformers' Qwen3 in bf16: loaded in its dtype (the rotary inv_freq stays fp32) its attention is fused; after
    model.to(torch.bfloat16) (inv_freq rounded, the model's RoPE no longer the config's) it is left, and says why."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, vocab_size=128, max_position_embeddings=256, head_dim=16,
                                      rope_theta=1000000.0)
    torch.manual_seed(0)
    loaded = transformers.Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    converted = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    assert patch.patch_transformers(loaded, rope=False)["qk_norm_rope"] == ["model.layers.0.self_attn"]
    report = patch.patch_transformers(converted, rope=False)  # rope=False: the modeling module stays as it is
    assert report["qk_norm_rope"] == [] and "inv_freq is torch.bfloat16" in dict(report["skipped"])["model.layers.0.self_attn"]


def test_patch_transformers_fuses_a_checked_decoder_layers_residual_add(fake_model, gen):
    """Llama-shaped decoder layers: the attention output's residual add and post_attention_layernorm become one
    add_rms_norm call with the norm's (shared) weight, and so do the first layer's MLP residual add and the second
    layer's input_layernorm, which then normalizes nothing itself; outputs and gradients as before, the state dict's
    keys too."""
    _, model = fake_model(model="FakeDecoderModel")
    keys = list(model.state_dict())
    x, position_ids = torch.randn(2, 7, 64, generator=gen), torch.arange(3, 10)[None]
    grads = []
    for patched in (False, True):
        if patched:
            report = patch.patch_transformers(model)
            assert report["add_rms_norm"] == ["layers.0", "layers.1"] and report["skipped"] == [], report
            assert model.layers[0].cupyrope_add_norm == (1e-5, 0.0)
            calls = [[], []]
            for layer, seen in zip(model.layers, calls):
                layer.input_layernorm.register_forward_hook(lambda *args, seen=seen: seen.append(1))
        xg = x.clone().requires_grad_()
        model.zero_grad()
        out = model(xg, position_ids)
        out.square().sum().backward()
        grads.append((out.detach(), xg.grad, model.layers[0].post_attention_layernorm.weight.grad.clone(),
                      model.layers[1].input_layernorm.weight.grad.clone(),
                      model.layers[1].self_attn.q_proj.weight.grad.clone()))
    assert calls == [[1], []]  # the second layer's input normalized by the first
    for before, after in zip(*grads):
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5 * float(before.abs().max()))
    assert list(model.state_dict()) == keys
    assert patch.patch_transformers(model)["add_rms_norm"] == []  # idempotent


@pytest.mark.parametrize("change", ["replaced", "written in place"])
def test_a_decoder_layer_normalizes_its_input_itself_where_the_output_before_changed(fake_model, gen, change):
    """The first layer's normalized output goes to the second only with the very tensor it returned, unwritten: a
    forward hook that replaces that output, or writes it in place, and the second layer normalizes what it gets."""
    hook = (lambda module, args, out: out * 2.0) if change == "replaced" else (lambda module, args, out: out.mul_(2.0))
    _, model = fake_model(model="FakeDecoderModel")
    unpatched = copy.deepcopy(model)
    assert patch.patch_transformers(model)["add_rms_norm"] == ["layers.0", "layers.1"]
    for m in (model, unpatched):
        m.layers[0].register_forward_hook(hook)
    calls = []
    model.layers[1].input_layernorm.register_forward_hook(lambda *args: calls.append(1))
    x, position_ids = torch.randn(2, 7, 64, generator=gen), torch.arange(3, 10)[None]
    with torch.no_grad():
        got, expected = model(x, position_ids), unpatched(x, position_ids)
    assert calls == [1]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


def test_patch_transformers_leaves_a_decoder_layer_it_cannot_match(fake_model):
    _, model = fake_model(model="FakeDecoderModel", normed_residual=True)
    report = patch.patch_transformers(model, rope=False, rms_norm=False, qk_norm_rope=False)
    reason = "its forward differs from input_layernorm, self_attn, add_rms_norm and mlp in that order"
    assert report["add_rms_norm"] == [] and report["skipped"] == [("layers.0", reason), ("layers.1", reason)]
    _, extra = fake_model(model="FakeDecoderModel")
    extra.layers[0].post_mlp_layernorm = torch.nn.Identity()
    report = patch.patch_transformers(extra, rope=False, rms_norm=False, qk_norm_rope=False)
    assert report["add_rms_norm"] == ["layers.1"]
    assert report["skipped"] == [("layers.0", "has submodules besides input_layernorm, self_attn, "
                                              "post_attention_layernorm, mlp: post_mlp_layernorm")]


def test_patch_transformers_leaves_layers_with_parameters_of_their_own(fake_model):
    """A learned scale on a layer itself (Doge's residual scales), or on an attention beside its projections and norms,
    starts at one: the forward check passes, but a fused forward would leave the scale untrained. Such layers keep
    their forward."""
    _, model = fake_model(model="FakeDecoderModel")
    model.layers[0].input_residual = torch.nn.Parameter(torch.ones(64))
    model.layers[1].self_attn.head_scale = torch.nn.Parameter(torch.ones(4))
    report = patch.patch_transformers(model, rope=False, rms_norm=False)
    assert report["add_rms_norm"] == ["layers.1"] and report["qk_norm_rope"] == ["layers.0.self_attn"]
    assert report["skipped"] == [
        ("layers.1.self_attn", "has parameters besides those of q_proj, k_proj, v_proj, o_proj, q_norm, k_norm: "
                               "head_scale"),
        ("layers.0", "has parameters besides those of input_layernorm, self_attn, post_attention_layernorm, mlp: "
                     "input_residual")]


# Real transformers models, where transformers is installed (CPU; the GPU test below repeats it in bf16).

TINY_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-3.1-scaling": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"partial_rotary_factor": 0.5}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5}),
    # The one-tensor apply_rotary_pos_emb(x, cos, sin), q and k rotated apart; its full-attention layers' cos rotates a
    # quarter of their wider heads (zero frequencies past it).
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", {"head_dim": 16, "global_head_dim": 32, "sliding_window": 8}),
    # Multimodal RoPE (text towers of vision-language models): the rotary embedding picks each frequency's
    # position from one of three rows (time, height, width), in sections or interleaved; the rotation
    # itself is transformers' apply_rotary_pos_emb.
    "qwen2-vl-mrope": ("Qwen2VLTextConfig", "Qwen2VLTextModel", {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}),
    "qwen3-vl-interleaved-mrope": ("Qwen3VLTextConfig", "Qwen3VLTextModel", {"head_dim": 16, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}}),
}


def tiny_model(name, dtype=torch.float32, device="cpu"):
    transformers = pytest.importorskip("transformers")
    config_name, model_name, options = TINY_MODELS[name]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config = getattr(transformers, config_name)(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, **options)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # norms start at their identity: make them count
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor):
                module.weight.normal_()
    return model.to(device=device, dtype=dtype)


def model_inputs(name, device="cpu"):
    """Token ids, and for multimodal RoPE three distinct position rows (as an image's grid gives)."""
    gen = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(1, 64, (2, 40), generator=gen)}
    if "mrope" in name:
        t = torch.arange(40).expand(2, 40)
        inputs["position_ids"] = torch.stack([t, t // 5, t % 7])
    return {key: value.to(device) for key, value in inputs.items()}


def _patched_outputs(model, inputs):
    """The model's first output (logits, or the last hidden state of a text tower) before and after
    patch_transformers, and its report."""
    source = sys.modules[type(model).__module__]
    original = source.apply_rotary_pos_emb
    try:
        with torch.no_grad():
            before = model(**inputs)[0]
            report = patch.patch_transformers(model)
            after = model(**inputs)[0]
    finally:
        source.apply_rotary_pos_emb = original  # other tests build this model type too
    return before, after, report


QK_NORM_MODELS = ("qwen3", "gemma3")  # their attention layers fuse q_norm, k_norm and the rotation
# Decoder layers that are not the pre-norm pair add_rms_norm fuses, and their other submodules (Cohere's attention
# and MLP run in parallel: no post_attention_layernorm).
OTHER_DECODER_LAYERS = {"gemma3": "pre_feedforward_layernorm, post_feedforward_layernorm",
                        "glm4": "post_self_attn_layernorm, post_mlp_layernorm",
                        "phi3": "resid_attn_dropout, resid_mlp_dropout"}


@pytest.mark.parametrize("name", TINY_MODELS)
def test_patch_transformers_on_real_models(name):
    model = tiny_model(name)
    before, after, report = _patched_outputs(model, model_inputs(name))
    skipped = [reason for _, reason in report["skipped"]]
    if name == "qwen3-vl-interleaved-mrope":  # its layers get text positions only
        assert skipped == ["M-RoPE: its layers receive text positions, not the three position rows its cos/sin "
                           "come from"] * 2
    elif name == "gemma4":  # attention and decoder layers with more parts than the fused forwards run
        assert sorted(module for module, _ in report["skipped"]) == [
            "model.layers.0", "model.layers.0.self_attn", "model.layers.0.self_attn.v_norm",
            "model.layers.1", "model.layers.1.self_attn", "model.layers.1.self_attn.v_norm"]
    elif name in OTHER_DECODER_LAYERS:
        assert skipped == [f"has submodules besides input_layernorm, self_attn, post_attention_layernorm, mlp: "
                           f"{OTHER_DECODER_LAYERS[name]}"] * 2
    else:
        assert skipped == []
    assert report["rope"] == [type(model).__module__]
    assert len(report["qk_norm_rope"]) == (2 if name in QK_NORM_MODELS else 0)
    assert len(report["add_rms_norm"]) == (0 if name in OTHER_DECODER_LAYERS or name in ("cohere", "gemma4") else 2)
    assert len(report["rms_norm"]) >= (0 if name == "cohere" else 5)  # Cohere's norm is a LayerNorm
    assert_close(after, before, "float32")


@pytest.mark.parametrize("name", ["llama", *QK_NORM_MODELS, "gemma4"])
def test_patched_models_train_and_generate_alike(name):
    """The fused attention and residual add, and the one-tensor RoPE, in training (gradients of every parameter) and
    in greedy decoding with the KV cache."""
    source = sys.modules[type(tiny_model(name)).__module__]
    original = source.apply_rotary_pos_emb
    inputs = model_inputs(name)
    models = [tiny_model(name), tiny_model(name)]
    try:
        report = patch.patch_transformers(models[1])
        assert len(report["qk_norm_rope"]) == (2 if name in QK_NORM_MODELS else 0)
        assert len(report["add_rms_norm"]) == (0 if name in OTHER_DECODER_LAYERS or name == "gemma4" else 2)
        assert report["rope"] == [source.__name__]
        results = []
        for model in models:
            model.train()
            model(**inputs, labels=inputs["input_ids"]).loss.backward()
            model.eval()
            with torch.no_grad():
                tokens = model.generate(inputs["input_ids"][:, :12], max_new_tokens=6, do_sample=False)
            results.append(({n: p.grad for n, p in model.named_parameters()}, tokens))
    finally:
        source.apply_rotary_pos_emb = original
    (grads, tokens), (patched_grads, patched_tokens) = results
    assert torch.equal(patched_tokens, tokens)
    for n, g in grads.items():
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(patched_grads[n], g, rtol=1e-4, atol=1e-5 * scale, msg=n)


# ------------------------------------------------------------------------------------------------ GPU


def gpu(test):
    return pytest.mark.gpu(requires_torch_cuda(test))


@gpu
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "gemma4", "cohere", "qwen3-vl-interleaved-mrope"])
def test_patch_transformers_on_gpu(name):
    model = tiny_model(name, dtype=torch.float32, device="cuda")
    before, after, report = _patched_outputs(model, model_inputs(name, "cuda"))
    assert report["rope"] == [type(model).__module__]
    assert len(report["qk_norm_rope"]) == (2 if name in QK_NORM_MODELS else 0)
    assert len(report["add_rms_norm"]) == (0 if name in OTHER_DECODER_LAYERS or name in ("cohere", "gemma4") else 2)
    # Two layers of fp32 ops whose summation orders differ (the kernels' reductions against torch's):
    # the kernels' own accuracy is tested op by op; here the model must agree to a few fp32 roundings.
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))


def _hf4_multimodal(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers 4's Qwen2-VL apply_multimodal_rotary_pos_emb."""
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _with_multimodal(module, model, function, section=(2, 3, 3)):
    module.apply_multimodal_rotary_pos_emb = function
    model.config = types.SimpleNamespace(rope_scaling={"type": "mrope", "mrope_section": list(section)})
    return model


def test_multimodal_dropin_is_transformers_4s(gen):
    dropin = pytest.importorskip("cupyrope.dropin")
    angles = torch.rand(3, 2, 7, 8, generator=gen) * 6
    cos, sin = (torch.cat([t, t], -1) for t in (angles.cos(), angles.sin()))
    q, k = torch.randn(2, 4, 7, 16, generator=gen), torch.randn(2, 2, 7, 16, generator=gen)
    for got, expected in zip(dropin.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 3, 3]),
                             _hf4_multimodal(q, k, cos, sin, [2, 3, 3])):
        assert_close(got, expected, "float32")
    with pytest.raises(ValueError, match=r"mrope_section: expected sections adding up to rotary_dim / 2 = 8"):
        dropin.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 3, 2])


def test_patch_transformers_swaps_a_matching_multimodal_rope(fake_model):
    module, model = fake_model()
    _with_multimodal(module, model, _hf4_multimodal)
    report = patch.patch_transformers(model)
    assert module.__name__ in report["rope"]
    assert module.apply_multimodal_rotary_pos_emb is patch.apply_multimodal_rotary_pos_emb


def test_patch_transformers_leaves_a_multimodal_rope_it_cannot_match(fake_model):
    def interleaved(q, k, cos, sin, mrope_section, unsqueeze_dim=1):  # another assignment of the sections
        return _hf4_multimodal(q, k, cos.flip(0), sin.flip(0), mrope_section, unsqueeze_dim)

    module, model = fake_model()
    _with_multimodal(module, model, interleaved)
    report = patch.patch_transformers(model)
    assert module.apply_multimodal_rotary_pos_emb is interleaved
    assert any(name.endswith("apply_multimodal_rotary_pos_emb") and "differ" in why for name, why in report["skipped"])
    module2, model2 = fake_model()
    module2.apply_multimodal_rotary_pos_emb = _hf4_multimodal  # no mrope_section in a config
    report = patch.patch_transformers(model2)
    assert any("no mrope_section" in why for _, why in report["skipped"])
