"""``run_bench``: every speculation config × set × batch size, measured against plain
decoding on the same engine settings, interleaved; then the optional analysis passes and
peers. The plain engine lives for the whole run; one speculating engine at a time.

A row's requests are the set's prompts cycled to ``BenchConfig.waves`` batches' worth.
Prefix caching is off (repeats would otherwise skip their prefill), ``max_num_seqs`` and
the CUDA-graph batch limit are the largest batch size. A config or row that fails is
reported with its error and the run goes on: one broken config must not hide the rest.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.bench import passes
from specdec.bench.config import BenchConfig, shape_fields
from specdec.bench.driver import Run, RunParams
from specdec.bench.env import command_line, env_info, git_commit, git_dirty
from specdec.bench.measure import (
    WARMUP_TOKENS,
    Agreement,
    Timing,
    compare,
    measure_engines,
    measure_interleaved,
    merged_stats,
    per_prompt_counts,
)
from specdec.bench.peers import build_peers
from specdec.bench.report import (
    BenchRow,
    PeerRow,
    PromptInfo,
    PromptRow,
    Report,
    SetReport,
    TraceReport,
    markdown,
)
from specdec.bench.sets import BenchSet, file_set, get_set
from specdec.bench.sets.jsonl import write_prompt_file
from specdec.config import SpeculativeConfig
from specdec.data_gen.records import Conversation
from specdec.engine.llm import LLM
from specdec.engine.runtime import engine_dtype, kv_bytes_per_block
from specdec.models import load_config

_GIB = 1 << 30


# The KV cache of every engine a GPU bench builds, unless the engine keywords size it: what
# this many bytes hold in the target's K/V layout.
BENCH_KV_BYTES = 8 * _GIB


def build_llm(
    model: str, engine: dict[str, Any], spec: SpeculativeConfig | None, largest_batch: int
) -> LLM:
    """An engine for measuring: ``engine``'s ``LLM`` keywords, prefix caching off (repeats
    would skip their prefill), batch limits at the largest batch measured. On the GPU,
    unless ``engine`` sizes the KV cache, every engine holds the same number of tokens
    (``bench_kv_blocks``)."""
    kwargs = {**engine, "speculative": spec, "enable_prefix_caching": False}
    kwargs.update(max_num_seqs=largest_batch, cuda_graph_max_batch_size=largest_batch)
    sized = any(kwargs.get(k) is not None for k in ("kv_cache_memory", "num_blocks"))
    if not sized and torch.cuda.is_available():
        kwargs["num_blocks"] = bench_kv_blocks(model, kwargs)
    return LLM(model, **kwargs)


def bench_kv_blocks(model: str, engine: dict[str, Any]) -> int:
    """KV blocks for a GPU bench engine: ``BENCH_KV_BYTES`` of the target's K/V. Two
    engines share the GPU, so sizing each from free memory would starve the second; and a
    count of blocks rather than bytes, since an EAGLE-3 engine also keeps each slot's aux
    states (~15% more bytes per token on SmolLM2): at a byte budget it would hold fewer
    tokens, and a batch near that capacity would measure memory instead of speed."""
    config = load_config(model, engine.get("cache_dir"))
    on_gpu = str(engine.get("device") or "auto").split(":")[0] in ("auto", "cuda")
    dtype = engine_dtype(engine.get("dtype") or "auto", on_gpu)
    per_block = kv_bytes_per_block(config, engine.get("block_size") or 16, dtype)
    return max(2, BENCH_KV_BYTES // per_block)


def _build(config: BenchConfig, spec: SpeculativeConfig | None) -> LLM:
    return build_llm(config.model, config.engine, spec, max(config.batch_sizes))


def encode(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    """Prompt token ids: the chat template when the model has one, else the user text."""
    if getattr(llm.tokenizer, "chat_template", None) is None:
        text = "\n\n".join(m["content"] for m in messages if m["role"] != "assistant")
        return llm.tokenizer.encode(text)
    return llm.apply_chat_template(messages, add_generation_prompt=True)


def select_prompts(
    bench_set: BenchSet, llm: LLM, config: BenchConfig
) -> tuple[SetReport, list[list[int]]]:
    """The set's first ``num_prompts`` prompts that fit ``max_prompt_tokens``."""
    limit = config.max_prompt_tokens or llm.engine.max_model_len - config.max_tokens
    infos, ids, skipped = [], [], 0
    conv: Conversation
    for conv in bench_set.load(config.set_options):
        tokens = encode(llm, list(conv.messages))
        if len(tokens) > limit:
            skipped += 1
            continue
        infos.append(PromptInfo(conv.id, list(conv.messages), len(tokens)))
        ids.append(tokens)
        if len(ids) == config.num_prompts:
            break
    if not ids:
        raise ValueError(
            f"bench set {bench_set.name!r}: no prompt fits in {limit:,} tokens ({skipped} "
            "too long); raise --max-prompt-tokens / --max-model-len or lower --max-tokens"
        )
    report = SetReport(bench_set.name, bench_set.description, bench_set.source, infos, skipped)
    return report, ids


