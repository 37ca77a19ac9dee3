"""Block drafter checkpoints: ours and vLLM's ``dflash`` layout (z-lab's DFlash).

Facts this module relies on (read from vllm-project/vllm
``model_executor/models/qwen3_dflash.py``, ``v1/spec_decode/dflash.py``,
``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``, ``v1/spec_decode/llm_base_proposer.py``
and z-lab/dflash ``model/dflash.py``):

- config.json: ``architectures: ["DFlashDraftModel"]``, Qwen3 fields (``hidden_size``,
  ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``hidden_act``, ``rms_norm_eps``, ``rope_theta``,
  ``rope_scaling``, ``max_position_embeddings``, ``vocab_size`` = the target's),
  ``draft_vocab_size``, ``target_hidden_size`` (``fc`` reads len(ids) * it), ``block_size``
  (z-lab's), and ``dflash_config: {mask_token_id, target_layer_ids}``. vLLM takes the mask
  token from ``dflash_config.mask_token_id``; a layer is bidirectional unless
  ``is_causal``/``dflash_config.causal`` or a ``sliding_attention`` layer type says so.
- Layer ids: ``target_layer_ids`` index ``i`` means the *output* of target layer ``i``
  (HF ``hidden_states[i + 1]``: z-lab's ``extract_context_feature`` offsets by one, and vLLM
  adds 1 when it reads them, unless a top-level ``eagle_aux_hidden_state_layer_ids``, read
  first and as is, is present). Our ``aux_layer_ids`` name the residual stream *entering*
  a layer (= HF ``hidden_states[l]``), so ``target_layer_ids = aux_layer_ids - 1`` on
  export and ``+ 1`` on import; aux layer 0 (the embeddings) has no DFlash id.
- Weights: ``layers.<i>.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.<i>.self_attn.{q_norm,k_norm}.weight``, ``layers.<i>.mlp.{gate,up,down}_proj.weight``,
  ``layers.<i>.{input_layernorm,post_attention_layernorm}.weight``, ``fc.weight``
  [H, len(ids) * H_t], ``hidden_norm.weight``, ``norm.weight``; with a pruned vocabulary
  ``lm_head.weight`` [draft_vocab, H] and ``d2t`` [draft_vocab] int64 (vLLM: target id = i
  + d2t[i], the EAGLE-3 offset; it skips ``t2d``). Without ``lm_head.weight`` vLLM uses the
  target's; ``embed_tokens.weight`` is optional (the target's otherwise).

Formats here:

- ``"specdec"`` (ours): the same config.json plus ``target_model``, and ``t2d`` beside
  ``d2t``; shards of at most 16 MB (rows split as for EAGLE-3 heads, ``eagle3_formats``).
- ``"dflash"``: one ``model.safetensors``, what vLLM's and z-lab's loaders read. Serve it
  with ``--speculative-config '{"method": "dflash", "model": DIR,
  "num_speculative_tokens": block_size - 1}'``; vLLM 0.32's CPU build drafts with it as
  specdec does (tests/interop/test_vllm_dflash.py).

Loading reads both (and z-lab's published drafters of supported shape), checks every
field against the target, every key's shape, and refuses what the drafter does not
compute (attention bias, causal or sliding-window layers) naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from safetensors.torch import save_file

from specdec.models.block_drafter import BlockDrafter, BlockDrafterConfig
from specdec.models.block_drafter_file import (
    ARCHITECTURE,
    block_size_of,
    read_block_drafter_json,
)
from specdec.models.config import ModelConfig
from specdec.models.eagle3_formats import (
    MAX_SHARD_BYTES,
    SINGLE_FILE,
    _check_shape,
    _read_tensors,
    _write_shards,
    fill_by_layout,
    hf_decoder_fields,
)
from specdec.models.materialize import materialize
from specdec.models.weights import WeightLoadError

BlockFormat = Literal["specdec", "dflash"]
_IGNORED_KEYS = frozenset({"embed_tokens.weight"})  # the target's embedding, if shipped
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def to_target_layer_ids(aux_layer_ids: tuple[int, ...]) -> list[int]:
    """Ours (entering layer l) -> DFlash's ``target_layer_ids`` (output of layer l - 1)."""
    if 0 in aux_layer_ids:
        raise ValueError(
            f"aux_layer_ids {list(aux_layer_ids)} include 0 (the embeddings), which DFlash's "
            "target_layer_ids (layer outputs) cannot name; train on layers >= 1"
        )
    return [i - 1 for i in aux_layer_ids]


