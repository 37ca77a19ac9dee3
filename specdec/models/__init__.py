"""Target models (one decoder for Llama / SmolLM2 / Qwen2 / Qwen3) and their loading."""

from specdec.models.aliases import ALIASES, ModelNotFoundError
from specdec.models.config import ModelConfig
from specdec.models.llama import CausalLM
from specdec.models.loader import (
    ResolvedModel,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model,
)
from specdec.models.registry import ARCHITECTURES
from specdec.models.weights import WeightLoadError

__all__ = [
    "ALIASES",
    "ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "ModelNotFoundError",
    "ResolvedModel",
    "WeightLoadError",
    "load_config",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
