"""The pipelined speculative step (``StepMode``): launch speculative step N+1 from step
N's device outcome, then read step N.

``SpecPipeline`` (spec/pipeline.py) drafts, verifies and accepts a whole step on the
device; this mode decides when a step can run that way, admits arrivals beside it (their
prompts prefilled, their first token picked on the device), and applies what the host
reads one step later: the emitted tokens, each request's computed tokens past the step's
root and accepted nodes, the proposer's resumed state, the step hooks' cuts. Greedy requests
of a ``PipelinedProposer`` only; everything else runs the synchronous step after the
launches in flight are read.
"""

from __future__ import annotations

import time

from specdec.engine.hook_cuts import RowCut, cut_rows
from specdec.engine.kv_cache_manager import cdiv
from specdec.engine.output_processor import RequestState
from specdec.engine.scheduler import ScheduledRequest
from specdec.engine.step_mode import StepMode, StepOutputs
from specdec.engine.step_sampling import decodes_plainly
from specdec.engine.sync_step import observe
from specdec.request import Request, RequestStatus
from specdec.spec.pipeline import SpecLaunch


class PipelinedStep(StepMode):
    """Pipelined speculative steps (module docstring). ``launches``: those in flight, a
    step then arrivals' prefills (``SpecPipeline.arrive``); every running request is a
    row of one of them."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.pipeline = engine.pipeline
        self.launches: list[SpecLaunch] = []

    @property
    def in_flight(self) -> bool:
        return bool(self.launches)

    def drain(self) -> StepOutputs:
        done, self.launches = self.launches, []
        return self._finish_all(done)

    def can_run(self) -> bool:
        """Whether the next step can be pipelined: every running request decodes greedily
        with drafts (no prefill chunk, no pending plain or forced token), continues a
        launch in flight (or, with none, can start from the host state), and the
        worst-case slots of two steps fit its context and the free blocks, so scheduling
        preempts nobody; the request first in line, if any, can join as an arrival
        (``joins``). With nothing running, arrivals alone start the pipeline."""
        engine = self.engine
        scheduler = engine.scheduler
        running = scheduler.running
        if (not running and not scheduler.num_waiting) or engine.speculation_graphs_pending:
            return False
        limit = engine.config.speculative.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return False
        budget = scheduler.config.max_num_batched_tokens - len(running)
        if budget < 0:
            return False
        if scheduler.num_waiting:
            first = scheduler.waiting[0]
            # Its whole prompt next to the decodes (a prefix-cache hit may need less).
            if first.num_tokens > budget or not self.joins(first):
                return False
        prev = self.launches
        # What cannot change for a request after a launch (greedy, drafting, min_tokens
        # reached) was checked when its launch in flight did: only a batch that is not
        # exactly the launches' rows needs those checks again.
        if (
            not prev or running != [r for launch in prev for r in launch.requests]
        ) and not self.may_run(running, prev):
            return False
        reserve = 1 + engine.lookahead + self.pipeline.extra_lookahead
        bs, needed = engine.block_size, 0
        for request in running:
            computed = request.num_computed_tokens
            if (
                request.num_pending_tokens
                or computed + 1 != request.num_tokens
                or computed + reserve > engine.max_model_len
            ):
                return False
            needed += max(0, cdiv(computed + reserve, bs) - len(request.block_ids))
        return needed <= engine.kv_manager.pool.num_free_blocks

    def may_run(self, requests: list[Request], prev: list[SpecLaunch]) -> bool:
        """``can_run``'s checks that hold for a request from its first pipelined launch
        on: greedy with drafts (min_tokens reached), and continuing a launch in flight
        or, with none, ready to start from the host state."""
        in_flight = {r.request_id for launch in prev for r in launch.requests} if prev else None
        for request in requests:
            if not request.sampling_params.is_greedy or decodes_plainly(request):
                return False
            if in_flight is not None:
                if request.request_id not in in_flight:
                    return False
            elif not self.engine.proposer.pipeline_ready(request):
                return False
        return True

    def joins(self, request: Request) -> bool:
        """Whether a waiting request can be admitted as a pipelined arrival
        (``SpecPipeline.arrive``): new (not recomputed after preemption), greedy with
        drafts from its first token, and followed by no step hook: such a request's first
        verify step runs synchronously after its prefill, so the signals its hooks judge
        it by are the synchronous step's (an arrival's first pipelined step reads them
        from the prompt's last token alone)."""
        return (
            request.status is RequestStatus.WAITING
            and request.sampling_params.is_greedy
            and not decodes_plainly(request)
            and not any(hook.follows(request) for hook in self.engine.step_hooks)
        )

    def step(self, deferring: bool) -> StepOutputs:
        """Launch speculative step N+1 from the device outcomes in flight (step N and the
        arrivals prefilled with it), prefill the requests arriving now beside it (with
        nothing running, only them), then read what was in flight and update its
        requests while the device runs N+1."""
        engine = self.engine
        scheduler = engine.scheduler
        num_running = scheduler.num_running
        sched = scheduler.schedule(
            engine.lookahead + self.pipeline.extra_lookahead,
            admit_whole=self.joins if scheduler.num_waiting else None,
        )
        requests = [s.request for s in sched.scheduled[:num_running]]
        if sched.preempted or len(requests) != num_running:
            raise RuntimeError("a pipelined step must schedule every running request")
        launches = [self.pipeline.launch(requests, self.launches)] if requests else []
        if arrivals := sched.scheduled[num_running:]:
            launches.append(self._arrive(arrivals))
        engine.num_steps += 1
        done, self.launches = self.launches, launches
        return self._finish_all(done)

    def _arrive(self, arrivals: list[ScheduledRequest]) -> SpecLaunch:
        """Prefill the arrivals' whole prompts (a step's prefill, graphs where they fit),
        pick each first token on the device and start the head over the prompt; the
        engine then holds each request one step behind, at its prompt's last token."""
        engine = self.engine
        starts = [s.request.num_computed_tokens for s in arrivals]
        inputs = engine.runner.prepare(arrivals)
        logits, aux = engine.runner.execute(inputs)  # [n, vocab]: each prompt's last row
        if len(inputs.sampled_rows) != len(arrivals):
            raise RuntimeError("a pipelined arrival must prefill its whole prompt")
        observe(engine.proposer, arrivals, inputs, starts, {}, aux)
        requests = [s.request for s in arrivals]
        engine.scheduler.update(arrivals)
        last_aux = engine.proposer.start_pipelined(requests)
        for request in requests:  # one step behind: the prompt's last token is the root
            engine.scheduler.roll_back(request, 1)
        first = logits.argmax(dim=-1)  # greedy (joins), min_tokens reached
        return self.pipeline.arrive(requests, first, last_aux)

    def _finish_all(self, done: list[SpecLaunch]) -> StepOutputs:
        """``_finish`` of each launch read (a request is a row of one of them)."""
        return [out for launch in done for out in self._finish(launch)]

    def _finish(self, done: SpecLaunch) -> StepOutputs:
        """Append a pipelined step's tokens (its host sync); each request's computed tokens
        move past the step's root and accepted nodes, and the proposer resumes from them.
        The step hooks cut the step here (``hook_cuts.cut_rows``, with the signals the
        read-back carries); a cut also marks the request's row of the step in flight
        stale (module docstring of spec/pipeline.py)."""
        engine = self.engine
        processor = engine.outputs
        emitted = done.read()
        live: list[tuple[int, RequestState]] = []  # rows whose requests take their tokens
        for row, (request, tokens) in enumerate(zip(done.requests, emitted, strict=True)):
            state = processor.states.get(request.request_id)
            if state is None or request.status.is_finished or state.stale_launch is done:
                engine.num_dropped_tokens += len(tokens)  # stopped or cut after it launched
                if state is not None and state.stale_launch is done:
                    state.stale_launch = None
                continue
            live.append((row, state))
        cuts: dict[int, RowCut] = {}
        if engine.step_hooks and done.num_draft_tokens:  # an arrival's prefill is no step
            cuts = cut_rows(
                engine.step_hooks,
                [done.requests[row] for row, _ in live],
                [emitted[row] for row, _ in live],
                [len(emitted[row]) - 1 for row, _ in live],
                lambda js: [done.signals(live[j][0]) for j in js],
            )
        now = time.monotonic()
        outputs: StepOutputs = []
        for j, (row, state) in enumerate(live):
            request, tokens = done.requests[row], emitted[row]
            num_accepted = len(tokens) - 1
            counted = None
            if done.num_draft_tokens:  # an arrival's prefill drafted nothing: not a step
                counted = counted_as_synchronous(
                    request, done.num_draft_tokens, done.depth, num_accepted
                )
            if counted is not None:
                engine.spec_stats.record(*counted)
                state.spec_stats.record(*counted)
            if (cut := cuts.get(j)) is not None:
                tokens, num_accepted = cut.tokens, cut.num_accepted
                # The launch since, which holds the request's next row (none when the
                # launches in flight are being drained).
                state.stale_launch = next(
                    (launch for launch in self.launches if request in launch.requests), None
                )
            root = request.num_computed_tokens  # one step behind: this step's root
            engine.scheduler.advance(request, 1 + num_accepted)
            engine.proposer.resume(
                request, root, done.state.aux, done.state_row(row), num_accepted + 1
            )
            for token_id in tokens:
                processor.append_token(state, token_id, None, now)
                if request.is_finished:
                    break
            processor.report(state, outputs)
        return outputs


def counted_as_synchronous(
    request: Request, num_drafted: int, depth: int, num_accepted: int
) -> tuple[int, int] | None:
    """(drafted, accepted) of a pipelined step as the synchronous step counts it, or None
    where that step would not have drafted. A pipelined step launches before the host
    knows its request's output length, so near ``max_tokens`` it drafts the full shape;
    the synchronous step drafts at most ``max_tokens - output - 1`` tokens (a chain) and
    decodes plainly at 0, which is not a step. Counting the same makes τ independent of
    pipelining: exact for chains (a shorter chain is the longer one's prefix), the
    shortened chain's count for trees."""
    depth_left = request.max_tokens - request.num_output_tokens - 1
    if depth_left >= depth:
        return num_drafted, num_accepted
    if depth_left <= 0:
        return None
    return depth_left, min(num_accepted, depth_left)
