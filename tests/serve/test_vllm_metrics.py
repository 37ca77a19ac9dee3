"""bench-serve reads τ and per-position acceptance from either server's /metrics in one
form: vLLM's names (an exposition as vLLM 0.32.0 wrote it) and specdec's own (rendered by
the server's registry), differenced between two scrapes. No server process here; the real
vLLM server is in test_vllm.py."""

from __future__ import annotations

import json

import pytest

from specdec.serve.async_engine import EngineSnapshot
from specdec.serve.bench import format_report
from specdec.serve.metrics import ServerMetrics
from specdec.serve.spec_metrics import METRICS_SOURCES, SpecCounters, read_counters

MODEL = 'engine="0",model_name="/models/SmolLM2-135M-Instruct"'


def vllm_exposition(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
    """/metrics as vLLM 0.32.0 exposes it (names, labels, _created series, a histogram)."""
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{MODEL}}} 0.0",
        "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.",
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        f'vllm:e2e_request_latency_seconds_bucket{{{MODEL},le="0.3"}} 0.0',
        f'vllm:e2e_request_latency_seconds_bucket{{{MODEL},le="+Inf"}} 3.0',
        f"vllm:e2e_request_latency_seconds_count{{{MODEL}}} 3.0",
        f"vllm:e2e_request_latency_seconds_sum{{{MODEL}}} 4.5",
    ]
    for name, doc, value in (
        ("num_drafts", "Number of spec decoding drafts.", drafts),
        ("num_draft_tokens", "Number of draft tokens.", draft_tokens),
        ("num_accepted_tokens", "Number of accepted tokens.", accepted),
    ):
        lines += [
            f"# HELP vllm:spec_decode_{name}_total {doc}",
            f"# TYPE vllm:spec_decode_{name}_total counter",
            f"vllm:spec_decode_{name}_total{{{MODEL}}} {float(value)}",
            f"# HELP vllm:spec_decode_{name}_created {doc}",
            f"# TYPE vllm:spec_decode_{name}_created gauge",
            f"vllm:spec_decode_{name}_created{{{MODEL}}} 1.7960201605732222e+09",
        ]
    lines += [
        "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft "
        "position.",
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
    ]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{MODEL},position="{i}"}} {float(n)}'
        for i, n in enumerate(per_pos)
    ]
    return "\n".join(lines) + "\n"


def specdec_exposition(steps: int, drafted: int, accepted: int, at_least: list[int]) -> str:
    snapshot = EngineSnapshot(
        spec_depth=3,
        spec_steps=steps,
        spec_drafted_tokens=drafted,
        spec_accepted_tokens=accepted,
        spec_accepted_at_least=tuple(at_least),
    )
    return ServerMetrics(lambda: snapshot).render().decode()


def test_vllm_counters_and_their_difference():
    before = vllm_exposition(15, 45, 0, [0, 0, 0])
    after = vllm_exposition(15 + 40, 45 + 120, 70, [35, 25, 10])
    source, b = read_counters(before)
    assert source == "vllm"
    assert b == SpecCounters(15, 45, 0, (0, 0, 0))
    _, a = read_counters(after, "vllm")
    report = a.minus(b).report(source)
    assert report["steps"] == 40 and report["drafted_tokens"] == 120
    assert report["tau"] == pytest.approx(1 + 70 / 40)
    assert report["acceptance_rates"] == pytest.approx([35 / 40, 25 / 40, 10 / 40])
    # τ - 1 is the sum of the a_k: both count steps that accepted at least k tokens.
    assert report["tau"] - 1 == pytest.approx(sum(report["acceptance_rates"]))


def test_vllm_counters_sum_over_engines():
    one = vllm_exposition(10, 30, 12, [6, 4, 2])
    two = one.replace('engine="0"', 'engine="1"')
    merged = one + "\n".join(line for line in two.splitlines() if not line.startswith("#"))
    _, c = read_counters(merged + "\n")
    assert c == SpecCounters(20, 60, 24, (12, 8, 4))


