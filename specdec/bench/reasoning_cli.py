"""``specdec eval-reasoning``: accuracy, think length and latency of a reasoning model on
held-out reasoning-gym items (``specdec.bench.reasoning``).

    specdec eval-reasoning --model runs/smollm2-reasoning/model \\
        --traces data/reasoning/eval.jsonl --out reports/reasoning-plain
    specdec eval-reasoning --model ... --traces ... --draft eagle3 --draft-model HEAD \\
        --spec-exit '{"confidence_above": 0.9}' --out reports/reasoning-specexit
"""

from __future__ import annotations

import argparse
import json

from specdec.cli import command
from specdec.cli_engine import add_engine_args, engine_kwargs, positive_int


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces", required=True, help="eval split of data-gen reasoning-traces")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="directory for report.json and report.md (default: print the table only)",
    )
    p.add_argument(
        "--per-task",
        type=positive_int,
        default=None,
        help="the first N items of each task (default: all)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=1024,
        help="output tokens per reply at most (default: %(default)s)",
    )
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        help="requests in flight (default: all; 1 measures single-request latency)",
    )
    p.add_argument(
        "--sampling",
        type=_json_object,
        default={},
        help="extra SamplingParams fields as JSON, e.g. '{\"temperature\": 0.6}' (default: "
        "{}, greedy)",
    )
    p.add_argument(
        "--spec-exit",
        type=_json_object,
        default=None,
        help="SpecExit settings (SamplingParams.spec_exit) as a JSON object of "
        "SpecExitParams fields; they override the draft head's recorded setting "
        "(spec_exit_defaults), which overrides the defaults ('{}': the head's; default: "
        "SpecExit off)",
    )
    add_engine_args(p)


@command("eval-reasoning", _args)
def cmd_eval_reasoning(args: argparse.Namespace) -> int:
    """Score a reasoning model on held-out reasoning-gym items (accuracy, think length, latency)."""
    from specdec.bench.reasoning import EvalConfig, markdown, run_eval

    sampling = dict(args.sampling)
    if args.spec_exit is not None:
        sampling["spec_exit"] = args.spec_exit
    config = EvalConfig(
        model=args.model,
        traces=args.traces,
        output=args.out,
        per_task=args.per_task,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        sampling=sampling,
        engine=engine_kwargs(args),
    )
    report = run_eval(config)
    print(markdown(report))
    return 0
