"""Supervised fine-tuning data: chat records -> packed micro-batches with next-token
labels on assistant tokens only.

Records are JSONL chats (``conversations`` or ``messages``), typically from ``specdec
data-gen reasoning-traces``; stored ``input_ids`` + ``loss_mask`` are used as they are
(after checking that the base model's tokenizer reproduces the first record of each file),
others are tokenised with ``data_gen.chat.tokenize_conversation``. The order is
``train.data``'s: a pure function of (seed, epoch), records shuffled per epoch and packed
greedily into micro-batches of at most ``max_tokens`` tokens, so a resumed run sees the
batches an uninterrupted one does (``train.data.Schedule``).

Labels (``shift_labels``): position ``t`` of a sequence learns token ``t + 1`` iff that
token is an assistant token (``loss_mask[t + 1]``); the system prompt, user turns and
chat headers are context only, and no position learns across a sequence boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from specdec.data_gen.chat import tokenize_conversation
from specdec.data_gen.records import BadRecord, SkipCounts, parse_conversation
from specdec.data_gen.sources import iter_jsonl
from specdec.train.data import BatchRef, clip, evenly_spaced, pack, shuffled

IGNORE = -100  # the label of a position without loss (torch's cross_entropy default)


def shift_labels(
    input_ids: np.ndarray,  # [n] one sequence
    loss_mask: np.ndarray,  # [n] 1 on assistant tokens
) -> np.ndarray:  # [n] int64: the next token where it is an assistant token, else IGNORE
    labels = np.full(len(input_ids), IGNORE, dtype=np.int64)
    keep = loss_mask[1:].astype(bool)
    labels[:-1][keep] = input_ids[1:][keep]
    return labels


@dataclass
class SFTBatch:
    """One micro-batch of packed sequences. ``loss_index`` (host-computed) lists the
    positions with a label, so the loss touches no other logits and needs no sync."""

    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64: index within its sequence (the RoPE position)
    labels: torch.Tensor  # [n] int64: next assistant token, or IGNORE
    loss_index: torch.Tensor  # [m] int64: positions whose label is not IGNORE
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32
    lengths: list[int]  # host copy of the sequence lengths

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> SFTBatch:
        moved = (self.input_ids, self.positions, self.labels, self.loss_index, self.cu_seqlens)
        return SFTBatch(*(t.to(device, non_blocking=True) for t in moved), self.lengths)


def assemble(seqs: list[tuple[np.ndarray, np.ndarray]]) -> SFTBatch:
    """Pack (ids, loss_mask) sequences back to back."""
    lengths = [len(ids) for ids, _ in seqs]
    ids = np.concatenate([s[0] for s in seqs]).astype(np.int64)
    labels = np.concatenate([shift_labels(i, m) for i, m in seqs])
    return SFTBatch(
        input_ids=torch.from_numpy(ids),
        positions=torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])),
        labels=torch.from_numpy(labels),
        loss_index=torch.from_numpy(np.flatnonzero(labels != IGNORE)),
        cu_seqlens=torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32),
        lengths=lengths,
    )


def read_chat_records(
    path: str | Path, tokenizer, vocab_size: int, limit: int | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids int32, loss_mask uint8) of the records of a JSONL file (``.jsonl.gz``
    too); a broken line, a record without assistant tokens or an id outside the
    vocabulary raises, naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"SFT records {path} do not exist; write them with `specdec "
            "data-gen reasoning-traces --out FILE`"
        )
    out: list[tuple[np.ndarray, np.ndarray]] = []
    skipped = SkipCounts()
    lines = iter_jsonl(path, skipped)
    for n, obj in tqdm(lines, desc=f"read {path.name}", unit="rec"):
        if limit is not None and len(out) >= limit:
            break
        where = f"{path}:{n}"
        try:
            messages = list(parse_conversation(obj, where).messages)
        except BadRecord as e:
            raise ValueError(f"{where}: {e}") from None
        if "input_ids" in obj and out:
            ids, mask = obj["input_ids"], obj["loss_mask"]
        else:  # tokenise (and, for a record that stores tokens, check they agree)
            tok = tokenize_conversation(tokenizer, messages)
            ids, mask = tok.input_ids, tok.loss_mask
            if "input_ids" in obj and (obj["input_ids"], obj["loss_mask"]) != (ids, mask):
                raise ValueError(
                    f"{where}: the stored input_ids were made by another tokenizer than "
                    "model.base's; regenerate the records with --model set to model.base"
                )
        if len(ids) != len(mask) or not any(mask):
            raise ValueError(
                f"{where}: no assistant tokens to learn (or a loss_mask of "
                "another length than input_ids)"
            )
        if max(ids) >= vocab_size:
            raise ValueError(f"{where}: token id {max(ids)} >= vocab size {vocab_size}")
        out.append((np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
    broken = {k: v for k, v in skipped.counts.items() if k != "empty"}
    if broken:
        raise ValueError(f"{path}: unreadable lines {broken}; the file is damaged")
    if not out:
        raise ValueError(f"{path} holds no records")
    return out


def spread(records: list, n: int) -> list:
    """``n`` records evenly spaced over ``records`` (all when there are fewer): a traces
    file is written task by task, so its first ``n`` would cover only the first tasks."""
    return [records[i] for i in evenly_spaced(len(records), n)]


class ChatRecords:
    """The ``Source`` ``train.data.Schedule`` plays for SFT: train records (unit 0) in a
    shuffled order per epoch, eval records (unit 1) in file order."""

    def __init__(
        self,
        train: list[tuple[np.ndarray, np.ndarray]],
        eval: list[tuple[np.ndarray, np.ndarray]],
        *,
        max_tokens: int,
        max_seq_len: int,
        seed: int,
    ) -> None:
        self.units = (train, eval)
        self.max_tokens, self.max_seq_len, self.seed = max_tokens, max_seq_len, seed

    def epoch_plan(self, epoch: int) -> list[BatchRef]:
        train = self.units[0]
        order = shuffled(len(train), self.seed, epoch)
        refs = pack([(0, [len(train[i][0]) for i in order])], self.max_tokens, self.max_seq_len)
        return [
            BatchRef(tuple((0, order[r]) for _, r in ref.items), ref.num_tokens) for ref in refs
        ]

    def eval_plan(self) -> list[BatchRef]:
        lengths = [len(ids) for ids, _ in self.units[1]]
        return pack([(1, lengths)], self.max_tokens, self.max_seq_len) if lengths else []

    def load(self, ref: BatchRef) -> SFTBatch:
        seqs = []
        for unit, i in ref.items:
            ids, mask = self.units[unit][i]
            n = clip(len(ids), self.max_tokens, self.max_seq_len)
            seqs.append((ids[:n], mask[:n]))
        return assemble(seqs)
