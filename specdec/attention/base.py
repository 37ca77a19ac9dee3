"""Attention backend interface and registry.

A backend writes the new tokens' K/V into the paged cache at ``meta.slot_mapping`` and
then computes attention for every query token over its sequence's cached context (which
now includes the new tokens), following the causal rule in ``specdec.ops.attention_metadata``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.rope import apply_rotary

_BACKENDS: dict[str, type[AttentionBackend]] = {}


class AttentionBackend(ABC):
    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls, "name", None):
            _BACKENDS[cls.name] = cls

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata with whatever this backend derives from it once for every
        layer of a forward (the caller passes the result to each layer); as it is here."""
        return meta

    # Whether ``forward_rope`` rotates q and k inside the backend's own kernels (and so
    # compiled code should leave RoPE to the backend instead of fusing it itself).
    fuses_rope: ClassVar[bool] = False

    def forward_rope(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """``forward`` on q and k before RoPE (HF's "half" layout): rotate, store, attend.
        The default rotates with ``apply_rotary``; a backend may fold the rotation into
        its cache write (``fuses_rope``)."""
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.forward(q, k, v, k_cache, v_cache, meta, scale)


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiate a registered backend by name ("torch", "triton", "triton_invariant")."""
    # Importing the modules registers their classes.
    from specdec.attention import torch_backend  # noqa: F401

    with contextlib.suppress(ImportError):  # without triton only the reference exists
        from specdec.attention import invariant_backend, triton_backend  # noqa: F401
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def available_backends() -> list[str]:
    get_attention_backend("torch")
    return sorted(_BACKENDS)
