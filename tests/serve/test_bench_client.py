"""``bench-serve``'s HTTP client against a scripted server: SSE events split across TCP
writes or packed several to a write are read as events, usage sets the token counts, an
error status or an error event fails only its request, and keep-alive connections carry
one request after another."""

from __future__ import annotations

import asyncio
import json

from specdec.serve.bench import BenchConfig, run_benchmark

MODEL = "scripted"


def _event(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {data}\n\n".encode()


def _content(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def _chunked(payload: bytes) -> bytes:
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


class ScriptedServer:
    """HTTP/1.1 with keep-alive: /v1/models, no /metrics, and a chat route whose SSE
    answer depends on the prompt ("fail": 429; "error": an error event mid-stream)."""

    def __init__(self) -> None:
        self.requests = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                length = 0
                for line in lines[1:]:
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":")[1])
                body = json.loads(await reader.readexactly(length)) if length else {}
                self.requests += 1
                await self.answer(method, path, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def answer(self, method: str, path: str, body: dict, writer) -> None:
        if path == "/v1/models":
            payload = json.dumps({"data": [{"id": MODEL}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
            writer.write(f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            return
        prompt = body.get("messages", [{}])[0].get("content", "")
        if path != "/v1/chat/completions" or prompt == "fail":
            status = "404 Not Found" if path != "/v1/chat/completions" else "429 Too Many"
            payload = b'{"error": {"message": "no"}}'
            writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(payload)}\r\n\r\n".encode())
            writer.write(payload)
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        role = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        first = _event(_content("Hello"))
        # One event split across two writes, with a pause between them.
        writer.write(_chunked(role + first[:7]))
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(_chunked(first[7:]))
        if prompt == "error":
            writer.write(_chunked(_event({"error": {"message": "engine stopped"}})))
        # Three events in one write: two texts and the finish.
        finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        rest = _event(_content(" wor")) + _event(_content("ld")) + _event(finish)
        writer.write(_chunked(rest))
        usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
        writer.write(_chunked(_event(usage) + _event("[DONE]")) + b"0\r\n\r\n")
        await writer.drain()


async def _bench(prompts: list[str], concurrency: int) -> tuple[dict, ScriptedServer]:
    scripted = ScriptedServer()
    server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        config = BenchConfig(
            base_url=f"http://127.0.0.1:{port}/",
            prompts=prompts,
            num_prompts=len(prompts),
            concurrency=concurrency,
        )
        return await run_benchmark(config), scripted
    finally:
        server.close()


def test_events_split_or_packed_are_read_one_by_one():
    report, scripted = asyncio.run(_bench(["a", "b", "c", "d"], concurrency=2))
    assert report["model"] == MODEL
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 12 and report["total_input_tokens"] == 28
    # The first text completes only after the split event's pause.
    assert report["ttft_ms"]["p50"] >= 10.0
    assert "speculation" not in report  # no /metrics
    # /v1/models, /metrics before and after, four chats: on kept-alive connections.
    assert scripted.requests == 7 and scripted.connections <= 3


def test_error_status_and_error_event_fail_only_their_request():
    report, _ = asyncio.run(_bench(["fail", "ok", "error"], concurrency=1))
    assert report["completed"] == 1 and report["failed"] == 2
    assert report["total_output_tokens"] == 3
    errors = report["errors"]
    assert any(e.startswith("HTTP 429") for e in errors), errors
    assert "engine stopped" in errors, errors
