"""EAGLE-3 head checkpoints: ours, the EAGLE/SpecForge research format, speculators.

Facts this module relies on (read from the public sources named):

- Research format (SafeAILab/EAGLE ``eagle/model/cnets.py``, ``eagle/traineagle3/config.json``;
  sgl-project/SpecForge ``configs/llama3-8B-eagle3.json``): an HF Llama ``config.json`` with
  ``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, ``vocab_size``
  = the *target* vocabulary and ``draft_vocab_size``; EAGLE's own configs carry no RoPE
  theta (HF Llama's default 10000 applies) and no aux-layer ids, because EAGLE hard-codes
  the residual stream entering layers (2, N//2, N-3) (``eagle/model/modeling_llama_kv.py``).
  Weight keys: ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
  ``fc.weight`` [H, 3H], ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t``
  int64 [draft_vocab], ``t2d`` bool [target_vocab]; SpecForge exports may add the frozen
  ``embed_tokens.weight`` (``specforge/export/to_hf.py``). EAGLE's loader opens exactly one
  ``model.safetensors`` (or ``pytorch_model.bin``) (``eagle/model/ea_model.py``).
- Aux-layer ids. SpecForge writes ``eagle_config: {eagle_aux_hidden_state_layer_ids,
  use_aux_hidden_state}`` by *output* index, default [1, N//2-1, N-4]
  (``specforge/algorithms/model_providers.py``, ``configs/qwen3-235B-A22B-eagle3.json``);
  SGLang adds 1 when it reads them ("the ith layer takes the output of the (i-1)th").
  vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` first, then
  ``eagle_config``'s, and uses either *as is* as the residual entering those layers, default
  (2, N//2, N-3) (vllm ``v1/worker/gpu_model_runner.py``, ``models/llama.py``). So the
  nested field means different layers to vLLM and SGLang. We read a top-level list in
  vLLM's numbering and the nested one in SGLang's, and write both where both are wanted.
- speculators (vllm-project/speculators ``models/eagle3/config.py``, ``config.py``,
  ``convert/eagle/eagle3_converter.py``; vllm ``transformers_utils/configs/speculators/
  algos.py``): ``speculators_model_type: "eagle3"``, ``architectures: ["Eagle3Speculator"]``,
  ``transformer_layer_config`` (an HF Llama config; its ``vocab_size`` is the target's),
  ``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` (vLLM numbering; speculators' default is also
  [2, N//2, N-3]), ``norm_before_fc``/``fc_norm``/``norm_output`` (the variants, below), and
  ``speculators_config: {algorithm, proposal_methods: [{proposal_type: "greedy",
  speculative_tokens, ...}], default_proposal_method, verifier: {name_or_path,
  architectures}}``. Keys: ``layers.0.*`` instead of ``midlayer.*``, otherwise as above.
  vLLM assumes ``norm_before_residual: true`` when the field is absent, the speculators
  library false; we always write it and read an absent one as the library's false.

- EAGLE-3.1 and speculators' variant (vllm ``model_executor/models/llama_eagle3.py``,
  ``transformers_utils/configs/speculators/algos.py``; SpecForge
  ``configs/qwen3-30B-A3B-eagle3.1.json``): top-level booleans ``fc_norm`` (one RMSNorm
  per aux state before ``fc``, weights ``fc_norm.{0,1,2}.weight`` [H]), ``norm_output``
  (the next draft step reads the post-norm output; no weights) and ``norm_before_fc`` (one
  RMSNorm over the 3H concatenation, ``input_norm.weight`` [3H]; vLLM also reads it from
  ``eagle_config``); absent means false in every reader. The architecture and method
  stay EAGLE-3's. We write each flag in every format (false included in speculators',
  whose readers take all three) and read them from either place.

Formats here:

- ``"specdec"`` (ours) and ``"eagle"`` share the research layout and one code path. Ours adds
  to config.json the top-level vLLM-numbered ids, ``target_model`` and ``tree_defaults``,
  and writes shards of at most 16 MB: a tensor larger than a shard is split by rows into
  keys ``"<key>@<part>"`` that ``model.safetensors.index.json`` lists under
  ``metadata.split_tensors``. Heads small enough to need no split are byte-compatible with
  the research loaders; bigger ones need ``load_eagle3`` or an ``"eagle"`` export.
- ``"eagle"`` writes one ``model.safetensors`` and only the fields the research tools read.
- ``"speculators"`` writes one ``model.safetensors`` with ``layers.0.*`` keys.

Deeper heads (``Eagle3Config.num_layers`` > 1; vLLM's ``llama_eagle3.py`` builds
``num_hidden_layers`` layers, the first reading ``cat(embed, hidden)``, the rest plain
H-wide Llama layers on the same residual stream, weights ``layers.<i>.*``): config.json's
``num_hidden_layers`` says how many; the layers after the first are stored as
``layers.1.*``, ``layers.2.*``, ... in every format (vLLM maps ``midlayer.*`` to its
``layers.0.*`` and loads the rest by name). SGLang and EAGLE build exactly one layer
(SGLang raises "EAGLE3 currently only supports 1 layer"), so ``"eagle"`` refuses them.

SpecExit channels (``Eagle3Config.exit_signals``) exist only in ours: config.json lists
them as ``spec_exit_signals`` and the weights add ``spec_exit.weight`` [k, 3H] and
``spec_exit.bias`` [k]; the SpecExit setting measured best for the head, if recorded, is
``spec_exit_defaults`` (``Eagle3Config.spec_exit_defaults``: some ``SpecExitParams``
fields, written only when set). ``"eagle"`` and ``"speculators"`` have no place for them,
so ``save_eagle3`` drops them there (``dropped_keys`` says which) and records that in the
safetensors metadata (``specdec_dropped``), which every reader ignores.

The token embedding is never written; a stored ``embed_tokens.weight`` (the frozen target
embedding in SpecForge and speculators exports) is ignored on load. Loading reads
safetensors only, never ``torch.load``.

Inspection without loading (``specdec.interop``'s validator builds on these):
``tensor_infos`` reads shapes and dtypes from the file headers, ``checkpoint_shapes`` gives
the shape every key must have for a config, ``stored_dtype`` the dtype a lossless
conversion keeps, ``to_speculators_key``/``from_speculators_key`` map the key layouts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.attention.base import AttentionBackend, get_attention_backend
from specdec.models.config import ModelConfig
from specdec.models.eagle3_head import Eagle3Config, Eagle3Head, default_aux_layer_ids
from specdec.models.materialize import materialize
from specdec.models.rope import rope_from_hf
from specdec.models.tree_defaults import TreeDefaults
from specdec.models.weights import WeightLoadError

Eagle3Format = Literal["specdec", "eagle", "speculators"]

MAX_SHARD_BYTES = 16_000_000  # DESIGN.md: shards of at most 16 MB (decimal, not 16 MiB)
ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SPLIT_SEP = "@"
EXIT_PREFIX = "spec_exit."  # stored keys of the SpecExit channels (ours only)
# Eagle3Config's variant switches, as config.json names them (module docstring).
VARIANT_FLAGS = ("fc_norm", "norm_output", "norm_before_fc")
# Stored keys we accept and drop: the frozen target embedding some exporters include.
_IGNORED_KEYS = frozenset({"embed_tokens.weight"})
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# safetensors header dtype names -> torch dtypes (those a head can hold).
_SAFETENSORS_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
# Per-tensor and per-file allowance for the safetensors JSON header inside a shard budget.
_HEADER_PER_TENSOR, _HEADER_PER_FILE = 256, 1024


# ----------------------------------------------------------------- aux-layer ids


def entering_to_output_ids(ids: Sequence[int], num_layers: int | None = None) -> list[int]:
    """vLLM numbering (residual entering layer i) -> SGLang/SpecForge numbering (output of
    layer i - 1): (2, N//2, N-3) -> [1, N//2-1, N-4]. ``num_layers`` checks the range."""
    if num_layers is not None:
        _check_ids(ids, 0, num_layers, "vLLM (entering-layer)", num_layers)
    return [i - 1 for i in ids]


def output_to_entering_ids(ids: Sequence[int], num_layers: int | None = None) -> tuple[int, ...]:
    """SGLang/SpecForge numbering (output of layer i; -1 = the embeddings) -> vLLM
    numbering (residual entering layer i + 1). ``num_layers`` checks the range."""
    if num_layers is not None:
        _check_ids(ids, -1, num_layers - 1, "SGLang (output-index)", num_layers)
    return tuple(i + 1 for i in ids)


def _check_ids(ids: Sequence[int], low: int, high: int, convention: str, num_layers: int) -> None:
    bad = [i for i in ids if not isinstance(i, int) or not low <= i < high]
    if bad:
        raise ValueError(
            f"aux layer ids {list(ids)} in {convention} numbering include {bad}, outside "
            f"[{low}, {high}) for a {num_layers}-layer target"
        )


# ----------------------------------------------------------------------- saving


def save_eagle3(
    head: Eagle3Head,
    directory: str | Path,
    format: Eagle3Format = "specdec",
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write ``head`` to a new (or empty) ``directory`` in ``format``; returns the path.

    ``max_shard_bytes`` bounds each file of the ``"specdec"`` format; the other two write
    a single ``model.safetensors``, as their loaders expect.
    """
    if format not in get_args(Eagle3Format):
        raise ValueError(
            f"unknown EAGLE-3 format {format!r}; choose one of {get_args(Eagle3Format)}"
        )
    if format == "eagle" and head.config.num_layers > 1:
        raise ValueError(
            f"the head has {head.config.num_layers} decoder layers; the research format's "
            "readers (SGLang, EAGLE) build exactly one, so it cannot hold them: save it as "
            "specdec or export it for vLLM (speculators)"
        )
    out = Path(directory)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} is not empty; save each checkpoint to a new directory (stale shards "
            "would be read back with the new ones)"
        )
    out.mkdir(parents=True, exist_ok=True)
    tensors = _checkpoint_tensors(head)
    metadata = {"format": "pt"}
    dropped = dropped_keys(head, format)
    if dropped:  # other engines run the head without its SpecExit channels
        tensors = {k: t for k, t in tensors.items() if k not in dropped}
        metadata["specdec_dropped"] = "SpecExit channels " + ", ".join(head.config.exit_signals)
    dtype = _DTYPE_NAMES.get(head.lm_head.weight.dtype, str(head.lm_head.weight.dtype))
    if format == "speculators":
        config = _speculators_config(head.config, dtype)
        tensors = {to_speculators_key(k): t for k, t in tensors.items()}
    else:
        config = _research_config(head.config, dtype, ours=format == "specdec")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if format == "specdec":
        _write_shards(tensors, out, max_shard_bytes)
    else:
        save_file(tensors, str(out / SINGLE_FILE), metadata=metadata)
    return out


def dropped_keys(head: Eagle3Head, format: Eagle3Format) -> list[str]:
    """Research-format keys of ``head`` that ``format`` cannot hold: its SpecExit
    channels, outside our own format."""
    if format == "specdec":
        return []
    return [name for name, _ in head.named_parameters() if name.startswith(EXIT_PREFIX)]


def _checkpoint_tensors(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """Research-format key -> contiguous CPU tensor (fused parameters split apart)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in head.named_parameters():
        row = 0
        for key, rows in head.checkpoint_layout(name):
            tensors[key] = param.detach()[row : row + rows].to("cpu").contiguous().clone()
            row += rows
    tensors["d2t"] = head.d2t.detach().to("cpu").clone()
    tensors["t2d"] = head.t2d.detach().to("cpu").clone()
    return tensors


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, limit: int) -> None:
    """Pack tensors in order into files of at most ``limit`` bytes, splitting by rows any
    tensor that would not fit in an empty file."""
    budget = limit - _HEADER_PER_FILE
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    split: dict[str, int] = {}

    def cost(key: str, t: torch.Tensor) -> int:
        return t.numel() * t.element_size() + _HEADER_PER_TENSOR + len(key)

    for key, tensor in tensors.items():
        if cost(key, tensor) <= budget:
            if used + cost(key, tensor) > budget:
                shards.append({})
                used = 0
            shards[-1][key] = tensor
            used += cost(key, tensor)
            continue
        row_bytes = tensor[:1].numel() * tensor.element_size()
        overhead = _HEADER_PER_TENSOR + len(key) + 8
        if row_bytes + overhead > budget:
            raise ValueError(
                f"one row of {key} {tuple(tensor.shape)} takes {row_bytes} bytes; "
                f"max_shard_bytes={limit} cannot hold it, raise the limit"
            )
        start, part = 0, 0
        while start < tensor.shape[0]:
            fit = (budget - used - overhead) // row_bytes
            if fit <= 0:
                shards.append({})
                used = 0
                continue
            end = min(tensor.shape[0], start + fit)
            shards[-1][f"{key}{_SPLIT_SEP}{part}"] = tensor[start:end].clone()
            used += (end - start) * row_bytes + overhead
            start, part = end, part + 1
        split[key] = part
    shards = [s for s in shards if s]
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        if (out / name).stat().st_size > limit:  # the header allowance is a bound: a bug
            raise RuntimeError(f"{name} exceeds max_shard_bytes={limit}")
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total, "split_tensors": split}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _llama_layer_fields(c: Eagle3Config, dtype: str) -> dict[str, Any]:
    """The HF Llama config fields of the head's decoder layers."""
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def _research_config(c: Eagle3Config, dtype: str, *, ours: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        **_llama_layer_fields(c, dtype),
        "draft_vocab_size": c.draft_vocab_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": entering_to_output_ids(c.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }
    if c.norm_before_residual:
        config["norm_before_residual"] = True
    for flag in VARIANT_FLAGS:
        if getattr(c, flag):
            config[flag] = True
    if ours:
        config["eagle_aux_hidden_state_layer_ids"] = list(c.aux_layer_ids)
        config["target_model"] = c.target_name
        config["tree_defaults"] = asdict(c.tree) if c.tree else None
        if c.exit_signals:
            config["spec_exit_signals"] = list(c.exit_signals)
        if c.spec_exit_defaults:
            config["spec_exit_defaults"] = dict(c.spec_exit_defaults)
    return config


def _speculators_config(c: Eagle3Config, dtype: str) -> dict[str, Any]:
    steps = c.tree.num_speculative_tokens if c.tree else 3
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": steps,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": c.target_name or None, "architectures": []},
        },
        "transformer_layer_config": _llama_layer_fields(c, dtype),
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,  # vLLM's default differs: write it
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        **{flag: getattr(c, flag) for flag in VARIANT_FLAGS},
        "torch_dtype": dtype,
    }


