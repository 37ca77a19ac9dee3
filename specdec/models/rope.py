"""Rotary position embeddings with the scaling variants found in HF configs.

Each variant turns (theta, head_dim, scaling params) into inverse frequencies and a
post-scale for cos/sin ("attention factor"); we evaluate them once into a cos/sin table
indexed by position, so the forward is a single gather: no host syncs, static shapes.

The formulas follow the published methods and agree numerically with HF transformers:
the tables are computed in float32 in the same operation order, then cast to the
activation dtype at use, as HF does. The layout is HF's "half" layout: dimension ``i`` of
the first half rotates with dimension ``i`` of the second half.

Position-dependent variants (``dynamic`` NTK, ``longrope``) pick their frequencies from a
sequence length. HF uses the longest position in the current forward call, which makes a
token's rotation depend on what else is in the batch and on the chunking of its prompt.
We instead give each position ``p`` the frequencies for sequence length ``p + 1``: a pure
function of position, so batching, chunked prefill and speculative verification all see
the same rotations, and one token per step (HF incremental decoding) matches HF exactly.
A single HF forward over a prompt that already exceeds the original context rotates its
earlier tokens with the frequencies of the full length instead; it is the one case where
the two differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# Scaling types that are anchored to the pretraining context length.
_NEEDS_ORIGINAL_MAX = frozenset({"llama3", "yarn", "longrope"})


@dataclass(frozen=True)
class RopeParams:
    """What every RoPE variant is computed from. ``scaling`` excludes ``rope_theta``."""

    head_dim: int
    theta: float
    max_position_embeddings: int
    scaling: dict[str, Any] = field(default_factory=dict)

    @property
    def rope_type(self) -> str:
        return self.scaling.get("rope_type", "default")


# inv_freq(params, seq_lens) -> (inv_freq, attention_factor). ``seq_lens`` is [P, 1] int64,
# the sequence length each table row stands for (row p: p + 1). The result is
# [head_dim // 2] for static variants and [P, head_dim // 2] for position-dependent ones.
InvFreqFn = Callable[[RopeParams, torch.Tensor], tuple[torch.Tensor, float]]


@dataclass(frozen=True)
class RopeType:
    required: frozenset[str]  # keys the scaling dict must carry
    inv_freq: InvFreqFn


def _exponents(dim: int, device: torch.device) -> torch.Tensor:  # [dim // 2] float32
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _default(p: RopeParams, seq_lens: torch.Tensor) -> tuple[torch.Tensor, float]:
    return 1.0 / (p.theta ** _exponents(p.head_dim, seq_lens.device)), 1.0


def _linear(p: RopeParams, seq_lens: torch.Tensor) -> tuple[torch.Tensor, float]:
    # Position interpolation: dividing positions by `factor` equals dividing frequencies.
    inv_freq, _ = _default(p, seq_lens)
    return inv_freq / p.scaling["factor"], 1.0


def _dynamic_ntk(p: RopeParams, seq_lens: torch.Tensor) -> tuple[torch.Tensor, float]:
    # NTK-aware base growth once the sequence passes the trained length; float32 tensor
    # arithmetic in HF's order so the tables agree to the last bit.
    factor, trained, dim = p.scaling["factor"], p.max_position_embeddings, p.head_dim
    seq_len = torch.clamp(seq_lens, min=trained)  # [P, 1] int64
    base = p.theta * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim, seq_lens.device)), 1.0  # [P, dim // 2]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: RopeParams, seq_lens: torch.Tensor) -> tuple[torch.Tensor, float]:
    s, dim, theta = p.scaling, p.head_dim, p.theta
    original = s["original_max_position_embeddings"]
    # DeepSeek-style configs omit `factor` and imply it by the context extension ratio.
    factor = s.get("factor") or p.max_position_embeddings / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_for_rotations(rotations: float) -> float:
        # The rotary dimension that completes `rotations` turns over the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp below divides by (high - low)

    pos_freqs = theta ** _exponents(dim, seq_lens.device)  # [dim // 2]
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=seq_lens.device) - low) / (
        high - low
    )
    # 1 keeps the original frequency (fast dims), 0 takes the interpolated one (slow dims).
    extrapolate = 1 - torch.clamp(ramp, 0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _longrope(p: RopeParams, seq_lens: torch.Tensor) -> tuple[torch.Tensor, float]:
    s, device = p.scaling, seq_lens.device
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or p.max_position_embeddings / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    long = torch.tensor(s["long_factor"], dtype=torch.float32, device=device)
    short = torch.tensor(s["short_factor"], dtype=torch.float32, device=device)
    ext = torch.where(seq_lens > original, long, short)  # [P, dim // 2]
    return 1.0 / (ext * p.theta ** _exponents(p.head_dim, device)), float(attention_factor)


def _llama3(p: RopeParams, seq_lens: torch.Tensor) -> tuple[torch.Tensor, float]:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
    # between blends the two linearly in (context / wavelength).
    s = p.scaling
    factor, low_ff, high_ff = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    context = s["original_max_position_embeddings"]
    inv_freq, _ = _default(p, seq_lens)
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > context / low_ff
    short_wave = wavelen < context / high_ff
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~short_wave & ~long_wave, blended, scaled), 1.0


ROPE_TYPES: dict[str, RopeType] = {
    "default": RopeType(frozenset(), _default),
    "linear": RopeType(frozenset({"factor"}), _linear),
    "dynamic": RopeType(frozenset({"factor"}), _dynamic_ntk),
    "yarn": RopeType(frozenset({"original_max_position_embeddings"}), _yarn),
    "longrope": RopeType(
        frozenset({"long_factor", "short_factor", "original_max_position_embeddings"}), _longrope
    ),
    "llama3": RopeType(
        frozenset(
            {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        ),
        _llama3,
    ),
}


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from an HF config dict, old or new style.

    Older configs keep ``rope_theta`` at top level and scaling under ``rope_scaling`` (with
    ``type`` or ``rope_type``); transformers 5 writes one ``rope_parameters`` dict holding
    ``rope_theta`` and ``rope_type``. ``scaling`` is None for plain RoPE, else a dict with
    ``rope_type`` and the variant's keys (``rope_theta`` removed).
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"per-layer-type rope_parameters {sorted(params)} are not supported; "
            "specdec models use one RoPE for every layer"
        )
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    partial = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"partial_rotary_factor={partial} is not supported (the Llama/Qwen decoders "
            "rotate the whole head); use a config with partial_rotary_factor 1.0"
        )
    if rope_type == "default":
        return theta, None
    if rope_type in _NEEDS_ORIGINAL_MAX:
        # A top-level value wins over the one inside the dict (Phi-3-style configs).
        if "original_max_position_embeddings" in hf:
            params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def validate_rope_scaling(scaling: dict[str, Any] | None, head_dim: int) -> None:
    """Raise naming the bad value if ``scaling`` is not a complete, supported variant."""
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling type {rope_type!r}; supported: {sorted(ROPE_TYPES)}"
        )
    missing = sorted(k for k in ROPE_TYPES[rope_type].required if scaling.get(k) is None)
    if missing:
        raise ValueError(f"RoPE scaling {rope_type!r} needs keys {missing}; got {scaling}")
    if "factor" in ROPE_TYPES[rope_type].required and not scaling["factor"] >= 1.0:
        raise ValueError(f"RoPE scaling factor must be >= 1.0; got {scaling['factor']}")
    for key in ("long_factor", "short_factor"):
        if key in scaling and len(scaling[key]) != head_dim // 2:
            raise ValueError(
                f"RoPE {key} has {len(scaling[key])} entries; head_dim {head_dim} needs "
                f"{head_dim // 2}"
            )


def max_context_len(scaling: dict[str, Any] | None, max_position_embeddings: int) -> int:
    """Positions the model can be run at. Dynamic NTK exists to run past the trained length,
    so it is allowed ``factor`` times more; every other variant's configs already state
    their (extended) limit in ``max_position_embeddings``."""
    if scaling is not None and scaling.get("rope_type") == "dynamic":
        return int(max_position_embeddings * scaling["factor"])
    return max_position_embeddings


def rope_cos_sin(
    params: RopeParams, num_positions: int, device: torch.device | None = None
) -> torch.Tensor:  # [num_positions, head_dim] float32: cos | sin halves
    """The cos/sin table for positions ``0 .. num_positions - 1`` (attention factor applied)."""
    positions = torch.arange(num_positions, dtype=torch.int64, device=device)
    inv_freq, attention_factor = ROPE_TYPES[params.rope_type].inv_freq(
        params, (positions + 1)[:, None]
    )
    freqs = positions.float()[:, None] * inv_freq  # [P, head_dim // 2]
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; ``forward`` gathers the rows for the given positions.

    The table is a non-persistent float32 buffer; after moving a meta-constructed model to
    a real device (``materialize``), call ``build_cache`` to fill it. Positions must lie in
    ``[0, num_positions)``: the gather is unchecked on GPU, so the engine bounds them by
    ``ModelConfig.max_context_len``.
    """

    cos_sin_cache: torch.Tensor  # [num_positions, head_dim] float32

    def __init__(self, params: RopeParams, num_positions: int) -> None:
        super().__init__()
        self.params = params
        self.num_positions = num_positions
        table = torch.empty(num_positions, params.head_dim)  # on the default device
        # Built on the meta device, the model fills its table in ``build_cache`` after
        # ``to_empty``: computing one on meta would only cost time (the first torch._refs
        # call there imports torch._dynamo, ~0.7 s).
        if not table.is_meta:
            table = rope_cos_sin(params, num_positions, table.device)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    @classmethod
    def for_config(cls, config: Any, num_positions: int) -> RotaryEmbedding:
        """From a config with ``head_dim``, ``rope_theta``, ``max_position_embeddings`` and
        ``rope_scaling`` (a target's ``ModelConfig`` or an ``Eagle3Config``)."""
        params = RopeParams(
            head_dim=config.head_dim,
            theta=config.rope_theta,
            max_position_embeddings=config.max_position_embeddings,
            scaling=config.rope_scaling or {},
        )
        return cls(params, num_positions)

    def build_cache(self) -> None:
        """(Re)compute the table in float32 on the buffer's current device."""
        self.cos_sin_cache = rope_cos_sin(
            self.params, self.num_positions, self.cos_sin_cache.device
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_tokens, 1, head_dim // 2] each
        # Cast after the float32 evaluation, as HF does, so low-precision runs round alike.
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(dtype)
        cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)
        return cos, sin
