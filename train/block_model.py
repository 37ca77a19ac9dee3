"""What train-draft optimises for ``model.drafter=block``: a ``BlockDrafter`` wrapped in
``BlockModel``, whose forward is the whole block objective (``block_loss.py``).

As for EAGLE-3 (``model.py``), the target's embedding and lm_head are frozen tensors held
outside the module's parameters, buffers and checkpoints. Init: a pruned drafter's lm_head
rows are the target's lm_head rows of the kept ids (EAGLE-3's init); a full-vocabulary
drafter (``block.target_lm_head``) drafts with the target's lm_head itself and stores no
vocabulary; everything else is PyTorch's default init.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.block_drafter import BlockDrafter, BlockDrafterConfig
from specdec.train.block_attention import PackedBlockAttention
from specdec.train.block_loss import block_objective, sample_anchors
from specdec.train.model import TargetIO
from specdec.train.ttt import PackedBatch, TTTOutput, draft_rows

EVAL_SEED = 0  # held-out batches draw the same anchors at every evaluation


def build_block_drafter(
    target: TargetIO,
    config: BlockDrafterConfig,
    d2t: torch.Tensor | None,  # [draft_vocab] int64; None with a full-vocabulary config
    t2d: torch.Tensor | None,  # [vocab] bool
) -> BlockDrafter:
    """A fresh drafter; a pruned one gets the vocabulary and EAGLE-3's lm_head init."""
    drafter = BlockDrafter(config)
    if config.full_vocab:
        return drafter
    if d2t is None or t2d is None:
        raise ValueError("a pruned block drafter needs its draft vocabulary (d2t, t2d)")
    drafter.set_vocab_map(d2t, t2d)
    kept = torch.arange(d2t.shape[0]) + d2t
    with torch.no_grad():
        drafter.lm_head.weight.copy_(target.lm_head[kept].to(drafter.lm_head.weight.dtype))
    return drafter


class BlockModel(nn.Module):
    """``forward(batch) -> TTTOutput``: anchors drawn (global RNG in training, a fixed
    seed in evaluation), one masked forward, the decayed per-slot loss. ``pad_to`` pads
    every batch to one size for attention that wants static shapes."""

    def __init__(
        self,
        head: BlockDrafter,
        target: TargetIO,
        *,
        attention: PackedBlockAttention,
        anchors: int,
        gamma: float,
        loss: str = "ce",
        lk_eta: float = 3.0,
        argmax_weight: float = 1.0,
        pad_to: int | None = None,
    ) -> None:
        super().__init__()
        self.head = head
        self.anchors, self.gamma = anchors, gamma
        self.loss, self.lk_eta, self.argmax_weight = loss, lk_eta, argmax_weight
        self.pad_to = pad_to
        self.__dict__["attention"] = attention
        self.__dict__["target"] = target  # frozen, unregistered (module docstring)
        self._bind()

    def _bind(self) -> None:
        target: TargetIO = self.__dict__["target"]
        lm_head = target.lm_head if self.head.config.full_vocab else None
        self.head.bind_target(lambda ids: nn.functional.embedding(ids, target.embed), lm_head)

    def place_target(self, device: torch.device, dtype: torch.dtype) -> None:
        target = self.__dict__["target"].to(device, dtype)
        self.__dict__["target"] = target
        self.__dict__["label_weight"] = draft_rows(self.head, target.lm_head)
        self._bind()

    def forward(self, batch: PackedBatch) -> TTTOutput:
        target: TargetIO = self.__dict__["target"]
        if "label_weight" not in self.__dict__:
            raise RuntimeError("BlockModel.place_target(device, dtype) must run first")
        if self.pad_to is not None:
            batch = batch.padded(self.pad_to)
        generator = None
        if not self.training:
            generator = torch.Generator(batch.input_ids.device).manual_seed(EVAL_SEED)
        anchors = sample_anchors(batch, self.anchors, generator)
        return block_objective(
            self.head, batch, anchors, self.__dict__["attention"], target.lm_head,
            self.__dict__["label_weight"], gamma=self.gamma, loss=self.loss,
            lk_eta=self.lk_eta, argmax_weight=self.argmax_weight,
        )  # fmt: skip
