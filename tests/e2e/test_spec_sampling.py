"""Speculative sampling through the whole engine keeps the target's distribution.

A tiny random target and a different tiny random draft model (both with SmolLM2's
vocabulary, so the engine runs its real tokenizer path) generate 3 tokens for 6,000
copies of one prompt at temperature 1 with top-k 4. The first token comes from plain
sampling, the second from verifying the draft's token (accepted, or rejected and
resampled from the residual). The joint frequency of (first, second) must match the
exact target distribution p(t1) p(t2 | t1) computed with HF transformers — and the same
test must reject a broken acceptor that always accepts the draft.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import make_tiny_model_dir

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig

N = 6_000
TOP_K = 4
PROMPT = [17, 2934, 880, 41, 1337, 9, 512, 77]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smollm2_dir):
    out = tmp_path_factory.mktemp("tiny_target")
    return make_tiny_model_dir(out, smollm2_dir, seed=1, logit_scale=6.0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, smollm2_dir):
    out = tmp_path_factory.mktemp("tiny_draft")
    return make_tiny_model_dir(out, smollm2_dir, seed=2, logit_scale=6.0)


def _filtered(logits: torch.Tensor) -> torch.Tensor:  # [V] -> [V] probabilities
    top = logits.topk(TOP_K)
    probs = torch.zeros_like(logits)
    probs[top.indices] = torch.softmax(top.values, dim=-1)
    return probs


@pytest.fixture(scope="module")
def exact_joint(target_dir) -> dict[tuple[int, int], float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = _filtered(model(torch.tensor([PROMPT])).logits[0, -1].double())
        joint = {}
        for t1 in p1.nonzero().flatten().tolist():
            p2 = _filtered(model(torch.tensor([[*PROMPT, t1]])).logits[0, -1].double())
            for t2 in p2.nonzero().flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def _sample_pairs(target_dir, draft_dir, n: int = N) -> tuple[dict[tuple[int, int], int], LLM]:
    spec = SpeculativeConfig(method="draft_model", model=str(draft_dir), num_speculative_tokens=1)
    llm = LLM(
        str(target_dir),
        device="cpu",
        dtype="float32",
        kv_cache_memory=512 << 20,
        max_model_len=64,
        max_num_seqs=1000,  # waves of 1,000: [1000, vocab] logits stay small
        max_num_batched_tokens=1000 * len(PROMPT),
        speculative=spec,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True)
    outs = llm.generate([PROMPT] * n, params, use_tqdm=False)
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        pair = tuple(o.outputs[0].token_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1
    return counts, llm


def _chi_square_p(counts, joint) -> float:
    n = sum(counts.values())
    unexpected = sum(n for pair, n in counts.items() if pair not in joint)
    if unexpected:
        return 0.0
    stat = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in joint.items())
    dof = len(joint) - 1
    # Wilson-Hilferty normal approximation of the chi-square tail.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_engine_speculative_sampling_matches_target(target_dir, draft_dir, exact_joint):
    counts, llm = _sample_pairs(target_dir, draft_dir)
    stats = llm.engine.spec_stats
    assert stats.steps >= N and 0 < stats.accepted_tokens < stats.drafted_tokens
    assert _chi_square_p(counts, exact_joint) > 0.01


def test_broken_acceptor_is_detected(target_dir, draft_dir, exact_joint, monkeypatch):
    """Always accepting the draft token skews the second token: the same check fails,
    already on a third of the draws (so the check has power at the size it runs at)."""
    from specdec.engine import sync_step
    from specdec.ops.accept import Acceptance

    def accept_all(trees, target_logits, meta, generator=None):
        width = max(t.num_nodes for t in trees)
        path = torch.zeros(len(trees), width, dtype=torch.int64)
        tokens = torch.zeros(len(trees), width, dtype=torch.int64)
        start = 0
        for b, tree in enumerate(trees):
            n = tree.num_nodes
            path[b, :n] = torch.arange(n)
            bonus = target_logits[start + n - 1].argmax()
            tokens[b, :n] = torch.cat([tree.token_ids[1:], bonus[None]])
            start += n
        num_accepted = torch.tensor([t.num_nodes - 1 for t in trees])
        return Acceptance(num_accepted=num_accepted, path=path, token_ids=tokens)

    monkeypatch.setattr(sync_step, "accept_batch", accept_all)
    counts, _ = _sample_pairs(target_dir, draft_dir, N // 3)
    assert _chi_square_p(counts, exact_joint) < 1e-6
