"""A block drafter checkpoint's config.json, read without torch: what the command line needs
(the block size sets ``num_speculative_tokens``'s default) before the engine, and torch,
load. Both layouts (ours and vLLM's ``dflash``) name the same architecture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdec.models.errors import WeightLoadError

ARCHITECTURE = "DFlashDraftModel"
DEFAULT_BLOCK_SIZE = 16


def read_block_drafter_json(path: Path) -> dict[str, Any]:
    """``path/config.json``; raises ``WeightLoadError`` unless it names a block drafter."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise WeightLoadError(f"{path} has no config.json; it is not a block drafter directory")
    hf = json.loads(config_file.read_text())
    if hf.get("architectures") != [ARCHITECTURE]:
        raise WeightLoadError(
            f"{path}/config.json names architectures={hf.get('architectures')}; a block "
            f"drafter needs [{ARCHITECTURE!r}]"
        )
    return hf


def block_size_of(hf: dict[str, Any]) -> int:
    """The block size (B) in a block drafter's config.json, either layout."""
    return (
        hf.get("block_size")
        or (hf.get("dflash_config") or {}).get("block_size")
        or DEFAULT_BLOCK_SIZE
    )


def read_block_size(directory: str | Path) -> int:
    """The block size (B) a drafter checkpoint in either format was trained with: one
    block drafts B - 1 tokens (vLLM's ``num_speculative_tokens`` for it)."""
    return block_size_of(read_block_drafter_json(Path(directory)))
