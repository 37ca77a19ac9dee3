"""EAGLE-3.1 heads (``Eagle3Config.fc_norm``, ``norm_output``) in the engine: every
output equals plain greedy decoding on the real SmolLM2 (fp32, CPU), on the synchronous
and the pipelined step, chains and trees, under preemption. The trained head with
post-norm feedback drafts well enough that drafts are really accepted (its first level is
the trained head's); a random head with both switches exercises the fused norms."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_engine import DYNAMIC, LOSSLESS_TOKENS, PREEMPTING, greedy, make_llm, token_ids
from test_spec_pipeline import PICKED

from specdec.config import SpeculativeConfig
from specdec.models import load_config
from specdec.models.eagle3_formats import load_eagle3, save_eagle3


def _as_variant(head_dir, out, smollm2_dir, *, random_weights: bool, **flags):
    head = load_eagle3(head_dir, target_config=load_config(str(smollm2_dir)))
    variant = type(head)(replace(head.config, **flags), head.attention)
    state = head.state_dict()
    if random_weights:
        torch.manual_seed(0)
        state = {k: torch.randn_like(v) * v.shape[-1] ** -0.5 if v.is_floating_point()
                 and "norm" not in k else v for k, v in state.items()}  # fmt: skip
        state["fc.weight"] = state["fc.weight"] * 1e-3
    variant.load_state_dict(state, strict=False)  # fc_norm: fresh, weight 1
    save_eagle3(variant, out)
    return out


@pytest.fixture(scope="module")
def post_norm_head_dir(trained_head_dir, smollm2_dir, tmp_path_factory):
    return _as_variant(trained_head_dir, tmp_path_factory.mktemp("post_norm"), smollm2_dir,
                       random_weights=False, norm_output=True)  # fmt: skip


@pytest.fixture(scope="module")
def random_31_head_dir(trained_head_dir, smollm2_dir, tmp_path_factory):
    return _as_variant(trained_head_dir, tmp_path_factory.mktemp("random_31"), smollm2_dir,
                       random_weights=True, fc_norm=True, norm_output=True)  # fmt: skip


@pytest.fixture(scope="module")
def reference(smollm2_dir, chats) -> list[list[int]]:
    outs = make_llm(smollm2_dir).generate([chats[i] for i in PICKED],
                                          greedy(LOSSLESS_TOKENS), use_tqdm=False)  # fmt: skip
    return token_ids(outs)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_post_norm_feedback_is_lossless_and_drafts_are_accepted(
    smollm2_dir, post_norm_head_dir, chats, reference, pipelined
):
    spec = SpeculativeConfig(method="eagle3", model=str(post_norm_head_dir),
                             num_speculative_tokens=3, pipelined=pipelined)  # fmt: skip
    llm = make_llm(smollm2_dir, speculative=spec)
    engine = llm.engine
    assert engine.proposer.head.config.norm_output
    outs = llm.generate([chats[i] for i in PICKED], greedy(LOSSLESS_TOKENS), use_tqdm=False)
    assert token_ids(outs) == reference
    stats = engine.spec_stats
    assert stats.accepted_tokens > 0.3 * stats.steps  # drafts really accepted
    if pipelined:
        assert engine.pipeline.num_launches > 0


@pytest.mark.parametrize(
    ("tree", "kwargs"),
    [({"num_speculative_tokens": 3}, PREEMPTING), (DYNAMIC, {})],
    ids=["chain+preemption", "dynamic"],
)
def test_a_random_eagle3_1_head_is_lossless(smollm2_dir, random_31_head_dir, chats, reference,
                                           tree, kwargs):  # fmt: skip
    spec = SpeculativeConfig(method="eagle3", model=str(random_31_head_dir), **tree)
    llm = make_llm(smollm2_dir, speculative=spec, **kwargs)
    assert llm.engine.proposer.head.config.variant == "eagle3.1"
    outs = llm.generate([chats[i] for i in PICKED], greedy(LOSSLESS_TOKENS), use_tqdm=False)
    assert token_ids(outs) == reference
    assert llm.engine.spec_stats.steps > 0
