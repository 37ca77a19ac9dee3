"""``specdec export`` / ``import`` / ``validate-head`` on SmolLM2-shaped heads.

Published heads are written here by hand in their own layouts (EAGLE upstream as in
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: fp16, no aux ids; a SpecForge export: bf16, ids in
``eagle_config`` by output index, the frozen embedding included), so the round trip is
checked against bytes specdec did not write: import, then export to the same layout, gives
the source's tensors back bit for bit. The validator is fed the mistakes that make engines
fail or silently compute something else, and must name each with its fix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.config import SpeculativeConfig
from specdec.interop.export import ExportError, export_head
from specdec.interop.importer import HeadImportError, import_head
from specdec.interop.validate import validate_head
from specdec.models import load_config
from specdec.models.eagle3_formats import checkpoint_shapes, detect_format, read_eagle3_config
from specdec.models.eagle3_head import Eagle3Config

SMOLLM2 = "smollm2-135m-instruct"
DRAFT_VOCAB = 2048


def research_config(**extra) -> dict:
    """SmolLM2-shaped head config as EAGLE upstream writes it (no aux ids, no head_dim)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu",
        "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192,
        "model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-05, "rope_theta": 100000.0,
        "tie_word_embeddings": False, "transformers_version": "4.28.1", "use_cache": True,
        "vocab_size": 49152, "draft_vocab_size": DRAFT_VOCAB, **extra,
    }  # fmt: skip


Tensors = dict[str, torch.Tensor]


def write_published_head(
    out: Path, config: dict, dtype: torch.dtype, seed: int, extra: Tensors | None = None
) -> Tensors:
    """A head in the research layout, tensors drawn at the shapes the config implies and
    saved as one model.safetensors; returns what was stored."""
    target = load_config(SMOLLM2)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shapes = checkpoint_shapes(read_eagle3_config(out, target))
    g = torch.Generator().manual_seed(seed)
    tensors = {
        key: (torch.randn(shape, generator=g) * 0.02).to(dtype)
        for key, shape in shapes.items()
        if key not in ("d2t", "t2d")
    }
    kept = torch.randperm(target.vocab_size, generator=g)[:DRAFT_VOCAB].sort().values
    tensors["d2t"] = kept - torch.arange(DRAFT_VOCAB)
    tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, kept, True)
    tensors.update(extra or {})
    save_file(tensors, str(out / "model.safetensors"))
    return tensors


