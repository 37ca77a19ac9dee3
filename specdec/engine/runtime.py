"""Where and how the target runs: device, dtype, attention backend, CUDA graphs and
compilation resolved from the config's "auto" fields, the context limit, and the KV
cache's bytes per block."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specdec.attention import available_backends
from specdec.config import INVARIANT_ATTENTION, EngineConfig
from specdec.models.config import ModelConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


_TRITON_BACKENDS = frozenset({"triton", INVARIANT_ATTENTION})


@dataclass(frozen=True)
class RuntimeChoice:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    use_cuda_graphs: bool
    compile_target: bool = False  # torch.compile the target's layers (compile_regions)
    compile_draft: bool = False  # the draft side may compile (SpeculativeConfig.compile_head)
    deterministic: bool = False  # batch-invariant kernels on the target's path
    # What a draft model's attention runs (None: the target's backend). Deterministic mode
    # gives the draft the backend the mode would otherwise pick: only the target's logits
    # decide the output, and the invariant kernels (query tiles built per layer, every
    # split stored) would only slow the draft down.
    draft_attention: str | None = None

    @property
    def draft_attention_backend(self) -> str:
        return self.draft_attention or self.attention_backend

    @property
    def triton_kernels(self) -> bool:
        """Whether the attention backend runs Triton kernels, so the runner's other Triton
        kernels (K/V move, acceptance, top-k) run too: both Triton backends."""
        return self.attention_backend in _TRITON_BACKENDS


def choose_runtime(config: EngineConfig) -> RuntimeChoice:
    """Resolve the "auto" fields: the GPU path is bf16 + Triton + CUDA graphs (+ compiled
    regions), the CPU path fp32 + the torch reference backend, eager. Deterministic mode
    takes the batch-invariant attention backend and leaves the target uncompiled; it is
    refused where its kernels cannot run or its backend is not registered."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={config.device!r} but no CUDA device is visible")
    on_gpu = device.type == "cuda"
    dtype = engine_dtype(config.dtype, on_gpu)
    backend = config.attention_backend
    fast = "triton" if on_gpu else "torch"  # the backend a mode without invariance takes
    if backend == "auto":
        backend = INVARIANT_ATTENTION if config.deterministic else fast
    if config.deterministic:
        _require_deterministic_runtime(device, backend)
    graphs = on_gpu and not config.enforce_eager
    compiles = graphs and config.compile is not False
    return RuntimeChoice(
        device,
        dtype,
        backend,
        graphs,
        compile_target=compiles and not config.deterministic,
        compile_draft=compiles,
        deterministic=config.deterministic,
        draft_attention=fast if config.deterministic else None,
    )


def _require_deterministic_runtime(device: torch.device, backend: str) -> None:
    """What deterministic mode needs once the device is known: somewhere its Triton
    kernels run, and its attention backend registered (never a silent substitute)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"deterministic=True runs the target on Triton kernels, which need a CUDA "
            f"device; device={str(device)!r}: use device='cuda' (or set TRITON_INTERPRET=1 "
            "before starting, to run them slowly in the interpreter for tests)"
        )
    available = available_backends()
    if backend not in available:
        raise ValueError(
            f"deterministic=True needs the batch-invariant attention backend {backend!r}, "
            f"which is not registered (available: {available}); without it a token's "
            "attention output would depend on its step. Use a specdec build that ships "
            "it, or turn deterministic off"
        )


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


def engine_dtype(name: str, on_gpu: bool) -> torch.dtype:
    """``EngineConfig.dtype`` resolved: "auto" is bf16 on the GPU, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    return _DTYPES[name]


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    c = model_config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * elem
