"""eval-reasoning (specdec/bench/reasoning.py): replies are split at ``</think>`` (an
unclosed span has no answer), scored by the task's own verifier on the rebuilt entry,
think length is counted in generated tokens, and a whole run on the engine writes the
JSON and Markdown reports."""

from __future__ import annotations

import json

import pytest
from reasoning_items import write_eval_items
from tiny_models import make_tiny_model_dir

from specdec.bench.reasoning import (
    EvalConfig,
    load_items,
    run_eval,
    sampling_params,
    tokens_through,
)
from specdec.data_gen.reasoning.format import parse
from specdec.data_gen.reasoning.tasks import Scorer

pytest.importorskip("reasoning_gym")


@pytest.mark.parametrize(
    ("text", "think", "answer", "opened", "closed"),
    [
        ("<think>\n1 + 1 = 2.\n</think>\n\n2", "1 + 1 = 2.", "2", True, True),
        ("  <think>a</think>b </think> c", "a", "b </think> c", True, True),  # first close
        (
            "<think>\nstill thinking when max_tokens hit",
            "still thinking when max_tokens hit",
            None,
            True,
            False,
        ),
        ("The answer is 4.", "", "The answer is 4.", False, False),  # no reasoning at all
        (
            "thought without an opening tag</think>\n7",
            "thought without an opening tag",
            "7",
            False,
            True,
        ),
    ],
)
def test_parse_splits_at_the_first_close_tag(text, think, answer, opened, closed):
    c = parse(text)
    assert (c.think, c.answer, c.opened, c.closed) == (think, answer, opened, closed)
    if closed:
        assert text[: c.think_end].endswith("</think>")
    elif opened:
        assert c.think_end == len(text)


@pytest.fixture(scope="module")
def items(tmp_path_factory, smollm2_tokenizer):
    out = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    tasks = ("gcd", "fraction_simplification", "prime_factorization")
    return write_eval_items(out, smollm2_tokenizer, tasks, num_per_task=2)


def test_the_verifier_scores_the_text_after_think(items):
    scorer = Scorer()
    for rec in load_items(items):
        reference = rec["conversations"][1]["content"]  # the tracer's own, correct reply
        assert scorer.score(rec, parse(reference)) == 1.0
        think = reference.split("</think>")[0] + "</think>\n\n"
        assert scorer.score(rec, parse(think + "0/0 × 1")) < 1.0
        assert scorer.score(rec, parse(reference.split("</think>")[0])) == 0.0  # unclosed
    rec = load_items(items)[0]
    assert scorer.score(rec, parse(f"No thinking: {rec['answer']}")) < 1.0  # partial credit
    tampered = {**rec, "conversations": [{"role": "user", "content": "another question"}]}
    with pytest.raises(ValueError, match="another reasoning-gym version"):
        scorer.score(tampered, parse(rec["conversations"][1]["content"]))


def test_think_tokens_count_generated_tokens_through_the_close_tag(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "<think>\nLet me see: 12 = 2 × 2 × 3.\n</think>\n\n2 × 2 × 3"
    ids = tok.encode(text, add_special_tokens=False)
    c = parse(text)
    n = tokens_through(tok, ids, c.think_end)
    assert tok.decode(ids[:n]).endswith("</think>") and not tok.decode(ids[: n - 1]).endswith(
        "</think>"
    )
    assert tokens_through(tok, ids, 0) == 0 and tokens_through(tok, ids, len(text)) == len(ids)


def test_sampling_options_must_exist():
    with pytest.raises(ValueError, match=r"sampling options \['temprature'\] are not"):
        sampling_params(EvalConfig(model="m", traces="t", sampling={"temprature": 0.5}))
    params = sampling_params(
        EvalConfig(model="m", traces="t", max_tokens=7, sampling={"temperature": 0.5})
    )
    assert (params.temperature, params.max_tokens) == (0.5, 7)


def test_a_run_on_the_engine_writes_both_reports(items, tmp_path, smollm2_dir):
    """Plumbing on a tiny random model: every item gets a result and a per-task row."""
    model = make_tiny_model_dir(tmp_path, smollm2_dir, seed=0)
    config = EvalConfig(
        model=str(model),
        traces=str(items),
        output=str(tmp_path / "report"),
        max_tokens=8,
        concurrency=2,
        engine={
            "device": "cpu",
            "dtype": "float32",
            "kv_cache_memory": 16 << 20,
            "max_model_len": 512,
        },
    )
    report = run_eval(config)
    assert report["overall"]["items"] == 6 and len(report["items"]) == 6
    assert set(report["tasks"]) == {"gcd", "fraction_simplification", "prime_factorization"}
    for item in report["items"]:
        assert item["output_tokens"] == 8 and 0 <= item["think_tokens"] <= 8
        assert item["latency_s"] > 0
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["overall"] == report["overall"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| gcd | 2 |" in md and "| **all** | 6 |" in md
