"""Batched token sampling: greedy and random rows, per-request seeds, top logprobs.

The *filtered target distribution* of a row is what ``probs_from_logits`` returns:
softmax(logits / T) restricted by top-k, then top-p, then min-p (the order fixed in
``specdec.sampling_params``), renormalised; for a greedy row it is the one-hot of the
argmax. Sampling draws exactly from it, and lossless rejection sampling must verify
against exactly it, so both go through the same two pure functions below.

Hot-path rule: nothing here reads a device value on the host (no ``.item()``, ``.tolist()``
or ``nonzero``). The host booleans in ``SamplingMetadata`` decide which work to skip.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specdec.device.staging import to_device
from specdec.sampling.seeded_stream import SeededStream, keys_tensor, row_exponentials
from specdec.sampling_params import SamplingParams

# Exp(1) draws of exactly 0 would divide by zero; 0/0 is NaN and argmax favours NaN.
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny


@dataclass
class SamplingMetadata:
    """One step's sampling inputs for a batch of ``B`` rows (one row per sampled token).

    Invariants: tensors are on the logits' device; ``temperature`` is 1.0 on greedy rows
    (so dividing by it is harmless); ``top_k`` is 0 where disabled, ``top_p`` 1.0 and
    ``min_p`` 0.0 where disabled; ``len(streams) == B``. The host flags are exact
    summaries of the tensors and exist so the common batches skip work without a sync.
    """

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = disabled
    top_p: torch.Tensor  # [B] float32, 1.0 = disabled
    min_p: torch.Tensor  # [B] float32, 0.0 = disabled
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    max_top_k: int  # >= every row's top_k (0 if none set): top-k alone then needs no sort
    no_top_p: bool
    no_min_p: bool
    streams: list[SeededStream | None]  # per row; None = draw from the batch's RNG
    max_num_logprobs: int | None  # largest ``logprobs`` in the batch; None if none asked

    @property
    def no_top_k(self) -> bool:
        return self.max_top_k == 0

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def all_seeded(self) -> bool:
        return all(g is not None for g in self.streams)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        streams: list[SeededStream | None],
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Gather per-row tensors and flags. Row ``i`` samples with ``params[i]``; a seeded
        random row needs its request's stream (``SeededStream(seed)``) in ``streams[i]``."""
        if not params:
            raise ValueError("params is empty; a sampling step needs at least one row")
        if len(streams) != len(params):
            raise ValueError(
                f"got {len(streams)} streams for {len(params)} rows; pass one per row "
                "(None for unseeded rows)"
            )
        # One pass over the rows (this runs every step for the whole batch).
        temperature: list[float] = []
        top_p: list[float] = []
        min_p: list[float] = []
        top_k: list[int] = []
        greedy: list[bool] = []
        row_streams: list[SeededStream | None] = []
        max_num_logprobs = None
        for i, (p, g) in enumerate(zip(params, streams, strict=True)):
            is_greedy = p.is_greedy
            if is_greedy:
                temperature.append(1.0)
                row_streams.append(None)  # greedy rows never draw: the stream stays put
            else:
                if g is None and p.seed is not None:
                    raise ValueError(
                        f"row {i} has seed={p.seed} but no stream; create SeededStream(seed) "
                        "when the request arrives and pass it every step"
                    )
                temperature.append(p.temperature)
                row_streams.append(g)
            greedy.append(is_greedy)
            top_p.append(p.top_p)
            min_p.append(p.min_p)
            top_k.append(p.top_k)
            if p.logprobs is not None and (
                max_num_logprobs is None or p.logprobs > max_num_logprobs
            ):
                max_num_logprobs = p.logprobs
        b = len(params)
        # Two packed copies (float32, int64), staged so the host never waits on the device.
        floats = to_device(np.array(temperature + top_p + min_p, dtype=np.float32), device)
        ints = to_device(np.array(top_k + greedy, dtype=np.int64), device)
        return cls(
            temperature=floats[:b],
            top_k=ints[:b],
            top_p=floats[b : 2 * b],
            min_p=floats[2 * b :],
            greedy=ints[b:].bool(),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            max_top_k=max(top_k),
            no_top_p=top_p.count(1.0) == b,
            no_min_p=min_p.count(0.0) == b,
            streams=row_streams,
            max_num_logprobs=max_num_logprobs,
        )


