"""Long-context RoPE scaling (cupyrope.rope_scaling, rope_cache(scaling=...)): the float64 frequencies
against transformers' formulas, the table's properties, bad configs, and the torch module. CPU only;
tests/test_rope_gpu.py runs the scaled tables through the kernels."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

import cupyrope
from cupyrope import reference, rope_scaling

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
QWEN25_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
DEEPSEEK_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False}
# (rotary_dim, theta, scaling): configs of released models
MODELS = {
    "llama-3.1": (128, 500000.0, LLAMA31),
    "linear": (128, 10000.0, {"type": "linear", "factor": 4.0}),
    "qwen-2.5-yarn": (128, 1e6, QWEN25_YARN),
    "deepseek-v3-yarn": (64, 10000.0, DEEPSEEK_YARN),
    "gpt-oss-yarn": (64, 150000.0, GPT_OSS_YARN),
    "yarn-mscale-alone": (128, 1e6, {**QWEN25_YARN, "mscale": 0.707}),  # used only with mscale_all_dim
    "yarn-attention-factor": (96, 10000.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                                            "attention_factor": 0.9, "beta_fast": 16, "beta_slow": 2}),
}


def transformers_frequencies(rotary_dim, theta, scaling):
    """transformers' modeling_rope_utils (_compute_llama3_parameters, _compute_yarn_parameters) transcribed
    step by step, in float64 instead of float32: an independent spelling of the same formulas."""
    import torch

    kind = scaling.get("rope_type", scaling.get("type"))
    dim, base = rotary_dim, theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    assert kind == "yarn"
    factor = scaling["factor"]
    attention_factor, mscale, mscale_all_dim = (scaling.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim"))
    original = scaling["original_max_position_embeddings"]

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def find_correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = find_correction_dim(beta_fast), find_correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv = 1.0 / (factor * pos_freqs) * (1 - extrapolation_factor) + 1.0 / pos_freqs * extrapolation_factor
    return inv, attention_factor


@pytest.mark.parametrize("model", MODELS)
def test_frequencies_match_the_transformers_formulas(model):
    pytest.importorskip("torch")
    rotary_dim, theta, scaling = MODELS[model]
    ours, attention = rope_scaling.frequencies(rotary_dim, theta, scaling)
    theirs, their_attention = transformers_frequencies(rotary_dim, theta, scaling)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-13)
    assert attention == pytest.approx(their_attention, rel=1e-14)
    assert not np.allclose(ours, reference.inv_freq(rotary_dim, theta))  # the scaling changed something


def transformers_llama_config(rotary_dim, theta, scaling):
    """A transformers LlamaConfig with this RoPE, as the installed version spells it (5: rope_parameters;
    4: rope_theta and rope_scaling)."""
    import transformers

    kind = scaling.get("rope_type", scaling.get("type"))
    rest = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    sizes = dict(hidden_size=rotary_dim * 8, num_attention_heads=8, num_key_value_heads=2, head_dim=rotary_dim,
                 max_position_embeddings=131072)
    if int(transformers.__version__.split(".")[0]) >= 5:
        return transformers.LlamaConfig(**sizes, rope_parameters={"rope_type": kind, "rope_theta": theta, **rest})
    return transformers.LlamaConfig(**sizes, rope_theta=theta, rope_scaling={"rope_type": kind, **rest})


@pytest.mark.parametrize("model", MODELS)
def test_frequencies_match_installed_transformers(model):
    """The real transformers functions (float32), when transformers is installed: same within fp32."""
    utils = pytest.importorskip("transformers.modeling_rope_utils", reason="transformers is not installed")
    rotary_dim, theta, scaling = MODELS[model]
    config = transformers_llama_config(rotary_dim, theta, scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    theirs, their_attention = utils.ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    ours, attention = rope_scaling.frequencies(rotary_dim, theta, scaling)
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-6)
    assert attention == pytest.approx(their_attention, rel=1e-7)


@pytest.mark.parametrize("model", ["llama-3.1", "qwen-2.5-yarn", "deepseek-v3-yarn", "gpt-oss-yarn"])
def test_rotary_embedding_matches_installed_transformers_llama(model, rng):
    """RotaryEmbedding.from_hf_config against transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb
    (float32 tables; positions below 100, where their fp32 angles are still accurate)."""
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama", reason="transformers is not installed")
    torch = pytest.importorskip("torch")
    ct = pytest.importorskip("cupyrope.torch")
    config = transformers_llama_config(*MODELS[model])
    rotary_dim = MODELS[model][0]
    pos = torch.from_numpy(rng.integers(0, 100, 7))
    q, k = torch.randn(1, 8, 7, rotary_dim), torch.randn(1, 2, 7, rotary_dim)  # (batch, heads, seq, dim)
    cos, sin = modeling.LlamaRotaryEmbedding(config)(q, pos[None])
    hf_q, hf_k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    ours = ct.RotaryEmbedding.from_hf_config(config, max_position=100)
    q_out, k_out = ours(q[0].transpose(0, 1), k[0].transpose(0, 1), pos)  # as (tokens, heads, dim)
    torch.testing.assert_close(q_out, hf_q[0].transpose(0, 1), atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, hf_k[0].transpose(0, 1), atol=3e-5, rtol=1e-5)


def test_llama3_keeps_short_wavelengths_and_slows_long_ones():
    base = reference.inv_freq(128, 500000.0)
    scaled, _ = rope_scaling.frequencies(128, 500000.0, LLAMA31)
    wavelength = 2 * np.pi / base
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert short.sum() and long.sum() and (~short & ~long).sum()  # all three bands occur at these settings
    np.testing.assert_array_equal(scaled[short], base[short])
    np.testing.assert_allclose(scaled[long], base[long] / 8, rtol=1e-15)
    assert np.all(np.diff(scaled) < 0)  # still strictly decreasing: the blend is continuous


def test_linear_scaling_is_positions_divided_by_factor():
    plain = reference.rope_cache(100, 64, 10000.0)
    scaled = reference.rope_cache(400, 64, 10000.0, {"rope_type": "linear", "factor": 4})
    np.testing.assert_allclose(scaled[::4], plain, atol=1e-13)


@pytest.mark.parametrize("model", ["qwen-2.5-yarn", "deepseek-v3-yarn", "yarn-attention-factor"])
def test_yarn_table_carries_the_attention_factor(model):
    rotary_dim, theta, scaling = MODELS[model]
    table = reference.rope_cache(50, rotary_dim, theta, scaling)
    _, attention = rope_scaling.frequencies(rotary_dim, theta, scaling)
    half = rotary_dim // 2
    np.testing.assert_allclose(table[:, :half] ** 2 + table[:, half:] ** 2, attention**2, rtol=1e-13)
    assert attention != 1.0


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, {"rope_type": "default", "rope_theta": 1e4}])
def test_default_scaling_is_the_plain_table(scaling):
    np.testing.assert_array_equal(reference.rope_cache(64, 32, 1e4, scaling), reference.rope_cache(64, 32, 1e4))


BAD_SCALINGS = [
    ([("llama3",)], TypeError, "scaling: expected a dict"),
    ({"rope_type": "dynamic", "factor": 2.0}, ValueError, "scaling: rope_type 'dynamic' changes the frequencies"),
    ({"type": "longrope", "short_factor": [1.0]}, ValueError, "scaling: rope_type 'longrope'"),
    ({"rope_type": "ntk"}, ValueError, "scaling: unknown rope_type 'ntk'; supported: default, linear, llama3, yarn"),
    ({"rope_type": "llama3", "factor": 8.0}, ValueError, "scaling: rope_type 'llama3' needs low_freq_factor"),
    ({"rope_type": "linear"}, ValueError, "scaling: rope_type 'linear' needs factor"),
    ({**LLAMA31, "low_freq_factr": 1.0}, ValueError, r"scaling: unknown keys \['low_freq_factr'\]"),
    ({**QWEN25_YARN, "beta_fst": 8}, ValueError, r"scaling: unknown keys \['beta_fst'\]"),
    ({"rope_type": "default", "mrope_section": [16, 24, 24]}, ValueError,
     r"scaling: unknown keys \['mrope_section'\] for rope_type 'default' \(it takes no keys of its own"),
    ({**LLAMA31, "rope_theta": 10000.0}, ValueError, r"scaling: rope_theta 10000.0 differs from theta=500000.0"),
    ({**LLAMA31, "factor": 0}, ValueError, "scaling: factor must be a finite number > 0"),
    ({**LLAMA31, "factor": float("inf")}, ValueError, "scaling: factor must be a finite number > 0"),
    ({**LLAMA31, "factor": "8"}, ValueError, "scaling: factor must be a finite number > 0"),
    ({**LLAMA31, "high_freq_factor": 1.0}, ValueError, r"scaling: high_freq_factor \(1.0\) must exceed"),
    ({**QWEN25_YARN, "beta_fast": 1, "beta_slow": 32}, ValueError, "scaling: beta_fast must be >= beta_slow"),
    ({**QWEN25_YARN, "truncate": "no"}, ValueError, "scaling: truncate must be a bool"),
    ({**QWEN25_YARN, "mscale": float("nan")}, ValueError, "scaling: mscale must be a finite number"),
]


@pytest.mark.parametrize("scaling,error,message", BAD_SCALINGS)
def test_bad_scaling_is_rejected_with_a_clear_message(scaling, error, message):
    with pytest.raises(error, match=message):
        cupyrope.rope_cache(100, 128, 500000.0, scaling=scaling)  # raises before it needs a GPU
    with pytest.raises(error, match=message):
        reference.rope_cache(100, 128, 500000.0, scaling)


def test_yarn_needs_theta_above_one():
    with pytest.raises(ValueError, match="scaling: yarn needs theta > 1"):
        cupyrope.rope_cache(10, 64, 1.0, scaling=QWEN25_YARN)


# ------------------------------------------------------------------------------ torch module (CPU)


def hf_config(version, rotary=None, **rope):
    """A Llama-like config as transformers 4 (rope_theta + rope_scaling) or 5 (rope_parameters) spells it."""
    fields = dict(hidden_size=1024, num_attention_heads=8, head_dim=None, max_position_embeddings=4096)
    if rotary:
        fields["partial_rotary_factor"] = rotary
    theta = rope.pop("rope_theta", 500000.0)
    if version == 4:
        return SimpleNamespace(**fields, rope_theta=theta, rope_scaling=rope or None)
    rope = {("rope_type" if key == "type" else key): value for key, value in rope.items()}
    return SimpleNamespace(**fields, rope_parameters={"rope_type": "default", "rope_theta": theta, **rope})


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("model", ["plain", "llama-3.1", "qwen-2.5-yarn", "partial"])
def test_rotary_embedding_from_hf_config_on_cpu(version, model):
    torch = pytest.importorskip("torch")
    ct = pytest.importorskip("cupyrope.torch")
    scaling = {"llama-3.1": LLAMA31, "qwen-2.5-yarn": QWEN25_YARN}.get(model, {})
    config = hf_config(version, rotary=0.5 if model == "partial" else None, **scaling)
    rotary = ct.RotaryEmbedding.from_hf_config(config, max_position=9000)
    rotary_dim = 64 if model == "partial" else 128
    assert (rotary.head_dim, rotary.rotary_dim, rotary.theta, rotary.max_position) == (128, rotary_dim, 500000.0, 9000)
    assert (rotary.cos_sin_cache is None) == (not scaling)
    q, k = torch.randn(5, 8, 128, dtype=torch.float64), torch.randn(5, 2, 128, dtype=torch.float64)
    pos = torch.tensor([0, 1, 4095, 8191, 8999])
    q_out, k_out = rotary(q.float(), k.float(), pos)
    table = reference.rope_cache(9000, rotary_dim, 500000.0, scaling or None)
    for out, x in ((q_out, q), (k_out, k)):
        expected = reference.rope(x.numpy(), pos.numpy(), rotary_dim=rotary_dim, cos_sin_cache=table)
        np.testing.assert_allclose(out.double().numpy(), expected, atol=2e-5)


def test_rotary_embedding_refuses_what_it_cannot_do():
    pytest.importorskip("torch")
    ct = pytest.importorskip("cupyrope.torch")
    with pytest.raises(ValueError, match="use_cache: scaled RoPE"):
        ct.RotaryEmbedding(128, 1024, 500000.0, use_cache=False, scaling=LLAMA31)
    with pytest.raises(ValueError, match="scaling: rope_type 'dynamic'"):
        ct.RotaryEmbedding.from_hf_config(hf_config(4, type="dynamic", factor=2.0))
    per_layer = SimpleNamespace(hidden_size=1024, num_attention_heads=8, max_position_embeddings=4096,
                                rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                    "factor": 8.0},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match=r"layer_type: .* one of \['full_attention', 'sliding_attention'\], got None"):
        ct.RotaryEmbedding.from_hf_config(per_layer)
    # Gemma 3's: one RotaryEmbedding per layer type.
    sliding = ct.RotaryEmbedding.from_hf_config(per_layer, layer_type="sliding_attention")
    assert sliding.theta == 1e4 and sliding.scaling is None and sliding.cos_sin_cache is None
    full = ct.RotaryEmbedding.from_hf_config(per_layer, layer_type="full_attention")
    assert full.theta == 1e6 and full.scaling["factor"] == 8.0 and full.cos_sin_cache.shape == (4096, 128)
    with pytest.raises(ValueError, match=r"mrope_section: expected sections adding up to rotary_dim / 2 = 64"):
        ct.RotaryEmbedding.from_hf_config(hf_config(5, mrope_section=[16, 24, 16]))


def test_rotary_embedding_reads_mrope_configs():
    """Qwen2-VL as transformers 4 (rope_scaling type "mrope") and 5 (mrope_section in rope_parameters) spell it,
    and Qwen3-VL's interleaved sections."""
    pytest.importorskip("torch")
    ct = pytest.importorskip("cupyrope.torch")
    for config in (hf_config(4, type="mrope", mrope_section=[16, 24, 24]), hf_config(5, mrope_section=[16, 24, 24])):
        rotary = ct.RotaryEmbedding.from_hf_config(config)
        assert rotary.mrope_section == [16, 24, 24] and not rotary.mrope_interleaved and rotary.scaling is None
    qwen3_vl = ct.RotaryEmbedding.from_hf_config(hf_config(5, mrope_section=[24, 20, 20], mrope_interleaved=True))
    assert qwen3_vl.mrope_section == [24, 20, 20] and qwen3_vl.mrope_interleaved
