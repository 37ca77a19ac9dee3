"""Prompt sources: JSONL files (ShareGPT, OpenAI messages, or ``{"prompt": ...}``), Hugging
Face ``datasets`` (hub name or local path), and stage directories written by ``data-gen``.

Every reader yields ``Conversation``s in a fixed order (file order; ids default to
``<file>:<line>``) and counts what it skips instead of failing: a broken JSON line, a record
without a user message, an unknown speaker. Source specs, as the CLI takes them:

- ``path/to/file.jsonl`` (or ``.jsonl.gz``): one record per line;
- ``path/to/stage_dir``: the shards listed in its manifest.json (prompts or regenerate);
- ``hf:NAME[:SPLIT]`` or ``hf:/local/path[:SPLIT]``: a ``datasets`` dataset (optional
  dependency, imported only here), records in the same shapes as JSONL.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specdec.data_gen.records import BadRecord, Conversation, SkipCounts, parse_conversation
from specdec.data_gen.shards import MANIFEST, load_manifest


def iter_jsonl(path: Path, skipped: SkipCounts) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every parseable line; blank and broken lines counted."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                skipped.add("empty")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                skipped.add("bad_json")
                continue
            if not isinstance(obj, dict):
                skipped.add("bad_structure")
                continue
            yield n, obj


def read_jsonl_conversations(path: str | Path, skipped: SkipCounts) -> Iterator[Conversation]:
    path = Path(path)
    for n, obj in iter_jsonl(path, skipped):
        try:
            yield parse_conversation(obj, f"{path.name}:{n}", source=path.stem)
        except BadRecord as e:
            skipped.add(e.reason)


def read_stage_records(root: str | Path, skipped: SkipCounts) -> Iterator[dict]:
    """The raw records of a stage directory's JSONL shards, in shard order."""
    root = Path(root)
    for shard in load_manifest(root)["shards"]:
        if not shard["file"].endswith(".jsonl"):
            raise ValueError(
                f"{root} holds {shard['file']}, not JSONL records; pass a prompts or "
                "regenerate directory"
            )
        for _, obj in iter_jsonl(root / shard["file"], skipped):
            yield obj


def read_hf_conversations(spec: str, skipped: SkipCounts) -> Iterator[Conversation]:
    """``NAME[:SPLIT]`` (default split ``train``) through ``datasets.load_dataset`` (a hub
    name or a local dataset directory / data file)."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"reading {spec!r} needs the `datasets` package: pip install 'specdec[data]'"
        ) from None
    name, _, split = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    split = split or "train"
    path = Path(name)
    if path.is_dir() and (path / "dataset_info.json").is_file():
        ds = datasets.load_from_disk(str(path))
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    elif path.is_file():
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
        if path.suffix not in kind:
            raise ValueError(f"{spec!r}: unknown data file type {path.suffix!r}")
        ds = datasets.load_dataset(kind[path.suffix], data_files=str(path), split="train")
    else:
        ds = datasets.load_dataset(name, split=split)
    label = path.name if path.exists() else name
    for i, row in enumerate(ds):
        try:
            yield parse_conversation(_plain(row), f"{label}:{i}", source=label)
        except BadRecord as e:
            skipped.add(e.reason)


def _plain(row: Any) -> Any:
    # Arrow rows can carry unused null columns (e.g. "prompt": None next to
    # "conversations"): drop them so the record's real shape decides.
    return {k: v for k, v in row.items() if v is not None} if isinstance(row, dict) else row


def read_source(spec: str, skipped: SkipCounts) -> Iterator[Conversation]:
    """Conversations from a source spec (module docstring)."""
    if spec.startswith("hf:"):
        yield from read_hf_conversations(spec[3:], skipped)
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / MANIFEST).is_file():
            raise FileNotFoundError(
                f"{spec} is a directory without {MANIFEST}; pass a JSONL file, a completed "
                "data-gen stage directory, or hf:NAME for a datasets dataset"
            )
        for obj in read_stage_records(path, skipped):
            try:
                yield parse_conversation(obj, obj.get("id", ""))
            except BadRecord as e:
                skipped.add(e.reason)
        return
    if path.is_file():
        yield from read_jsonl_conversations(path, skipped)
        return
    raise FileNotFoundError(
        f"prompt source {spec!r} does not exist; pass a .jsonl file, a data-gen stage "
        "directory, hf:NAME[:SPLIT], or one of the built-in sources (see `specdec data-gen "
        "prompts --help`)"
    )
