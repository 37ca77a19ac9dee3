"""The target model a head drafts for: named on the command line or by the head itself.

specdec's own format records ``target_model``, the speculators format
``speculators_config.verifier.name_or_path``; the research format names none, so
``--target`` is needed there. ``portable_name`` is what other engines can resolve: a
specdec alias of a GGUF inside a pip package becomes its converted HF directory, an alias
of a shipped LoRA adapter the adapter's directory (never its bare base, which would serve
a different model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec.models import ALIASES, ModelConfig, load_config, resolve_model


@dataclass(frozen=True)
class ResolvedTarget:
    name: str  # as given (alias, HF directory or hub name)
    portable_name: str  # a hub name or an HF directory other engines can open
    config: ModelConfig


def named_target(head_dir: str | Path) -> str | None:
    """The target a head's config.json names, if any."""
    config_file = Path(head_dir) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return config.get("target_model") or verifier or None


def resolve_target(head_dir: str | Path, target: str | None) -> ResolvedTarget:
    """``target``, else the head's own target name, resolved to its config; raises
    naming the fix when neither is there."""
    name = target or named_target(head_dir)
    if not name:
        raise ValueError(
            f"{head_dir} does not name its target model (the research format has no field "
            "for it); pass --target with the model the head drafts for (alias, HF directory "
            "or hub name)"
        )
    if name in ALIASES:  # a path that loads anywhere: the adapter itself, not its base
        resolved = resolve_model(name)
        portable = str(resolved.adapter or resolved.hf_dir)
    else:
        portable = name
    return ResolvedTarget(name, portable, load_config(name))


def local_target(head_dir: str | Path, target: str | None) -> ResolvedTarget | None:
    """Like ``resolve_target`` for an explicit ``target``; a name taken from the head is
    used only when it resolves without the network (an alias or a local directory)."""
    if target:
        return resolve_target(head_dir, target)
    name = named_target(head_dir)
    if name and (name in ALIASES or Path(name).expanduser().is_dir()):
        return resolve_target(head_dir, name)
    return None
