"""EAGLE-3's training-time test (TTT): the head unrolled over its own draft steps.

Alignment (EAGLE's, the same as ``specdec.spec.eagle3`` at inference). Sequences are
packed: global index ``n`` is token ``t`` of its sequence. Step ``i`` (0 .. steps-1) at
``n`` plays a depth-``i+1`` draft from the root ``x[t+1]``:

- input token ``x[t+1+i]``; input hidden ``fuse(aux[t])`` at step 0, else step ``i-1``'s
  output at ``n`` (pre-norm; post-norm for EAGLE-3.1's ``norm_output``); RoPE position
  ``t + i``;
- label: the target's next-token distribution at ``t+1+i`` restricted to the draft
  vocabulary (softmax of the target's logits over the kept ids), i.e. it predicts
  ``x[t+2+i]``;
- attention: step 0's keys at indices ``<= t`` of the same sequence (the catch-up entries
  a request holds at inference) plus steps ``1..i``'s keys at ``n`` itself (its ancestors
  in a chain draft) — ``ttt_attention.ttt_visible`` states this rule once;
- valid iff ``t+1+i`` lies inside the sequence, ``loss_mask[t+1+i]`` and the target's
  argmax at ``t+1+i`` is a kept id (``t2d``): a head cannot be asked for a token it
  cannot emit.

Loss: sum over steps of ``decay**i`` x (the per-position draft loss against the label,
averaged over the step's valid positions): the soft cross-entropy, or an LK loss on the
acceptance rate (``draft_loss.py``, ``ttt.loss``). ``argmax_weight`` ``w`` moves a share
of each label onto the target's argmax, ``(1 - w) * p + w * onehot(argmax p)``: 0 is
EAGLE-3's distillation, 1 the cross-entropy of greedy acceptance's own event (the head's
argmax is the target's).

``acc_i``: fraction of step ``i``'s valid positions where the head's argmax equals the
target's. With greedy target data, a chain drafted from
``x[t+1]`` accepts exactly the leading run of correct steps at ``n``, so ``simulated τ`` =
1 + the mean leading run over positions valid at step 0.

``ttt_forward(..., trace=True)`` also returns a ``DraftTrace``: each step's *hits* (the
head's argmax equals the target's at the step's source, whatever the loss mask says) and
the target's full-vocabulary argmax, for ``specdec eval-draft``'s replay of chain decoding
(``chain_replay.py``), which counts drafts where the loss mask does not reach.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.train.draft_loss import DRAFT_LOSSES
from specdec.train.ttt_attention import TTTCache, TTTMeta

if TYPE_CHECKING:
    from specdec.train.spec_exit_loss import ExitLossOutput


@dataclass
class PackedBatch:
    """One micro-batch of packed sequences (padding, if any, is a final pseudo-sequence
    whose loss mask is all False)."""

    input_ids: torch.Tensor  # [n] int64
    loss_mask: torch.Tensor  # [n] bool: assistant tokens
    aux_hidden: torch.Tensor  # [n, 3 * hidden]: the target's aux residual streams
    target_hidden: torch.Tensor  # [n, hidden]: the target's final-normed hidden states
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int64: sequence boundaries
    # [n, num_signals] float32: SpecExit labels (spec_exit_labels), NaN = none; None: off
    exit_targets: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def padded(self, n: int) -> PackedBatch:
        """This batch with ``n - num_tokens`` padding tokens appended as one pseudo-sequence
        (loss mask False, zero states, no exit labels): the objective is unchanged and
        every batch of a run gets the same shape (static shapes for compiled kernels)."""
        pad = n - self.num_tokens
        if pad < 0:
            raise ValueError(f"a batch of {self.num_tokens} tokens cannot be padded to {n}")
        if pad == 0:
            return self

        def grow(t: torch.Tensor, fill: float | bool) -> torch.Tensor:
            return torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])

        return PackedBatch(
            input_ids=grow(self.input_ids, 0),
            loss_mask=grow(self.loss_mask, False),
            aux_hidden=grow(self.aux_hidden, 0),
            target_hidden=grow(self.target_hidden, 0),
            cu_seqlens=torch.cat([self.cu_seqlens, self.cu_seqlens.new_full((1,), n)]),
            exit_targets=None if self.exit_targets is None
            else grow(self.exit_targets, float("nan")),
        )  # fmt: skip

    def to(self, device: torch.device | str) -> PackedBatch:
        exit_targets = self.exit_targets
        return PackedBatch(
            *(t.to(device, non_blocking=True) for t in (
                self.input_ids, self.loss_mask, self.aux_hidden, self.target_hidden,
                self.cu_seqlens,
            )),
            exit_targets=exit_targets.to(device, non_blocking=True) if exit_targets is not None
            else None,
        )  # fmt: skip


@dataclass
class StepIndex:
    """Where step ``i`` reads its token and label (``PackedBatch`` indices)."""

    seq_ids: torch.Tensor  # [n] int64: sequence of each index
    local: torch.Tensor  # [n] int64: index within its sequence (t)
    seq_end: torch.Tensor  # [n] int64: global index one past the sequence's last token

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, n: int) -> StepIndex:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        seq_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device),
                                          lengths, output_size=n)  # fmt: skip
        local = torch.arange(n, device=lengths.device) - cu_seqlens[seq_ids]
        return cls(seq_ids, local, cu_seqlens[1:][seq_ids])

    def source(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(index of ``x[t+1+i]`` clamped into the batch [n], whether it exists [n])."""
        n = self.seq_ids.shape[0]
        src = torch.arange(n, device=self.seq_ids.device) + 1 + i
        inside = src < self.seq_end
        return torch.where(inside, src, torch.zeros_like(src)), inside


