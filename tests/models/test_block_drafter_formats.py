"""Block drafter checkpoints (specdec/models/block_drafter_formats.py): ours and vLLM's
dflash layout round-trip exactly, the dflash layout holds the keys and config fields vLLM's
``qwen3_dflash.py`` loader reads (layer ids as layer outputs: ours minus one), bad configs
are refused naming the field, and ``specdec export``/``import``/``validate-head`` handle
drafters."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdec.models import load_config, resolve_model
from specdec.models.block_drafter import BlockDrafter, BlockDrafterConfig, ContextKV
from specdec.models.block_drafter_formats import (
    load_block_drafter,
    save_block_drafter,
)
from specdec.models.config import ModelConfig
from specdec.models.weights import WeightLoadError

VOCAB, HIDDEN = 96, 32
TARGET = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
    num_layers=8, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
    rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
    tie_word_embeddings=True, attention_bias=False, o_proj_bias=False, qk_norm=False,
    bos_token_id=1, eos_token_ids=[2], torch_dtype="float32",
)  # fmt: skip
# What vLLM's qwen3_dflash.py loads per layer (q/k/v and gate/up stacked by its mapper).
LAYER_KEYS = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
]  # fmt: skip


def drafter(draft_vocab: int = 48, seed: int = 0) -> BlockDrafter:
    torch.manual_seed(seed)
    config = BlockDrafterConfig.for_target(TARGET, draft_vocab, mask_token_id=5, block_size=4,
                                           num_layers=2, target_name="tiny")  # fmt: skip
    d = BlockDrafter(config)
    with torch.no_grad():
        for p in d.parameters():  # norms away from 1, so a swapped key would show
            p.normal_()
    if draft_vocab < VOCAB:
        kept = torch.arange(0, VOCAB, VOCAB // draft_vocab)[:draft_vocab]
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[kept] = True
        d.set_vocab_map(kept - torch.arange(draft_vocab), t2d)
    return d


def logits(d: BlockDrafter) -> torch.Tensor:
    torch.manual_seed(1)
    embed, lm_head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    d.bind_target(lambda ids: embed[ids], lm_head)
    kv = d.context_kv(torch.randn(6, 3 * HIDDEN), torch.arange(6))
    ids = d.block_inputs(torch.tensor([9]))
    context = [ContextKV(x.k[None], x.v[None]) for x in kv]
    with torch.no_grad():
        return d.block_logits(embed[ids], torch.arange(6, 10)[None], context, torch.tensor([6]))


def test_ours_round_trips_through_split_shards(tmp_path):
    d = drafter()
    out = save_block_drafter(d, tmp_path / "ours", max_shard_bytes=8_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["split_tensors"]  # the limit forced row splits
    config = json.loads((out / "config.json").read_text())
    assert config["target_model"] == "tiny" and config["block_size"] == 4
    back = load_block_drafter(out, target_config=TARGET)
    assert back.config == d.config
    for (name, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    torch.testing.assert_close(logits(back), logits(d), rtol=0, atol=0)


def test_dflash_layout_holds_what_vllm_reads(tmp_path):
    d = drafter()
    out = save_block_drafter(d, tmp_path / "vllm", "dflash")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(str(out / "model.safetensors"))
    expected = {f"layers.{i}.{k}" for i in range(2) for k in LAYER_KEYS}
    expected |= {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t"}
    assert set(tensors) == expected  # no t2d: vLLM skips it, DFlash ships none
    assert tensors["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    assert tensors["lm_head.weight"].shape == (48, HIDDEN) and tensors["d2t"].dtype == torch.int64
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and "target_model" not in c
    # Ours enter layers (2, 4, 5) of the 8-layer target; DFlash names layer outputs.
    assert d.config.aux_layer_ids == (2, 4, 5)
    assert c["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [1, 3, 4]}
    assert (c["target_hidden_size"], c["draft_vocab_size"], c["vocab_size"]) == (HIDDEN, 48, VOCAB)
    assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["intermediate_size"]) == (2, 4, 2, 8, 64)  # fmt: skip
    assert c["hidden_act"] == "silu" and c["layer_types"] == ["full_attention"] * 2
    assert c["rope_theta"] == 10000.0 and c["rms_norm_eps"] == 1e-6
    back = load_block_drafter(out, target_config=TARGET)
    assert back.config.aux_layer_ids == (2, 4, 5) and torch.equal(back.t2d, d.t2d)
    torch.testing.assert_close(logits(back), logits(d), rtol=0, atol=0)


def test_full_vocabulary_stores_no_vocabulary(tmp_path):
    d = drafter(draft_vocab=VOCAB)
    out = save_block_drafter(d, tmp_path / "full", "dflash")
    keys = set(load_file(str(out / "model.safetensors")))
    assert not keys & {"lm_head.weight", "d2t", "t2d"}
    back = load_block_drafter(out, target_config=TARGET)
    assert back.lm_head is None
    torch.testing.assert_close(logits(back), logits(d), rtol=0, atol=0)


def _edit(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_bad_configs_are_refused_naming_the_field(tmp_path):
    out = save_block_drafter(drafter(), tmp_path / "d", "dflash")
    _edit(out, eagle_aux_hidden_state_layer_ids=[1, 3, 4])  # vLLM numbering, off by one
    with pytest.raises(WeightLoadError, match=r"target_layer_ids=\[1, 3, 4\].* disagree"):
        load_block_drafter(out, target_config=TARGET)
    _edit(out, eagle_aux_hidden_state_layer_ids=[2, 4, 5])  # the same layers: fine
    assert load_block_drafter(out, target_config=TARGET).config.aux_layer_ids == (2, 4, 5)
    _edit(out, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(WeightLoadError, match=r"layer_types=.*only full_attention"):
        load_block_drafter(out, target_config=TARGET)
    _edit(out, layer_types=None, dflash_config={"target_layer_ids": [1, 3, 4]})
    with pytest.raises(WeightLoadError, match=r"mask_token_id is missing"):
        load_block_drafter(out, target_config=TARGET)
    _edit(out, dflash_config={"mask_token_id": 5, "target_layer_ids": [1, 3, 4]},
          hidden_size=64)  # fmt: skip
    with pytest.raises(WeightLoadError, match=r"hidden_size=64.*target's is 32"):
        load_block_drafter(out, target_config=TARGET)


def test_export_for_vllm_and_validate(tmp_path, smollm2_dir):
    """A SmolLM2 drafter in our layout: validate-head sends vLLM to the export, which
    writes the dflash layout, validates it and prints vLLM's dflash launch line."""
    from specdec.interop.export import export_head
    from specdec.interop.validate import validate_head

    target = load_config(resolve_model("smollm2-135m-instruct"))
    config = BlockDrafterConfig.for_target(
        target, target.vocab_size, mask_token_id=16, block_size=8, num_layers=1,
        target_name="smollm2-135m-instruct",
    )  # fmt: skip
    ours = save_block_drafter(BlockDrafter(config), tmp_path / "ours")
    report = validate_head(ours, "vllm", target=target)
    assert not report.ok and "dflash layout" in report.render()
    assert not validate_head(ours, "sglang", target=target).ok
    assert validate_head(ours, "specdec", target=target).ok
    result = export_head(ours, tmp_path / "vllm", "vllm")
    assert result.report.ok and result.num_speculative_tokens == 7
    assert '"method": "dflash"' in result.launch
    exported = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert exported["dflash_config"]["target_layer_ids"] == [1, 14, 26]  # (2, 15, 27) - 1
    with pytest.raises(ValueError, match=r"use --to vllm"):
        export_head(ours, tmp_path / "sglang", "sglang")