def to_speculators_key(key: str) -> str:
    return "layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key


def from_speculators_key(key: str) -> str:
    return "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key


# ---------------------------------------------------------------------- loading


def detect_format(directory: str | Path) -> Eagle3Format:
    """Which of the three formats ``directory/config.json`` is written in."""
    path = Path(directory)
    return _detect(_read_config(path), path)


def read_eagle3_config(directory: str | Path, target_config: ModelConfig) -> Eagle3Config:
    """The head config of a checkpoint in any format, checked against its target."""
    path = Path(directory)
    hf = _read_config(path)
    return _to_config(hf, _detect(hf, path), target_config, path)


def load_eagle3(
    directory: str | Path,
    *,
    target_config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attention: AttentionBackend | str = "torch",
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    max_positions: int | None = None,
) -> Eagle3Head:
    """Load a head in any of the three formats (detected from config.json).

    Aux ids are converted to vLLM numbering and checked against ``target_config``; hidden
    size and vocabulary must be the target's. Every weight's shape is checked, missing and
    unexpected keys are errors, and the vocab map is validated (``validate_vocab_map``);
    without ``d2t``/``t2d`` the draft vocabulary must be the whole target vocabulary.
    ``embed`` is the target's embedding (or bind it later); ``max_positions`` (default the
    target's ``max_context_len``) sizes the RoPE table.
    """
    path = Path(directory)
    hf = _read_config(path)
    fmt = _detect(hf, path)
    config = _to_config(hf, fmt, target_config, path)
    tensors = _read_tensors(path)
    if fmt == "speculators":
        tensors = {from_speculators_key(k): t for k, t in tensors.items()}
    backend = get_attention_backend(attention) if isinstance(attention, str) else attention
    with torch.device("meta"):
        head = Eagle3Head(
            config, backend, max_positions=max_positions or target_config.max_context_len
        )
    # Materialize uninitialized, then fill every parameter and buffer from the checkpoint.
    materialize(head, dtype, device)
    head.rotary.build_cache()
    _fill_head(head, tensors, path)
    head.bind_embedding(embed)
    return head


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise WeightLoadError(f"{path} has no config.json; it is not an EAGLE-3 head directory")
    return json.loads(config_file.read_text())