@dataclass
class DraftTrace:
    """Per-position outcomes of one unroll (``ttt_forward(..., trace=True)``).

    ``hits[i, n]`` holds iff ``x[t+1+i]`` exists in the sequence, the target's argmax at
    ``t+1+i`` is a kept id and the head's step-``i`` argmax equals it: step ``i`` drafted
    the token greedy decoding emits there. Unlike ``TTTOutput``'s figures it ignores the
    loss mask, so ``hits & loss_mask[source]`` are the trainer's correct steps."""

    hits: torch.Tensor  # [steps, n] bool
    target_top: torch.Tensor  # [n] int64: the target's argmax (full vocabulary) at n


@dataclass
class TTTOutput:
    """Per-step figures stay on the device (no host sync in the training step)."""

    loss: torch.Tensor  # scalar: sum_i decay**i * loss_i (the one that carries gradients)
    step_losses: torch.Tensor  # [steps] float32, detached
    step_correct: torch.Tensor  # [steps] int64: valid positions where argmax matches
    step_valid: torch.Tensor  # [steps] int64: valid positions
    leading_correct: torch.Tensor  # [n] int64: correct steps in a row from step 0
    valid0: torch.Tensor  # [n] bool: positions valid at step 0
    exit: ExitLossOutput | None = None  # the SpecExit term, when trained (included in loss)
    trace: DraftTrace | None = None  # per-position hits, when asked (``ttt_forward``)

    @property
    def step_acc(self) -> list[float]:
        """acc_i (nan for a step without valid positions)."""
        pairs = zip(self.step_correct.tolist(), self.step_valid.tolist(), strict=True)
        return [c / v if v else float("nan") for c, v in pairs]

    @property
    def simulated_tau(self) -> float:
        """1 + mean leading run of correct steps over step-0-valid positions."""
        runs = self.leading_correct[self.valid0]
        return 1.0 + float(runs.float().mean()) if runs.numel() else 1.0


@dataclass
class DraftStep:
    """One unrolled step's outputs over the whole batch."""

    step: int
    source: torch.Tensor  # [n] int64: index of the step's input token x[t+1+i] (clamped)
    inside: torch.Tensor  # [n] bool: x[t+1+i] exists in the sequence
    logits: torch.Tensor  # [n, draft_vocab] float32


def unroll(head, batch: PackedBatch, steps: int) -> Iterator[DraftStep]:
    """Run the head's ``steps`` draft steps over ``batch`` (alignment: module docstring).
    ``head`` is an ``Eagle3Head`` whose attention backend is a TTT one, embedding bound."""
    index = StepIndex.of(batch.cu_seqlens, batch.num_tokens)
    hidden = head.fuse(batch.aux_hidden.to(head.fc.weight.dtype))  # [n, hidden]
    caches = [TTTCache() for _ in range(head.config.num_layers)]  # one per head layer
    kv = [(cache, cache) for cache in caches]  # (k_cache, v_cache): both in one TTTCache
    # RoPE positions t + i clamped into the head's table: the padding pseudo-sequence
    # (``PackedBatch.padded``) runs up to the batch size, and t + i passes a sequence's end
    # on its last steps; only rows outside every loss (``inside`` False, or no loss mask)
    # reach past the table, and their keys are seen by no valid row (``ttt_visible``). The
    # gather is unchecked on GPU, so an index past the table is a device-side assert.
    last = head.rotary.num_positions - 1
    for i in range(steps):
        src, inside = index.source(i)
        meta = TTTMeta(index.seq_ids, i, steps)
        positions = (index.local + i).clamp(max=last)
        hidden, logits = head(batch.input_ids[src], hidden, positions, kv, meta)
        yield DraftStep(i, src, inside, logits)


