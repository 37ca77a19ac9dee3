"""``specdec eval-draft``: the replay of greedy chain decoding counts the steps and accepted
tokens the engine counts, on hand-made draft outcomes (K caps, max_tokens cuts, drafts
past EOS, out-of-vocabulary roots, packed sequences) and on the real SmolLM2 with the
shipped head, where the engine's own per-request counters are the reference: equal, not
close."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.cli import main
from specdec.train.chain_replay import (
    answer_spans,
    chain_leading,
    checkable,
    greedy_agreement,
    replay_answers,
    replay_chain,
)


def _mask(n: int, *runs: tuple[int, int]) -> np.ndarray:
    """[n] bool, True on each half-open run."""
    mask = np.zeros(n, dtype=bool)
    for a, b in runs:
        mask[a:b] = True
    return mask


def _hits(cu: list[int], steps: int, misses=()) -> np.ndarray:
    """[steps, n] hits of a head that drafts every token right, except the (step, index)
    pairs in ``misses``; a source past its sequence never hits (DraftTrace.hits)."""
    n = cu[-1]
    seq_end = np.repeat(cu[1:], np.diff(cu))
    hits = np.stack([np.arange(n) + 1 + i < seq_end for i in range(steps)])
    for i, j in misses:
        hits[i, j] = False
    return hits


def _replay(leading, mask, cu, k, max_tokens=None):
    spans = answer_spans(mask, np.array(cu), max_tokens)
    stats = replay_chain(np.asarray(leading), spans, k)
    return stats.steps, stats.accepted_tokens, stats.drafted_tokens


# ---- the replay on hand-made outcomes ---------------------------------------------------


def test_k_caps_each_step_and_the_prefill_token_is_no_step():
    """A 10-token answer (indices 2..11) whose every chain would run 5 deep."""
    mask, cu, leading = _mask(12, (2, 12)), [0, 12], [5] * 12
    # 9 tokens after the prefill's: K=3 emits 4 per step -> 3 steps (the last past EOS).
    assert _replay(leading, mask, cu, 3) == (3, 9, 9)
    assert _replay(leading, mask, cu, 1) == (5, 5, 5)  # 2 tokens per step
    assert _replay(leading, mask, cu, 7) == (2, 10, 14)  # the leading run caps: 5 of 7


def test_max_tokens_caps_drafts_and_the_last_token_is_decoded_plainly():
    """A turn cut at max_tokens: the record closes it with an end-of-turn token the engine
    never emitted (index 9), and the engine never drafts past max_tokens."""
    mask, cu, leading = _mask(10, (2, 10)), [0, 10], [5] * 10
    # max_tokens 7: 1 (prefill) + 4 (3 accepted + bonus), then a 1-draft step to 7 tokens.
    assert _replay(leading, mask, cu, 3, max_tokens=7) == (2, 4, 4)
    # max_tokens 6: after 5 tokens one is left, decoded plainly: no second step.
    assert _replay(leading, mask, cu, 3, max_tokens=6) == (1, 3, 3)
    # Unknown max_tokens: the appended token is replayed as if the engine had emitted it.
    assert _replay(leading, mask, cu, 3) == (2, 6, 6)


def test_drafts_accepted_past_eos_count_where_the_record_shows_the_target():
    """Answer 2..5 ends with EOS at 5; the template's glue follows. The engine verifies
    drafts past EOS and counts those accepted; the record holds the target's continuation
    while each token is the target's argmax after the one before."""
    ids = np.array([10, 11, 20, 21, 22, 2, 13, 14])  # 2: EOS, 13: "\n", 14: "<|im_start|>"
    mask, cu = _mask(8, (2, 6)), [0, 8]
    hits = _hits(cu, 3, misses=[(1, 1)])  # the first chain accepts 1 draft
    top = np.array([0, 20, 21, 22, 2, 13, 99, 0])  # the target continues EOS with "\n"
    ok = checkable(ids, mask, top, np.array(cu))
    assert ok.tolist() == [False, False, True, True, True, True, True, False]
    leading = chain_leading(hits, ok)
    # Root 2 accepts 1; root 4 drafts EOS, "\n" and what follows "\n": all 3 count, the
    # engine emits only EOS of them.
    assert _replay(leading, mask, cu, 3) == (2, 4, 6)
    # A record whose glue is not the target's continuation: the third draft is unknown,
    # counted as a miss.
    other = top.copy()
    other[5] = 77
    leading = chain_leading(hits, checkable(ids, mask, other, np.array(cu)))
    assert leading[3] == 2
    assert _replay(leading, mask, cu, 3) == (2, 3, 6)


