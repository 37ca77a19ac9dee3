"""Supported target architectures: the HF ``architectures`` names we load and the fixed
traits that name implies.

All three families run on the one decoder in ``llama.py``; they differ only in flags
(projection biases, per-head q/k norm). A trait is either fixed by the architecture (Qwen2
always has q/k/v biases and no o_proj bias, whatever config.json says) or read from the
config's ``attention_bias`` key (``None`` here).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureSpec:
    name: str  # the HF ``architectures[0]`` string
    families: str  # human-readable list of model families, for error messages
    qkv_bias: bool | None  # bias on q/k/v projections; None: config's ``attention_bias``
    o_proj_bias: bool | None  # bias on the attention output projection; None: as above
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    spec.name: spec
    for spec in (
        ArchitectureSpec(
            "LlamaForCausalLM",
            "Llama 2/3, SmolLM2",
            qkv_bias=None,
            o_proj_bias=None,
            qk_norm=False,
        ),
        ArchitectureSpec(
            "Qwen2ForCausalLM",
            "Qwen2, Qwen2.5",
            qkv_bias=True,
            o_proj_bias=False,
            qk_norm=False,
        ),
        ArchitectureSpec(
            "Qwen3ForCausalLM",
            "Qwen3",
            qkv_bias=None,
            o_proj_bias=None,
            qk_norm=True,
        ),
    )
}


def get_architecture(name: str) -> ArchitectureSpec:
    """The spec for an HF architecture name; raises naming the supported ones."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        supported = ", ".join(f"{s.name} ({s.families})" for s in ARCHITECTURES.values())
        raise ValueError(
            f"unsupported architecture {name!r}; specdec implements: {supported}"
        ) from None
