"""A block drafter continued from a trained one (``model.drafter=block`` with
``model.init_head``, train/block_init.py) on a tiny random target: the run starts from the
saved weights, as saved in fp32 or halved to bf16 by ``specdec import --dtype bfloat16``,
with the head's vocabulary and shape; a checkpoint in output_dir still wins; settings the
head cannot take are refused, naming the value and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prompts import QUESTIONS
from tiny_models import make_tiny_model_dir

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.config import SpeculativeConfig
from specdec.data_gen.dump import DumpConfig, run_dump
from specdec.data_gen.regenerate import RegenerateConfig, run_regenerate
from specdec.data_gen.shards import RankInfo
from specdec.data_gen.vocab import VocabConfig, run_vocab
from specdec.models.block_drafter_formats import load_block_drafter
from specdec.train.block_init import check_init_drafter
from specdec.train.config import TrainConfig
from specdec.train.model import TargetIO
from specdec.train.trainer import DRAFTERS, train

ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 32 << 20, "max_num_seqs": 8}
AUX = (1, 2, 3)  # a 4-layer target: the streams entering layers 1-3


@pytest.fixture(scope="module")
def data(tmp_path_factory, smollm2_dir) -> Path:
    """A 4-layer random target with SmolLM2's tokenizer, its greedy answers dumped in
    fp32 (aux layers 1-3) over several shards, and a 128-token draft vocabulary."""
    root = tmp_path_factory.mktemp("block_init_data")
    target = root / "target"
    target.mkdir()
    make_tiny_model_dir(target, smollm2_dir, seed=0, num_layers=4)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q}) + "\n"
                               for i, q in enumerate(QUESTIONS)))  # fmt: skip
    run_regenerate(RegenerateConfig(input=str(prompts), output=str(root / "regen"),
                                    model=str(target), engine={**ENGINE, "max_model_len": 256},
                                    temperature=0.0, max_tokens=32, records_per_shard=2),
                   RankInfo())  # fmt: skip
    run_dump(DumpConfig(input=str(root / "regen"), output=str(root / "dump"), model=str(target),
                        dtype="float32", compute_dtype="float32", aux_layer_ids=AUX,
                        shard_bytes=1 << 16, batch_tokens=1024),
             RankInfo())  # fmt: skip
    run_vocab(VocabConfig(inputs=(str(root / "dump"),), output=str(root), draft_vocab_size=128))
    return root


def config(root: Path, out: Path, **sections) -> TrainConfig:
    """A block drafter run on the tiny target; its shape (block size, layers, MLP width)
    is the defaults' or model.init_head's unless ``sections`` set it (``SHAPE``)."""
    base = {
        "model": {"target": str(root / "target"), "drafter": "block"},
        "block": {"anchors": 16},
        "data": {"path": str(root / "dump"), "max_tokens": 256, "eval_shards": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 1, "max_steps": 6},
        "run": {"output_dir": str(out), "save_every": 100, "eval_every": 100, "log_every": 1,
                "wandb": "disabled"},
    }  # fmt: skip
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return TrainConfig.from_dict(base)


SHAPE = {"model": {"num_layers": 1, "intermediate_size": 96}, "block": {"block_size": 8}}


def eval_loss(out: Path, step: int) -> float:
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return next(e["eval/loss"] for e in lines if "eval/loss" in e and e["step"] == step)


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> tuple[Path, Path]:
    """A drafter trained 6 steps (its head in fp32), and the same head in bf16."""
    out = tmp_path_factory.mktemp("block_run")
    assert train(config(data, out, **SHAPE))["step"] == 6
    half = out / "head-bf16"
    assert main(["import", str(out / "head"), str(half), "--dtype", "bfloat16"]) == 0
    return out, half


def weights(head_dir: Path, data: Path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    target = TargetIO.load(str(data / "target")).config
    return load_block_drafter(head_dir, target_config=target, dtype=dtype).state_dict()


@pytest.mark.parametrize("saved", ["float32", "bfloat16"])
def test_init_head_starts_from_the_saved_weights(trained, data, tmp_path, saved):
    """The built drafter holds the saved weights in fp32 master weights (bf16-rounded
    where the head was saved in bf16), with the head's vocabulary, block size, mask token,
    layers and MLP width, none of them set in the config."""
    out, half = trained
    head_dir = out / "head" if saved == "float32" else half
    cfg = config(data, tmp_path, model={"init_head": str(head_dir)})
    target = TargetIO.load(cfg.model.target)
    head = DRAFTERS["block"].build(cfg, target, torch.device("cpu"), AUX, lambda: None).head
    saved_state = weights(out / "head", data)
    built = head.state_dict()
    assert built.keys() == saved_state.keys()
    for key, value in saved_state.items():
        if value.is_floating_point():
            assert built[key].dtype == torch.float32, key
            want = value if saved == "float32" else value.to(torch.bfloat16).float()
        else:
            want = value
        assert torch.equal(built[key], want), key
    c = head.config
    assert (c.block_size, c.num_layers, c.intermediate_size, c.mask_token_id) == (8, 1, 96, 16)
    assert c.draft_vocab_size == 128 and c.aux_layer_ids == AUX


def test_a_continued_run_begins_where_the_trained_one_ended(trained, data, tmp_path):
    """Its step-0 evaluation (the same held-out anchors) equals the trained run's last,
    and is below a fresh drafter's; the run trains on and saves a head of the same shape.
    Deepened by a layer (new layers start silent) it still begins there."""
    out, _ = trained
    ended = eval_loss(out, 6)
    assert ended < eval_loss(out, 0)
    cont = config(data, tmp_path / "cont", model={"init_head": str(out / "head")},
                 optim={"max_steps": 2})  # fmt: skip
    assert train(cont)["step"] == 2
    assert eval_loss(tmp_path / "cont", 0) == pytest.approx(ended, rel=1e-5)
    assert weights(tmp_path / "cont/head", data).keys() == weights(out / "head", data).keys()
    deep = config(data, tmp_path / "deep", model={"init_head": str(out / "head"), "num_layers": 2},
                 optim={"max_steps": 1})  # fmt: skip
    train(deep)
    assert eval_loss(tmp_path / "deep", 0) == pytest.approx(ended, rel=1e-5)


def test_an_online_run_computes_the_heads_aux_layers(trained, data, tmp_path):
    """Online, without model.aux_layer_ids, the target's forward gives the continued
    drafter the layers it was trained on (EAGLE-3's default would be another set)."""
    cfg = config(data, tmp_path, model={"init_head": str(trained[0] / "head")},
                 data={"mode": "online", "path": str(data / "regen"), "eval_records": 2},
                 optim={"max_steps": 1})  # fmt: skip
    assert train(cfg)["step"] == 1
    target = TargetIO.load(cfg.model.target).config
    assert load_block_drafter(tmp_path / "head", target_config=target).config.aux_layer_ids == AUX


def test_a_checkpoint_in_output_dir_wins_over_init_head(trained, data, tmp_path):
    """A run continued from the bf16 head, stopped after step 1 and rerun naming the fp32
    head as model.init_head, ends with the head of a run continued from the bf16 head that
    never stopped: the checkpoint, not the init head, holds the weights it resumes from."""
    out, half = trained
    steps = {"optim": {"max_steps": 3}}
    train(config(data, tmp_path / "straight", model={"init_head": str(half)}, **steps))
    stopped = config(data, tmp_path / "resumed", model={"init_head": str(half)}, **steps,
                     run={"time_limit_s": 1e-6})  # fmt: skip
    assert train(stopped)["step"] == 1
    rerun = config(data, tmp_path / "resumed", model={"init_head": str(out / "head")}, **steps)
    assert train(rerun)["step"] == 3
    a, b = weights(tmp_path / "straight/head", data), weights(tmp_path / "resumed/head", data)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)


