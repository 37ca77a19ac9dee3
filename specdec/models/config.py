"""``ModelConfig``: the target model's shape and numerics, read from an HF config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.models.registry import get_architecture
from specdec.models.rope import max_context_len, rope_from_hf, validate_rope_scaling

_DECODER_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)


def validate_decoder_shape(config: Any, extra_sizes: tuple[str, ...] = ()) -> None:
    """The checks every rotary GQA decoder config shares (targets and EAGLE-3 heads):
    positive int sizes, whole query groups, an even head_dim, positive eps and theta, a
    complete RoPE scaling variant. Errors name the config class and the field."""
    owner = type(config).__name__
    for name in (*_DECODER_SIZES, *extra_sizes):
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive int; got {value!r}")
    if config.num_heads % config.num_kv_heads:
        raise ValueError(
            f"num_heads={config.num_heads} is not a multiple of num_kv_heads="
            f"{config.num_kv_heads}; grouped-query attention needs whole groups"
        )
    if config.head_dim % 2:
        raise ValueError(f"head_dim={config.head_dim} must be even for rotary embeddings")
    if not config.rms_norm_eps > 0 or not config.rope_theta > 0:
        raise ValueError(
            f"rms_norm_eps ({config.rms_norm_eps}) and rope_theta ({config.rope_theta}) "
            "must be positive"
        )
    validate_rope_scaling(config.rope_scaling, config.head_dim)


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only target (Llama / Qwen2 / Qwen3 family), validated on construction.

    Invariants: ``num_heads % num_kv_heads == 0`` (grouped-query attention), every size is
    positive, ``architecture`` is registered in ``registry.ARCHITECTURES`` and
    ``rope_scaling`` (None = plain RoPE) is a complete variant from ``rope.ROPE_TYPES``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2: always)
    o_proj_bias: bool  # bias on the attention output projection
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None  # the checkpoint's dtype as config.json names it

    def __post_init__(self) -> None:
        get_architecture(self.architecture)
        validate_decoder_shape(self, ("num_layers",))
        if not all(isinstance(t, int) for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be ints; got {self.eos_token_ids!r}")

    @property
    def max_context_len(self) -> int:
        """The longest context (positions) the model can run; the RoPE table's length."""
        return max_context_len(self.rope_scaling, self.max_position_embeddings)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.json. Raises on features the decoder lacks
        (sliding-window layers, MLP biases, non-SiLU activations) instead of silently
        computing something else."""
        archs = hf.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(
                f"config.json must name exactly one architecture; got architectures={archs!r}"
            )
        arch = get_architecture(archs[0])
        _reject_unsupported(hf)
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        if hf.get("head_dim") is None and hidden % heads:
            raise ValueError(
                f"hidden_size={hidden} is not divisible by num_attention_heads={heads} and "
                "config.json gives no head_dim"
            )
        theta, scaling = rope_from_hf(hf)
        bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        return cls(
            architecture=arch.name,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias if arch.qkv_bias is None else arch.qkv_bias,
            o_proj_bias=bias if arch.o_proj_bias is None else arch.o_proj_bias,
            qk_norm=arch.qk_norm,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        )


def _reject_unsupported(hf: dict[str, Any]) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; the MLP is SiLU-gated")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported; the MLP projections have no bias")
    layer_types = hf.get("layer_types") or []
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise ValueError(
            "sliding-window attention layers are not supported (use_sliding_window="
            f"{hf.get('use_sliding_window')}, layer_types={sorted(set(layer_types))}); "
            "use a config whose layers are all full attention"
        )
