"""The EAGLE-3 head computes the published formula; its checkpoints round-trip and fail loudly.

A random head over a tiny target runs prefill and decode steps on a paged cache with
scattered blocks; after a save and load in each of the three formats the draft logits are
bit-identical. A plain-PyTorch re-implementation (no paged cache, unfused weights read from
the saved checkpoint) pins the 2H attention input, the residual wiring and the RoPE.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdec.attention import get_attention_backend
from specdec.models import ModelConfig, WeightLoadError
from specdec.models.eagle3_formats import (
    MAX_SHARD_BYTES,
    detect_format,
    entering_to_output_ids,
    load_eagle3,
    output_to_entering_ids,
    save_eagle3,
)
from specdec.models.eagle3_head import (
    Eagle3Config,
    Eagle3Head,
    default_aux_layer_ids,
    validate_vocab_map,
)
from specdec.models.tree_defaults import TreeDefaults
from specdec.ops.attention_metadata import AttentionMetadata

BLOCK_SIZE = 4
FORMATS = ("specdec", "eagle", "speculators")


def target_config(**overrides) -> ModelConfig:
    hf = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
    )
    return ModelConfig.from_hf({**hf, **overrides})


def kept_ids(target_vocab: int, draft_vocab: int, seed: int) -> torch.Tensor:  # sorted
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(target_vocab, generator=gen)[:draft_vocab].sort().values


def vocab_map(kept: torch.Tensor, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = kept - torch.arange(kept.shape[0])
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def random_head(
    target: ModelConfig,
    draft_vocab: int = 40,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> tuple[Eagle3Head, torch.nn.Embedding]:
    """A head with O(1) activations, non-trivial norms and a random sorted vocab map."""
    config = Eagle3Config.for_target(
        target,
        draft_vocab,
        target_name="tiny/target",
        tree=TreeDefaults("chain", 4),
    )
    if config_overrides:
        config = Eagle3Config(**{**config.__dict__, **config_overrides})
    embed = torch.nn.Embedding(target.vocab_size, target.hidden_size)
    head = Eagle3Head(config, get_attention_backend("torch"), embed=embed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape, generator=gen))
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    head.set_vocab_map(
        *vocab_map(kept_ids(target.vocab_size, draft_vocab, seed), target.vocab_size)
    )
    return head.to(dtype), embed


def run_steps(head: Eagle3Head, target: ModelConfig, seed: int = 0) -> list[torch.Tensor]:
    """Two sequences: a varlen prefill (5 and 3 tokens; ``hidden`` = fuse(aux)), then three
    decode steps that feed each step's pre-norm output back. Returns every step's logits."""
    gen = torch.Generator().manual_seed(seed)
    dtype = head.lm_head.weight.dtype
    c = head.config
    shape = (32, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
          for _ in range(c.num_layers)]  # fmt: skip
    free = list(range(1, 32))
    random.Random(seed).shuffle(free)
    tables: list[list[int]] = [[], []]
    lens = [0, 0]
    logits_per_step = []
    q_lens = [5, 3]
    aux = torch.randn(sum(q_lens), 3 * c.hidden_size, generator=gen).to(dtype)
    hidden = head.fuse(aux)
    for _step in range(4):
        ids = torch.randint(0, target.vocab_size, (sum(q_lens),), generator=gen)
        positions, slots = [], []
        for s, q_len in enumerate(q_lens):
            while len(tables[s]) * BLOCK_SIZE < lens[s] + q_len:
                tables[s].append(free.pop())
            for pos in range(lens[s], lens[s] + q_len):
                positions.append(pos)
                slots.append(tables[s][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            lens[s] += q_len
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]).int(),
            max_query_len=max(q_lens),
            max_seq_len=max(lens),
            query_lens_cpu=list(q_lens),
            seq_lens_cpu=list(lens),
        )
        with torch.no_grad():
            out, logits = head(ids, hidden, torch.tensor(positions), kv, meta)
        assert out.shape == (sum(q_lens), c.hidden_size)
        assert logits.shape == (sum(q_lens), c.draft_vocab_size)
        assert logits.dtype == torch.float32
        logits_per_step.append(logits)
        ends = list(accumulate(q_lens))
        hidden = out[[e - 1 for e in ends]]  # each sequence drafts on from its last row
        q_lens = [1, 1]
    return logits_per_step


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_load_gives_identical_logits(fmt: str, tmp_path: Path) -> None:
    target = target_config()
    head, embed = random_head(target)
    save_eagle3(head, tmp_path / fmt, fmt)
    assert detect_format(tmp_path / fmt) == fmt
    loaded = load_eagle3(tmp_path / fmt, target_config=target, embed=embed)

    for a, b in zip(run_steps(head, target), run_steps(loaded, target), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    got, want = loaded.config, head.config
    assert got.aux_layer_ids == want.aux_layer_ids == (2, 4, 5)
    assert (got.rope_theta, got.draft_vocab_size) == (5000.0, 40)
    assert got.target_name == ("" if fmt == "eagle" else "tiny/target")
    assert got.tree == (None if fmt == "eagle" else TreeDefaults("chain", 4))
    assert "embed_tokens.weight" not in _stored_keys(tmp_path / fmt)


def test_formats_write_what_other_tools_read(tmp_path: Path) -> None:
    target = target_config()
    head, _ = random_head(target)
    for fmt in FORMATS:
        save_eagle3(head, tmp_path / fmt, fmt)
    ours = json.loads((tmp_path / "specdec/config.json").read_text())
    eagle = json.loads((tmp_path / "eagle/config.json").read_text())
    spec = json.loads((tmp_path / "speculators/config.json").read_text())
    # vLLM numbering on top, SGLang/SpecForge numbering in eagle_config.
    assert ours["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert ours["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert eagle["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert "eagle_aux_hidden_state_layer_ids" not in eagle
    assert ours["architectures"] == eagle["architectures"] == ["LlamaForCausalLMEagle3"]
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert spec["norm_before_residual"] is False  # vLLM assumes true when absent
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "tiny/target"
    assert spec["transformer_layer_config"]["vocab_size"] == 96
    research_keys = _stored_keys(tmp_path / "eagle")
    assert research_keys == _stored_keys(tmp_path / "specdec")  # no split at this size
    assert {"midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight"} <= research_keys
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= research_keys
    spec_keys = _stored_keys(tmp_path / "speculators")
    assert spec_keys == {k.replace("midlayer.", "layers.0.") for k in research_keys}


VARIANTS = {
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "norm_before_fc": {"norm_before_fc": True},
    "all": {"fc_norm": True, "norm_output": True, "norm_before_fc": True},
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_round_trip_in_every_format(fmt: str, variant: str, tmp_path: Path) -> None:
    """EAGLE-3.1 and speculators' norm_before_fc: config.json carries the switches where
    vLLM reads them, the norms are stored under vLLM's names, and the head loads back
    drafting the same logits over steps that feed each step's output back."""
    target = target_config()
    flags = VARIANTS[variant]
    head, embed = random_head(target, **flags)
    save_eagle3(head, tmp_path / fmt, fmt)
    loaded = load_eagle3(tmp_path / fmt, target_config=target, embed=embed)
    for flag in ("fc_norm", "norm_output", "norm_before_fc"):
        assert getattr(loaded.config, flag) == flags.get(flag, False)
    assert loaded.config.variant == ("eagle3.1" if variant == "eagle3.1" else
                                     "eagle3+" + "+".join(flags))  # fmt: skip
    for a, b in zip(run_steps(head, target), run_steps(loaded, target), strict=True):
        assert torch.equal(a, b)
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    for flag, value in flags.items():
        assert config[flag] is value
    keys = _stored_keys(tmp_path / fmt)
    assert ({f"fc_norm.{i}.weight" for i in range(3)} <= keys) == bool(flags.get("fc_norm"))
    assert ("input_norm.weight" in keys) == bool(flags.get("norm_before_fc"))


