"""``data-gen reasoning-traces``: seeded worked solutions written as chat records (JSONL),
one per (task, seed), resumable.

Splits. Train items come from seeds [0, 1e9), eval items from [1e9, 2e9), and a question
belongs to the eval split iff a hash of its normalised text falls in one bucket of
``EVAL_BUCKETS`` (``question_split``): seeds never overlap, and neither does any question
text, however many records either side draws. Within a file questions are unique, and
none overlaps a benchmark set (``data_gen.decontam``: gsm_symbolic, HumanEval,
WritingBench).

Order and resume. Tasks are written one after another, each scanning its split's seeds in
increasing order and keeping the first ``num_per_task`` eligible ones; records are
appended and flushed one by one. A rerun reads the file (cutting a torn last line), skips
the ids it holds and continues the scan, so an interrupted run finishes with the bytes an
uninterrupted one writes; a larger ``num_per_task`` extends the file.

Record (one JSON object per line, keys sorted)::

    id             "<task>/<split>/<seed>"
    task, split, seed, params      the generator and its config (rebuilds the entry)
    conversations  [{"role": "user", ...}, {"role": "assistant", ...}]
    answer, oracle, score          our final answer, the generator's, and its verifier's
                                   score of ours (always 1.0: others are not written)
    think          {"chars": [0, e], "tokens": [0, t]}: "<think>" .. "</think>" in the reply
    answer_span    {"chars": [a, b], "tokens": [c, d]}: the final answer in the reply
    steps          [{"kind": "work"|"check", "chars": [..], "tokens": [..], "settled": bool}]
    settled_step   index of the step that first states the answer
    prompt_tokens  p: input_ids[p:] is the reply (+ end-of-turn); reply token i is p + i
    input_ids, loss_mask           the chat tokenised as training sees it (data_gen.chat)

Character offsets index the assistant's content; token offsets index the reply's tokens,
i.e. the tokens the model generates after the prompt (add ``prompt_tokens`` to index
``input_ids``). ``settled`` is true for the settled step and every later one: exiting the
think span at the end of such a step already gives the right answer — what SpecExit's
confidence labels are made of.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec.data_gen.chat import tokenize_conversation
from specdec.data_gen.decontam import BenchmarkConfig, Decontaminator, load_benchmark_prompts
from specdec.data_gen.reasoning.format import RenderedTrace, TraceStyle, Untraceable, render
from specdec.data_gen.reasoning.tasks import ReasoningTask, get_tasks
from specdec.data_gen.records import dumps_record, text_hash

logger = logging.getLogger(__name__)

SOURCE = "reasoning_traces"
SPLITS = {"train": (0, 10**9), "eval": (10**9, 2 * 10**9)}  # [first seed, end)
EVAL_BUCKETS = 8


def question_split(question: str) -> str:
    """The split a question text may appear in (a pure function of the text)."""
    return "eval" if int(text_hash(question)[:8], 16) % EVAL_BUCKETS == 0 else "train"


def record_id(task: str, split: str, seed: int) -> str:
    return f"{task}/{split}/{seed}"


@dataclass(frozen=True)
class TracesConfig:
    """``model`` names the tokenizer of token offsets and ``input_ids`` (the SFT base).
    ``max_scan`` bounds the seeds scanned per wanted record: a task whose question space
    holds fewer unique questions stops there with what it has (logged, and listed under
    ``short`` in the stats)."""

    output: str
    split: str = "train"
    tasks: tuple[str, ...] | None = None  # None: every registered task
    num_per_task: int = 1000
    model: str = "smollm2-135m-instruct"
    style: TraceStyle = field(default_factory=TraceStyle)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    ngram: int = 13
    max_scan: int = 50

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split={self.split!r}; choose one of {' | '.join(SPLITS)}")
        if self.num_per_task < 1:
            raise ValueError(f"num_per_task={self.num_per_task} must be >= 1")


def token_spans(tokenizer, text: str, spans: list[tuple[int, int]]):
    """Token ids of ``text`` alone (as it follows a chat prompt) and, for each character
    span, the tokens that overlap it as a [start, end) token range."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]

    def first_ending_after(c: int) -> int:
        return next((i for i, (_, e) in enumerate(offsets) if e > c), len(offsets))

    def first_starting_at(c: int) -> int:
        return next((i for i, (s, _) in enumerate(offsets) if s >= c), len(offsets))

    return list(enc["input_ids"]), [(first_ending_after(a), first_starting_at(b)) for a, b in spans]


def build_record(
    task: ReasoningTask,
    split: str,
    seed: int,
    entry: dict[str, Any],
    tokenizer,
    style: TraceStyle,
) -> dict[str, Any]:
    """The record of one item (module docstring). Raises ``Untraceable`` when the tracer
    cannot solve it or the verifier rejects the trace's answer."""
    rng = random.Random(f"{task.name}/{seed}")  # phrasing only; the item is the generator's
    trace: RenderedTrace = render(task.solve(entry, rng), rng, style)
    score = task.score(trace.answer, entry)
    if score != 1.0:
        raise Untraceable(f"the verifier scores the trace's answer {trace.answer!r} {score}")
    messages = [
        {"role": "user", "content": entry["question"]},
        {"role": "assistant", "content": trace.text},
    ]
    tok = tokenize_conversation(tokenizer, messages)
    prompt_tokens = tok.loss_mask.index(1)
    char_spans = [(0, trace.think_end), (trace.answer_start, len(trace.text))]
    char_spans += [(s.start, s.end) for s in trace.steps]
    reply_ids, tok_spans = token_spans(tokenizer, trace.text, char_spans)
    if tok.input_ids[prompt_tokens : prompt_tokens + len(reply_ids)] != reply_ids:
        raise ValueError(
            f"{task.name} seed {seed}: the reply tokenises differently inside the chat; "
            "token offsets would be wrong for this tokenizer"
        )
    steps = [
        {
            "kind": s.kind,
            "chars": [s.start, s.end],
            "tokens": list(t),
            "settled": i >= trace.settled_step,
        }
        for i, (s, t) in enumerate(zip(trace.steps, tok_spans[2:], strict=True))
    ]
    return {
        "id": record_id(task.name, split, seed),
        "source": SOURCE,
        "task": task.name,
        "split": split,
        "seed": seed,
        "params": task.params,
        "conversations": messages,
        "answer": trace.answer,
        "oracle": entry["answer"],
        "score": score,
        "think": {"chars": list(char_spans[0]), "tokens": list(tok_spans[0])},
        "answer_span": {"chars": list(char_spans[1]), "tokens": list(tok_spans[1])},
        "steps": steps,
        "settled_step": trace.settled_step,
        "prompt_tokens": prompt_tokens,
        "input_ids": tok.input_ids,
        "loss_mask": tok.loss_mask,
    }


