"""A deeper head (vLLM's multi-layer EAGLE-3 drafter) trained and exported by specdec
runs in real vLLM (CPU build, own venv) drafting exactly what specdec drafts.

Its own module so that no other vLLM server (test_vllm's module fixture) shares the two
cores with this one.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from test_eval_draft import deeper_head
from test_vllm import ENGINE, MAX_TOKENS, SMOLLM2, TASKS, K, completions
from vllm_server import SKIP_ENV, start_vllm, vllm_python

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.config import SpeculativeConfig
from specdec.serve.spec_metrics import read_counters

pytestmark = pytest.mark.slow


def test_a_deeper_head_drafts_in_vllm_as_in_specdec(tmp_path, smollm2_dir, smollm2_tokenizer,
                                                   trained_head_dir):  # fmt: skip
    """A 2-layer head (vLLM's multi-layer EAGLE-3 drafter), exported by specdec: vLLM
    emits the same greedy tokens and accepts its drafts as specdec does, per position.
    Its second layer is made to matter: it lowers the chain of 3's τ from the shipped
    head's ~2.9 to ~2.1, so a reader that skipped or misread the layer would differ by a
    third (session 33's run: 178 vLLM steps against 177, 198 accepted tokens in both)."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1")
    python = vllm_python()
    head = deeper_head(trained_head_dir, tmp_path / "deep", nudge=0.5)
    prompts = [
        smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a Python function that returns the {t}."}],
            tokenize=False, add_generation_prompt=True,
        )
        for t in TASKS
    ]  # fmt: skip
    spec = SpeculativeConfig(method="eagle3", model=str(head), num_speculative_tokens=K)
    llm = LLM(SMOLLM2, **ENGINE, max_model_len=1024, speculative=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), False)
    ours, token_ids = llm.engine.spec_stats, [list(o.outputs[0].token_ids) for o in outs]
    del llm
    exported = tmp_path / "vllm_head"
    assert main(["export", "--to", "vllm", str(head), str(exported),
                 "--num-speculative-tokens", str(K)]) == 0  # fmt: skip
    spec_config = {"method": "eagle3", "model": str(exported), "num_speculative_tokens": K}
    server = start_vllm(python, smollm2_dir, ["--speculative-config", json.dumps(spec_config)])
    try:
        server.wait_ready(timeout=600)
        assert completions(server.url, str(smollm2_dir), prompts) == token_ids
        source, counters = read_counters(httpx.get(f"{server.url}/metrics", timeout=10).text)
    finally:
        server.stop()
    theirs = counters.report(source)
    detail = f"vLLM {theirs}; specdec {ours.summary()}"
    assert 1.5 < ours.tau < 2.5, detail  # the second layer changed the drafts
    assert abs(theirs["tau"] - ours.tau) <= 0.05 * ours.tau, detail
    for a, b in zip(theirs["acceptance_rates"], ours.acceptance_rates, strict=True):
        assert abs(a - b) <= 0.05, detail
