"""The API side of the engine core (``AsyncLLMEngine``) and both transports, on a scripted
stand-in engine (no model): every engine call happens on the core's own thread or process,
outputs stream in order and coalesce for slow readers, stop strings are matched on the API
side (then the core aborts the request), closing a stream aborts its request before the
next step, bad input and a full queue raise before any output, an engine failure reaches
every stream, and an idle core sleeps."""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from specdec.outputs import RequestMetrics, TokenDelta
from specdec.sampling_params import RequestOutputKind, SamplingParams
from specdec.serve.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from specdec.serve.core_client import EngineStartError, ProcCoreClient, _send_commands
from specdec.serve.engine_core import EngineCore, _read
from specdec.spec.metrics import SpecStats


class LetterTokenizer:
    """Token id t decodes to one letter, chr(97 + t % 26)."""

    def decode(self, token_ids, skip_special_tokens=True, **kwargs) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)


class ScriptedEngine:
    """Each request emits token ids 0, 1, 2, ... one per step until it has
    ``max_tokens``; records the calls it gets and the threads they come from."""

    def __init__(
        self, fail_at_step: int | None = None, step_s: float = 0.01, tokens_per_step: int = 1
    ) -> None:
        self.tokens_per_step = tokens_per_step  # more than one: a step message grows
        self.requests: dict[str, list[int]] = {}
        self.limits: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []
        self.threads: set[int] = set()
        self.fail_at_step = fail_at_step
        self.step_s = step_s
        self.num_steps = 0
        self.num_graph_steps = 0  # no CUDA graphs here
        self.idle_checks = 0
        self.spec_stats = SpecStats()
        self.proposer = None
        self.has_pending_graphs = False  # no deferred graphs (LLMEngine's properties)
        self.speculation_graphs_pending = False
        self.resolved = "scripted"
        self.max_model_len = 64
        self.config = SimpleNamespace(speculative=None)
        self.runner = SimpleNamespace(runtime=SimpleNamespace(device="cpu", dtype="float32"))
        pool = SimpleNamespace(num_usable_blocks=8, num_free_blocks=8, prefix_queries=0)
        pool.prefix_hits = 0
        self.kv_manager = SimpleNamespace(pool=pool)
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0, num_preemptions=0)

    def hook(self, kind):
        return None  # no step hooks: no SpecExit channels (LLMEngine.hook)

    def _touch(self, name: str, request_id: str = "") -> None:
        self.threads.add(threading.get_ident())
        self.calls.append((name, request_id))

    def add_request(
        self, prompt, params: SamplingParams, request_id: str, arrival_time: float
    ) -> str:
        self._touch("add", request_id)
        assert arrival_time <= time.monotonic()  # the API side's send time
        if not prompt:
            raise ValueError("the prompt is empty; pass at least one token")
        # The core asks for token ids per step and leaves text to the API side.
        assert params.output_kind is RequestOutputKind.TOKENS and not params.stop
        self.requests[request_id] = []
        self.limits[request_id] = params.max_tokens
        return request_id

    def abort_request(self, request_id: str) -> None:
        self._touch("abort", request_id)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        self.idle_checks += 1
        return bool(self.requests)

    def step(self) -> list[TokenDelta]:
        self._touch("step")
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("device lost")
        outputs = []
        for request_id, tokens in list(self.requests.items()):
            n = len(tokens)
            new = list(range(n, min(n + self.tokens_per_step, self.limits[request_id])))
            tokens += new
            done = len(tokens) >= self.limits[request_id]
            metrics = RequestMetrics(arrival_time=0.0) if done else None
            reason = "length" if done else None
            outputs.append(TokenDelta(request_id, new, None, reason, None, metrics))
            if done:
                del self.requests[request_id]
        time.sleep(self.step_s)  # a step takes a while: the loop side runs meanwhile
        return outputs


def scripted_engine(config: dict) -> ScriptedEngine:
    """Builds the stand-in in the core's process (a spawn target must be importable)."""
    if config.get("fail_to_build"):
        raise RuntimeError("no device")
    return ScriptedEngine(**config)


def _run(core, body, max_in_flight: int = 8, loop_factory=None):
    async def main():
        a = AsyncLLMEngine(core, max_in_flight, tokenizer=LetterTokenizer())
        a.start()
        try:
            return await body(a)
        finally:
            a.shutdown()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())


def _text(n: int) -> str:
    return LetterTokenizer().decode(list(range(n)))


