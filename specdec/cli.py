"""The ``specdec`` command. Subcommands register themselves in ``COMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
    "Give three tips for writing clear technical documentation.",
]

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable]] = {}


def command(name: str, add_args: Callable[[argparse.ArgumentParser], None]):
    """Register ``fn(args) -> exit code`` as ``specdec NAME``; its docstring is the help."""

    def register(fn):
        COMMANDS[name] = (add_args, fn)
        return fn

    return register


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="alias, HF model directory, .gguf file or hub name",
    )
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens computed per step (default: 8192; data-gen regenerate: 32768)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--admit-batch",
        type=int,
        default=None,
        help="start waiting requests in groups of this many so most steps replay CUDA "
        "graphs (default: 1, at once; data-gen regenerate: max-num-seqs / 4)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--triton-gemm-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="on CUDA, projections of at most N token rows (decode, verify and draft steps) "
        "run the skinny Triton GEMM instead of cuBLAS (experimental: slower than cuBLAS on "
        "the H200 so far); default 0: cuBLAS always",
    )
    g.add_argument(
        "--prefill-graph-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="on CUDA, steps with prompt tokens of at most N tokens replay a CUDA graph per "
        "(tokens, sequences) bucket instead of launching eagerly (default 8192, capped by "
        "--max-num-batched-tokens; 0: eager)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap host work with the device by keeping one step in flight (default: "
        "on for plain decoding with CUDA graphs, off otherwise)",
    )
    g.add_argument(
        "--draft",
        default=None,
        choices=["auto", "none", "ngram", "eagle3", "draft_model"],
        help="speculate with this proposer; auto: the model's shipped EAGLE-3 head when it "
        "has one (specdec/heads), else this command's fallback; none: plain decoding",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        help="EAGLE-3 head dir (eagle3; default: the model's shipped head) or draft LM "
        "(draft_model)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="chain length K, or the depth of a dynamic tree (default: the head's tree, else 3)",
    )
    g.add_argument(
        "--num-speculative-tokens-by-batch-size",
        type=_depth_bands,
        default=None,
        metavar="B:K,...",
        help="draft to depth K while at most B requests run, e.g. 4:5 (larger batches: "
        "--num-speculative-tokens), or another shape: 1:t8-d6-n32 (a dynamic tree), 4:c5 "
        "(a chain), @cuda after a shape for CUDA only; none: one shape for all (default: "
        "the head's)",
    )
    g.add_argument(
        "--spec-tree",
        default=None,
        choices=["chain", "dynamic", "static"],
        help="draft shape: a chain, EAGLE-2's dynamic tree, or --spec-choices (default: the "
        "head's, else chain)",
    )
    g.add_argument(
        "--spec-top-k", type=int, default=None, help="dynamic tree: children per node (8)"
    )
    g.add_argument(
        "--spec-total-tokens", type=int, default=None, help="dynamic tree: draft nodes kept (48)"
    )
    g.add_argument(
        "--spec-disable-by-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="decode plainly while more than N requests run (default: the head's, else never)",
    )
    g.add_argument(
        "--spec-pipelined",
        type=_on_off,
        default=None,
        metavar="on|off",
        help="launch each speculative step before reading the last one (greedy EAGLE-3; "
        "default: on with CUDA graphs)",
    )
    g.add_argument(
        "--spec-compile-head",
        type=_on_off,
        default=None,
        metavar="on|off",
        help="torch.compile the EAGLE-3 head inside its CUDA graphs (default: on)",
    )
    g.add_argument(
        "--spec-compile-growth",
        type=_on_off,
        default=None,
        metavar="on|off",
        help="with --spec-compile-head: compile the whole draft side of a captured step "
        "(index arithmetic, catch-up, every level, tree building) as one region, not only "
        "the head's layer and logits (default: on)",
    )
    g.add_argument(
        "--spec-choices",
        type=json.loads,
        default=None,
        help='static tree as JSON choice paths, e.g. "[[0], [1], [0, 0]]"',
    )


# --spec-* flags -> SpeculativeConfig fields (the tree shape and when to speculate)
TREE_FLAGS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "num_speculative_tokens_by_batch_size": "num_speculative_tokens_by_batch_size",
    "spec_tree": "tree",
    "spec_top_k": "top_k",
    "spec_total_tokens": "total_tokens",
    "spec_choices": "choices",
    "spec_disable_by_batch_size": "disable_by_batch_size",
    "spec_pipelined": "pipelined",
    "spec_compile_head": "compile_head",
    "spec_compile_growth": "compile_growth",
}


_TREE_BAND = re.compile(r"t(\d+)-d(\d+)-n(\d+)")


def _depth_bands(value: str) -> list[list]:
    """``B:K,B:K`` -> ``[[B, K], ...]``; ``B:tT-dD-nN`` -> ``[B, {dynamic tree}]``, ``B:cK``
    -> ``[B, {chain of K}]`` (``none``: [], no bands)."""
    if value.strip().lower() == "none":
        return []
    bands: list[list] = []
    try:
        for pair in value.split(","):
            batch, shape = pair.split(":")
            shape, at, device = shape.partition("@")
            tree = _TREE_BAND.fullmatch(shape)
            if tree:
                t, d, n = (int(g) for g in tree.groups())
                band = {"tree": "dynamic", "top_k": t, "num_speculative_tokens": d,
                        "total_tokens": n}  # fmt: skip
            elif shape.startswith("c"):
                band = {"tree": "chain", "num_speculative_tokens": int(shape[1:])}
            else:
                band = int(shape)
            if at:
                if not isinstance(band, dict) or not device:
                    raise ValueError(f"{pair}: @DEVICE follows a shape (t..-d..-n.. or cK)")
                band["device"] = device
            bands.append([int(batch), band])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: use MAX_BATCH:K pairs, e.g. 4:5 or 2:6,8:4, a shape per band "
            "(1:t8-d6-n32 a dynamic tree, 4:c5 a chain; 1:t8-d6-n32@cuda on CUDA only), "
            "or none"
        ) from None
    return bands


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{value!r}: use on or off")
    return value == "on"


def _speculative(args: argparse.Namespace, fallback: str | None = None):
    """``--draft``/``--draft-model``/``--spec-*`` -> ``SpeculativeConfig`` or None (plain).

    ``auto`` drafts with the model's shipped head (``specdec.models.packaged_heads``),
    else with ``fallback`` (None: plain decoding); ``eagle3`` without ``--draft-model``
    uses the shipped head. Tree flags given override the head's recorded tree (the
    shipped head's, or ``--draft-model``'s own), which overrides ``SpeculativeConfig``'s
    defaults."""
    from specdec.config import SpeculativeConfig
    from specdec.models.packaged_heads import default_speculative, head_speculative

    method = args.draft
    if method in (None, "none"):
        return None
    given = {flag: getattr(args, flag) for flag in TREE_FLAGS}
    tree = {TREE_FLAGS[flag]: value for flag, value in given.items() if value is not None}
    if method == "auto":
        if args.draft_model is not None:
            raise ValueError(
                f"--draft-model {args.draft_model} needs --draft eagle3 or --draft draft_model"
            )
        spec = default_speculative(args.model, **tree)
        if spec is not None or fallback is None:
            return spec
        method = fallback
    if method == "eagle3" and args.draft_model is None:
        spec = default_speculative(args.model, **tree)
        if spec is None:
            raise ValueError(
                f"--draft eagle3 needs --draft-model HEAD_DIR: {args.model!r} ships no head"
            )
        return spec
    if method == "eagle3":
        return head_speculative(args.draft_model, **tree)
    return SpeculativeConfig(method=method, model=args.draft_model, **tree)


def _engine_kwargs(args: argparse.Namespace, draft_fallback: str | None = None) -> dict:
    """``LLM`` keyword arguments from the engine flags; ``draft_fallback``: the proposer
    of ``--draft auto`` when the model ships no head (None: plain decoding)."""
    return dict(
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        **_given(
            max_num_batched_tokens=args.max_num_batched_tokens,
            admit_batch=args.admit_batch,
            triton_gemm_max_tokens=args.triton_gemm_max_tokens,
            prefill_graph_max_tokens=args.prefill_graph_max_tokens,
        ),
        seed=args.seed,
        speculative=_speculative(args, draft_fallback),
        async_scheduling=args.async_scheduling,
    )


def _given(**kwargs) -> dict:
    """The flags the user set: unset ones (None) keep the config's (or a command's) default."""
    return {k: v for k, v in kwargs.items() if v is not None}


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


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="*", help="prompts (default: three example prompts)")
    p.add_argument(
        "--prompts-file", help=".txt (one per line) or .jsonl ({prompt} or {messages} objects)"
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="send prompts as plain text instead of through the chat template",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--json", dest="json_out", help="write outputs and timing to this file")
    p.add_argument(
        "--compare-plain",
        action="store_true",
        help="with --draft: rerun the prompts without speculation on the same engine "
        "settings and print the speedup and whether outputs match",
    )
    _add_engine_args(p)
    p.set_defaults(draft="auto")  # the model's shipped head if any, else plain decoding


@command("generate", _generate_args)
def cmd_generate(args: argparse.Namespace) -> int:
    """Generate completions for prompts on the engine (offline batch)."""
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


def build_parser() -> argparse.ArgumentParser:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, fn) in COMMANDS.items():
        p = sub.add_parser(name, help=(fn.__doc__ or "").strip().split("\n")[0] or None)
        add_args(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
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
