"""What the dump computes where: tokenised conversations packed into shards of bounded
size, and shards packed into forward batches. Pure functions of the input and the
config, so every rank and every rerun derives the same plan.

Invariants: shards and groups are consecutive runs of records in input order; a shard is
at most ``shard_bytes`` unless one conversation alone is larger (then it is alone); a
group is at most ``batch_tokens`` unless one shard alone is larger. Group ``g`` belongs to
rank ``g % world_size`` and so do all of its shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.data_gen.records import SkipCounts

# A record's SpecExit confidence labels (``data-gen exit-labels``), sparse: {"positions":
# [token index into input_ids, ...], "labels": [0..1, ...]} (extra keys, e.g. the probes'
# "answers", are ignored). The dump stores them dense under the same name, NaN elsewhere.
CONFIDENCE_KEY = "spec_exit_confidence"


@dataclass
class TokenRecord:
    """One conversation to dump."""

    id: str
    input_ids: np.ndarray  # [num_tokens] int32
    loss_mask: np.ndarray  # [num_tokens] bool
    confidence: np.ndarray | None = None  # [num_tokens] float32, NaN where unlabelled
    source: str = ""  # the prompt's source (``data-gen prompts`` records it; "": none)

    def confidence_labels(self) -> list[list[float]] | None:
        """The labelled (position, label) pairs, for digests (None: no labels)."""
        if self.confidence is None:
            return None
        positions = np.flatnonzero(~np.isnan(self.confidence))
        return [[int(p), float(self.confidence[p])] for p in positions]


def parse_confidence(value: object, num_tokens: int) -> np.ndarray:
    """A record's sparse ``CONFIDENCE_KEY`` → [num_tokens] float32, NaN where unlabelled.
    Raises ValueError naming what is wrong."""
    if not isinstance(value, dict):
        raise ValueError(f"{CONFIDENCE_KEY} must be an object of positions and labels")
    positions, labels = value.get("positions"), value.get("labels")
    if not isinstance(positions, list) or not isinstance(labels, list):
        raise ValueError(f"{CONFIDENCE_KEY} needs lists 'positions' and 'labels'")
    if len(positions) != len(labels):
        raise ValueError(
            f"{CONFIDENCE_KEY} has {len(positions)} positions but {len(labels)} labels"
        )
    out = np.full(num_tokens, np.nan, dtype=np.float32)
    if not positions:
        return out
    try:
        pos = np.asarray(positions, dtype=np.int64)
        lab = np.asarray(labels, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{CONFIDENCE_KEY} positions must be ints, labels numbers") from None
    if pos.min() < 0 or pos.max() >= num_tokens:
        raise ValueError(f"{CONFIDENCE_KEY} position outside the record's {num_tokens} tokens")
    if not ((lab >= 0) & (lab <= 1)).all():
        raise ValueError(f"{CONFIDENCE_KEY} labels must lie in [0, 1]")
    out[pos] = lab
    return out


@dataclass(frozen=True)
class DumpShard:
    index: int
    start: int  # first record (index into the record list)
    end: int  # one past the last record
    num_tokens: int


@dataclass(frozen=True)
class DumpGroup:
    """Shards computed in one forward pass."""

    index: int
    shards: tuple[DumpShard, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def records(self) -> range:
        return range(self.shards[0].start, self.shards[-1].end)


def parse_token_record(
    obj: dict, vocab_size: int, max_seq_len: int, skipped: SkipCounts
) -> TokenRecord | None:
    """A regenerated record → ``TokenRecord``, or None (counted) when it is unusable:
    malformed, empty, longer than ``max_seq_len``, ids outside the vocabulary, no
    assistant token to learn from, or malformed SpecExit confidence labels."""
    ids, mask = obj.get("input_ids"), obj.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        skipped.add("bad_structure")
        return None
    if not ids:
        skipped.add("empty")
        return None
    if len(ids) > max_seq_len:
        skipped.add("too_long")
        return None
    try:
        arr = np.asarray(ids, dtype=np.int64)
        m = np.asarray(mask, dtype=np.int64)
    except (TypeError, ValueError):
        skipped.add("bad_structure")
        return None
    if arr.ndim != 1 or m.ndim != 1 or arr.min() < 0 or arr.max() >= vocab_size:
        skipped.add("bad_token_ids")
        return None
    if not m.any():
        skipped.add("no_loss_tokens")
        return None
    confidence = None
    if obj.get(CONFIDENCE_KEY) is not None:
        try:
            confidence = parse_confidence(obj[CONFIDENCE_KEY], len(arr))
        except ValueError:
            skipped.add("bad_spec_exit_confidence")
            return None
    return TokenRecord(
        str(obj.get("id", "")), arr.astype(np.int32), m.astype(bool), confidence,
        source=str(obj.get("source") or ""),
    )  # fmt: skip


def plan_shards(lengths: list[int], bytes_per_token: int, shard_bytes: int) -> list[DumpShard]:
    shards: list[DumpShard] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (tokens + n) * bytes_per_token > shard_bytes:
            shards.append(DumpShard(len(shards), start, i, tokens))
            start, tokens = i, 0
        tokens += n
    if len(lengths) > start:
        shards.append(DumpShard(len(shards), start, len(lengths), tokens))
    return shards


def plan_groups(shards: list[DumpShard], batch_tokens: int) -> list[DumpGroup]:
    groups: list[DumpGroup] = []
    current: list[DumpShard] = []
    for shard in shards:
        if current and sum(s.num_tokens for s in current) + shard.num_tokens > batch_tokens:
            groups.append(DumpGroup(len(groups), tuple(current)))
            current = []
        current.append(shard)
    if current:
        groups.append(DumpGroup(len(groups), tuple(current)))
    return groups
