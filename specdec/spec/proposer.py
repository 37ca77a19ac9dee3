"""The proposer interface and registry.

A proposer looks at running requests that are about to decode and returns, for each, a
draft tree rooted at the request's last token (the token this step computes anyway), or
None when it has nothing to propose. The engine verifies every tree in one target
forward; the proposer never sees the target's logits.

The engine picks each step's shape from the number of running requests
(``SpeculativeConfig.bands``); a proposer grows that shape, or a chain where a request's
limit or room is short of it (``shape_for``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from specdec.config import SpeculativeConfig, band_shape
from specdec.models.config import ModelConfig
from specdec.request import Request
from specdec.spec.spec_exit_runtime import SpecExitRuntime, SpecExitUnavailable
from specdec.spec.tree import DraftTree, TreeBatch
from specdec.step_hook import StepHook
from specdec.tree_shapes import ChainShape, TreeShape

if TYPE_CHECKING:
    from specdec.spec.aux_rows import AuxRows
    from specdec.spec.tree_draft import GrowInputs

_PROPOSERS: dict[str, type[Proposer]] = {}


class Proposer(ABC):
    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls, "name", None):
            _PROPOSERS[cls.name] = cls

    def __init__(self, config: SpeculativeConfig, *, runner=None) -> None:
        self.config = config
        # (max running requests, shape) by ascending batch size; the last unbounded. Bands
        # confined to another device type are left out (``config.Band``).
        device_type = runner.device.type if runner is not None else None
        self.bands: list[tuple[int | None, TreeShape]] = config.bands_on(device_type)
        self.shapes: list[TreeShape] = list(dict.fromkeys(s for _, s in self.bands))

    @classmethod
    def cannot_draft(cls, config: SpeculativeConfig) -> str | None:
        """Why this proposer could not draft ``config``'s bands, found without building it
        (the bench skips such a sweep point with the reason); None when it can."""
        return None

    def shape_at(self, batch_size: int) -> TreeShape:
        """The shape a step of ``batch_size`` running requests drafts (the bands made
        once: this runs every step)."""
        return band_shape(self.bands, batch_size)

    @property
    def lookahead_slots(self) -> int:
        """Cache slots past the root a decoding request reserves per step: the tree's
        draft nodes for verification, and room for a model proposer's fed nodes (the
        largest of the bands' shapes: the band is known only once the step is)."""
        return max(max(s.max_draft_tokens, s.num_expanded) for s in self.shapes)

    @property
    def max_depth(self) -> int:
        """The deepest band's depth: a step emits at most this + 1 tokens."""
        return max(s.depth for s in self.shapes)

    def shape_for(self, shape: TreeShape, max_draft_tokens: int, room: int) -> TreeShape:
        """The step's ``shape`` when ``max_draft_tokens`` nodes and ``room`` fed-node
        slots allow it; otherwise the chain that fits (near the context's or the request's
        end). A chain never needs more room than verification already reserves."""
        if max_draft_tokens >= shape.max_draft_tokens and room >= shape.num_expanded:
            return shape
        return ChainShape(min(max_draft_tokens, shape.depth))

    # Target layers whose entering residual stream this proposer reads (EAGLE-3): the
    # engine then passes the aux states of the tokens each step that may speculate
    # computes to ``observe``, and ``defer``s the rest (``ModelRunner.aux_cache``).
    aux_layer_ids: tuple[int, ...] = ()
    # SpecExit signals its trees carry in ``DraftTree.signals`` (an EAGLE-3 head with
    # exit channels; specdec.spec.spec_exit); empty: none, and requests cannot opt in
    # (``make_step_hooks``).
    exit_signals: tuple[str, ...] = ()
    # The SpecExit setting the head records as measured best for it (some SpecExitParams
    # fields, ``Eagle3Config.spec_exit_defaults``): the base requests' settings override.
    spec_exit_defaults: dict[str, Any] | None = None

    # Whether its drafts attend through the runner's ``draft_attention`` backend (a draft
    # model, an EAGLE-3 head): the runner then compiles that backend's kernel variants
    # before serving even where the target's attention is another backend
    # (``ModelRunner.warm_up_kernels``).
    uses_draft_attention: ClassVar[bool] = False

    # Whether the growth its captured graphs run is one compiled region
    # (``SpeculativeConfig.compile_growth``); a pipeline then compiles its own draft
    # side, which inlines the growth, as one region too. Set by ``capture_graphs``.
    compiles_growth: bool = False

    def group_by_shape(
        self,
        shape: TreeShape,
        rows: Sequence[int],
        max_draft_tokens: Sequence[int],
        rooms: Sequence[int],
    ) -> dict[TreeShape, list[int]]:
        """``rows`` grouped by the shape each can grow (``shape_for`` of the step's
        ``shape``, its limit and its room, both indexed by row): one batch per shape,
        usually just the step's."""
        groups: dict[TreeShape, list[int]] = {}
        for i in rows:
            groups.setdefault(self.shape_for(shape, max_draft_tokens[i], rooms[i]), []).append(i)
        return groups

    @property
    def catch_up_width(self) -> int:
        """Tokens a model proposer catches up on after a full verify step: the accepted
        drafts its cache lacks plus the bonus token, at most the deepest band's depth + 1
        (catch-ups are padded to this width whatever the step's band)."""
        return self.max_depth + 1

    def capture_graphs(
        self,
        batch_sizes: dict[TreeShape, list[int]],
        block_table_width: int,
        max_seq_len: int,
    ) -> Iterator[str]:
        """CUDA graphs of the draft steps of each shape for its bucketed batch sizes
        (model proposers; once on the GPU path, after the target's graphs): each
        iteration captures one graph and yields what it captured, so the engine can
        capture them all before it starts or one at a time between steps. None here."""
        return iter(())

    def release(self, request_id: str) -> None:  # noqa: B027  (optional hook)
        """Forget per-request state once a request finishes or is aborted."""

    @classmethod
    def aux_layers_of(cls, config: SpeculativeConfig, target: ModelConfig) -> tuple[int, ...]:
        """The ``aux_layer_ids`` a proposer built from ``config`` for ``target`` has, known
        before it is built (the runner sizes its aux cache with them)."""
        return ()

    def observe(  # noqa: B027  (optional hook)
        self,
        request: Request,
        start: int,  # cache index of the first row's token
        aux: torch.Tensor,  # [m, len(aux_layer_ids) * hidden]: tokens start, start+1, ...
    ) -> None:
        """Aux states of tokens the target just computed for ``request``, in order."""

    def defer(self, request: Request) -> None:  # noqa: B027  (optional hook)
        """The aux states of ``request``'s tokens from ``num_computed_tokens`` on are not
        observed: read them from the runner's ``aux_cache`` (at each token's slot) when
        the request is next observed or drafts. For steps that do not speculate, so they
        hand the proposer nothing; idempotent until then."""

    @abstractmethod
    def propose(
        self, requests: Sequence[Request], max_draft_tokens: Sequence[int], shape: TreeShape
    ) -> list[DraftTree | None]:
        """One tree (or None) per request with at most ``max_draft_tokens[i]`` draft
        nodes, of the step's ``shape`` where those allow (``shape_at`` of the step's batch
        size); the root's token is ``requests[i]``'s last token."""