def test_an_out_of_vocabulary_next_token_is_a_step_that_accepts_nothing():
    """Answer 2..7: the target's argmax after the first answer token is no draft id, so
    the chain rooted there misses at once (hits False, as DraftTrace encodes it). The
    trainer's simulated τ skips such roots (valid0); the engine still runs the step."""
    mask, cu = _mask(8, (2, 8)), [0, 8]
    leading = chain_leading(_hits(cu, 3, misses=[(0, 1)]), mask)
    assert leading[1] == 0
    # Root 2: 0 accepted, emits 1 (3 tokens); root 3: 3 accepted, emits 4 (done).
    assert _replay(leading, mask, cu, 3) == (2, 3, 6)


def test_packed_sequences_and_turns_replay_as_separate_requests_pooled():
    """Three sequences packed: single-turn, two-turn, and one whose mask starts at its
    first token (no prompt before it: that token counts as prompt). Pooled counters equal
    the sums of each sequence replayed alone."""
    alone = [
        (_mask(9, (3, 9)), [0, 9], [2, 0, 1, 3, 1, 0, 2, 1, 0]),
        (_mask(12, (2, 5), (8, 12)), [0, 12], [3, 1, 0, 1, 2, 0, 1, 2, 0, 3, 1, 0]),
        (_mask(6, (0, 6)), [0, 6], [1, 1, 2, 0, 1, 0]),
    ]
    mask = np.concatenate([m for m, _, _ in alone])
    cu = [0, 9, 21, 27]
    leading = np.concatenate([np.array(lead) for _, _, lead in alone])
    spans = answer_spans(mask, np.array(cu))
    assert spans.start.tolist() == [3, 9 + 2, 9 + 8, 21 + 1]
    assert spans.end.tolist() == [9, 9 + 5, 9 + 12, 27]
    for k in (1, 2, 3):
        expected = np.sum([_replay(lead, m, c, k) for m, c, lead in alone], axis=0)
        assert _replay(leading, mask, cu, k) == tuple(expected)
    per_answer = replay_answers(leading, spans, 2)
    assert len(per_answer) == 4 and sum(s.steps for s in per_answer) > 0


def test_a_clipped_answer_replays_as_if_max_tokens_had_cut_it():
    mask, cu = _mask(10, (2, 10)), np.array([0, 10])
    spans = answer_spans(mask, cu, max_tokens=100, clipped=np.array([True]))
    assert spans.max_tokens.tolist() == [8]
    # 8 tokens: 1 + 4, then a 2-draft step (never past the clip).
    stats = replay_chain(np.full(10, 5), spans, 3)
    assert (stats.steps, stats.accepted_tokens, stats.drafted_tokens) == (2, 5, 5)


def test_greedy_agreement_counts_tokens_after_each_answers_first():
    ids = np.array([1, 5, 6, 7, 8])
    top = np.array([5, 6, 0, 8, 0])  # 7 is not the argmax after 6
    spans = answer_spans(_mask(5, (1, 5)), np.array([0, 5]))
    assert greedy_agreement(ids, top, spans) == (2, 3)


# ---- the CLI's checks (no model runs) ---------------------------------------------------


def _records_dir(tmp_path, ids: list[int], mask: list[int]):
    root = tmp_path / "regen"
    root.mkdir()
    record = {"id": "r0", "input_ids": ids, "loss_mask": mask}
    (root / "regen-00000.jsonl").write_text(json.dumps(record) + "\n")
    shards = [{"file": "regen-00000.jsonl"}]
    (root / "manifest.json").write_text(json.dumps({"stage": "regenerate", "shards": shards}))
    return root


def test_bad_input_fails_naming_the_value_and_the_fix(tmp_path, capsys, trained_head_dir):
    head = ["--head", str(trained_head_dir)]
    assert main(["eval-draft", "--records", f"x={tmp_path / 'none'}", *head]) == 2
    assert "x=" in capsys.readouterr().err
    assert main(["eval-draft", "--records", str(tmp_path), "--chain", "2,9", *head]) == 2
    assert "[9] are outside 1..7" in capsys.readouterr().err
    other = _records_dir(tmp_path, [1, 2, 60_000], [0, 1, 1])  # SmolLM2 has 49,152 ids
    assert main(["eval-draft", "--records", str(other), *head]) == 2
    assert "outside the target's vocabulary" in capsys.readouterr().err
    assert main(["eval-draft", "--records", str(other), "--model", "smollm2-135m-reasoning",
                 *head]) == 2  # fmt: skip
    assert "pass --model smollm2-135m-instruct" in capsys.readouterr().err