def _detect(hf: dict[str, Any], path: Path) -> Eagle3Format:
    if "speculators_config" in hf or "speculators_model_type" in hf:
        kind = hf.get("speculators_model_type")
        algorithm = (hf.get("speculators_config") or {}).get("algorithm")
        if kind != "eagle3" or algorithm not in (None, "eagle3"):
            raise WeightLoadError(
                f"{path} is a speculators {kind!r}/{algorithm!r} checkpoint; only eagle3 "
                "heads load here"
            )
        return "speculators"
    archs = hf.get("architectures") or []
    if archs != [ARCHITECTURE]:
        raise WeightLoadError(
            f"{path}/config.json names architectures={archs}; an EAGLE-3 head needs "
            f"[{ARCHITECTURE!r}] or a speculators eagle3 config"
        )
    return "specdec" if "target_model" in hf or "tree_defaults" in hf else "eagle"


def _to_config(
    hf: dict[str, Any], fmt: Eagle3Format, target: ModelConfig, path: Path
) -> Eagle3Config:
    if fmt == "speculators":
        return _speculators_to_config(hf, target, path)
    return _research_to_config(hf, target, path)


def _research_to_config(hf: dict[str, Any], target: ModelConfig, path: Path) -> Eagle3Config:
    eagle = hf.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise WeightLoadError(
            f"{path}: eagle_config.use_aux_hidden_state=false (an EAGLE-1/2-style head); "
            "EAGLE-3 heads fuse three aux layers"
        )
    top, nested = (
        hf.get("eagle_aux_hidden_state_layer_ids"),
        eagle.get("eagle_aux_hidden_state_layer_ids"),
    )
    ids = tuple(top) if top else None
    if nested:
        try:
            from_nested = output_to_entering_ids(nested, target.num_layers)
        except ValueError as err:
            raise WeightLoadError(f"{path}: eagle_config: {err}") from err
        if ids is not None and ids != from_nested:
            raise WeightLoadError(
                f"{path}: eagle_aux_hidden_state_layer_ids={list(ids)} (vLLM numbering) and "
                f"eagle_config's {list(nested)} (SGLang numbering, = {list(from_nested)}) "
                "disagree; fix or drop one"
            )
        ids = from_nested
    try:
        tree = TreeDefaults(**hf["tree_defaults"]) if hf.get("tree_defaults") else None
    except (TypeError, ValueError) as err:
        raise WeightLoadError(f"{path}: tree_defaults {hf['tree_defaults']}: {err}") from err
    return _layer_to_config(
        hf,
        hf,
        target,
        path,
        ids=ids,
        target_name=hf.get("target_model") or "",
        tree=tree,
        exit_signals=tuple(hf.get("spec_exit_signals") or ()),
        spec_exit_defaults=hf.get("spec_exit_defaults"),
    )


