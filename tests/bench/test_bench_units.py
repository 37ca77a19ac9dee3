"""``specdec.bench`` pieces that need no model: the set registry and prompt files, sweeps,
interleaving, summaries, the analysis helpers, and the CLI's errors."""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from pathlib import Path

import pytest

from specdec.bench import analysis, passes
from specdec.bench.config import BenchConfig, label, sweep
from specdec.bench.driver import RequestRecord, Run
from specdec.bench.measure import Agreement, Timing, measure_interleaved, per_prompt_counts
from specdec.bench.sets import SETS, SetOptions, file_set, get_set
from specdec.bench.sets.writingbench import is_english
from specdec.config import SpeculativeConfig
from specdec.data_gen.package_files import PackageDataMissing
from specdec.spec.metrics import SpecStats


def test_registry_names_the_three_sets():
    assert list(SETS) == ["humaneval", "gsm_symbolic", "writingbench"]
    with pytest.raises(ValueError, match=r"unknown bench set 'mtbench'.*humaneval.*--prompts"):
        get_set("mtbench")


def test_builtin_sets_load_in_a_fixed_order():
    first = next(get_set("humaneval").load(SetOptions()))
    assert first.id == "HumanEval/0" and "has_close_elements" in first.messages[0]["content"]
    a, b = (
        list(itertools.islice(get_set("gsm_symbolic").load(SetOptions(seed=3)), 3)) for _ in "ab"
    )
    assert [c.id for c in a] == ["gsm_symbolic/3#0", "gsm_symbolic/3#1", "gsm_symbolic/3#2"]
    assert a == b  # seeded
    english = list(get_set("writingbench").load(SetOptions()))
    assert len(english) == 558 and all(is_english(c.messages[0]["content"]) for c in english)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails
    with pytest.raises(PackageDataMissing, match=r"pip install 'reasoning-gym==0.1.25'"):
        next(get_set("gsm_symbolic").load(SetOptions()))


def test_prompt_files(tmp_path):
    path = tmp_path / "chat.jsonl.gz"
    lines = [
        {"prompt": "Hi"},
        {},  # skipped below: written as a blank line
        {
            "id": "x",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Why?"},
                {"role": "assistant", "content": "Because."},
            ],
        },
    ]
    path.write_bytes(gzip.compress("\n".join(json.dumps(x) if x else "" for x in lines).encode()))
    bench_set = file_set(path)
    assert bench_set.name == "chat"
    convs = list(bench_set.load(SetOptions()))
    assert [c.messages for c in convs] == [
        ({"role": "user", "content": "Hi"},),
        ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}),
    ]
    assert convs[1].id == "x"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not a"):
        list(file_set(bad).load(SetOptions()))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        file_set(tmp_path / "missing.jsonl")


def test_sweep_expands_chains_and_the_tree_grid():
    base = SpeculativeConfig(method="eagle3", model="head", num_speculative_tokens=4)
    assert sweep(base) == ([base], [])
    configs, skipped = sweep(base, chain=[1, 3], top_k=[2, 8], total_tokens=[4, 16])
    assert [label(c) for c in configs] == [
        "eagle3-k1",
        "eagle3-k3",
        "eagle3-tree-t2-d4-n4",
        "eagle3-tree-t8-d4-n16",
    ]
    assert all(c.model == "head" for c in configs)
    # more nodes than top_k=2 can grow in 4 levels; fewer nodes than top_k=8 children
    assert [s.split(":")[0] for s in skipped] == [
        "top_k=2 depth=4 total_tokens=16",
        "top_k=8 depth=4 total_tokens=4",
    ]