# ---- the engine as reference ----------------------------------------------------------

PROMPTS = [  # two end with EOS, two are cut at max_tokens (checked below)
    "What is the capital of Australia?",
    "Write a haiku about autumn rain.",
    "Say hello.",
    "List three uses of a paperclip.",
]


def deeper_head(trained_head_dir: Path, out: Path, nudge: float = 0.02) -> Path:
    """The trained head with a second layer (``deepen``) whose silent projections get
    random entries of scale ``nudge``, so that it changes the drafts (at 0.02 slightly:
    most stay right; at 0.5 the chain of 3's τ falls from ~2.9 to ~2.1), saved to ``out``."""
    from dataclasses import replace

    from specdec.models import load_config, resolve_model
    from specdec.models.eagle3_formats import load_eagle3, save_eagle3
    from specdec.models.eagle3_head import Eagle3Head
    from specdec.train.model import deepen

    target = load_config(resolve_model("smollm2-135m-instruct"))
    head = load_eagle3(trained_head_dir, target_config=target)
    deep = Eagle3Head(replace(head.config, num_layers=2), head.attention)
    state = head.state_dict()
    deepen(state, deep, 1)
    gen = torch.Generator().manual_seed(0)
    for key in ("layers.1.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
        state[key] = nudge * torch.randn(state[key].shape, generator=gen).to(state[key].dtype)
    deep.load_state_dict(state)
    return save_eagle3(deep, out)


@pytest.mark.parametrize("depth", [1, 2])
def test_replay_equals_the_engines_counts_per_request(tmp_path, monkeypatch, trained_head_dir,
                                                      depth):  # fmt: skip
    """Greedy answers generated with a chain of 3 drafts by the shipped head (and by a
    2-layer head made from it: the engine's per-layer K/V against TTT's), written by
    regenerate; the replay of those records counts each request's steps and accepted
    tokens exactly as the engine did, and the answers are the target's own greedy ones."""
    from specdec import LLM
    from specdec.config import SpeculativeConfig
    from specdec.data_gen.regenerate import RegenerateConfig, run_regenerate
    from specdec.data_gen.shards import RankInfo
    from specdec.train.head_eval import EvalConfig, evaluate_head, format_report

    if depth > 1:
        trained_head_dir = deeper_head(trained_head_dir, tmp_path / "deep")

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    spec = SpeculativeConfig(method="eagle3", model=str(trained_head_dir), tree="chain",
                             num_speculative_tokens=3)  # fmt: skip
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", kv_cache_memory=64 << 20,
              max_num_seqs=4, speculative=spec)  # fmt: skip
    engine_counts: dict[str, tuple[int, int, str]] = {}
    step = llm.engine.step

    def step_and_count():
        outputs = step()
        for out in outputs:
            if out.finished:
                m = out.metrics
                engine_counts[out.request_id] = (
                    m.spec_steps, m.spec_accepted_tokens, out.outputs[0].finish_reason
                )  # fmt: skip
        return outputs

    monkeypatch.setattr(llm.engine, "step", step_and_count)
    regen = tmp_path / "regen"
    config = RegenerateConfig(input=str(prompts), output=str(regen), temperature=0.0,
                              max_tokens=40, record_workers=0)  # fmt: skip
    run_regenerate(config, RankInfo(), llm=llm)
    # Request ids are shard/slot/turn: record i is request 0/i/0.
    engine = [engine_counts[f"0/{i}/0"] for i in range(len(PROMPTS))]
    assert sorted(reason for *_, reason in engine) == ["length", "length", "stop", "stop"]

    eval_config = EvalConfig(records=(("greedy", str(regen)),), head=str(trained_head_dir),
                             steps=3, chains=(1, 3), per_answer=True)  # fmt: skip
    (figures,) = evaluate_head(eval_config, progress=False)
    assert (figures.sequences, figures.answers, figures.answer_max_tokens) == (4, 4, 40)
    assert figures.greedy_agreement == 1.0  # the records are the target's greedy answers
    assert figures.per_answer[3] == [[steps, accepted] for steps, accepted, _ in engine]
    stats = llm.engine.spec_stats
    assert (figures.chains[3].steps, figures.chains[3].accepted_tokens) == (
        stats.steps, stats.accepted_tokens
    )  # fmt: skip
    # Drafts were both accepted and rejected, so equality was not trivial.
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    assert figures.chains[1].tau < figures.chains[3].tau
    report = format_report([figures], eval_config, trained_head_dir)
    assert "K=3" in report and "note:" not in report


