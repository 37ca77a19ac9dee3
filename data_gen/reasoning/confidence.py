"""``data-gen exit-labels``: SpecExit confidence labels from a target's own reasoning.

Confidence at a point of a think span (docs/spec_exit.md) is whether an answer forced
there is already *settled*. For each record (the token ids of a reasoning conversation,
and for ``target="correct"`` the reasoning-gym item it answers), at the span's start (the
think-start marker's last token: an answer with no thinking) and at every step boundary
``j`` inside its think span the target is *probed*:

    input_ids[: j + 1] + think-end marker ids + answer-prefix ids  →  greedy answer

which is SpecExit's exit at that boundary (keep the tokens through the delimiter, force
the end marker) plus the separator the reasoning format writes before its answer
(``"\\n\\n"``, as running text: SmolLM2 writes it [198, 198]; ``answer_prefix=""`` leaves it
to the model, exactly the engine's exit). Position ``j`` (the delimiter's last token: what
the head has read when the policy decides to exit there) is labelled 1.0 or 0.0 by the
config's ``target`` (``JUDGES``):

- ``final`` (default): the answer equals the record's own final answer, the text after its
  think span (whitespace-normalised; a probe answer cut at ``max_tokens`` counts as
  different). An exit there would not change the reply's answer, right or wrong, so the
  head learns "the answer is settled" and needs no verifier: any reasoning data works.
- ``correct``: the task's reasoning-gym verifier gives it 1.0 (eval-reasoning's
  ``correct``). The head then also has to guess whether the settled answer is right,
  which it cannot see: a head trained on the reasoning target reads 0.6-0.8 at settled
  steps of wrong traces and 0.8-0.98 at right ones. On 256 of its train traces (chain_sum) the
  earliest exit that keeps the answer saves ~70% of the thinking under ``final``, ~50%
  under ``correct`` (no exit ever fires on a wrong trace).

Other positions have no label here; training fills them from the probes
(``train.spec_exit_labels.CONFIDENCE_HOLDS``: by default each token takes the label of the
boundary that closes its step, the one serving decides at).

Spans and boundaries are serving's and training's: the span is train-draft's
``find_think_span`` (markers as token sequences, ``specdec.think_markers``), a
boundary is a token whose text, joined with the span's text before it, ends one of
``delimiters`` (``SpecExitState``'s rule).

Output: a stage directory of ``labels-00000.jsonl`` shards; shard ``i`` holds input records
``[i*R, (i+1)*R)`` as they came, a labelled one with one more key::

    spec_exit_confidence  {"positions": [j, ...], "labels": [1.0 | 0.0, ...],
                           "answers": [the probe's answer text, ...]}

Records that cannot be labelled (no closed think span, no final answer after it, no item
for the verifier, no probe that fits the context, no token ids) pass through without it and
are counted, so a mixed data set stays whole. ``data-gen dump`` stores the labels as the
shard tensor ``spec_exit_confidence``; train-draft's online mode reads them from the
records (both through ``dump_plan.parse_confidence``).

Items (``target="correct"``): the verifier rebuilds the reasoning-gym entry from (task,
seed, params), read from the record itself (a traces record) or, for ``data-gen
regenerate`` output of traces prompts (which keeps each id and drops the rest), from
``items`` (the traces file) by id.

Batching and resume: every probe of a shard's records goes into one ``LLM.generate``,
record by record and each record's longest probe first (the shorter ones then reuse its
prefix blocks through the prefix cache). Shards are written whole and checksummed
(``ShardStore``); a rerun skips finished shards and redoes torn or stale ones, so it ends
with the bytes an uninterrupted run writes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from specdec.data_gen.dump_plan import CONFIDENCE_KEY
from specdec.data_gen.records import SkipCounts, dumps_record
from specdec.data_gen.shards import RankInfo, ShardStore, chunk_ranges, digest_json
from specdec.data_gen.stage import finish_stage, write_plan
from specdec.think_markers import as_marker

logger = logging.getLogger(__name__)

ITEM_KEYS = ("task", "seed", "params")  # what rebuilds a reasoning-gym entry
Score = Callable[[str], float]  # an answer's verifier score (1.0: correct)
# (item, record) -> the record's scorer. The default rebuilds the reasoning-gym entry.
Verifier = Callable[[dict[str, Any], dict[str, Any]], Score]


@dataclass(frozen=True)
class ExitLabelsConfig:
    """``engine``: ``LLM`` keyword arguments. ``think_start`` / ``think_end``: text or
    token ids (``think_markers``); ``delimiters``: step boundaries; ``answer_prefix``: text
    appended after the end marker; ``target``: what a label says (``JUDGES``: ``final`` or
    ``correct``; module docstring); ``max_tokens``: per probe answer."""

    input: str  # a stage directory (regenerate) or a JSONL file of records with input_ids
    output: str
    model: str = "smollm2-135m-instruct"
    target: str = "final"
    items: str | None = None  # traces JSONL: (task, seed, params) by id; target "correct"
    engine: dict[str, Any] = field(default_factory=dict)
    think_start: str | tuple[int, ...] = "<think>"
    think_end: str | tuple[int, ...] = "</think>"
    delimiters: tuple[str, ...] = ("\n\n",)
    answer_prefix: str = "\n\n"
    max_tokens: int = 32
    records_per_shard: int = 256
    verify: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "delimiters", tuple(self.delimiters))
        if not self.delimiters or not all(isinstance(d, str) and d for d in self.delimiters):
            raise ValueError(
                f"delimiters={list(self.delimiters)!r} must hold one or more non-empty "
                'strings, e.g. ["\\n\\n"]'
            )
        for name in ("think_start", "think_end"):
            value = getattr(self, name)
            if not isinstance(value, str):
                object.__setattr__(self, name, as_marker(value, name))
            elif not value:
                raise ValueError(f"{name} is empty; give the marker's text or token ids")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1 (answer tokens)")
        if self.target not in JUDGES:
            raise ValueError(
                f"target={self.target!r} is not a label target; choose from {sorted(JUDGES)} "
                "(final: the trace's own answer; correct: the task's verifier)"
            )
        if self.records_per_shard < 1:
            raise ValueError(f"records_per_shard={self.records_per_shard} must be >= 1")


# ---------------------------------------------------------------- pure parts


def running_text_ids(tokenizer, text: str) -> list[int]:
    """``text``'s ids as the model writes it before more text (SmolLM2: ``"\\n\\n"`` alone
    is one token, 1116, but two, [198, 198], before the answer). Found by encoding it
    followed by a digit; its ids alone when the digit does not split off cleanly."""
    if not text:
        return []
    follow = tokenizer.encode("0", add_special_tokens=False)
    whole = tokenizer.encode(text + "0", add_special_tokens=False)
    if len(whole) > len(follow) and whole[-len(follow) :] == follow:
        return whole[: -len(follow)]
    return tokenizer.encode(text, add_special_tokens=False)


def step_boundaries(
    ids: np.ndarray, start: int, end: int, text_of: Callable[[int], str],
    delimiters: Sequence[str],
) -> list[int]:  # fmt: skip
    """Token indices in ``(start, end)`` (the thinking between the markers) whose text,
    joined with the thinking before them, ends one of ``delimiters``."""
    longest = max(len(d) for d in delimiters)
    ends = tuple(delimiters)
    tail, out = "", []
    for j in range(start + 1, end):
        tail = (tail + text_of(int(ids[j])))[-longest:]
        if tail.endswith(ends):
            out.append(j)
    return out


def item_of(record: dict[str, Any], items: dict[str, dict[str, Any]]) -> dict | None:
    """The reasoning-gym item a record answers: its own (task, seed, params), else the
    items file's entry for its id; None when neither has one."""
    if all(k in record for k in ITEM_KEYS):
        return {k: record[k] for k in ITEM_KEYS}
    return items.get(str(record.get("id")))