def test_sweep_points_drop_the_bases_depths_by_batch_size():
    """A base with depths by batch size is its own point (labelled with its bands); sweep
    points name one shape each."""
    base = SpeculativeConfig(
        method="eagle3", model="head", num_speculative_tokens_by_batch_size=[[4, 5]]
    )
    assert [label(c) for c in sweep(base)[0]] == ["eagle3-k3-b4k5"]
    configs, _ = sweep(base, chain=[3], top_k=[8], depth=[5])
    assert [label(c) for c in configs] == ["eagle3-k3", "eagle3-tree-t8-d5-n48"]
    assert all(c.num_speculative_tokens_by_batch_size is None for c in configs)


def test_bands_naming_shapes_parse_from_the_flag_and_label_by_shape():
    """``--num-speculative-tokens-by-batch-size 1:t8-d6-n32,2:c5,4:5``: a tree, a chain and a
    depth; the label names each band's shape."""
    from specdec.cli_engine import depth_bands

    bands = depth_bands("1:t8-d6-n32,2:c5,4:5")
    assert bands == [
        [1, {"tree": "dynamic", "top_k": 8, "num_speculative_tokens": 6, "total_tokens": 32}],
        [2, {"tree": "chain", "num_speculative_tokens": 5}],
        [4, 5],
    ]
    spec = SpeculativeConfig(
        method="eagle3", model="head", num_speculative_tokens_by_batch_size=bands
    )
    assert label(spec) == "eagle3-k3-b1t8d6n32-b2c5-b4k5"
    with pytest.raises(argparse.ArgumentTypeError, match="1:t8-d6-n32 a dynamic tree"):
        depth_bands("1:t8-d6")
    with pytest.raises(argparse.ArgumentTypeError):
        depth_bands("1:5@cuda")  # a device confines a shape, not a depth
    gpu = depth_bands("1:t8-d6-n32@cuda,4:5")
    assert gpu[0][1]["device"] == "cuda"
    spec = SpeculativeConfig(
        method="eagle3", model="head", num_speculative_tokens_by_batch_size=gpu
    )
    assert label(spec) == "eagle3-k3-b1t8d6n32@cuda-b4k5"


def test_drafters_compare_at_the_sweeps_shapes(tmp_path):
    """Each drafter runs every shape of the sweep it can draft (one verify budget for all):
    n-gram the chains, a block drafter of block 4 shapes up to depth 3; two drafters of one
    method are told apart by directory."""
    from specdec.bench.config import compare_drafters, labels_of

    block = tmp_path / "block"
    block.mkdir()
    (block / "config.json").write_text(
        json.dumps({"architectures": ["DFlashDraftModel"], "block_size": 4})
    )
    base = SpeculativeConfig(method="eagle3", model="heads/a", top_k=8, total_tokens=16)
    shapes, _ = sweep(base, chain=[3], top_k=[8], depth=[4])
    others, skipped = compare_drafters(shapes, [f"dflash:{block}", "ngram", "eagle3:heads/b"])
    assert [(c.method, c.model, c.tree) for c in others] == [
        ("dflash", str(block), "chain"),
        ("ngram", None, "chain"),
        ("eagle3", "heads/b", "chain"),
        ("eagle3", "heads/b", "dynamic"),
    ]
    assert [s.split(": ")[0] for s in skipped] == [
        f"dflash:{block} eagle3-tree-t8-d4-n16",
        "ngram eagle3-tree-t8-d4-n16",
    ]
    assert "drafts 4 tokens deep" in skipped[0] and "chain" in skipped[1]
    assert labels_of(shapes + others) == [
        "eagle3[a]-k3",
        "eagle3[a]-tree-t8-d4-n16",
        "dflash-k3",
        "ngram-k3",
        "eagle3[b]-k3",
        "eagle3[b]-tree-t8-d4-n16",
    ]
    config = BenchConfig(speculative=tuple(shapes + others))
    assert config.label_of(others[0]) == "dflash-k3"
    with pytest.raises(ValueError, match="speculation configs repeat"):
        BenchConfig(speculative=(base, base))