# ---- records with sources ----------------------------------------------------------------


SOURCES = ["qa", "writing", "qa", ""]  # PROMPTS' sources in greedy_records


@pytest.fixture(scope="module")
def greedy_records(tmp_path_factory) -> Path:
    """The target's greedy answers to PROMPTS (24 tokens), as regenerate writes them; the
    prompts name sources as ``data-gen prompts`` does (SOURCES; the last names none, so
    regenerate records its file's name, "prompts")."""
    from specdec import LLM
    from specdec.data_gen.regenerate import RegenerateConfig, run_regenerate
    from specdec.data_gen.shards import RankInfo

    root = tmp_path_factory.mktemp("probe")
    prompts = root / "prompts.jsonl"
    rows = [{"prompt": p, **({"source": s} if s else {})}
            for p, s in zip(PROMPTS, SOURCES, strict=True)]  # fmt: skip
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", kv_cache_memory=64 << 20,
              max_num_seqs=4, speculative=None)  # fmt: skip
    config = RegenerateConfig(input=str(prompts), output=str(root / "regen"), temperature=0.0,
                              max_tokens=24, record_workers=0)  # fmt: skip
    run_regenerate(config, RankInfo(), llm=llm)
    return root / "regen"


# ---- eval-draft --by-source -------------------------------------------------------------


def test_by_source_rows_split_the_set_and_pool_back_to_it(greedy_records, trained_head_dir, capsys):
    """One row per prompt source (sorted), each judging exactly its own answers, and the
    set's row pooled from them: the counts that do not depend on the forward's numerics
    equal the plain run's, the figures that do agree to within the rounding of a
    different packing."""
    from specdec.train.head_eval import EvalConfig, evaluate_head

    records = (("greedy", str(greedy_records)),)
    plain_config = EvalConfig(records=records, head=str(trained_head_dir), steps=3, chains=(3,))
    (plain,) = evaluate_head(plain_config, progress=False)
    config = EvalConfig(records=records, head=str(trained_head_dir), steps=3, chains=(3,),
                        by_source=True, per_answer=True)  # fmt: skip
    pooled, *parts = evaluate_head(config, progress=False)
    assert [f.name for f in (pooled, *parts)] == ["greedy", "greedy/prompts", "greedy/qa",
                                                  "greedy/writing"]  # fmt: skip
    assert [f.sequences for f in parts] == [1, 2, 1]  # SOURCES
    counts = ("sequences", "answers", "answer_tokens", "kept_answer_tokens", "greedy_tokens")
    for key in counts:
        assert getattr(pooled, key) == getattr(plain, key) == sum(getattr(f, key) for f in parts)
    assert pooled.chains[3].steps == sum(f.chains[3].steps for f in parts)
    assert pooled.per_answer[3] == [row for f in parts for row in f.per_answer[3]]
    assert pooled.chains[3].tau == pytest.approx(plain.chains[3].tau, abs=0.05)
    assert pooled.acc == pytest.approx(plain.acc, abs=0.05)
    assert len({f.chains[3].tau for f in parts}) > 1  # the sources differ: the split shows it

    args = ["--head", str(trained_head_dir), "--steps", "3", "--chain", "3", "--by-source"]
    assert main(["eval-draft", "--records", f"greedy={greedy_records}", *args]) == 0
    table = capsys.readouterr().out
    assert all(f"\n{name} " in table for name in ("greedy", "greedy/prompts", "greedy/qa"))


def test_by_source_keeps_record_order_and_names_a_missing_source(tmp_path, trained_head_dir):
    from specdec.data_gen.dump_plan import TokenRecord
    from specdec.train.head_eval import EvalConfig, by_source, evaluate_head

    ids, mask = np.zeros(2, np.int32), np.ones(2, bool)
    sources = ["b", "a", "b", ""]
    groups = by_source([TokenRecord(f"r{i}", ids, mask, source=s) for i, s in enumerate(sources)])
    assert list(groups) == ["", "a", "b"]
    assert [[r.id for r in g] for g in groups.values()] == [["r3"], ["r1"], ["r0", "r2"]]
    # A record written without a source (not by regenerate) is judged under "-".
    root = _records_dir(tmp_path, [1, 2, 3, 4, 5], [0, 0, 1, 1, 1])
    config = EvalConfig(records=(("x", str(root)),), head=str(trained_head_dir), steps=2,
                        by_source=True)  # fmt: skip
    assert [f.name for f in evaluate_head(config, progress=False)] == ["x", "x/-"]