def test_streams_outputs_in_order_with_every_engine_call_on_the_engine_thread():
    engine = ScriptedEngine()

    async def body(a: AsyncLLMEngine):
        async def one(i: int):
            stream = await a.add_request(f"r{i}", [1, 2], SamplingParams(max_tokens=3 + i))
            outs = [out async for out in stream]
            return [len(out.outputs[0].token_ids) for out in outs], outs[-1]

        results = await asyncio.gather(*(one(i) for i in range(4)))
        await asyncio.sleep(0.1)  # the idle core's last snapshot
        return results, a.num_in_flight, a.snapshot

    results, in_flight, snapshot = _run(engine, body)
    assert [counts for counts, _ in results] == [list(range(1, 4 + i)) for i in range(4)]
    for i, (_, last) in enumerate(results):
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert last.outputs[0].text == _text(3 + i)
        assert last.outputs[0].token_ids == list(range(3 + i))
    assert in_flight == 0 and snapshot.num_steps == engine.num_steps
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads


def test_a_slow_reader_gets_what_arrived_in_one_output_and_the_deltas_add_up():
    engine = ScriptedEngine(step_s=0.002)

    async def body(a: AsyncLLMEngine):
        stream = await a.add_request("r", [1], SamplingParams(max_tokens=40))
        outs = []
        async for out in stream:
            outs.append(out)
            await asyncio.sleep(0.03)  # a client slower than the engine's steps
        return outs

    outs = _run(engine, body)
    assert len(outs) < 20  # 40 steps reached this reader in far fewer outputs
    counts = [len(out.outputs[0].token_ids) for out in outs]
    assert max(b - a for a, b in itertools.pairwise(counts)) > 1
    assert "".join(o.text_delta for o in outs) == outs[-1].outputs[0].text == _text(40)


def test_a_stop_string_finishes_on_the_api_side_and_aborts_the_core_request():
    engine = ScriptedEngine()

    async def body(a: AsyncLLMEngine):
        params = SamplingParams(max_tokens=50, stop=["def"])
        stream = await a.add_request("r", [1], params)
        outs = [out async for out in stream]
        await asyncio.sleep(0.1)
        return outs, a.num_in_flight

    outs, in_flight = _run(engine, body)
    last = outs[-1].outputs[0]
    assert (last.text, last.finish_reason, last.stop_reason) == ("abc", "stop", "def")
    assert last.token_ids == [0, 1, 2, 3, 4, 5]  # up to the token that completed the stop
    assert "".join(o.text_delta for o in outs) == "abc"
    assert ("abort", "r") in engine.calls and not engine.requests and in_flight == 0


def test_closing_a_stream_aborts_before_the_next_step():
    engine = ScriptedEngine()

    async def body(a: AsyncLLMEngine):
        stream = await a.add_request("r", [1], SamplingParams(max_tokens=1000))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
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
            with pytest.raises(EngineDeadError, match="device lost"):
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


# ---- the core in its own process ------------------------------------------------------------
def test_the_core_process_streams_stops_aborts_and_reports_its_engine():
    core = ProcCoreClient({}, build_engine=scripted_engine, start_timeout=120)
    assert core.info.max_model_len == 64 and core.process.pid != os.getpid()

    async def body(a: AsyncLLMEngine):
        async def one(i: int, stop: list[str]):
            params = SamplingParams(max_tokens=5 + i, stop=stop)
            stream = await a.add_request(f"r{i}", [1], params)
            return [out async for out in stream][-1].outputs[0]

        done = await asyncio.gather(*(one(i, ["cd"] if i == 3 else []) for i in range(6)))
        with pytest.raises(ValueError, match="the prompt is empty"):
            await a.add_request("bad", [], SamplingParams())
        closed = await a.add_request("closed", [1], SamplingParams(max_tokens=10_000))
        async for _ in closed:
            break
        await asyncio.sleep(0.2)
        return done, a.num_in_flight, a.snapshot

    done, in_flight, snapshot = _run(core, body)
    assert [c.text for c in done] == [_text(5 + i) if i != 3 else "ab" for i in range(6)]
    assert done[3].finish_reason == "stop" and done[5].finish_reason == "length"
    assert in_flight == 0 and snapshot.num_steps > 0
    assert not core.process.is_alive()  # shutdown stopped it


def _loop_factories():
    factories = [pytest.param(None, id="asyncio")]
    try:
        import uvloop
    except ImportError:
        return factories
    return [*factories, pytest.param(uvloop.new_event_loop, id="uvloop")]


