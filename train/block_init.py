"""The shape of a block drafter run (``model.drafter=block``) and continuing a trained
drafter (``model.init_head``).

A run's drafter takes each shape setting from the config when it is set, else from
``model.init_head`` when there is one, else the defaults. A trained drafter's weights fix
what it reads and writes, so an explicit setting that disagrees with the head (block size,
mask token, aux layers, full vocabulary or not) is an error naming the value and the fix;
only ``model.num_layers`` and ``model.intermediate_size`` may exceed the head's (it is
deepened or widened exactly, ``train/model.py``), and ``model.vocab`` moves its lm_head
rows to another draft vocabulary by target token (``carry_vocab_rows``).

The head is read in float32 whatever its files store (a bf16 head continues with fp32
master weights); the optimizer and schedule start fresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.models.block_drafter import BlockDrafter
from specdec.train.config import TrainConfig
from specdec.train.model import VOCAB_KEYS, TargetIO, carry_init_rows, init_head_state

DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_LAYERS = 2


@dataclass(frozen=True)
class BlockShape:
    """The settings a block drafter run trains with, config and init head reconciled."""

    block_size: int
    num_layers: int
    intermediate_size: int | None  # None: the target's
    mask_token_id: int | None  # None: resolved from the target's tokenizer


def read_init_drafter(directory: str | Path, target: TargetIO) -> BlockDrafter:
    """The trained drafter in ``directory`` (either block layout), in float32 on the CPU."""
    from specdec.models.block_drafter_formats import is_block_drafter, load_block_drafter

    if not is_block_drafter(directory):
        raise ValueError(
            f"model.init_head={str(directory)!r} is not a block drafter directory (its "
            "config.json does not name DFlashDraftModel); pass the head directory a "
            "model.drafter=block run wrote (<output_dir>/head)"
        )
    return load_block_drafter(directory, target_config=target.config, dtype=torch.float32)


def init_aux_layer_ids(config: TrainConfig, target: TargetIO) -> tuple[int, ...] | None:
    """The aux layers ``model.init_head`` reads, for a block drafter run continuing one
    (what an online run computes unless ``model.aux_layer_ids`` says otherwise); else None."""
    if config.model.drafter != "block" or not config.model.init_head:
        return None
    from specdec.models.block_drafter_formats import read_block_config

    return read_block_config(config.model.init_head, target.config).aux_layer_ids


def block_shape(config: TrainConfig, init: BlockDrafter | None) -> BlockShape:
    """The run's shape: each setting from the config, else from ``init``, else the default;
    with ``init``, an explicit block size or mask token that differs from its own raises."""
    cfg, model = config.block, config.model
    if init is None:
        return BlockShape(cfg.block_size or DEFAULT_BLOCK_SIZE,
                          model.num_layers or DEFAULT_NUM_LAYERS, model.intermediate_size,
                          cfg.mask_token_id)  # fmt: skip
    have = init.config
    for key, value, own in (("block_size", cfg.block_size, have.block_size),
                            ("mask_token_id", cfg.mask_token_id, have.mask_token_id)):  # fmt: skip
        if value not in (None, own):
            raise ValueError(
                f"block.{key}={value} but model.init_head was trained with {key} {own}; set "
                f"block.{key}={own} or null (the head's) to continue it"
            )
    return BlockShape(have.block_size, model.num_layers or have.num_layers,
                      model.intermediate_size or have.intermediate_size,
                      have.mask_token_id)  # fmt: skip


def check_init_drafter(config: TrainConfig, init: BlockDrafter, aux_ids: tuple[int, ...]) -> None:
    """Refuse a run that cannot continue ``init``: other aux layers than the data's, or a
    full-vocabulary drafter where the run trains a pruned one (or the reverse)."""
    have = init.config
    if tuple(have.aux_layer_ids) != tuple(aux_ids):
        raise ValueError(
            f"model.init_head reads aux layers {list(have.aux_layer_ids)} but the run trains "
            f"on {list(aux_ids)}; train it on data with its layers (model.aux_layer_ids="
            f"{list(have.aux_layer_ids)} online, a dump of them offline)"
        )
    full = config.block.target_lm_head
    if have.full_vocab != full:
        kind = "the target's whole vocabulary" if have.full_vocab else "a pruned vocabulary"
        raise ValueError(
            f"block.target_lm_head={str(full).lower()} but model.init_head drafts over "
            f"{kind}; set block.target_lm_head={str(have.full_vocab).lower()} to continue it"
        )
    if full and config.model.vocab:
        raise ValueError(
            f"model.vocab={config.model.vocab!r} moves a head's lm_head rows to another draft "
            "vocabulary; model.init_head drafts with the target's lm_head (block."
            "target_lm_head) and has none: drop model.vocab"
        )


def continue_from(drafter: BlockDrafter, init: BlockDrafter) -> None:
    """Load ``init``'s weights into the fresh ``drafter`` (built with the run's shape and
    vocabulary), cast to its dtype: deepened and widened where the run asks for more, lm_head
    rows carried by target token where the run drafts another vocabulary."""
    state, rows = init_head_state(drafter, init)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    lacking = [k for k in missing if rows is None or k not in VOCAB_KEYS]
    if lacking or unexpected:
        raise ValueError(
            f"model.init_head lacks {lacking} and has extra {unexpected}; it is not a "
            "drafter for this run"
        )
    if rows is not None:
        carry_init_rows(drafter, init, rows)
