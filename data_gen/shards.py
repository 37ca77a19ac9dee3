"""Crash-safe sharded output shared by every stage: atomic shard writes, completion
markers with checksums, deterministic shard ownership by rank, and the manifest merge.

Layout of a stage directory::

    manifest.json            written once every shard is complete (any rank may write it)
    <prefix>-00000.<ext>     the shards
    progress/<prefix>-00000.json   completion marker: sha256, size, counts, input digest

Invariants:

- A shard file appears only whole: it is written to a temporary name, fsynced and renamed
  (rename is atomic on POSIX), so a SIGKILL leaves at most an orphan ``*.tmp-*`` file.
- A shard counts as complete only if its marker exists, names the same input digest (the
  work it was computed from) and the file's sha256 equals the marker's. Anything else —
  missing file, torn marker, corrupt bytes, changed input — means the shard is redone.
- Shard ``i`` belongs to rank ``i % world_size``; the assignment does not depend on what
  is already done, so reruns and different world sizes produce the same bytes per shard.
- The manifest holds no timestamps or host names: identical work gives identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
PROGRESS_DIR = "progress"
# Test hook: after this many shard writes in one process, the next write stops halfway
# and the process SIGKILLs itself (a torn temporary file, no marker) — what a crash or a
# preempted node does. Used only by the kill-and-resume tests.
KILL_ENV = "SPECDEC_DATA_GEN_KILL_AFTER_SHARDS"


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a multi-process run (torchrun / accelerate set RANK,
    WORLD_SIZE and LOCAL_RANK; a plain run is rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} / world size {self.world_size} is invalid; need "
                "0 <= RANK < WORLD_SIZE (set by torchrun or accelerate launch)"
            )

    @classmethod
    def from_env(cls) -> RankInfo:
        def read(name: str, default: int) -> int:
            value = os.environ.get(name)
            if value is None or value == "":
                return default
            try:
                return int(value)
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None

        return cls(read("RANK", 0), read("WORLD_SIZE", 1), read("LOCAL_RANK", 0))

    def owns(self, index: int) -> bool:
        """Work unit ``index`` (a shard, or a group of shards) is this rank's."""
        return index % self.world_size == self.rank

    def owned(self, n: int) -> range:
        return range(self.rank, n, self.world_size)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def digest_json(obj: Any) -> str:
    """A stable sha256 of a JSON-serialisable value (sorted keys, no whitespace)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def atomic_write_bytes(path: Path, data: bytes, *, fault_after: int | None = None) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    ``fault_after`` (test hook): write half of ``data``, fsync, then SIGKILL this process.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            if fault_after is not None:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _fsync_dir(path: Path) -> None:
    # The rename itself must reach the disk, or a power loss can undo it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardStore:
    """The shards of one stage in ``root``: ``{prefix}-{index:05d}.{ext}``."""

    def __init__(self, root: str | Path, prefix: str, ext: str) -> None:
        self.root = Path(root)
        self.prefix = prefix
        self.ext = ext
        self._writes = 0
        kill = os.environ.get(KILL_ENV)
        self._kill_after = int(kill) if kill else None

    def name(self, index: int) -> str:
        return f"{self.prefix}-{index:05d}.{self.ext}"

    def path(self, index: int) -> Path:
        return self.root / self.name(index)

    def marker_path(self, index: int) -> Path:
        return self.root / PROGRESS_DIR / f"{self.prefix}-{index:05d}.json"

    def read_marker(self, index: int) -> dict | None:
        try:
            marker = json.loads(self.marker_path(index).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return marker if isinstance(marker, dict) else None

    def is_complete(self, index: int, input_digest: str, *, verify: bool = True) -> bool:
        """The shard exists, was computed from ``input_digest`` and (``verify``) its bytes
        hash to the recorded sha256."""
        marker = self.read_marker(index)
        path = self.path(index)
        if marker is None or marker.get("input_digest") != input_digest or not path.is_file():
            return False
        if path.stat().st_size != marker.get("bytes"):
            return False
        return not verify or sha256_file(path) == marker.get("sha256")

    def write(self, index: int, data: bytes, input_digest: str, counts: dict[str, int]) -> dict:
        """Write shard ``index`` atomically, then its marker. Returns the marker."""
        fault = None
        if self._kill_after is not None and self._writes >= self._kill_after:
            fault = self._writes
        # Drop a stale marker first: a crash between the two writes then leaves a shard
        # without a marker (redone), never a marker describing other bytes.
        self.marker_path(index).unlink(missing_ok=True)
        atomic_write_bytes(self.path(index), data, fault_after=fault)
        marker = {
            "file": self.name(index),
            "index": index,
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "input_digest": input_digest,
            "counts": dict(sorted(counts.items())),
        }
        atomic_write_json(self.marker_path(index), marker)
        self._writes += 1
        return marker

    def pending(
        self, digests: list[str], owned: Iterable[int], *, verify: bool = True
    ) -> list[int]:
        """The shards among ``owned`` that are missing, stale or corrupt, in order."""
        return [i for i in sorted(owned) if not self.is_complete(i, digests[i], verify=verify)]

    def merge(self, digests: list[str], header: dict[str, Any], *, verify: bool = False) -> dict:
        """Write ``manifest.json`` covering every shard; raises if some shard is missing.

        ``counts`` in the manifest are the sums of the shards' counts. Any rank may call
        this: the content is a pure function of the shards, so concurrent writers agree.
        """
        shards, totals = [], {}
        missing = [i for i, d in enumerate(digests) if not self.is_complete(i, d, verify=verify)]
        if missing:
            raise ShardsIncompleteError(
                f"{len(missing)} of {len(digests)} shards in {self.root} are missing or "
                f"stale (first: {self.name(missing[0])}); run the stage again (every rank) "
                "to complete them"
            )
        for i in range(len(digests)):
            marker = self.read_marker(i)
            assert marker is not None
            shards.append({k: marker[k] for k in ("file", "sha256", "bytes", "counts")})
            for k, v in marker["counts"].items():
                totals[k] = totals.get(k, 0) + v
        manifest = {**header, "num_shards": len(shards), "counts": totals, "shards": shards}
        atomic_write_json(self.root / MANIFEST, manifest)
        return manifest


class ShardsIncompleteError(RuntimeError):
    """The manifest cannot be written yet: some shards are missing or stale."""


def load_manifest(root: str | Path) -> dict:
    path = Path(root) / MANIFEST
    if not Path(root).is_dir():
        raise FileNotFoundError(
            f"{root} does not exist; pass a directory written by a data-gen stage"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{root} has no {MANIFEST}: the stage that writes it has not completed there; "
            "run it (again) until it reports the manifest written"
        )
    return json.loads(path.read_text())


def verify_manifest(root: str | Path) -> list[str]:
    """Shard files of ``root``'s manifest that are missing or fail their checksum."""
    root = Path(root)
    bad = []
    for shard in load_manifest(root)["shards"]:
        path = root / shard["file"]
        if not path.is_file() or sha256_file(path) != shard["sha256"]:
            bad.append(shard["file"])
    return bad


def chunk_ranges(n: int, size: int) -> Iterable[tuple[int, int]]:
    """``[start, end)`` ranges of ``size`` items covering ``range(n)``."""
    if size < 1:
        raise ValueError(f"shard size {size} must be >= 1")
    for start in range(0, n, size):
        yield start, min(start + size, n)
