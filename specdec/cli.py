"""The ``specdec`` command. Subcommands register in ``COMMANDS`` with ``@command``; a
command's docstring is its help: the first paragraph, one sentence, is the summary that
``specdec --help`` lists, and the whole docstring heads ``specdec COMMAND --help``."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Under these names too for serve/cli.py, which imports them from here.
from specdec.cli_engine import TREE_FLAGS as TREE_FLAGS
from specdec.cli_engine import add_engine_args as _add_engine_args
from specdec.cli_engine import engine_kwargs as _engine_kwargs

DEFAULT_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
    "Give three tips for writing clear technical documentation.",
]

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable]] = {}


DESCRIPTION = """\
Lossless speculative decoding: a small EAGLE-3 draft head (or n-gram lookup, or a
smaller model) guesses tokens ahead and the target model verifies them in one forward
pass, so outputs are exactly what the target alone would produce, only faster.

Run "specdec COMMAND --help" for a command's flags and their defaults."""


def command(name: str, add_args: Callable[[argparse.ArgumentParser], None]):
    """Register ``fn(args) -> exit code`` as ``specdec NAME``; its docstring is the help
    (module docstring)."""

    def register(fn):
        COMMANDS[name] = (add_args, fn)
        return fn

    return register


def _read_prompts(path: str) -> list[str]:
    """One prompt per line (.txt), or per line of a .jsonl one ``{"prompt": ...}`` object or
    one ``{"messages": [...]}`` object (``specdec bench --export-prompts``' format), whose
    last user message is the prompt."""
    file = Path(path)
    if not file.exists():
        raise SystemExit(f"error: prompts file {path!r} does not exist")
    prompts = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if file.suffix != ".jsonl":
            prompts.append(line)
            continue
        try:
            prompts.append(_jsonl_prompt(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise SystemExit(
                f'error: {path}:{n} is neither a {{"prompt": "..."}} nor a {{"messages": '
                f"[...]}} JSON object with a user message ({e})"
            ) from None
    return prompts


def _jsonl_prompt(record: dict) -> str:
    if "prompt" in record:
        prompt = record["prompt"]
    else:
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        if not users:
            raise ValueError("no user message")
        prompt = users[-1]
    if not isinstance(prompt, str):
        raise TypeError(f"the prompt is a {type(prompt).__name__}, not a string")
    return prompt


def _max_tokens(value: str) -> int | None:
    """``--max-tokens``: an integer >= 1, or ``none`` (until EOS or the context ends)."""
    if value.strip().lower() == "none":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r}: use an integer >= 1, or none to generate until EOS or the context ends"
        )
    return n


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="*", help="prompts (default: three example prompts)")
    p.add_argument(
        "--prompts-file",
        metavar="FILE",
        help=".txt (one per line) or .jsonl ({prompt} or {messages} objects), added after the "
        "prompts given (default: none)",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="send prompts as plain text instead of through the chat template",
    )
    p.add_argument(
        "--max-tokens",
        type=_max_tokens,
        default=128,
        metavar="N",
        help="output tokens per prompt at most; none: until EOS or the context ends "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default: %(default)s)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling: keep the smallest set of tokens whose probability reaches P; "
        "1 keeps all (default: %(default)s)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="sample among the K most likely tokens; 0 or -1 keeps all (default: %(default)s)",
    )
    p.add_argument(
        "--sample-seed",
        type=int,
        default=None,
        help="per-request sampling seed: the same seed gives the same output at any batch "
        "size (default: none, the engine's RNG, see --seed)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        help="stop string, not included in the output; repeatable (default: none, stop at "
        "EOS or --max-tokens)",
    )
    p.add_argument(
        "--json",
        dest="json_out",
        metavar="FILE",
        help="also write outputs, timing and speculation figures to this file (default: "
        "print only)",
    )
    p.add_argument(
        "--compare-plain",
        action="store_true",
        help="with --draft: rerun the prompts without speculation on the same engine "
        "settings and print the speedup and whether outputs match",
    )
    _add_engine_args(p, draft="auto")


@command("generate", _generate_args)
def cmd_generate(args: argparse.Namespace) -> int:
    """Generate completions for prompts on the engine (offline batch).

    By default the model speculates with its shipped EAGLE-3 head when it has one (--draft
    auto). Speculation is lossless: greedy outputs are plain decoding's tokens, sampled ones
    follow the target's distribution. --compare-plain reruns the prompts without it and
    prints the speedup.

        specdec generate "Explain speculative decoding in one sentence."
        specdec generate --prompts-file prompts.txt --draft ngram --compare-plain
    """
    from specdec import LLM, SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += _read_prompts(args.prompts_file)
    prompts = prompts or DEFAULT_PROMPTS
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sample_seed,
        stop=args.stop,
    )
    engine_kwargs = _engine_kwargs(args)
    if args.compare_plain and engine_kwargs["speculative"] is None:
        raise ValueError(
            f"--compare-plain compares speculation with plain decoding, but {args.model!r} "
            "ships no head; add --draft"
        )
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs)
    load_s = time.perf_counter() - t0
    outputs, gen_s = _run(llm, prompts, params, args.raw)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"\n### {prompt}\n{out.outputs[0].text}")
    runtime = llm.engine.runner.runtime
    print(
        f"\n{len(outputs)} requests, {num_out} tokens in {gen_s:.2f} s "
        f"({num_out / gen_s:.1f} tokens/s; model loaded in {load_s:.1f} s) "
        f"on {runtime.device} {str(runtime.dtype).removeprefix('torch.')}, "
        f"attention={runtime.attention_backend}"
    )
    report: dict = {"seconds": gen_s, "tokens_per_s": num_out / gen_s}
    if llm.engine.proposer is not None:
        stats = llm.engine.spec_stats
        spec = llm.engine.config.speculative
        print(f"speculation ({spec.method}{', ' + spec.model if spec.model else ''}): "
              f"{stats.summary()}")  # fmt: skip
        report["speculation"] = {
            "steps": stats.steps,
            "drafted_tokens": stats.drafted_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "tau": stats.tau,
            "acceptance_rates": stats.acceptance_rates,
        }
    if args.compare_plain:
        del llm
        plain = LLM(args.model, **{**_engine_kwargs(args), "speculative": None})
        plain_outputs, plain_s = _run(plain, prompts, params, args.raw)
        plain_out = sum(len(o.outputs[0].token_ids) for o in plain_outputs)
        same = sum(
            a.outputs[0].token_ids == b.outputs[0].token_ids
            for a, b in zip(outputs, plain_outputs, strict=True)
        )
        speedup = (num_out / gen_s) / (plain_out / plain_s)
        print(
            f"plain decoding: {plain_out / plain_s:.1f} tokens/s; speedup {speedup:.2f}x; "
            f"identical outputs {same}/{len(outputs)}"
        )
        report["plain_tokens_per_s"] = plain_out / plain_s
        report["speedup"] = speedup
        report["identical_outputs"] = same
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "outputs": [
                        {
                            "prompt": p,
                            "text": o.outputs[0].text,
                            "token_ids": o.outputs[0].token_ids,
                            "finish_reason": o.outputs[0].finish_reason,
                        }
                        for p, o in zip(prompts, outputs, strict=True)
                    ],
                    **report,
                },
                indent=1,
            )
        )
    return 0