def test_sweep_pairs_each_shape_with_the_synchronous_and_pipelined_step():
    base = SpeculativeConfig(method="eagle3", model="head")
    configs, _ = sweep(base, chain=[3], top_k=[8], depth=[5], pipelined=[False, True])
    assert [label(c) for c in configs] == [
        "eagle3-k3-sync",
        "eagle3-k3-pipelined",
        "eagle3-tree-t8-d5-n48-sync",
        "eagle3-tree-t8-d5-n48-pipelined",
    ]
    assert [c.pipelined for c in configs] == [False, True, False, True]


def test_config_validation():
    with pytest.raises(ValueError, match="unknown bench set"):
        BenchConfig(sets=("nope",))
    with pytest.raises(ValueError, match="repeats=0"):
        BenchConfig(repeats=0)
    with pytest.raises(ValueError, match="repeat"):
        BenchConfig(speculative=(SpeculativeConfig(), SpeculativeConfig()))
    with pytest.raises(ValueError, match="waves=0 must be >= 1"):
        BenchConfig(waves=0)


def test_waves_fill_the_batch_and_keep_every_prompt():
    """A batch size runs ``waves`` batches' worth of requests, never fewer than the set's
    prompts (each prompt at least once, also when the batch is smaller than the set)."""
    assert [BenchConfig().num_requests(16, b) for b in (1, 16)] == [16, 16]
    assert [BenchConfig(waves=4).num_requests(16, b) for b in (1, 2, 16)] == [16, 16, 64]
    assert BenchConfig(waves=3).num_requests(2, 5) == 15


def test_cli_errors_are_clear(capsys):
    from specdec.cli import main

    assert main(["bench", "--sets", "humaneval,nope"]) == 2
    assert "unknown bench set 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--batch-sizes", "0,2"])
    assert "positive integers" in capsys.readouterr().err


def _run(seconds: float, outputs: list[list[int]], counts: list[tuple[int, int, int]]) -> Run:
    stats = SpecStats()
    for steps, drafted, accepted in counts:
        for i in range(steps):  # spread the prompt's counters over its steps
            d = drafted // steps + (i < drafted % steps)
            a = accepted // steps + (i < accepted % steps)
            stats.record(d, a)
    requests = [
        RequestRecord(out, "length", 0.1, 0.02, s, d, a)
        for out, (s, d, a) in zip(outputs, counts, strict=True)
    ]
    return Run(seconds, requests, stats)


