"""``specdec eval-reasoning``: a reasoning model on held-out reasoning-gym items — accuracy,
think length and latency, overall and per task — as JSON and Markdown.

Items are the eval split of ``data-gen reasoning-traces`` (records with task, seed and
params; the reference trace is ignored). Each prompt is the record's user turn through the
model's chat template; generation is greedy unless sampling options say otherwise. A reply
is read with ``reasoning.format.parse``: the answer is the text after the first
``</think>`` (the whole reply when it has no think span); an unclosed think span has no
answer (score 0). The verifier is the task's
own ``score_answer`` on the entry rebuilt from (task, seed, params).

Definitions (per item): ``correct`` = verifier score 1.0; ``think_tokens`` = generated
tokens through ``</think>`` (all of them when unclosed, 0 without a think span);
``latency_s`` = seconds from submitting the request to its last token, with at most
``concurrency`` requests in flight. The same items, options and engine with SpecExit on
and off (``--spec-exit``) give the comparison SpecExit is judged by; the settings given
override the draft head's recorded ones (``spec_exit_defaults``), which override the
library defaults, and the report's ``sampling.spec_exit`` holds the settings that ran.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec.data_gen.reasoning.format import parse
from specdec.data_gen.reasoning.tasks import Scorer
from specdec.spec.spec_exit_runtime import SpecExitRuntime


@dataclass(frozen=True)
class EvalConfig:
    """``engine``: ``LLM`` keyword arguments; ``sampling``: extra ``SamplingParams``
    fields (e.g. ``{"spec_exit": {...}}``) on top of greedy decoding and ``max_tokens``."""

    model: str
    traces: str
    output: str | None = None  # directory for report.json and report.md
    per_task: int | None = None  # the first N items of each task (None: every item)
    max_tokens: int = 1024
    concurrency: int | None = None  # requests in flight (None: all at once)
    sampling: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.per_task is not None and self.per_task < 1:
            raise ValueError(f"per_task={self.per_task} must be >= 1 (or None for every item)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1 (or None for all)")


@dataclass
class ItemResult:
    id: str
    task: str
    score: float
    correct: bool
    opened: bool
    closed: bool
    think_tokens: int
    output_tokens: int
    latency_s: float
    answer: str | None


def load_items(path: str | Path, per_task: int | None = None) -> list[dict[str, Any]]:
    """The records of a traces file (``.jsonl`` or ``.jsonl.gz``; the first ``per_task``
    of each task)."""
    from specdec.data_gen.records import SkipCounts
    from specdec.data_gen.sources import iter_jsonl

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; write an eval split with `specdec "
            "data-gen reasoning-traces --split eval --out FILE`"
        )
    items, skipped, counts = [], SkipCounts(), {}
    for n, rec in iter_jsonl(path, skipped):
        missing = {"id", "task", "seed", "params", "conversations"} - set(rec)
        if missing:
            raise ValueError(f"{path}:{n} lacks {sorted(missing)}: not a traces record")
        counts[rec["task"]] = counts.get(rec["task"], 0) + 1
        if per_task is None or counts[rec["task"]] <= per_task:
            items.append(rec)
    broken = {k: v for k, v in skipped.counts.items() if k != "empty"}
    if broken or not items:
        raise ValueError(f"{path}: no records, or unreadable lines {broken}")
    return items


def tokens_through(tokenizer, token_ids: list[int], chars: int) -> int:
    """The fewest leading tokens whose decoded text covers ``chars`` characters."""
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(token_ids[:mid], skip_special_tokens=True)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def sampling_params(config: EvalConfig, head_spec_exit: dict[str, Any] | None = None):
    """Greedy ``SamplingParams`` with ``config.sampling`` on top; an unknown field is an
    error naming the known ones. ``spec_exit`` may be a mapping of ``SpecExitParams``
    fields (what ``--spec-exit JSON`` gives), layered over ``head_spec_exit`` (the draft
    head's recorded setting) by ``spec_exit_params``: ``{}`` takes the head's setting, else
    the library defaults."""
    from specdec.sampling_params import RequestOutputKind, SamplingParams
    from specdec.spec_exit_params import spec_exit_params

    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(config.sampling) - known)
    if unknown:
        raise ValueError(
            f"sampling options {unknown} are not SamplingParams fields in this build; known: "
            f"{sorted(known)}"
        )
    base = {"temperature": 0.0, "max_tokens": config.max_tokens}
    sampling = dict(config.sampling)
    if isinstance(sampling.get("spec_exit"), dict):
        sampling["spec_exit"] = spec_exit_params(head_spec_exit, sampling["spec_exit"])
    return SamplingParams(**{**base, **sampling, "output_kind": RequestOutputKind.FINAL_ONLY})


def recorded_spec_exit(config: EvalConfig) -> dict[str, Any] | None:
    """The draft head's recorded SpecExit setting (``Eagle3Config.spec_exit_defaults``),
    read from its config.json without loading the model, so the early check of
    ``sampling_params`` layers ``--spec-exit`` over what the engine will (it hands the
    same record on once loaded). None: no ``spec_exit`` fields given, no EAGLE-3 head, or
    no record."""
    if not isinstance(config.sampling.get("spec_exit"), dict):
        return None
    from specdec.config import EngineConfig
    from specdec.models.eagle3_formats import read_eagle3_config
    from specdec.models.loader import load_config

    spec = EngineConfig.from_flat(config.model, **dict(config.engine)).speculative
    if spec is None or spec.method != "eagle3" or spec.model is None:
        return None
    return read_eagle3_config(spec.model, load_config(config.model)).spec_exit_defaults


def generate(llm, prompts: list[list[int]], params, concurrency: int | None):
    """(output, latency seconds) per prompt, in order, with at most ``concurrency``
    requests in flight."""
    engine, window = llm.engine, concurrency or len(prompts)
    results: list[Any] = [None] * len(prompts)
    started: dict[str, tuple[int, float]] = {}
    pending = iter(enumerate(prompts))
    bar = tqdm(total=len(prompts), desc="eval-reasoning", unit="item")
    try:
        while True:
            while len(started) < window and (nxt := next(pending, None)) is not None:
                i, ids = nxt
                started[engine.add_request(ids, params)] = (i, time.perf_counter())
            if not started:
                break
            for out in engine.step():
                if out.finished and out.request_id in started:
                    i, t0 = started.pop(out.request_id)
                    results[i] = (out, time.perf_counter() - t0)
                    bar.update(1)
    finally:
        bar.close()
    return results


def run_eval(config: EvalConfig, llm=None) -> dict[str, Any]:
    """Generate, score and summarise (module docstring); writes the report files when
    ``config.output`` is set."""
    items = load_items(config.traces, config.per_task)
    # Fail on bad options before the model loads, over the head's record as they will run.
    sampling_params(config, recorded_spec_exit(config))
    scorer = Scorer()
    for rec in items:  # fail on a bad item before any generation
        scorer.task(rec)
    if llm is None:
        from specdec.engine.llm import LLM

        llm = LLM(config.model, **config.engine)
    runtime = llm.engine.hook(SpecExitRuntime)  # the draft head's recorded setting is the base
    params = sampling_params(config, runtime.head_defaults if runtime is not None else None)
    prompts = [
        llm.apply_chat_template([{"role": "user", "content": r["conversations"][0]["content"]}])
        for r in items
    ]
    t0 = time.perf_counter()
    outputs = generate(llm, prompts, params, config.concurrency)
    seconds = time.perf_counter() - t0
    results = []
    for rec, (out, latency) in zip(items, outputs, strict=True):
        completion = out.outputs[0]
        parsed = parse(completion.text)
        score = scorer.score(rec, parsed)
        think = tokens_through(llm.tokenizer, completion.token_ids, parsed.think_end)
        results.append(
            ItemResult(
                rec["id"],
                rec["task"],
                score,
                score == 1.0,
                parsed.opened,
                parsed.closed,
                think,
                len(completion.token_ids),
                latency,
                parsed.answer,
            )
        )
    report = {
        "model": config.model,
        "traces": str(config.traces),
        "sampling": {k: v for k, v in asdict(params).items() if k != "output_kind"},
        "engine": {k: str(v) for k, v in config.engine.items()},
        "concurrency": config.concurrency,
        "seconds": seconds,
        "output_tokens_per_s": sum(r.output_tokens for r in results) / max(seconds, 1e-9),
        "overall": summarize(results),
        "tasks": {
            t: summarize([r for r in results if r.task == t])
            for t in dict.fromkeys(r.task for r in results)
        },
        "items": [asdict(r) for r in results],
    }
    if llm.engine.proposer is not None:
        report["speculation"] = llm.engine.spec_stats.summary()
    if params.spec_exit is not None:  # exits and the head's own estimate of tokens saved
        stats = llm.engine.hook(SpecExitRuntime).stats
        report["spec_exit"] = {"exits": stats.exits, "tokens_saved_estimate": stats.tokens_saved}
    if config.output:
        write_report(report, config.output)
    return report


def summarize(results: list[ItemResult]) -> dict[str, Any]:
    latencies = sorted(r.latency_s for r in results)
    return {
        "items": len(results),
        "accuracy": statistics.fmean(r.correct for r in results),
        "mean_score": statistics.fmean(r.score for r in results),
        "closed_rate": statistics.fmean(r.closed for r in results),
        "think_tokens": statistics.fmean(r.think_tokens for r in results),
        "output_tokens": statistics.fmean(r.output_tokens for r in results),
        "latency_s": statistics.fmean(latencies),
        "latency_p50_s": latencies[len(latencies) // 2],
        "latency_p90_s": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
    }


def markdown(report: dict[str, Any]) -> str:
    head = (
        "| task | items | accuracy | mean score | closed | think tokens | output tokens "
        "| latency s (mean / p50 / p90) |\n|---|---:|---:|---:|---:|---:|---:|---|"
    )
    rows = [_row(name, s) for name, s in report["tasks"].items()]
    rows.append(_row("**all**", report["overall"]))
    lines = [
        f"# eval-reasoning: {report['model']}",
        "",
        f"Items: `{report['traces']}`; sampling: `{json.dumps(report['sampling'])}`; "
        f"concurrency: {report['concurrency'] or 'all'}; {report['seconds']:.1f} s, "
        f"{report['output_tokens_per_s']:,.0f} output tokens/s.",
        "",
        head,
        *rows,
    ]
    if "speculation" in report:
        lines += ["", f"Speculation: {report['speculation']}"]
    if "spec_exit" in report:
        lines += ["", f"SpecExit: {report['spec_exit']}"]
    return "\n".join(lines) + "\n"


def _row(name: str, s: dict[str, Any]) -> str:
    return (
        f"| {name} | {s['items']} | {100 * s['accuracy']:.1f}% | {s['mean_score']:.3f} | "
        f"{100 * s['closed_rate']:.0f}% | {s['think_tokens']:.1f} | {s['output_tokens']:.1f} "
        f"| {s['latency_s']:.3f} / {s['latency_p50_s']:.3f} / {s['latency_p90_s']:.3f} |"
    )


def write_report(report: dict[str, Any], output: str | Path) -> tuple[Path, Path]:
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    return out / "report.json", out / "report.md"
