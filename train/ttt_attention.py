"""Attention of the unrolled TTT steps (rule: ``ttt_visible``; alignment: ``ttt.py``).

The head's ``Attention`` module calls its backend exactly as at inference —
``forward(q, k, v, k_cache, v_cache, meta, scale)`` — so training runs the very modules the
engine serves. Here the "cache" is a ``TTTCache`` holding every step's K/V so far and
``meta`` a ``TTTMeta``; the backend appends the step's K/V and attends.

Two implementations with equal results: ``TTTAttention`` (reference, any device: causal
attention per sequence for step 0, then the diagonal keys of steps 1..i merged through
log-sum-exps) and ``TTTFlexAttention`` (GPU: one FlexAttention call over the steps' keys
concatenated, with a block mask built from ``ttt_visible``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from specdec.attention.base import AttentionBackend


def ttt_visible(
    q_seq: torch.Tensor,  # sequence id of the query
    q_idx: torch.Tensor,  # global (packed) index of the query
    k_step: torch.Tensor,  # step that wrote the key (0 .. i)
    k_seq: torch.Tensor,  # sequence id of the key
    k_idx: torch.Tensor,  # global index of the key
) -> torch.Tensor:  # bool, the arguments broadcast together
    """Whether a step-``i`` query sees a key: step-0 keys of its sequence at or before it
    (the catch-up entries), and keys at its own index from steps 1..i (its ancestors in a
    chain draft). Elementwise, so it serves dense masks and FlexAttention's mask_mod. A
    key whose ``k_seq`` matches no sequence (-1: a step not yet written) is never seen."""
    same_seq = k_seq == q_seq
    causal = (k_step == 0) & same_seq & (k_idx <= q_idx)
    diagonal = (k_step > 0) & same_seq & (k_idx == q_idx)
    return causal | diagonal


@dataclass
class TTTMeta:
    """The attention metadata of one TTT step (passed where inference passes
    ``AttentionMetadata``)."""

    seq_ids: torch.Tensor  # [n] int64: packed sequence of each index
    step: int
    num_steps: int  # steps of the unroll (the flex path sizes its key buffer by it)


@dataclass
class TTTCache:
    """Every step's keys and values so far ([n, kv_heads, head_dim] each), in the place
    of a paged cache."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


class TTTAttention(AttentionBackend):
    """Reference: step 0 is causal attention within each sequence; each later step adds
    its diagonal keys by merging log-sum-exps, so memory stays linear in the steps.
    Differentiable; any device. Not registered for serving (no ``name``)."""

    static_tokens = False  # whether batches should be padded to one size (flex path)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        cache: TTTCache = k_cache
        cache.keys.append(k)
        cache.values.append(v)
        group = q.shape[1] // k.shape[1]
        out0, lse0 = _causal_by_sequence(q, cache.keys[0], cache.values[0], meta.seq_ids, scale)
        if len(cache.keys) == 1:
            return out0
        ks = torch.stack(cache.keys[1:], dim=2).repeat_interleave(group, dim=1)  # [n,h,i,d]
        vs = torch.stack(cache.values[1:], dim=2).repeat_interleave(group, dim=1)
        s = torch.einsum("nhd,nhjd->nhj", q.float(), ks.float()) * scale  # [n, h, i]
        lse = torch.logsumexp(torch.cat([lse0.unsqueeze(-1), s], dim=-1), dim=-1)  # [n, h]
        w0 = torch.exp(lse0 - lse).unsqueeze(-1)  # [n, h, 1]
        ws = torch.exp(s - lse.unsqueeze(-1))  # [n, h, i]
        out = w0 * out0.float() + torch.einsum("nhj,nhjd->nhd", ws, vs.float())
        return out.to(q.dtype)


