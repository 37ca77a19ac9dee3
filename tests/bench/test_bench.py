"""``specdec bench`` end to end on CPU (SmolLM2 fp32, the ngram proposer, a few prompts per
set): both reports are written and internally consistent, and every notebook in
notebooks/ executes on the JSON and draws its figures.

The bench runs once per pytest session (a subprocess through the real ``specdec`` entry point, so
the report records the command as typed); each test checks one invariant of its output.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from notebook_runner import NOTEBOOKS, ROOT, figures, run_notebook

from specdec.bench import passes

SETS = ["humaneval", "gsm_symbolic", "writingbench"]
# Figures each notebook draws on the ngram report (no dynamic trees, no draft vocabulary).
MIN_FIGURES = {"acceptance": 4, "tree_shapes": 2, "entropy": 2, "vocab_coverage": 1}


def specdec_bench(args: list[str]) -> subprocess.CompletedProcess:
    exe = shutil.which("specdec")
    cmd = [exe] if exe else [sys.executable, "-m", "specdec.cli"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [*cmd, "bench", *args], capture_output=True, text=True, env=env, timeout=900
    )


CPU = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", str(64 << 20)]


@pytest.fixture(scope="session")
def bench_json(tmp_path_factory, smollm2_dir) -> Path:
    """Three sets × chains K=2,3 × batch sizes 1,2, with the analysis passes; two waves,
    so batch 2 cycles the two prompts to four requests and batch 1 runs each once."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    result = specdec_bench(
        [
            *CPU,
            # The model-free proposer every model gets (the shipped head's default is
            # tested in test_packaged_heads; its speed and τ are bench rows on the H200).
            "--draft", "ngram",
            "--num-prompts", "2",
            "--max-prompt-tokens", "200",
            "--max-tokens", "12",
            "--repeats", "1",
            "--warmup", "0",
            "--batch-sizes", "1,2",
            "--waves", "2",
            "--sweep-chain", "2,3",
            "--analysis",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def report(bench_json) -> dict:
    return json.loads(bench_json.read_text())


def test_writes_both_reports(report, bench_json):
    assert report["schema"] == "specdec.bench/1"
    assert report["command"].startswith("specdec bench ")
    assert "--sweep-chain 2,3" in report["command"]
    assert report["env"]["dtype"] == "float32" and report["git_commit"]
    assert list(report["sets"]) == SETS
    assert {r["label"] for r in report["rows"]} == {"ngram-k2", "ngram-k3"}
    assert len(report["rows"]) == 2 * len(SETS) * 2  # configs × sets × batch sizes
    table = bench_json.with_suffix(".md").read_text()
    header = (
        "| set | proposer | batch | requests | in flight plain/spec, time at full batch "
        "| plain tok/s |"
    )
    assert header in table
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + 12
    for row in report["rows"]:
        cells = f"| {row['set']} | {row['label']} | {row['batch_size']} | {row['num_requests']} |"
        assert cells in table


def test_sets_keep_prompts_outputs_and_entropy(report):
    for name in SETS:
        prompts = report["sets"][name]["prompts"]
        assert len(prompts) == 2
        for p in prompts:
            assert p["messages"][-1]["role"] == "user" and 0 < p["prompt_tokens"] <= 200
            assert 0 < len(p["output_ids"]) <= 12 and p["output_text"]
            assert len(p["target_entropy"]) == len(p["output_ids"])
            assert all(h >= 0 for h in p["target_entropy"])


def test_rows_are_internally_consistent(report):
    for r in report["rows"]:
        plain, spec = r["plain"], r["spec"]
        # speedup is the ratio of the two measured throughputs, each a median of run rates
        assert math.isclose(r["speedup"], spec["tokens_per_s"] / plain["tokens_per_s"])
        for t in (plain, spec):
            rates = [t["output_tokens"] / s for s in t["seconds"]]
            assert math.isclose(t["tokens_per_s"], statistics.median(rates))
            assert t["ttft_s"] > 0 and t["tpot_s"] > 0
        steps, accepted = r["steps"], r["accepted_tokens"]
        if steps:
            assert math.isclose(r["tau"], (accepted + steps) / steps)
            verified = steps + r["drafted_tokens"]  # each step's root and drafts
            assert math.isclose(r["tau_per_verified"], (accepted + steps) / verified)
            rates = r["acceptance_rates"]
            assert len(rates) == r["shape"]["depth"]
            assert all(a >= b for a, b in itertools.pairwise(rates))
            assert rates == [n / steps for n in r["accepted_at_least"]]
            assert sum(r["accepted_at_least"]) == accepted
        assert 0 <= accepted <= r["drafted_tokens"]
        # counts add up across prompts
        per = r["per_prompt"]
        assert sum(p["steps"] for p in per) == steps
        assert sum(p["drafted_tokens"] for p in per) == r["drafted_tokens"]
        assert sum(p["accepted_tokens"] for p in per) == accepted
        for p in per:
            if p["steps"]:
                assert math.isclose(p["tau"], 1 + p["accepted_tokens"] / p["steps"])
        # two waves: batch 2 runs the 2 prompts twice each, batch 1 once
        assert r["num_requests"] == max(r["num_prompts"], 2 * r["batch_size"])
        # batch 1 always has its one request in flight (a full batch all the time); batch 2
        # up to two, and drains to one at the end
        for t in (plain, spec):
            if r["batch_size"] == 1:
                assert t["mean_in_flight"] == 1.0
                assert 0.99 < t["full_batch_share"] <= 1.0  # all but the final sync
            else:
                assert 1.0 < t["mean_in_flight"] <= 2.0
                assert 0.0 < t["full_batch_share"] < 1.0
        assert len(per) == r["num_prompts"]
        # fp32: speculation is lossless, every request of every cycled prompt
        assert r["identical"] == r["compared"] == r["num_requests"] * r["repeats"]
        assert r["vocab_coverage"] is None and r["note"] == "" and r["divergence_gaps"] == []
    # ngram drafts on these sets: the checks above ran on real acceptance
    assert sum(r["accepted_tokens"] for r in report["rows"]) > 0


def test_divergence_gaps_tell_near_ties_from_tokens_plain_would_not_pick(chats):
    """A speculative output that leaves plain decoding's at plain's runner-up token gets
    plain's top-1 minus top-2 logprob gap; at a token outside plain's top 20, a gap at
    least the top-20 spread (greedy outputs stand in for speculative ones here)."""
    from specdec.bench.driver import RunParams, drive
    from specdec.engine.llm import LLM
    from specdec.sampling_params import MAX_LOGPROBS

    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", kv_cache_memory=64 << 20)
    requests = [chats[0], chats[1]]
    params = RunParams(max_tokens=6, ignore_eos=True).sampling(logprobs=MAX_LOGPROBS)
    reference, tops = [[], []], [[], []]
    for i, out in drive(llm.engine, requests, params):
        if out.finished:
            reference[i] = list(out.outputs[0].token_ids)
            tops[i] = [lp.top for lp in out.outputs[0].logprobs]
    near = sorted(tops[0][3].items(), key=lambda kv: -kv[1])
    far = next(t for t in range(1000) if t not in tops[1][0])
    outputs = [
        [*reference[0][:3], near[1][0], *reference[0][4:]],  # the runner-up at index 3
        [far, *reference[1][1:]],  # a token outside the top 20 at index 0
    ]
    divergences = passes.first_divergences(outputs, reference)
    assert [(d.request, d.at) for d in divergences] == [(0, 3), (1, 0)]
    near_gap, far_gap = passes.divergence_gaps(llm, requests, reference, divergences)
    assert near_gap == pytest.approx(near[0][1] - near[1][1], abs=1e-3)
    spread = max(tops[1][0].values()) - min(tops[1][0].values())
    assert far_gap == pytest.approx(spread, abs=1e-3) and far_gap > 1.0


def test_traces_match_the_engine_counters(report):
    """The untimed trace pass sees the same verify steps the timed runs counted."""
    assert len(report["traces"]) == 2 * len(SETS)
    for trace in report["traces"]:
        row = next(
            r
            for r in report["rows"]
            if (r["set"], r["label"], r["batch_size"]) == (trace["set"], trace["label"], 1)
        )
        for steps, prompt in zip(trace["steps"], row["per_prompt"], strict=True):
            assert len(steps) * row["repeats"] == prompt["steps"]
            assert sum(a for _, _, a in steps) * row["repeats"] == prompt["accepted_tokens"]
            positions = [p for p, _, _ in steps]
            assert positions == sorted(set(positions)) and all(p >= 1 for p in positions)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_draws(path, bench_json, monkeypatch):
    outputs = run_notebook(path, bench_json, monkeypatch)
    assert len(figures(outputs)) >= MIN_FIGURES[path.stem]


def test_export_prompts_selects_the_same_prompts(report, tmp_path):
    """--export-prompts writes what a bench with the same selection flags measures, as
    files ``--prompts`` reads back (for machines without the data packages)."""
    result = specdec_bench(
        [*CPU, "--num-prompts", "2", "--max-prompt-tokens", "200", "--max-tokens", "12",
         "--export-prompts", str(tmp_path)]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    from specdec.bench.sets import SetOptions, file_set

    for name in SETS:
        convs = list(file_set(tmp_path / f"{name}.jsonl").load(SetOptions()))
        expected = report["sets"][name]["prompts"]
        assert [c.id for c in convs] == [p["id"] for p in expected]
        assert [list(c.messages) for c in convs] == [p["messages"] for p in expected]


# ---------------------------------------------------------------------------- extras


@pytest.fixture(scope="session")
def extras_report(tmp_path_factory, random_head_dir) -> dict:
    """A random EAGLE-3 head (draft vocabulary of 4,096 ids) on one prompt file, chain and
    dynamic tree, with every HF peer (the target drafting for itself as the assistant)."""
    out = tmp_path_factory.mktemp("bench_extras")
    prompts = out / "mine.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Count from one to ten in words."})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Name three colours."}]})
        + "\n"
    )
    result = specdec_bench(
        [
            *CPU,
            "--prompts", str(prompts),
            "--draft", "eagle3",
            "--draft-model", str(random_head_dir),
            "--sweep-chain", "2",
            "--sweep-top-k", "2",
            "--sweep-depth", "2",
            "--sweep-total-tokens", "1,4",  # 1 < top_k: skipped, not fatal
            "--max-tokens", "6",
            "--repeats", "1",
            "--warmup", "0",
            "--batch-sizes", "2",
            "--peer-hf",
            "--peer-hf-prompt-lookup", "2",
            "--peer-hf-assistant", "smollm2-135m-instruct",
            "--json", str(out / "bench.json"),
        ]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipping sweep point top_k=2 depth=2 total_tokens=1" in result.stderr
    report = json.loads((out / "bench.json").read_text())
    report["markdown"] = (out / "bench.md").read_text()
    return report


def test_head_vocab_coverage(extras_report, random_head_dir):
    from safetensors import safe_open

    t2d = None
    for f in random_head_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            if "t2d" in handle.keys():  # noqa: SIM118 (not a dict)
                t2d = handle.get_tensor("t2d")
    outputs = [t for p in extras_report["sets"]["mine"]["prompts"] for t in p["output_ids"]]
    expected = sum(bool(t2d[t]) for t in outputs) / len(outputs)
    rows = extras_report["rows"]
    assert [r["label"] for r in rows] == ["eagle3-k2", "eagle3-tree-t2-d2-n4"]
    for r in rows:
        assert math.isclose(r["vocab_coverage"], expected) and r["draft_vocab_size"] == 4096
        assert r["identical"] == r["compared"] == 2
    assert "| mine | eagle3-tree-t2-d2-n4 | 2 |" in extras_report["markdown"]


def test_hf_peers(extras_report):
    peers = {p["peer"]: p for p in extras_report["peers"]}
    assert set(peers) == {"hf-generate", "hf-prompt-lookup", "hf-assisted"}
    for p in peers.values():
        assert p["set"] == "mine" and p["batch_size"] == 1 and p["timing"]["tokens_per_s"] > 0
        # HF's greedy decoding emits exactly the engine's tokens (fp32)
        assert p["identical"] == p["compared"] == 2, p["note"]
    # peer columns appear (batch-1 rows only: this run has none, so the cells are empty)
    assert (
        "| hf-generate tok/s | hf-prompt-lookup tok/s | hf-assisted tok/s |"
        in (extras_report["markdown"])
    )


def test_bench_spec_script(tmp_path, smollm2_dir):
    """benchmarks/bench_spec.py (the GPU machinery check) still runs on specdec.bench."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_spec
    finally:
        sys.path.pop(0)
    opts = bench_spec.parse_args(
        [*CPU, "--variants", "ngram-k3", "--batch-sizes", "1", "--max-tokens", "6",
         "--repeats", "2", "--json", str(tmp_path / "spec.json")]
    )  # fmt: skip
    rows = bench_spec.run(opts)
    assert [r.variant for r in rows] == ["plain", "ngram-k3"]
    plain, ngram = rows
    assert plain.speedup == 1.0 and plain.identical == plain.compared == 2
    assert ngram.identical == ngram.compared == 2 and len(ngram.all_seconds) == 2
    assert math.isclose(ngram.speedup, ngram.tokens_per_s / ngram.plain_tokens_per_s)
    saved = json.loads((tmp_path / "spec.json").read_text())
    assert [r["variant"] for r in saved["rows"]] == ["plain", "ngram-k3"]
    assert "graphed (target, draft)" in bench_spec.table(rows)
