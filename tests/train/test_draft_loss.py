"""TTT's per-position draft losses (train/draft_loss.py): the soft cross-entropy and the
LK losses on the acceptance rate alpha = sum min(p, q), checked against their formulas,
their fixed points and their gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.train.config import TTTSection
from specdec.train.draft_loss import ALPHA_FLOOR, DRAFT_LOSSES, acceptance


def _pair(seed: int, n: int = 6, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.softmax(torch.randn(n, vocab, generator=gen) * 2, dim=-1)
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float32) * 2
    return labels, logits


def test_each_loss_is_its_formula() -> None:
    labels, logits = _pair(0)
    q = torch.softmax(logits, dim=-1)
    alpha = torch.minimum(labels, q).sum(-1)
    torch.testing.assert_close(acceptance(labels, q.log()), alpha)
    assert bool(((alpha > 0) & (alpha < 1)).all())
    ce = -(labels * q.log()).sum(-1)
    kl = (labels * (labels.log() - q.log())).sum(-1)
    lam = torch.exp(-3.0 * alpha)
    torch.testing.assert_close(DRAFT_LOSSES["ce"](labels, logits, 3.0), ce)
    torch.testing.assert_close(DRAFT_LOSSES["lk_alpha"](labels, logits, 3.0), -alpha.log())
    want = lam * kl + (1 - lam) * (1 - alpha)
    torch.testing.assert_close(DRAFT_LOSSES["lk_hybrid"](labels, logits, 3.0), want)


def test_lk_losses_vanish_where_the_draft_is_the_label_and_stay_finite_where_disjoint() -> None:
    labels, _ = _pair(1)
    logits = labels.log()  # q == p
    for name in ("lk_alpha", "lk_hybrid"):
        torch.testing.assert_close(DRAFT_LOSSES[name](labels, logits, 3.0),
                                   torch.zeros(labels.shape[0]), atol=1e-6, rtol=0)  # fmt: skip
    p = F.one_hot(torch.tensor([0, 1]), 4).float()  # the label on token 0 (1), the draft on 3
    far = torch.tensor([[-50.0, -50.0, -50.0, 50.0]] * 2, requires_grad=True)
    loss = DRAFT_LOSSES["lk_alpha"](p, far, 3.0)
    torch.testing.assert_close(loss, torch.full((2,), -torch.tensor(ALPHA_FLOOR).log().item()))
    hybrid = DRAFT_LOSSES["lk_hybrid"](p, far, 3.0).detach()  # alpha ~ 0: lam ~ 1, all KL
    assert bool(torch.isfinite(hybrid).all()) and float(hybrid.min()) > 50


@pytest.mark.parametrize("name", ["lk_alpha", "lk_hybrid"])
def test_a_gradient_step_raises_the_acceptance_rate(name: str) -> None:
    labels, logits = _pair(2)
    logits.requires_grad_(True)
    before = acceptance(labels, F.log_softmax(logits, -1)).detach()
    DRAFT_LOSSES[name](labels, logits, 3.0).sum().backward()
    with torch.no_grad():
        after = acceptance(labels, F.log_softmax(logits - 0.05 * logits.grad, -1))
    assert bool((after > before).all())


def test_the_hybrid_weight_carries_no_gradient() -> None:
    """d/dlogits of lam * KL + (1 - lam) * (1 - alpha) with lam = exp(-eta alpha) held
    fixed: the weight only mixes the two gradients."""
    labels, logits = _pair(3)
    logits.requires_grad_(True)
    DRAFT_LOSSES["lk_hybrid"](labels, logits, 3.0).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    log_q = F.log_softmax(logits, -1)
    alpha = acceptance(labels, log_q)
    lam = torch.exp(-3.0 * alpha).detach()
    kl = (labels * (labels.log() - log_q)).sum(-1)
    (lam * kl - (1 - lam) * alpha).sum().backward()
    torch.testing.assert_close(got, logits.grad)


def test_the_config_names_the_losses() -> None:
    assert TTTSection(loss="lk_hybrid").loss == "lk_hybrid"
    with pytest.raises(ValueError, match=r"ttt.loss='kl'; choose one of ce \| lk_alpha"):
        TTTSection(loss="kl")
    with pytest.raises(ValueError, match=r"ttt.lk_eta=-1.0 must be >= 0"):
        TTTSection(lk_eta=-1.0)