def _speculators_to_config(hf: dict[str, Any], target: ModelConfig, path: Path) -> Eagle3Config:
    spec = hf.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or []
    steps = methods[0].get("speculative_tokens") if methods else None
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    return _layer_to_config(
        hf.get("transformer_layer_config") or {},
        hf,
        target,
        path,
        ids=tuple(ids) if ids else None,
        target_name=(spec.get("verifier") or {}).get("name_or_path") or "",
        tree=TreeDefaults("chain", steps) if steps else None,
    )


def _layer_to_config(
    layer: dict[str, Any],
    top: dict[str, Any],
    target: ModelConfig,
    path: Path,
    *,
    ids: tuple[int, ...] | None,
    target_name: str,
    tree: TreeDefaults | None,
    exit_signals: tuple[str, ...] = (),
    spec_exit_defaults: dict[str, Any] | None = None,
) -> Eagle3Config:
    """An ``Eagle3Config`` from HF Llama fields (``layer``) and EAGLE-3 fields (``top``),
    checked against ``target``; ``ids`` None means the target's default aux layers."""

    def fail(what: str) -> WeightLoadError:
        return WeightLoadError(f"{path}/config.json: {what}")

    num_layers = layer.get("num_hidden_layers", 1)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise fail(f"num_hidden_layers={num_layers!r}; the head has one or more layers")
    if layer.get("hidden_act", "silu") != "silu" or layer.get("mlp_bias"):
        raise fail("the head's MLP is SiLU-gated without bias")
    if layer.get("attention_bias"):
        raise fail("attention_bias=true is not supported; the head's projections have no bias")
    try:
        hidden, heads, vocab = (
            layer["hidden_size"],
            layer["num_attention_heads"],
            layer["vocab_size"],
        )
        if top.get("target_hidden_size") not in (None, hidden):
            raise ValueError(
                f"target_hidden_size={top['target_hidden_size']} differs from hidden_size="
                f"{hidden}; the head shares the target's embedding, so the two must match"
            )
        if hidden != target.hidden_size or vocab != target.vocab_size:
            raise ValueError(
                f"hidden_size={hidden}, vocab_size={vocab} but the target has "
                f"{target.hidden_size}, {target.vocab_size}; this head is for another target"
            )
        ids = ids or default_aux_layer_ids(target.num_layers)
        _check_ids(ids, 0, target.num_layers, "vLLM (entering-layer)", target.num_layers)
        return Eagle3Config(
            **hf_decoder_fields(layer, hidden, heads, vocab),
            draft_vocab_size=top.get("draft_vocab_size") or vocab,
            aux_layer_ids=tuple(ids),
            target_name=target_name,
            tree=tree,
            norm_before_residual=bool(top.get("norm_before_residual", False)),
            **_variant_flags(top),
            exit_signals=exit_signals,
            spec_exit_defaults=spec_exit_defaults,
            num_layers=num_layers,
        )
    except KeyError as err:
        raise fail(f"missing field {err}") from err
    except ValueError as err:
        raise fail(str(err)) from err


