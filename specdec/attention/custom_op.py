"""Attention as one opaque torch op, so ``torch.compile`` can fuse everything around it.

Dynamo cannot trace through a Triton launcher's host code (grid lambdas, autotuning), and
must not specialise on the metadata's host ints. Registered as a custom op that mutates
the caches, attention becomes a single node: the compiler fuses norms, RoPE and the MLP
around it, and CUDA graphs capture the result.
"""

from __future__ import annotations

import torch

from specdec.attention.base import AttentionBackend, get_attention_backend
from specdec.ops.attention_metadata import AttentionMetadata

_INSTANCES: dict[str, AttentionBackend] = {}


def _backend(name: str) -> AttentionBackend:
    if name not in _INSTANCES:
        _INSTANCES[name] = get_attention_backend(name)
    return _INSTANCES[name]


@torch.library.custom_op("specdec::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    backend: str,
    tree_lens: torch.Tensor | None = None,  # [num_seqs] int32
    tree_mask_offsets: torch.Tensor | None = None,  # [num_seqs] int64
    tree_mask: torch.Tensor | None = None,  # [sum_s tree_lens[s]**2] bool
    max_tree_len: int = 0,
    cos: torch.Tensor | None = None,  # [num_tokens, 1, head_dim // 2]: q, k before RoPE
    sin: torch.Tensor | None = None,  # [num_tokens, 1, head_dim // 2]
    tree_paths: torch.Tensor | None = None,  # [num_seqs, max_tree_len, max_tree_len] int32
    tree_depths: torch.Tensor | None = None,  # [num_seqs, max_tree_len] int32
    tile_starts: torch.Tensor | None = None,  # [num_seqs + 1] int32
    tile_seqs: torch.Tensor | None = None,  # [num_tokens] int64
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        tree_lens=tree_lens,
        tree_mask_offsets=tree_mask_offsets,
        tree_mask=tree_mask,
        max_tree_len=max_tree_len,
        tree_paths=tree_paths,
        tree_depths=tree_depths,
        tile_starts=tile_starts,
        tile_seqs=tile_seqs,
    )
    if cos is not None:
        assert sin is not None
        return _backend(backend).forward_rope(q, k, v, cos, sin, k_cache, v_cache, meta, scale)
    return _backend(backend).forward(q, k, v, k_cache, v_cache, meta, scale)


@paged_attention.register_fake
def _(
    q,
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    query_start_loc,
    seq_lens,
    block_tables,
    max_query_len,
    max_seq_len,
    scale,
    backend,
    tree_lens=None,
    tree_mask_offsets=None,
    tree_mask=None,
    max_tree_len=0,
    cos=None,
    sin=None,
    tree_paths=None,
    tree_depths=None,
    tile_starts=None,
    tile_seqs=None,
):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


class OpaqueAttention(AttentionBackend):
    """Wraps a registered backend behind the custom op (same interface, same results).
    Only code that torch.compile traces goes through the op; eager calls (prefill and
    mixed steps, graph capture without compile) call the backend directly, because the
    op's dispatch costs more host time than the attention it wraps (~140 µs a call on a
    CPU host, 0.4 ms under cProfile on the H200's: 30 layers make it milliseconds a step)."""

    name = ""  # not registered itself

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self._inner = _backend(inner)  # fails early on an unknown name

    @property
    def fuses_rope(self) -> bool:  # type: ignore[override]
        return self._inner.fuses_rope

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        return self._inner.prepare(meta)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if not torch.compiler.is_compiling():
            return self._inner.forward(q, k, v, k_cache, v_cache, meta, scale)
        return self.through_op(q, k, v, k_cache, v_cache, meta, scale)

    def forward_rope(self, q, k, v, cos, sin, k_cache, v_cache, meta, scale):
        if not torch.compiler.is_compiling():
            return self._inner.forward_rope(q, k, v, cos, sin, k_cache, v_cache, meta, scale)
        if not self.fuses_rope:  # rotate in the compiled code, fused with what is around
            return super().forward_rope(q, k, v, cos, sin, k_cache, v_cache, meta, scale)
        return self.through_op(q, k, v, k_cache, v_cache, meta, scale, rope=(cos, sin))

    def through_op(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """The custom op's call, what compiled code runs; ``rope`` = (cos, sin) when q
        and k come before RoPE (a backend that ``fuses_rope`` rotates them)."""
        cos, sin = rope if rope is not None else (None, None)
        return paged_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            meta.max_seq_len,
            scale,
            self.inner,
            meta.tree_lens,
            meta.tree_mask_offsets,
            meta.tree_mask,
            meta.max_tree_len,
            cos,
            sin,
            meta.tree_paths,
            meta.tree_depths,
            meta.tile_starts,
            meta.tile_seqs,
        )