def test_interleaving_alternates_the_order():
    calls: list[str] = []

    def contender(name):
        def run():
            calls.append(name)
            return _run(1.0, [[1]], [(0, 0, 0)])

        return run

    runs = measure_interleaved({"a": contender("a"), "b": contender("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert [len(r) for r in runs.values()] == [3, 3]


def test_summaries():
    runs = [
        _run(2.0, [[1, 2, 3], [4, 5]], [(2, 6, 3), (1, 3, 0)]),
        _run(1.0, [[1, 2, 3], [4, 6]], [(2, 6, 4), (1, 3, 1)]),
        _run(4.0, [[1, 2, 3], [4, 5]], [(2, 6, 3), (1, 3, 0)]),
    ]
    timing = Timing.of(runs)
    assert timing.tokens_per_s == 2.5 and timing.seconds == [2.0, 1.0, 4.0]
    assert timing.ttft_s == 0.1 and timing.tpot_s == 0.02
    counts = per_prompt_counts(runs)
    assert [(c.steps, c.drafted_tokens, c.accepted_tokens) for c in counts] == [
        (6, 18, 10),
        (3, 9, 1),
    ]
    assert counts[0].tau == 1 + 10 / 6
    # Cycled prompts (waves): request j is prompt j mod 2, and its counters fold into it.
    cycled = [_run(1.0, [[1], [2], [1]], [(2, 6, 3), (1, 3, 0), (4, 8, 5)])]
    folded = per_prompt_counts(cycled, num_prompts=2)
    assert [(c.steps, c.drafted_tokens, c.accepted_tokens) for c in folded] == [
        (6, 14, 8),
        (1, 3, 0),
    ]
    assert len(folded[0].ttft_s) == 2 and len(folded[1].ttft_s) == 1
    agreement = Agreement.of(runs, [[1, 2, 3], [4, 5]])
    assert (agreement.identical, agreement.compared, agreement.first_mismatch_at) == (5, 6, 1)
    assert agreement.note == "MISMATCH from token 1"


def test_entropy_and_coverage_helpers():
    import math

    import torch

    assert passes.entropy_from_top([0.0]) == 0.0
    assert math.isclose(passes.entropy_from_top([math.log(0.5)] * 2), math.log(2))
    # the 0.5 outside the top is one outcome: a lower bound
    assert math.isclose(passes.entropy_from_top([math.log(0.5)]), math.log(2))
    t2d = torch.tensor([True, False, True, False])
    assert passes.vocab_coverage(t2d, [[0, 1], [2, 2]]) == 0.75
    assert passes.vocab_coverage(None, [[0]]) is None


def test_analysis_helpers():
    # chain of 3: step at 1 accepts 2 (positions 1, 2; 3 rejected), step at 4 accepts all 3
    steps = [[1, 3, 2], [4, 3, 3], [8, 1, 0]]
    assert analysis.position_outcomes(steps, depth=3) == {
        1: True,
        2: True,
        3: False,
        4: True,
        5: True,
        6: True,
        8: False,
    }
    assert analysis.rates_from_steps(steps, 3) == [2 / 3, 2 / 3, 1 / 3]
    pairs = [(0.0, True), (0.1, True), (0.1, False), (3.0, False), (5.0, True)]
    rates, counts = analysis.binned_acceptance(pairs, [0.0, 0.05, 1.0, 5.0])
    assert rates == [1.0, 0.5, 0.5] and counts == [1, 2, 2]
    from collections import Counter

    assert analysis.frequency_coverage(Counter({7: 6, 8: 3, 9: 1}), [1, 2, 10]) == [
        0.6,
        0.9,
        1.0,
    ]


def test_load_report_rejects_other_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"rows": []}))
    expected = r"not a specdec\.bench/1 or specdec\.bench-serve/1 report"
    with pytest.raises(ValueError, match=expected):
        analysis.load_report(path)


