"""What every stage shares around its shards: the plan file written before any work and
the manifest merge after it.

``plan.json`` records the shard prefix, extension, the input digest of every shard and the
manifest header. Every rank computes the same plan and writes the same bytes, so it is a
pure description of the work; ``data-gen merge DIR`` needs nothing else to finish a run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from specdec.data_gen.shards import (
    RankInfo,
    ShardsIncompleteError,
    ShardStore,
    atomic_write_json,
)

logger = logging.getLogger(__name__)

PLAN = "plan.json"


def write_plan(store: ShardStore, digests: list[str], header: dict[str, Any]) -> None:
    plan = {"prefix": store.prefix, "ext": store.ext, "digests": digests, "header": header}
    path = store.root / PLAN
    if path.is_file():
        try:
            if json.loads(path.read_text()) == plan:
                return  # already there (another rank, or an earlier run): keep its bytes
        except json.JSONDecodeError:
            pass
    atomic_write_json(path, plan)


def finish_stage(
    store: ShardStore, digests: list[str], header: dict[str, Any], rank: RankInfo
) -> dict | None:
    """Merge the manifest if every rank's shards are complete, else return None.

    Ranks finish at different times; whichever completes the set last writes the
    manifest (its content does not depend on who writes it). Single-process runs always
    end here with a manifest.
    """
    try:
        manifest = store.merge(digests, header)
    except ShardsIncompleteError as e:
        if rank.world_size == 1:
            raise
        logger.info("rank %d done; manifest not written yet: %s", rank.rank, e)
        return None
    logger.info("manifest written: %s (%d shards)", store.root / "manifest.json", len(digests))
    return manifest


def merge_dir(root: str | Path, verify: bool = True) -> dict:
    """Write ``root``'s manifest from its plan and shard markers (``data-gen merge``);
    with ``verify`` every shard's checksum is checked first."""
    root = Path(root)
    try:
        plan = json.loads((root / PLAN).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{root} has no {PLAN}: not a data-gen stage directory, or its stage never started"
        ) from None
    store = ShardStore(root, plan["prefix"], plan["ext"])
    return store.merge(plan["digests"], plan["header"], verify=verify)
