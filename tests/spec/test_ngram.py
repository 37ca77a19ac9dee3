"""Prompt-lookup drafting picks the continuation of the longest, most recent match."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.spec.ngram import NgramConfig, NgramIndex, ngram_propose


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


@pytest.mark.parametrize("seed", range(20))
def test_incremental_index_equals_full_scan(seed):
    """The proposer's incremental index drafts exactly what a full scan drafts, step after
    step of a growing sequence (small alphabet: many repeats, overlaps and periodic runs)."""
    rng = np.random.default_rng(seed)
    config = NgramConfig(int(rng.integers(1, 6)), int(rng.integers(1, 3)), int(rng.integers(3, 5)))
    index = NgramIndex(config)
    tokens = rng.integers(0, 4, size=int(rng.integers(1, 6))).tolist()
    for _ in range(60):
        expected = ngram_propose(np.array(tokens, dtype=np.int64), config).tolist()
        assert index.propose(tokens) == expected
        tokens += rng.integers(0, 4, size=int(rng.integers(1, 5))).tolist()


def test_incremental_index_refuses_a_different_sequence():
    index = NgramIndex(NgramConfig())
    index.propose([1, 2, 3, 1, 2])
    with pytest.raises(ValueError, match="does not extend"):
        index.propose([1, 2])


def test_the_proposer_refuses_tree_bands():
    """Prompt lookup finds one continuation: a band naming a tree is refused by name, a
    band of another depth is kept."""
    from specdec.config import SpeculativeConfig
    from specdec.spec.ngram_proposer import NgramProposer
    from specdec.tree_shapes import ChainShape

    tree = {"tree": "dynamic", "num_speculative_tokens": 4, "top_k": 4, "total_tokens": 8}
    with pytest.raises(ValueError, match=r"drafts chains only, but bands \[\(1, Dynamic"):
        NgramProposer(SpeculativeConfig(num_speculative_tokens_by_batch_size=[[1, tree]]))
    chains = NgramProposer(SpeculativeConfig(num_speculative_tokens_by_batch_size=[[1, 5]]))
    assert chains.bands == [(1, ChainShape(5)), (None, ChainShape(3))]
