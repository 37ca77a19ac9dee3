"""``specdec export``, ``specdec import`` and ``specdec validate-head``, registered in
``specdec.cli.COMMANDS``. Heavy imports wait until a command runs.

    specdec export --to vllm runs/head exported/vllm      # speculators format + launch line
    specdec export --to sglang runs/head exported/sglang  # research format, SGLang ids
    specdec import yuhuili-head/ heads/llama --target meta-llama/Llama-3.1-8B-Instruct
    specdec import runs/smollm2-block/head heads/block-bf16 --dtype bfloat16
    specdec validate-head exported/vllm --for vllm
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager

from specdec.cli import command

_CONSUMERS = ("vllm", "sglang", "eagle", "specdec")
_EXPORT_TARGETS = ("vllm", "sglang", "eagle")


@contextmanager
def _new_dir_errors() -> Iterator[None]:
    """A non-empty output directory is bad input: a message, not a traceback."""
    try:
        yield
    except FileExistsError as err:
        raise ValueError(str(err)) from None


def _target_arg(p: argparse.ArgumentParser, required_for: str) -> None:
    p.add_argument(
        "--target",
        default=None,
        help="the model the head drafts for: alias, HF directory or hub name (default: the "
        f"one the head's config names; {required_for})",
    )


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("head_dir", help="the head to export (any format specdec loads)")
    p.add_argument("out_dir", help="a new (or empty) directory for the export")
    p.add_argument(
        "--to", required=True, choices=_EXPORT_TARGETS, help="the engine that will load it"
    )
    _target_arg(p, "needed for research-format heads")
    p.add_argument(
        "--verifier",
        default=None,
        help="vllm: the target's hub name or path written into speculators_config "
        "(default: the target; an alias becomes its HF directory)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="chain length K recorded in the config (default: the head's, else 3)",
    )


@command("export", _export_args)
def cmd_export(args: argparse.Namespace) -> int:
    """Export an EAGLE-3 head for vLLM or SGLang/EAGLE and print the command that serves it.

    vLLM gets the speculators format, SGLang and EAGLE the research format (SGLang's
    aux-layer ids). The output is validated for that engine against the target; an export
    that would not load there fails, naming every finding.

        specdec export --to vllm runs/eagle3/head exported/vllm
    """
    from specdec.interop.export import export_head

    with _new_dir_errors():
        result = export_head(
            args.head_dir,
            args.out_dir,
            args.to,
            target=args.target,
            verifier=args.verifier,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    k = result.num_speculative_tokens
    print(f"exported {args.head_dir} for {args.to} to {result.out_dir} (K={k})")
    if result.dropped:
        dropped = ", ".join(result.dropped)
        print(f"  dropped {dropped} (SpecExit channels; {args.to} does not run them)")
    for finding in result.report.warnings:
        print(f"  {finding}")
    print(f"serve it with:\n  {result.launch}")
    return 0


def _import_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a published head: directory, or hub name in the local HF cache")
    p.add_argument("out_dir", help="a new (or empty) directory for the specdec-format head")
    _target_arg(p, "required for research-format heads, which do not record it")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="floating weights' dtype, e.g. bfloat16 to halve a head (default: the stored "
        "one, so the import is lossless)",
    )
    p.add_argument(
        "--tree",
        type=json.loads,
        default=None,
        help="the draft tree to record as the head's default, TreeDefaults fields as JSON: "
        '\'{"tree": "dynamic", "num_speculative_tokens": 5, "top_k": 8, "total_tokens": 48}\' '
        "(default: the one it records, if any)",
    )
    p.add_argument(
        "--spec-exit",
        type=json.loads,
        default=None,
        help="the SpecExit setting to record as the head's default (it needs SpecExit "
        'channels), SpecExitParams fields as JSON: \'{"smoothing": "window", '
        "\"window\": 2}'; a server's or a request's settings override it (default: the "
        "one it records, if any)",
    )


def _tree_defaults(value):
    from dataclasses import fields

    from specdec.models.tree_defaults import TreeDefaults

    known = [f.name for f in fields(TreeDefaults)]
    if not isinstance(value, dict) or set(value) - set(known) or "tree" not in value:
        raise ValueError(f"--tree {json.dumps(value)}: give a JSON object with keys {known}")
    return TreeDefaults(**value)


@command("import", _import_args)
def cmd_import(args: argparse.Namespace) -> int:
    """Import a published EAGLE-3 head or a block drafter into specdec's format.

    Reads the EAGLE research layout, SpecForge exports and the speculators format, and
    converts aux-layer ids to vLLM's numbering; block drafters in either layout (ours,
    vLLM's dflash). --dtype bfloat16 halves a trained head or drafter for shipping or
    moving; serving and model.init_head read it as is.

        specdec import yuhuili-head/ heads/llama --target meta-llama/Llama-3.1-8B-Instruct
        specdec import runs/smollm2-block/head heads/block-bf16 --dtype bfloat16
    """
    import torch

    from specdec.interop.importer import import_head
    from specdec.interop.validate import FORMAT_NAMES

    dtype = getattr(torch, args.dtype) if args.dtype else None
    with _new_dir_errors():
        tree = _tree_defaults(args.tree) if args.tree is not None else None
        if args.spec_exit is not None and not isinstance(args.spec_exit, dict):
            raise ValueError(
                f"--spec-exit {json.dumps(args.spec_exit)}: give a JSON object of "
                "SpecExitParams fields"
            )
        result = import_head(
            args.src,
            args.out_dir,
            target=args.target,
            dtype=dtype,
            tree=tree,
            spec_exit=args.spec_exit,
        )
    print(
        f"imported {args.src} ({FORMAT_NAMES[result.source_format]} format, "
        f"{str(result.dtype).removeprefix('torch.')}) for {result.target} to {result.out_dir}"
    )
    print(f"  aux layers: {result.aux_source}")
    if result.dropped_keys:
        print(f"  dropped {', '.join(result.dropped_keys)} (the target's own weights)")
    for finding in result.warnings:
        print(f"  {finding}")
    return 0


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("head_dir", help="the head directory to check")
    p.add_argument(
        "--for",
        dest="consumer",
        choices=_CONSUMERS,
        default=None,
        help="the engine that will load it (default: the one its format is made for)",
    )
    _target_arg(p, "without one, only the head's own consistency is checked")


@command("validate-head", _validate_args)
def cmd_validate_head(args: argparse.Namespace) -> int:
    """Check that an EAGLE-3 head directory would load in an engine.

    Checks keys, shapes, dtypes, config fields and aux-layer id conventions; exits 1 and
    names each fix if the head would not load there.
    """
    from specdec.interop.target import local_target
    from specdec.interop.validate import validate_head
    from specdec.models.block_drafter_formats import detect_block_format, is_block_drafter
    from specdec.models.eagle3_formats import detect_format
    from specdec.models.weights import WeightLoadError

    consumer = args.consumer
    if consumer is None and is_block_drafter(args.head_dir):
        consumer = {"dflash": "vllm"}.get(detect_block_format(args.head_dir), "specdec")
    elif consumer is None:
        try:
            consumer = {"speculators": "vllm", "eagle": "sglang"}.get(
                detect_format(args.head_dir), "specdec"
            )
        except (WeightLoadError, FileNotFoundError):
            consumer = "specdec"  # the report names what is wrong
    target = local_target(args.head_dir, args.target)
    report = validate_head(
        args.head_dir,
        consumer,
        target=target.config if target else None,
        target_name=target.name if target else None,
    )
    print(report.render())
    return 0 if report.ok else 1
