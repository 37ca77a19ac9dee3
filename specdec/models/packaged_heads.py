"""EAGLE-3 heads shipped inside the package, one per model alias (specdec/heads/<alias>/).

A shipped head is its model's default speculation: ``specdec generate``, ``serve`` and
``bench`` draft with it unless told otherwise (``--draft none`` or another proposer), in
the tree shape recorded in its config (``tree_defaults``), which explicit ``--spec-*``
flags override. A head named by directory (``--draft eagle3 --draft-model DIR``) drafts
in the shape its own config records the same way (``head_speculative``). A head with
SpecExit channels may also record its exit setting (``spec_exit_defaults``); that one
reaches requests through the loaded head (``SpecExitRuntime.head_defaults``,
docs/spec_exit.md). A model without a shipped head
keeps each command's own default.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.models.aliases import ALIASES

if TYPE_CHECKING:  # specdec.config imports torch; CLI parsers import this module
    from specdec.config import SpeculativeConfig

HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"


def packaged_head(model: str) -> Path | None:
    """The head directory shipped for alias ``model``; None for paths, hub names and
    aliases without one."""
    if model not in ALIASES:
        return None
    head = HEADS_DIR / model
    return head if (head / "config.json").is_file() else None


def tree_defaults(head_dir: str | Path) -> dict[str, Any]:
    """The ``SpeculativeConfig`` fields of the tree a head was tuned for ({} if its config
    records none, or if ``head_dir`` is not a local directory with a config, e.g. a hub
    name); validated as ``TreeDefaults``."""
    from specdec.models.tree_defaults import TreeDefaults

    path = Path(head_dir) / "config.json"
    if not path.is_file():
        return {}
    tree = json.loads(path.read_text()).get("tree_defaults")
    return asdict(TreeDefaults(**tree)) if tree else {}


def head_speculative(head: str | Path, **overrides: Any) -> SpeculativeConfig:
    """EAGLE-3 with the head at ``head`` in the tree shape its config records,
    ``overrides`` (fields of ``SpeculativeConfig``) applied on top."""
    from specdec.config import SpeculativeConfig, override_fields

    base = {"method": "eagle3", "model": str(head), **tree_defaults(head)}
    return SpeculativeConfig(**override_fields(base, overrides))


def default_speculative(model: str, **overrides: Any) -> SpeculativeConfig | None:
    """``head_speculative`` of ``model``'s shipped head; None when the model ships none."""
    head = packaged_head(model)
    return None if head is None else head_speculative(head, **overrides)