def hf_decoder_fields(hf: dict[str, Any], hidden: int, heads: int, vocab: int) -> dict[str, Any]:
    """A draft model's decoder-shape config fields (widths, heads, norm eps, RoPE,
    vocabulary) from its HF-style config dict, HF's defaults where a field is absent;
    ``hidden``, ``heads`` and ``vocab`` as the caller read and checked them."""
    theta, scaling = rope_from_hf(hf)
    return dict(
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        vocab_size=vocab,
    )


def _variant_flags(top: dict[str, Any]) -> dict[str, bool]:
    """The variant switches of a config.json's EAGLE-3 fields (``eagle_config`` too, where
    vLLM also reads ``norm_before_fc``); raises on a value that is not a boolean."""
    nested = top.get("eagle_config") or {}
    flags = {}
    for flag in VARIANT_FLAGS:
        value = top.get(flag, nested.get(flag, False))
        if not isinstance(value, bool):
            raise ValueError(f"{flag}={value!r}; it is true or false")
        flags[flag] = value
    return flags


@dataclass(frozen=True)
class WeightFiles:
    """Where a checkpoint's tensors are: its safetensors ``files`` (sorted) and the keys
    ``split`` by rows into ``<key>@<part>`` parts (key -> number of parts; ours only)."""

    files: list[Path]
    split: dict[str, int]


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor as its file header describes it (split parts already joined)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    files: tuple[str, ...]  # the file(s) holding it


