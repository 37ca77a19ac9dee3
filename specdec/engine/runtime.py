"""Where and how the target runs: device, dtype, attention backend and CUDA graphs
resolved from the config's "auto" fields, the context limit, and the KV cache's bytes per
block."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.models.config import ModelConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class RuntimeChoice:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    use_cuda_graphs: bool


def choose_runtime(config: EngineConfig) -> RuntimeChoice:
    """Resolve the "auto" fields: the GPU path is bf16 + Triton + CUDA graphs, the CPU path
    fp32 + the torch reference backend, eager."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={config.device!r} but no CUDA device is visible")
    on_gpu = device.type == "cuda"
    if config.dtype == "auto":
        dtype = torch.bfloat16 if on_gpu else torch.float32
    else:
        dtype = _DTYPES[config.dtype]
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if on_gpu else "torch"
    return RuntimeChoice(device, dtype, backend, on_gpu and not config.enforce_eager)


def decide_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_context_len
    asked = config.scheduler.max_model_len
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(
            f"max_model_len={asked} exceeds the model's context length {limit}; "
            f"use max_model_len <= {limit}"
        )
    return asked


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    c = model_config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * elem
