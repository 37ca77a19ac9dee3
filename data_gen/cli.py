"""``specdec data-gen STAGE``: the training-data pipeline, one resumable stage per
subcommand (flags in stage_args.py). Under ``torchrun`` / ``accelerate launch`` each rank
takes its share of the shards (RANK / WORLD_SIZE).

A draft head's data: ``prompts`` → ``regenerate`` → ``dump`` / ``vocab`` (``documents``
adds long requests around papers the target wrote); ``merge`` and ``verify`` finish and
check a stage directory. ``reasoning-traces``: worked ``<think>`` solutions of
reasoning-gym tasks (the reasoning target's SFT data and its held-out evaluation set;
data_gen/reasoning). ``exit-labels``: SpecExit confidence labels of a target's own
reasoning (an answer forced at each step boundary, scored by the task's verifier)."""

from __future__ import annotations

import argparse
import json
import sys

from specdec.cli import HelpFormatter, command
from specdec.cli_engine import engine_kwargs
from specdec.data_gen import stage_args

SUBCOMMANDS = {
    "prompts": (stage_args.prompts_args, "Build the prompt mix: dedup, decontaminate, shard."),
    "regenerate": (stage_args.regenerate_args, "Answer every conversation with the target."),
    "documents": (
        stage_args.documents_args,
        "Build long requests around papers the target wrote (the academic source).",
    ),
    "dump": (stage_args.dump_args, "Store the target's aux and last hidden states per token."),
    "vocab": (
        stage_args.vocab_args,
        "Build the draft vocabulary (d2t / t2d) from loss-token frequencies.",
    ),
    "merge": (stage_args.dir_args, "Write a stage directory's manifest once all its shards exist."),
    "verify": (stage_args.dir_args, "Check every shard of a stage directory against its sha256."),
    "reasoning-traces": (
        stage_args.traces_args,
        "Write worked <think> solutions of reasoning-gym tasks.",
    ),
    "exit-labels": (
        stage_args.exit_labels_args,
        "Label SpecExit confidence: answers forced at each step boundary, scored.",
    ),
}


def _add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="stage", required=True, title="stages", metavar="STAGE")
    for name, (add, help_) in SUBCOMMANDS.items():
        add(sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter))


@command("data-gen", _add_args)
def cmd_data_gen(args: argparse.Namespace) -> int:
    """Build training data for draft heads and targets, one resumable stage per subcommand.

    A draft head's data: prompts → regenerate (the target answers every prompt) → vocab,
    and dump (hidden states) for offline training; documents adds long requests around
    papers the target wrote. The reasoning target's: reasoning-traces, and exit-labels for
    SpecExit. merge and verify finish and check a stage's directory. Under torchrun or
    accelerate launch each rank takes its share of the shards.
    """
    return STAGES[args.stage](args)


def _prompts(args) -> int:
    from specdec.data_gen.decontam import BenchmarkConfig
    from specdec.data_gen.mix import MixConfig
    from specdec.data_gen.prompts import PromptsConfig, run_prompts

    mix = MixConfig(
        seed=args.seed,
        bigbench_per_task=args.bigbench_per_task,
        bigbench_multiple_choice=args.bigbench_multiple_choice,
        bigbench_archive=args.bigbench_archive,
        reasoning_gym_per_generator=args.reasoning_gym_per_generator,
        reasoning_gym_generators=tuple(args.reasoning_gym_generators or ()) or None,
        chatterbot_languages=tuple(args.chatterbot_languages),
        writing_prompts=args.writing_prompts,
        code_prompts=args.code_prompts,
        math_prompts=args.math_prompts,
        academic_papers=args.academic_papers,
        cache_dir=args.cache_dir,
        allow_download=not args.no_download,
    )
    bench = BenchmarkConfig(
        gsm_symbolic_size=args.gsm_symbolic_size,
        cache_dir=args.cache_dir,
        allow_download=not args.no_download,
    )
    config = PromptsConfig(
        output=args.output,
        sources=tuple(args.sources or ("mix",)),
        mix=mix,
        benchmark=bench,
        records_per_shard=args.records_per_shard,
        max_records=args.max_records,
        ngram=args.ngram,
        seed=args.seed,
    )
    return _report(run_prompts(config))