def weight_files(directory: str | Path) -> WeightFiles:
    """The safetensors files of a checkpoint directory (an index's, else every
    ``*.safetensors``); raises naming any pickled weights found instead."""
    path = Path(directory)
    index_file = path / INDEX_FILE
    split: dict[str, int] = {}
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        files = sorted({path / f for f in index["weight_map"].values()})
        split = (index.get("metadata") or {}).get("split_tensors") or {}
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = (
            f" (found {pickles}: convert them once with safetensors.torch.save_file("
            "torch.load(f, weights_only=True), ...))"
            if pickles
            else ""
        )
        raise WeightLoadError(
            f"no safetensors weights in {path}; specdec loads only safetensors{hint}"
        )
    return WeightFiles(files, split)


def tensor_infos(directory: str | Path) -> dict[str, TensorInfo]:
    """Shape, dtype and file of every stored tensor, read from the file headers only (no
    tensor data), split tensors joined back under their key; stored keys as they are."""
    path = Path(directory)
    where = weight_files(path)
    infos: dict[str, TensorInfo] = {}
    for file in where.files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (not a dict)
                if key in infos:
                    raise WeightLoadError(f"{key} is stored twice in {path}; remove one copy")
                part = handle.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(part.get_dtype())
                if dtype is None:
                    raise WeightLoadError(
                        f"{key} in {file} has unsupported dtype {part.get_dtype()}"
                    )
                infos[key] = TensorInfo(tuple(part.get_shape()), dtype, (file.name,))
    for key, parts in where.split.items():
        names = [f"{key}{_SPLIT_SEP}{i}" for i in range(parts)]
        missing = [n for n in names if n not in infos]
        if missing:
            raise WeightLoadError(f"{path}: parts {missing} of the split tensor {key} are missing")
        pieces = [infos.pop(n) for n in names]
        rows = sum(p.shape[0] for p in pieces)
        files = tuple(dict.fromkeys(f for p in pieces for f in p.files))
        infos[key] = TensorInfo((rows, *pieces[0].shape[1:]), pieces[0].dtype, files)
    return infos