@pytest.mark.parametrize("layout", ["specdec", "dflash"])
def test_import_halves_a_drafter_to_bf16(tmp_path, layout):
    """``specdec import --dtype bfloat16`` writes a drafter in our layout with every
    floating weight in bf16 (the fp32 values rounded) and the vocabulary exact; without
    --dtype the import is lossless."""
    from specdec.cli import main
    from specdec.interop.importer import HeadImportError, import_head
    from specdec.models.tree_defaults import TreeDefaults

    name = "smollm2-135m-instruct"
    target = load_config(resolve_model(name))
    torch.manual_seed(0)
    config = BlockDrafterConfig.for_target(target, 1024, mask_token_id=16, block_size=8,
                                           num_layers=1, target_name=name)  # fmt: skip
    original = BlockDrafter(config)
    kept = torch.arange(0, 4096, 4)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    original.set_vocab_map(kept - torch.arange(1024), t2d)
    src = save_block_drafter(original, tmp_path / "src", layout)
    args = ["--target", name] if layout == "dflash" else []
    assert main(["import", str(src), str(tmp_path / "half"), "--dtype", "bfloat16", *args]) == 0
    stored = {}
    for f in sorted((tmp_path / "half").glob("*.safetensors")):
        stored.update(load_file(f))
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.bfloat16}
    assert stored["d2t"].dtype == torch.int64 and torch.equal(stored["t2d"], t2d)
    written = json.loads((tmp_path / "half/config.json").read_text())
    assert written["torch_dtype"] == "bfloat16" and written["target_model"] == name
    half = load_block_drafter(tmp_path / "half", target_config=target, dtype=torch.bfloat16)
    for key, value in original.state_dict().items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(half.state_dict()[key], want), key
    result = import_head(src, tmp_path / "same", target=name)
    assert result.dtype == torch.float32 and result.aux_layer_ids == (2, 15, 27)
    same = load_block_drafter(tmp_path / "same", target_config=target)
    for key, value in original.state_dict().items():
        assert torch.equal(same.state_dict()[key], value), key
    with pytest.raises(HeadImportError, match=r"block drafter.*leave them out"):
        import_head(src, tmp_path / "tree", target=name, tree=TreeDefaults("chain", 3))
