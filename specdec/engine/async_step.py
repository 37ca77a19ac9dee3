"""The async step (``StepMode``): launch step N+1, then read step N.

Step N+1's decode rows read step N's sampled tokens on the device (``PendingTokens``), so
the host schedules, prepares and launches N+1 before it waits for N, and host work
overlaps the device's. Used for plain steps: an engine without a proposer, and steps
above the speculation bands (a model proposer's aux states then stay in the runner's aux
cache: ``LLMEngine.defer_observation``).
"""

from __future__ import annotations

import time

import torch

from specdec.device.staging import to_host
from specdec.engine.step_mode import StepMode, StepOutputs
from specdec.engine.step_sampling import logprobs_to_host
from specdec.ops.step_inputs import PendingTokens
from specdec.request import Request
from specdec.sampling.sampler import LogprobsTensors


class InFlight:
    """A launched step whose sampled tokens the host has not read. Their copy to the host
    is queued behind the step (``to_host``), so reading them waits for this step only,
    not for the one launched after it."""

    def __init__(
        self,
        requests: list[Request],  # each sampled row's request, in row order
        token_ids: torch.Tensor,  # [num_sampled] int64, on the model's device
        logprobs: LogprobsTensors | None,
    ) -> None:
        self.requests = requests
        self.token_ids = token_ids
        self.logprobs = logprobs
        self._host = to_host(token_ids)

    def pending(self) -> PendingTokens:
        return PendingTokens(self.token_ids, {r.request_id: i for i, r in enumerate(self.requests)})

    def read(self) -> list[int]:
        return self._host.tolist()


class AsyncStep(StepMode):
    """Plain steps, one in flight (module docstring)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.launched: InFlight | None = None  # launched, not read

    def can_run(self) -> bool:
        return not self.engine.speculates_next()

    @property
    def in_flight(self) -> bool:
        return self.launched is not None

    def step(self, deferring: bool) -> StepOutputs:
        """Launch step N+1, then read step N's tokens and update its requests while the
        device runs N+1. A request that step N stops was scheduled in N+1 too: that token
        is computed and dropped (its K/V lands in the request's own freed slots, written
        before any later step can hand them out, as the device runs steps in order)."""
        engine = self.engine
        num_running = engine.scheduler.num_running
        sched = engine.scheduler.schedule()
        if engine.runner.aux_cache is not None:
            engine.defer_observation(num_running, deferring)
        launched = self._launch(sched.scheduled) if not sched.is_empty else None
        done, self.launched = self.launched, launched
        return self._finish(done) if done is not None else []

    def drain(self) -> StepOutputs:
        done, self.launched = self.launched, None
        return self._finish(done) if done is not None else []

    def _launch(self, scheduled) -> InFlight | None:
        """Prepare, run and sample one step without reading anything back."""
        engine = self.engine
        pending = self.launched.pending() if self.launched is not None else None
        inputs = engine.runner.prepare(scheduled, pending=pending)
        logits, _ = engine.runner.execute(inputs)
        engine.scheduler.update(scheduled)
        engine.num_steps += 1
        if not inputs.sampled_rows:
            return None
        requests = [scheduled[row].request for row in inputs.sampled_rows]
        states = [engine.outputs.states[r.request_id] for r in requests]
        token_ids, logprobs = engine.step_sampler.on_device(states, logits)
        for request in requests:
            request.num_pending_tokens += 1
        return InFlight(requests, token_ids, logprobs)

    def _finish(self, done: InFlight) -> StepOutputs:
        """Append a launched step's tokens (the step's host sync) and build its outputs."""
        engine = self.engine
        token_ids = done.read()
        # Logprobs read back on the current stream, i.e. after the step launched since:
        # only requests that ask for them pay that wait.
        logprobs = logprobs_to_host(done.logprobs, token_ids)
        now = time.monotonic()
        outputs: StepOutputs = []
        processor = engine.outputs
        for i, (request, token_id) in enumerate(zip(done.requests, token_ids, strict=True)):
            request.num_pending_tokens -= 1
            state = processor.states.get(request.request_id)
            if state is None or request.status.is_finished:
                engine.num_dropped_tokens += 1  # stopped or aborted after this step launched
                continue
            processor.append_token(state, token_id, logprobs[i] if logprobs else None, now)
            processor.report(state, outputs)
        return outputs
