"""``data-gen exit-labels`` (data_gen/reasoning/confidence.py): SpecExit confidence labels
from forced answers at the start of a think span and at every step boundary in it.

With a stub model whose answer is right exactly when the probe's prefix holds the settled
step, the labels must be 0 at the span's start and before the settled step and 1 from it
on, at the second newline token of each step separator, whether judged against the
trace's own answer or by reasoning-gym's verifier; probes are the record's tokens through
the boundary, ``</think>`` and ``"\\n\\n"`` as running text. On a tiny random target through
the engine: the stage labels every boundary, a SIGKILLed run resumes to the bytes of an
uninterrupted one, and the dump and the online reader carry the labels.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tiny_models import make_tiny_model_dir

from specdec.data_gen.reasoning.confidence import (
    ExitLabelsConfig,
    read_input,
    run_exit_labels,
    running_text_ids,
)
from specdec.data_gen.records import SkipCounts, dumps_record
from specdec.data_gen.shards import KILL_ENV, RankInfo, ShardStore, load_manifest
from specdec.data_gen.stage import write_plan

pytest.importorskip("reasoning_gym")

OPEN, CLOSE, NL = [44, 17400, 46], [9617, 17400, 46], 198
TASKS = ("gcd", "prime_factorization", "chain_sum")
ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 32 << 20, "max_model_len": 768}


@pytest.fixture(scope="module")
def traces(tmp_path_factory, smollm2_tokenizer) -> Path:
    from specdec.data_gen.decontam import Decontaminator
    from specdec.data_gen.reasoning.generate import TracesConfig, run_traces

    out = tmp_path_factory.mktemp("traces") / "train.jsonl"
    run_traces(
        TracesConfig(output=str(out), tasks=TASKS, num_per_task=2),
        decontaminator=Decontaminator({"none": ["nothing to match here at all"]}),
        tokenizer=smollm2_tokenizer,
    )
    return out


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def boundaries(rec: dict) -> list[tuple[int, bool]]:
    """(token index, settled) of each probe: the span's start (the last token of
    ``<think>``, never settled), then each step separator's second newline from the
    record's own step offsets: the ground truth the stage must find from token texts
    alone."""
    p, steps = rec["prompt_tokens"], rec["steps"]
    start = rec["input_ids"].index(OPEN[-1], p)
    return [(start, False)] + [(p + s["tokens"][1] + 1, s["settled"]) for s in steps[:-1]]


class StubLLM:
    """Answers a probe with the record's answer iff its prefix reaches past the settled
    step's end, else with a wrong one; records every prompt it is given."""

    def __init__(self, tokenizer, records: list[dict]) -> None:
        self.tokenizer = tokenizer
        self.engine = SimpleNamespace(max_model_len=4096)
        self.records = records
        self.prompts: list[list[int]] = []
        self.calls = 0

    def generate(self, prompts, params, use_tqdm=True):
        self.calls += 1
        outs = []
        for prompt in prompts:
            self.prompts.append(prompt)
            rec = next(r for r in self.records if prompt[: r["prompt_tokens"] + 3] ==
                       r["input_ids"][: r["prompt_tokens"] + 3])  # fmt: skip
            settled = rec["steps"][rec["settled_step"]]["tokens"][1] + rec["prompt_tokens"]
            cut = len(prompt) - len(CLOSE) - 2  # through the delimiter
            answer = rec["answer"] if cut > settled else "-1"
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(text=f" {answer}\n")]))
        return outs


