"""Target models (one decoder for Llama / SmolLM2 / Qwen2 / Qwen3) and their loading.

The names below load on first use (PEP 562), so importing a torch-free submodule such
as ``specdec.models.packaged_heads`` or ``specdec.models.aliases`` does not import torch:
a server's API process resolves its config and starts the engine core first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_SOURCES = {
    "ALIASES": "aliases",
    "ModelNotFoundError": "aliases",
    "ModelConfig": "config",
    "CausalLM": "llama",
    "ResolvedModel": "loader",
    "load_config": "loader",
    "load_model": "loader",
    "load_tokenizer": "loader",
    "resolve_model": "loader",
    "ARCHITECTURES": "registry",
    "WeightLoadError": "weights",
}

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


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"specdec.models.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})
