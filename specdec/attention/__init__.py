"""Attention over the paged KV cache: the backends (torch reference, Triton) and their
registry. The metadata they read is ``specdec.ops.attention_metadata``."""

from specdec.attention.base import AttentionBackend, available_backends, get_attention_backend

__all__ = ["AttentionBackend", "available_backends", "get_attention_backend"]
