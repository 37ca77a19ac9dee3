"""``specdec train-draft``: train an EAGLE-3 head; ``specdec eval-draft``: judge one on
record sets as greedy chain decoding would accept it; ``specdec train-sft``: fine-tune a
target on chat records (the reasoning target's recipe). Registered in
``specdec.cli.COMMANDS``.

    specdec train-draft --config configs/train/smollm2.yaml data.path=out/dump optim.lr=3e-4
    accelerate launch --config_file configs/accelerate/zero2.yaml -m specdec.cli \\
        train-draft --config configs/train/smollm2.yaml
    specdec eval-draft --head runs/x/head --records humaneval=data/regen_humaneval
    specdec train-sft --config configs/train/smollm2_reasoning_sft.yaml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.cli import command
from specdec.cli_engine import DEFAULT_MODEL, positive_int


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="YAML",
        help="YAML run config such as configs/train/smollm2.yaml (default: the config "
        "classes' built-in values)",
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. optim.lr=3e-4 data.path=out/dump")  # fmt: skip
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


@command("train-draft", _args)
def cmd_train_draft(args: argparse.Namespace) -> int:
    """Train an EAGLE-3 head or a DFlash-style block drafter on data-gen output, offline or online.

    model.drafter picks the drafter: eagle3 (the default; training-time test) or block
    (a block drafter, the config's block section).

    Settings come from a YAML run config (--config, e.g. configs/train/smollm2.yaml) with
    section.key=value overrides on top. A run resumes from the newest checkpoint in
    run.output_dir; under accelerate launch it trains data-parallel (configs/accelerate/).

        specdec train-draft --config configs/train/smollm2.yaml data.path=out/dump
    """
    from specdec.train.config import TrainConfig

    config = TrainConfig.load(args.config, args.overrides)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    from specdec.train.trainer import train

    result = train(config)
    print(json.dumps(result, indent=2))
    return 0


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--head",
        metavar="DIR",
        help="EAGLE-3 head directory (default: the head shipped for --model)",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target (default: %(default)s)")
    p.add_argument(
        "--records",
        action="append",
        required=True,
        type=_record_set,
        metavar="NAME=DIR",
        help="a `specdec data-gen regenerate` directory, named NAME (default: its basename); "
        "repeatable",
    )
    p.add_argument(
        "--chain",
        type=_int_list,
        default=(),
        metavar="K,K,...",
        help="chain lengths to replay (default: 1..--steps)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=7,
        help="TTT steps unrolled, for acc_i and simulated τ (default: %(default)s)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, or auto (default: %(default)s)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype (default: %(default)s)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=4096,
        help="tokens per packed batch; longer records are clipped (default: %(default)s)",
    )
    p.add_argument(
        "--answer-max-tokens",
        type=positive_int,
        default=None,
        help="the max_tokens the answers were generated with (default: the manifest's)",
    )
    p.add_argument(
        "--per-answer", action="store_true", help="--json also lists every answer's counts"
    )
    p.add_argument(
        "--by-source",
        action="store_true",
        help="also report each set per prompt source (the records' `source`), as SET/SOURCE",
    )
    p.add_argument(
        "--json",
        dest="json_out",
        metavar="FILE",
        help="also write the figures to this file (default: print only)",
    )


def _record_set(spec: str) -> tuple[str, str]:
    """``NAME=DIR`` or ``DIR`` (named by its basename)."""
    name, sep, path = spec.partition("=")
    if not sep or Path(spec).exists():
        return Path(spec).name, spec
    if not name or not path:
        raise argparse.ArgumentTypeError(f"{spec!r}: use NAME=DIR or DIR")
    return name, path


def _int_list(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: use comma-separated integers") from None


@command("eval-draft", _eval_args)
def cmd_eval_draft(args: argparse.Namespace) -> int:
    """Judge an EAGLE-3 head on record sets: acc_i, simulated τ, exact chain τ by replay.

    No engine runs: the head reads the target's hidden states over each set's answers
    (specdec data-gen regenerate output) and every chain length is replayed as greedy
    chain decoding would accept it.

        specdec eval-draft --head runs/eagle3/head --records humaneval=data/regen_humaneval
    """
    from specdec.train.head_eval import EvalConfig, evaluate_head, format_report, resolve_head

    config = EvalConfig(
        records=tuple(args.records),
        head=args.head,
        model=args.model,
        steps=args.steps,
        chains=args.chain,
        device=args.device,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        answer_max_tokens=args.answer_max_tokens,
        per_answer=args.per_answer,
        by_source=args.by_source,
    )
    head_dir = resolve_head(config.head, config.model)
    figures = evaluate_head(config)
    if args.json_out:
        report = {
            "head": str(head_dir),
            "model": config.model,
            "steps": config.steps,
            "device": config.device,
            "dtype": config.dtype,
            "sets": [f.to_dict() for f in figures],
        }
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    print(format_report(figures, config, head_dir))
    return 0


@command("train-sft", _args)
def cmd_train_sft(args: argparse.Namespace) -> int:
    """Fine-tune a target model on chat records (assistant-token loss, packed).

    Settings as for train-draft: a YAML run config (--config, e.g.
    configs/train/smollm2_reasoning_sft.yaml) with section.key=value overrides on top.
    """
    from specdec.train.sft_config import SFTConfig

    config = SFTConfig.load(args.config, args.overrides)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    from specdec.train.sft import train_sft

    result = train_sft(config)
    print(json.dumps(result, indent=2))
    return 0
