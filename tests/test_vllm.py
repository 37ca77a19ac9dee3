"""A head trained and exported by specdec runs in real vLLM (CPU build, own venv).

A tiny head is trained on SmolLM2's own greedy answers to eight prompts (data_gen + 100
train-draft steps), so its drafts are accepted often on those prompts (τ ≈ 3.5 at K=3) and
τ is a sharp comparison, not 1.0 against 1.0. ``specdec export --to vllm`` writes it in the
speculators format; vLLM's OpenAI server loads it with K=3 and:

- reads our aux layers as written (its log names them) and accepts the drafts;
- gives the same greedy tokens as a vLLM server without speculation;
- reports, through ``specdec bench-serve --url`` reading its Prometheus counters, a τ
  within 10% of specdec's for the same head, K and prompt strings (both count
  1 + accepted / verify steps that carried a draft; see serve/spec_metrics.py).

Everything runs in one fixture, in order, so that no two engines share the two cores at
once: specdec's own run first, then both vLLM servers. Set SPECDEC_SKIP_VLLM=1 to skip on
a machine that cannot build the venv.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from vllm_server import SKIP_ENV, start_vllm, vllm_python

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.config import SpeculativeConfig

pytestmark = pytest.mark.slow

SMOLLM2 = "smollm2-135m-instruct"
K = 3
MAX_TOKENS = 48
TOPICS = ["rivers", "chess", "bread", "owls", "volcanoes", "bicycles", "tea", "glaciers"]
ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 64 << 20, "max_num_seqs": 8}


def train_head(root: Path) -> Path:
    """data_gen (greedy answers, fp32 dump, 512-token vocab) + 100 train-draft steps."""
    from specdec.data_gen.dump import DumpConfig, run_dump
    from specdec.data_gen.regenerate import RegenerateConfig, run_regenerate
    from specdec.data_gen.shards import RankInfo
    from specdec.data_gen.vocab import VocabConfig, run_vocab
    from specdec.train.config import TrainConfig
    from specdec.train.trainer import train

    prompts = [{"id": f"t{i}", "prompt": f"Write two sentences about {t}."}
               for i, t in enumerate(TOPICS)]  # fmt: skip
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    regen = RegenerateConfig(
        input=str(root / "prompts.jsonl"), output=str(root / "regen"),
        engine={**ENGINE, "max_model_len": 512}, temperature=0.0, max_tokens=MAX_TOKENS,
        records_per_shard=4,
    )  # fmt: skip
    run_regenerate(regen, RankInfo())
    dump = DumpConfig(input=str(root / "regen"), output=str(root / "dump"), dtype="float32",
                      compute_dtype="float32", shard_bytes=1 << 20, batch_tokens=2048)  # fmt: skip
    run_dump(dump, RankInfo())
    run_vocab(VocabConfig(input=str(root / "dump"), output=str(root), draft_vocab_size=512))
    config = TrainConfig.from_dict({
        "data": {"path": str(root / "dump"), "max_tokens": 256, "eval_shards": 0},
        "ttt": {"steps": 3},
        "optim": {"lr": 2e-3, "warmup_steps": 5, "max_steps": 100, "grad_accum": 1},
        "run": {"output_dir": str(root / "run"), "save_every": 100, "eval_every": 100_000,
                "log_every": 50, "wandb": "disabled"},
    })  # fmt: skip
    return Path(train(config)["head"])


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir, smollm2_tokenizer):
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1")
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    head = train_head(root)
    prompts = [
        smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write two sentences about {t}."}],
            tokenize=False, add_generation_prompt=True,
        )
        for t in TOPICS
    ]  # fmt: skip

    # specdec: the same head, K, prompt strings and greedy budget.
    spec = SpeculativeConfig(method="eagle3", model=str(head), num_speculative_tokens=K)
    llm = LLM(SMOLLM2, **ENGINE, max_model_len=1024, speculative=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), False)
    specdec = {
        "stats": llm.engine.spec_stats,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }
    del llm

    exported = root / "vllm_head"
    assert main(["export", "--to", "vllm", str(head), str(exported),
                 "--num-speculative-tokens", str(K)]) == 0  # fmt: skip
    spec_config = {"method": "eagle3", "model": str(exported), "num_speculative_tokens": K}
    servers = {
        "spec": start_vllm(python, smollm2_dir, ["--speculative-config", json.dumps(spec_config)]),
        "plain": start_vllm(python, smollm2_dir, []),
    }
    try:
        for server in servers.values():
            server.wait_ready(timeout=600)
        prompts_file = root / "prompts_bench.jsonl"
        prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        report_file = root / "bench.json"
        assert main([
            "bench-serve", "--url", servers["spec"].url, "--endpoint", "completions",
            "--prompts-file", str(prompts_file), "--num-prompts", str(len(prompts)),
            "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--concurrency", "1",
            "--json", str(report_file),
        ]) == 0  # fmt: skip
        model = str(smollm2_dir)
        yield {
            "specdec": specdec,
            "bench": json.loads(report_file.read_text()),
            "spec_ids": completions(servers["spec"].url, model, prompts),
            "plain_ids": completions(servers["plain"].url, model, prompts),
            "spec_log": servers["spec"].log_tail(200_000),
        }
    finally:
        for server in servers.values():
            server.stop()


def test_exported_head_loads_in_vllm_with_our_aux_layers(runs):
    assert "Using auxiliary layers from speculative config: (2, 15, 27)" in runs["spec_log"]
    spec = runs["bench"]["speculation"]
    assert spec["source"] == "vllm" and spec["steps"] > 0
    assert spec["acceptance_rates"][0] > 0.5, spec  # a head loaded wrongly is never accepted


def test_vllm_greedy_output_with_speculation_equals_without(runs):
    assert runs["spec_ids"] == runs["plain_ids"]
    assert all(len(ids) > 0 for ids in runs["spec_ids"])


def test_vllm_tau_is_within_10_percent_of_specdec(runs):
    bench, stats = runs["bench"], runs["specdec"]["stats"]
    assert bench["completed"] == len(TOPICS) and bench["failed"] == 0
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