def stored_dtype(directory: str | Path) -> torch.dtype:
    """The floating dtype of a checkpoint's weights (the most common one among its
    floating tensors): what a lossless import or export keeps."""
    counts: dict[torch.dtype, int] = {}
    for info in tensor_infos(directory).values():
        if info.dtype.is_floating_point:
            counts[info.dtype] = counts.get(info.dtype, 0) + 1
    if not counts:
        raise WeightLoadError(f"{directory} stores no floating-point weights")
    return max(counts, key=lambda d: counts[d])


def checkpoint_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Research-format key -> the shape a head of ``config`` stores under it (``d2t``
    [draft_vocab], ``t2d`` [target_vocab] included): the layout ``load_eagle3`` checks."""
    with torch.device("meta"):
        head = Eagle3Head(config, get_attention_backend("torch"), max_positions=1)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in head.named_parameters():
        for key, rows in head.checkpoint_layout(name):
            shapes[key] = (rows, *param.shape[1:])
    shapes["d2t"] = tuple(head.d2t.shape)
    shapes["t2d"] = tuple(head.t2d.shape)
    return shapes


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor by key, split tensors (``<key>@<part>``) joined back."""
    where = weight_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in where.files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (not a dict)
                if key in tensors:
                    raise WeightLoadError(f"{key} is stored twice in {path}; remove one copy")
                tensors[key] = handle.get_tensor(key)
    for key, parts in where.split.items():
        names = [f"{key}{_SPLIT_SEP}{i}" for i in range(parts)]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise WeightLoadError(f"{path}: parts {missing} of the split tensor {key} are missing")
        tensors[key] = torch.cat([tensors.pop(n) for n in names])
    return tensors


