"""The block drafter's training objective: random anchors, one masked forward, decayed
per-slot losses.

Anchors. A position ``a`` of a packed sequence is *eligible* iff ``loss_mask[a]`` and
``a + 1`` lies in the same sequence with ``loss_mask[a + 1]``: the block then drafts at
least one assistant token. Each micro-batch draws ``num`` anchors uniformly without
replacement among its eligible positions (a fixed count, so every batch has the same shape;
sequences weigh by their eligible positions); when fewer exist, the rest are padding blocks
that carry no loss.

Alignment (``BlockDrafter``'s). Block ``a`` reads ``[x[a], MASK * (B-1)]`` at positions
``a .. a+B-1`` and sees the context positions ``< a`` of its sequence
(``block_attention.block_visible``). Slot ``k`` (1 .. B-1) predicts ``x[a+k]``; its label
is the target's next-token distribution at ``a+k-1`` restricted to the draft vocabulary
(``ttt.draft_labels``), with ``argmax_weight`` of its mass moved to the argmax (1: the
target's greedy token, which is ``x[a+k]`` itself in greedily regenerated data). Slot ``k``
is valid iff ``a+k-1`` lies in the sequence and is usable there (loss mask, argmax kept:
``ttt.usable_labels``), as a TTT step is.

Loss: ``sum_k w_k * loss_k`` with ``w_k = exp(-(k-1) / gamma)`` and ``loss_k`` the
per-position draft loss (``draft_loss.DRAFT_LOSSES``: ce or an LK loss) averaged over slot
``k``'s valid blocks. Figures follow TTT's, slot ``k`` in the place of step ``k-1``: acc_i
is slot ``i+1``'s accuracy, and simulated τ is 1 + the mean leading run of correct slots
over blocks whose slot 1 is valid (greedy verification of the block's chain accepts that
run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.models.block_drafter import BlockDrafter
from specdec.train.block_attention import BlockMeta, PackedBlockAttention
from specdec.train.draft_loss import DRAFT_LOSSES
from specdec.train.ttt import (
    PackedBatch,
    StepIndex,
    TTTOutput,
    draft_labels,
    mix_argmax,
    usable_labels,
)

# Upstream DFlash's slot-decay constants by block size.
DEFAULT_GAMMA: dict[int, float] = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    if block_size not in DEFAULT_GAMMA:
        raise ValueError(
            f"no default loss decay for block.block_size={block_size} (known: "
            f"{sorted(DEFAULT_GAMMA)}); set block.gamma"
        )
    return DEFAULT_GAMMA[block_size]


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:  # [B - 1] float32
    """``exp(-(k-1) / gamma)`` for slots k = 1 .. B-1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


@dataclass
class BlockAnchors:
    """The anchors of one micro-batch, ascending (padding ones last)."""

    index: torch.Tensor  # [A] int64: packed index of each anchor (0 for padding)
    valid: torch.Tensor  # [A] bool: False for padding blocks
    seq: torch.Tensor  # [A] int64: sequence of each anchor (-1 for padding)
    local: torch.Tensor  # [A] int64: the anchor's position within its sequence


def eligible_anchors(batch: PackedBatch, index: StepIndex) -> torch.Tensor:  # [n] bool
    n = batch.num_tokens
    nxt = torch.arange(1, n + 1, device=batch.loss_mask.device)
    inside = nxt < index.seq_end
    return batch.loss_mask & inside & batch.loss_mask[nxt.clamp(max=n - 1)]


def sample_anchors(
    batch: PackedBatch, num: int, generator: torch.Generator | None = None
) -> BlockAnchors:
    """``num`` anchors drawn without replacement among the eligible positions (module
    docstring); sync-free. ``generator`` None draws from the global RNG (which training
    checkpoints save and restore); evaluation passes a seeded one."""
    index = StepIndex.of(batch.cu_seqlens, batch.num_tokens)
    ok = eligible_anchors(batch, index)
    n = batch.num_tokens
    device = ok.device
    scores = torch.rand(n, device=device, generator=generator)
    scores = torch.where(ok, scores, -1.0)
    if n < num:  # too few positions for the count: pad with ineligible slots
        scores = torch.cat([scores, scores.new_full((num - n,), -1.0)])
    top, picked = scores.topk(num)
    valid = top >= 0
    picked = torch.where(valid, picked, n)  # padding sorts last
    picked, order = picked.sort()
    valid = valid[order]
    picked = torch.where(valid, picked, 0)
    seq = torch.where(valid, index.seq_ids[picked], -1)
    return BlockAnchors(picked, valid, seq, index.local[picked])


