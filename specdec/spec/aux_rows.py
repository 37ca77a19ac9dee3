"""The target's aux rows a proposer has been handed but not consumed yet, per request.

A proposer that reads the target's aux states (``Proposer.aux_layer_ids``) consumes one
row per computed token, in cache-index order: row ``t`` is the aux state of token ``t``.
The engine hands rows over as the target computes them (``observe``) or, for steps that
do not speculate, leaves them in the runner's aux cache at each token's slot (``defer``).
``AuxRows`` keeps, per request, where the proposer's own computation stands (``done``:
rows below it are consumed) and the rows from there to the request's computed tokens,
and hands them out in one piece (``take``).

A pipelined proposer's steps bypass ``observe``: after the engine reads a pipelined step,
``resume`` restarts the request's state at the step's first catch-up index with the rows
the launch left on the device (sliced only when a synchronous step takes them), and
``rewind`` hands back the last rows a proposer took but leaves to the device (an
arrival's last prompt position, caught up by its first pipelined step).

A request that was preempted (its blocks freed, its tokens recomputed) starts afresh at
the first row observed after: ``num_preemptions`` tells the states apart. That row is
not 0 after a prefix-cache hit: the rows of shared blocks are never observed, and the
proposer relies on what its own cache holds there (drafts may be worse, never wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.device.staging import to_device
from specdec.ops.attention_metadata import request_slots
from specdec.request import Request


@dataclass(slots=True)
class _RowState:
    num_preemptions: int  # the request's count when this state started
    done: int  # cache indices below this are consumed by the proposer
    pending: list[torch.Tensor] = field(default_factory=list)  # rows from ``done`` on
    # ``resume``: a pipelined launch's rows as (buffer, row, count), sliced only when
    # taken; they precede ``pending`` (the rows observed since).
    resumed: tuple[torch.Tensor, int, int] | None = None
    # ``defer``: the rows from this cache index (right after the pending ones) to the
    # request's computed tokens are in the runner's aux cache, read when next needed.
    deferred: int | None = None

    @property
    def num_pending(self) -> int:
        n = self.resumed[2] if self.resumed is not None else 0
        return n + sum(p.shape[0] for p in self.pending)

    def rows(self) -> list[torch.Tensor]:
        """Every pending row block, in order (the resumed rows first)."""
        if self.resumed is None:
            return self.pending
        aux, row, count = self.resumed
        return [aux[row, :count], *self.pending]


class AuxRows:
    """Per-request pending aux rows (module docstring). Invariant: a current state's
    ``done + num_pending`` (or ``deferred``, when set) is the cache index of the next
    row the engine reports."""

    def __init__(
        self,
        aux_cache: torch.Tensor | None,  # [slots, aux width]: the runner's aux cache
        block_size: int,
        device: torch.device,
    ) -> None:
        self.aux_cache = aux_cache
        self.block_size = block_size
        self.device = device
        self._states: dict[str, _RowState] = {}

    def __len__(self) -> int:
        """Requests with a state (observed or deferred, not yet released)."""
        return len(self._states)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def is_current(self, request: Request) -> bool:
        """Whether ``request`` has a state from its current run (observed or deferred
        since it was last admitted); a proposer drafts only for those."""
        state = self._states.get(request.request_id)
        return state is not None and state.num_preemptions == request.num_preemptions

    def pending_len(self, request: Request) -> int:
        """Cache indices ``request`` has computed past the proposer's (``take`` would hand
        out that many rows); 0 for a request without a current state."""
        if not self.is_current(request):
            return 0
        return request.num_computed_tokens - self._states[request.request_id].done

    def observe(
        self,
        request: Request,
        start: int,  # cache index of the first row's token
        aux: torch.Tensor,  # [m, aux width]: tokens start, start + 1, ...
    ) -> None:
        state = self._state_at(request, start)
        if state.deferred is not None:  # the rows up to `start` are in the aux cache
            if start > state.deferred:
                state.pending += self._read_deferred([request], [(state.deferred, start)])
            state.deferred = None
        state.pending.append(aux)

    def defer(self, request: Request) -> None:
        state = self._state_at(request, request.num_computed_tokens)
        if state.deferred is None:
            state.deferred = request.num_computed_tokens

    def take(
        self, group: Sequence[Request]
    ) -> tuple[list[tuple[int, int]], list[torch.Tensor | None]]:
        """Each request's span ``[done, num_computed_tokens)`` and its aux rows ([end -
        start, aux width]; None for an empty span); the rows then count as consumed (the
        caller computes them). Every request must be ``is_current``."""
        states = [self._states[r.request_id] for r in group]
        spans = [(st.done, r.num_computed_tokens) for st, r in zip(states, group, strict=True)]
        deferred = [
            i
            for i, st in enumerate(states)
            if st.deferred is not None and st.deferred < spans[i][1]
        ]
        if deferred:
            tails = [(states[i].deferred, spans[i][1]) for i in deferred]
            rows = self._read_deferred([group[i] for i in deferred], tails)
            for i, tail in zip(deferred, rows, strict=True):
                states[i].pending.append(tail)
        aux = []
        for st, (start, end) in zip(states, spans, strict=True):
            if st.num_pending != end - start:
                raise RuntimeError(
                    f"{st.num_pending} aux rows for cache indices [{start}, {end}); the "
                    "engine must report every computed token once, in order (observe or "
                    "defer)"
                )
            rows = st.rows()
            aux.append(torch.cat(rows) if rows else None)
            st.done, st.pending, st.resumed, st.deferred = end, [], None, None
        return spans, aux

    def rewind(self, request: Request, done: int) -> None:
        """After ``take``: the proposer consumed ``request``'s rows below ``done`` only;
        the rest are the caller's to deliver (a pipelined launch's catch-up, then
        ``resume``)."""
        self._states[request.request_id].done = done

    def resume(
        self,
        request: Request,
        start: int,
        aux: torch.Tensor,  # [rows, width, aux width]: a pipelined launch's catch-up rows
        row: int,
        num_rows: int,
    ) -> None:
        """After the engine read a pipelined step: ``request``'s next rows start at cache
        index ``start`` with ``aux[row, :num_rows]`` (valid until the next launch; the
        engine reads the step in flight before any synchronous step), exactly what
        ``observe`` would have collected."""
        self._states[request.request_id] = _RowState(
            request.num_preemptions, start, [], (aux, row, num_rows)
        )

    def _state_at(self, request: Request, start: int) -> _RowState:
        """``request``'s state, whose next row (observed or deferred) is at cache index
        ``start``; a new one there for a new or preempted request."""
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            state = _RowState(request.num_preemptions, done=start)
            self._states[request.request_id] = state
        expected = state.done + state.num_pending
        if state.deferred is not None:
            if state.deferred != expected or start < expected:
                raise RuntimeError(
                    f"request {request.request_id}: aux states deferred from "
                    f"{state.deferred} resume at {start}, expected {expected} or later"
                )
        elif start != expected:
            raise RuntimeError(
                f"request {request.request_id}: aux states start at {start}, expected "
                f"{expected}; the engine must report every computed token once, in order"
            )
        return state

    def _read_deferred(
        self, group: Sequence[Request], spans: Sequence[tuple[int, int]]
    ) -> list[torch.Tensor]:  # [end - start, aux width] each
        """The aux rows of cache indices [start, end) of each request, from the aux cache
        (one gather)."""
        if self.aux_cache is None:
            raise RuntimeError("aux states were deferred but the runner keeps no aux cache")
        slots = [
            request_slots(request.block_ids, np.arange(start, end), self.block_size)
            for request, (start, end) in zip(group, spans, strict=True)
        ]
        index = to_device(np.concatenate(slots), self.device)
        rows = self.aux_cache.index_select(0, index)
        return list(rows.split([end - start for start, end in spans]))
