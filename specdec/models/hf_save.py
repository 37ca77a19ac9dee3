"""Write a ``CausalLM`` as an HF model directory that ``specdec`` (``LLM``, ``generate``,
``load_model``) loads: config.json, safetensors shards, the tokenizer and chat template.

Fused parameters are split back into the HF projections (``checkpoint_layout``); a tied
model writes its embedding once. Shards hold at most ``max_shard_bytes`` (16 MB by
default, so they move between machines and sit in git); a larger tensor — SmolLM2's
49152 x 576 embedding is 57 MB in bf16 — is stored as row slices listed in the index's
``metadata.split_tensors``, the head checkpoints' convention. specdec joins them on load
(``weights.py``); HF transformers does not, so ``max_shard_bytes=None`` writes plain
HF shards (one file) for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specdec.models.llama import CausalLM

MAX_SHARD_BYTES = 16_000_000  # DESIGN.md: shards of at most 16 MB (decimal, not 16 MiB)
# Files of the source directory that travel with the weights (tokenizer, template).
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_tensors(model: CausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF checkpoint key -> contiguous CPU tensor in ``dtype``, in parameter order."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():  # a tied weight is listed once
        row = 0
        for key, rows in model.checkpoint_layout(name):
            tensors[key] = param.detach()[row : row + rows].to("cpu", dtype).contiguous()
            row += rows
    return tensors


def save_hf_model(
    model: CausalLM,
    out: str | Path,
    *,
    source_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int | None = MAX_SHARD_BYTES,
    extra_files: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` to ``out`` with config.json and tokenizer files from ``source_dir``
    (the directory it was loaded from). ``extra_files``: name -> JSON object written next
    to the weights (provenance). Returns ``out``."""
    from specdec.models.eagle3_formats import _write_shards  # one writer for heads and models

    out, source_dir = Path(out), Path(source_dir)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be saved; use one of {list(_DTYPE_NAMES)}")
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model, dtype)
    if max_shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        _write_shards(tensors, out, max_shard_bytes)
    config = json.loads((source_dir / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = _DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED:
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out / name)
    for name, obj in (extra_files or {}).items():
        (out / name).write_text(json.dumps(obj, indent=2) + "\n")
    return out
