"""Tiny random models with SmolLM2's vocabulary (and tokenizer), for speculation tests:
fast to run, and wrong often enough that drafts get rejected."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_tiny_model_dir(
    out: Path,
    smollm2_dir: Path,
    seed: int,
    logit_scale: float = 1.0,
    vocab_size: int | None = None,
    num_layers: int = 2,
) -> Path:
    """A ``num_layers``-layer, 64-wide Llama in HF format with SmolLM2's config otherwise
    and its tokenizer files; ``logit_scale`` sharpens the (tied) embedding so logits are
    uneven; ``vocab_size`` narrows the logits (token ids then have to be taken modulo it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((smollm2_dir / "config.json").read_text())
    config.update(
        num_hidden_layers=num_layers,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    (out / "config.json").write_text(json.dumps(config))
    for f in smollm2_dir.iterdir():  # the tokenizer, so the engine can serve this dir
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            (out / f.name).write_bytes(f.read_bytes())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(logit_scale)
    model.save_pretrained(out)
    return out