# Up to this k, top-k alone runs as two topk calls instead of a stable sort of the
# whole vocabulary (the stable sort of [2000, 49152] logits took 10-15 s on a busy CPU).
_TOP_K_WITHOUT_SORT = 1024


def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V] float32
    top_k: torch.Tensor | None,  # [B] int64, <= 0 disables the row; None disables all
    top_p: torch.Tensor | None,  # [B] float32, 1.0 disables the row; None disables all
    max_top_k: int | None = None,  # host int >= every row's top_k, if known
) -> torch.Tensor:  # [B, V] float32, dropped tokens set to -inf
    """Mask every token outside the top-k / top-p set with -inf (out of place).

    top-k keeps the k highest logits; ties at the boundary go to the lower token id.
    top-p then keeps the smallest prefix of the remaining tokens, in descending order,
    whose probability (softmax of the top-k-masked logits) sums to >= top_p; the most
    likely token is always kept, and a row with top_p == 1 loses nothing to rounding.
    With top-k alone and ``max_top_k`` given (and small), the same set is found without
    sorting the vocabulary (``_apply_top_k``).
    """
    if top_k is None and top_p is None:
        return logits
    if top_p is None and max_top_k is not None and 0 < max_top_k <= _TOP_K_WITHOUT_SORT:
        return _apply_top_k(logits, top_k, max_top_k)
    vocab = logits.shape[-1]
    # A stable sort breaks ties by token id, matching torch.argmax's choice.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device)  # [V]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab)  # [B]
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)  # [B, V]
        # A token is needed while the mass strictly before it is still < top_p. Shifting
        # the cumsum (rather than subtracting p) compares the exact cumulative sums.
        mass_before = F.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [B, V]
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _apply_top_k(
    logits: torch.Tensor,  # [B, V] float32
    top_k: torch.Tensor,  # [B] int64, <= 0 disables the row
    max_top_k: int,  # >= every row's top_k
) -> torch.Tensor:  # [B, V] float32
    """top-k as the stable sort keeps it, from the k-th largest logit: every logit above
    it, then the lowest ids among those equal to it until k are kept. Two topk calls and
    a few elementwise passes; no sort and no cumulative sum over the vocabulary."""
    vocab = logits.shape[-1]
    kmax = min(max_top_k, vocab)
    k = top_k.clamp(1, kmax)[:, None]  # [B, 1]
    top = logits.topk(kmax, dim=-1).values  # [B, kmax], descending
    kth = top.gather(-1, k - 1)  # [B, 1]
    # Logits above the k-th all sit in `top`; the ties fill the slots they leave (>= 1).
    room = k - (top > kth).sum(dim=-1, keepdim=True)  # [B, 1]
    tied = logits == kth  # [B, V]
    ids = torch.arange(vocab, device=logits.device, dtype=torch.float32)  # exact below 2**24
    lowest = torch.where(tied, -ids, float("-inf")).topk(kmax, dim=-1).values  # [B, kmax]
    last = -lowest.gather(-1, room - 1)  # [B, 1] the highest tied id still kept
    keep = (logits > kth) | (tied & (ids <= last))  # [B, V]
    keep |= ((top_k <= 0) | (top_k >= vocab))[:, None]  # rows that drop nothing
    return logits.masked_fill(~keep, float("-inf"))