def from_target_layer_ids(ids: list[int]) -> tuple[int, ...]:
    """DFlash's ``target_layer_ids`` (output of layer i) -> ours (entering layer i + 1)."""
    return tuple(i + 1 for i in ids)


def is_block_drafter(directory: str | Path) -> bool:
    """Whether ``directory/config.json`` describes a DFlash-style block drafter."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        return False
    return json.loads(config_file.read_text()).get("architectures") == [ARCHITECTURE]


# ----------------------------------------------------------------------- saving


def save_block_drafter(
    drafter: BlockDrafter,
    directory: str | Path,
    format: BlockFormat = "specdec",
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write ``drafter`` to a new (or empty) ``directory`` in ``format``; returns it."""
    if format not in get_args(BlockFormat):
        raise ValueError(f"unknown block drafter format {format!r}; choose one of "
                         f"{get_args(BlockFormat)}")  # fmt: skip
    out = Path(directory)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} is not empty; save each checkpoint to a new directory (stale shards "
            "would be read back with the new ones)"
        )
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in drafter.named_parameters():
        row = 0
        for key, rows in drafter.checkpoint_layout(name):
            tensors[key] = param.detach()[row : row + rows].to("cpu").contiguous().clone()
            row += rows
    if not drafter.config.full_vocab:
        tensors["d2t"] = drafter.d2t.detach().to("cpu").clone()
        if format == "specdec":
            tensors["t2d"] = drafter.t2d.detach().to("cpu").clone()
    dtype = drafter.fc.weight.dtype
    config = _hf_config(drafter.config, _DTYPE_NAMES.get(dtype, str(dtype)))
    if format == "specdec":
        config["target_model"] = drafter.config.target_name
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if format == "specdec":
        _write_shards(tensors, out, max_shard_bytes)
    else:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    return out


def _hf_config(c: BlockDrafterConfig, dtype: str) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.hidden_size,
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
        "draft_vocab_size": c.draft_vocab_size,
        "attention_bias": False,
        "layer_types": ["full_attention"] * c.num_layers,  # bidirectional in vLLM
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": to_target_layer_ids(c.aux_layer_ids),
        },
        "torch_dtype": dtype,
    }


# ---------------------------------------------------------------------- loading


def detect_block_format(directory: str | Path) -> BlockFormat:
    path = Path(directory)
    hf = read_block_drafter_json(path)
    return "specdec" if "target_model" in hf else "dflash"


def read_block_config(directory: str | Path, target_config: ModelConfig) -> BlockDrafterConfig:
    """The drafter config of a checkpoint in either format, checked against its target."""
    path = Path(directory)
    return _to_config(read_block_drafter_json(path), target_config, path)


