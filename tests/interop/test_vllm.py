"""A head trained and exported by specdec runs in real vLLM (CPU build, own venv).

The head is the repository's trained SmolLM2 head (the shipped one; conftest's
``trained_head_dir``), asked for eight small Python functions, where its chain of 3 is
accepted often (τ ≈ 2.9 in fp32), so τ is a sharp comparison, not 1.0 against 1.0.
``specdec export --to vllm`` writes it in the speculators format; vLLM's OpenAI server
loads it with K=3 and:

- reads our aux layers as written (its log names them) and accepts the drafts;
- gives, with speculation, the same greedy tokens as specdec's engine for the same prompt
  strings (both fp32: the target's own greedy continuation);
- reports, through ``specdec bench-serve --url`` reading its Prometheus counters, a τ
  within 10% of specdec's for the same head, K and prompt strings (both count
  1 + accepted / verify steps that carried a draft; see serve/spec_metrics.py).

Everything runs in one fixture, in order, so that no two engines share the two cores at
once: specdec's own run first, then the vLLM server, the module holding ``exclusive_vllm``
(no other test worker runs vLLM meanwhile). Set SPECDEC_SKIP_VLLM=1 to skip on a machine
that cannot build the venv.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from vllm_server import SKIP_ENV, VllmServer, exclusive_vllm, start_vllm

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.config import SpeculativeConfig
from specdec.spec.metrics import SpecStats

pytestmark = pytest.mark.slow

SMOLLM2 = "smollm2-135m-instruct"
K = 3
MAX_TOKENS = 48
TASKS = ["sum of a list", "largest of three numbers", "reverse of a string", "factorial of n",
         "number of vowels in a string", "average of a list", "square of each item in a list",
         "first n even numbers"]  # fmt: skip
ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 64 << 20, "max_num_seqs": 8}


def completions(url: str, model: str, prompts: list[str]) -> list[list[int]]:
    """Greedy token ids for each prompt, one request at a time."""
    out = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def task_prompts(tokenizer) -> list[str]:
    """The TASKS as chat prompt strings (both engines get the same strings)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a Python function that returns the {t}."}],
            tokenize=False, add_generation_prompt=True,
        )
        for t in TASKS
    ]  # fmt: skip


def specdec_greedy(
    head_dir: Path, prompts: list[str], method: str = "eagle3"
) -> tuple[list, SpecStats]:
    """specdec's greedy outputs and speculation counters with ``head_dir``, K drafts."""
    spec = SpeculativeConfig(method=method, model=str(head_dir), num_speculative_tokens=K)
    llm = LLM(SMOLLM2, **ENGINE, max_model_len=1024, speculative=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), False)
    return outs, llm.engine.spec_stats


def serve_exported(
    python: Path, smollm2_dir: Path, head_dir: Path, root: Path, method: str = "eagle3"
) -> VllmServer:
    """``specdec export --to vllm`` of ``head_dir`` under ``root``, served by vLLM with K
    as ``method`` (``eagle3`` heads, ``dflash`` block drafters)."""
    exported = root / "vllm_head"
    assert main(["export", "--to", "vllm", str(head_dir), str(exported),
                 "--num-speculative-tokens", str(K)]) == 0  # fmt: skip
    spec_config = {"method": method, "model": str(exported), "num_speculative_tokens": K}
    return start_vllm(python, smollm2_dir, ["--speculative-config", json.dumps(spec_config)])


def vllm_drafts_as_specdec(
    python: Path, smollm2_dir: Path, head_dir: Path, prompts: list[str], root: Path,
    outs: list, ours: SpecStats, tau_tolerance: float, method: str = "eagle3",
    aux_layers: tuple[int, ...] | None = None,
) -> dict:  # fmt: skip
    """Serve ``head_dir``'s export in vLLM as ``method`` and check it against specdec's
    run of it (``outs``, ``ours``): the same greedy tokens, τ within ``tau_tolerance`` (a
    share of ours), each position's acceptance rate within 0.05 (ours lists positions up
    to the deepest acceptance seen, vLLM all K) and, given ``aux_layers`` (our
    numbering), vLLM's log naming them as the target layers it reads. Returns vLLM's
    report."""
    from specdec.serve.spec_metrics import read_counters

    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    server = serve_exported(python, smollm2_dir, head_dir, root, method)
    try:
        server.wait_ready(timeout=600)
        assert completions(server.url, str(smollm2_dir), prompts) == token_ids
        source, counters = read_counters(httpx.get(f"{server.url}/metrics", timeout=10).text)
    finally:
        server.stop()
    if aux_layers is not None:  # adjacent layers' states are alike: τ barely shows a shift
        read = f"Using auxiliary layers from speculative config: {tuple(aux_layers)}"
        assert read in server.log_tail(200_000), read
    theirs = counters.report(source)
    detail = f"vLLM {theirs}; specdec {ours.summary()}"
    assert abs(theirs["tau"] - ours.tau) <= tau_tolerance * ours.tau, detail
    rates = theirs["acceptance_rates"]
    mine = ours.acceptance_rates + [0.0] * (len(rates) - len(ours.acceptance_rates))
    for a, b in zip(rates, mine, strict=True):
        assert abs(a - b) <= 0.05, detail
    return theirs