def ttt_forward(
    head,
    batch: PackedBatch,
    target_lm_head: torch.Tensor,  # [vocab, hidden]: the target's (frozen) output weights
    *,
    steps: int = 7,
    decay: float = 0.8,
    label_weight: torch.Tensor | None = None,  # [draft_vocab, hidden]: its kept-id rows
    trace: bool = False,
    argmax_weight: float = 0.0,
    loss: str = "ce",
    lk_eta: float = 3.0,
) -> TTTOutput:
    """The TTT objective: weighted loss and per-step accuracy (module docstring).
    ``label_weight`` (``draft_rows(head, target_lm_head)``) saves gathering the kept rows
    on every call; callers that train for many steps pass it once computed. ``trace``
    keeps each step's hits (``DraftTrace``) for evaluation; training leaves it off."""
    n = batch.num_tokens
    position_loss = DRAFT_LOSSES[loss]
    with torch.no_grad():
        target_top, kept, usable = usable_labels(head, batch, target_lm_head)
        if label_weight is None:
            label_weight = draft_rows(head, target_lm_head)
    device = batch.input_ids.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    losses, corrects, counts, hits = [], [], [], []
    correct_run = torch.ones(n, dtype=torch.bool, device=device)
    leading = torch.zeros(n, dtype=torch.int64, device=device)
    valid0 = torch.zeros(n, dtype=torch.bool, device=device)
    with torch.no_grad():  # every position's label once; step i reads them shifted by i
        labels = draft_labels(batch.target_hidden, label_weight)  # [n, V_d]
        label_top = labels.argmax(-1)  # [n]
        labels = mix_argmax(labels, label_top, argmax_weight)
    for out in unroll(head, batch, steps):
        valid = out.inside & usable[out.source]  # [n]
        if out.step == 0:
            valid0 = valid
        target_p = labels[out.source]  # [n, V_d]
        per_pos = position_loss(target_p, out.logits, lk_eta)  # [n]
        count = valid.sum()
        loss_i = (per_pos * valid).sum() / count.clamp(min=1)
        total = total + decay**out.step * loss_i
        with torch.no_grad():
            match = out.logits.argmax(-1) == label_top[out.source]  # [n]
            correct = match & valid
            correct_run &= correct
            leading += correct_run.long()
            if trace:
                hits.append(match & out.inside & kept[out.source])
        losses.append(loss_i.detach())
        corrects.append(correct.sum())
        counts.append(count)
    return TTTOutput(
        total, torch.stack(losses), torch.stack(corrects), torch.stack(counts), leading, valid0,
        trace=DraftTrace(torch.stack(hits), target_top) if trace else None,
    )  # fmt: skip


def usable_labels(
    head, batch: PackedBatch, target_lm_head: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [n] each
    """(the target's argmax at each index, whether the head can emit it, whether its label
    counts: an assistant token whose argmax is kept). Step ``i``'s valid positions are
    ``inside & usable[source]`` (module docstring)."""
    target_top = _argmax_logits(batch.target_hidden, target_lm_head)  # [n] target ids
    kept = head.t2d[target_top]  # [n]
    return target_top, kept, batch.loss_mask & kept


def draft_labels(
    target_hidden: torch.Tensor,  # [n, hidden]: the target's final-normed hidden states
    label_weight: torch.Tensor,  # [draft_vocab, hidden]: the target lm_head's kept-id rows
) -> torch.Tensor:  # [n, V_d] float32
    """The target's next-token distribution restricted to the draft vocabulary."""
    logits = target_hidden.to(label_weight.dtype) @ label_weight.T
    return torch.softmax(logits.float(), dim=-1)


def mix_argmax(
    labels: torch.Tensor,  # [n, V_d] float32: the target's distribution over the draft vocab
    label_top: torch.Tensor,  # [n] int64: its argmax
    weight: float,
) -> torch.Tensor:  # [n, V_d]: (1 - weight) * labels + weight * onehot(label_top), in place
    """Move ``weight`` of each label's mass onto its argmax (module docstring). Each row
    still sums to 1 and keeps its argmax, so acc_i and simulated τ mean what they did."""
    if weight:
        labels.mul_(1.0 - weight).scatter_add_(
            1, label_top[:, None], labels.new_full((labels.shape[0], 1), weight)
        )
    return labels


def draft_rows(head, target_lm_head: torch.Tensor) -> torch.Tensor:  # [draft_vocab, hidden]
    """The target lm_head's rows of the head's kept ids (draft id order)."""
    kept = head.d2t + torch.arange(head.d2t.shape[0], device=head.d2t.device)
    return target_lm_head.index_select(0, kept.to(target_lm_head.device))


def _argmax_logits(
    hidden: torch.Tensor,  # [n, hidden]
    lm_head: torch.Tensor,  # [vocab, hidden]
    chunk: int = 4096,
) -> torch.Tensor:  # [n] int64
    """argmax of ``hidden @ lm_head.T`` in row chunks (full-vocab logits of a long batch
    would not fit in memory at once)."""
    out = []
    for lo in range(0, hidden.shape[0], chunk):
        out.append((hidden[lo : lo + chunk].to(lm_head.dtype) @ lm_head.T).argmax(-1))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.int64)
