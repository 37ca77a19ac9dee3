"""An EAGLE-3.1 head (a norm on each fused aux state, post-norm states fed back) exported
by specdec runs in real vLLM (CPU build, own venv) drafting what specdec drafts.

Its own module, and under ``exclusive_vllm``, so that no other vLLM server shares the
cores with this one.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_vllm import specdec_greedy, task_prompts, vllm_drafts_as_specdec
from vllm_server import SKIP_ENV, exclusive_vllm

pytestmark = pytest.mark.slow


def eagle3_1_head(trained_head_dir: Path, out: Path, smollm2_hf, tokenizer) -> Path:
    """The trained head as EAGLE-3.1, saved to ``out``: each ``fc_norm``'s weight is the
    median RMS of its aux state over a prompt, so that ``fuse`` stays near the trained
    head's and its first drafts stay mostly right; the post-norm feedback changes the
    deeper ones."""
    from specdec.models import load_config, resolve_model
    from specdec.models.eagle3_formats import load_eagle3, save_eagle3
    from specdec.models.eagle3_head import Eagle3Head

    target = load_config(resolve_model("smollm2-135m-instruct"))
    head = load_eagle3(trained_head_dir, target_config=target)
    head31 = Eagle3Head(replace(head.config, fc_norm=True, norm_output=True), head.attention)
    state = head.state_dict()
    ids = tokenizer("Write a Python function that sorts a list of words.", return_tensors="pt")
    with torch.no_grad():  # HF hidden_states[i]: the residual stream entering layer i
        states = smollm2_hf(**ids, output_hidden_states=True).hidden_states
    for n, layer in enumerate(head.config.aux_layer_ids):
        rms = states[layer][0].float().pow(2).mean(-1).sqrt().median()  # outliers: BOS
        state[f"fc_norm.{n}.weight"] = torch.full((target.hidden_size,), float(rms))
    head31.load_state_dict(state)
    return save_eagle3(head31, out)


def test_an_eagle3_1_head_drafts_in_vllm_as_in_specdec(
    tmp_path, smollm2_dir, smollm2_hf, smollm2_tokenizer, trained_head_dir
):
    """vLLM reads fc_norm and norm_output from the export and emits the same greedy
    tokens, accepting its drafts as specdec does per position (within 10% of τ, the
    rates within 0.05). The variant changes what the head drafts: the same weights as
    EAGLE-3 (norms and feedback ignored, as a reader without 3.1 support would) give a τ
    more than 10% away, so a reader that skipped the switches would fail the check."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1")
    with exclusive_vllm() as python:
        head = eagle3_1_head(trained_head_dir, tmp_path / "h31", smollm2_hf, smollm2_tokenizer)
        prompts = task_prompts(smollm2_tokenizer)
        outs, ours = specdec_greedy(head, prompts)
        _, plain = specdec_greedy(trained_head_dir, prompts)
        assert abs(plain.tau - ours.tau) > 0.1 * ours.tau, (plain.summary(), ours.summary())
        vllm_drafts_as_specdec(python, smollm2_dir, head, prompts, tmp_path, outs, ours, 0.1)
