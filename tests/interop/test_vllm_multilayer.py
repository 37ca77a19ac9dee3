"""A deeper head (vLLM's multi-layer EAGLE-3 drafter) trained and exported by specdec
runs in real vLLM (CPU build, own venv) drafting exactly what specdec drafts.

Its own module, and under ``exclusive_vllm``, so that no other vLLM server (test_vllm's
module fixture, perhaps on another test worker) shares the cores with this one.
"""

from __future__ import annotations

import os

import pytest
from test_eval_draft import deeper_head
from test_vllm import specdec_greedy, task_prompts, vllm_drafts_as_specdec
from vllm_server import SKIP_ENV, exclusive_vllm

pytestmark = pytest.mark.slow


def test_a_deeper_head_drafts_in_vllm_as_in_specdec(tmp_path, smollm2_dir, smollm2_tokenizer,
                                                   trained_head_dir):  # fmt: skip
    """A 2-layer head (vLLM's multi-layer EAGLE-3 drafter), exported by specdec: vLLM
    emits the same greedy tokens and accepts its drafts as specdec does, per position.
    Its second layer is made to matter: it lowers the chain of 3's τ from the shipped
    head's ~2.9 to ~2.1, so a reader that skipped or misread the layer would differ by a
    third, far outside the 5% the checks allow (the two engines typically differ by one
    step in ~180, with equal accepted tokens)."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1")
    with exclusive_vllm() as python:
        head = deeper_head(trained_head_dir, tmp_path / "deep", nudge=0.5)
        prompts = task_prompts(smollm2_tokenizer)
        outs, ours = specdec_greedy(head, prompts)
        theirs = vllm_drafts_as_specdec(python, smollm2_dir, head, prompts, tmp_path, outs, ours,
                                        0.05)  # fmt: skip
        assert 1.5 < ours.tau < 2.5, (theirs, ours.summary())  # the second layer changed the drafts
        assert len(theirs["acceptance_rates"]) == len(ours.acceptance_rates)