def proposer_class(config: SpeculativeConfig) -> type[Proposer]:
    """The registered proposer ``config.method`` names."""
    from specdec.spec import (  # noqa: F401  (registration)
        block_proposer,
        draft_model,
        eagle3,
        ngram_proposer,
    )

    if config.method not in _PROPOSERS:
        raise ValueError(
            f"speculative method {config.method!r} is not available; choose one of "
            f"{sorted(_PROPOSERS)}"
        )
    return _PROPOSERS[config.method]


def make_proposer(config: SpeculativeConfig, **kwargs) -> Proposer:
    return proposer_class(config)(config, **kwargs)


def make_step_hooks(proposer: Proposer | None, tokenizer: Callable[[], Any]) -> list[StepHook]:
    """The hooks on the update step (specdec/step_hook.py) of an engine drafting with
    ``proposer`` (None: speculation off), in the order they judge a verify row: SpecExit's,
    which follows the requests that opt in where the proposer's trees carry exit signals
    and refuses them elsewhere. ``tokenizer`` returns the target's tokenizer (loaded only
    when a hook needs it)."""
    if proposer is None or not proposer.exit_signals:
        return [SpecExitUnavailable()]
    return [SpecExitRuntime(tokenizer(), proposer.exit_signals, proposer.spec_exit_defaults)]


class PipelinedProposer(Proposer):
    """A proposer that runs pipelined speculative steps (spec/pipeline.py): the
    next step's draft is grown on the device from the step in flight's outcome, before
    the host reads it. Its catch-up state travels between launches as device tensors of
    ``catch_up_width`` positions per request (the engine reserves that many slots beyond
    a synchronous step's lookahead)."""

    catch_up_width: int
    rows: AuxRows  # each request's aux rows not yet caught up on

    @abstractmethod
    def pipeline_ready(self, request: Request) -> bool:
        """Whether ``request`` can start a pipelined step from the host state."""

    @abstractmethod
    def pipeline_inputs(self, requests: Sequence[Request]) -> GrowInputs:
        """``grow_pipelined``'s inputs from the host state of ``pipeline_ready`` requests."""

    @abstractmethod
    def start_pipelined(self, requests: Sequence[Request]) -> torch.Tensor:
        """Arrivals joining the pipeline right after their prefill: the state their first
        pipelined step continues from (the catch-up aux rows)."""

    @abstractmethod
    def grow_pipelined(
        self, shape: TreeShape, inputs: GrowInputs, max_seq_len: int, captured: bool = False
    ) -> TreeBatch:
        """Catch-up and growth of ``shape`` from device inputs (device ops only)."""

    def resume(
        self,
        request: Request,
        start: int,
        aux: torch.Tensor,  # [rows, catch_up_width, aux width]: a launch's catch-up aux
        row: int,
        num_rows: int,
    ) -> None:
        """After the engine read a pipelined step: the next catch-up of ``request`` starts
        at cache index ``start`` with ``aux[row, :num_rows]`` (the step's root and accepted
        nodes, ``SpecLaunch.state.aux``: valid until the next launch, and the engine reads
        the step in flight before any synchronous step), exactly what ``observe`` would
        have collected. Sliced only when a synchronous step reads them (``AuxRows.resume``
        keeps the launch's tensor), so a run of pipelined steps never pays for it."""
        self.rows.resume(request, start, aux, row, num_rows)
