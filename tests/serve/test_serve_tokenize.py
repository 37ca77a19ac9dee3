"""vLLM's /tokenize and /detokenize on a real ``specdec serve`` process (SmolLM2, fp32 CPU,
no speculation): /tokenize reports the ids the generation routes actually use (checked
against their ``usage.prompt_tokens``), /detokenize inverts it, bad ids and unknown models
get OpenAI-style 400/404s; and the request shape of ``vllm bench serve --backend
openai-chat`` streams the same greedy text as a plain request, with exact usage."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_server import CPU_ARGS, start_server

from specdec.serve.inputs import chat_prompt_ids
from specdec.serve.protocol import ChatCompletionRequest
from specdec.serve.tokenize import special_tokens_around

SMOLLM2 = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512
SENTENCE = "The quick brown fox jumps over the lazy dog, twice: 1, 2."
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven is a prime number."},
        {"role": "user", "content": [{"type": "text", "text": "Name another one."}]},
    ],
]


@pytest.fixture(scope="module")
def server_proc():
    args = [*CPU_ARGS, "--model", SMOLLM2, "--max-model-len", str(MAX_MODEL_LEN)]
    server = start_server(["--draft", "none", *args])
    yield server
    server.stop()
    assert not server.unhandled_errors(), server.log_tail()


@pytest.fixture(scope="module")
def server(server_proc, smollm2_tokenizer):  # the tokenizer loads while the server starts
    server_proc.wait_ready()
    return server_proc


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_tokenize_prompt_gives_the_tokenizers_ids(server, smollm2_tokenizer):
    tok = smollm2_tokenizer
    for prompt in [SENTENCE, "  leading spaces,\nnewlines\tand héllo wörld — 日本"]:
        r = _ok(_post(server, "/tokenize", {"model": SMOLLM2, "prompt": prompt}))
        assert r["tokens"] == tok.encode(prompt)  # add_special_tokens defaults to true
        assert r["count"] == len(r["tokens"]) > 0
        assert r["max_model_len"] == MAX_MODEL_LEN
        assert r["token_strs"] is None

        body = {"prompt": prompt, "add_special_tokens": False, "return_token_strs": True}
        r = _ok(_post(server, "/tokenize", body))  # model left out: the served one
        assert r["tokens"] == tok.encode(prompt, add_special_tokens=False)
        assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])

        # /v1/completions prompts with exactly these ids.
        gen = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        usage = _ok(_post(server, "/v1/completions", gen))["usage"]
        assert usage["prompt_tokens"] == r["count"]


def test_chat_tokenize_gives_the_ids_chat_completions_uses(server, smollm2_tokenizer):
    for messages in CONVERSATIONS:
        r = _ok(_post(server, "/tokenize", {"model": SMOLLM2, "messages": messages}))
        request = ChatCompletionRequest(messages=messages)
        assert r["tokens"] == chat_prompt_ids(smollm2_tokenizer, request)
        assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
        gen = {"model": SMOLLM2, "messages": messages, "max_tokens": 1, "temperature": 0}
        usage = _ok(_post(server, "/v1/chat/completions", gen))["usage"]
        assert usage["prompt_tokens"] == r["count"]

        # Without the generation prompt: the same conversation, minus the assistant header.
        body = {"messages": messages, "add_generation_prompt": False}
        bare = _ok(_post(server, "/tokenize", body))["tokens"]
        assert len(bare) < r["count"] and r["tokens"][: len(bare)] == bare

    # Content given as text parts tokenizes as the same text given as a string.
    text = CONVERSATIONS[0][0]["content"]
    parts = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    as_parts = _ok(_post(server, "/tokenize", {"messages": parts}))["tokens"]
    assert as_parts == _ok(_post(server, "/tokenize", {"messages": CONVERSATIONS[0]}))["tokens"]


def test_detokenize_inverts_tokenize(server, smollm2_tokenizer):
    ids = _ok(_post(server, "/tokenize", {"prompt": SENTENCE}))["tokens"]
    assert _ok(_post(server, "/detokenize", {"model": SMOLLM2, "tokens": ids})) == {
        "prompt": SENTENCE
    }
    # Special tokens are kept, as in vLLM: a chat prompt decodes to its template text.
    chat = _ok(_post(server, "/tokenize", {"messages": CONVERSATIONS[0]}))["tokens"]
    text = _ok(_post(server, "/detokenize", {"tokens": chat}))["prompt"]
    assert text == smollm2_tokenizer.decode(chat)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert _ok(_post(server, "/detokenize", {"tokens": []})) == {"prompt": ""}


def test_bad_ids_unknown_models_and_bad_bodies_get_openai_errors(server, smollm2_tokenizer):
    vocab = len(smollm2_tokenizer)
    assert _ok(_post(server, "/detokenize", {"tokens": [0, vocab - 1]}))["prompt"]
    for tokens, bad in [([10**9], 10**9), ([5, -1], -1), ([vocab], vocab)]:
        error = _error(_post(server, "/detokenize", {"tokens": tokens}), 400)
        assert str(bad) in error["message"] and f"[0, {vocab})" in error["message"]
        assert error["param"] == "tokens"

    for path, body in [
        ("/tokenize", {"model": "gpt-4", "prompt": "hi"}),
        ("/tokenize", {"model": "gpt-4", "messages": CONVERSATIONS[0]}),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}),
    ]:
        error = _error(_post(server, path, body), 404)
        assert "gpt-4" in error["message"] and SMOLLM2 in error["message"]
        assert error["code"] == "model_not_found"

    message = _error(_post(server, "/tokenize", {}), 400)["message"]
    assert "prompt" in message and "messages" in message
    assert "prompt" in _error(_post(server, "/tokenize", {"prompt": 5}), 400)["message"]
    assert "messages" in _error(_post(server, "/tokenize", {"messages": []}), 400)["message"]
    body = {"messages": CONVERSATIONS[0], "continue_final_message": True}
    assert _error(_post(server, "/tokenize", body), 400)["param"] == "continue_final_message"
    assert "tokens" in _error(_post(server, "/detokenize", {"tokens": "1 2"}), 400)["param"]

    paths = httpx.get(f"{server.url}/openapi.json", timeout=10).json()["paths"]
    assert {"/tokenize", "/detokenize"} <= set(paths)


def test_vllm_bench_openai_chat_requests_stream_the_greedy_text(server):
    """The body ``vllm bench serve --backend openai-chat`` sends, read the way its client
    reads it: text from each chunk's ``choices[0].delta.content``, the output length from
    the last chunk's ``usage.completion_tokens``."""
    n = 16
    messages = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}]
    body = {
        "model": SMOLLM2,
        "messages": messages,
        "temperature": 0.0,
        "max_completion_tokens": n,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    text, completion_tokens, prompt_tokens, done, chunks = "", None, None, False, 0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    for message in raw.split("\n\n"):
        message = message.strip()
        if not message or message.startswith(":"):
            continue
        data = message.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        assert not done, "a chunk after [DONE]"
        chunk = json.loads(data)
        if choices := chunk.get("choices"):
            chunks += 1
            text += choices[0]["delta"].get("content") or ""
        elif usage := chunk.get("usage"):
            completion_tokens = usage["completion_tokens"]
            prompt_tokens = usage["prompt_tokens"]
    assert done and chunks > 1

    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    response = _ok(_post(server, "/v1/chat/completions", plain))
    assert response["usage"]["completion_tokens"] == n
    assert text == response["choices"][0]["message"]["content"] and text
    assert completion_tokens == n
    assert prompt_tokens == _ok(_post(server, "/tokenize", {"messages": messages}))["count"]


def test_special_tokens_around_finds_a_bos_and_eos_template():
    """What add_special_tokens adds, on tokenizers that do add tokens (SmolLM2's adds none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "a": 3, "hello": 4, "world": 5}
    for template, expected in [("<s> $A", ([0], [])), ("<s> $A </s>", ([0], [1]))]:
        backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        backend.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("<s>", 0), ("</s>", 1)]
        )
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
        assert special_tokens_around(tokenizer) == expected
        prefix, suffix = expected
        bare = tokenizer.encode("hello world", add_special_tokens=False)
        assert [*prefix, *bare, *suffix] == tokenizer.encode("hello world")
