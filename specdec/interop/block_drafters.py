"""Block drafters (DFlash-style, ``models/block_drafter_formats.py``) across engines: the
export for vLLM, the import into specdec's layout (optionally in another dtype) and the
validator's checks. ``export_head``, ``import_head`` and ``validate_head`` hand a directory
whose config.json names ``DFlashDraftModel`` to these.

vLLM runs them as ``method: "dflash"`` from one ``model.safetensors`` in the ``dflash``
layout; SGLang's and EAGLE's EAGLE-3 loaders do not run them; specdec loads both layouts.
The chain length K is ``block_size - 1`` (vLLM drafts ``num_speculative_tokens`` masked
slots after the anchor); a shorter K drafts fewer slots than the drafter was trained on.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path

import torch

from specdec.interop.target import resolve_target
from specdec.interop.validate import Finding, ValidationReport
from specdec.models.block_drafter import BlockDrafterConfig
from specdec.models.block_drafter_formats import (
    BlockFormat,
    detect_block_format,
    load_block_drafter,
    save_block_drafter,
)
from specdec.models.config import ModelConfig
from specdec.models.eagle3_formats import INDEX_FILE, stored_dtype
from specdec.models.weights import WeightLoadError

# consumer -> the block layouts it reads (absent: it runs no block drafter)
READS = {"vllm": ("dflash",), "specdec": ("specdec", "dflash")}


def validate_block_drafter(
    directory: str | Path,
    consumer: str | None = "specdec",
    *,
    target: ModelConfig | None = None,
    target_name: str | None = None,
) -> ValidationReport:
    """The findings for a block drafter directory: whether ``consumer`` runs block
    drafters and reads its layout, and (with ``target``) a real load against it."""
    path = Path(directory)
    findings: list[Finding] = []
    try:
        fmt = detect_block_format(path)
    except WeightLoadError as err:
        return ValidationReport(path, consumer or "any engine", None, target_name,
                                [Finding("error", "config.json", str(err), "fix it")])  # fmt: skip
    if consumer is not None and consumer not in READS:
        findings.append(Finding(
            "error", "config.json", f"describes a DFlash block drafter; {consumer} runs EAGLE-3 "
            "heads only", "serve it with vLLM (specdec export --to vllm) or specdec",
        ))  # fmt: skip
    elif consumer is not None and fmt not in READS[consumer]:
        findings.append(Finding(
            "error", f"weights: {INDEX_FILE}" if (path / INDEX_FILE).exists() else "config.json",
            f"is specdec's block drafter layout (16 MB shards, row splits); {consumer} reads "
            "the dflash layout", f"export it: specdec export --to {consumer} {path} OUT_DIR",
        ))  # fmt: skip
    if target is None:
        findings.append(Finding(
            "warning", "target", "no target model given, so the drafter was not loaded "
            "against one", "pass --target with the model the drafter drafts for",
        ))  # fmt: skip
    else:
        try:
            load_block_drafter(path, target_config=target)
        except (WeightLoadError, ValueError) as err:
            findings.append(Finding("error", "load", str(err), "fix what the message names"))
    return ValidationReport(path, consumer or "any engine", fmt, target_name, findings)


def export_block_drafter(
    head_dir: str | Path,
    out_dir: str | Path,
    to: str,
    *,
    target: str | None = None,
    verifier: str | None = None,
    num_speculative_tokens: int | None = None,
):
    """Write the drafter in ``head_dir`` to ``out_dir`` in the dflash layout for ``to``
    (vLLM only), validated; returns ``export.ExportResult``."""
    from specdec.interop.export import ExportError, ExportResult

    if to != "vllm":
        raise ValueError(f"--to {to!r}: block drafters run in vLLM (method dflash) and "
                         "specdec only; use --to vllm")  # fmt: skip
    resolved = resolve_target(head_dir, target)
    drafter = load_block_drafter(head_dir, target_config=resolved.config,
                                 dtype=stored_dtype(head_dir))  # fmt: skip
    slots = drafter.config.block_size - 1
    k = num_speculative_tokens or slots
    if not 1 <= k <= slots:
        raise ValueError(f"--num-speculative-tokens {k}: the drafter fills {slots} slots per "
                         f"block (block_size {slots + 1}); pass 1 .. {slots}")  # fmt: skip
    out = save_block_drafter(drafter, out_dir, "dflash")
    report = validate_block_drafter(out, to, target=resolved.config, target_name=resolved.name)
    if not report.ok:
        raise ExportError(f"the export in {out} would not load in vLLM:\n{report.render()}")
    spec = {"method": "dflash", "model": str(out), "num_speculative_tokens": k}
    name = verifier or resolved.portable_name
    launch = f"vllm serve {shlex.quote(name)} --speculative-config {shlex.quote(json.dumps(spec))}"
    return ExportResult(out, to, name, k, report, launch)


def import_block_drafter(
    src: str | Path,
    out_dir: str | Path,
    *,
    target: str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[BlockFormat, BlockDrafterConfig, torch.dtype]:
    """Write the drafter in ``src`` (either layout) to a new ``out_dir`` in specdec's
    layout, its floating weights in ``dtype`` (default: the stored one, lossless) and its
    target's name recorded; ``d2t``/``t2d`` stay integer and bool. Returns the source
    layout, the config written and its dtype. The engine and ``model.init_head`` read the
    result whatever its dtype (``load_block_drafter`` casts on load)."""
    path = Path(src)
    resolved = resolve_target(path, target)
    fmt = detect_block_format(path)
    dtype = dtype or stored_dtype(path)
    drafter = load_block_drafter(path, target_config=resolved.config, dtype=dtype)
    drafter.config = replace(drafter.config, target_name=resolved.name)
    save_block_drafter(drafter, out_dir, "specdec")
    return fmt, drafter.config, dtype
