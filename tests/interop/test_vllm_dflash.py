"""A block drafter (DFlash-style) fitted and exported by specdec runs in real vLLM (CPU
build, own venv) as ``method: "dflash"``, drafting what specdec drafts.

The drafter is a one-layer block-4 drafter for SmolLM2 (a 256-wide MLP) fitted to
SmolLM2's own greedy continuations of four of the eight task prompts
(test_block_drafter_engine's helper), so its chains of 3 are mostly accepted there and
mostly rejected on the other four: τ and each position's rate sit well inside their
ranges, a sharp comparison. ``specdec export --to vllm`` writes it in the ``dflash``
layout (``target_layer_ids`` = our aux layers − 1, ``dflash_config``); vLLM's OpenAI
server loads it with K = 3, logs our aux layers as those it reads, emits specdec's greedy
tokens for the same prompt strings, and accepts its drafts as specdec does: τ within 10%
and each position's rate within 0.05.

Its own module, and under ``exclusive_vllm``, so that no other vLLM server shares the
cores with this one. Set SPECDEC_SKIP_VLLM=1 to skip on a machine that cannot build the
venv.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_block_drafter_engine import fit_to_continuations, smollm2_drafter
from test_vllm import (
    ENGINE,
    MAX_TOKENS,
    SMOLLM2,
    specdec_greedy,
    task_prompts,
    vllm_drafts_as_specdec,
)
from vllm_server import SKIP_ENV, exclusive_vllm

from specdec import LLM, SamplingParams
from specdec.models.block_drafter_formats import save_block_drafter

pytestmark = pytest.mark.slow

FITTED = 4  # the first FITTED task prompts: the drafter learns their continuations


def test_a_block_drafter_drafts_in_vllm_as_in_specdec(
    tmp_path, smollm2_dir, smollm2_hf, smollm2_tokenizer
):
    """vLLM runs the exported drafter as ``dflash`` reading our aux layers, with the same
    greedy tokens and the same acceptance as specdec. The layers are checked in vLLM's
    log, because τ hardly shows them: read one layer lower or higher, this drafter's τ in
    specdec moves from 1.91 to 1.91 and 1.93, neighbouring residual streams being that
    alike. Its mask token misread, it drafts at random (τ 1.01), far outside 10%."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1")
    with exclusive_vllm() as python:
        prompts = task_prompts(smollm2_tokenizer)
        plain = LLM(SMOLLM2, **ENGINE, max_model_len=1024).generate(
            prompts[:FITTED], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), False
        )
        sequences = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in plain]
        vocab = torch.tensor(sorted({t for s in sequences for t in s} | set(range(256))))
        torch.manual_seed(0)
        drafter = smollm2_drafter(smollm2_dir, vocab, intermediate_size=256)  # fits fast
        fit_to_continuations(drafter, smollm2_hf, sequences,
                             [len(o.prompt_token_ids) for o in plain], steps=120)  # fmt: skip
        drafter_dir = save_block_drafter(drafter, tmp_path / "drafter")

        outs, ours = specdec_greedy(drafter_dir, prompts, "dflash")
        assert [o.outputs[0].token_ids for o in outs[:FITTED]] == [
            o.outputs[0].token_ids for o in plain
        ]
        assert ours.tau > 1.8, ours.summary()  # a drafter worth comparing
        theirs = vllm_drafts_as_specdec(python, smollm2_dir, drafter_dir, prompts, tmp_path,
                                        outs, ours, 0.1, "dflash",
                                        drafter.config.aux_layer_ids)  # fmt: skip
        assert len(theirs["acceptance_rates"]) == len(ours.acceptance_rates), (theirs, ours)
        print(f"block drafter, K=3: vLLM {theirs}; specdec {ours.summary()}")