def apply_min_p(
    logits: torch.Tensor,  # [B, V] float32
    min_p: torch.Tensor,  # [B] float32, 0 disables the row
) -> torch.Tensor:  # [B, V] float32, dropped tokens set to -inf
    """Drop tokens whose probability is below ``min_p`` times the row's largest.

    Works on logits (p_i / p_max = exp(l_i - l_max)), so it needs no softmax and gives the
    same set before or after any renormalisation."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # [B, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def probs_from_logits(
    logits: torch.Tensor,  # [B, V] float32, raw model output
    meta: SamplingMetadata,
) -> torch.Tensor:  # [B, V] float32, rows sum to 1
    """Each row's filtered target distribution (see the module docstring)."""
    if meta.all_greedy:
        return _one_hot_argmax(logits)
    scaled = logits / meta.temperature[:, None]  # [B, V]
    scaled = apply_top_k_top_p(
        scaled,
        None if meta.no_top_k else meta.top_k,
        None if meta.no_top_p else meta.top_p,
        meta.max_top_k,
    )
    if not meta.no_min_p:
        scaled = apply_min_p(scaled, meta.min_p)
    probs = scaled.softmax(dim=-1)  # [B, V]
    if meta.all_random:
        return probs
    return torch.where(meta.greedy[:, None], _one_hot_argmax(logits), probs)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:  # [B, V] float32
    top = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
    return torch.zeros_like(logits).scatter_(-1, top, 1.0)


@dataclass
class LogprobsTensors:
    """Log-probabilities under log_softmax of the *raw* logits (before temperature and
    filtering), as the OpenAI API reports them. ``n`` is the batch's max_num_logprobs;
    rows that asked for fewer slice their first entries (sorted by logprob, descending)."""

    top_token_ids: torch.Tensor  # [B, n] int64
    top_logprobs: torch.Tensor  # [B, n] float32
    sampled_logprobs: torch.Tensor  # [B] float32: logprob of the token in token_ids


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Turns one step's logits into tokens.

    Sampling uses the exponential race: with q_i ~ Exp(1) i.i.d., argmax_i p_i / q_i is
    distributed exactly as p, needs no cumulative sum, and is sync-free. A seeded row draws
    its q from its own stream (``seeded_stream``: all seeded rows in one device op), so its
    tokens do not depend on the rest of the batch; unseeded rows share one batched draw
    from ``generator`` (torch's default RNG if None).
    Greedy rows take argmax(logits); ties go to the lowest token id.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,  # [B, V] float32
        meta: SamplingMetadata,
    ) -> SamplerOutput:
        if logits.dtype != torch.float32:
            raise TypeError(
                f"logits have dtype {logits.dtype}; the sampler needs float32 "
                "(upcast the lm_head output with .float())"
            )
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(
                f"logits have shape {tuple(logits.shape)}; expected [{meta.num_rows}, vocab] "
                "(one row per SamplingMetadata row)"
            )
        if meta.all_greedy:
            token_ids = logits.argmax(dim=-1)  # [B]
        else:
            probs = probs_from_logits(logits, meta)  # [B, V]; greedy rows are one-hot
            token_ids = (probs / self._exponentials(probs, meta)).argmax(dim=-1)  # [B]
        return SamplerOutput(token_ids=token_ids, logprobs=_logprobs(logits, token_ids, meta))

    def _exponentials(
        self, probs: torch.Tensor, meta: SamplingMetadata
    ) -> torch.Tensor:  # [B, V] float32, every entry > 0
        seeded = [row for row, g in enumerate(meta.streams) if g is not None]
        vocab = probs.shape[1]
        if seeded:
            keys = keys_tensor([meta.streams[row] for row in seeded], probs.device)
            drawn = row_exponentials(keys, vocab)  # [len(seeded), V], every entry > 0
            if len(seeded) == len(meta.streams):
                return drawn
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        if seeded:
            rows = to_device(np.array(seeded, dtype=np.int64), probs.device)
            q.index_copy_(0, rows, drawn)
        return q.clamp_min_(_MIN_EXPONENTIAL)


def _logprobs(
    logits: torch.Tensor,  # [B, V] float32
    token_ids: torch.Tensor,  # [B] int64
    meta: SamplingMetadata,
) -> LogprobsTensors | None:
    if meta.max_num_logprobs is None:
        return None
    logprobs = logits.log_softmax(dim=-1)  # [B, V]
    top_logprobs, top_ids = logprobs.topk(meta.max_num_logprobs, dim=-1)  # [B, n]
    return LogprobsTensors(
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
        sampled_logprobs=logprobs.gather(-1, token_ids[:, None]).squeeze(-1),
    )