def export_prompts(config: BenchConfig, out_dir: str | Path) -> list[Path]:
    """Write each set's selected prompts to ``out_dir/<set>.jsonl``; ``--prompts`` on those
    files selects the same prompts on a machine without the data packages."""
    llm = _build(config, None)  # selection counts tokens with the model's template
    paths = []
    for bench_set in bench_sets(config):
        set_report, _ = select_prompts(bench_set, llm, config)
        convs = [Conversation(p.id, tuple(p.messages), bench_set.name) for p in set_report.prompts]
        paths.append(Path(out_dir) / f"{bench_set.name}.jsonl")
        write_prompt_file(paths[-1], convs)
    return paths


def bench_sets(config: BenchConfig) -> list[BenchSet]:
    sets = [get_set(n) for n in config.sets] + [file_set(p) for p in config.prompt_files]
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"bench set names repeat: {names}; rename a --prompts file")
    return sets


# ---------------------------------------------------------------------------- one row


def summarize_row(
    row: BenchRow, plain_runs: list[Run], spec_runs: list[Run], depth: int
) -> BenchRow:
    """Fill ``row``'s figures from its interleaved runs (``BenchRow`` invariants). Outputs
    are compared request by request (a cycled prompt's every request with plain's);
    per-prompt counters fold each prompt's requests (``per_prompt_counts``)."""
    row.plain, row.spec = Timing.of(plain_runs), Timing.of(spec_runs)
    row.speedup = row.spec.tokens_per_s / row.plain.tokens_per_s
    stats = merged_stats(spec_runs)
    row.steps, row.drafted_tokens = stats.steps, stats.drafted_tokens
    row.accepted_tokens = stats.accepted_tokens
    if stats.steps:
        row.tau = stats.tau
        row.tau_per_verified = (stats.accepted_tokens + stats.steps) / (
            stats.steps + stats.drafted_tokens
        )
        # Counted up to the deepest acceptance seen: pad to the depth drafted.
        pad = max(0, depth - len(stats.accepted_at_least))
        row.accepted_at_least = stats.accepted_at_least + [0] * pad
        row.acceptance_rates = stats.acceptance_rates + [0.0] * pad
    else:
        row.note = "no verify steps (the proposer never drafted)"
    agreement = Agreement.of(spec_runs, plain_runs[0].token_ids)
    row.identical, row.compared = agreement.identical, agreement.compared
    row.first_mismatch_at = agreement.first_mismatch_at
    row.note = "; ".join(x for x in (row.note, agreement.note) if x)
    row.per_prompt = [
        PromptRow(
            index=i,
            output_tokens=len(spec_runs[0].requests[i].output_ids),
            steps=c.steps,
            drafted_tokens=c.drafted_tokens,
            accepted_tokens=c.accepted_tokens,
            tau=c.tau,
            ttft_s=statistics.median(c.ttft_s) if c.ttft_s else None,
            tpot_s=statistics.median(c.tpot_s) if c.tpot_s else None,
        )
        for i, c in enumerate(per_prompt_counts(spec_runs, row.num_prompts))
    ]
    return row


