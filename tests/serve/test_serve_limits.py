"""A server started from a YAML config with tight limits (one running request, no queue,
max_tokens capped at 4): a full queue answers 429 with Retry-After, the token cap is a
clear 400, and schemathesis fuzzing every operation of /openapi.json (valid and invalid
bodies) never gets a 5xx."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml
from serve_server import running_server, scrape

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {
        "served_model_name": ["tiny", "smollm2"],
        "max_waiting_requests": 0,
        "max_tokens_limit": 4,
        "retry_after_s": 2,
        "engine": {  # no `speculative` key: the server's default (n-gram) speculation
            "model": SMOLLM2,
            "device": "cpu",
            "dtype": "float32",
            "cache": {"kv_cache_memory": 64 << 20},
            "scheduler": {"max_num_seqs": 1, "max_model_len": 256},
        },
    }
    path = tmp_path_factory.mktemp("serve") / "tight.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_server(["--config", str(path)]) as server:
        yield server


def test_yaml_config_names_limits_and_default_speculation(server):
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["tiny", "smollm2"]
    assert models[0]["max_model_len"] == 256
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "smollm2", "prompt": "Hello", "temperature": 0},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 4
    unknown = httpx.post(
        f"{server.url}/v1/completions", json={"model": SMOLLM2, "prompt": "Hello"}, timeout=60
    )
    assert unknown.status_code == 404
    over = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
        timeout=60,
    )
    assert over.status_code == 400 and "limit 4" in over.json()["error"]["message"]
    assert 'specdec_spec_decode_acceptance_rate{position="3"}' in scrape(server.url)


def test_full_queue_gets_429_with_retry_after(server):
    before = scrape(server.url)['specdec_request_rejected_total{reason="queue_full"}']

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {"prompt": "Count up: 1, 2, 3,", "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(4))
            )

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    # One request fits (max_num_seqs 1 + 0 waiting); the others arrive while it runs.
    assert statuses[0] == 200 and statuses[-1] == 429 and set(statuses) <= {200, 429}
    for r in responses:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "2"
            error = r.json()["error"]
            assert error["code"] == "queue_full" and "retry later" in error["message"]
    after = scrape(server.url)['specdec_request_rejected_total{reason="queue_full"}']
    assert after - before == statuses.count(429)


def test_schemathesis_finds_no_server_errors(server):
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    statuses: dict[str, list[int]] = {}
    for operation in operations:
        seen = statuses.setdefault(operation.path, [])
        # The schema's own request examples (/docs): known-good bodies.
        for strategy in operation.get_strategies_from_examples():
            seen += _fuzz(strategy, server.url, max_examples=1)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                seen += _fuzz(operation.as_strategy(generation_mode=mode), server.url)
            except Unsatisfiable:
                # An operation without parameters or body has no invalid request to make.
                assert mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET"
    # Requests reached the engine and were answered (the documented examples), and
    # generated ones hit validation; none got a 5xx.
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert 200 in statuses[path] and 400 in statuses[path], (path, statuses[path])


def _fuzz(strategy, url: str, max_examples: int = 25) -> list[int]:
    """Hypothesis-drawn requests from one operation's strategy; fails on any 5xx.
    Returns the statuses seen."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error

    seen: list[int] = []

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases on every run: no flaky CI
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def check(case) -> None:
        response = case.call(base_url=url, timeout=60)
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    check()
    return seen
