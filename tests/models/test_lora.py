"""LoRA adapters (specdec/models/lora.py): a wrapped model starts at its base, the merged
weights compute what the wrapped model computes, the adapter directory is PEFT's (HF
transformers + PEFT load it to the same logits), every loader here takes an adapter
directory, and bad adapters are refused with the field to fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model_dir

from specdec.models import load_model
from specdec.models.aliases import ModelNotFoundError
from specdec.models.loader import resolve_model
from specdec.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraLinear,
    LoraSpec,
    adapter_tensors,
    apply_lora,
    save_adapter,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), smollm2_dir, seed=0)


def _forward(model, ids: torch.Tensor) -> torch.Tensor:  # [n, vocab] logits, one sequence
    from specdec.train.packed_attention import PackedCausalAttention, PackedMeta

    for layer in model.layers:
        layer.self_attn.backend = PackedCausalAttention()
    n = ids.shape[0]
    meta = PackedMeta(torch.tensor([0, n], dtype=torch.int32), [n])
    hidden, _ = model(ids, torch.arange(n), [(None, None)] * model.config.num_layers, meta)
    return model.compute_logits(hidden)


def _trained(tiny: Path, spec: LoraSpec, seed: int = 0):
    """The tiny model wrapped by ``apply_lora``, with random (trained-looking) A and B."""
    model = load_model(str(tiny))
    wrapped = apply_lora(model, spec)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in wrapped:
            for p in [*lora.lora_A.values(), *lora.lora_B.values()]:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, wrapped


IDS = torch.tensor([1, 504, 77, 9, 3021, 18, 255, 12, 7, 2])


def test_a_fresh_adapter_leaves_the_model_as_its_base(tiny):
    base = load_model(str(tiny))
    model = load_model(str(tiny))
    wrapped = apply_lora(model, LoraSpec(rank=4))
    assert all(isinstance(w, LoraLinear) for w in wrapped) and len(wrapped) == 4 * 2
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    with torch.no_grad():
        torch.testing.assert_close(_forward(model, IDS), _forward(base, IDS), atol=0, rtol=0)


@pytest.mark.parametrize(
    "targets",
    [tuple(LoraSpec().targets), ("q_proj", "v_proj"), ("k_proj", "up_proj", "down_proj")],
    ids=["all", "q-v", "k-up-down"],
)
def test_saved_adapter_loads_merged_to_the_wrapped_models_logits(tiny, tmp_path, targets):
    """Export, then ``load_model(adapter_dir)``: the base plus the merged updates computes
    what the wrapped model computed (fp32), whichever blocks of the fused projections the
    adapter targets."""
    spec = LoraSpec(rank=4, alpha=8.0, targets=targets)
    model, _ = _trained(tiny, spec)
    adapter = save_adapter(tmp_path / "adapter", adapter_tensors(model), spec, str(tiny))
    with torch.no_grad():
        want = _forward(model, IDS)
        base = _forward(load_model(str(tiny)), IDS)
        got = _forward(load_model(str(adapter)), IDS)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, base, atol=1e-3)  # the adapter changed the model

    resolved = resolve_model(str(adapter))
    assert (resolved.source, resolved.adapter) == ("adapter", adapter.resolve())
    assert resolved.hf_dir == resolve_model(str(tiny)).hf_dir  # config, tokenizer: the base's


def test_adapter_directory_is_peft_layout(tiny, tmp_path):
    spec = LoraSpec(rank=4, alpha=8.0)
    model, _ = _trained(tiny, spec)
    tensors = adapter_tensors(model, torch.bfloat16)
    adapter = save_adapter(tmp_path / "adapter", tensors, spec, "smollm2-135m-instruct")
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == "smollm2-135m-instruct"
    assert set(config["target_modules"]) == set(spec.targets)
    c = model.config
    kv = c.num_kv_heads * c.head_dim
    prefix = "base_model.model.model.layers.1"
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    assert shapes[f"{prefix}.self_attn.q_proj.lora_A.weight"] == (4, c.hidden_size)
    assert shapes[f"{prefix}.self_attn.k_proj.lora_B.weight"] == (kv, 4)
    assert shapes[f"{prefix}.self_attn.o_proj.lora_B.weight"] == (c.hidden_size, 4)
    assert shapes[f"{prefix}.mlp.down_proj.lora_A.weight"] == (4, c.intermediate_size)
    assert len(tensors) == 2 * 7 * c.num_layers
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert (adapter / ADAPTER_WEIGHTS).is_file()
    with pytest.raises(ValueError, match=r"at rank 4, over the 0.0 MB file limit"):
        save_adapter(tmp_path / "big", tensors, spec, "x", max_file_bytes=1000)


def test_hf_transformers_with_peft_loads_the_adapter_to_the_same_logits(tiny, tmp_path):
    """The PEFT side of the format: transformers + PEFT, on the base's HF weights, compute
    the logits our merged model computes."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    spec = LoraSpec(rank=4, alpha=8.0)
    model, _ = _trained(tiny, spec, seed=3)
    adapter = save_adapter(tmp_path / "adapter", adapter_tensors(model), spec, str(tiny))
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tuned = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    with torch.no_grad():
        want = tuned(IDS[None]).logits[0]
        got = _forward(load_model(str(adapter)), IDS)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bad_adapters_are_refused_with_the_fix(tiny, tmp_path):
    spec = LoraSpec(rank=4)
    model, _ = _trained(tiny, spec)
    tensors = adapter_tensors(model)
    missing = save_adapter(tmp_path / "missing", tensors, spec, str(tmp_path / "no-such-base"))
    with pytest.raises(ModelNotFoundError, match=r"base_model_name_or_path .* does not resolve"):
        resolve_model(str(missing))
    # a relative base resolves next to the adapter too
    beside = save_adapter(tmp_path / "beside", tensors, spec, "../tiny-base")
    (tmp_path / "tiny-base").symlink_to(tiny)
    assert resolve_model(str(beside)).hf_dir == resolve_model(str(tiny)).hf_dir
    wrong = save_adapter(tmp_path / "wrong", {**tensors, "base_model.model.lm_head.lora_A.weight":
                                              torch.zeros(4, 64)}, spec, str(tiny))  # fmt: skip
    with pytest.raises(ValueError, match="match no projection"):
        load_model(str(wrong))
    dora = tmp_path / "dora"
    save_adapter(dora, tensors, spec, str(tiny))
    config = json.loads((dora / ADAPTER_CONFIG).read_text())
    (dora / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        load_model(str(dora))
    with pytest.raises(ValueError, match=r"lora targets \['wq'\] are invalid"):
        LoraSpec(targets=("wq",))
