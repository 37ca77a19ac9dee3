"""Fill a (materialized) ``CausalLM`` from an HF directory's safetensors shards.

Shards are memory-mapped and each tensor is copied straight into its parameter (or its
row range of a fused parameter), converting dtype and device on the way: peak host memory
stays near one tensor, not one checkpoint.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.models.llama import CausalLM

# Checkpoint entries that carry no weights we need (old HF saves included RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """The checkpoint does not match the model built from its config.json."""


def load_safetensors_weights(model: CausalLM, hf_dir: Path) -> None:
    """Copy every parameter of ``model`` from ``hf_dir/*.safetensors``.

    Raises ``WeightLoadError`` naming the keys on a missing key, an unexpected key or a
    shape mismatch. A tied model accepts (and ignores) a stored ``lm_head.weight``.
    """
    shards = sorted(hf_dir.glob("*.safetensors"))
    if not shards:
        raise WeightLoadError(f"no *.safetensors files in {hf_dir}")
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(s), framework="pt")) for s in shards]
        where = {key: h for h in handles for key in h.keys()}  # noqa: SIM118 (not a dict)
        used: set[str] = set()
        missing: list[str] = []
        with torch.no_grad():
            # named_parameters() lists a tied weight once, under embed_tokens.
            for name, param in model.named_parameters():
                row = 0
                for key, rows in model.checkpoint_layout(name):
                    if key not in where:
                        missing.append(key)
                        row += rows
                        continue
                    tensor = where[key].get_tensor(key)
                    expected = (rows, *param.shape[1:])
                    if tuple(tensor.shape) != expected:
                        raise WeightLoadError(
                            f"{key} in {hf_dir} has shape {tuple(tensor.shape)}; the model "
                            f"built from config.json expects {expected} (for {name}); the "
                            "config and the weights belong to different models"
                        )
                    param[row : row + rows].copy_(tensor)
                    used.add(key)
                    row += rows
    if missing:
        raise WeightLoadError(
            f"{len(missing)} weights missing from {hf_dir}: {_preview(missing)}; "
            "the checkpoint is incomplete or for another architecture"
        )
    ignorable = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    unexpected = sorted(
        k
        for k in where
        if k not in used and k not in ignorable and not k.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise WeightLoadError(
            f"{len(unexpected)} unexpected weights in {hf_dir}: {_preview(unexpected)}; "
            "config.json does not describe these weights (wrong architecture or layer count?)"
        )


def _preview(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown if len(keys) <= limit else f"{shown}, ... ({len(keys) - limit} more)"