def _run(llm, prompts: list[str], params, raw: bool):
    """Outputs and seconds for one pass over the prompts (chat template unless raw)."""
    t0 = time.perf_counter()
    if raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return outputs, time.perf_counter() - t0


# Modules whose ``@command`` functions register the other subcommands. Each keeps its
# heavy imports inside the command, so loading them all costs milliseconds.
COMMAND_MODULES = (
    "specdec.data_gen.cli",
    "specdec.serve.cli",
    "specdec.train.cli",
    "specdec.bench.cli",
    "specdec.interop.cli",
    "specdec.bench.reasoning_cli",
)


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions keep their paragraphs, and indented lines (examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks = []
        for block in inspect.cleandoc(text).split("\n\n"):
            if block.startswith(" "):
                blocks.append("\n".join(indent + line for line in block.splitlines()))
            else:
                blocks.append(super()._fill_text(block, width, indent))
        return "\n\n".join(blocks)


def summary(fn: Callable) -> str:
    """A command's one-line summary: its docstring's first paragraph, on one line."""
    first = inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0]
    return " ".join(first.split())


def build_parser() -> argparse.ArgumentParser:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    parser = argparse.ArgumentParser(
        prog="specdec", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="log messages of this level and above; INFO adds progress messages, such as a "
        "GGUF file's one-time conversion (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    for name, (add_args, fn) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=summary(fn),
            description=fn.__doc__,
            formatter_class=HelpFormatter,
        )
        add_args(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: a clear message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run the canonical module's main: subcommand modules register into
    # ``specdec.cli.COMMANDS``, not into this ``__main__`` copy (``python -m specdec.cli``,
    # as ``accelerate launch -m`` runs it).
    from specdec import cli

    sys.exit(cli.main())
