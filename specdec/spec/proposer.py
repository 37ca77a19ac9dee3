"""The proposer interface and registry.

A proposer looks at running requests that are about to decode and returns, for each, a
draft tree rooted at the request's last token (the token this step computes anyway), or
None when it has nothing to propose. The engine verifies every tree in one target
forward; the proposer never sees the target's logits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from specdec.config import SpeculativeConfig
from specdec.engine.request import Request
from specdec.spec.tree import ChainShape, DraftTree, TreeShape

_PROPOSERS: dict[str, type[Proposer]] = {}


class Proposer(ABC):
    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls, "name", None):
            _PROPOSERS[cls.name] = cls

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.shape: TreeShape = config.tree_shape

    @property
    def lookahead_slots(self) -> int:
        """Cache slots past the root a decoding request reserves per step: the tree's
        draft nodes for verification, and room for a model proposer's fed nodes."""
        return max(self.shape.max_draft_tokens, self.shape.num_expanded)

    def shape_for(self, max_draft_tokens: int, room: int) -> TreeShape:
        """The configured shape when ``max_draft_tokens`` nodes and ``room`` fed-node
        slots allow it; otherwise the chain that fits (near the context's or the request's
        end). A chain never needs more room than verification already reserves."""
        shape = self.shape
        if max_draft_tokens >= shape.max_draft_tokens and room >= shape.num_expanded:
            return shape
        return ChainShape(min(max_draft_tokens, shape.depth))

    # Target layers whose entering residual stream this proposer reads (EAGLE-3); the
    # engine then passes every computed token's aux states to ``observe``.
    aux_layer_ids: tuple[int, ...] = ()
    # SpecExit signals its trees carry in ``DraftTree.exit_signals`` (an EAGLE-3 head with
    # exit channels; specdec.spec.spec_exit); empty: none, and requests cannot opt in.
    exit_signals: tuple[str, ...] = ()
    # The SpecExit setting the head records as measured best for it (some SpecExitParams
    # fields, ``Eagle3Config.spec_exit_defaults``): the base requests' settings override.
    spec_exit_defaults: dict[str, Any] | None = None

    # Whether this proposer runs pipelined speculative steps (engine/spec_pipeline.py):
    # it then has ``pipeline_ready``, ``pipeline_inputs``, ``grow_pipelined`` and
    # ``resume`` (Eagle3Proposer).
    pipelines: ClassVar[bool] = False
    # Whether the growth its captured graphs run is one compiled region
    # (``SpeculativeConfig.compile_growth``); a pipeline then compiles its own draft
    # side, which inlines the growth, as one region too. Set by ``capture_graphs``.
    compiles_growth: bool = False

    def group_by_shape(
        self, rows: Sequence[int], max_draft_tokens: Sequence[int], rooms: Sequence[int]
    ) -> dict[TreeShape, list[int]]:
        """``rows`` grouped by the shape each can grow (``shape_for`` of its limit and its
        room, both indexed by row): one batch per shape, usually just the configured one."""
        groups: dict[TreeShape, list[int]] = {}
        for i in rows:
            groups.setdefault(self.shape_for(max_draft_tokens[i], rooms[i]), []).append(i)
        return groups

    @property
    def catch_up_width(self) -> int:
        """Tokens a model proposer catches up on after a full verify step: the accepted
        drafts its cache lacks plus the bonus token, at most depth + 1."""
        return self.shape.depth + 1

    def capture_graphs(  # noqa: B027  (optional hook)
        self, max_batch_size: int, block_table_width: int, max_seq_len: int
    ) -> None:
        """Capture CUDA graphs of the draft steps for batches up to ``max_batch_size``
        (model proposers; called once on the GPU path, after the target's graphs)."""

    def release(self, request_id: str) -> None:  # noqa: B027  (optional hook)
        """Forget per-request state once a request finishes or is aborted."""

    def observe(  # noqa: B027  (optional hook)
        self,
        request: Request,
        start: int,  # cache index of the first row's token
        aux: torch.Tensor,  # [m, len(aux_layer_ids) * hidden]: tokens start, start+1, ...
    ) -> None:
        """Aux states of tokens the target just computed for ``request``, in order."""

    @abstractmethod
    def propose(
        self, requests: Sequence[Request], max_draft_tokens: Sequence[int]
    ) -> list[DraftTree | None]:
        """One tree (or None) per request with at most ``max_draft_tokens[i]`` draft
        nodes; the root's token is ``requests[i]``'s last token."""


def make_proposer(config: SpeculativeConfig, **kwargs) -> Proposer:
    from specdec.spec import draft_model, eagle3, ngram_proposer  # noqa: F401  (registration)

    if config.method not in _PROPOSERS:
        raise ValueError(
            f"speculative method {config.method!r} is not available; choose one of "
            f"{sorted(_PROPOSERS)}"
        )
    return _PROPOSERS[config.method](config, **kwargs)
