"""``export_head``: a head in any format -> the layout another engine loads, validated.

The head is loaded with ``load_eagle3`` in its stored dtype (so nothing is rounded) and
written with ``save_eagle3`` in the consumer's format (``consumers.CONSUMERS[to].writes``):
vLLM gets the speculators format, SGLang and EAGLE the research one with the aux ids in
SGLang's numbering. The output is then validated for that consumer against the target;
an export that would not load there raises with every finding.

A block drafter (config.json naming ``DFlashDraftModel``) goes to vLLM in the dflash
layout instead (``block_drafters.export_block_drafter``).

A head's SpecExit channels (docs/spec_exit.md) run only in specdec: the export drops them
(``ExportResult.dropped``, and ``specdec_dropped`` in the safetensors metadata), and the
exported head drafts exactly as the original does.

The speculators config names a *verifier* (the target vLLM pairs the head with when it is
served on its own). It defaults to the head's target name; a specdec alias is replaced by
its resolved HF directory, since vLLM cannot resolve specdec aliases.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from specdec.interop.consumers import EXPORT_TARGETS, LaunchSpec, get_consumer
from specdec.interop.target import resolve_target
from specdec.interop.validate import ValidationReport, validate_head
from specdec.models.block_drafter_formats import is_block_drafter
from specdec.models.eagle3_formats import dropped_keys, load_eagle3, save_eagle3, stored_dtype
from specdec.models.tree_defaults import TreeDefaults

DEFAULT_NUM_SPECULATIVE_TOKENS = 3


class ExportError(ValueError):
    """The exported directory would not load in its consumer (the report says why)."""


@dataclass(frozen=True)
class ExportResult:
    """``out_dir`` holds the head for ``consumer``; ``launch`` is the command that serves it
    (with ``target`` as written there, K = ``num_speculative_tokens``); ``dropped`` names
    the stored keys the consumer cannot run (the SpecExit channels), left out."""

    out_dir: Path
    consumer: str
    target: str
    num_speculative_tokens: int
    report: ValidationReport
    launch: str
    dropped: tuple[str, ...] = ()


def export_head(
    head_dir: str | Path,
    out_dir: str | Path,
    to: str,
    *,
    target: str | None = None,
    verifier: str | None = None,
    num_speculative_tokens: int | None = None,
) -> ExportResult:
    """Write the head in ``head_dir`` to a new ``out_dir`` for consumer ``to`` (one of
    ``EXPORT_TARGETS``). ``target`` (alias, HF directory or hub name) defaults to the
    head's own target name; ``verifier`` is the target name written for vLLM;
    ``num_speculative_tokens`` the chain length recorded in the config (default: the
    head's tree defaults, else 3)."""
    if is_block_drafter(head_dir):
        from specdec.interop.block_drafters import export_block_drafter

        return export_block_drafter(head_dir, out_dir, to, target=target, verifier=verifier,
                                    num_speculative_tokens=num_speculative_tokens)  # fmt: skip
    consumer = get_consumer(to)
    if consumer.writes is None:
        raise ValueError(f"--to {to!r} is not an export target; choose one of {EXPORT_TARGETS}")
    resolved = resolve_target(head_dir, target)
    head = load_eagle3(head_dir, target_config=resolved.config, dtype=stored_dtype(head_dir))
    tree = head.config.tree
    if num_speculative_tokens is not None or tree is None:
        tree = TreeDefaults("chain", num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS)
    k = tree.num_speculative_tokens
    head.config = replace(head.config, target_name=verifier or resolved.portable_name, tree=tree)
    dropped = tuple(dropped_keys(head, consumer.writes))
    out = save_eagle3(head, out_dir, consumer.writes)
    report = validate_head(out, to, target=resolved.config, target_name=resolved.name)
    if not report.ok:
        raise ExportError(
            f"the export in {out} would not load in {consumer.title}:\n{report.render()}"
        )
    launch = (
        consumer.launch(LaunchSpec(resolved.portable_name, str(out), k)) if consumer.launch else ""
    )
    return ExportResult(out, to, resolved.portable_name, k, report, launch, dropped)