def measure_row(
    config: BenchConfig,
    plain: LLM,
    spec_llm: LLM,
    row: BenchRow,
    prompts: list[list[int]],
) -> tuple[BenchRow, list[Run]]:
    """Plain and speculative runs of one set at one batch size, interleaved; the set's
    prompts cycled to ``config.num_requests`` requests."""
    run = RunParams(config.max_tokens, config.ignore_eos, concurrency=row.batch_size)
    requests = [prompts[j % len(prompts)] for j in range(row.num_requests)]
    pipeline = spec_llm.engine.pipeline
    launches = pipeline.num_launches if pipeline is not None else 0
    runs = measure_engines(
        {"plain": plain, "spec": spec_llm}, requests, run, config.repeats, config.warmup
    )
    depth = spec_llm.engine.config.speculative.tree_shape.depth
    summarize_row(row, runs["plain"], runs["spec"], depth)
    reference = runs["plain"][0].token_ids
    divergences = list(dict.fromkeys(
        d for r in runs["spec"] for d in passes.first_divergences(r.token_ids, reference)
    ))  # fmt: skip
    gaps = passes.divergence_gaps(plain, requests, reference, divergences)
    row.divergence_gaps = [round(g, 4) for g in gaps]
    if gaps:
        row.note += f" (plain's largest logprob gap there {max(gaps):.3f} nats, {len(gaps)} seen)"
    t2d = passes.draft_vocab(spec_llm)
    row.vocab_coverage = passes.vocab_coverage(t2d, runs["spec"][0].token_ids)
    row.draft_vocab_size = int(t2d.sum()) if t2d is not None else None
    if pipeline is not None:  # this row's runs (warm-up included)
        row.pipelined_launches = pipeline.num_launches - launches
    return row, runs["plain"]


# ---------------------------------------------------------------------------- the run


def _new_row(config: BenchConfig, spec: SpeculativeConfig, set_name: str, n: int, batch: int):
    return BenchRow(
        set=set_name,
        label=config.label_of(spec),
        speculative=dataclasses.asdict(spec),
        shape=shape_fields(spec),
        batch_size=batch,
        num_prompts=n,
        num_requests=config.num_requests(n, batch),
        max_tokens=config.max_tokens,
        repeats=config.repeats,
    )


