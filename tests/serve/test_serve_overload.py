"""A server over its limits (two running requests, four waiting): requests beyond the
running ones queue first come, first served, every admitted request finishes with its
greedy output, and only those beyond the waiting queue's bound are refused, with 429 and
Retry-After."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import pytest
from serve_server import CPU_ARGS, running_server, scrape

MAX_NUM_SEQS, MAX_WAITING = 2, 4
# Arrivals this far apart keep their order at the server on a loaded machine; each
# request decodes long enough (MAX_TOKENS steps, over a second on any CPU) that none
# finishes before the last one arrives (9 x SPACING_S).
SPACING_S, MAX_TOKENS = 0.1, 128


@pytest.fixture(scope="module")
def server():
    args = [*CPU_ARGS, "--draft", "none", "--max-model-len", "256"]
    limits = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING)]
    with running_server([*args, *limits]) as server:
        yield server


def test_requests_queue_fcfs_and_only_those_past_the_bound_get_429(server):
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    prompts = [f"Count from {i}: {i}, {i + 1}," for i in range(10)]
    alone = httpx.post(
        f"{server.url}/v1/completions",
        json={**body, "stream": False, "prompt": prompts[0]},
        timeout=120,
    ).json()["choices"][0]["text"]

    async def one(client: httpx.AsyncClient, i: int, sent: float):
        await asyncio.sleep(SPACING_S * i)  # arrival order = index
        request = {**body, "prompt": prompts[i]}
        async with client.stream("POST", "/v1/completions", json=request) as r:
            if r.status_code != 200:
                await r.aread()
                return i, r.status_code, r.headers.get("Retry-After"), None, ""
            first, text = None, ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    first = first or time.monotonic() - sent
                    text += json.loads(line[6:])["choices"][0]["text"]
            return i, 200, None, first, text

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            sent = time.monotonic()
            return await asyncio.gather(*(one(client, i, sent) for i in range(10)))

    before = scrape(server.url)['specdec_request_rejected_total{reason="queue_full"}']
    results = asyncio.run(burst())
    admitted = [r for r in results if r[1] == 200]
    refused = [r for r in results if r[1] != 200]
    # The first MAX_NUM_SEQS + MAX_WAITING to arrive are admitted, later ones refused.
    assert [r[0] for r in admitted] == list(range(MAX_NUM_SEQS + MAX_WAITING))
    assert all(status == 429 and retry == "1" for _, status, retry, _, _ in refused)
    after = scrape(server.url)['specdec_request_rejected_total{reason="queue_full"}']
    assert after - before == len(refused)
    # First come, first served: each waiting request starts after those that came before
    # (requests admitted in one step reach the client in either order: 100 ms of slack,
    # far below a request's MAX_TOKENS steps here).
    firsts = [r[3] for r in admitted]
    assert all(b >= a - 0.1 for a, b in itertools.pairwise(firsts)), firsts
    waits = [first - SPACING_S * i for i, _, _, first, _ in admitted]  # from each arrival
    assert waits[-1] > waits[0] + 0.5, waits  # the last one queued behind whole requests
    assert admitted[0][4] == alone
    assert all(len(r[4]) > 0 for r in admitted)