def _causal_by_sequence(
    q: torch.Tensor,  # [n, heads, d]
    k: torch.Tensor,  # [n, kv_heads, d]
    v: torch.Tensor,  # [n, kv_heads, d]
    seq_ids: torch.Tensor,  # [n], non-decreasing
    scale: float,
    tile: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [n, heads, d], log-sum-exp [n, heads] fp32
    """Causal attention within each packed sequence, as a few batched ops whatever the
    number of sequences: queries in tiles of ``tile``, each tile against the window of key
    tiles back to the start of its first query's sequence (one width for all tiles, the
    largest needed), masked by sequence and position. Memory: [tiles, heads, tile, window]
    scores; the flex path is the one for long sequences and wide heads."""
    n, heads, d = q.shape
    group = heads // k.shape[1]
    dev = q.device
    num_tiles = -(-n // tile)
    idx = torch.arange(n, device=dev)
    is_start = torch.diff(seq_ids, prepend=seq_ids[:1] - 1) != 0
    seq_start = torch.where(is_start, idx, 0).cummax(0).values  # [n]
    tiles = torch.arange(num_tiles, device=dev)
    back = tiles - seq_start[tiles * tile] // tile  # [tiles]: key tiles before its own
    width = (int(back.max()) + 1) * tile  # one host sync per call
    key_idx = (tiles[:, None] - width // tile + 1) * tile + torch.arange(width, device=dev)
    key_ok = (key_idx >= 0) & (key_idx < n)  # [tiles, width]: outside the batch: no key
    key_idx = key_idx.clamp(0, n - 1)
    q_idx = tiles[:, None] * tile + torch.arange(tile, device=dev)  # [tiles, tile]
    q_ok = q_idx < n
    q_idx = q_idx.clamp(max=n - 1)
    visible = (
        key_ok[:, None, :]
        & (seq_ids[key_idx][:, None, :] == seq_ids[q_idx][:, :, None])
        & (key_idx[:, None, :] <= q_idx[:, :, None])
    )  # [tiles, tile, width]
    qs = q[q_idx].float()  # [tiles, tile, heads, d]
    ks = k[key_idx].repeat_interleave(group, dim=2).float()  # [tiles, width, heads, d]
    vs = v[key_idx].repeat_interleave(group, dim=2).float()
    scores = torch.einsum("aqhd,akhd->ahqk", qs, ks) * scale  # [tiles, heads, tile, width]
    # Finite fill: every real query sees itself, so masked keys weigh exp(-1e30) = 0 there,
    # and the padded queries of the last tile stay finite (no NaN into the backward).
    scores = scores.masked_fill(~visible[:, None], -1e30)
    lse = torch.logsumexp(scores, dim=-1)  # [tiles, heads, tile]
    out = torch.einsum("ahqk,akhd->aqhd", torch.exp(scores - lse[..., None]), vs)
    keep = q_ok.flatten()
    out = out.reshape(num_tiles * tile, heads, d)[keep]  # [n, heads, d]
    lse = lse.permute(0, 2, 1).reshape(num_tiles * tile, heads)[keep]
    return out.to(q.dtype), lse


class TTTFlexAttention(TTTAttention):
    """GPU path: one FlexAttention call per step over a key buffer of every step's slot
    ([num_steps * n]: steps 0..i written, later ones zero and marked unseen), with a block
    mask from ``ttt_visible``; the blocks outside step 0's causal band and the written
    steps' diagonals are skipped. ``compile`` runs FlexAttention's fused kernel (eager
    FlexAttention is a slow reference).

    Shapes are the same at every step, and across batches padded to one size
    (``PackedBatch.padded``; ``static_tokens`` asks the trainer for that): a compiled
    kernel is specialised to its shapes, and torch.compile falls back to eager — the
    unfused path whose dense score matrix ran out of memory on the H200 — once a function
    has been recompiled ``recompile_limit`` (8) times, which growing key lengths reached
    within the first batch."""

    def __init__(self, compile: bool = True) -> None:
        self.compile = compile
        self.static_tokens = compile

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        cache: TTTCache = k_cache
        cache.keys.append(k)
        cache.values.append(v)
        n = q.shape[0]
        seq = meta.seq_ids
        unwritten = meta.num_steps - len(cache.keys)
        # [num_steps * n]: each key's sequence; -1 in the slots of steps not yet written.
        key_seq = torch.cat([seq.repeat(len(cache.keys)), seq.new_full((unwritten * n,), -1)])

        def mask_mod(b, h, q_idx, kv_idx):
            key = kv_idx % n
            return ttt_visible(seq[q_idx], q_idx, kv_idx // n, key_seq[kv_idx], key)

        num_keys = meta.num_steps * n
        block_mask = _block_mask(self.compile)(mask_mod, None, None, n, num_keys,
                                               device=q.device)  # fmt: skip
        keys = torch.cat([*cache.keys, k.new_zeros(unwritten * n, *k.shape[1:])])
        values = torch.cat([*cache.values, v.new_zeros(unwritten * n, *v.shape[1:])])
        keys = keys.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, keys, d]
        values = values.transpose(0, 1).unsqueeze(0)
        out = _flex(self.compile)(
            q.transpose(0, 1).unsqueeze(0), keys, values, block_mask=block_mask, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        return out[0].transpose(0, 1)  # [n, heads, d]


@functools.cache
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@functools.cache
def _block_mask(compiled: bool):
    """``create_block_mask``; compiled, it evaluates the mask block by block instead of
    materialising every (query, key) pair."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False) if compiled else create_block_mask