def test_init_head_under_another_vocabulary_carries_rows_by_token(trained, data, tmp_path):
    """model.vocab beside model.init_head (default_head.sh's NEW_VOCAB=1): the drafter
    drafts the new vocabulary; each token both keep takes its trained lm_head row."""
    out, _ = trained
    other = tmp_path / "vocab.safetensors"
    run_vocab(VocabConfig(inputs=(str(data / "dump"),), output=str(other), draft_vocab_size=64))
    cfg = config(data, tmp_path, model={"init_head": str(out / "head"), "vocab": str(other)})
    head = DRAFTERS["block"].build(cfg, TargetIO.load(cfg.model.target), torch.device("cpu"),
                                   AUX, lambda: None).head  # fmt: skip
    saved = weights(out / "head", data)
    old = torch.arange(128) + saved["d2t"]
    new = torch.arange(64) + head.d2t
    shared = [(int((old == t).nonzero()), i) for i, t in enumerate(new.tolist()) if t in old]
    assert head.d2t.shape == (64,) and len(shared) > 32
    for o, i in shared:
        assert torch.equal(head.lm_head.weight[i], saved["lm_head.weight"][o])


def test_settings_the_head_cannot_take_are_refused(trained, data, tmp_path):
    head_dir = str(trained[0] / "head")
    target = TargetIO.load(str(data / "target"))

    def build(**sections):
        cfg = config(data, tmp_path, **sections)
        DRAFTERS["block"].build(cfg, target, torch.device("cpu"), AUX, lambda: None)

    init = {"init_head": head_dir}
    with pytest.raises(ValueError, match=r"block.block_size=16 but model.init_head was trained "
                       r"with block_size 8; set block.block_size=8 or null"):  # fmt: skip
        build(model=init, block={"block_size": 16})
    with pytest.raises(ValueError, match=r"block.mask_token_id=17 .* mask_token_id 16; set "
                       r"block.mask_token_id=16"):  # fmt: skip
        build(model=init, block={"mask_token_id": 17})
    with pytest.raises(ValueError, match=r"block.target_lm_head=true but model.init_head "
                       r"drafts over a pruned vocabulary"):  # fmt: skip
        build(model=init, block={"target_lm_head": True})
    with pytest.raises(ValueError, match=r"intermediate_size=48 is narrower than "
                       r"model.init_head's MLP \(96\)"):  # fmt: skip
        build(model={**init, "intermediate_size": 48})
    with pytest.raises(ValueError, match=r"model.variant='eagle3' is an EAGLE-3 setting"):
        build(model={**init, "variant": "eagle3"})
    with pytest.raises(ValueError, match=r"model.init_head=.* is not a block drafter directory"):
        build(model={"init_head": str(data / "target")})
    drafter = load_block_drafter(head_dir, target_config=target.config)
    cfg = config(data, tmp_path, model=init)
    other_layers = (r"model.init_head reads aux layers \[1, 2, 3\] but the run trains on "
                    r"\[1, 2\]; .*model.aux_layer_ids=\[1, 2, 3\]")  # fmt: skip
    with pytest.raises(ValueError, match=other_layers):
        check_init_drafter(cfg, drafter, (1, 2))


def test_the_engine_drafts_with_the_bf16_head(trained, data):
    """The halved head serves (``--draft dflash``) on an fp32 engine: greedy output
    equals plain decoding."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(30, 50))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = []
    for spec in (None, SpeculativeConfig(method="dflash", model=str(trained[1]))):
        llm = LLM(str(data / "target"), **ENGINE, max_model_len=128, speculative=spec)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)])  # fmt: skip
        if spec is not None:
            assert llm.engine.spec_stats.steps > 0
    assert outs[1] == outs[0]