def load_item_index(path: str | Path | None) -> dict[str, dict[str, Any]]:
    """id -> (task, seed, params) of a traces file (``.jsonl`` or ``.jsonl.gz``)."""
    if path is None:
        return {}
    from specdec.data_gen.sources import iter_jsonl

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"items file {path} does not exist; pass the traces file the prompts came from "
            "(specdec data-gen reasoning-traces --out FILE)"
        )
    index = {}
    for n, rec in iter_jsonl(path, SkipCounts()):
        if "id" not in rec or not all(k in rec for k in ITEM_KEYS):
            raise ValueError(f"{path}:{n} lacks id/{'/'.join(ITEM_KEYS)}: not a traces record")
        index[str(rec["id"])] = {k: rec[k] for k in ITEM_KEYS}
    return index


class ReasoningGymVerifier:
    """The default verifier: the task's own ``score_answer`` on the entry rebuilt from the
    item (tasks cached per (task, params), as eval-reasoning does)."""

    def __init__(self) -> None:
        from specdec.data_gen.reasoning.tasks import Scorer

        self._scorer = Scorer()

    def __call__(self, item: dict[str, Any], record: dict[str, Any]) -> Score:
        task = self._scorer.task({"id": record.get("id"), **item})
        entry = task.entry(item["seed"])
        question = next(
            (m["content"] for m in record.get("conversations", []) if m.get("role") == "user"),
            None,
        )
        if question is not None and question != entry["question"]:
            raise ValueError(
                f"{record.get('id')}: its question is not reasoning-gym's for {item}; the "
                "items file does not belong to these records, or reasoning-gym's version "
                "changed (0.1.25 is pinned)"
            )
        return lambda answer: task.score(answer, entry)