def fill_by_layout(
    module: torch.nn.Module, tensors: dict[str, torch.Tensor], path: Path
) -> tuple[set[str], list[str]]:
    """Copy every parameter of ``module`` from ``tensors`` by its ``checkpoint_layout``
    (one or more stored keys stacked by rows), each shape checked. Returns the keys used
    and the keys missing; the caller decides what else it reads (d2t/t2d) and reports."""
    used: set[str] = set()
    missing: list[str] = []
    with torch.no_grad():
        for name, param in module.named_parameters():
            row = 0
            for key, rows in module.checkpoint_layout(name):
                if key not in tensors:
                    missing.append(key)
                else:
                    _check_shape(tensors[key], (rows, *param.shape[1:]), key, path)
                    param[row : row + rows].copy_(tensors[key])
                    used.add(key)
                row += rows
    return used, missing


def _fill_head(head: Eagle3Head, tensors: dict[str, torch.Tensor], path: Path) -> None:
    used, missing = fill_by_layout(head, tensors, path)
    with torch.no_grad():
        if ("d2t" in tensors) != ("t2d" in tensors):
            raise WeightLoadError(f"{path} stores only one of d2t/t2d; the two come together")
        if "d2t" in tensors:
            d2t, t2d = tensors["d2t"], tensors["t2d"]
            _check_shape(d2t, tuple(head.d2t.shape), "d2t", path)
            _check_shape(t2d, tuple(head.t2d.shape), "t2d", path)
            if d2t.is_floating_point() or t2d.is_floating_point():
                raise WeightLoadError(
                    f"{path}: d2t ({d2t.dtype}) and t2d ({t2d.dtype}) must be integer/bool"
                )
            try:
                head.set_vocab_map(d2t.to(torch.int64), t2d.to(torch.bool))
            except ValueError as err:
                raise WeightLoadError(f"{path}: invalid draft vocabulary: {err}") from err
            used.update(("d2t", "t2d"))
        elif head.config.draft_vocab_size != head.config.vocab_size:
            missing.append("d2t, t2d")
        else:  # the full target vocabulary: the identity map (EAGLE drops d2t/t2d then)
            head.d2t.zero_()
            head.t2d.fill_(True)
    if missing:
        raise WeightLoadError(
            f"{len(missing)} weights missing from {path}: {', '.join(missing[:6])}; the "
            "checkpoint is incomplete or not an EAGLE-3 head"
        )
    unexpected = sorted(set(tensors) - used - _IGNORED_KEYS)
    if unexpected:
        raise WeightLoadError(
            f"{len(unexpected)} unexpected weights in {path}: {', '.join(unexpected[:6])}; "
            "config.json does not describe them (another EAGLE variant?)"
        )


def _check_shape(tensor: torch.Tensor, expected: tuple[int, ...], key: str, path: Path) -> None:
    if tuple(tensor.shape) != expected:
        raise WeightLoadError(
            f"{key} in {path} has shape {tuple(tensor.shape)}; the head built from "
            f"config.json expects {expected}; the config and the weights belong to "
            "different heads"
        )