def test_validation_names_the_readers_an_eagle3_1_head_does_not_suit(tmp_path: Path) -> None:
    """EAGLE builds EAGLE-3 proper: an error naming the variant and the fix. SGLang may
    lack EAGLE-3.1 support (it skips unknown keys): a warning. vLLM and specdec: fine."""
    from specdec.interop.validate import validate_head

    target = target_config()
    head, _ = random_head(target, fc_norm=True, norm_output=True)
    save_eagle3(head, tmp_path / "h", "eagle")
    eagle = validate_head(tmp_path / "h", "eagle", target=target)
    assert any("eagle3.1 head" in f.problem and "vllm" in f.fix for f in eagle.errors)
    sglang = validate_head(tmp_path / "h", "sglang", target=target)
    assert sglang.ok and any("fc_norm" in f.problem for f in sglang.warnings)
    save_eagle3(head, tmp_path / "ours")
    for consumer in ("vllm", "specdec"):
        report = validate_head(tmp_path / "ours", consumer, target=target)
        assert report.ok and not any("eagle3.1" in f.problem for f in report.warnings)


def test_eagle3_1_norms_each_aux_state_and_feeds_back_the_post_norm_output() -> None:
    """EAGLE-3.1 against EAGLE-3 with the same weights: ``fuse`` is fc over each aux state
    normed by its own fc_norm, and a step's ``out`` is the EAGLE-3 output after ``norm``
    (so the next step reads what the logits read); the logits themselves are EAGLE-3's
    for the same input hidden."""
    target = target_config()
    head31, embed = random_head(target, fc_norm=True, norm_output=True)
    head3 = Eagle3Head(replace(head31.config, fc_norm=False, norm_output=False),
                       get_attention_backend("torch"), embed=embed)  # fmt: skip
    head3.load_state_dict(
        {k: v for k, v in head31.state_dict().items() if not k.startswith("fc_norm.")}
    )
    c = head31.config
    aux = torch.randn(3, 3 * c.hidden_size, generator=torch.Generator().manual_seed(1))
    w = [n.weight for n in head31.fc_norm]
    chunks = aux.split(c.hidden_size, dim=-1)
    want = torch.cat([rms(x, wi, c.rms_norm_eps) for x, wi in zip(chunks, w, strict=True)], -1)
    with torch.no_grad():
        torch.testing.assert_close(head31.fuse(aux), head31.fc(want), atol=1e-6, rtol=1e-6)
        hidden = head3.fuse(aux)
        assert not torch.allclose(head31.fuse(aux), hidden)
    k_cache = torch.zeros(4, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    meta = three_token_meta()
    ids, pos = torch.tensor([11, 42, 7]), torch.tensor([4, 5, 6])
    outs = []
    for head in (head3, head31):
        k_cache.zero_()
        with torch.no_grad():
            outs.append(head(ids, hidden, pos, [(k_cache, torch.zeros_like(k_cache))], meta))
    (out3, logits3), (out31, logits31) = outs
    torch.testing.assert_close(logits31, logits3, atol=1e-6, rtol=1e-6)
    want_out = rms(out3, head3.norm.weight, c.rms_norm_eps)
    torch.testing.assert_close(out31, want_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["specdec", "speculators"])
def test_a_deeper_head_round_trips_with_vllms_layer_names(fmt: str, tmp_path: Path) -> None:
    """A 3-layer head (vLLM's multi-layer EAGLE-3 drafter): config.json says
    num_hidden_layers 3, the layers after the first are stored as layers.1.* and
    layers.2.* (midlayer.* is vLLM's layers.0.*), and it loads back drafting the same
    logits, its layers each on its own K/V. The research format (SGLang, EAGLE: one
    layer) refuses it, and validation for SGLang names the fix."""
    from specdec.interop.validate import validate_head

    target = target_config()
    head, embed = random_head(target, num_layers=3)
    assert len(head.decoder_layers) == 3
    save_eagle3(head, tmp_path / fmt, fmt)
    loaded = load_eagle3(tmp_path / fmt, target_config=target, embed=embed)
    assert loaded.config.num_layers == 3
    for a, b in zip(run_steps(head, target), run_steps(loaded, target), strict=True):
        assert torch.equal(a, b)
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    assert layer["num_hidden_layers"] == 3
    keys = _stored_keys(tmp_path / fmt)
    first = "midlayer." if fmt == "specdec" else "layers.0."
    assert {f"{first}hidden_norm.weight", "layers.1.self_attn.q_proj.weight",
            "layers.2.mlp.down_proj.weight"} <= keys  # fmt: skip
    assert not any(k.startswith(("layers.1.hidden_norm", "layers.2.hidden_norm")) for k in keys)
    # The extra layers change what the head drafts (they are not dead weight).
    one = Eagle3Head(replace(head.config, num_layers=1), get_attention_backend("torch"),
                     embed=embed)  # fmt: skip
    one.load_state_dict({k: v for k, v in head.state_dict().items()
                         if not k.startswith("layers.")})  # fmt: skip
    assert not torch.equal(run_steps(one, target)[-1], run_steps(head, target)[-1])
    with pytest.raises(ValueError, match="build exactly one"):
        save_eagle3(head, tmp_path / "eagle", "eagle")
    errors = validate_head(tmp_path / fmt, "sglang", target=target).errors
    assert any(f.where == "config.json: num_hidden_layers" for f in errors)
    assert validate_head(tmp_path / fmt, "specdec", target=target).ok


@pytest.mark.parametrize(
    ("num_layers", "dynamic"), [(1, None), (2, None), (1, True)], ids=["1", "2", "1-dynamic"]
)
def test_compiled_regions_draft_as_the_eager_head(num_layers: int, dynamic: bool | None) -> None:
    """``compile_regions`` (what the proposer's CUDA graphs run) compiles every layer:
    ``forward(compiled=True)`` gives the eager logits (the eager backend on CPU). With
    symbolic shapes too (``dynamic=True``; dynamo also makes dims dynamic after a
    recompile in a long process), where the head counts read off shapes are SymInts."""
    target = target_config()
    head, _ = random_head(target, num_layers=num_layers)
    eager = run_steps(head, target)
    head.compile_regions(backend="eager", fullgraph=True, dynamic=dynamic)
    forward = head.forward
    head.forward = lambda *args, **kw: forward(*args, **kw, compiled=True)  # what graphs call
    assert len(head.__dict__["_compiled"][0]) == num_layers
    for a, b in zip(eager, run_steps(head, target), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def _stored_keys(path: Path) -> set[str]:
    keys: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


# ----------------------------------------------------------------------- shards


def test_small_shard_limit_splits_tensors_and_round_trips(tmp_path: Path) -> None:
    target = target_config()
    head, embed = random_head(target)
    limit = 16 * 1024  # fc (48 KiB) and q_proj (32 KiB) must be split by rows
    save_eagle3(head, tmp_path, max_shard_bytes=limit)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 4 and all(f.stat().st_size <= limit for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["split_tensors"]["fc.weight"] >= 3
    assert set(index["weight_map"].values()) == {f.name for f in files}
    loaded = load_eagle3(tmp_path, target_config=target, embed=embed)
    for (name, p), (_, q) in zip(
        head.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name


def test_default_shards_stay_under_16_mb(tmp_path: Path) -> None:
    # A bf16 lm_head of 8200 x 1024 is 16.4 MB: larger than one shard on its own.
    target = target_config(
        vocab_size=8300, hidden_size=1024, intermediate_size=128, num_attention_heads=8
    )
    head, embed = random_head(target, draft_vocab=8200, dtype=torch.bfloat16)
    assert head.lm_head.weight.numel() * 2 > MAX_SHARD_BYTES
    save_eagle3(head, tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) >= 2 and all(f.stat().st_size <= MAX_SHARD_BYTES for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["metadata"]["split_tensors"]
    loaded = load_eagle3(tmp_path, target_config=target, dtype=torch.bfloat16, embed=embed)
    assert torch.equal(loaded.lm_head.weight, head.lm_head.weight)
    assert torch.equal(
        loaded.midlayer.self_attn.qkv_proj.weight, head.midlayer.self_attn.qkv_proj.weight
    )


# --------------------------------------------------------------- aux-layer ids


@pytest.mark.parametrize("num_layers", [30, 32])
def test_aux_layer_ids_convert_between_conventions(num_layers: int) -> None:
    entering = default_aux_layer_ids(num_layers)
    assert entering == (2, num_layers // 2, num_layers - 3)
    output = entering_to_output_ids(entering, num_layers)
    assert output == [1, num_layers // 2 - 1, num_layers - 4]  # SGLang/SpecForge default
    assert output_to_entering_ids(output, num_layers) == entering
    with pytest.raises(ValueError, match="outside"):
        entering_to_output_ids([2, 15, num_layers], num_layers)
    with pytest.raises(ValueError, match="outside"):
        output_to_entering_ids([1, 14, num_layers - 1], num_layers)


def test_research_ids_read_in_sglang_numbering(tmp_path: Path) -> None:
    """A SpecForge-style config (only eagle_config ids, output index) and an EAGLE-upstream
    style one (no ids, no rope_theta, no head_dim) load with the right layers and RoPE."""
    target = target_config()
    head, _ = random_head(target, aux_layer_ids=(1, 3, 6))
    save_eagle3(head, tmp_path / "h", "eagle")
    config_file = tmp_path / "h/config.json"
    config = json.loads(config_file.read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    assert load_eagle3(tmp_path / "h", target_config=target).config.aux_layer_ids == (1, 3, 6)

    for key in ("eagle_config", "rope_theta", "head_dim"):
        config.pop(key)
    config_file.write_text(json.dumps(config))
    upstream = load_eagle3(tmp_path / "h", target_config=target).config
    assert upstream.aux_layer_ids == (2, 4, 5)  # EAGLE's hard-coded (2, N//2, N-3)
    assert (upstream.rope_theta, upstream.head_dim) == (10000.0, 16)  # HF Llama defaults

    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    config_file.write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match="disagree"):
        load_eagle3(tmp_path / "h", target_config=target)


# ------------------------------------------------------------- draft vocabulary


def test_vocab_map_invariants() -> None:
    kept = kept_ids(96, 40, seed=3)
    d2t, t2d = vocab_map(kept, 96)
    validate_vocab_map(d2t, t2d)
    head, _ = random_head(target_config(), seed=3)
    draft_ids = torch.tensor([[0, 39], [7, 12]])
    assert torch.equal(head.draft_to_target(draft_ids), kept[draft_ids])

    beyond = d2t.clone()
    beyond[-1] = 96 - 39  # draft id 39 -> target id 96, one past the vocabulary
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        validate_vocab_map(beyond, t2d)
    swapped = vocab_map(kept[[1, 0, *range(2, 40)]], 96)[0]
    with pytest.raises(ValueError, match="not strictly ascending"):
        validate_vocab_map(swapped, t2d)
    extra = t2d.clone()
    extra[(~t2d).nonzero()[0]] = True
    with pytest.raises(ValueError, match="t2d marks 41 target ids, d2t keeps 40"):
        validate_vocab_map(d2t, extra)
    moved = extra.clone()
    moved[kept[5]] = False
    with pytest.raises(ValueError, match=f"target id {int(kept[5])} \\(draft id 5\\)"):
        validate_vocab_map(d2t, moved)


def test_load_rejects_a_corrupt_vocab_map(tmp_path: Path) -> None:
    target = target_config()
    head, _ = random_head(target)
    save_eagle3(head, tmp_path, "eagle")
    tensors = load_file(tmp_path / "model.safetensors")
    t2d = tensors["t2d"].clone()
    t2d[(~t2d).nonzero()[0]] = True
    save_file({**tensors, "t2d": t2d}, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"invalid draft vocabulary.*t2d marks 41"):
        load_eagle3(tmp_path, target_config=target)


def test_missing_vocab_map_means_the_full_vocabulary(tmp_path: Path) -> None:
    """EAGLE drops d2t/t2d when the draft vocabulary is the target's: identity map then;
    with a reduced draft vocabulary their absence is an error."""
    target = target_config()
    for draft_vocab in (96, 40):
        head, _ = random_head(target, draft_vocab=draft_vocab)
        out = tmp_path / str(draft_vocab)
        save_eagle3(head, out, "eagle")
        tensors = load_file(out / "model.safetensors")
        save_file(
            {k: t for k, t in tensors.items() if k not in ("d2t", "t2d")}, out / "model.safetensors"
        )
        if draft_vocab == 40:
            with pytest.raises(WeightLoadError, match=r"missing.*d2t, t2d"):
                load_eagle3(out, target_config=target)
            continue
        loaded = load_eagle3(out, target_config=target)
        assert torch.equal(loaded.d2t, torch.zeros(96, dtype=torch.int64))
        assert bool(loaded.t2d.all())
        assert torch.equal(loaded.draft_to_target(torch.tensor([0, 95])), torch.tensor([0, 95]))


# ------------------------------------------------------------------ load errors


def test_load_names_bad_shapes_targets_and_pickles(tmp_path: Path) -> None:
    target = target_config()
    head, _ = random_head(target)
    save_eagle3(head, tmp_path / "h", "eagle")
    config_file = tmp_path / "h/config.json"
    good = json.loads(config_file.read_text())

    config_file.write_text(json.dumps({**good, "intermediate_size": 80}))
    with pytest.raises(
        WeightLoadError, match=r"midlayer.mlp.gate_proj.weight .*\(96, 64\).*\(80, 64\)"
    ):
        load_eagle3(tmp_path / "h", target_config=target)
    config_file.write_text(json.dumps(good))
    with pytest.raises(WeightLoadError, match="another target"):
        load_eagle3(tmp_path / "h", target_config=target_config(hidden_size=128))
    with pytest.raises(WeightLoadError, match="outside"):
        load_eagle3(tmp_path / "h", target_config=target_config(num_hidden_layers=4))

    config_file.write_text(json.dumps({**good, "eagle_config": {"use_aux_hidden_state": False}}))
    with pytest.raises(WeightLoadError, match="use_aux_hidden_state=false"):
        load_eagle3(tmp_path / "h", target_config=target)
    config_file.write_text(json.dumps(good))
    tensors = load_file(tmp_path / "h/model.safetensors")
    save_file({**tensors, "midlayer.extra.weight": torch.ones(2)}, tmp_path / "h/model.safetensors")
    with pytest.raises(WeightLoadError, match=r"unexpected weights.*midlayer\.extra\.weight"):
        load_eagle3(tmp_path / "h", target_config=target)
    save_file(tensors, tmp_path / "h/model.safetensors")

    save_eagle3(head, tmp_path / "s", "speculators")
    spec_file = tmp_path / "s/config.json"
    spec = json.loads(spec_file.read_text())
    spec_file.write_text(json.dumps({**spec, "fc_norm": "yes"}))
    with pytest.raises(WeightLoadError, match="fc_norm='yes'; it is true or false"):
        load_eagle3(tmp_path / "s", target_config=target)
    spec_file.write_text(json.dumps({**spec, "fc_norm": True}))  # an EAGLE-3 head's weights
    with pytest.raises(WeightLoadError, match=r"fc_norm\.0\.weight"):
        load_eagle3(tmp_path / "s", target_config=target)

    (tmp_path / "h/model.safetensors").rename(tmp_path / "h/pytorch_model.bin")
    with pytest.raises(WeightLoadError, match=r"safetensors.*pytorch_model\.bin"):
        load_eagle3(tmp_path / "h", target_config=target)


# --------------------------------------------------- the formula, re-implemented


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """HF Llama RoPE: x [..., tokens, d] at positions pos [tokens]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.cat([pos[:, None].float() * inv_freq] * 2, dim=-1)  # [tokens, d]
    x1, x2 = x.chunk(2, dim=-1)
    return x * ang.cos() + torch.cat((-x2, x1), dim=-1) * ang.sin()


def three_token_meta() -> AttentionMetadata:
    """One sequence of 3 tokens at cache indices 0..2 in block 2 (slots 8..10), no
    earlier context."""
    return AttentionMetadata(
        slot_mapping=torch.tensor([8, 9, 10]),
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        block_tables=torch.tensor([[2]], dtype=torch.int32),
        max_query_len=3,
        max_seq_len=3,
        query_lens_cpu=[3],
        seq_lens_cpu=[3],
    )


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_forward_matches_plain_formula(norm_before_residual: bool, tmp_path: Path) -> None:
    """The last token of a 3-token draft context, recomputed from the saved research-format
    weights: attention reads cat(input_layernorm(embed), hidden_norm(h)), residual is h
    (or hidden_norm(h)), and hidden at the first step is fc(aux)."""
    target = target_config()
    head, embed = random_head(target, norm_before_residual=norm_before_residual)
    c = head.config
    gen = torch.Generator().manual_seed(5)
    ids, pos = torch.tensor([11, 42, 7]), torch.tensor([4, 5, 6])
    aux = torch.randn(3, 3 * c.hidden_size, generator=gen)

    # RoPE positions 4..6 at cache indices 0..2 (as for tree nodes: positions come in
    # through ``positions``, never through the metadata), in block 2.
    k_cache = torch.zeros(4, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    meta = three_token_meta()
    with torch.no_grad():
        out, logits = head(ids, head.fuse(aux), pos, [(k_cache, torch.zeros_like(k_cache))], meta)

    save_eagle3(head, tmp_path, "eagle")
    w = load_file(tmp_path / "model.safetensors")
    eps, hd = c.rms_norm_eps, c.head_dim
    h = aux @ w["fc.weight"].T  # [3, H]
    normed = rms(h, w["midlayer.hidden_norm.weight"], eps)
    x = torch.cat((rms(embed.weight[ids], w["midlayer.input_layernorm.weight"], eps), normed), -1)
    assert x.shape == (3, 2 * c.hidden_size)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(3, c.num_heads, hd).transpose(0, 1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(3, c.num_kv_heads, hd).transpose(0, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(3, c.num_kv_heads, hd).transpose(0, 1)
    q, k = rotate(q, pos, c.rope_theta), rotate(k, pos, c.rope_theta)
    group = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [heads, 3, hd]
    scores = q[:, -1:] @ k.transpose(1, 2)  # [heads, 1, 3]: the last query sees all keys
    probs = torch.softmax(scores * hd**-0.5, dim=-1)
    attn = (probs @ v).reshape(1, -1)  # [1, heads * hd]
    residual = normed[-1:] if norm_before_residual else h[-1:]
    mid = residual + attn @ w["midlayer.self_attn.o_proj.weight"].T
    up = rms(mid, w["midlayer.post_attention_layernorm.weight"], eps)
    gate = F.silu(up @ w["midlayer.mlp.gate_proj.weight"].T) * (
        up @ w["midlayer.mlp.up_proj.weight"].T
    )
    want_out = mid + gate @ w["midlayer.mlp.down_proj.weight"].T
    want_logits = rms(want_out, w["norm.weight"], eps) @ w["lm_head.weight"].T

    torch.testing.assert_close(out[-1:], want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[-1:], want_logits, atol=1e-5, rtol=1e-5)

    # Projecting chosen rows only gives those rows of the full projection.
    k_cache.zero_()
    rows = torch.tensor([2, 0])
    with torch.no_grad():
        _, some = head(
            ids,
            head.fuse(aux),
            pos,
            [(k_cache, torch.zeros_like(k_cache))],
            meta,
            logits_indices=rows,
        )
    torch.testing.assert_close(some, logits[rows], atol=1e-6, rtol=1e-6)