def normalize_answer(text: str) -> str:
    """An answer compared as text: whitespace runs collapsed, ends stripped."""
    return " ".join(text.split())


def final_answer(tokenizer, ids: Sequence[int], after: int, answer_prefix: str) -> str:
    """A trace's own answer: its text from ``after`` (the first token past the think-end
    marker) without the answer prefix and special tokens, normalised."""
    tail = tokenizer.decode([int(t) for t in ids[after:]], skip_special_tokens=True)
    tail = tail[len(answer_prefix) :] if tail.startswith(answer_prefix) else tail
    return normalize_answer(tail)


def agrees_with(final: str) -> Score:
    """``target="final"``'s scorer: 1.0 when an answer is the (normalised) ``final`` one;
    never for an empty ``final``."""
    return lambda answer: float(bool(final) and normalize_answer(answer) == final)


# A record's scorer (answer text -> label), or the counts key saying why it has none.
Judge = Callable[
    ["ConfidenceProber", dict[str, Any], "dict | None", np.ndarray, Any], "Score | str"
]


def _judge_final(prober: ConfidenceProber, record, item, ids, span) -> Score | str:
    final = prober.final_answer(ids, span)
    if not final:
        return "unlabelled_no_final_answer"
    return agrees_with(final)


def _judge_correct(prober: ConfidenceProber, record, item, ids, span) -> Score | str:
    if item is None:
        return "unlabelled_no_item"
    return prober.verifier(item, record)


JUDGES: dict[str, Judge] = {"final": _judge_final, "correct": _judge_correct}
NEEDS_ITEMS = frozenset({"correct"})


# ---------------------------------------------------------------- one shard


@dataclass
class _Probe:
    record: int  # index in the shard
    position: int  # the probe's token index in the record's input_ids
    prompt: list[int]


