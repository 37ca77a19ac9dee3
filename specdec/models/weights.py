"""Fill a (materialized) ``CausalLM`` from an HF directory's safetensors shards.

Shards are memory-mapped and each tensor is copied straight into its parameter (or its
row range of a fused parameter), converting dtype and device on the way: peak host memory
stays near one tensor, not one checkpoint.

Directories we write with shards of at most 16 MB (``hf_save.save_hf_model``) store a
larger tensor as row slices ``<key>@0``, ``<key>@1``, ... that the index lists under
``metadata.split_tensors`` (the head checkpoints' convention, ``eagle3_formats``); they
are joined back here, so such a directory loads like any other.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.models.errors import WeightLoadError
from specdec.models.llama import CausalLM

# Checkpoint entries that carry no weights we need (old HF saves included RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX_FILE = "model.safetensors.index.json"
SPLIT_SEP = "@"


def split_tensors(hf_dir: Path) -> dict[str, int]:
    """Keys stored as row slices (key -> number of parts) per the directory's index."""
    index = Path(hf_dir) / INDEX_FILE
    if not index.is_file():
        return {}
    return (json.loads(index.read_text()).get("metadata") or {}).get("split_tensors") or {}


class _Reader:
    """``get(key)`` from memory-mapped shards, split tensors joined back (``used`` records
    the stored keys read)."""

    def __init__(self, handles: list, hf_dir: Path) -> None:
        self.where = {key: h for h in handles for key in h.keys()}  # noqa: SIM118 (not a dict)
        self.split = split_tensors(hf_dir)
        self.used: set[str] = set()

    def parts(self, key: str) -> list[str]:
        n = self.split.get(key, 0)
        return [f"{key}{SPLIT_SEP}{i}" for i in range(n)] if n else [key]

    def __contains__(self, key: str) -> bool:
        return all(p in self.where for p in self.parts(key))

    def get(self, key: str) -> torch.Tensor:
        names = self.parts(key)
        self.used.update(names)
        tensors = [self.where[n].get_tensor(n) for n in names]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def read_tensors(hf_dir: Path, keys: list[str]) -> dict[str, torch.Tensor | None]:
    """The named tensors of a directory (split ones joined), None for absent keys."""
    shards = sorted(Path(hf_dir).glob("*.safetensors"))
    with ExitStack() as stack:
        reader = _Reader(
            [stack.enter_context(safe_open(str(s), framework="pt")) for s in shards], Path(hf_dir)
        )
        return {k: reader.get(k) if k in reader else None for k in keys}


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
        reader = _Reader(handles, hf_dir)
        missing: list[str] = []
        with torch.no_grad():
            # named_parameters() lists a tied weight once, under embed_tokens.
            for name, param in model.named_parameters():
                row = 0
                for key, rows in model.checkpoint_layout(name):
                    if key not in reader:
                        missing.append(key)
                        row += rows
                        continue
                    tensor = reader.get(key)
                    expected = (rows, *param.shape[1:])
                    if tuple(tensor.shape) != expected:
                        raise WeightLoadError(
                            f"{key} in {hf_dir} has shape {tuple(tensor.shape)}; the model "
                            f"built from config.json expects {expected} (for {name}); the "
                            "config and the weights belong to different models"
                        )
                    param[row : row + rows].copy_(tensor)
                    row += rows
    if missing:
        raise WeightLoadError(
            f"{len(missing)} weights missing from {hf_dir}: {_preview(missing)}; "
            "the checkpoint is incomplete or for another architecture"
        )
    ignorable = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    unexpected = sorted(
        k
        for k in reader.where
        if k not in reader.used and k not in ignorable and not k.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise WeightLoadError(
            f"{len(unexpected)} unexpected weights in {hf_dir}: {_preview(unexpected)}; "
            "config.json does not describe these weights (wrong architecture or layer count?)"
        )


def _preview(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown if len(keys) <= limit else f"{shown}, ... ({len(keys) - limit} more)"
