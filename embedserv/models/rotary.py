"""Rotary position embeddings computed from a Hugging Face config, as transformers computes them.

transformers 5 keeps every RoPE setting in `config.rope_parameters` (`rope_type`, `rope_theta`,
`factor`, ...) and converts older config.json files (`rope_scaling` plus a top-level `rope_theta`) into
that dict when it loads them; configs built by older transformers still carry the two apart, so both
are read. Models with layer types (Gemma) keep one such dict per type (`rope_parameters[layer_type]`).
The inverse frequencies use transformers' float32 formulas op for op, so on CPU the cos/sin
tables hold the same bits as the reference's. One type transformers lacks: "ntk", the fixed (and mixed)
NTK scaling of Alibaba's GTE v1.5 configs (`rope_scaling: {"type": "ntk", "factor": 2.0}`), computed as
their published code (Alibaba-NLP/new-impl, NTKScalingRotaryEmbedding) computes it.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional", "ntk")
# transformers' RotaryEmbeddingConfigMixin.default_theta, for configs that name no base.
DEFAULT_THETA = 10_000.0


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's RoPE settings (those of `layer_type`'s layers, for configs with per-type settings) as
    one flat dict with `rope_type` and `rope_theta` filled in."""
    params = getattr(config, "rope_parameters", None)
    if layer_type is not None:
        params = dict((params or {}).get(layer_type) or {})
    elif params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", None)
        if theta is not None:
            params.setdefault("rope_theta", theta)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] == "mrope":
        # Qwen2-VL's config.json form: default frequencies, `mrope_section` saying how M-RoPE splits them.
        params["rope_type"] = "default"
    params.setdefault("rope_theta", DEFAULT_THETA)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {params['rope_type']!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    # Proportional RoPE (Gemma 4) rotates a part of each head by design; elsewhere we rotate whole heads only.
    if params["rope_type"] != "proportional" and params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not supported; only 1.0")
    if params["rope_type"] == "llama3":
        # What transformers assumes when a llama3 config leaves the pretraining length out.
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def _require(params: dict, key: str):
    if params.get(key) is None:
        raise ValueError(f"rope type {params['rope_type']!r} needs {key!r} in the config's rope parameters")
    return params[key]


def inverse_frequencies(params: dict, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 on CPU, the `inv_freq` transformers' rotary embedding holds."""
    base = params["rope_theta"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if params["rope_type"] == "linear":
        # Dividing the frequencies by the factor is dividing the positions by it.
        return inv_freq / _require(params, "factor")
    if params["rope_type"] == "llama3":
        return _llama3_scaling(params, inv_freq)
    if params["rope_type"] == "proportional":
        return _proportional(params, head_dim)
    if params["rope_type"] == "ntk":
        return _ntk(params, head_dim)
    return inv_freq


def _ntk(params: dict, head_dim: int) -> torch.Tensor:
    """GTE v1.5's NTK scaling (https://kexue.fm/archives/9706), as Alibaba-NLP/new-impl computes it at every
    length (its table is built past max_position_embeddings, where the scaling applies). Fixed: the base
    times `factor`, every frequency over factor ** (2 / head_dim). Mixed (`mixed_b`): the unscaled base,
    pair i's frequency over exp(a * i ** mixed_b) with a = log(factor) / (head_dim / 2) ** mixed_b."""
    factor = _require(params, "factor")
    mixed_b = params.get("mixed_b")
    base = params["rope_theta"] * (factor if mixed_b is None else 1)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if mixed_b is None:
        return inv_freq / factor ** (2 / head_dim)
    a = torch.tensor(factor).log() / (head_dim / 2) ** mixed_b
    return inv_freq / (a * torch.arange(1, head_dim // 2 + 1).float() ** mixed_b).exp()


def _proportional(params: dict, head_dim: int) -> torch.Tensor:
    """Gemma 4: the first `partial_rotary_factor` of each head's pairs rotate at the frequencies a whole
    head would give them; the other pairs get frequency 0 (cos 1, sin 0: left as they are)."""
    rotated = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.int64, device="cpu").to(torch.float) / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    inv_freq = torch.cat((inv_freq, torch.zeros(head_dim // 2 - rotated, dtype=torch.float32)))
    return inv_freq / params.get("factor", 1.0)


def _llama3_scaling(params: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = _require(params, "factor")
    low_freq_factor = _require(params, "low_freq_factor")
    high_freq_factor = _require(params, "high_freq_factor")
    old_context_len = _require(params, "original_max_position_embeddings")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin of every position up to `max_positions`, looked up by the flat `positions` tensor, or by M-RoPE
    positions [3, num_tokens] where the config has an `mrope_section` (Qwen2-VL and its kin).

    Not an nn.Module with buffers on purpose: models are built on the meta device and then `to_empty`,
    which would leave a buffer made in __init__ uninitialized, and a model-wide `.to(bfloat16)` would
    round it. The float32 table is made on first use on a device (and again only if the device changes).
    """

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head size, not {head_dim}")
        self.params = rope_parameters(config, layer_type)
        self.head_dim = head_dim
        self.max_positions = max_positions
        # M-RoPE: how many of each head's frequencies rotate by the temporal, height and width positions.
        self.mrope_section = tuple(int(n) for n in self.params.get("mrope_section") or ())
        if self.mrope_section and (len(self.mrope_section) != 3 or sum(self.mrope_section) != head_dim // 2):
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must be three sizes adding up to half the head size, "
                f"{head_dim // 2}"
            )
        # Which position row (temporal 0, height 1, width 2) each frequency rotates by: in runs of the sections'
        # sizes (Qwen2-VL), or interleaved t, h, w, t, h, w, ... (Qwen3-VL).
        self._mrope_rows = _mrope_rows(self.mrope_section, bool(self.params.get("mrope_interleaved")))
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def _build(self, device: torch.device) -> None:
        inv_freq = inverse_frequencies(self.params, self.head_dim)
        positions = torch.arange(self.max_positions, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]
        self._cos = freqs.cos().to(device)
        self._sin = freqs.sin().to(device)
        if self._mrope_rows is not None:
            self._mrope_rows = self._mrope_rows.to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens], or M-RoPE's [3, num_tokens] -> cos, sin as [num_tokens, 1, head_dim // 2] float32
        (broadcast over heads)."""
        if self._cos is None or self._cos.device != positions.device:
            self._build(positions.device)
        cos, sin = self._cos[positions], self._sin[positions]
        if positions.dim() == 2:
            cos, sin = self._sections(cos), self._sections(sin)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _sections(self, table: torch.Tensor) -> torch.Tensor:
        """[3, num_tokens, head_dim // 2] -> [num_tokens, head_dim // 2]: each frequency from its position row
        (transformers' Qwen2VLRotaryEmbedding / Qwen3VLTextRotaryEmbedding recomposition). Where the three rows
        are equal (text) this copies the plain table's values: the same bits as 1-D positions."""
        if self._mrope_rows is None:
            raise ValueError("3-D (M-RoPE) positions given to a rotary embedding whose config has no mrope_section")
        rows = self._mrope_rows.expand(1, table.shape[1], -1)
        return table.gather(0, rows).squeeze(0)


def _mrope_rows(section: tuple[int, ...], interleaved: bool) -> torch.Tensor | None:
    """[1, 1, sum(section)] int64 on the CPU (models are built under a meta default device): the position row
    of each frequency; None without M-RoPE. Interleaved
    (transformers' Qwen3-VL): frequency i takes height where i % 3 == 1 and i < 3 * section[1], width where
    i % 3 == 2 and i < 3 * section[2], temporal elsewhere."""
    if not section:
        return None
    if not interleaved:
        runs = torch.repeat_interleave(torch.arange(3, device="cpu"), torch.tensor(section, device="cpu"))
        return runs.view(1, 1, -1)
    index = torch.arange(sum(section), device="cpu")
    rows = torch.zeros_like(index)
    for row, count in ((1, section[1]), (2, section[2])):
        rows[(index % 3 == row) & (index < 3 * count)] = row
    return rows.view(1, 1, -1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[num_tokens, heads, head_dim] (any strides) rotated in float32 -> a new contiguous tensor in x's dtype.

    transformers' convention: the two halves of each head form the (real, imaginary) pairs, i.e.
    `x * cos + rotate_half(x) * sin` with `rotate_half(x) = cat(-x2, x1)`, written out per half.
    Each half is written in place into one output (multiply, then fused multiply-add): on CPU about
    5x faster than building the halves as temporaries and concatenating them.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out2).addcmul_(x1, sin)
    return out.to(x.dtype)
