"""AsyncLLMEngine's threading contract, on a scripted stand-in engine (no model): every
engine call happens on the engine thread, outputs stream in order, closing a stream
aborts its request before the next step, bad input and a full queue raise before any
output, an engine failure reaches every stream, and an idle loop sleeps."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from specdec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specdec.sampling_params import RequestOutputKind, SamplingParams
from specdec.serve.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from specdec.spec.metrics import SpecStats


class ScriptedEngine:
    """Each request emits one token per step until it has ``max_tokens``; records the
    calls it gets and the threads they come from."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.requests: dict[str, list[int]] = {}
        self.limits: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []
        self.threads: set[int] = set()
        self.fail_at_step = fail_at_step
        self.num_steps = 0
        self.idle_checks = 0
        self.spec_stats = SpecStats()
        self.proposer = None
        self.spec_exit = None  # no SpecExit channels (LLMEngine's attribute)
        pool = SimpleNamespace(num_usable_blocks=8, num_free_blocks=8, prefix_queries=0)
        pool.prefix_hits = 0
        self.kv_manager = SimpleNamespace(pool=pool)
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0, num_preemptions=0)

    def _touch(self, name: str, request_id: str = "") -> None:
        self.threads.add(threading.get_ident())
        self.calls.append((name, request_id))

    def add_request(self, prompt, params: SamplingParams, request_id: str) -> str:
        self._touch("add", request_id)
        if not prompt:
            raise ValueError("the prompt is empty; pass at least one token")
        assert params.output_kind is RequestOutputKind.CUMULATIVE
        self.requests[request_id] = []
        self.limits[request_id] = params.max_tokens
        return request_id

    def abort_request(self, request_id: str) -> None:
        self._touch("abort", request_id)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        self.idle_checks += 1
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._touch("step")
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("device lost")
        outputs = []
        for request_id, tokens in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= self.limits[request_id]
            completion = CompletionOutput(
                0, "x" * len(tokens), list(tokens), "length" if done else None
            )
            metrics = RequestMetrics(arrival_time=0.0)
            outputs.append(RequestOutput(request_id, None, [1], [completion], done, metrics, "x"))
            if done:
                del self.requests[request_id]
        time.sleep(0.01)  # a step takes a while: the loop side runs meanwhile
        return outputs


def _run(engine: ScriptedEngine, body, max_in_flight: int = 8):
    async def main():
        async_engine = AsyncLLMEngine(engine, max_in_flight)
        async_engine.start()
        try:
            return await body(async_engine)
        finally:
            async_engine.shutdown()

    return asyncio.run(main())


def test_streams_outputs_in_order_with_every_engine_call_on_the_engine_thread():
    engine = ScriptedEngine()

    async def body(a: AsyncLLMEngine):
        async def one(i: int):
            stream = await a.add_request(f"r{i}", [1, 2], SamplingParams(max_tokens=3 + i))
            return [len(out.outputs[0].token_ids) async for out in stream]

        counts = await asyncio.gather(*(one(i) for i in range(4)))
        return counts, a.num_in_flight, a.snapshot

    counts, in_flight, snapshot = _run(engine, body)
    assert counts == [list(range(1, 4 + i)) for i in range(4)]
    assert in_flight == 0 and snapshot.num_steps == engine.num_steps
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads


def test_closing_a_stream_aborts_before_the_next_step():
    engine = ScriptedEngine()

    async def body(a: AsyncLLMEngine):
        stream = await a.add_request("r", [1], SamplingParams(max_tokens=1000))
        async for out in stream:
            if len(out.outputs[0].token_ids) == 2:
                break  # leaving the loop closes the stream
        await asyncio.sleep(0.1)
        return a.num_in_flight

    assert _run(engine, body) == 0
    abort = engine.calls.index(("abort", "r"))
    assert engine.calls[abort + 1 :].count(("step", "")) == 0  # no step ran after it
    assert engine.num_steps < 20


def test_bad_input_and_a_full_queue_raise_before_any_output():
    engine = ScriptedEngine()

    async def body(a: AsyncLLMEngine):
        with pytest.raises(ValueError, match="the prompt is empty"):
            await a.add_request("bad", [], SamplingParams())
        assert a.num_in_flight == 0
        first = await a.add_request("ok", [1], SamplingParams(max_tokens=50))
        with pytest.raises(QueueFullError, match="retry later"):
            await a.add_request("more", [1], SamplingParams())
        first.close()
        return a.num_in_flight

    assert _run(engine, body, max_in_flight=1) == 0
    assert ("add", "more") not in engine.calls


def test_an_engine_failure_reaches_every_stream_and_refuses_new_requests():
    engine = ScriptedEngine(fail_at_step=3)

    async def body(a: AsyncLLMEngine):
        streams = [await a.add_request(f"r{i}", [1], SamplingParams(max_tokens=99)) for i in "ab"]
        for stream in streams:
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            await a.add_request("late", [1], SamplingParams())
        return a.dead

    assert isinstance(_run(engine, body), RuntimeError)


def test_an_idle_engine_thread_sleeps():
    engine = ScriptedEngine()

    async def body(a: AsyncLLMEngine):
        stream = await a.add_request("r", [1], SamplingParams(max_tokens=2))
        _ = [out async for out in stream]
        await asyncio.sleep(0.1)
        checks = engine.idle_checks
        await asyncio.sleep(0.5)
        return engine.idle_checks - checks

    assert _run(engine, body) == 0  # no polling while nothing is queued or running
