"""Attention for training a target (``CausalLM``) on packed sequences, outside the engine.

The model calls its backend exactly as at inference — ``forward(q, k, v, k_cache,
v_cache, meta, scale)`` — so training runs the very modules the engine serves. Here
there is no cache (``k_cache``/``v_cache`` are None) and ``meta`` is a ``PackedMeta``:
each query attends causally to the keys of its own sequence. Differentiable.

Implementations (``PACKED_ATTENTION``), equal up to rounding:

- ``sdpa``: one ``scaled_dot_product_attention(is_causal=True)`` per sequence; any device
  (the reference, and the CPU path);
- ``varlen``: one FlashAttention varlen call for the whole batch
  (``torch.nn.attention.varlen``); CUDA, computed in bf16.

``auto`` is ``varlen`` where it runs (CUDA), else ``sdpa``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.attention.base import AttentionBackend
from specdec.ops.paged_attention import is_gqa


@dataclass
class PackedMeta:
    """Where each packed sequence lies (passed where inference passes
    ``AttentionMetadata``). Invariant: ``cu_seqlens[-1] == num_tokens`` and
    ``lengths[s] == cu_seqlens[s + 1] - cu_seqlens[s]``."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32, on the model's device
    lengths: list[int]  # host copy of the sequence lengths (no device sync to loop)

    @property
    def max_len(self) -> int:
        return max(self.lengths)


class PackedCausalAttention(AttentionBackend):
    """``sdpa``: causal attention per sequence. Not registered for serving (no ``name``)."""

    def forward(self, q, k, v, k_cache, v_cache, meta: PackedMeta, scale: float):
        outs, start = [], 0
        for n in meta.lengths:
            o = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1),  # [heads, n, d]
                k[start : start + n].transpose(0, 1),  # [kv_heads, n, d]
                v[start : start + n].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=is_gqa(q.shape[1], k.shape[1]),
            )
            outs.append(o.transpose(0, 1))
            start += n
        return torch.cat(outs)  # [num_tokens, heads, d]


class VarlenCausalAttention(PackedCausalAttention):
    """``varlen``: the whole batch in one FlashAttention call (CUDA; bf16 inside)."""

    def forward(self, q, k, v, k_cache, v_cache, meta: PackedMeta, scale: float):
        from torch.nn.attention.varlen import varlen_attn

        cu = meta.cu_seqlens.to(torch.int32)
        half = torch.bfloat16 if q.dtype == torch.float32 else q.dtype
        group = q.shape[1] // k.shape[1]
        if group > 1 and not _varlen_gqa():  # torch < 2.13: repeat the K/V heads instead
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        gqa = {"enable_gqa": True} if group > 1 and _varlen_gqa() else {}
        out = varlen_attn(
            q.to(half), k.to(half), v.to(half), cu, cu, meta.max_len, meta.max_len,
            scale=scale, window_size=(-1, 0), **gqa,
        )  # fmt: skip
        return out.to(q.dtype)


PACKED_ATTENTION: dict[str, type[PackedCausalAttention]] = {
    "sdpa": PackedCausalAttention,
    "varlen": VarlenCausalAttention,
}


def packed_attention(name: str, device: torch.device) -> PackedCausalAttention:
    """The implementation ``name`` (``auto``: module docstring); raises for an unknown
    name or ``varlen`` off CUDA."""
    if name == "auto":
        name = "varlen" if device.type == "cuda" and _has_varlen() else "sdpa"
    if name not in PACKED_ATTENTION:
        raise ValueError(
            f"packed attention {name!r} is unknown; choose auto | {' | '.join(PACKED_ATTENTION)}"
        )
    if name == "varlen" and (device.type != "cuda" or not _has_varlen()):
        raise ValueError(
            f"model.attention=varlen needs CUDA and torch.nn.attention.varlen; "
            f"this run is on {device.type}: use sdpa"
        )
    return PACKED_ATTENTION[name]()


@functools.cache
def _varlen_gqa() -> bool:
    """Whether this torch's varlen_attn takes ``enable_gqa`` (2.13 does, 2.11 does not)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True