class ConfidenceProber:
    """Probes and labels shards of records with one ``LLM`` (``label_shard``). The verifier
    (``target="correct"``) defaults to ``ReasoningGymVerifier``, made on first use."""

    def __init__(self, config: ExitLabelsConfig, llm, verifier: Verifier | None = None) -> None:
        from specdec.sampling_params import SamplingParams
        from specdec.think_markers import check_markers, resolve_marker

        self.config, self.llm, self._verifier = config, llm, verifier
        self.judge = JUDGES[config.target]
        tok = llm.tokenizer
        self.start = resolve_marker(tok, config.think_start, "think_start")
        self.end = resolve_marker(tok, config.think_end, "think_end")
        check_markers(self.start, self.end, ("think_start", "think_end"))
        self.forced = [*self.end, *running_text_ids(tok, config.answer_prefix)]
        self.params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens)
        self.max_model_len = llm.engine.max_model_len
        self._texts: dict[int, str] = {}

    @property
    def verifier(self) -> Verifier:
        if self._verifier is None:
            self._verifier = ReasoningGymVerifier()
        return self._verifier

    def final_answer(self, ids: np.ndarray, span) -> str:
        return final_answer(self.llm.tokenizer, ids, span.end + len(self.end),
                            self.config.answer_prefix)  # fmt: skip

    def text_of(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.llm.tokenizer.decode([token])
        return text

    def probes_of(
        self, index: int, record: dict[str, Any], item: dict | None, counts: Counter
    ) -> tuple[list[_Probe], Score | None]:
        """The record's probes and the scorer of their answers; none (and a count saying
        why) when it cannot be labelled."""
        from specdec.think_markers import find_think_span

        ids = record.get("input_ids")
        if not isinstance(ids, list) or not ids:
            counts["unlabelled_no_input_ids"] += 1
            return [], None
        arr = np.asarray(ids)
        span = find_think_span(arr, self.start, self.end)
        if span is None:
            counts["unlabelled_no_think_span"] += 1
            return [], None
        score = self.judge(self, record, item, arr, span)
        if isinstance(score, str):
            counts[score] += 1
            return [], None
        positions = [span.start, *step_boundaries(arr, span.start, span.end, self.text_of,
                                                  self.config.delimiters)]  # fmt: skip
        probes = []
        for j in positions:
            prompt = [*ids[: j + 1], *self.forced]
            if len(prompt) + self.config.max_tokens > self.max_model_len:
                counts["probes_too_long"] += 1
                continue
            probes.append(_Probe(index, j, prompt))
        if not probes:
            counts["unlabelled_no_probe"] += 1  # none fits the context
        return probes, score

    def label_shard(
        self, records: list[dict[str, Any]], items: list[dict | None]
    ) -> tuple[bytes, dict[str, int]]:
        """The shard's JSONL bytes (records in order, labelled ones with
        ``CONFIDENCE_KEY``) and its counts."""
        counts: Counter = Counter()
        probed = [self.probes_of(i, r, it, counts) for i, (r, it) in
                  enumerate(zip(records, items, strict=True))]  # fmt: skip
        per_record = [probes for probes, _ in probed]
        scores = [score for _, score in probed]
        # Record by record, longest probe first: its blocks are published to the prefix
        # cache when it is scheduled (even within one step), and the record's shorter
        # probes, queued right behind it, reuse them instead of recomputing the prefix.
        order = [probe for probes in per_record for probe in reversed(probes)]
        outputs = []
        if order:
            outputs = self.llm.generate([p.prompt for p in order], self.params, use_tqdm=True)
        answers = {
            (p.record, p.position): out.outputs[0].text.strip()
            for p, out in zip(order, outputs, strict=True)
        }
        lines = []
        for i, (record, score) in enumerate(zip(records, scores, strict=True)):
            if per_record[i]:
                positions = [p.position for p in per_record[i]]
                texts = [answers[(i, j)] for j in positions]
                labels = [1.0 if score(a) == 1.0 else 0.0 for a in texts]
                record = {**record, CONFIDENCE_KEY: {
                    "positions": positions, "labels": labels, "answers": texts,
                }}  # fmt: skip
                counts["labelled"] += 1
                counts["probes"] += len(labels)
                counts["probes_labelled_1"] += int(sum(labels))
            lines.append(dumps_record(record) + "\n")
        counts["records"] = len(records)
        return "".join(lines).encode(), dict(counts)


# ---------------------------------------------------------------- the stage


def read_input(spec: str, skipped: SkipCounts) -> list[dict[str, Any]]:
    """The records of a stage directory (its manifest's JSONL shards) or a JSONL file."""
    from specdec.data_gen.sources import iter_jsonl, read_stage_records

    path = Path(spec)
    if path.is_dir():
        return list(read_stage_records(path, skipped))
    if not path.is_file():
        raise FileNotFoundError(
            f"{spec} does not exist; pass a data-gen regenerate directory or a JSONL file "
            "of records with input_ids"
        )
    return [obj for _, obj in iter_jsonl(path, skipped)]


def run_exit_labels(
    config: ExitLabelsConfig,
    rank: RankInfo | None = None,
    llm=None,
    verifier: Verifier | None = None,
) -> dict[str, Any]:
    """Label this rank's shards (module docstring). Returns stats (``probes``,
    ``seconds``, ``shards_written``) and ``manifest`` (None until every rank's shards
    exist). ``llm`` / ``verifier`` default to ``LLM(config.model, **config.engine)`` and
    ``ReasoningGymVerifier``."""
    rank = rank or RankInfo.from_env()
    skipped = SkipCounts()
    records = read_input(config.input, skipped)
    if not records:
        raise ValueError(f"{config.input} holds no records ({skipped.as_dict()})")
    index = load_item_index(config.items)
    items = [item_of(r, index) for r in records]
    if config.target in NEEDS_ITEMS and not any(items):
        raise ValueError(
            f"no record of {config.input} names its reasoning-gym item (task, seed, params), "
            f"which target={config.target!r} verifies against; pass --items TRACES.jsonl, the "
            "traces file its prompts came from, or use --target final"
        )
    ranges = list(chunk_ranges(len(records), config.records_per_shard))
    gen = {k: v for k, v in asdict(config).items()
           if k not in ("input", "output", "items", "engine", "verify")}  # fmt: skip
    digests = [digest_json([gen, records[a:b], items[a:b]]) for a, b in ranges]
    header = {"stage": "exit-labels", "target": config.model, "input": config.input, **gen}
    header["input_skipped"] = skipped.as_dict(prefix="")
    store = ShardStore(config.output, "labels", "jsonl")
    store.root.mkdir(parents=True, exist_ok=True)
    write_plan(store, digests, header)
    todo = store.pending(digests, rank.owned(len(ranges)), verify=config.verify)
    stats: dict[str, Any] = {"probes": 0, "seconds": 0.0, "shards_written": 0}
    if todo:
        if llm is None:
            llm = _load_llm(config, rank)
        prober = ConfidenceProber(config, llm, verifier)
        total = sum(ranges[i][1] - ranges[i][0] for i in todo)
        bar = tqdm(total=total, desc=f"exit-labels {store.root.name}", unit="rec")
        t0 = time.perf_counter()
        try:
            for i in todo:
                a, b = ranges[i]
                data, counts = prober.label_shard(records[a:b], items[a:b])
                store.write(i, data, digests[i], counts)
                stats["probes"] += counts.get("probes", 0)
                stats["shards_written"] += 1
                bar.update(b - a)
                bar.set_postfix(probes=stats["probes"])
        finally:
            bar.close()
        stats["seconds"] = time.perf_counter() - t0
    stats["manifest"] = finish_stage(store, digests, header, rank)
    return stats


def _load_llm(config: ExitLabelsConfig, rank: RankInfo):
    import torch

    from specdec.engine.llm import LLM

    if rank.world_size > 1 and torch.cuda.is_available():
        torch.cuda.set_device(rank.local_rank)  # "cuda" = this rank's GPU
    return LLM(config.model, **config.engine)
