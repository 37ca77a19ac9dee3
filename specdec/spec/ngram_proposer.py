"""Prompt-lookup proposer: chains from ``ngram_propose`` (model-free, host-side)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.config import SpeculativeConfig
from specdec.spec.ngram import NgramConfig, NgramIndex
from specdec.spec.proposer import Proposer
from specdec.spec.tree import DraftTree
from specdec.tree_shapes import ChainShape


def chain_tree(root: int, drafts: Sequence[int]) -> DraftTree:
    """The tree of a chain: node i's parent is node i-1."""
    n = len(drafts) + 1
    return DraftTree(
        token_ids=torch.tensor([root, *drafts], dtype=torch.int64),
        parents=torch.tensor([0, *range(n - 1)], dtype=torch.int64),
        depths=torch.arange(n, dtype=torch.int64),
        is_chain=True,
    )


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, config: SpeculativeConfig, *, runner=None, **_unused) -> None:
        super().__init__(config, runner=runner)
        reason = self.cannot_draft(config)
        if reason is not None:
            raise ValueError(reason)
        # Up to the deepest band's length; each step cuts to its own band's.
        self.ngram = NgramConfig(self.max_depth, config.ngram_min, config.ngram_max)
        # One incremental index per request: a step costs O(new tokens), not O(length).
        self._indexes: dict[str, NgramIndex] = {}

    @classmethod
    def cannot_draft(cls, config: SpeculativeConfig) -> str | None:
        if config.tree != "chain":
            return (
                f"the ngram proposer drafts the one continuation it finds (a chain); got "
                f"tree={config.tree!r}, use tree='chain'"
            )
        trees = [(m, s) for m, s in config.bands if not isinstance(s, ChainShape)]
        if trees:
            return (
                f"the ngram proposer drafts chains only, but bands {trees} are trees; give "
                "those bands a depth (num_speculative_tokens_by_batch_size [max_batch, k])"
            )
        return None

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def propose(self, requests, max_draft_tokens, shape):
        trees: list[DraftTree | None] = []
        for request, limit in zip(requests, max_draft_tokens, strict=True):
            limit = min(limit, shape.depth)
            if limit < 1:
                trees.append(None)
                continue
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = NgramIndex(self.ngram)
            tokens = request.all_token_ids
            drafts = index.propose(tokens)[:limit]
            trees.append(chain_tree(tokens[-1], drafts) if drafts else None)
        return trees