def load_block_drafter(
    directory: str | Path,
    *,
    target_config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> BlockDrafter:
    """Load a drafter in either format (module docstring). Bind the target's embedding
    (and lm_head, for a full-vocabulary drafter) with ``bind_target`` before drafting."""
    path = Path(directory)
    config = _to_config(read_block_drafter_json(path), target_config, path)
    tensors = _read_tensors(path)
    with torch.device("meta"):
        drafter = BlockDrafter(config, max_positions=max_positions or target_config.max_context_len)
    materialize(drafter, dtype, device)
    drafter.rotary.build_cache()
    _fill(drafter, tensors, path)
    return drafter


def _to_config(hf: dict[str, Any], target: ModelConfig, path: Path) -> BlockDrafterConfig:
    def fail(what: str) -> WeightLoadError:
        return WeightLoadError(f"{path}/config.json: {what}")

    dflash = hf.get("dflash_config") or {}
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias"):
        raise fail("the drafter's MLP is SiLU-gated and its projections have no bias")
    if hf.get("is_causal") or dflash.get("causal") or dflash.get("use_swa"):
        raise fail("causal or sliding-window DFlash layers are not supported (bidirectional only)")
    if any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise fail(f"layer_types={hf['layer_types']}; only full_attention layers are supported")
    if "mask_token_id" not in dflash:
        raise fail("dflash_config.mask_token_id is missing; the drafter needs its mask token")
    top, nested = hf.get("eagle_aux_hidden_state_layer_ids"), dflash.get("target_layer_ids")
    if not top and not nested:
        raise fail("dflash_config.target_layer_ids is missing; name the target layers it reads")
    ids = tuple(top) if top else from_target_layer_ids(nested)
    if top and nested and ids != from_target_layer_ids(nested):
        raise fail(
            f"eagle_aux_hidden_state_layer_ids={list(top)} (entering-layer numbering) and "
            f"dflash_config.target_layer_ids={list(nested)} (layer outputs, = "
            f"{list(from_target_layer_ids(nested))}) disagree; fix or drop one"
        )
    try:
        hidden, heads, vocab = hf["hidden_size"], hf["num_attention_heads"], hf["vocab_size"]
        if hf.get("target_hidden_size") not in (None, hidden) or hidden != target.hidden_size:
            raise ValueError(
                f"hidden_size={hidden}, target_hidden_size={hf.get('target_hidden_size')} but "
                f"the target's is {target.hidden_size}; the drafter embeds with the target's "
                "embedding, so all three must match"
            )
        if vocab != target.vocab_size:
            raise ValueError(f"vocab_size={vocab} but the target has {target.vocab_size}; this "
                             "drafter is for another target")  # fmt: skip
        bad = [i for i in ids if not 0 <= i < target.num_layers]
        if bad:
            raise ValueError(f"aux layers {list(ids)} (entering-layer numbering) include {bad}, "
                             f"outside a {target.num_layers}-layer target")  # fmt: skip
        return BlockDrafterConfig(
            **hf_decoder_fields(hf, hidden, heads, vocab),
            draft_vocab_size=hf.get("draft_vocab_size") or vocab,
            aux_layer_ids=ids,
            mask_token_id=dflash["mask_token_id"],
            block_size=block_size_of(hf),
            num_layers=hf["num_hidden_layers"],
            target_name=hf.get("target_model") or "",
        )
    except KeyError as err:
        raise fail(f"missing field {err}") from err
    except ValueError as err:
        raise fail(str(err)) from err


def _fill(drafter: BlockDrafter, tensors: dict[str, torch.Tensor], path: Path) -> None:
    used, missing = fill_by_layout(drafter, tensors, path)
    with torch.no_grad():
        if drafter.config.full_vocab:
            drafter.d2t.zero_()
            drafter.t2d.fill_(True)
        elif "d2t" not in tensors:
            missing.append("d2t")
        else:
            d2t = tensors["d2t"].to(torch.int64)
            _check_shape(d2t, tuple(drafter.d2t.shape), "d2t", path)
            t2d = tensors.get("t2d")
            if t2d is None:  # the DFlash layout ships d2t only: t2d marks its kept ids
                t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
                kept = (torch.arange(d2t.shape[0]) + d2t).clamp(0, t2d.shape[0] - 1)
                t2d[kept] = True
            try:
                drafter.set_vocab_map(d2t, t2d.to(torch.bool))
            except ValueError as err:
                raise WeightLoadError(f"{path}: invalid draft vocabulary: {err}") from err
            used.update(("d2t", "t2d"))
    if missing:
        raise WeightLoadError(
            f"{len(missing)} weights missing from {path}: {', '.join(missing[:6])}; the "
            "checkpoint is incomplete or config.json describes another drafter"
        )
    unexpected = sorted(set(tensors) - used - _IGNORED_KEYS)
    if unexpected:
        raise WeightLoadError(
            f"{len(unexpected)} unexpected weights in {path}: {', '.join(unexpected[:6])}; "
            "config.json does not describe them (a full-vocabulary drafter shipping an "
            "lm_head? set draft_vocab_size and d2t)"
        )