def test_vocab_cut_steps_counts_out_of_vocabulary_stops():
    """benchmarks/vocab_bench_coverage.py: a step whose first rejected draft was meant for
    a token outside the draft vocabulary is a cut; the estimate lets it go on at the
    conditional rates measured on in-vocabulary tries."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from vocab_bench_coverage import cut_steps

    outputs = [[10, 11, 12, 13, 14, 15, 16]]
    t2d = torch.ones(20, dtype=torch.bool)
    t2d[13] = False
    # (first output index, drafted, accepted): a miss at 12 (in the vocabulary), a cut at
    # 13, then two accepted before a miss at 16. Rates: depth 0 2/2, depth 1 1/2, depth 2 0/1.
    traces = [[(1, 3, 1), (3, 3, 0), (4, 3, 2)]]
    assert cut_steps(traces, outputs, t2d) == (3, 1, 1.0 + 1.0 * 0.5 + 0.0)
    t2d[13] = True  # every token drafted: nothing to add
    assert cut_steps(traces, outputs, t2d) == (3, 0, 0.0)


def test_first_divergences_skip_equal_and_length_only_differences():
    reference = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [1, 1]]
    outputs = [[1, 2, 3, 4], [5, 6, 0, 7], [8], [2, 1, 1]]
    assert passes.first_divergences(outputs, reference) == [
        passes.Divergence(request=1, at=2, reference_token=7, spec_token=0),
        passes.Divergence(request=3, at=0, reference_token=1, spec_token=2),
    ]
    assert passes.divergence_gaps(None, [], [], []) == []  # nothing to rerun: no engine call


def test_tier_tiles_keep_the_fastest_equal_bits_tile_over_every_tuned_row_count():
    """benchmarks/skinny_gemm.py --write-tier: per weight shape, the tile whose times summed
    over the tuned row counts are least, among tiles with the decode tile's bits at every
    one of them (a tile that differed or failed at some row count is out); a fused
    gate/up shape is keyed by its half width, as ``gemm_tiles`` looks it up."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from skinny_gemm import _tier_tiles

    def tile(m, us, same=True):
        return {"us": us, "same_bits": same, "block_m": m, "block_n": 16, "block_k": 128,
                "num_warps": 4, "num_stages": 3}  # fmt: skip

    o_proj = {"shape": "o_proj", "N": 576, "K": 576}
    gate_up = {"shape": "gate_up+silu", "N": 3072, "K": 576}
    rows = [
        # m64 is fastest at 32 rows but differs at 64: out; m32 (3 + 3) beats m16 (4 + 5)
        {**o_proj, "grid": [tile(16, 4), tile(32, 3), tile(64, 1)]},
        {**o_proj, "grid": [tile(16, 5), tile(32, 3), tile(64, 2, same=False)]},
        # m32 failed to launch at 64 rows (missing): m16 is the only tile timed at both
        {**gate_up, "grid": [tile(16, 9), tile(32, 1)]},
        {**gate_up, "grid": [tile(16, 9)]},
        {"shape": "down", "N": 576, "K": 1536},  # not tuned
    ]
    got = _tier_tiles(rows)
    assert set(got) == {"576,576", "1536,576"}
    assert got["576,576"]["block_m"] == 32 and got["1536,576"]["block_m"] == 16
    assert set(got["576,576"]) == {"block_m", "block_n", "block_k", "num_warps", "num_stages"}