@pytest.mark.parametrize("loop_factory", _loop_factories())
def test_step_messages_larger_than_the_pipe_arrive_whole_on_either_loop(loop_factory):
    """A step message of ~200 KB (more than a pipe holds) reaches the API side whole while
    its streams read: the loop reads what the pipe has and keeps a partial message for the
    next read (uvloop's watcher makes the pipe non-blocking, so a reader that waits for a
    message's rest would fail mid-message there)."""
    per_step = 30_000
    config = {"tokens_per_step": per_step, "step_s": 0.0}
    core = ProcCoreClient(config, build_engine=scripted_engine, start_timeout=120)

    async def body(a: AsyncLLMEngine):
        async def one(i: int):
            params = SamplingParams(max_tokens=4 * per_step)
            stream = await a.add_request(f"r{i}", [1], params)
            return [out async for out in stream][-1].outputs[0]

        return await asyncio.gather(*(one(i) for i in range(2)))

    done = _run(core, body, loop_factory=loop_factory)
    assert [c.text for c in done] == [_text(4 * per_step)] * 2
    assert [c.finish_reason for c in done] == ["length", "length"]


def test_a_core_process_failure_is_reported_not_hung():
    with pytest.raises(EngineStartError, match="no device"):
        ProcCoreClient({"fail_to_build": True}, build_engine=scripted_engine, start_timeout=120)
    core = ProcCoreClient({"fail_at_step": 4}, build_engine=scripted_engine, start_timeout=120)

    async def body(a: AsyncLLMEngine):
        stream = await a.add_request("r", [1], SamplingParams(max_tokens=99))
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in stream:
                pass
        return a.dead

    assert _run(core, body) is not None


def test_commands_reach_the_core_in_order_one_message_per_burst():
    """The API side's sender writes everything queued since its last send as one list, in
    order, and stops at None; the core's reader unpacks the lists in order. A pipe that
    does not take the message (the core is busy) holds only the sender thread: queuing a
    command returns at once."""

    class Pipe:
        def __init__(self) -> None:
            self.sent: list[list[tuple]] = []
            self.open = threading.Event()

        def send(self, message: list[tuple]) -> None:
            self.open.wait(10)  # a full pipe until the test opens it
            self.sent.append(message)

    outbox: queue.SimpleQueue = queue.SimpleQueue()
    pipe = Pipe()
    sender = threading.Thread(target=_send_commands, args=(outbox, pipe), daemon=True)
    sender.start()
    outbox.put(("add", "r0"))
    time.sleep(0.2)  # the sender holds r0 at the closed pipe
    start = time.perf_counter()
    burst = [("add", f"r{i}") for i in range(1, 65)] + [("abort", "r3")]
    for command in burst:
        outbox.put(command)
    assert time.perf_counter() - start < 0.1  # queuing never waits on the pipe
    outbox.put(None)
    pipe.open.set()
    sender.join(10)
    assert not sender.is_alive()
    assert pipe.sent == [[("add", "r0")], burst]  # the burst as one message, in order

    class Received:
        def __init__(self, messages: list[list[tuple]]) -> None:
            self.messages = list(messages)

        def recv(self) -> list[tuple]:
            if not self.messages:
                raise EOFError
            return self.messages.pop(0)

    inbox: queue.SimpleQueue = queue.SimpleQueue()
    _read(Received(pipe.sent), inbox)
    got = [inbox.get_nowait() for _ in range(inbox.qsize())]
    assert got == [("add", "r0"), *burst, ("shutdown",)]  # the API side gone: stop


def test_the_adds_of_one_iteration_get_their_verdicts_in_one_message():
    """Adds queued together are applied before the next step and answered in one
    ("added", [...]) message, in order, a rejected one with its error, before the step
    that gives their first tokens."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    sent: list[tuple] = []
    core = EngineCore(ScriptedEngine(step_s=0.0), inbox, sent.append)
    params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.TOKENS)
    for request_id, prompt in [("a", [1]), ("empty", []), ("b", [2])]:
        inbox.put(("add", request_id, prompt, params, time.monotonic()))
    assert core._iteration()
    verdicts = [m for m in sent if m[0] == "added"]
    assert len(verdicts) == 1
    (_, answers) = verdicts[0]
    assert [r for r, _ in answers] == ["a", "empty", "b"]
    assert answers[0][1] is None and answers[2][1] is None
    assert "the prompt is empty" in answers[1][1]
    first_tokens = next(i for i, m in enumerate(sent) if m[0] == "step" and m[1])
    assert sent.index(verdicts[0]) < first_tokens