@pytest.mark.parametrize("target", ["final", "correct"])
def test_labels_at_the_span_start_and_each_step_boundary(
    traces, tmp_path, smollm2_tokenizer, target
):
    """On traces whose final answers are right, both targets label alike: 0 before the
    settled step, 1 from it on."""
    records = records_of(traces)
    stub = StubLLM(smollm2_tokenizer, records)
    out = tmp_path / "labels"
    config = ExitLabelsConfig(input=str(traces), output=str(out), target=target)
    stats = run_exit_labels(config, RankInfo(), llm=stub)
    assert stub.calls == 1  # every probe of the shard in one generate
    labelled = read_input(str(out), SkipCounts())
    assert [r["id"] for r in labelled] == [r["id"] for r in records]
    for rec, got in zip(records, labelled, strict=True):
        conf = got.pop("spec_exit_confidence")
        assert got == rec  # everything else passes through unchanged
        expected = boundaries(rec)
        assert conf["positions"] == [j for j, _ in expected]
        assert conf["labels"] == [1.0 if settled else 0.0 for _, settled in expected]
        assert 0 in conf["labels"] and 1 in conf["labels"]
    probe = stub.prompts[0]
    assert any(probe[:-5] == r["input_ids"][: len(probe) - 5] for r in records)
    assert probe[-5:] == [*CLOSE, NL, NL]  # "</think>" then "\n\n" as running text
    assert probe[-7:-5] == [NL, NL]  # through the delimiter's two newline tokens
    assert running_text_ids(smollm2_tokenizer, "\n\n") == [NL, NL]
    manifest = load_manifest(out)
    counts = manifest["counts"]
    n_probes = sum(len(boundaries(r)) for r in records)
    assert (counts["records"], counts["labelled"], counts["probes"]) == (6, 6, n_probes)
    assert counts["probes_labelled_1"] == sum(s for r in records for _, s in boundaries(r))
    assert stats["probes"] == n_probes and manifest["stage"] == "exit-labels"


def test_items_by_id_and_records_that_cannot_be_labelled(traces, tmp_path, smollm2_tokenizer):
    """Regenerated records keep the id and lose (task, seed, params): the items file
    supplies them. A record the items file lacks, and one whose reply never closes its
    span, pass through without labels and are counted."""
    records = records_of(traces)
    stripped = [{k: v for k, v in r.items() if k not in ("task", "seed", "params")}
                for r in records]  # fmt: skip
    stripped[1]["id"] = "not/in/the/items"
    cut = stripped[2]["input_ids"].index(CLOSE[0])
    stripped[2]["input_ids"] = stripped[2]["input_ids"][:cut]  # unclosed
    stripped[2]["loss_mask"] = stripped[2]["loss_mask"][:cut]
    src = tmp_path / "regen.jsonl"
    src.write_text("".join(dumps_record(r) + "\n" for r in stripped))
    out = tmp_path / "labels"
    config = ExitLabelsConfig(input=str(src), output=str(out), items=str(traces),
                              target="correct")  # fmt: skip
    run_exit_labels(config, RankInfo(), llm=StubLLM(smollm2_tokenizer, records))
    labelled = read_input(str(out), SkipCounts())
    assert ["spec_exit_confidence" in r for r in labelled] == [True, False, False] + [True] * 3
    assert labelled[0]["spec_exit_confidence"]["labels"] == [float(s) for _, s in
                                                            boundaries(records[0])]  # fmt: skip
    counts = load_manifest(out)["counts"]
    assert counts["unlabelled_no_item"] == 1 and counts["unlabelled_no_think_span"] == 1
    with pytest.raises(ValueError, match="pass --items"):
        run_exit_labels(ExitLabelsConfig(input=str(src), output=str(tmp_path / "x"),
                                         target="correct"),
                        RankInfo(), llm=StubLLM(smollm2_tokenizer, records))  # fmt: skip


