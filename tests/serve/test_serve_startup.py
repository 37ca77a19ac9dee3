"""``specdec serve``'s start-up: the API process spawns the engine core before any heavy
import, the core builds its engine without the compiler stack, and the log names each
phase with its duration."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest
import torch
from serve_server import CPU_ARGS, running_server

from specdec.attention import get_attention_backend
from specdec.models.config import ModelConfig
from specdec.models.eagle3_head import Eagle3Config, Eagle3Head
from specdec.models.llama import CausalLM
from specdec.models.materialize import materialize

# Modules the API process has no use for before its engine core is running: the model
# stack, the HTTP stack (imported after the spawn), training and data generation.
HEAVY = (
    "torch",
    "transformers",
    "triton",
    "safetensors",
    "fastapi",
    "uvicorn",
    "datasets",
    "accelerate",
    "deepspeed",
    "wandb",
    "specdec.engine",
    "specdec.models.loader",
    "specdec.train.trainer",
    "specdec.train.loop",
    "specdec.data_gen.regenerate",
    "specdec.data_gen.dump",
)


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout


def test_the_api_process_spawns_the_core_before_any_heavy_import():
    """Parsing every command's flags, resolving the serve config and spawning the core
    (the default engine builder included) import none of ``HEAVY``: those imports cost
    seconds, and the core's own start should not wait for them."""
    code = (
        "import sys\n"
        "from specdec.cli import build_parser\n"
        "from specdec.serve.cli import serve_config_from_args\n"
        "args = build_parser().parse_args(['serve', '--device', 'cpu'])\n"
        "config = serve_config_from_args(args)\n"
        "from specdec.serve.core_client import ProcCoreClient\n"
        "core = ProcCoreClient(config.core_engine, wait=False)\n"
        f"heavy = [m for m in sys.modules if any(m == h or m.startswith(h + '.') "
        f"for h in {HEAVY!r})]\n"
        "core.process.kill()\n"
        "core.process.join(10)\n"
        "print(sorted(heavy))\n"
    )
    assert _run(code).strip() == "[]"


def test_an_engine_thread_imports_the_engine_before_the_tokenizer_thread_starts():
    """With the engine on a thread of the API process, ``launch`` imports the engine's
    modules before the tokenizer thread imports the tokenizer stack (specdec.models.loader
    imports specdec.attention too): imported from both threads at once, a package's
    __init__ and its submodules could deadlock on their module locks."""
    code = (
        "import sys\n"
        "import specdec.serve.launch as launch\n"
        "from specdec.cli import build_parser\n"
        "from specdec.serve.cli import serve_config_from_args\n"
        "seen = {}\n"
        "class Loader:\n"
        "    def __init__(self):\n"
        "        seen['engine'] = 'specdec.engine.llm_engine' in sys.modules\n"
        "launch.TokenizerLoader = Loader\n"
        "args = build_parser().parse_args(['serve', '--device', 'cpu', '--no-engine-process'])\n"
        "launch.launch(serve_config_from_args(args))\n"
        "print(seen)\n"
    )
    assert _run(code).strip() == "{'engine': True}"


def test_building_the_served_engine_on_cpu_imports_no_compiler():
    """The engine ``specdec serve --device cpu`` builds (target and shipped head from
    meta-device modules) compiles nothing, so it imports neither torch._dynamo nor sympy
    (~1 s of imports on CPU)."""
    code = (
        "import sys\n"
        "from specdec.cli import build_parser\n"
        "from specdec.serve.cli import serve_config_from_args\n"
        "from specdec.serve.engine_core import build_llm_engine\n"
        "args = build_parser().parse_args(\n"
        "    ['serve', '--device', 'cpu', '--kv-cache-memory', str(64 << 20)])\n"
        "engine = build_llm_engine(serve_config_from_args(args).core_engine)\n"
        "assert engine.proposer is not None\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy') "
        "if m in sys.modules))\n"
    )
    assert _run(code).strip() == "[]"


def test_process_age_counts_from_the_interpreter_start():
    """Start-up logs count from the process's start, interpreter and imports included."""
    code = (
        "import time\n"
        "time.sleep(0.5)\n"
        "from specdec.serve.launch import process_age\n"
        "print(process_age())\n"
    )
    assert 0.5 <= float(_run(code)) < 30


_TINY = ModelConfig.from_hf(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
)


def _layout(module: torch.nn.Module) -> dict[str, tuple]:
    params = {
        n: (tuple(p.shape), p.dtype, p.device.type, p.requires_grad, "param")
        for n, p in module.named_parameters(remove_duplicate=False)
    }
    buffers = {
        n: (tuple(b.shape), b.dtype, b.device.type, False, "buffer")
        for n, b in module.named_buffers(remove_duplicate=False)
    }
    return {**params, **buffers}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_materialize_lays_out_what_to_empty_does(dtype: torch.dtype):
    backend = get_attention_backend("torch")
    builders = [
        lambda: CausalLM(_TINY, backend, max_positions=32),
        lambda: Eagle3Head(Eagle3Config.for_target(_TINY, 32), backend, max_positions=32),
    ]
    for build in builders:
        with torch.device("meta"):
            ours, reference = build(), build()
        materialize(ours, dtype, "cpu")
        reference = reference.to(dtype=dtype).to_empty(device="cpu")
        assert _layout(ours) == _layout(reference)
        assert ours.state_dict().keys() == reference.state_dict().keys()  # persistence
        assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])
        # Non-float buffers (the head's draft vocabulary maps) keep their dtype.
        assert {b.dtype for b in ours.buffers()} == {b.dtype for b in reference.buffers()}


@pytest.mark.parametrize(
    "args",
    [[], ["--no-engine-process", "--draft", "none"]],
    ids=["engine process", "engine thread"],
)
def test_the_server_log_times_each_start_up_phase(args: list[str]):
    with running_server([*CPU_ARGS, "--log-level", "info", *args]) as server:
        body = {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        log = server.log.read_text()
    phases = [
        r"starting the engine core for smollm2-135m-instruct \(.*\) [\d.]+ s after launch",
        r"loaded the target's weights \(\d+ MiB, float32 on cpu\) in [\d.]+ s",
        r"loaded the tokenizer in [\d.]+ s",
        r"ready [\d.]+ s after launch; event loop (uvloop|asyncio), HTTP parser (httptools|h11)",
    ]
    if not args:
        phases += [
            r"imported the model code \(torch\) and resolved .* in [\d.]+ s",
            r"loaded the EAGLE-3 head .* in [\d.]+ s",
            r"built the engine in [\d.]+ s",
            r"engine core ready [\d.]+ s after its start",
        ]
    for phase in phases:
        assert re.search(phase, log), f"{phase!r} missing from the log:\n{log}"
