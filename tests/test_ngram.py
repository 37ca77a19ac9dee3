"""Prompt-lookup drafting picks the continuation of the longest, most recent match."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.spec.ngram import NgramConfig, ngram_propose


def propose(tokens, k=3, min_n=2, max_n=3):
    return ngram_propose(np.array(tokens, dtype=np.int64), NgramConfig(k, min_n, max_n)).tolist()


def test_continues_earlier_occurrence():
    assert propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]


def test_longer_ngram_wins_over_more_recent_shorter_one():
    # Suffix (8, 2, 3): the trigram occurs at the start; the bigram (2, 3) more recently.
    assert propose([8, 2, 3, 4, 0, 2, 3, 6, 8, 2, 3]) == [4, 0, 2]


def test_most_recent_occurrence_wins():
    assert propose([2, 3, 4, 2, 3, 5, 2, 3], max_n=2) == [5, 2, 3]


def test_draft_is_cut_at_sequence_end_and_empty_without_match():
    assert propose([5, 6, 5, 6], k=5) == [5, 6]
    assert propose([1, 2, 3, 4]) == []
    assert propose([1]) == []


def test_config_validation_names_the_value():
    with pytest.raises(ValueError, match="min_n=3, max_n=2"):
        NgramConfig(3, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        NgramConfig(0)