def test_final_target_labels_agreement_with_the_traces_own_answer(
    traces, tmp_path, smollm2_tokenizer
):
    """A trace that ends on a wrong answer: ``final`` labels the probes whose forced answer
    is that answer (the stub's "-1" before the settled step), ``correct`` those whose
    answer is right (from the settled step on): exactly the other probes. No items are
    needed for ``final``; a trace with nothing after its span is unlabelled."""
    records = records_of(traces)
    wrong = []
    for rec in records:
        ids = rec["input_ids"]
        end = next(i for i in range(len(ids)) if ids[i : i + 3] == CLOSE) + len(CLOSE)
        tail = smollm2_tokenizer.encode("\n\n-1", add_special_tokens=False)
        wrong.append({"id": rec["id"], "input_ids": [*ids[:end], *tail, 2, NL]})
    wrong[0]["input_ids"] = wrong[0]["input_ids"][: -len(tail) - 2]  # ends at </think>
    src = tmp_path / "wrong.jsonl"
    src.write_text("".join(dumps_record(r) + "\n" for r in wrong))
    got = {}
    for target in ("final", "correct"):
        out = tmp_path / target
        config = ExitLabelsConfig(input=str(src), output=str(out), target=target,
                                  items=str(traces) if target == "correct" else None)  # fmt: skip
        run_exit_labels(config, RankInfo(), llm=StubLLM(smollm2_tokenizer, records))
        got[target] = [r.get("spec_exit_confidence") for r in read_input(str(out), SkipCounts())]
        if target == "final":
            assert load_manifest(out)["counts"]["unlabelled_no_final_answer"] == 1
    assert got["final"][0] is None
    for rec, final, correct in zip(records[1:], got["final"][1:], got["correct"][1:],
                                   strict=True):  # fmt: skip
        assert final["labels"] == [0.0 if settled else 1.0 for _, settled in boundaries(rec)]
        assert correct["labels"] == [1.0 if settled else 0.0 for _, settled in boundaries(rec)]
        assert final["answers"] == correct["answers"]  # the same probes, judged two ways
    with pytest.raises(ValueError, match="not a label target"):
        ExitLabelsConfig(input="x", output="y", target="gold")


# ---------------------------------------------------------------- on the engine


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), smollm2_dir, seed=0)


def engine_config(traces: Path, tiny_target: Path, out: Path) -> ExitLabelsConfig:
    return ExitLabelsConfig(input=str(traces), output=str(out), model=str(tiny_target),
                            engine=ENGINE, max_tokens=4, records_per_shard=2)  # fmt: skip


@pytest.fixture(scope="module")
def engine_labels(tmp_path_factory, traces, tiny_target) -> Path:
    """The target's greedy answers (garbage from a random model, scored 0 by the real
    verifiers) at every boundary, in three shards."""
    out = tmp_path_factory.mktemp("engine_labels")
    stats = run_exit_labels(engine_config(traces, tiny_target, out), RankInfo())
    assert stats["shards_written"] == 3 and stats["manifest"] is not None
    return out


def test_the_engine_answers_every_probe(engine_labels, traces, tiny_target):
    from specdec import LLM, SamplingParams

    records = records_of(traces)
    labelled = read_input(str(engine_labels), SkipCounts())
    for rec, got in zip(records, labelled, strict=True):
        conf = got["spec_exit_confidence"]
        assert conf["positions"] == [j for j, _ in boundaries(rec)]
        assert set(conf["labels"]) <= {0.0, 1.0} and len(conf["answers"]) == len(conf["labels"])
    # A probe's answer is the target's plain greedy continuation of the forced prefix.
    llm = LLM(str(tiny_target), **ENGINE)
    j = labelled[0]["spec_exit_confidence"]["positions"][1]
    prompt = [*records[0]["input_ids"][: j + 1], *CLOSE, NL, NL]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert labelled[0]["spec_exit_confidence"]["answers"][1] == out[0].outputs[0].text.strip()


def test_resume_after_sigkill_is_byte_identical(engine_labels, traces, tiny_target, tmp_path):
    """The test hook SIGKILLs the CLI halfway through writing its second shard."""
    out = tmp_path / "labels"
    args = ["data-gen", "exit-labels", "-i", str(traces), "-o", str(out),
            "--model", str(tiny_target), "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory", str(ENGINE["kv_cache_memory"]),
            "--max-model-len", str(ENGINE["max_model_len"]), "--max-tokens", "4",
            "--records-per-shard", "2"]  # fmt: skip
    code = "import sys; from specdec.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", code, *args], env={**os.environ, KILL_ENV: "1"},
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert (out / "labels-00000.jsonl").is_file() and not (out / "manifest.json").exists()
    stats = run_exit_labels(engine_config(traces, tiny_target, out), RankInfo())
    assert stats["shards_written"] == 2
    for name in ["manifest.json", *(f"labels-0000{i}.jsonl" for i in range(3))]:
        assert (out / name).read_bytes() == (engine_labels / name).read_bytes(), name


