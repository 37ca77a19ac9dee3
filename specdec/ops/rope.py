"""RoPE's rotation in HF's "half" layout: the reference of the rotation the Triton cache
write fuses (``kernels.store_kv.rope_store_kvcache``), applied by the models and the torch
attention path. The cos/sin tables and RoPE scaling live in ``specdec.models.rope``."""

from __future__ import annotations

import torch


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