def block_logits(
    drafter: BlockDrafter,
    batch: PackedBatch,
    anchors: BlockAnchors,
    attention: PackedBlockAttention,
) -> torch.Tensor:  # [A, B - 1, draft_vocab] float32
    """Every anchor's block in one forward over the packed batch (module docstring)."""
    index = StepIndex.of(batch.cu_seqlens, batch.num_tokens)
    block = drafter.config.block_size
    last = drafter.rotary.num_positions - 1
    # Positions past the RoPE table only occur on slots past a sequence's end (invalid):
    # clamped, as TTT clamps its own (the gather is unchecked on GPU).
    context = drafter.context_kv(batch.aux_hidden, index.local.clamp(max=last))
    ids = drafter.block_inputs(batch.input_ids[anchors.index])  # [A, B]
    positions = anchors.local[:, None] + torch.arange(block, device=ids.device)  # [A, B]
    meta = BlockMeta(index.seq_ids, index.local, anchors.seq, anchors.local, block)
    scale = drafter.config.head_dim**-0.5

    def attend(layer: int, q, k, v):
        return attention(q, k, v, context[layer], meta, scale)

    hidden = drafter.block_hidden(
        drafter.embed(ids.reshape(-1)), positions.reshape(-1).clamp(max=last), attend
    )  # [A * B, hidden]
    return drafter.compute_logits(hidden.view(ids.shape[0], block, -1)[:, 1:])


def block_objective(
    drafter: BlockDrafter,
    batch: PackedBatch,
    anchors: BlockAnchors,
    attention: PackedBlockAttention,
    target_lm_head: torch.Tensor,  # [vocab, hidden]: the target's (frozen) output weights
    label_weight: torch.Tensor,  # [draft_vocab, hidden]: its rows of the kept ids
    *,
    gamma: float,
    loss: str = "ce",
    lk_eta: float = 3.0,
    argmax_weight: float = 1.0,
) -> TTTOutput:
    """The weighted per-slot loss and TTT-shaped figures (module docstring)."""
    block = drafter.config.block_size
    position_loss = DRAFT_LOSSES[loss]
    index = StepIndex.of(batch.cu_seqlens, batch.num_tokens)
    with torch.no_grad():
        _, _, usable = usable_labels(drafter, batch, target_lm_head)
        slots = torch.arange(block - 1, device=anchors.index.device)  # k - 1
        source = anchors.index[:, None] + slots  # [A, B-1]: where slot k's label is made
        inside = source < index.seq_end[anchors.index][:, None]
        source = torch.where(inside, source, 0)
        valid = anchors.valid[:, None] & inside & usable[source]  # [A, B-1]
        labels = draft_labels(batch.target_hidden[source.reshape(-1)], label_weight)
        label_top = labels.argmax(-1)
        labels = mix_argmax(labels, label_top, argmax_weight)
    logits = block_logits(drafter, batch, anchors, attention)  # [A, B-1, V_d]
    per_pos = position_loss(labels, logits.reshape(-1, logits.shape[-1]), lk_eta)
    per_pos = per_pos.view(valid.shape)  # [A, B-1]
    counts = valid.sum(0)  # [B-1]
    slot_loss = (per_pos * valid).sum(0) / counts.clamp(min=1)  # [B-1]
    weights = slot_weights(block, gamma).to(slot_loss.device)
    with torch.no_grad():
        correct = (logits.argmax(-1) == label_top.view(valid.shape)) & valid  # [A, B-1]
        leading = correct.long().cumprod(1).sum(1)  # [A]
    return TTTOutput(
        loss=(weights * slot_loss).sum(),
        step_losses=slot_loss.detach(),
        step_correct=correct.sum(0),
        step_valid=counts,
        leading_correct=leading,
        valid0=valid[:, 0],
    )


def anchors_for(block_size: int, max_tokens: int) -> int:
    """A default anchor count per micro-batch: about one block token per context token."""
    return max(1, math.ceil(max_tokens / block_size))