class _Bench:
    """The state of one run: the report being filled, the plain engine, progress."""

    def __init__(self, config: BenchConfig, argv: list[str] | None) -> None:
        self.config = config
        self.report = Report(
            command=command_line(argv),
            git_commit=git_commit(),
            git_dirty=git_dirty(),
            config=dataclasses.asdict(config),
        )
        self.plain = _build(config, None)
        runtime = self.plain.engine.runner.runtime
        self.report.env = env_info(runtime.device, runtime.dtype)
        self.prompts: dict[str, list[list[int]]] = {}
        for bench_set in bench_sets(config):
            set_report, ids = select_prompts(bench_set, self.plain, config)
            self.report.sets[bench_set.name] = set_report
            self.prompts[bench_set.name] = ids

    def save(self) -> None:
        if self.config.json_path:
            self.report.write_json(self.config.json_path)

    def _record_outputs(self, set_name: str, plain_runs: list[Run]) -> None:
        """The set's plain greedy outputs (once: every row's plain runs emit the same)."""
        infos = self.report.sets[set_name].prompts
        if infos[0].output_ids:
            return
        # Request i < num_prompts is prompt i (cycled prompts repeat after them).
        for info, request in zip(infos, plain_runs[0].requests[: len(infos)], strict=True):
            info.output_ids = request.output_ids
            info.output_text = self.plain.tokenizer.decode(
                request.output_ids, skip_special_tokens=True
            )

    def run_config(self, spec: SpeculativeConfig, bar: tqdm) -> None:
        config = self.config
        try:
            spec_llm = _build(config, spec)
        except Exception as e:  # report it, go on with the other configs
            for set_name, prompts in self.prompts.items():
                for batch in config.batch_sizes:
                    row = _new_row(config, spec, set_name, len(prompts), batch)
                    row.note = f"FAILED: {type(e).__name__}: {e}"[:300]
                    self.report.rows.append(row)
                    bar.update()
            tqdm.write(f"{config.label_of(spec)} FAILED to build: {type(e).__name__}: {e}")
            return
        for set_name, prompts in self.prompts.items():
            for batch in config.batch_sizes:
                bar.set_postfix_str(f"{set_name} {config.label_of(spec)} batch {batch}")
                row = _new_row(config, spec, set_name, len(prompts), batch)
                try:
                    row, plain_runs = measure_row(config, self.plain, spec_llm, row, prompts)
                    self._record_outputs(set_name, plain_runs)
                except Exception as e:  # a failed row is reported, not fatal
                    row.note = f"FAILED: {type(e).__name__}: {e}"[:300]
                self.report.rows.append(row)
                tqdm.write(markdown(dataclasses.replace(self.report, rows=[row])).splitlines()[-1])
                self.save()
                bar.update()
            if config.analysis:
                run = RunParams(config.max_tokens, config.ignore_eos, max(config.batch_sizes))
                steps = passes.trace_steps(spec_llm, prompts, run)
                self.report.traces.append(
                    TraceReport(set_name, config.label_of(spec), run.concurrency, steps)
                )
                self.save()
        del spec_llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def run_entropy(self) -> None:
        run = RunParams(
            self.config.max_tokens, self.config.ignore_eos, max(self.config.batch_sizes)
        )
        for set_name, prompts in self.prompts.items():
            entropies, outputs = passes.target_entropy(self.plain, prompts, run)
            for info, entropy, out in zip(
                self.report.sets[set_name].prompts, entropies, outputs, strict=True
            ):
                # Past a divergence from the reference output (bf16 batching may flip a
                # near-tied argmax) the entropies describe another text: cut them there.
                if not info.output_ids:  # every row of the set failed: take these
                    info.output_ids = out
                _, first = compare([out], [info.output_ids])
                info.target_entropy = entropy if first is None else entropy[:first]
        self.save()

    def run_peers(self) -> None:
        config = self.config
        runtime = self.plain.engine.runner.runtime
        peers = build_peers(config.peers, config.model, runtime.device, runtime.dtype)
        eos = list(self.plain.engine.eos_token_ids)
        run = RunParams(config.max_tokens, config.ignore_eos, concurrency=1)
        warm = dataclasses.replace(run, max_tokens=min(WARMUP_TOKENS, config.max_tokens))
        for set_name, prompts in tqdm(
            self.prompts.items(), desc="peers", disable=not config.progress
        ):
            runs = measure_interleaved(
                {name: partial(peer, prompts, run, eos) for name, peer in peers.items()},
                config.repeats,
                warmups={
                    name: partial(peer, prompts[:1], warm, eos) for name, peer in peers.items()
                },
                warmup=config.warmup,
            )
            reference = [p.output_ids for p in self.report.sets[set_name].prompts]
            for name, peer_runs in runs.items():
                row = PeerRow(set_name, name, 1, Timing.of(peer_runs))
                if all(reference):
                    agreement = Agreement.of(peer_runs, reference)
                    row.identical, row.compared = agreement.identical, agreement.compared
                    row.note = agreement.note
                self.report.peers.append(row)
            self.save()


def run_bench(
    config: BenchConfig, argv: list[str] | None = None, skipped_configs: list[str] | None = None
) -> Report:
    """Measure everything ``config`` names; the JSON (if asked) is rewritten after every
    row. ``skipped_configs``: sweep points left out, recorded in the report. Returns the
    report."""
    bench = _Bench(config, argv)
    bench.report.skipped_configs = list(skipped_configs or [])
    bench.save()
    total = len(config.speculative) * len(bench.prompts) * len(config.batch_sizes)
    with tqdm(total=total, desc="bench", unit="row", disable=not config.progress) as bar:
        tqdm.write(markdown(dataclasses.replace(bench.report, rows=[])))
        for spec in config.speculative:
            bench.run_config(spec, bar)
    if config.analysis:
        bench.run_entropy()
    if config.peers.enabled:
        bench.run_peers()
    return bench.report
