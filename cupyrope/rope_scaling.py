"""RoPE frequencies, plain and scaled for long context, in float64.

``scaling`` is a model config's Hugging Face ``rope_scaling`` dict (transformers 4) or
``rope_parameters`` dict (transformers 5), e.g. Llama 3.1's ``{"rope_type": "llama3", "factor": 8.0,
"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``. The
formulas are transformers' (modeling_rope_utils: linear, llama3, yarn), evaluated in float64.
``rope_cache(scaling=...)`` bakes them into the cos/sin table; the in-kernel cos/sin are unscaled.
"""

import math

import numpy as np

# Frequencies that depend on the sequence length at run time: no single table reproduces them.
LENGTH_DEPENDENT = ("dynamic", "longrope", "su")
REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
OPTIONAL_KEYS = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")}
NUMBER_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "attention_factor",
               "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
SIGNED_KEYS = ("mscale", "mscale_all_dim")  # any finite number; the others must be > 0
# Keys any config may carry: the type's name, and what rope_cache's own arguments already say
# (rope_theta must then equal theta; partial_rotary_factor is rotary_dim / head_dim).
COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def inv_freq(rotary_dim: int, theta: float = 10000.0) -> np.ndarray:
    """theta^(-2i/rotary_dim) for i < rotary_dim/2, in float64 (the kernels compute the same values in
    double, as exp(i * -2 ln(theta) / rotary_dim))."""
    return np.power(float(theta), -2.0 * np.arange(rotary_dim // 2, dtype=np.float64) / rotary_dim)


def _yarn_betas(scaling) -> tuple[float, float]:
    """(beta_fast, beta_slow) with transformers' defaults, 32 and 1."""
    return scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1


def scaling_type(scaling) -> str:
    """The scaling's name ("default" for None), after checking it names one rope_cache can build."""
    if scaling is None:
        return "default"
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling: expected a dict like a Hugging Face config's rope_scaling, or None, got "
                        f"{type(scaling).__name__}")
    name = scaling.get("rope_type", scaling.get("type", "default"))
    if name in LENGTH_DEPENDENT:
        raise ValueError(f"scaling: rope_type {name!r} changes the frequencies with the sequence length at run time, "
                         "which one cos/sin table cannot reproduce; supported: " + ", ".join(REQUIRED_KEYS))
    if name not in REQUIRED_KEYS:
        raise ValueError(f"scaling: unknown rope_type {name!r}; supported: " + ", ".join(REQUIRED_KEYS))
    return name


def check_scaling(scaling, theta: float) -> str:
    """Raise a ValueError/TypeError naming ``scaling`` unless it is a complete, consistent config the
    formulas below accept; returns its type's name. Unknown keys are refused (a misspelt optional key
    would otherwise be ignored and give a silently different table)."""
    name = scaling_type(scaling)
    if scaling is None:
        return name
    required, optional = REQUIRED_KEYS[name], OPTIONAL_KEYS.get(name, ())
    missing = [key for key in required if scaling.get(key) is None]
    if missing:
        raise ValueError(f"scaling: rope_type {name!r} needs " + ", ".join(missing))
    unknown = sorted(set(scaling) - set(required) - set(optional) - set(COMMON_KEYS))
    if unknown:
        takes = ", ".join(required + optional) or "no keys of its own"
        raise ValueError(f"scaling: unknown keys {unknown} for rope_type {name!r} (it takes {takes}; also "
                         f"{', '.join(COMMON_KEYS)})")
    if "rope_theta" in scaling and not math.isclose(float(scaling["rope_theta"]), float(theta), rel_tol=1e-12):
        raise ValueError(f"scaling: rope_theta {scaling['rope_theta']} differs from theta={theta}; pass "
                         f"theta={scaling['rope_theta']}")
    for key in NUMBER_KEYS:
        value, positive = scaling.get(key), key not in SIGNED_KEYS
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or (positive and value <= 0)):
            raise ValueError(f"scaling: {key} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    if name == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"scaling: high_freq_factor ({scaling['high_freq_factor']}) must exceed low_freq_factor "
                         f"({scaling['low_freq_factor']})")
    if name == "yarn":
        if theta <= 1:
            raise ValueError(f"scaling: yarn needs theta > 1, got theta={theta}")
        beta_fast, beta_slow = _yarn_betas(scaling)
        if beta_fast < beta_slow:
            raise ValueError("scaling: beta_fast must be >= beta_slow")
        if not isinstance(scaling.get("truncate", True), (bool, np.bool_)):
            raise ValueError(f"scaling: truncate must be a bool, got {scaling['truncate']!r}")
    return name


def frequencies(rotary_dim: int, theta: float = 10000.0, scaling=None) -> tuple[np.ndarray, float]:
    """(inverse frequencies, float64 [rotary_dim / 2]; attention factor that multiplies cos and sin)."""
    name = check_scaling(scaling, theta)
    base = inv_freq(rotary_dim, theta)
    if name == "default":
        return base, 1.0
    factor = float(scaling["factor"])
    if name == "linear":  # positions / factor
        return base / factor, 1.0
    if name == "llama3":
        return _llama3(base, factor, scaling), 1.0
    return _yarn(base, rotary_dim, theta, factor, scaling)


def _llama3(base, factor, scaling):
    """Long wavelengths (over original_max / low_freq_factor) slowed by factor, short ones (under
    original_max / high_freq_factor) kept, a linear blend in between."""
    old_context = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelength = 2 * math.pi / base
    smooth = (old_context / wavelength - low) / (high - low)
    blended = (1 - smooth) * base / factor + smooth * base
    scaled = np.where(wavelength > old_context / low, base / factor, base)
    medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
    return np.where(medium, blended, scaled)


def _yarn(base, rotary_dim, theta, factor, scaling):
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than beta_slow times over the original
    context are interpolated (divided by factor), those turning more than beta_fast times kept, a
    linear ramp over the dimensions between; cos and sin are multiplied by the attention factor."""
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = _yarn_betas(scaling)

    def correction_dim(rotations):  # the dimension whose frequency turns `rotations` times over `original`
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # share of the unscaled (extrapolated) frequency
    frequencies = base / factor * (1 - kept) + base * kept
    return frequencies, _yarn_attention_factor(factor, scaling)


def _yarn_attention_factor(factor, scaling) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:  # DeepSeek's variant
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)
