"""``specdec serve`` end to end against a real server process on 127.0.0.1 (SmolLM2, fp32
CPU, n-gram speculation on, API key required): the official openai client gets exactly
the offline engine's greedy text; 64 concurrent streams finish with their offline outputs
and /metrics adds up; clients that disconnect mid-stream leave the KV pool free; bad
input gets OpenAI-style errors with the right status; bench-serve reports percentiles."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_server import CPU_ARGS, scrape, start_server

from specdec import LLM, SamplingParams
from specdec.cli import main

SMOLLM2 = "smollm2-135m-instruct"
API_KEY = "sk-specdec-test"
MAX_MODEL_LEN = 512
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server_proc():
    args = [*CPU_ARGS, "--model", SMOLLM2, "--max-model-len", str(MAX_MODEL_LEN)]
    # Speculation at every batch size (the default n-gram server stops above 4 requests):
    # the concurrent tests below then verify drafts inside large batches.
    spec = ["--draft", "ngram", "--spec-disable-by-batch-size", "1024"]
    server = start_server([*args, "--api-key", API_KEY, *spec])
    yield server
    server.stop()
    assert not server.unhandled_errors(), server.log_tail()


@pytest.fixture(scope="module")
def offline(server_proc):
    """The offline engine, plain decoding (loads while the server starts)."""
    return LLM(SMOLLM2, device="cpu", dtype="float32", kv_cache_memory=256 << 20, max_model_len=512)


@pytest.fixture(scope="module")
def server(server_proc):
    server_proc.wait_ready()
    return server_proc


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


PROMPTS = ["The three primary colours are", "def add(a, b):\n    return"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven is a prime number."},
        {"role": "user", "content": "Name another one."},
    ],
]


def test_openai_client_gets_the_offline_greedy_text(offline, server, client):
    expected = offline.generate(PROMPTS, _greedy(16), use_tqdm=False)
    for prompt, exp in zip(PROMPTS, expected, strict=True):
        out = exp.outputs[0]
        kw = dict(model=SMOLLM2, prompt=prompt, max_tokens=16, temperature=0)
        r = client.completions.create(**kw)
        assert r.choices[0].text == out.text
        assert r.choices[0].finish_reason == out.finish_reason
        assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert r.usage.completion_tokens == len(out.token_ids)
        chunks = list(
            client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == out.text
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == out.finish_reason and not any(reasons[:-1])
        assert chunks[-1].usage.completion_tokens == len(out.token_ids)

    expected = offline.chat(CONVERSATIONS, _greedy(16), use_tqdm=False)
    for messages, exp in zip(CONVERSATIONS, expected, strict=True):
        out = exp.outputs[0]
        kw = dict(model=SMOLLM2, messages=messages, max_tokens=16, temperature=0)
        r = client.chat.completions.create(**kw)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == out.text
        assert r.choices[0].finish_reason == out.finish_reason
        assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert r.usage.completion_tokens == len(out.token_ids)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.text
        assert chunks[-1].choices[0].finish_reason == out.finish_reason


def test_stop_strings_logprobs_and_seeds(offline, server, client):
    prompt = "Count up: 1, 2, 3,"
    exp = offline.generate([prompt], _greedy(16, stop=[" 7"]), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(
        model=SMOLLM2, prompt=prompt, max_tokens=16, temperature=0, stop=[" 7"]
    )
    assert r.choices[0].text == exp.text and " 7" not in exp.text
    assert r.choices[0].finish_reason == "stop"

    r = client.completions.create(
        model=SMOLLM2, prompt=prompt, max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy takes the top

    r = client.chat.completions.create(
        model=SMOLLM2,
        messages=CONVERSATIONS[0],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 3
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content

    kw = dict(model=SMOLLM2, prompt=prompt, max_tokens=12, temperature=1.0, top_p=0.95)
    seeded = [client.completions.create(**kw, seed=1234).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]  # same seed, same sample


def _prompts_64() -> list[str]:
    templates = [
        "Count up: {i}, {j}, {k},",
        "Q: What is {i} plus {i}?\nA:",
        "Spell the number {i} in words:",
        "The year {k} was",
    ]
    return [templates[n % 4].format(i=n, j=n + 1, k=n + 2) for n in range(64)]


def test_64_concurrent_streams_match_offline_and_metrics_add_up(offline, server):
    prompts = _prompts_64()
    expected = offline.generate(prompts, _greedy(12), use_tqdm=False)
    before = scrape(server.url)

    async def one(client: openai.AsyncOpenAI, prompt: str):
        stream = await client.completions.create(
            model=SMOLLM2,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return text, usage

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == [e.outputs[0].text for e in expected]
    n_out = sum(u.completion_tokens for _, u in results)
    assert n_out == sum(len(e.outputs[0].token_ids) for e in expected)
    n_in = sum(u.prompt_tokens for _, u in results)
    assert n_in == sum(len(e.prompt_token_ids) for e in expected)

    after = scrape(server.url)

    def delta(series: str) -> float:
        return after.get(series, 0.0) - before.get(series, 0.0)

    finished = sum(
        delta(f'specdec_request_success_total{{finished_reason="{r}"}}') for r in ("stop", "length")
    )
    assert finished == 64
    assert delta("specdec_generation_tokens_total") == n_out
    assert delta("specdec_prompt_tokens_total") == n_in
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        assert delta(f"specdec_{histogram}_seconds_count") == 64
    # Where TTFT went, from the core's timeline (another process, the same clock): every
    # phase observed once a request, no phase's total negative; prepare + queue + prefill
    # end at the core's first token, which the server's stream can only see after.
    phases = {p: delta(f"specdec_request_{p}_time_seconds_sum")
              for p in ("prepare", "queue", "prefill", "decode")}  # fmt: skip
    for p in phases:
        assert delta(f"specdec_request_{p}_time_seconds_count") == 64, p
    assert min(phases.values()) >= 0.0, phases
    to_first = phases["prepare"] + phases["queue"] + phases["prefill"]
    assert to_first <= delta("specdec_time_to_first_token_seconds_sum"), phases
    # Speculation was on and its counters are consistent.
    steps = delta("specdec_spec_decode_num_steps_total")
    accepted = delta("specdec_spec_decode_num_accepted_tokens_total")
    assert steps > 0 and 0 <= accepted <= delta("specdec_spec_decode_num_draft_tokens_total")
    tau = after["specdec_spec_decode_mean_acceptance_length"]
    a1 = after['specdec_spec_decode_acceptance_rate{position="1"}']
    assert tau >= 1.0 and 0.0 <= a1 <= 1.0
    # Steps replayed from a CUDA graph are some of the steps (none off CUDA).
    assert 0 <= delta("specdec_engine_graph_steps_total") <= delta("specdec_engine_steps_total")
    assert delta("specdec_engine_steps_total") > 0
    assert after["specdec_num_requests_running"] == 0
    assert after["specdec_kv_cache_usage_perc"] == 0.0


def test_clients_disconnecting_mid_stream_leave_the_kv_pool_free(server):
    before = scrape(server.url)
    # 10 streaming requests that would each run for hundreds of steps; each client leaves
    # after its first generated text.
    body = {"model": SMOLLM2, "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        request = {**body, "prompt": f"Story number {i}: once upon a time"}
        async with client.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # leaving the block closes the connection mid-stream

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            await asyncio.gather(*(one(client, i) for i in range(10)))

    asyncio.run(run_all())
    # A non-streaming client that gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        request = {**body, "stream": False, "prompt": "A very long story:"}
        httpx.post(f"{server.url}/v1/completions", json=request, headers=AUTH, timeout=1.0)
    # Finishing 400 tokens each would take far longer than this deadline on CPU.
    deadline = time.monotonic() + 5.0
    while True:
        now = scrape(server.url)
        busy = now["specdec_num_requests_running"] + now["specdec_num_requests_waiting"]
        if busy == 0 and now["specdec_kv_cache_usage_perc"] == 0.0:
            break
        assert time.monotonic() < deadline, f"KV pool still in use after the disconnects: {now}"
        time.sleep(0.05)
    assert now["specdec_kv_cache_free_blocks"] == now["specdec_kv_cache_total_blocks"]
    assert now["specdec_request_aborted_total"] - before["specdec_request_aborted_total"] == 11
    generated = now["specdec_generation_tokens_total"] - before["specdec_generation_tokens_total"]
    assert 10 <= generated < 11 * 400 / 4  # each stopped early, not at max_tokens


def test_idle_server_does_not_spin(server):
    """With nothing to do, the engine thread sleeps: the process uses ~no CPU."""

    def cpu_seconds() -> float:
        stat = Path(f"/proc/{server.proc.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(0.5)  # let the previous test's aborts settle
    start = cpu_seconds()
    time.sleep(2.0)
    assert cpu_seconds() - start < 0.2


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    return body["error"]["message"]


def test_bad_input_gets_openai_errors_with_the_right_status(server, client):
    def post(path: str, body=None, headers=AUTH, content: bytes | None = None):
        return httpx.post(
            server.url + path, json=body, content=content, headers=headers, timeout=60
        )

    raw = {**AUTH, "Content-Type": "application/json"}
    msg = _error(post("/v1/completions", content=b'{"prompt": "hi",', headers=raw), 400)
    assert "not valid JSON" in msg
    msg = _error(post("/v1/chat/completions", content=b"[1, 2]", headers=raw), 400)
    # A text the tokenizer cannot take (a lone surrogate, valid JSON): this request's 400.
    response = post("/v1/completions", content=b'{"prompt": "a\\ud800b"}', headers=raw)
    assert "prompt cannot be tokenized" in _error(response, 400)
    assert response.json()["error"]["param"] == "prompt"
    for body, param in [
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "hi", "temperature": 3}, "temperature"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ]:
        response = post("/v1/completions", body)
        _error(response, 400)
        assert response.json()["error"]["param"].startswith(param)
    bad_role = {"messages": [{"role": "tool", "content": "x"}]}
    assert "messages.0.role" in _error(post("/v1/chat/completions", bad_role), 400)
    assert "messages" in _error(post("/v1/chat/completions", {"messages": []}), 400)

    # Over the context: the message has the numbers and the fix.
    msg = _error(post("/v1/completions", {"prompt": "hi", "max_tokens": 600}), 400)
    assert "600" in msg and "max_model_len 512" in msg and "lower max_tokens" in msg
    msg = _error(post("/v1/completions", {"prompt": "hello " * 600}), 400)
    assert "max_model_len is 512" in msg
    msg = _error(post("/v1/completions", {"prompt": [10**9]}), 400)
    assert "outside the vocabulary" in msg
    for body, word in [
        ({"prompt": "hi", "n": 2}, "n=2"),
        ({"prompt": "hi", "echo": True}, "echo"),
        ({"prompt": ["a", "b"]}, "one prompt per request"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
    ]:
        assert word in _error(post("/v1/completions", body), 400)

    msg = _error(post("/v1/completions", {"prompt": "hi", "model": "gpt-4"}), 404)
    assert "gpt-4" in msg and SMOLLM2 in msg
    assert _error(post("/v1/completions", {"prompt": "hi"}, headers={}), 401)
    wrong = {"Authorization": "Bearer nope"}
    assert _error(post("/v1/chat/completions", {"messages": []}, headers=wrong), 401)
    _error(httpx.get(f"{server.url}/v1/models", timeout=10), 401)
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).status_code == 200
    _error(httpx.get(f"{server.url}/v1/nothing-here", headers=AUTH, timeout=10), 404)

    # The official client maps them to its exception classes.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SMOLLM2, prompt="hi", max_tokens=600)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope").models.list()


def test_open_routes_models_and_docs(server):
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in models["data"]] == [SMOLLM2]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/docs", timeout=10).status_code == 200
    paths = httpx.get(f"{server.url}/openapi.json", timeout=10).json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(paths)
    metrics = scrape(server.url)
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hit_rate",
        "engine_steps_total",
        "engine_graph_steps_total",
        "spec_decode_num_steps_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "spec_decode_mean_acceptance_length",
        "spec_decode_graphs_pending",
        "deferred_graphs_pending",
        "time_per_output_token_seconds_count",
    ):
        assert f"specdec_{name}" in metrics
    assert 'specdec_spec_decode_acceptance_rate{position="3"}' in metrics


def test_bench_serve_reports_throughput_and_percentiles(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench-serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6"]
    args += ["--concurrency", "3", "--request-rate", "50", "--max-tokens", "8", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] > 0 and report["output_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        s = report[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert report["speculation"]["steps"] > 0 and report["speculation"]["tau"] >= 1.0
    assert "TTFT" in capsys.readouterr().out
