"""Prompt-lookup (n-gram) drafting: model-free, strong on text that repeats its context
(code edits, quoting, summarisation, repetitive generations).

The draft continues the most recent earlier occurrence of the sequence's longest suffix
n-gram (``max_n`` down to ``min_n`` tokens): if the last n tokens appeared before, the
tokens that followed them then are proposed now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramConfig:
    num_speculative_tokens: int = 5
    min_n: int = 2
    max_n: int = 4

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"n-gram sizes min_n={self.min_n}, max_n={self.max_n} need 1 <= min_n <= max_n"
            )


def ngram_propose(tokens: np.ndarray, config: NgramConfig) -> np.ndarray:
    """Draft up to ``num_speculative_tokens`` tokens for the sequence ``tokens`` [L].

    Returns [k] int64 with 0 <= k <= num_speculative_tokens (empty: no earlier match).
    Longer n-grams win; among equal n, the most recent earlier occurrence wins. The match
    must end before the suffix itself so the continuation is real context.
    """
    length = tokens.shape[0]
    k = config.num_speculative_tokens
    for n in range(min(config.max_n, length - 1), config.min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows start at 0 .. length-n-1, so every candidate has at least one token after
        # it; an occurrence may overlap the suffix (periodic text) and still continues it.
        windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # continuation of the most recent occurrence
            return tokens[start : start + k].astype(np.int64, copy=False)
    return np.empty(0, dtype=np.int64)


@dataclass
class NgramIndex:
    """``ngram_propose`` for one growing sequence, incrementally: O(max_n) dictionary
    updates per new token instead of a scan of the whole sequence per step.

    Invariant (after ``propose(tokens)`` has seen ``length`` tokens): ``last[n]`` maps
    every n-gram that ends at position <= length - 2 to the start of its most recent such
    occurrence, which are exactly the candidates ``ngram_propose`` scans (windows of
    ``tokens[:length - 1]``). Sequences only grow (a request's tokens are never taken
    back: rejected drafts never enter them), so the index is never rebuilt.
    """

    config: NgramConfig
    tokens: list[int] = field(default_factory=list)
    last: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """The draft ``ngram_propose`` gives for ``tokens``, which must extend every
        sequence passed before."""
        self._extend(tokens)
        seq = self.tokens
        length = len(seq)
        c = self.config
        for n in range(min(c.max_n, length - 1), c.min_n - 1, -1):
            start = self.last.get(n, {}).get(tuple(seq[length - n :]))
            if start is not None:
                return seq[start + n : start + n + c.num_speculative_tokens]
        return []

    def _extend(self, tokens: Sequence[int]) -> None:
        seq, old = self.tokens, len(self.tokens)
        if len(tokens) < old or list(tokens[: min(old, 8)]) != seq[: min(old, 8)]:
            raise ValueError(
                f"the sequence ({len(tokens)} tokens) does not extend the indexed one ({old} "
                "tokens); use a new NgramIndex per sequence"
            )
        seq.extend(tokens[old:])
        # Grams ending at positions old - 1 .. len - 2 become candidates now.
        for end in range(max(old - 1, 0), len(seq) - 1):
            for n in range(self.config.min_n, self.config.max_n + 1):
                begin = end - n + 1
                if begin >= 0:
                    self.last.setdefault(n, {})[tuple(seq[begin : end + 1])] = begin
