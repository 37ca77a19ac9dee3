"""The per-position draft loss of TTT (train config ``ttt.loss``): how far a step's
draft distribution ``q`` (softmax of the head's logits) is from its label ``p`` (the
target's distribution over the draft vocabulary, renormalised there; ``ttt.argmax_weight``
may have moved mass onto its argmax).

- ``ce``: soft cross-entropy ``-sum p log q`` (EAGLE-3's distillation; KL(p || q) plus
  the label's entropy, a constant).
- LK losses (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for
  Speculative Decoding", arXiv 2602.23881) train on the acceptance rate of speculative
  sampling itself, ``alpha = sum min(p, q)`` (1 - the total variation distance):
  - ``lk_alpha``: ``-log alpha`` (alpha floored at 1e-5: a position whose draft puts no
    mass where the label has any still has a finite loss and gradient);
  - ``lk_hybrid``: ``lam * KL(p || q) + (1 - lam) * (1 - alpha)`` with ``lam =
    exp(-eta * alpha)``, alpha detached in the weight: KL's well-scaled gradients while
    the draft is far from the label, the acceptance rate's once it is close. ``eta``
    (``ttt.lk_eta``) 3 is the paper's EAGLE-3 setting (and vLLM speculators' default).

Per position, like speculators' implementation (SpecForge's weights whole steps by their
batch-mean alpha); the step's valid positions and the steps' ``decay`` weights are
applied by the caller (``ttt.ttt_forward``) as for ``ce``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ALPHA_FLOOR = 1e-5

# labels [n, V] float32 (rows sum to 1), logits [n, V] float32, eta -> loss [n]
PositionLoss = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def acceptance(labels: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:  # [n]
    """``alpha = sum_x min(p(x), q(x))``: the chance that speculative sampling accepts a
    token drafted from ``q`` against ``p``."""
    return torch.minimum(labels, log_q.exp()).sum(-1)


def _ce(labels: torch.Tensor, logits: torch.Tensor, eta: float) -> torch.Tensor:
    return -(labels * F.log_softmax(logits, dim=-1)).sum(-1)


def _lk_alpha(labels: torch.Tensor, logits: torch.Tensor, eta: float) -> torch.Tensor:
    alpha = acceptance(labels, F.log_softmax(logits, dim=-1))
    return -alpha.clamp(min=ALPHA_FLOOR).log()


def _lk_hybrid(labels: torch.Tensor, logits: torch.Tensor, eta: float) -> torch.Tensor:
    log_q = F.log_softmax(logits, dim=-1)
    alpha = acceptance(labels, log_q)
    # KL(p || q) = sum p (log p - log q); 0 log 0 = 0.
    log_p = torch.where(labels > 0, labels.log(), torch.zeros_like(labels))
    kl = (labels * (log_p - log_q)).sum(-1)
    lam = torch.exp(-eta * alpha.detach())
    return lam * kl + (1.0 - lam) * (1.0 - alpha)


DRAFT_LOSSES: dict[str, PositionLoss] = {
    "ce": _ce,
    "lk_alpha": _lk_alpha,
    "lk_hybrid": _lk_hybrid,
}