def test_specdec_counters_read_from_the_server_registry():
    source, c = read_counters(specdec_exposition(40, 120, 70, [35, 25, 10]))
    assert source == "specdec"
    assert c == SpecCounters(40, 120, 70, (35, 25, 10))
    assert read_counters(specdec_exposition(40, 120, 70, [35, 25, 10]), "vllm") is None


def test_report_has_the_same_form_for_both_servers():
    runs = {
        "specdec": (specdec_exposition(0, 0, 0, []), specdec_exposition(40, 120, 70, [35, 25, 10])),
        "vllm": (vllm_exposition(0, 0, 0, [0, 0, 0]), vllm_exposition(40, 120, 70, [35, 25, 10])),
    }
    reports = {}
    for name, (before, after) in runs.items():
        _, b = read_counters(before)
        source, a = read_counters(after)
        reports[name] = a.minus(b).report(source)
    assert reports["specdec"] == {**reports["vllm"], "source": "specdec"}
    bench = {
        "model": "m", "completed": 1, "failed": 0, "duration_s": 1.0, "request_throughput": 1.0,
        "output_throughput": 1.0, "total_input_tokens": 1, "total_output_tokens": 1,
        "errors": [], "speculation": reports["vllm"],
        **{k: {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
           for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
    }  # fmt: skip
    text = format_report(bench)
    assert "speculation (vllm metrics): τ=2.75 over 40 verify steps" in text
    assert "per-position acceptance [0.88, 0.62, 0.25]" in text


def test_no_counters_and_unknown_sources():
    assert read_counters("# nothing here\n") is None
    assert read_counters(vllm_exposition(1, 3, 1, [1, 0, 0]), "specdec") is None
    assert set(METRICS_SOURCES) == {"specdec", "vllm"}
    with pytest.raises(ValueError, match="unknown metrics source 'sglang'"):
        read_counters("", "sglang")


def _serve_report(speculation: dict | None) -> dict:
    """A bench-serve report of 4 requests at concurrency 2 (the shape ``summarize`` writes)."""
    from specdec.serve.bench import SERVE_SCHEMA

    stats = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    report = {
        "schema": SERVE_SCHEMA, "model": "smollm2", "base_url": "http://127.0.0.1:8000",
        "settings": {"concurrency": 2, "num_prompts": 4}, "duration_s": 1.0, "completed": 4,
        "failed": 0, "errors": [], "total_input_tokens": 40, "total_output_tokens": 80,
        "request_throughput": 4.0, "output_throughput": 80.0,
        **{k: stats for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
    }  # fmt: skip
    if speculation is not None:
        report["speculation"] = speculation
    return report


def test_serve_report_reads_like_a_bench_report(tmp_path, monkeypatch):
    """The acceptance analysis reads a vLLM server's bench-serve report: the same τ and
    a_k as the counters give, in the bench report's form, and the notebook draws them."""
    from notebook_runner import ROOT, figures, run_notebook

    from specdec.bench import analysis

    _, before = read_counters(vllm_exposition(0, 0, 0, [0, 0, 0]))
    source, after = read_counters(vllm_exposition(40, 120, 70, [35, 25, 10]))
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(_serve_report(after.minus(before).report(source))))
    report = analysis.load_report(path)
    key = (analysis.SERVED_SET, "vllm: smollm2")
    assert analysis.taus(report) == {key: pytest.approx(2.75)}
    assert analysis.acceptance_curves(report)[key] == pytest.approx([35 / 40, 25 / 40, 10 / 40])
    outputs = run_notebook(ROOT / "notebooks" / "acceptance.ipynb", path, monkeypatch)
    assert len(figures(outputs)) >= 2  # a_k and τ


def test_serve_report_without_speculation_is_refused(tmp_path):
    from specdec.bench import analysis

    path = tmp_path / "plain.json"
    path.write_text(json.dumps(_serve_report(None)))
    with pytest.raises(ValueError, match="no speculation counters"):
        analysis.load_report(path)
    path.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="bench-serve --url URL --json PATH"):
        analysis.load_report(path)
