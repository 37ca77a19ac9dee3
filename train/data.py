"""Training data: packed micro-batches in a deterministic order, offline or online.

The order is a pure function of (seed, epoch): shards (offline) or records (online) are
shuffled per epoch, then whole sequences are packed greedily into micro-batches of at most
``max_tokens`` tokens. The run's position is the number of micro-batches consumed over all
epochs; micro-batch ``k`` goes to rank ``k % world_size``. So a resumed run sees exactly
the batches an uninterrupted one would, on any number of processes with the same world
size.

- ``OfflineShards`` streams data_gen dump shards (``hidden-*.safetensors``) one at a time:
  an epoch's plan needs only each shard's ``cu_seqlens``; tensors are read when a batch
  needs them (a background thread reads ahead), checksummed against the manifest.
- ``OnlineRecords`` keeps only token ids (data_gen's regenerate records) and runs the
  target inside the loop to get the aux and final hidden states of each micro-batch.

With a ``labeler`` (``spec_exit_labels.ExitLabeler``) each batch also carries SpecExit
labels (``PackedBatch.exit_targets``) from its sequences' think spans. Confidence labels
come from ``data-gen exit-labels`` records (``spec_exit_confidence``: positions and labels):
offline, the dump stores them as a ``spec_exit_confidence`` [n] float32 shard tensor (NaN:
none); online, ``load_records`` reads them from the records themselves. Either way the
same parser (``dump_plan.parse_confidence``) turns them into one value per token.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from specdec.data_gen.dump_plan import CONFIDENCE_KEY
from specdec.train.spec_exit_labels import ExitLabeler
from specdec.train.ttt import PackedBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchRef:
    """Which sequences make one micro-batch: (unit index, record index) pairs, where a
    unit is a shard (offline) or the record list (online, unit 0)."""

    items: tuple[tuple[int, int], ...]
    num_tokens: int


class Source(Protocol):
    aux_layer_ids: tuple[int, ...]
    target: str

    def epoch_plan(self, epoch: int) -> list[BatchRef]: ...
    def eval_plan(self) -> list[BatchRef]: ...
    def load(self, ref: BatchRef) -> PackedBatch: ...


def pack(units: list[tuple[int, list[int]]], max_tokens: int, max_seq_len: int) -> list[BatchRef]:
    """Greedy packing in the given order: ``units`` = [(unit, [length of each record])].
    Records longer than the limits are cut (see ``clip``)."""
    refs: list[BatchRef] = []
    items: list[tuple[int, int]] = []
    tokens = 0
    for unit, lengths in units:
        for record, length in enumerate(lengths):
            n = clip(length, max_tokens, max_seq_len)
            if n < 2:  # nothing to predict
                continue
            if tokens + n > max_tokens and items:
                refs.append(BatchRef(tuple(items), tokens))
                items, tokens = [], 0
            items.append((unit, record))
            tokens += n
    if items:
        refs.append(BatchRef(tuple(items), tokens))
    return refs


def clip(length: int, max_tokens: int, max_seq_len: int) -> int:
    return min(length, max_tokens, max_seq_len)


def evenly_spaced(n: int, k: int) -> list[int]:
    """``min(k, n)`` distinct indices spread evenly over ``range(n)``, ascending: files are
    often written in groups (a traces file task by task, and a regenerate output keeps its
    input's order), so the first or last ``k`` would cover one group."""
    if k >= n:
        return list(range(n))
    if k <= 0:
        return []
    return sorted(set(np.linspace(0, n - 1, k).round().astype(int).tolist()))


def shuffled(n: int, seed: int, epoch: int, salt: int = 0) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}/{epoch}/{salt}").shuffle(order)  # str seeds: same in every process
    return order


