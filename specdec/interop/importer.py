"""``import_head``: a published EAGLE-3 head (or a block drafter) -> specdec's own format,
lossless unless a dtype is asked for (bf16 halves a head).

Reads any layout ``load_eagle3`` detects: the EAGLE research layout (e.g.
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: no aux ids, EAGLE's defaults apply), a SpecForge
export (ids in ``eagle_config``, SGLang numbering; the frozen ``embed_tokens.weight``
dropped), or a speculators checkpoint. The source is validated first (errors abort with
every finding), loaded against the target in its stored dtype, and written with
``save_eagle3(..., "specdec")``: aux ids in vLLM numbering at top level and in SGLang's in
``eagle_config``, the target's name recorded. Exporting the result to the source's layout
gives back the source's tensors bit for bit (tests/interop/test_export.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specdec.interop.target import resolve_target
from specdec.interop.validate import IGNORED_KEYS, Finding, HeadDir, validate_head
from specdec.models import resolve_model
from specdec.models.block_drafter_formats import BlockFormat, is_block_drafter
from specdec.models.eagle3_formats import (
    Eagle3Format,
    detect_format,
    load_eagle3,
    save_eagle3,
    stored_dtype,
    tensor_infos,
)
from specdec.models.tree_defaults import TreeDefaults


class HeadImportError(ValueError):
    """The source head is not one specdec can import (the message lists every finding)."""


@dataclass(frozen=True)
class ImportResult:
    out_dir: Path
    source_format: Eagle3Format | BlockFormat
    target: str
    dtype: torch.dtype
    aux_layer_ids: tuple[int, ...]  # as written: vLLM numbering (entering layer i)
    aux_source: str  # where the source kept them, in words
    dropped_keys: list[str]  # stored keys every reader ignores (the target's embedding)
    warnings: list[Finding]


def import_head(
    src: str | Path,
    out_dir: str | Path,
    *,
    target: str | None = None,
    dtype: torch.dtype | None = None,
    tree: TreeDefaults | None = None,
    spec_exit: dict[str, Any] | None = None,
) -> ImportResult:
    """Convert the head at ``src`` (a directory, or a hub name in the local HF cache) into a
    new specdec-format ``out_dir``. ``target`` names the model it drafts for (needed for
    the research format, which does not record it); ``dtype`` defaults to the stored one;
    ``tree`` replaces the draft tree recorded as the head's default and ``spec_exit`` its
    SpecExit setting (``Eagle3Config.spec_exit_defaults``; only for a head with SpecExit
    channels); None keeps the recorded one. A block drafter (config.json naming
    ``DFlashDraftModel``) is rewritten in specdec's block layout
    (``block_drafters.import_block_drafter``); it records no tree or SpecExit setting."""
    path = source_dir(src)
    if is_block_drafter(path):
        return _import_block_drafter(path, out_dir, target, dtype, tree, spec_exit)
    resolved = resolve_target(path, target)
    report = validate_head(path, None, target=resolved.config, target_name=resolved.name)
    if not report.ok:
        raise HeadImportError(f"cannot import {src}:\n{report.render()}")
    fmt = detect_format(path)
    dtype = dtype or stored_dtype(path)
    head = load_eagle3(path, target_config=resolved.config, dtype=dtype)
    if spec_exit is not None and not head.config.exit_signals:
        raise HeadImportError(
            f"cannot record SpecExit settings {json.dumps(spec_exit)} on {src}: it has no "
            "SpecExit channels (its config.json lists no spec_exit_signals); leave them out, "
            "or import a head trained with spec_exit.signals"
        )
    head.config = replace(
        head.config,
        target_name=resolved.name,
        tree=tree or head.config.tree,
        spec_exit_defaults=head.config.spec_exit_defaults if spec_exit is None else spec_exit,
    )
    out = save_eagle3(head, out_dir, "specdec")
    return ImportResult(
        out_dir=out,
        source_format=fmt,
        target=resolved.name,
        dtype=dtype,
        aux_layer_ids=head.config.aux_layer_ids,
        aux_source=_describe_ids(path, fmt, head.config.aux_layer_ids),
        dropped_keys=sorted(k for k in tensor_infos(path) if k in IGNORED_KEYS),
        warnings=report.warnings,
    )


def _import_block_drafter(
    path: Path,
    out_dir: str | Path,
    target: str | None,
    dtype: torch.dtype | None,
    tree: TreeDefaults | None,
    spec_exit: dict[str, Any] | None,
) -> ImportResult:
    from specdec.interop.block_drafters import import_block_drafter, validate_block_drafter

    if tree is not None or spec_exit is not None:
        raise HeadImportError(
            f"cannot record --tree or --spec-exit on {path}: it is a block drafter, which "
            "drafts its block size's chain; leave them out"
        )
    resolved = resolve_target(path, target)
    report = validate_block_drafter(path, None, target=resolved.config, target_name=resolved.name)
    if not report.ok:
        raise HeadImportError(f"cannot import {path}:\n{report.render()}")
    fmt, config, dtype = import_block_drafter(path, out_dir, target=target, dtype=dtype)
    ids = config.aux_layer_ids
    return ImportResult(
        out_dir=Path(out_dir),
        source_format=fmt,
        target=config.target_name,
        dtype=dtype,
        aux_layer_ids=ids,
        aux_source=f"dflash_config.target_layer_ids {[i - 1 for i in ids]} (layer outputs) "
        f"-> {list(ids)}",
        dropped_keys=sorted(k for k in tensor_infos(path) if k == "embed_tokens.weight"),
        warnings=report.warnings,
    )


def source_dir(src: str | Path) -> Path:
    """A local directory as is; an ``org/name`` hub name through the HF cache."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if "/" in str(src) and not str(src).startswith((".", "/", "~")):
        return resolve_model(str(src)).hf_dir
    raise FileNotFoundError(f"{src} is neither a head directory nor a hub name (org/name)")


def _describe_ids(path: Path, fmt: Eagle3Format, ids: tuple[int, ...]) -> str:
    probe = HeadDir(path, json.loads((path / "config.json").read_text()), fmt)
    if probe.top_ids is not None:
        return f"top-level {probe.top_ids} (vLLM numbering, kept)"
    if probe.nested_ids is not None:
        return f"eagle_config {probe.nested_ids} (SGLang numbering) -> {list(ids)}"
    return f"none stored: EAGLE's default layers {list(ids)}"
