"""LoRA adapters on a ``CausalLM``, in PEFT's on-disk format: train small, ship small.

A fine-tuned 135M target is ~270 MB in bf16; its LoRA adapter at rank 16 on every
projection is ~10 MB, one safetensors file, so a tuned model can live in a repository
(and travel to a GPU machine) as base alias + adapter. The adapter directory is PEFT's:

- ``adapter_config.json``: ``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules``
  (HF projection names), ``base_model_name_or_path`` (an alias, directory or hub name);
- ``adapter_model.safetensors``: for each targeted projection of layer ``i``,
  ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`` ``[r, in]``
  and ``...lora_B.weight`` ``[out, r]``;

so PEFT, vLLM and SGLang load it as they load any LoRA adapter. The update of projection
``W`` is ``W + (lora_alpha / r) * B @ A``; ``load_model`` on an adapter directory loads the
base and merges every update into our fused weights (``qkv_proj`` holds q, k and v;
``gate_up_proj`` gate and up), so serving runs at the base model's speed.

Training wraps each fused projection in a ``LoraLinear``: the base weight frozen, one
(A, B) pair per targeted HF projection, B zero at the start (the wrapped model starts
exactly at the base, as PEFT's initialisation does).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Every projection of a Llama-family layer, by HF name: (submodule, our fused module).
PROJECTIONS = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


@dataclass(frozen=True)
class LoraSpec:
    """Which projections get an adapter, its rank and scale (``alpha / rank``)."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = tuple(PROJECTIONS)
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora rank={self.rank} must be >= 1")
        unknown = [t for t in self.targets if t not in PROJECTIONS]
        if unknown or not self.targets:
            raise ValueError(
                f"lora targets {list(self.targets)} are invalid; choose from {list(PROJECTIONS)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout={self.dropout} must be in [0, 1)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _parts(config, fused: str) -> list[tuple[str, int]]:
    """(HF projection, output rows) of a fused module, in its row order."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter, hidden = config.intermediate_size, config.hidden_size
    return {
        "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
        "o_proj": [("o_proj", hidden)],
        "gate_up_proj": [("gate_proj", inter), ("up_proj", inter)],
        "down_proj": [("down_proj", hidden)],
    }[fused]


class LoraLinear(nn.Module):
    """A frozen linear layer plus low-rank updates of some of its row blocks (the HF
    projections fused into it). ``forward(x) = base(x) + scale * [x A_p^T B_p^T]_p`` with
    zeros for untargeted blocks."""

    def __init__(self, base: nn.Linear, parts: list[tuple[str, int]], spec: LoraSpec) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.parts = parts
        self.spec = spec
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, rows in parts:
            if name in spec.targets:
                a = torch.empty(spec.rank, base.in_features, dtype=dtype, device=device)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's (and nn.Linear's) init
                self.lora_A[name] = nn.Parameter(a)
                self.lora_B[name] = nn.Parameter(
                    torch.zeros(rows, spec.rank, dtype=dtype, device=device)
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        out = self.base(x)
        if self.spec.dropout and self.training:
            x = F.dropout(x, self.spec.dropout)
        updates = []
        for name, rows in self.parts:
            if name in self.lora_A:
                updates.append(F.linear(F.linear(x, self.lora_A[name]), self.lora_B[name]))
            else:
                updates.append(x.new_zeros(*x.shape[:-1], rows))
        return out + self.spec.scale * torch.cat(updates, dim=-1)


def _modules(model):
    """(layer index, submodule name, submodule, fused attribute) of every projection."""
    fused_of = {}
    for sub, fused in PROJECTIONS.values():
        fused_of[fused] = sub
    for i, layer in enumerate(model.layers):
        for fused, sub in fused_of.items():
            yield i, sub, getattr(layer, sub), fused


def apply_lora(model, spec: LoraSpec) -> list[LoraLinear]:
    """Freeze ``model`` (a ``CausalLM``) and wrap every fused projection that holds a
    target in a ``LoraLinear``; returns the wrappers (their A and B train)."""
    model.requires_grad_(False)
    wrapped = []
    for _, _, module, fused in _modules(model):
        parts = _parts(model.config, fused)
        if any(name in spec.targets for name, _ in parts):
            lora = LoraLinear(getattr(module, fused), parts, spec)
            setattr(module, fused, lora)
            wrapped.append(lora)
    return wrapped


def adapter_tensors(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The trained A and B of a ``CausalLM`` wrapped by ``apply_lora``, under PEFT's keys."""
    tensors = {}
    for i, sub, module, fused in _modules(model):
        lora = getattr(module, fused)
        if not isinstance(lora, LoraLinear):
            continue
        for name in lora.lora_A:
            prefix = f"base_model.model.model.layers.{i}.{sub}.{name}"
            for kind, params in (("lora_A", lora.lora_A), ("lora_B", lora.lora_B)):
                t = params[name].detach()
                tensors[f"{prefix}.{kind}.weight"] = (t.to(dtype) if dtype else t).contiguous()
    return tensors


def save_adapter(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    spec: LoraSpec,
    base: str,
    max_file_bytes: int | None = None,
) -> Path:
    """Write ``tensors`` (``adapter_tensors``) and the PEFT config naming ``base``. One
    file, as PEFT reads it: over ``max_file_bytes`` is an error naming the rank."""
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_file_bytes is not None and size > max_file_bytes:
        raise ValueError(
            f"the adapter is {size / 2**20:.1f} MB at rank {spec.rank}, over the "
            f"{max_file_bytes / 2**20:.1f} MB file limit; lower the rank or the targets"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_adapter_config(adapter_dir: Path) -> tuple[LoraSpec, str]:
    """(spec, base model) of a PEFT LoRA directory; anything it cannot merge exactly is
    refused with the field to change."""
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {config['peft_type']!r}; only LORA merges")
    for key, plain in (("bias", "none"), ("use_rslora", False), ("use_dora", False)):
        if config.get(key, plain) != plain:
            raise ValueError(f"{adapter_dir}: {key}={config[key]!r} is not supported")
    if config.get("fan_in_fan_out", False):
        raise ValueError(f"{adapter_dir}: fan_in_fan_out=true is not supported")
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{adapter_dir}/{ADAPTER_CONFIG} names no base_model_name_or_path; set it to "
            "the model the adapter was trained on"
        )
    targets = config["target_modules"]
    if isinstance(targets, str):  # PEFT allows one name or a regex; we take names
        targets = [targets]
    spec = LoraSpec(
        rank=int(config["r"]),
        alpha=float(config.get("lora_alpha", config["r"])),
        targets=tuple(sorted(set(targets))),
    )
    return spec, base


@torch.no_grad()
def merge_adapter(model, adapter_dir: str | Path) -> None:
    """Add every update of ``adapter_dir`` to ``model``'s (a loaded ``CausalLM``) fused
    weights, in float32, cast back to the weights' dtype."""
    adapter_dir = Path(adapter_dir)
    spec, _ = read_adapter_config(adapter_dir)
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    used = set()
    for i, sub, module, fused in _modules(model):
        weight = getattr(module, fused).weight  # [out, in]
        row = 0
        for name, rows in _parts(model.config, fused):
            prefix = f"base_model.model.model.layers.{i}.{sub}.{name}"
            a_key, b_key = f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"
            if a_key in tensors:
                a, b = tensors[a_key].float(), tensors[b_key].float()
                if a.shape != (spec.rank, weight.shape[1]) or b.shape != (rows, spec.rank):
                    raise ValueError(
                        f"{adapter_dir}: {prefix} has A {tuple(a.shape)} and B "
                        f"{tuple(b.shape)}; the model needs [{spec.rank}, {weight.shape[1]}] "
                        f"and [{rows}, {spec.rank}] (another base model?)"
                    )
                block = weight[row : row + rows]
                delta = (b @ a) * spec.scale
                block.copy_((block.float() + delta.to(block.device)).to(block.dtype))
                used |= {a_key, b_key}
            row += rows
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(
            f"{adapter_dir}: {len(unused)} adapter tensors match no projection of the model "
            f"(first: {unused[0]}); only the layers' q/k/v/o/gate/up/down projections merge"
        )