@dataclass
class _Done:
    """What an existing output file already holds."""

    ids: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)  # task -> records
    questions: dict[str, set[str]] = field(default_factory=dict)  # task -> text hashes
    params: dict[str, dict] = field(default_factory=dict)  # task -> params seen


def read_done(path: Path, split: str) -> _Done:
    """Load the records of ``path`` (cutting a torn last line from a killed run)."""
    done = _Done()
    if not path.is_file():
        return done
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
        logger.warning("%s: cut a torn last line (an interrupted run); resuming", path)
    for n, line in enumerate(data.decode().splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(
                f"{path}:{n} is not JSON; the file is not a traces file we "
                "wrote, or was edited: move it away and rerun"
            ) from None
        if rec.get("split") != split:
            raise ValueError(
                f"{path} holds {rec.get('split')!r} records, not {split!r}; "
                "write each split to its own file"
            )
        task = rec["task"]
        done.ids.add(rec["id"])
        done.counts[task] = done.counts.get(task, 0) + 1
        done.questions.setdefault(task, set()).add(text_hash(rec["conversations"][0]["content"]))
        done.params.setdefault(task, rec["params"])
    return done


def run_traces(
    config: TracesConfig, *, decontaminator: Decontaminator | None = None, tokenizer=None
) -> dict[str, Any]:
    """Write (or finish) ``config.output``; returns counts of records written and skipped
    by reason. ``decontaminator`` / ``tokenizer`` default to the benchmark sets and the
    tokenizer of ``config.model``."""
    tasks = get_tasks(config.tasks)
    if tokenizer is None:
        from specdec.models import load_tokenizer

        tokenizer = load_tokenizer(config.model)
    if decontaminator is None:
        decontaminator = Decontaminator(load_benchmark_prompts(config.benchmark), config.ngram)
    path = Path(config.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(path, config.split)
    for task in tasks:
        if task.name in done.params and done.params[task.name] != task.params:
            raise ValueError(
                f"{path} holds {task.name} records made with params {done.params[task.name]}, "
                f"not {task.params}; write to a new file"
            )
    stats: dict[str, Any] = {"written": 0, "skipped": {}, "short": {}}
    total = config.num_per_task * len(tasks)
    initial = sum(min(done.counts.get(t.name, 0), config.num_per_task) for t in tasks)
    bar = tqdm(total=total, initial=initial, desc=f"reasoning traces ({config.split})", unit="rec")
    with path.open("a", encoding="utf-8") as out:
        for task in tasks:
            written = _write_task(task, config, done, decontaminator, tokenizer, out, bar, stats)
            stats["written"] += written
    bar.close()
    stats["records"] = sum(done.counts.get(t.name, 0) for t in tasks)
    return stats


def _write_task(
    task: ReasoningTask, config: TracesConfig, done: _Done, decontaminator: Decontaminator,
    tokenizer, out, bar, stats: dict[str, Any],
) -> int:  # fmt: skip
    """Scan ``task``'s seeds until it has ``num_per_task`` records; returns those written."""
    first, end = SPLITS[config.split]
    count = done.counts.get(task.name, 0)
    seen = done.questions.setdefault(task.name, set())
    skipped: dict[str, int] = stats["skipped"]
    limit = first + config.max_scan * config.num_per_task + 1000
    written, seed = 0, first
    while count < config.num_per_task:
        if seed >= min(end, limit):
            logger.warning(
                "%s: only %d of %d unique %s questions in seeds [%d, %d); the task's question "
                "space is smaller: its records stop here (raise its difficulty params for more)",
                task.name,
                count,
                config.num_per_task,
                config.split,
                first,
                seed,
            )
            stats["short"][task.name] = count
            bar.update(config.num_per_task - count)
            break
        rid = record_id(task.name, config.split, seed)
        seed += 1
        if rid in done.ids:
            continue
        entry = task.entry(seed - 1)
        question = entry["question"]
        reason = None
        if question_split(question) != config.split:
            reason = "other_split"
        elif text_hash(question) in seen:
            reason = "duplicate"
        elif decontaminator.overlaps(question):
            reason = "benchmark_overlap"
        if reason is None:
            try:
                record = build_record(task, config.split, seed - 1, entry, tokenizer, config.style)
            except Untraceable as e:
                logger.debug("%s: %s", rid, e)
                reason = "untraceable"
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        out.write(dumps_record(record) + "\n")
        out.flush()
        seen.add(text_hash(question))
        count += 1
        written += 1
        bar.update(1)
    done.counts[task.name] = count
    return written