def _regenerate(args) -> int:
    from specdec.data_gen.regenerate import RegenerateConfig, run_regenerate

    engine = engine_kwargs(args)
    # Offline: throughput over time to first token. Admitting groups keeps most steps on
    # the decode graphs (SchedulerConfig.admit_batch), and a larger token budget computes
    # an admitted group's prompts in fewer eager steps: 32,768 against 8,192 cut the eager
    # steps' time from 3.5 to 1.3 s of 12-15 s and lifted regeneration 19% on the H200
    # (docs/benchmarks.md, "Data generation"; benchmarks/bench_regen.py).
    engine.setdefault("admit_batch", max(1, args.max_num_seqs // 4))
    engine.setdefault("max_num_batched_tokens", 32768)
    config = RegenerateConfig(
        input=args.input,
        output=args.output,
        model=args.model,
        engine=engine,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        max_turns=args.max_turns,
        seed=args.seed,
        chat_template=args.chat_template,
        records_per_shard=args.records_per_shard,
        max_inflight=args.max_inflight,
        record_workers=args.record_workers,
        verify=not args.no_verify,
    )
    stats = run_regenerate(config)
    print(
        f"regenerated {stats['generated_tokens']:,} tokens in {stats['seconds']:.1f} s "
        f"({stats.get('tokens_per_s', 0.0):,.0f} generated tokens/s), "
        f"{stats['shards_written']} shards written"
    )
    return _report(stats["manifest"])


def _documents(args) -> int:
    from specdec.data_gen.documents import DocumentsConfig, run_documents

    config = DocumentsConfig(
        input=args.input,
        output=args.output,
        tasks_per_paper=args.tasks_per_paper,
        min_sections=args.min_sections,
        records_per_shard=args.records_per_shard,
        seed=args.seed,
        **({"tasks": tuple(args.tasks)} if args.tasks else {}),
    )
    return _report(run_documents(config))


def _dump(args) -> int:
    from specdec.data_gen.dump import DumpConfig, run_dump

    config = DumpConfig(
        input=args.input,
        output=args.output,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        compute_dtype=args.compute_dtype,
        attention_backend=args.attention_backend,
        aux_layer_ids=tuple(args.aux_layer_ids) if args.aux_layer_ids else None,
        max_seq_len=args.max_seq_len,
        shard_bytes=int(args.shard_mb * 2**20),
        batch_tokens=args.batch_tokens,
        num_writers=args.num_writers,
        verify=not args.no_verify,
    )
    stats = run_dump(config)
    print(
        f"dumped {stats['tokens']:,} tokens in {stats['seconds']:.1f} s "
        f"({stats.get('tokens_per_s', 0.0):,.0f} tokens/s), "
        f"{stats['shards_written']} shards written"
    )
    return _report(stats["manifest"])


def _vocab(args) -> int:
    from specdec.data_gen.vocab import VocabConfig, run_vocab

    meta = run_vocab(
        VocabConfig(
            inputs=tuple(args.input),
            output=args.output,
            draft_vocab_size=args.draft_vocab_size,
            target_vocab_size=args.target_vocab_size,
            model=args.model,
        )
    )
    print(json.dumps(meta, indent=1))
    return 0


def _merge(args) -> int:
    from specdec.data_gen.stage import merge_dir

    return _report(merge_dir(args.directory))


def _verify(args) -> int:
    from specdec.data_gen.shards import verify_manifest

    bad = verify_manifest(args.directory)
    if bad:
        print(
            f"{len(bad)} shards missing or corrupt: {', '.join(bad[:10])}; rerun their stage "
            "to redo them",
            file=sys.stderr,
        )
        return 1
    print(f"{args.directory}: every shard matches its sha256")
    return 0


def _traces(args) -> int:
    from specdec.data_gen.decontam import BenchmarkConfig
    from specdec.data_gen.reasoning.format import TraceStyle
    from specdec.data_gen.reasoning.generate import TracesConfig, run_traces
    from specdec.data_gen.reasoning.tasks import registry

    if args.list_tasks:
        for name, task in registry().items():
            print(f"{name}: {json.dumps(task.params)}")
        return 0
    if not args.out:
        raise ValueError("data-gen reasoning-traces needs --out FILE.jsonl")
    config = TracesConfig(
        output=args.out,
        split=args.split,
        tasks=tuple(args.tasks) if args.tasks else None,
        num_per_task=args.num_per_task,
        model=args.model,
        style=TraceStyle(args.min_checks, args.max_checks, args.restate_prob),
        benchmark=BenchmarkConfig(
            gsm_symbolic_size=args.gsm_symbolic_size,
            cache_dir=args.cache_dir,
            allow_download=not args.no_download,
        ),
        ngram=args.ngram,
    )
    stats = run_traces(config)
    print(
        f"{args.out}: {stats['records']:,} {args.split} records ({stats['written']:,} new); "
        f"skipped {json.dumps(stats['skipped'])}"
        + (
            f"; fewer unique questions than asked: {json.dumps(stats['short'])}"
            if stats["short"]
            else ""
        )
    )
    return 0


def _exit_labels(args) -> int:
    from specdec.data_gen.reasoning.confidence import ExitLabelsConfig, run_exit_labels

    config = ExitLabelsConfig(
        input=args.input,
        output=args.output,
        model=args.model,
        target=args.target,
        items=args.items,
        engine=engine_kwargs(args),
        think_start=args.think_start,
        think_end=args.think_end,
        delimiters=tuple(args.delimiters),
        answer_prefix=args.answer_prefix,
        max_tokens=args.max_tokens,
        records_per_shard=args.records_per_shard,
        verify=not args.no_verify,
    )
    stats = run_exit_labels(config)
    print(
        f"{stats['probes']:,} forced answers scored in {stats['seconds']:.1f} s, "
        f"{stats['shards_written']} shards written"
    )
    return _report(stats["manifest"])


def _report(manifest: dict | None) -> int:
    if manifest is None:
        print("this rank's shards are done; the manifest is written when every rank's are")
        return 0
    counts = ", ".join(f"{k}={v:,}" for k, v in manifest["counts"].items())
    print(f"manifest: {manifest['num_shards']} shards; {counts}")
    return 0


STAGES = {
    "prompts": _prompts,
    "regenerate": _regenerate,
    "documents": _documents,
    "dump": _dump,
    "vocab": _vocab,
    "merge": _merge,
    "verify": _verify,
    "reasoning-traces": _traces,
    "exit-labels": _exit_labels,
}
