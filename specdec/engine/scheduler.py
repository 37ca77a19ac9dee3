"""Continuous batching: which requests compute how many tokens in the next step.

There are no prefill and decode phases, only computed tokens. Each step first serves the
running requests in admission order (decodes take one token, unfinished chunked prefills a
chunk), then admits waiting requests while the token budget (``max_num_batched_tokens``)
and ``max_num_seqs`` allow, chunking a long prompt across steps; ``admit_batch`` > 1 admits
them in groups. When the pool runs out of blocks, the newest running request is preempted:
its blocks are freed and it is recomputed later from its prompt and the tokens it already
produced, so nothing is lost or repeated.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from specdec.config import SchedulerConfig
from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at num_computed_tokens
    num_lookahead_tokens: int = 0  # extra slots reserved for draft tokens (speculation)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._group_open = False  # admit_batch: a group of waiting requests is starting

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and release its blocks. Safe for waiting or running requests."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _ends_with_pending(self, request: Request) -> bool:
        """Async scheduling: the pending token reaches max_tokens or the context limit, so
        the request finishes once the host reads it (a stop token is only seen then)."""
        pending = request.num_pending_tokens
        return pending > 0 and (
            request.num_output_tokens + pending >= request.max_tokens
            or request.num_tokens_with_pending >= self.max_model_len
        )

    # ---- the step ---------------------------------------------------------------------
    def schedule(
        self,
        num_lookahead_tokens: int = 0,
        admit_whole: Callable[[Request], bool] | None = None,
    ) -> SchedulerOutput:
        """Pick this step's work. ``num_lookahead_tokens`` reserves slots for draft tokens
        (speculation) on requests that are decoding. ``admit_whole``: admit only waiting
        requests it accepts, each with its whole prompt (no chunk), stopping at the first
        that fails either (a pipelined speculative step's arrivals)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # This loop runs once per running request and step, so it reads each request's
        # counters once (no properties) and keeps the step's objects in locals.
        running, scheduled = self.running, out.scheduled
        allocate_slots = self.kv.allocate_slots
        max_model_len = self.max_model_len
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            pending = request.num_pending_tokens
            if pending and self._ends_with_pending(request):
                i += 1  # its step in flight sampled its last token: nothing left to compute
                continue
            num_new = min(num_tokens + pending - request.num_computed_tokens, budget)
            lookahead = 0
            if num_new == 1 and num_lookahead_tokens:
                # Decoding: room for drafts, never past the context limit.
                lookahead = max(0, min(num_lookahead_tokens, max_model_len - num_tokens))
            while not allocate_slots(request, num_new, num_lookahead_tokens=lookahead):
                victim = running.pop()  # the newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new, lookahead))
                budget -= num_new
                i += 1
                continue
            break  # the current request itself was preempted: nothing newer remains

        # Admit waiting requests only if nobody was preempted (they would fight for blocks),
        # and only a group of admit_batch at once while others run (SchedulerConfig says why).
        # A group that opened keeps admitting in the next steps (the token budget may split
        # it) until the batch is full or nothing waits.
        free_seqs = self.config.max_num_seqs - len(self.running)
        if free_seqs >= min(self.config.admit_batch, len(self.waiting)) or not self.running:
            self._group_open = True
        if not self._group_open:
            return out
        # A request preempted this step may still have a token in flight; the engine reads
        # it before the next schedule, and nothing is admitted after a preemption anyway.
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            computed = self.kv.get_computed_blocks(request)
            num_cached = len(computed) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if admit_whole is not None and (
                num_new < request.num_tokens - num_cached or not admit_whole(request)
            ):
                break
            if not self.kv.allocate_slots(request, num_new, computed_blocks=computed):
                break
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            self._group_open = False
        return out

    # ---- the update: what a step computed ------------------------------------------------
    # The scheduler owns each request's computed tokens: a step mode reports what its step
    # kept through these three calls and never writes the counter itself.
    def update(
        self, scheduled: Sequence[ScheduledRequest], rejected: Mapping[int, int] | None = None
    ) -> None:
        """A step ran: every row's request computed its scheduled tokens, less
        ``rejected[row]`` for a verify row (its tree's nodes acceptance did not keep; their
        K/V is stale and the next step overwrites it)."""
        rejected = rejected or {}
        for row, s in enumerate(scheduled):
            s.request.num_computed_tokens += s.num_new_tokens - rejected.get(row, 0)

    @staticmethod
    def advance(request: Request, num_tokens: int) -> None:
        """``request`` computed ``num_tokens`` more (a pipelined step read one step late:
        its root and accepted nodes)."""
        request.num_computed_tokens += num_tokens

    @staticmethod
    def roll_back(request: Request, num_tokens: int) -> None:
        """Un-compute ``request``'s last ``num_tokens`` computed tokens: their K/V is stale
        (a step hook cut the tokens after them) or is recomputed by the next step (a pipelined
        request held one step behind, at its root)."""
        if not 0 <= num_tokens <= request.num_computed_tokens:
            raise ValueError(
                f"request {request.request_id}: cannot roll back {num_tokens} of its "
                f"{request.num_computed_tokens} computed tokens"
            )
        request.num_computed_tokens -= num_tokens
