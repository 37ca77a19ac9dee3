"""Check an EAGLE-3 head directory before another engine loads it, and say what to fix.

``validate_head(dir, consumer)`` gathers the directory once (``HeadDir``: config.json, the
detected format, every tensor's shape and dtype from the file headers) and runs the
generic checks (``checks.py``), then the consumer's own (``consumers.py``: vLLM, SGLang, EAGLE,
specdec). Every problem becomes a ``Finding`` naming where it is, what is wrong and the fix;
checks never stop at the first one. Errors mean the consumer would fail or, worse, load a
different function (wrong aux layers, weights silently dropped); warnings mean it works
but something is off.

Without a target model the head is checked against itself (its hidden size and vocabulary;
aux ids only for sign), and a warning says what was skipped. Nothing here loads the
weights except ``d2t``/``t2d`` (small) and, for specdec, the final trial load.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from specdec.models.config import ModelConfig
from specdec.models.eagle3_formats import (
    ARCHITECTURE,
    Eagle3Format,
    TensorInfo,
    detect_format,
    from_speculators_key,
    tensor_infos,
    to_speculators_key,
    weight_files,
)
from specdec.models.eagle3_head import Eagle3Config
from specdec.models.weights import WeightLoadError

Severity = Literal["error", "warning"]
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
# Stored keys every reader accepts and drops: the frozen target embedding.
IGNORED_KEYS = frozenset({"embed_tokens.weight"})
FORMAT_NAMES: dict[str, str] = {
    "specdec": "specdec",
    "eagle": "research (EAGLE/SpecForge)",
    "speculators": "speculators",
    "dflash": "DFlash (vLLM dflash)",
}


@dataclass(frozen=True)
class Finding:
    """One problem: ``where`` (a file and field or key), what is wrong, how to fix it."""

    severity: Severity
    where: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.where}: {self.problem}. Fix: {self.fix}"


@dataclass
class HeadDir:
    """A head directory as the checks see it, read once. ``tensors`` is keyed by the
    research-format name whatever the stored layout (``stored_keys`` keeps the originals);
    ``target`` is None when no target model was given (``head`` then parsed against a
    stand-in built from the head's own sizes)."""

    path: Path
    config: dict[str, Any]
    format: Eagle3Format
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    stored_keys: list[str] = field(default_factory=list)
    split: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    target: ModelConfig | None = None
    head: Eagle3Config | None = None

    @property
    def layer(self) -> dict[str, Any]:
        """The HF Llama fields of the head's decoder layer."""
        if self.format == "speculators":
            return self.config.get("transformer_layer_config") or {}
        return self.config

    @property
    def top_ids(self) -> list[int] | None:
        """Top-level aux ids (vLLM numbering: the residual entering each layer)."""
        return self.config.get(IDS_KEY) or None

    @property
    def nested_ids(self) -> list[int] | None:
        """``eagle_config`` aux ids (SGLang numbering: the output of each layer)."""
        return (self.config.get("eagle_config") or {}).get(IDS_KEY) or None

    @property
    def num_layers(self) -> int | None:
        return self.target.num_layers if self.target else None

    @property
    def research_format(self) -> bool:
        return self.format != "speculators"


Check = Callable[[HeadDir], list[Finding]]


@dataclass
class ValidationReport:
    """Every finding for one directory and consumer; ``ok`` when there is no error."""

    path: Path
    consumer: str
    format: str | None  # an Eagle3Format, or a block drafter's BlockFormat
    target: str | None
    findings: list[Finding]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def render(self) -> str:
        head = (
            f"{self.path} ({FORMAT_NAMES.get(self.format or '', 'unknown')} format) for "
            f"{self.consumer}"
            + (f", target {self.target}" if self.target else ", no target")
            + f": {len(self.errors)} errors, {len(self.warnings)} warnings"
        )
        return "\n".join([head, *(f"  {f}" for f in self.findings)])


def validate_head(
    directory: str | Path,
    consumer: str | None = "specdec",
    *,
    target: ModelConfig | None = None,
    target_name: str | None = None,
) -> ValidationReport:
    """Run the generic checks and ``consumer``'s (a name in ``consumers.CONSUMERS``; None:
    the generic checks only) on a head directory; ``target`` (named ``target_name`` in the
    report) enables the checks against the target model."""
    from specdec.interop.checks import GENERIC_CHECKS
    from specdec.interop.consumers import get_consumer
    from specdec.models.block_drafter_formats import is_block_drafter

    if is_block_drafter(directory):  # a DFlash-style drafter: its own checks
        from specdec.interop.block_drafters import validate_block_drafter

        return validate_block_drafter(directory, consumer, target=target,
                                      target_name=target_name)  # fmt: skip
    checks = get_consumer(consumer).checks if consumer else ()
    path = Path(directory)
    findings: list[Finding] = []
    head = _read_head_dir(path, target, findings)
    if head is not None:
        if target is None:
            findings.append(
                Finding(
                    "warning",
                    "target",
                    "no target model given, so hidden size, vocabulary and aux-layer ranges "
                    "were checked only against the head itself",
                    "pass --target with the model the head drafts for",
                )
            )
        for check in (*GENERIC_CHECKS, *checks):
            findings.extend(check(head))
    return ValidationReport(
        path,
        consumer or "any engine",
        head.format if head else None,
        target_name,
        _dedupe(findings),
    )


# ------------------------------------------------------------------ reading


def _read_head_dir(
    path: Path, target: ModelConfig | None, findings: list[Finding]
) -> HeadDir | None:
    config_file = path / "config.json"
    if not config_file.is_file():
        findings.append(
            Finding(
                "error",
                str(path),
                "no config.json: not a head directory",
                "point at the directory holding the head's config.json and weights",
            )
        )
        return None
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        findings.append(
            Finding("error", "config.json", f"is not valid JSON ({err})", "repair the file")
        )
        return None
    try:
        fmt = detect_format(path)
    except WeightLoadError as err:
        findings.append(
            Finding(
                "error",
                "config.json: architectures",
                str(err),
                f'write architectures ["{ARCHITECTURE}"] (research layout) or a speculators '
                "eagle3 config; `specdec export` writes either",
            )
        )
        return None
    head = HeadDir(path, config, fmt, target=target)
    try:
        where = weight_files(path)
        infos = tensor_infos(path)
    except WeightLoadError as err:
        findings.append(Finding("error", "weights", str(err), "store the weights as *.safetensors"))
        return head
    head.split = dict(where.split)
    head.files = [f.name for f in where.files]
    head.stored_keys = sorted(infos)
    rename = from_speculators_key if fmt == "speculators" else (lambda k: k)
    head.tensors = {rename(k): v for k, v in infos.items()}
    return head


def read_small_tensor(head: HeadDir, key: str) -> torch.Tensor | None:
    """A stored tensor (research-format ``key``) read whole; for ``d2t``/``t2d``."""
    stored = to_speculators_key(key) if head.format == "speculators" else key
    for name in head.files:
        with safe_open(str(head.path / name), framework="pt") as handle:
            if stored in handle.keys():  # noqa: SIM118 (not a dict)
                return handle.get_tensor(stored)
    return None


def stand_in_target(layer: dict[str, Any], ids: Sequence[int] | None) -> ModelConfig:
    """A target with the head's own sizes and enough layers for ``ids`` (vLLM numbering),
    so a head parses without its real target; only for self-consistency checks."""
    num_layers = max([4, *(i + 4 for i in ids or ())])
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 2048,
        **{k: v for k, v in layer.items() if k != "architectures"},
        "num_hidden_layers": num_layers,
    }
    return ModelConfig.from_hf(hf)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    return list(dict.fromkeys(findings))
