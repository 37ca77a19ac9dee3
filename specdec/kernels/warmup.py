"""Compile, before serving, every attention kernel variant a request could otherwise compile.

Triton compiles a kernel on its first launch with each combination of compile-time
constants; the launchers pick those (tile rows, split-K or not, tree mask or not) from
the batch's shape, so without a warm-up the first request of each kind waits ~0.5-1 s on
the H200's host for a compilation (``benchmarks/bench_startup.py`` measured 0.75-1.2 s
first-token times where warm ones took 30 ms). The runtime integers that vary with every
step are kept out of the specialisation (``launch.RUNTIME_INTS``), and step inputs start
16-byte aligned (``input_batch``), so these launches cover what serving will launch.
Triton's disk cache makes the warm-up of a later process take milliseconds.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdec.kernels.decode import default_decode_config, paged_decode
from specdec.kernels.launch import gqa_group
from specdec.kernels.prefill import paged_attention, prefill_block_m_choices, prefill_config_for
from specdec.ops.attention_metadata import AttentionMetadata

__all__ = ["warm_up_attention"]


def _meta(
    query_len: int, seq_len: int, block_size: int, device: torch.device, tree: bool
) -> AttentionMetadata:
    """One sequence whose last ``query_len`` of ``seq_len`` tokens are new, every page the
    null block: what it reads is garbage, the launch is what counts."""
    i32 = {"dtype": torch.int32, "device": device}
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(query_len, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, query_len], **i32),
        seq_lens=torch.tensor([seq_len], **i32),
        block_tables=torch.zeros(1, -(-seq_len // block_size), **i32),
        max_query_len=query_len,
        max_seq_len=seq_len,
    )
    if not tree:
        return meta
    return replace(
        meta,
        tree_lens=torch.tensor([query_len], **i32),
        tree_mask_offsets=torch.zeros(1, dtype=torch.int64, device=device),
        tree_mask=torch.ones(query_len, query_len, dtype=torch.bool, device=device)
        .tril()
        .flatten(),
        max_tree_len=query_len,
    )


@torch.inference_mode()
def warm_up_attention(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], one layer's
    v_cache: torch.Tensor,
    num_heads: int,
    q_dtype: torch.dtype,
    *,
    plain: bool = True,
    trees: bool,
) -> int:
    """Launch once every variant of the varlen kernel (each tile size, split-K or not)
    without a tree mask and of the decode kernel (split or not) when ``plain``, and the
    varlen kernel's tree-mask variants when ``trees``; returns the number of launches.
    Leaves the caches unchanged (the kernels only read them). The two halves are separate
    so that an engine deferring speculation can compile the tree variants with
    speculation's graphs, after it reports ready."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = gqa_group(num_heads, num_kv_heads)
    device = k_cache.device
    launches = 0
    masks = [tree for tree, wanted in ((False, plain), (True, trees)) if wanted]
    for block_m in prefill_block_m_choices(group, k_cache.dtype) if masks else ():
        config = prefill_config_for(block_m)
        tokens = max(1, block_m // group)
        q = torch.zeros(tokens, num_heads, head_dim, dtype=q_dtype, device=device)
        for tree in masks:
            meta = _meta(tokens, tokens, block_size, device, tree)
            for num_splits in (1, 2):
                paged_attention(
                    q, k_cache, v_cache, meta, 1.0, config=config, num_splits=num_splits
                )
                launches += 1
    block_n = default_decode_config(head_dim, k_cache.dtype).block_n
    q = torch.zeros(1, num_heads, head_dim, dtype=q_dtype, device=device)
    meta = _meta(1, 2 * block_n, block_size, device, tree=False)
    for split_size in (2 * block_n, block_n) if plain else ():  # one split, two
        paged_decode(q, k_cache, v_cache, meta, 1.0, split_size=split_size)
        launches += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return launches
