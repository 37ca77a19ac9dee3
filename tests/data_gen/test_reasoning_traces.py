"""Reasoning traces (data_gen/reasoning): every tracer's answer passes reasoning-gym's own
verifier, the recorded think/step/answer offsets point at the right characters and
tokens, train and eval never share a seed or a question, benchmark questions are kept
out, and an interrupted run resumes to the bytes of an uninterrupted one."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specdec.data_gen.decontam import Decontaminator
from specdec.data_gen.reasoning.format import (
    STEP_SEP,
    THINK_CLOSE,
    THINK_OPEN,
    TraceStyle,
    Untraceable,
    render,
)
from specdec.data_gen.reasoning.generate import (
    SPLITS,
    TracesConfig,
    build_record,
    question_split,
    run_traces,
)
from specdec.data_gen.reasoning.tasks import get_tasks, register, registry

pytest.importorskip("reasoning_gym")

NO_BENCH = Decontaminator({"none": ["a benchmark prompt that shares nothing with any task"]})
SEEDS = 120  # per task; the tracers are deterministic functions of the generator's item


@pytest.mark.parametrize("name", list(registry()))
def test_tracer_answers_pass_the_generators_verifier(name):
    """Over many seeds, the rendered answer scores 1.0 with the task's own score_answer,
    the settled (last work) step states it, and checks follow it. A few degenerate items
    may be untraceable (skipped by generation), never wrong."""
    task = registry()[name]
    untraceable = 0
    for seed in range(SEEDS):
        entry = task.entry(seed)
        rng = random.Random(seed)
        try:
            solution = task.solve(entry, rng)
        except Untraceable:
            untraceable += 1
            continue
        trace = render(solution, rng, TraceStyle())
        assert task.score(trace.answer, entry) == 1.0, (entry["question"], trace.text)
        settled = trace.steps[trace.settled_step]
        assert settled.kind == "work" and trace.answer in trace.text[settled.start : settled.end]
        assert all(s.kind == "check" for s in trace.steps[trace.settled_step + 1 :])
        assert len(trace.steps) > trace.settled_step + 1  # it keeps checking after settling
    assert untraceable <= SEEDS // 20


def test_record_offsets_point_at_the_think_span_steps_and_answer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    for task in get_tasks(None):
        entry = task.entry(7)
        try:
            rec = build_record(task, "train", 7, entry, tok, TraceStyle())
        except Untraceable:
            continue
        reply = rec["conversations"][1]["content"]
        p = rec["prompt_tokens"]
        ids = rec["input_ids"]
        c0, c1 = rec["think"]["chars"]
        t0, t1 = rec["think"]["tokens"]
        assert c0 == 0 and reply.startswith(THINK_OPEN) and reply[:c1].endswith(THINK_CLOSE)
        assert tok.decode(ids[p + t0 : p + t1]) == reply[c0:c1]
        a0, a1 = rec["answer_span"]["chars"]
        assert reply[a0:a1] == rec["answer"] == reply.split(THINK_CLOSE)[1].strip()
        assert (
            tok.decode(
                ids[p + rec["answer_span"]["tokens"][0] : p + rec["answer_span"]["tokens"][1]]
            )
            == rec["answer"]
        )
        prev_end = 0
        for i, step in enumerate(rec["steps"]):
            s0, s1 = step["chars"]
            k0, k1 = step["tokens"]
            assert prev_end <= s0 < s1 <= c1 and STEP_SEP not in reply[s0:s1]
            assert tok.decode(ids[p + k0 : p + k1]).strip() == reply[s0:s1]
            assert step["settled"] == (i >= rec["settled_step"])
            prev_end = s1
        assert rec["steps"][rec["settled_step"]]["kind"] == "work"
        assert rec["score"] == 1.0
        # the loss mask covers exactly the reply and its end-of-turn token
        n = sum(rec["loss_mask"])
        assert rec["loss_mask"].index(1) == p and rec["loss_mask"][p : p + n] == [1] * n
        assert tok.decode(ids[p : p + n]) == reply + "<|im_end|>"


def _config(out: Path, split: str, n: int, tasks=("chain_sum", "gcd", "leg_counting")):
    return TracesConfig(output=str(out), split=split, tasks=tasks, num_per_task=n)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_and_eval_never_share_a_seed_or_a_question(tmp_path, smollm2_tokenizer):
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    run_traces(_config(train, "train", 40), decontaminator=NO_BENCH, tokenizer=smollm2_tokenizer)
    run_traces(_config(evals, "eval", 15), decontaminator=NO_BENCH, tokenizer=smollm2_tokenizer)
    a, b = _records(train), _records(evals)
    assert len(a) == 3 * 40 and len(b) == 3 * 15
    for recs, split in ((a, "train"), (b, "eval")):
        lo, hi = SPLITS[split]
        assert all(lo <= r["seed"] < hi and r["split"] == split for r in recs)
        assert all(question_split(r["conversations"][0]["content"]) == split for r in recs)
        questions = [(r["task"], r["conversations"][0]["content"]) for r in recs]
        assert len(set(questions)) == len(questions)  # unique within a file
    assert {r["seed"] for r in a}.isdisjoint(r["seed"] for r in b)
    assert {r["conversations"][0]["content"] for r in a}.isdisjoint(
        r["conversations"][0]["content"] for r in b
    )


def test_benchmark_questions_are_kept_out(tmp_path, smollm2_tokenizer):
    task = registry()["leg_counting"]
    clean = tmp_path / "clean.jsonl"
    run_traces(
        _config(clean, "train", 5, ("leg_counting",)),
        decontaminator=NO_BENCH,
        tokenizer=smollm2_tokenizer,
    )
    banned = _records(clean)[2]["conversations"][0]["content"]
    assert task.entry(_records(clean)[2]["seed"])["question"] == banned
    out = tmp_path / "filtered.jsonl"
    stats = run_traces(
        _config(out, "train", 5, ("leg_counting",)),
        decontaminator=Decontaminator({"bench": [banned]}, ngram=1000),  # exact text only
        tokenizer=smollm2_tokenizer,
    )
    assert stats["skipped"]["benchmark_overlap"] >= 1
    assert banned not in {r["conversations"][0]["content"] for r in _records(out)}


def test_an_interrupted_run_resumes_to_the_same_bytes(tmp_path, smollm2_tokenizer):
    """A kill leaves whole lines plus maybe a torn one; a smaller earlier run is a prefix
    of a larger one. Both resume to the uninterrupted run's bytes."""
    kw = {"decontaminator": NO_BENCH, "tokenizer": smollm2_tokenizer}
    full = tmp_path / "full.jsonl"
    run_traces(_config(full, "train", 12), **kw)
    data = full.read_bytes()
    lines = data.splitlines(keepends=True)

    torn = tmp_path / "torn.jsonl"  # killed mid-write in the second task
    torn.write_bytes(b"".join(lines[:17]) + lines[17][: len(lines[17]) // 2])
    stats = run_traces(_config(torn, "train", 12), **kw)
    assert torn.read_bytes() == data and stats["written"] == len(lines) - 17

    grown = tmp_path / "grown.jsonl"  # an earlier, smaller run extended
    run_traces(_config(grown, "train", 5), **kw)
    run_traces(_config(grown, "train", 12), **kw)
    assert _records(grown) != _records(full)  # tasks interleave differently ...
    assert sorted(grown.read_bytes().splitlines()) == sorted(data.splitlines())  # ... same set


def test_bad_requests_name_the_fix(tmp_path, smollm2_tokenizer):
    with pytest.raises(ValueError, match=r"gsm_symbolic.*cannot train"):
        register("gsm_symbolic")
    with pytest.raises(ValueError, match=r"unknown reasoning tasks \['nope'\]; known: chain_sum"):
        get_tasks(["nope"])
    with pytest.raises(ValueError, match=r"split='test'; choose one of train \| eval"):
        TracesConfig(output="x", split="test")
    mixed = tmp_path / "mixed.jsonl"
    run_traces(
        _config(mixed, "train", 1, ("gcd",)), decontaminator=NO_BENCH, tokenizer=smollm2_tokenizer
    )
    with pytest.raises(ValueError, match="holds 'train' records, not 'eval'"):
        run_traces(
            _config(mixed, "eval", 1, ("gcd",)),
            decontaminator=NO_BENCH,
            tokenizer=smollm2_tokenizer,
        )


def test_a_task_with_fewer_unique_questions_stops_short(tmp_path, smollm2_tokenizer):
    """Asking for more unique questions than a task's scanned seeds hold keeps what exists
    and reports it, instead of scanning forever."""
    out = tmp_path / "short.jsonl"
    config = TracesConfig(
        output=str(out), split="eval", tasks=("gcd",), num_per_task=200, max_scan=1
    )  # 1,200 seeds scanned, ~1/8 of them eval questions
    stats = run_traces(config, decontaminator=NO_BENCH, tokenizer=smollm2_tokenizer)
    n = len(_records(out))
    assert 0 < n < 200 and stats["short"] == {"gcd": n}