def test_step_timeline_splits_a_run_into_full_batch_and_drain_at_the_cutoff():
    """benchmarks/step_timeline.py: steps with every slot taken are the full-batch phase,
    the rest the drain, split again at the speculation cutoff; shares are of the run's
    wall time, tokens and steps summed per (phase, mode)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from step_timeline import StepRow, summarize

    rows = [
        StepRow(0.0, 0.5, 4, 0, 4, "AsyncStep", 0),
        StepRow(0.5, 0.25, 4, 4, 0, "AsyncStep", 4),
        StepRow(0.75, 0.125, 3, 3, 0, "AsyncStep", 3),
        StepRow(0.875, 0.125, 2, 2, 0, "SyncStep", 4),
        StepRow(1.0, 0.0, 1, 1, 0, "", 1),
    ]
    lines = summarize("default", rows, batch=4, cutoff=2)
    assert lines[0] == "default: 5 steps, 1.000 s, 12 tokens, 12 tok/s"
    body = {tuple(cell.strip() for cell in line.split("|")[1:3]): line for line in lines[3:]}
    assert set(body) == {
        ("full batch", "AsyncStep"),
        ("drain", "AsyncStep"),
        ("drain <= 2", "SyncStep"),
        ("drain <= 2", "(read)"),
    }
    assert (
        body["full batch", "AsyncStep"]
        == "| full batch | AsyncStep | 2 | 0.750 | 75.0% | 4 | 375.00 |"
    )
    assert body["drain <= 2", "SyncStep"].split("|")[3:6] == [" 1 ", " 0.125 ", " 12.5% "]
    plain = summarize("none", rows, batch=4, cutoff=None)
    assert {line.split("|")[1].strip() for line in plain[3:]} == {"full batch", "drain"}


def test_gpu_bench_engines_hold_the_same_kv_slots_with_and_without_speculation(monkeypatch):
    """On the GPU every engine the bench builds gets the same number of KV blocks (what
    ``BENCH_KV_BYTES`` hold in the target's bf16 K/V layout), whatever its proposer keeps
    per slot; a size the user gave is kept as given."""
    import torch

    from specdec.bench import runner
    from specdec.config import SpeculativeConfig

    built = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner, "LLM", lambda model, **kwargs: built.append(kwargs))
    spec_config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    for spec in (None, spec_config):
        runner.build_llm("smollm2-135m-instruct", {"dtype": "auto"}, spec, 64)
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, K and V, bf16, 16-token blocks.
    blocks = runner.BENCH_KV_BYTES // (2 * 30 * 3 * 64 * 2 * 16)
    assert [kw["num_blocks"] for kw in built] == [blocks, blocks]
    assert [kw["speculative"] for kw in built] == [None, spec_config]
    runner.build_llm("smollm2-135m-instruct", {"kv_cache_memory": 1 << 30}, None, 64)
    assert "num_blocks" not in built[-1] and built[-1]["kv_cache_memory"] == 1 << 30


def test_serve_load_merges_its_clients_reports():
    """benchmarks/serve_load.py: streams split over client processes report as one run:
    tokens and throughputs add up (the engine's tokens per step divide by all of them)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from serve_load import merge_client_reports

    def client(tokens: int, seconds: float, tpot: float) -> dict:
        return {
            "output_throughput": tokens / seconds,
            "completed": tokens // 256,
            "failed": 0,
            "total_input_tokens": 1000 * (tokens // 256),
            "total_output_tokens": tokens,
            "duration_s": seconds,
            "tpot_ms": {"p50": tpot},
            "ttft_ms": {"p50": 10 * tpot},
        }

    merged = merge_client_reports([client(16384, 2.0, 2.5), client(16384, 2.5, 3.0)])
    assert merged["total_output_tokens"] == 32768 and merged["completed"] == 128
    assert merged["output_throughput"] == 16384 / 2.0 + 16384 / 2.5
    assert merged["duration_s"] == 2.5 and merged["clients"] == 2
    assert merged["tpot_ms"] == {"p50": 2.75} and merged["ttft_ms"] == {"p50": 27.5}


def test_serve_load_splits_a_slots_cycle_into_server_and_client():
    """The client's share of a closed-loop slot: 64 slots, 640 requests in 10 s make a
    1,000 ms cycle; the server held each request 800 ms on average, so 200 ms went
    elsewhere. The e2e mean comes from the /metrics sums taken around the run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from serve_load import client_ms, ttft_split_ms

    before = {k: (0.0, 0.0) for k in ("ttft", "e2e", "prepare", "queue", "prefill")}
    after = {"ttft": (64.0, 640), "e2e": (512.0, 640), "prepare": (32.0, 640)}
    after |= {"queue": (12.8, 640), "prefill": (6.4, 640)}
    split = ttft_split_ms(before, after)
    assert split["e2e"] == pytest.approx(800.0) and split["rest"] == pytest.approx(20.0)
    report = {"duration_s": 10.0, "completed": 640}
    assert client_ms(64, report, split) == pytest.approx(200.0)
    assert client_ms(64, report, {"e2e": None}) is None
    assert client_ms(64, {"duration_s": 1.0, "completed": 0}, split) is None


def test_serve_load_variants_name_a_base_and_their_extra_flags():
    """``BASE@LABEL`` runs BASE's server with LABEL's flags and compares with BASE offline;
    a variant or flags entry it cannot read is a clear error."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from serve_load import parse_variant_args, variant_base

    assert variant_base("none") == "none" and variant_base("default@w4") == "default"
    flags = parse_variant_args(["w4=--tokenizer-workers 4 --tokenizer-max-batch 8"])
    assert flags == {"w4": ["--tokenizer-workers", "4", "--tokenizer-max-batch", "8"]}
    with pytest.raises(SystemExit, match="'eagle@w4' must be BASE or BASE@LABEL"):
        variant_base("eagle@w4")
    with pytest.raises(SystemExit, match="'w4' is not LABEL=FLAGS"):
        parse_variant_args(["w4"])