@pytest.fixture(scope="module")
def python() -> Iterator[Path]:
    """The vLLM venv's python, this module's alone while it runs."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1")
    with exclusive_vllm() as python:
        yield python


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir, smollm2_tokenizer, trained_head_dir, python):
    root = tmp_path_factory.mktemp("vllm")
    prompts = task_prompts(smollm2_tokenizer)

    # specdec: the same head, K, prompt strings and greedy budget.
    outs, stats = specdec_greedy(trained_head_dir, prompts)
    specdec = {
        "stats": stats,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }

    server = serve_exported(python, smollm2_dir, trained_head_dir, root)
    try:
        server.wait_ready(timeout=600)
        prompts_file = root / "prompts_bench.jsonl"
        prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        report_file = root / "bench.json"
        assert main([
            "bench-serve", "--url", server.url, "--endpoint", "completions",
            "--prompts-file", str(prompts_file), "--num-prompts", str(len(prompts)),
            "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--concurrency", "1",
            "--json", str(report_file),
        ]) == 0  # fmt: skip
        yield {
            "specdec": specdec,
            "bench": json.loads(report_file.read_text()),
            "spec_ids": completions(server.url, str(smollm2_dir), prompts),
            "spec_log": server.log_tail(200_000),
        }
    finally:
        server.stop()


def test_exported_head_loads_in_vllm_with_our_aux_layers(runs):
    assert "Using auxiliary layers from speculative config: (2, 15, 27)" in runs["spec_log"]
    spec = runs["bench"]["speculation"]
    assert spec["source"] == "vllm" and spec["steps"] > 0
    assert spec["acceptance_rates"][0] > 0.5, spec  # a head loaded wrongly is never accepted


def test_vllm_greedy_output_with_speculation_equals_specdecs(runs):
    """vLLM drafting with the exported head emits the target's greedy tokens, as specdec
    does (whose speculative output equals its plain decoding: test_engine)."""
    assert runs["spec_ids"] == runs["specdec"]["token_ids"]
    assert all(len(ids) > 0 for ids in runs["spec_ids"])


def test_vllm_tau_is_within_10_percent_of_specdec(runs):
    bench, stats = runs["bench"], runs["specdec"]["stats"]
    assert bench["completed"] == len(TASKS) and bench["failed"] == 0
    assert bench["total_input_tokens"] == runs["specdec"]["prompt_tokens"]  # same prompts
    vllm_tau, specdec_tau = bench["speculation"]["tau"], stats.tau
    detail = (
        f"vLLM τ={vllm_tau:.3f} a_k={bench['speculation']['acceptance_rates']} over "
        f"{bench['speculation']['steps']:.0f} steps; specdec {stats.summary()}"
    )
    assert specdec_tau > 2.0, detail  # a head worth comparing
    assert abs(vllm_tau - specdec_tau) <= 0.1 * specdec_tau, detail
    assert len(bench["speculation"]["acceptance_rates"]) == K


def test_acceptance_notebook_reads_the_vllm_report(runs, tmp_path, monkeypatch):
    """specdec's acceptance analysis on vLLM's own counters: the served row has vLLM's τ
    and a_k, and the notebook draws them."""
    from notebook_runner import ROOT, figures, run_notebook

    from specdec.bench import analysis

    path = tmp_path / "vllm_bench.json"
    path.write_text(json.dumps(runs["bench"]))
    report = analysis.load_report(path)
    spec = runs["bench"]["speculation"]
    [(key, tau)] = analysis.taus(report).items()
    assert key[0] == analysis.SERVED_SET and key[1].startswith("vllm: ")
    assert tau == spec["tau"]
    assert analysis.acceptance_curves(report)[key] == spec["acceptance_rates"]
    outputs = run_notebook(ROOT / "notebooks" / "acceptance.ipynb", path, monkeypatch)
    assert len(figures(outputs)) >= 2