def test_dump_and_online_reader_carry_the_labels(engine_labels, traces, tiny_target, tmp_path):
    from safetensors import safe_open

    from specdec.data_gen.dump import DumpConfig, load_records, run_dump
    from specdec.train.data import OfflineShards
    from specdec.train.spec_exit_labels import ExitLabeler

    labelled = read_input(str(engine_labels), SkipCounts())
    # Labels the stage could not produce on garbage answers: set some to 1 by hand.
    for rec in labelled:
        conf = rec["spec_exit_confidence"]
        conf["labels"] = [float(k % 2) for k in range(len(conf["labels"]))]
    stage = tmp_path / "stage"  # a one-shard stage directory of these records
    store = ShardStore(stage, "labels", "jsonl")
    header = {"stage": "exit-labels"}
    write_plan(store, ["d"], header)
    store.write(0, "".join(dumps_record(r) + "\n" for r in labelled).encode(), "d", {})
    store.merge(["d"], header)
    dense = []
    for rec in labelled:
        conf = np.full(len(rec["input_ids"]), np.nan, dtype=np.float32)
        c = rec["spec_exit_confidence"]
        conf[c["positions"]] = c["labels"]
        dense.append(conf)
    online = load_records(str(stage), 49152, 4096, SkipCounts())
    for rec, want in zip(online, dense, strict=True):
        np.testing.assert_array_equal(rec.confidence, want)
    dump = tmp_path / "dump"
    run_dump(DumpConfig(input=str(stage), output=str(dump), model=str(tiny_target),
                        dtype="float32", compute_dtype="float32", aux_layer_ids=(0, 1, 1)),
             RankInfo())  # fmt: skip
    manifest = load_manifest(dump)
    assert "spec_exit_confidence" in manifest["tensors"]
    with safe_open(str(dump / manifest["shards"][0]["file"]), "pt") as f:
        stored = f.get_tensor("spec_exit_confidence").numpy()
    np.testing.assert_array_equal(stored, np.concatenate(dense))
    labeler = ExitLabeler(("confidence",), (44, 17400, 46), tuple(CLOSE))
    shards = OfflineShards(dump, max_tokens=4096, max_seq_len=4096, eval_shards=0, seed=0,
                           labeler=labeler)  # fmt: skip
    batch = shards.load(shards.epoch_plan(0)[0])
    got = batch.exit_targets[:, 0].numpy()
    order = [labelled.index(next(r for r in labelled if r["input_ids"] == ids))
             for ids in _split(batch)]  # fmt: skip
    held = [_held(labelled[i]) for i in order]  # training holds each probe's label back
    np.testing.assert_array_equal(got, np.concatenate(held))
    assert np.nansum(got) > np.nansum(np.concatenate(dense))


def _held(rec: dict) -> np.ndarray:
    """Per-token confidence targets: inside the think span, the label of the first probe
    at or after each token (after the last probe, the last probe's); NaN elsewhere."""
    ids = rec["input_ids"]
    start = ids.index(OPEN[-1])
    end = next(i for i in range(start, len(ids)) if ids[i : i + 3] == CLOSE)
    c = rec["spec_exit_confidence"]
    label = dict(zip(c["positions"], c["labels"], strict=True))
    out, current = np.full(len(ids), np.nan, dtype=np.float32), np.nan
    for t in range(end - 1, start - 1, -1):  # backwards: the next probe's label
        current = label.get(t, current)
        out[t] = current
    last = max(p for p in label if start <= p < end)
    out[last:end] = label[last]
    return out


def _split(batch) -> list[list[int]]:
    cu = batch.cu_seqlens.tolist()
    ids = batch.input_ids.tolist()
    return [ids[a:b] for a, b in itertools.pairwise(cu)]


def test_cli_parses_markers_and_escapes():
    from specdec.cli import build_parser

    args = build_parser().parse_args(
        ["data-gen", "exit-labels", "-i", "x", "-o", "y", "--think-end", "[9617, 17400, 46]",
         "--delimiters", "\\n\\n", ".\\n", "--answer-prefix", ""]
    )  # fmt: skip
    assert args.think_end == tuple(CLOSE) and args.think_start == "<think>"
    assert args.delimiters == ["\n\n", ".\n"] and args.answer_prefix == ""