class Schedule:
    """Micro-batch ``k`` of the run (all epochs back to back) for a source's plans."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._plans: dict[int, list[BatchRef]] = {}  # the current epoch's plan only
        self._sizes: list[int] = []  # micro-batches per epoch, for the epochs planned so far

    def _plan(self, epoch: int) -> list[BatchRef]:
        if epoch not in self._plans:
            self._plans = {epoch: self.source.epoch_plan(epoch)}
            if not self._plans[epoch]:
                raise ValueError("the training split holds no sequence of >= 2 tokens")
            if epoch == len(self._sizes):
                self._sizes.append(len(self._plans[epoch]))
        return self._plans[epoch]

    def locate(self, k: int) -> tuple[int, int]:
        """(epoch, index in that epoch's plan) of micro-batch ``k``. Earlier epochs are
        skipped by their recorded sizes, so only a new epoch builds a plan."""
        epoch = 0
        while True:
            if epoch == len(self._sizes):
                self._plan(epoch)
            if k < self._sizes[epoch]:
                return epoch, k
            k -= self._sizes[epoch]
            epoch += 1

    def iterate(self, start: int, rank: int, world: int) -> Iterator[tuple[int, PackedBatch]]:
        """(k, batch) for micro-batches k >= start with k % world == rank, forever; loads
        run one batch ahead on a thread."""
        k = start + (rank - start) % world
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            future = pool.submit(self._load, k)
            while True:
                batch = future.result()
                future = pool.submit(self._load, k + world)
                yield k, batch
                k += world
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _load(self, k: int) -> PackedBatch:
        epoch, i = self.locate(k)
        return self.source.load(self._plan(epoch)[i])


def assemble(
    parts: list[tuple[np.ndarray, np.ndarray, torch.Tensor | None, torch.Tensor | None]],
) -> PackedBatch:
    """Concatenate (ids, loss_mask, aux, hidden) per sequence into one packed batch."""
    lengths = [len(ids) for ids, *_ in parts]
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    return PackedBatch(
        input_ids=torch.from_numpy(np.concatenate([p[0] for p in parts]).astype(np.int64)),
        loss_mask=torch.from_numpy(np.concatenate([p[1] for p in parts]).astype(bool)),
        aux_hidden=torch.cat([p[2] for p in parts]) if parts[0][2] is not None else None,
        target_hidden=torch.cat([p[3] for p in parts]) if parts[0][3] is not None else None,
        cu_seqlens=cu,
    )


def _with_exit_targets(
    batch: PackedBatch, labeler: ExitLabeler | None, confidence: np.ndarray | None = None
) -> PackedBatch:
    if labeler is not None:
        targets = labeler.targets(batch.input_ids.numpy(), batch.cu_seqlens.numpy(), confidence)
        batch.exit_targets = torch.from_numpy(targets)
    return batch


class OfflineShards:
    """data_gen dump shards (see ``specdec.data_gen.dump``), streamed."""

    def __init__(self, root: str | Path, *, max_tokens: int, max_seq_len: int,
                 eval_shards: int, seed: int, verify: bool = True,
                 labeler: ExitLabeler | None = None) -> None:  # fmt: skip
        from specdec.data_gen.shards import load_manifest

        self.root = Path(root)
        manifest = load_manifest(self.root)
        if manifest.get("stage") != "dump":
            raise ValueError(
                f"{root} holds a data_gen {manifest.get('stage')!r} stage; offline training "
                "reads the dump stage (`specdec data-gen dump`), or set data.mode=online"
            )
        self.manifest = manifest
        self.target: str = manifest["target"]
        self.aux_layer_ids = tuple(manifest["aux_layer_ids"])
        self.hidden_size: int = manifest["hidden_size"]
        shards = manifest["shards"]
        if eval_shards >= len(shards):
            raise ValueError(
                f"data.eval_shards={eval_shards} leaves no training shard of {len(shards)}; "
                "lower it or dump more data"
            )
        cut = len(shards) - eval_shards
        self.train_shards, self.eval_shards = shards[:cut], shards[cut:]
        self.max_tokens, self.max_seq_len, self.seed = max_tokens, max_seq_len, seed
        self.verify = verify
        self.labeler = labeler
        self._lengths: dict[str, list[int]] = {}
        self._cache: tuple[str, dict[str, torch.Tensor]] | None = None

    def _shard(self, split: str, unit: int) -> dict[str, Any]:
        return (self.train_shards if split == "train" else self.eval_shards)[unit]

    def lengths(self, shard: dict[str, Any]) -> list[int]:
        name = shard["file"]
        if name not in self._lengths:
            with safe_open(str(self.root / name), framework="pt") as f:
                cu = f.get_tensor("cu_seqlens")
            self._lengths[name] = (cu[1:] - cu[:-1]).tolist()
        return self._lengths[name]

    def epoch_plan(self, epoch: int) -> list[BatchRef]:
        units = []
        for unit in shuffled(len(self.train_shards), self.seed, epoch):
            lengths = self.lengths(self.train_shards[unit])
            order = shuffled(len(lengths), self.seed, epoch, salt=unit + 1)
            units.append((unit, [lengths[r] for r in order], order))
        refs = pack([(u, ls) for u, ls, _ in units], self.max_tokens, self.max_seq_len)
        # pack() numbered records by their shuffled position; map back to shard records.
        orders = {u: order for u, _, order in units}
        return [
            BatchRef(tuple((u, orders[u][r]) for u, r in ref.items), ref.num_tokens) for ref in refs
        ]

    def eval_plan(self) -> list[BatchRef]:
        # Eval units are numbered after the training shards.
        base = len(self.train_shards)
        units = [(base + i, self.lengths(s)) for i, s in enumerate(self.eval_shards)]
        return pack(units, self.max_tokens, self.max_seq_len)

    def _tensors(self, unit: int) -> dict[str, torch.Tensor]:
        shard = (self.train_shards + self.eval_shards)[unit]
        # Read the attribute once: the prefetch thread and an evaluation may both load.
        cached = self._cache
        if cached is None or cached[0] != shard["file"]:
            data = (self.root / shard["file"]).read_bytes()
            if self.verify and hashlib.sha256(data).hexdigest() != shard["sha256"]:
                raise ValueError(
                    f"{self.root / shard['file']} does not match its manifest checksum; "
                    "rerun `specdec data-gen dump` on the same output to redo it"
                )
            cached = (shard["file"], load_safetensors(data))
            self._cache = cached
        return cached[1]

    def load(self, ref: BatchRef) -> PackedBatch:
        parts, confidence = [], []
        for unit, record in ref.items:
            t = self._tensors(unit)
            lo, hi = int(t["cu_seqlens"][record]), int(t["cu_seqlens"][record + 1])
            hi = lo + clip(hi - lo, self.max_tokens, self.max_seq_len)
            parts.append((
                t["input_ids"][lo:hi].numpy(), t["loss_mask"][lo:hi].numpy(),
                t["aux_hidden_states"][lo:hi], t["hidden_states"][lo:hi],
            ))  # fmt: skip
            if self.labeler is not None:  # confidence only feeds SpecExit labels
                conf = t.get(CONFIDENCE_KEY)
                confidence.append(
                    conf[lo:hi].float().numpy() if conf is not None else np.full(hi - lo, np.nan)
                )
        conf_all = np.concatenate(confidence).astype(np.float32) if confidence else None
        return _with_exit_targets(assemble(parts), self.labeler, conf_all)


class OnlineRecords:
    """data_gen regenerate records (token ids + loss mask) of one or more directories,
    concatenated in order; the target computes the aux and final hidden states of each
    micro-batch inside the training loop."""

    def __init__(self, roots: str | Path | tuple[str | Path, ...], target_forward, *,
                 max_tokens: int, max_seq_len: int, eval_records: int, seed: int, vocab_size: int,
                 labeler: ExitLabeler | None = None) -> None:  # fmt: skip
        from specdec.data_gen.dump import load_records
        from specdec.data_gen.records import SkipCounts

        roots = (roots,) if isinstance(roots, str | Path) else roots
        records = []
        for root in roots:
            skipped = SkipCounts()
            found = load_records(str(root), vocab_size, max_seq_len, skipped)
            if not found:
                raise ValueError(f"{root} holds no usable token records ({skipped.as_dict()})")
            if skipped.as_dict():
                logger.info("%s: %d records, skipped %s", root, len(found), skipped.as_dict())
            records += found
        self.forward = target_forward
        self.target = target_forward.model_name
        self.aux_layer_ids = tuple(target_forward.aux_layer_ids)
        if len(records) - eval_records < 1:
            raise ValueError(
                f"data.eval_records={eval_records} leaves none of {len(records)} records for "
                "training; lower it"
            )
        held = evenly_spaced(len(records), eval_records)
        self.eval = [records[i] for i in held]
        held_set = set(held)  # once: the membership test runs for every record
        self.train = [r for i, r in enumerate(records) if i not in held_set]
        self.max_tokens, self.max_seq_len, self.seed = max_tokens, max_seq_len, seed
        self.labeler = labeler
        self._lock = threading.Lock()

    def epoch_plan(self, epoch: int) -> list[BatchRef]:
        order = shuffled(len(self.train), self.seed, epoch)
        refs = pack([(0, [len(self.train[i].input_ids) for i in order])], self.max_tokens,
                    self.max_seq_len)  # fmt: skip
        return [BatchRef(tuple((0, order[r]) for _, r in ref.items), ref.num_tokens)
                for ref in refs]  # fmt: skip

    def eval_plan(self) -> list[BatchRef]:
        return pack([(1, [len(r.input_ids) for r in self.eval])], self.max_tokens, self.max_seq_len)

    def load(self, ref: BatchRef) -> PackedBatch:
        recs = [(self.train if unit == 0 else self.eval)[i] for unit, i in ref.items]
        parts, confidence = [], []
        for r in recs:
            n = clip(len(r.input_ids), self.max_tokens, self.max_seq_len)
            parts.append((r.input_ids[:n], r.loss_mask[:n], None, None))
            if self.labeler is not None:  # confidence only feeds SpecExit labels
                confidence.append(
                    r.confidence[:n] if r.confidence is not None else np.full(n, np.nan, np.float32)
                )
        batch = assemble(parts)
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).numpy()
        with self._lock:  # one scratch KV cache: the prefetch thread and evaluation take turns
            hidden, aux = self.forward(batch.input_ids.numpy(), lengths)
        # Outputs of an inference-mode forward cannot be saved for backward: copy them.
        batch.aux_hidden, batch.target_hidden = aux.clone(), hidden.clone()
        conf_all = np.concatenate(confidence) if confidence else None
        return _with_exit_targets(batch, self.labeler, conf_all)
