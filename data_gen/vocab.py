"""Stage 4, ``data-gen vocab``: the draft vocabulary, from how often the target emits each
token (loss-masked tokens only: what the head learns to predict).

Conventions (docs/DESIGN.md): kept ids = the ``draft_vocab_size`` most frequent target
ids (ties to the lower id), padded with the lowest unused ids when fewer distinct ids
appear, sorted ascending. ``d2t[i]`` (int64) is an offset: ``target_id = i + d2t[i]``;
``t2d`` (bool, target vocab) marks the kept ids. Round trip: for every draft id ``i``,
``t2d[i + d2t[i]]`` holds and the kept ids, in draft-id order, are strictly increasing.

Output: ``vocab.safetensors`` with ``d2t``, ``t2d`` and ``token_counts`` (int64, target
vocab); metadata (one JSON string under ``specdec``) records the sizes and how many loss
tokens the kept ids cover.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors
from tqdm.auto import tqdm

from specdec.data_gen.records import SkipCounts
from specdec.data_gen.shards import atomic_write_bytes, load_manifest
from specdec.data_gen.sources import iter_jsonl

VOCAB_FILE = "vocab.safetensors"


@dataclass(frozen=True)
class VocabConfig:
    """``inputs``: regenerate or dump directories (their manifests list the shards), whose
    loss tokens are counted together: e.g. a mix's answers and the long documents' ones."""

    inputs: tuple[str, ...]
    output: str
    draft_vocab_size: int = 32000
    target_vocab_size: int | None = None  # default: the dump manifest's, else the model's
    model: str = "smollm2-135m-instruct"

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str) or not self.inputs:
            raise ValueError(f"inputs={self.inputs!r} must be a non-empty tuple of directories")
        if self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be >= 1")


def count_tokens(root: str | Path, vocab_size: int) -> np.ndarray:
    """[vocab_size] int64 counts of loss-masked token ids over a stage directory."""
    root = Path(root)
    manifest = load_manifest(root)
    counts = np.zeros(vocab_size, dtype=np.int64)
    skipped = SkipCounts()
    for shard in tqdm(manifest["shards"], desc="vocab", unit="shard"):
        path = root / shard["file"]
        if path.suffix == ".safetensors":
            with safe_open(path, "pt") as f:
                ids = f.get_tensor("input_ids").numpy()
                mask = f.get_tensor("loss_mask").numpy().astype(bool)
            _add(counts, ids[mask], path)
            continue
        for _, obj in iter_jsonl(path, skipped):
            ids, mask = obj.get("input_ids"), obj.get("loss_mask")
            if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
                skipped.add("bad_structure")
                continue
            arr = np.asarray(ids, dtype=np.int64)[np.asarray(mask, dtype=bool)]
            _add(counts, arr, path)
    return counts


def _add(counts: np.ndarray, ids: np.ndarray, path: Path) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= counts.shape[0]):
        raise ValueError(
            f"{path} holds token id {int(ids.max())} outside the target vocabulary of "
            f"{counts.shape[0]}; pass the target's --model (or --target-vocab-size)"
        )
    counts += np.bincount(ids, minlength=counts.shape[0])


def build_vocab_map(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(d2t, t2d)`` from [target_vocab] counts (module docstring)."""
    vocab = counts.shape[0]
    if draft_vocab_size > vocab:
        raise ValueError(
            f"draft_vocab_size={draft_vocab_size} exceeds the target vocabulary of {vocab}"
        )
    # Stable sort on -count: equal counts keep id order, so ties go to the lower id, and
    # ids that never appear (count 0) come last in ascending order: the padding.
    order = np.argsort(-counts, kind="stable")
    kept = np.sort(order[:draft_vocab_size])
    d2t = (kept - np.arange(draft_vocab_size)).astype(np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[kept] = True
    return d2t, t2d


COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32000, 65536)


def coverage_by_size(counts: np.ndarray) -> dict[str, float]:
    """Share of loss tokens a draft vocabulary of the ``COVERAGE_SIZES`` most frequent
    tokens covers (sizes below the target vocabulary; keys are strings for JSON)."""
    total = int(counts.sum())
    if not total:
        return {}
    cumulative = np.cumsum(np.sort(counts)[::-1])  # [vocab]
    return {str(n): float(cumulative[n - 1] / total) for n in COVERAGE_SIZES if n < counts.shape[0]}


def run_vocab(config: VocabConfig) -> dict:
    """Count, build and save ``vocab.safetensors`` atomically; returns its metadata."""
    vocab_size = config.target_vocab_size
    if vocab_size is None:  # a dump's manifest records it; regenerate's do not
        recorded = {load_manifest(d).get("vocab_size") for d in config.inputs} - {None}
        if len(recorded) > 1:
            raise ValueError(
                f"the inputs' manifests record different vocabulary sizes {sorted(recorded)}: "
                "they come from different targets; pass one target's directories"
            )
        vocab_size = recorded.pop() if recorded else None
    if vocab_size is None:
        from specdec.models import load_config

        vocab_size = load_config(config.model).vocab_size
    counts = sum(count_tokens(d, vocab_size) for d in config.inputs)
    d2t, t2d = build_vocab_map(counts, config.draft_vocab_size)
    total = int(counts.sum())
    meta = {
        "inputs": list(config.inputs),
        "draft_vocab_size": config.draft_vocab_size,
        "target_vocab_size": vocab_size,
        "loss_tokens": total,
        "distinct_tokens": int((counts > 0).sum()),
        "coverage": float(counts[t2d].sum() / total) if total else 0.0,
        # What other sizes would cover: the figure the draft vocabulary size is chosen by.
        "coverage_by_size": coverage_by_size(counts),
    }
    tensors = {
        "d2t": torch.from_numpy(d2t),
        "t2d": torch.from_numpy(t2d),
        "token_counts": torch.from_numpy(counts),
    }
    # One metadata key: safetensors writes its metadata map in (per-process) hash order.
    data = save_safetensors(tensors, metadata={"specdec": json.dumps(meta, sort_keys=True)})
    out = Path(config.output)
    path = out / VOCAB_FILE if out.suffix != ".safetensors" else out
    atomic_write_bytes(path, data)
    return {**meta, "path": str(path)}
