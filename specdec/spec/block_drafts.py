"""Draft trees from a block drafter's slot logits [n, depth, draft_vocab] (slot ``k``
scores the token ``k`` past the root), as ``spec.block_proposer``'s docstring describes:
deterministic candidates (the slots' argmax chain, or a tree band grown from the slots'
candidates; device ops only, so the pipelined step's graph captures them) and sampled
chains (slot ``k`` drawn from the softmax of its logits at the request's temperature,
carried as ``draft_probs`` for lossless rejection sampling). Seeded requests draw from a
stream of their own (``DRAFT_STREAM_SALT``), so their drafts do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from specdec.device.staging import to_device
from specdec.request import Request
from specdec.sampling.seeded_stream import SeededStream, keys_tensor, row_exponentials
from specdec.spec.tree import TreeBatch, grow_trees
from specdec.tree_shapes import ChainShape, TreeShape

# A seeded request's draft draws come from SeededStream(seed ^ this): independent of the
# stream its acceptance and sampling draw from (the same keys would correlate the two).
DRAFT_STREAM_SALT = 0x9E6C63D0676A9A99


class SlotDrafts:
    """Builds draft trees from slot logits [n, depth, draft_vocab] (module docstring);
    holds the seeded requests' draft streams until ``release``."""

    def __init__(
        self,
        draft_ids: torch.Tensor,  # [draft_vocab] int64: each column's target id
        vocab_size: int,  # the target's vocabulary (``draft_probs`` rows)
        level_topk: Callable,  # ``grow_trees``' per-level top-k (``level_topk_for``)
    ) -> None:
        self.draft_ids = draft_ids
        self.vocab_size = vocab_size
        self.level_topk = level_topk
        self._streams: dict[str, SeededStream] = {}

    def release(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def deterministic(
        self,
        shape: TreeShape,
        roots: torch.Tensor,  # [n] int64
        logits: torch.Tensor,  # [n, depth, draft_vocab]
    ) -> TreeBatch:
        """Deterministic candidates of ``shape``: the slots' argmax chain, or the tree of
        their best tokens (a block's slots do not see the tokens drafted before them)."""
        if isinstance(shape, ChainShape):
            return chains(roots, self.draft_ids[logits.argmax(dim=-1)])

        def slot_scores(tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int):
            return logits[:, depth, None, :].expand(-1, tokens.shape[1], -1)  # [n, m, V]

        return grow_trees(
            shape, roots, slot_scores, token_map=self.draft_ids, level_topk=self.level_topk
        )

    def sampled_chains(
        self,
        roots: torch.Tensor,  # [n] int64
        logits: torch.Tensor,  # [n, depth, draft_vocab]
        group: Sequence[Request],
    ) -> TreeBatch:
        """Slot ``k``'s token drawn from ``q_k`` (softmax of the slot's logits at the
        request's temperature), by an exponential race; ``draft_probs`` rows 1..depth hold
        ``q_k`` over the target's vocabulary (row 0, the root's, is unused)."""
        n, depth, vocab = logits.shape
        device = logits.device
        streams = [self._stream(r) for r in group]
        temperature = to_device(
            np.array([r.sampling_params.temperature for r in group], dtype=np.float32), device
        )
        q = (logits / temperature[:, None, None]).softmax(dim=-1)  # [n, depth, draft_vocab]
        race = torch.empty_like(q).exponential_()  # [n, depth, vocab]
        seeded = [b for b, s in enumerate(streams) if s is not None]
        if seeded:
            keys = keys_tensor([streams[b] for b in seeded], device)
            rows = to_device(np.array(seeded, dtype=np.int64), device)
            race.index_copy_(0, rows, row_exponentials(keys, depth * vocab).view(-1, depth, vocab))
        drawn = (q / race).argmax(dim=-1)  # [n, depth] draft columns
        drafts = chains(roots, self.draft_ids[drawn])
        probs = q.new_zeros(n, depth + 1, self.vocab_size)
        probs[:, 1:].index_copy_(2, self.draft_ids, q)
        drafts.draft_probs, drafts.sampled = probs, True
        return drafts

    def _stream(self, request: Request) -> SeededStream | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        if request.request_id not in self._streams:
            self._streams[request.request_id] = SeededStream(seed ^ DRAFT_STREAM_SALT)
        return self._streams[request.request_id]


def chains(
    roots: torch.Tensor,  # [n] int64
    tokens: torch.Tensor,  # [n, depth] int64 target ids
) -> TreeBatch:
    """Chains ``root, tokens[b, 0], tokens[b, 1], ...``: node i's parent is node i - 1."""
    n, depth = tokens.shape
    nodes = torch.arange(depth + 1, device=roots.device)
    return TreeBatch(
        token_ids=torch.cat([roots[:, None], tokens], dim=1),
        parents=(nodes - 1).clamp_min(0).expand(n, -1),
        depths=nodes.expand(n, -1),
        is_chain=True,
    )
