"""Prompt-lookup (n-gram) drafting: model-free, strong on text that repeats its context
(code edits, quoting, summarisation, repetitive generations).

The draft continues the most recent earlier occurrence of the sequence's longest suffix
n-gram (``max_n`` down to ``min_n`` tokens): if the last n tokens appeared before, the
tokens that followed them then are proposed now.
"""

from __future__ import annotations

from dataclasses import dataclass

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