def stored(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


# ------------------------------------------------------------------ round trip


@pytest.mark.parametrize("layout", ["eagle_upstream", "specforge"])
def test_research_import_then_export_is_identical_tensor_for_tensor(layout, tmp_path):
    if layout == "eagle_upstream":  # yuhuili/EAGLE3-*: fp16, EAGLE's default aux layers
        config, dtype, extra, to = (
            research_config(torch_dtype="float16"),
            torch.float16,
            {},
            "eagle",
        )
        nested, entering = None, [2, 15, 27]
    else:  # SpecForge: bf16, output-index ids (non-default here), embedding included
        config = research_config(
            torch_dtype="bfloat16",
            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 13, 25],
                          "use_aux_hidden_state": True},
        )  # fmt: skip
        dtype, to = torch.bfloat16, "sglang"
        extra = {"embed_tokens.weight": torch.zeros(49152, 576, dtype=torch.bfloat16)}
        nested, entering = [0, 13, 25], [1, 14, 26]
    source = write_published_head(tmp_path / "published", config, dtype, seed=1, extra=extra)

    assert main(["import", str(tmp_path / "published"), str(tmp_path / "ours"),
                 "--target", SMOLLM2]) == 0  # fmt: skip
    ours = json.loads((tmp_path / "ours/config.json").read_text())
    assert detect_format(tmp_path / "ours") == "specdec"
    assert ours["eagle_aux_hidden_state_layer_ids"] == entering  # vLLM numbering
    assert ours["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in entering]
    assert ours["target_model"] == SMOLLM2

    assert main(["export", "--to", to, str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    back = stored(tmp_path / "back")
    assert set(back) == set(source) - {"embed_tokens.weight"}  # the target's, never stored
    for key, tensor in source.items():
        if key in back:
            assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    exported = json.loads((tmp_path / "back/config.json").read_text())
    assert (exported.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") == (
        nested or [1, 14, 26]
    )  # SGLang numbering
    assert exported["torch_dtype"] == config["torch_dtype"]
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


def test_imported_head_runs_in_the_engine_losslessly(tmp_path):
    """An imported SpecForge-layout head drives specdec's eagle3 proposer; greedy output
    equals plain decoding (the converted ids feed the layers the config names)."""
    config = research_config(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}, torch_dtype="float32"
    )
    write_published_head(tmp_path / "published", config, torch.float32, seed=2)
    result = import_head(tmp_path / "published", tmp_path / "ours", target=SMOLLM2)
    assert result.aux_layer_ids == (2, 15, 27)
    assert "SGLang numbering" in result.aux_source
    engine = dict(device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The three primary colours are"]
    spec = SpeculativeConfig(
        method="eagle3", model=str(tmp_path / "ours"), num_speculative_tokens=3
    )
    llm = LLM(SMOLLM2, **engine, speculative=spec)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.spec_stats.steps > 0
    del llm
    plain = LLM(SMOLLM2, **engine).generate(prompts, params, use_tqdm=False)
    assert drafted[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


# ------------------------------------------------------------------ export


def test_export_for_vllm_writes_the_speculators_layout(random_head_dir, smollm2_dir, tmp_path,
                                                      capsys):  # fmt: skip
    out = tmp_path / "vllm"
    args = ["export", "--to", "vllm", str(random_head_dir), str(out), "--target", SMOLLM2]
    assert main([*args, "--num-speculative-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert f"vllm serve {smollm2_dir} --speculative-config" in printed
    assert f'"model": "{out}", "num_speculative_tokens": 4' in printed
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # entering, vLLM's
    assert config["norm_before_residual"] is False
    spec = config["speculators_config"]
    assert spec["verifier"]["name_or_path"] == str(smollm2_dir)  # the alias, made portable
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    source, exported = stored(random_head_dir), stored(out)
    assert set(exported) == {k.replace("midlayer.", "layers.0.") for k in source}
    for key, tensor in source.items():
        assert torch.equal(exported[key.replace("midlayer.", "layers.0.")], tensor), key


def test_export_refuses_what_the_consumer_cannot_run(tmp_path):
    """A head on non-default layers cannot go to EAGLE (it hard-codes them); SGLang gets
    the ids in its numbering; the export directory must be new."""
    target = load_config(SMOLLM2)
    config = Eagle3Config.for_target(target, 512, aux_layer_ids=(3, 15, 27), target_name=SMOLLM2)
    from specdec.attention import get_attention_backend
    from specdec.models.eagle3_formats import save_eagle3
    from specdec.models.eagle3_head import Eagle3Head

    save_eagle3(Eagle3Head(config, get_attention_backend("torch")), tmp_path / "head")
    with pytest.raises(ExportError, match=r"EAGLE's loader always feeds \[2, 15, 27\]"):
        export_head(tmp_path / "head", tmp_path / "eagle", "eagle")
    result = export_head(tmp_path / "head", tmp_path / "sglang", "sglang")
    exported = json.loads((tmp_path / "sglang/config.json").read_text())
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 14, 26]
    assert "--speculative-algorithm EAGLE3" in result.launch
    assert "--speculative-num-draft-tokens 4" in result.launch
    with pytest.raises(FileExistsError, match="not empty"):
        export_head(tmp_path / "head", tmp_path / "sglang", "sglang")


# ------------------------------------------------------------------ validation


def findings(path: Path, consumer: str) -> list[str]:
    report = validate_head(path, consumer, target=load_config(SMOLLM2), target_name=SMOLLM2)
    return [str(f) for f in report.findings]


def one(found: list[str], *parts: str) -> str:
    hits = [f for f in found if all(p in f for p in parts)]
    assert len(hits) == 1, f"{parts} not found once in:\n" + "\n".join(found)
    return hits[0]


def test_validator_names_speculators_mistakes(random_head_dir, tmp_path, capsys):
    out = tmp_path / "vllm"
    export_head(random_head_dir, out, "vllm", target=SMOLLM2)
    config = json.loads((out / "config.json").read_text())
    config.pop("norm_before_residual")
    config["eagle_aux_hidden_state_layer_ids"] = [1, 14, 26]  # SGLang numbering, lifted
    del config["speculators_config"]["verifier"]["name_or_path"]
    (out / "config.json").write_text(json.dumps(config))

    found = findings(out, "vllm")
    assert one(found, "error", "norm_before_residual", "vLLM then assumes true")
    assert one(found, "warning", "[1, 14, 26] equals the default layers in SGLang numbering",
               "write [2, 15, 27]")  # fmt: skip
    assert one(found, "error", "verifier", "no name_or_path")
    assert one(findings(out, "sglang"), "error", "speculators format; SGLang reads")
    assert main(["validate-head", str(out), "--target", SMOLLM2]) == 1
    assert "norm_before_residual" in capsys.readouterr().out


def test_validator_names_research_mistakes(tmp_path):
    config = research_config(
        tie_word_embeddings=True,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 15, 27]},  # vLLM's, misplaced
    )
    tensors = write_published_head(tmp_path / "h", config, torch.float32, seed=3)
    tensors.pop("norm.weight")
    tensors["fc.weight"] = tensors["fc.weight"][:, :576].contiguous()
    tensors["d2t"] = tensors["d2t"].float()
    tensors["layers.0.mlp.up_proj.weight"] = tensors.pop("midlayer.mlp.up_proj.weight")
    save_file(tensors, str(tmp_path / "h/model.safetensors"))

    found = findings(tmp_path / "h", "sglang")
    assert one(found, "warning", "[2, 15, 27] equals the default layers in vLLM numbering",
               "captures [3, 16, 28]", "write [1, 14, 26]")  # fmt: skip
    assert one(found, "error", "fc.weight", "[576, 576]", "implies [576, 1728]")
    assert one(found, "error", "norm.weight: is missing")
    assert one(found, "error", "midlayer.mlp.up_proj.weight: is missing")
    assert one(found, "error", "layers.0.* layout", "rename them to midlayer.*")
    assert one(found, "error", "d2t", "torch.float32", "store d2t as torch.int64")
    assert one(found, "error", "tie_word_embeddings", "replaces the head's lm_head")


def test_validator_checks_ids_and_layout_per_engine(tmp_path):
    config = research_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 13, 25]})
    write_published_head(tmp_path / "h", config, torch.float32, seed=4)
    assert findings(tmp_path / "h", "sglang") == []
    # vLLM reads eagle_config's ids as its own numbering: one layer off.
    assert one(findings(tmp_path / "h", "vllm"), "error", "without top-level ids vLLM reads",
               '"eagle_aux_hidden_state_layer_ids": [1, 14, 26]')  # fmt: skip
    assert one(findings(tmp_path / "h", "eagle"), "error", "EAGLE's loader always feeds")
    # Only top-level ids: SGLang ignores them and takes its defaults.
    config.pop("eagle_config")
    config["eagle_aux_hidden_state_layer_ids"] = [1, 14, 26]
    (tmp_path / "h/config.json").write_text(json.dumps(config))
    assert one(findings(tmp_path / "h", "sglang"), "error", "SGLang ignores the top-level")
    # specdec's 16 MB row splits are readable by specdec only.
    shutil.rmtree(tmp_path / "h")
    write_published_head(tmp_path / "h", research_config(), torch.float32, seed=5)
    import_head(tmp_path / "h", tmp_path / "ours", target=SMOLLM2)
    from specdec.models.eagle3_formats import load_eagle3, save_eagle3

    head = load_eagle3(tmp_path / "ours", target_config=load_config(SMOLLM2))
    save_eagle3(head, tmp_path / "split", max_shard_bytes=2 << 20)
    assert findings(tmp_path / "split", "specdec") == []
    assert one(findings(tmp_path / "split", "vllm"), "error", "only specdec joins")


def test_import_errors_name_the_fix(tmp_path):
    write_published_head(tmp_path / "h", research_config(), torch.float32, seed=6)
    with pytest.raises(ValueError, match=r"does not name its target model.*pass --target"):
        import_head(tmp_path / "h", tmp_path / "out")
    config = research_config(vocab_size=32000)
    (tmp_path / "h/config.json").write_text(json.dumps(config))
    with pytest.raises(HeadImportError, match="vocab_size=32000 but the target has"):
        import_head(tmp_path / "h", tmp_path / "out", target=SMOLLM2)
