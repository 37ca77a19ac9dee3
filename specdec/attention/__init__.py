"""Attention over the paged KV cache: metadata, backends (torch reference, Triton)."""

from specdec.attention.base import AttentionBackend, available_backends, get_attention_backend
from specdec.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_attention_backend"]
