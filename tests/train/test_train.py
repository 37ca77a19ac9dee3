"""`specdec train-draft` on real SmolLM2 data: data_gen regenerates greedy answers, dumps
the target's states (fp32) and builds a draft vocabulary; the trainer learns from them,
resumes exactly after a kill, and its head speeds up the engine's speculation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from prompts import QUESTIONS, document
from safetensors.torch import load_file, save_file

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.data_gen.dump import DumpConfig, run_dump
from specdec.data_gen.regenerate import RegenerateConfig, run_regenerate
from specdec.data_gen.shards import RankInfo
from specdec.data_gen.vocab import VocabConfig, run_vocab
from specdec.train import checkpoint
from specdec.train.config import TrainConfig
from specdec.train.loop import KILL_ENV, TimeLimit
from specdec.train.trainer import train

ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 64 << 20, "max_num_seqs": 8}
TOPICS = ["rivers", "chess", "bread", "owls", "volcanoes", "bicycles", "tea", "glaciers"]


def _prompts() -> list[dict]:
    prompts = [{"id": f"q{i}", "prompt": q} for i, q in enumerate(QUESTIONS)]
    prompts += [{"id": f"t{i}", "prompt": f"Write two sentences about {t}."}
                for i, t in enumerate(TOPICS)]  # fmt: skip
    prompts += [{"id": f"d{i}", "prompt": document(1, i) + "\n\nSummarise this."}
                for i in range(2)]  # fmt: skip
    return prompts


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Greedy answers (so the data is what the target itself would emit), an fp32 dump in
    several shards, and a 512-token draft vocabulary next to it."""
    root = tmp_path_factory.mktemp("train_data")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in _prompts()) + "\n")
    regen = RegenerateConfig(
        input=str(prompts), output=str(root / "regen"), engine={**ENGINE, "max_model_len": 512},
        temperature=0.0, max_tokens=32, records_per_shard=4,
    )  # fmt: skip
    run_regenerate(regen, RankInfo())
    dump = DumpConfig(input=str(root / "regen"), output=str(root / "dump"), dtype="float32",
                      compute_dtype="float32", shard_bytes=1 << 20, batch_tokens=2048)  # fmt: skip
    run_dump(dump, RankInfo())
    run_vocab(VocabConfig(inputs=(str(root / "dump"),), output=str(root), draft_vocab_size=512))
    return root


def config(root: Path, out: Path, **sections) -> TrainConfig:
    base = {
        "data": {"path": str(root / "dump"), "max_tokens": 512, "eval_shards": 4},
        "ttt": {"steps": 3},
        "optim": {"lr": 2e-3, "warmup_steps": 5, "max_steps": 12, "grad_accum": 2},
        "run": {"output_dir": str(out), "save_every": 4, "eval_every": 1000, "log_every": 4,
                "wandb": "disabled"},
    }  # fmt: skip
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return TrainConfig.from_dict(base)


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> tuple[Path, dict]:
    """150 optimizer steps; the held-out split evaluated at step 0 (the fresh head) and at
    the end."""
    out = tmp_path_factory.mktemp("run")
    cfg = config(data, out, data={"max_tokens": 256},
                 optim={"max_steps": 150, "grad_accum": 1, "lr": 2e-3},
                 run={"eval_every": 150, "save_every": 150, "log_every": 25})  # fmt: skip
    result = train(cfg)
    return out, result


def test_training_lowers_the_loss_and_lifts_acc0(trained):
    out, result = trained
    entries = [e for e in log(out) if "train/loss" in e]
    fresh = next(e for e in log(out) if "eval/loss" in e and e["step"] == 0)
    # Measured (CPU, fp32, 150 steps on 14 conversations): train loss 15 -> 3.1 and
    # acc_0 0.2 -> 0.92 (first and last 25-step windows); held-out (4 conversations)
    # loss 25 -> 17, acc_0 0.01 -> 0.18, simulated τ 1.01 -> 1.22.
    assert entries[-1]["train/loss"] < 0.3 * entries[0]["train/loss"]
    assert entries[-1]["train/acc_0"] > 0.8
    assert result["eval/loss"] < 0.8 * fresh["eval/loss"]
    assert result["eval/acc_0"] > fresh["eval/acc_0"] + 0.1
    assert result["eval/simulated_tau"] > fresh["eval/simulated_tau"] + 0.1


def test_trained_head_drives_speculation_above_a_random_head(trained, data, random_head_dir):
    """The final head loads in the engine as is and is accepted more often than a random
    one, on the training prompts' chats (what it learned)."""
    out, _ = trained
    chats = [[{"role": "user", "content": p["prompt"]}] for p in _prompts()[:4]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def tau(head: Path) -> tuple[float, list]:
        spec = SpeculativeConfig(method="eagle3", model=str(head), num_speculative_tokens=3)
        llm = LLM("smollm2-135m-instruct", **ENGINE, max_model_len=1024, speculative=spec)
        outs = llm.chat(chats, params, use_tqdm=False)
        return llm.engine.spec_stats.tau, [o.outputs[0].token_ids for o in outs]

    trained_tau, trained_out = tau(out / "head")
    random_tau, random_out = tau(random_head_dir)
    assert trained_out == random_out  # both lossless
    assert trained_tau > random_tau + 0.3


def _run_killed(cfg_path: Path, kill_after: int) -> subprocess.CompletedProcess:
    code = "import sys; from specdec.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, "train-draft", "--config", str(cfg_path)],
        env={**os.environ, KILL_ENV: str(kill_after), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory) -> Path:
    """The default config's run, uninterrupted, in one process: 12 steps of 2 micro-batches."""
    out = tmp_path_factory.mktemp("straight")
    train(config(data, out))
    return out


def _head(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next((out / "head").glob("*.safetensors"))))


def test_kill_and_resume_equals_an_uninterrupted_run(data, straight, tmp_path):
    """SIGKILL after step 6 (last checkpoint: step 4), resume: the final head equals an
    uninterrupted run's to 1e-6 (fp32), and so do the optimizer's moments."""

    resumed = config(data, tmp_path / "resumed")
    cfg_path = tmp_path / "resumed.yaml"
    cfg_path.write_text(json.dumps(resumed.to_dict()))  # JSON is YAML
    proc = _run_killed(cfg_path, kill_after=6)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "resumed")] == ["ckpt-00000004"]
    train(TrainConfig.load(cfg_path))

    a, b = _head(straight), _head(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)
    opt_a = torch.load(straight / "ckpt-00000012" / "optimizer.bin", weights_only=True)
    opt_b = torch.load(tmp_path / "resumed" / "ckpt-00000012" / "optimizer.bin", weights_only=True)
    for sa, sb in zip(opt_a["state"].values(), opt_b["state"].values(), strict=True):
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], atol=1e-6, rtol=0)
    # keep_last=3 of the checkpoints at 4, 8, 12
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "resumed")] == [
        "ckpt-00000004", "ckpt-00000008", "ckpt-00000012"
    ]  # fmt: skip


def test_two_processes_follow_one_process_at_equal_global_batch(data, straight, tmp_path):
    """Data parallelism: 2 processes (torchrun, gloo on CPU) x 1 micro-batch per step
    follow 1 process x 2 micro-batches — the same micro-batches, the mean of the same
    gradients — to float rounding: losses, held-out figures and the final head. The
    held-out split does not divide evenly between the two, which deadlocks the first
    evaluation (DDP's forward is itself a collective) unless every process runs the same
    number of forwards, and breaks its reduction unless the repeated batch is dropped."""
    two = config(data, tmp_path / "two", optim={"grad_accum": 1})
    cfg_path = tmp_path / "two.yaml"
    cfg_path.write_text(json.dumps(two.to_dict()))
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "specdec.cli", "train-draft", "--config", str(cfg_path)]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(run, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one_log, two_log = log(straight), log(tmp_path / "two")
    assert [r["step"] for r in one_log] == [r["step"] for r in two_log]
    for a, b in zip(one_log, two_log, strict=True):
        for key in ("train/loss", "train/tokens", "eval/loss", "eval/tokens", "eval/acc_0"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    a, b = _head(straight), _head(tmp_path / "two")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-5)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"unknown keys \['optim.lrr'\]"):
        TrainConfig.load(None, ["data.path=x", "optim.lrr=1"])
    with pytest.raises(ValueError, match=r"ttt\.steps=0 must be >= 1"):
        TrainConfig.load(None, ["data.path=x", "ttt.steps=0"])
    with pytest.raises(ValueError, match=r"ttt\.argmax_weight=1\.5 must be in \[0, 1\]"):
        TrainConfig.load(None, ["data.path=x", "ttt.argmax_weight=1.5"])
    with pytest.raises(ValueError, match=r"section\.key=value"):
        TrainConfig.load(None, ["lr=1"])
    cfg = TrainConfig.load("configs/train/smollm2.yaml", ["optim.lr=3e-4", "data.path=d"])
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.9, 0.95)
    assert cfg.data.paths == ("d",)
    # Online training reads several regenerate directories; a dump is one directory.
    cfg = TrainConfig.load(None, ["data.mode=online", "data.path=[a/regen,b/regen]"])
    assert cfg.data.paths == ("a/regen", "b/regen")
    with pytest.raises(ValueError, match=r"data\.path=\['a', 'b'\]: offline training reads one"):
        TrainConfig.load(None, ["data.path=[a,b]"])
    with pytest.raises(ValueError, match=r"data\.path is empty"):
        TrainConfig.load(None, ["data.mode=online", "data.path=[a,'']"])


def test_max_seq_len_past_the_targets_context_is_refused(data, tmp_path):
    """Positions past the head's RoPE table are clamped in the TTT unroll (fine for
    padding): a data.max_seq_len that lets tokens with loss reach them is an error."""
    cfg = config(data, tmp_path / "out", data={"max_seq_len": 8193})
    with pytest.raises(ValueError, match=r"data\.max_seq_len=8193 exceeds .* <= 8192"):
        train(cfg)


def test_online_mode_computes_the_dumped_states_and_trains(data, tmp_path):
    """Online mode runs the target in the loop: its batches hold the states the dump
    stored for the same conversations (up to CPU matmul rounding across batch sizes), and
    a short run trains from them."""
    from specdec.data_gen.target import TargetForward
    from specdec.train.data import BatchRef, OfflineShards, OnlineRecords, evenly_spaced

    offline = OfflineShards(data / "dump", max_tokens=4096, max_seq_len=2048, eval_shards=0,
                            seed=0)  # fmt: skip
    forward = TargetForward("smollm2-135m-instruct", device="cpu", dtype=torch.float32)
    online = OnlineRecords(data / "regen", forward, max_tokens=4096, max_seq_len=2048,
                           eval_records=0, seed=0, vocab_size=49152)  # fmt: skip
    first = len(offline.lengths(offline.train_shards[0]))
    a = offline.load(BatchRef(tuple((0, r) for r in range(first)), 0))
    b = online.load(BatchRef(tuple((0, r) for r in range(first)), 0))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    torch.testing.assert_close(b.aux_hidden, a.aux_hidden, rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(b.target_hidden, a.target_hidden, rtol=1e-4, atol=1e-3)

    # The held-out records spread over the file (it is written in groups, e.g. by task),
    # the first and the last included; together with the train split, every record once.
    ids = [r.id for r in online.train]  # eval_records=0: every record trains
    held = OnlineRecords(data / "regen", forward, max_tokens=4096, max_seq_len=2048,
                         eval_records=3, seed=0, vocab_size=49152)  # fmt: skip
    first, middle, last = (r.id for r in held.eval)
    assert (first, last) == (ids[0], ids[-1]) and middle not in (first, last)
    assert sorted(r.id for r in held.train + held.eval) == sorted(ids)
    assert evenly_spaced(10, 3) == [0, 4, 9] and evenly_spaced(5, 9) == [0, 1, 2, 3, 4]
    assert evenly_spaced(5, 0) == []
    # Several directories train as one list, in the order given.
    both = OnlineRecords((str(data / "regen"), data / "regen"), forward, max_tokens=4096,
                         max_seq_len=2048, eval_records=0, seed=0, vocab_size=49152)  # fmt: skip
    assert [r.id for r in both.train] == ids + ids

    cfg = config(data, tmp_path, data={"mode": "online", "path": str(data / "regen"),
                                       "eval_records": 4},
                 model={"vocab": str(data / "vocab.safetensors")},
                 optim={"max_steps": 3, "grad_accum": 1}, run={"save_every": 3})  # fmt: skip
    result = train(cfg)
    assert result["step"] == 3 and (tmp_path / "head" / "config.json").is_file()


def test_time_limit_saves_head_and_checkpoint_and_the_rerun_continues(data, tmp_path):
    """A run past run.time_limit_s stops at the next optimizer step with a checkpoint and
    a loadable head (a job's time limit loses no work); the same command continues."""
    cfg = config(data, tmp_path, optim={"max_steps": 4, "grad_accum": 1},
                 run={"time_limit_s": 1e-6})  # fmt: skip
    result = train(cfg)
    assert result["step"] == 1 and result["time_limited"]
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["ckpt-00000001"]
    assert (tmp_path / "head" / "config.json").is_file()
    result = train(config(data, tmp_path, optim={"max_steps": 4, "grad_accum": 1}))
    assert result["step"] == 4 and not result["time_limited"]
    with pytest.raises(ValueError, match=r"run\.time_limit_s=0"):
        config(data, tmp_path, run={"time_limit_s": 0})


def test_init_head_continues_with_its_own_draft_vocabulary(trained, data, tmp_path):
    """A head's lm_head rows belong to its draft vocabulary: model.init_head alone trains
    on under the head's own d2t/t2d, even where another vocab file sits beside the data
    (e.g. rebuilt from new answers)."""
    head_dir = trained[0] / "head"
    init = {"init_head": str(head_dir)}
    beside = tmp_path / "data"  # the same dump, with a 256-token vocab file beside it
    beside.mkdir()
    (beside / "dump").symlink_to(data / "dump", target_is_directory=True)
    other = beside / "vocab.safetensors"
    run_vocab(VocabConfig(inputs=(str(data / "dump"),), output=str(other), draft_vocab_size=256))
    cfg = config(data, tmp_path / "a", model=init, data={"path": str(beside / "dump")},
                 optim={"max_steps": 1, "grad_accum": 1})  # fmt: skip
    assert train(cfg)["step"] == 1
    saved, original = _head_tensors(tmp_path / "a" / "head"), _head_tensors(head_dir)
    assert torch.equal(saved["d2t"], original["d2t"]) and torch.equal(saved["t2d"], original["t2d"])


def test_init_head_under_another_vocabulary_carries_rows_by_token(trained, data, tmp_path):
    """model.init_head with an explicit model.vocab that keeps other tokens: the run
    drafts the new vocabulary; every target token both keep brings its trained lm_head row
    along (whatever its draft id now), and tokens new to the vocabulary start from the
    target's lm_head rows, as in a fresh head. (A learning rate of 1e-12 leaves the one
    step's update far below the tolerance.)"""
    from specdec.train.model import TargetIO

    head_dir = trained[0] / "head"
    original = _head_tensors(head_dir)
    old_kept = torch.arange(original["d2t"].shape[0]) + original["d2t"]  # [512] target ids
    outside = (~original["t2d"]).nonzero().squeeze(1)[-56:]  # 56 tokens the head never drafts
    kept = torch.cat([old_kept[::2][:200], outside]).sort().values  # [256]: 200 shared
    t2d = torch.zeros_like(original["t2d"])
    t2d[kept] = True
    other = tmp_path / "other.safetensors"
    save_file({"d2t": kept - torch.arange(kept.shape[0]), "t2d": t2d}, str(other))
    cfg = config(data, tmp_path / "run", model={"init_head": str(head_dir), "vocab": str(other)},
                 optim={"max_steps": 1, "grad_accum": 1, "lr": 1e-12})  # fmt: skip
    assert train(cfg)["step"] == 1
    saved = _head_tensors(tmp_path / "run" / "head")
    assert torch.equal(saved["d2t"], kept - torch.arange(kept.shape[0]))
    old_row = {int(t): i for i, t in enumerate(old_kept)}
    shared = [(j, old_row[int(t)]) for j, t in enumerate(kept) if int(t) in old_row]
    new = [j for j, t in enumerate(kept) if int(t) not in old_row]
    assert len(shared) == 200 and len(new) == 56
    rows, old_rows = saved["lm_head.weight"].float(), original["lm_head.weight"].float()
    assert any(j != i for j, i in shared)  # rows moved to other draft ids
    for j, i in shared:
        torch.testing.assert_close(rows[j], old_rows[i], atol=1e-6, rtol=0)
    target_rows = TargetIO.load(cfg.model.target).lm_head.float()
    torch.testing.assert_close(rows[new], target_rows[kept[new]], atol=1e-6, rtol=0)


def test_init_head_deepened_keeps_what_it_learned(trained, data, tmp_path):
    """model.num_layers above model.init_head's: the run trains a deeper head that starts
    as the trained one (every trained weight carried; the new layer's o_proj and
    down_proj zero, so it adds nothing until trained), records num_hidden_layers, and
    continues it without the setting. Fewer layers are refused, naming both."""
    head_dir = trained[0] / "head"
    original = _head_tensors(head_dir)
    cfg = config(data, tmp_path / "deep", model={"init_head": str(head_dir), "num_layers": 2},
                 optim={"max_steps": 1, "grad_accum": 1, "lr": 1e-12})  # fmt: skip
    assert train(cfg)["step"] == 1
    deep_dir = tmp_path / "deep" / "head"
    assert json.loads((deep_dir / "config.json").read_text())["num_hidden_layers"] == 2
    saved = _head_tensors(deep_dir)
    for key, value in original.items():
        torch.testing.assert_close(saved[key].float(), value.float(), atol=1e-6, rtol=0)
    new = {k for k in saved if k.startswith("layers.1.")}
    assert "layers.1.self_attn.q_proj.weight" in new and "layers.1.mlp.up_proj.weight" in new
    for key in ("layers.1.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert saved[key].float().abs().max() < 1e-6
    again = config(data, tmp_path / "again", model={"init_head": str(deep_dir)},
                   optim={"max_steps": 1, "grad_accum": 1})  # fmt: skip
    assert train(again)["step"] == 1
    assert json.loads((tmp_path / "again/head/config.json").read_text())["num_hidden_layers"] == 2
    fewer = config(data, tmp_path / "fewer", model={"init_head": str(deep_dir), "num_layers": 1},
                   optim={"max_steps": 1, "grad_accum": 1})  # fmt: skip
    with pytest.raises(ValueError, match=r"num_layers=1 is fewer than model.init_head's 2"):
        train(fewer)


def test_init_head_widened_keeps_what_it_learned(trained, data, tmp_path):
    """model.intermediate_size above model.init_head's MLP width: the run trains a wider
    head that starts as the trained one (old units' weights carried, new units' down
    columns zero; a learning rate of 1e-12 leaves the one step's update below the
    tolerance), records the width in its config, and continues it without the setting.
    A narrower width is refused, naming both."""
    head_dir = trained[0] / "head"
    original = _head_tensors(head_dir)
    narrow = json.loads((head_dir / "config.json").read_text())["intermediate_size"]
    cfg = config(data, tmp_path / "wide",
                 model={"init_head": str(head_dir), "intermediate_size": 2 * narrow},
                 optim={"max_steps": 1, "grad_accum": 1, "lr": 1e-12})  # fmt: skip
    assert train(cfg)["step"] == 1
    wide_dir = tmp_path / "wide" / "head"
    assert json.loads((wide_dir / "config.json").read_text())["intermediate_size"] == 2 * narrow
    saved = _head_tensors(wide_dir)
    for name in ("gate_proj", "up_proj"):
        key = f"midlayer.mlp.{name}.weight"
        assert saved[key].shape[0] == 2 * narrow
        torch.testing.assert_close(saved[key][:narrow].float(), original[key].float(),
                                   atol=1e-6, rtol=0)  # fmt: skip
    down = saved["midlayer.mlp.down_proj.weight"].float()
    torch.testing.assert_close(down[:, :narrow], original["midlayer.mlp.down_proj.weight"].float(),
                               atol=1e-6, rtol=0)  # fmt: skip
    assert down[:, narrow:].abs().max() < 1e-6
    again = config(data, tmp_path / "again", model={"init_head": str(wide_dir)},
                   optim={"max_steps": 1, "grad_accum": 1})  # fmt: skip
    assert train(again)["step"] == 1
    narrower = config(data, tmp_path / "narrow",
                      model={"init_head": str(head_dir), "intermediate_size": narrow // 2},
                      optim={"max_steps": 1, "grad_accum": 1})  # fmt: skip
    with pytest.raises(ValueError, match=rf"intermediate_size={narrow // 2} is narrower .*"
                                         rf"\({narrow}\)"):  # fmt: skip
        train(narrower)


def _head_tensors(head_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(head_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_time_limit_counts_from_the_command_start():
    """run.time_limit_s is a job's wall-clock budget: set-up before the loop (loading the
    target, reading the data, compiling) uses it up too, so a limit already spent by
    set-up stops the loop at its first step."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    now = time.monotonic()
    assert TimeLimit(60.0, accelerator, started=now - 61.0).reached()
    assert not TimeLimit(60.0, accelerator, started=now).reached()
    assert not TimeLimit(None, accelerator, started=now - 1e6).reached()


def test_an_eagle3_1_head_trains_and_an_eagle3_head_continues_as_one(trained, data, tmp_path):
    """model.variant=eagle3.1: a fresh head trains with a norm on each fused aux state and
    its post-norm states fed back (the loss falls; config.json records both switches), and
    a trained EAGLE-3 head continues as EAGLE-3.1 with every weight it had and fresh norms
    calibrated to the data's aux states (train/norm_init.py), so that its first draft
    step starts where the original's stands: held-out step-0 loss and acc_0 before any
    training step equal the original's final ones within a few percent. Continuing an
    EAGLE-3.1 head as EAGLE-3 would drop its norms: refused."""
    from specdec.models.eagle3_formats import load_eagle3
    from specdec.train.model import TargetIO

    cfg = config(data, tmp_path / "fresh", model={"variant": "eagle3.1"},
                 data={"max_tokens": 256}, optim={"max_steps": 40, "grad_accum": 1},
                 run={"log_every": 10, "save_every": 40})  # fmt: skip
    assert train(cfg)["step"] == 40
    entries = [e for e in log(tmp_path / "fresh") if "train/loss" in e]
    assert entries[-1]["train/loss"] < 0.5 * entries[0]["train/loss"]
    saved = json.loads((tmp_path / "fresh/head/config.json").read_text())
    assert saved["fc_norm"] is True and saved["norm_output"] is True
    target = TargetIO.load(cfg.model.target).config
    assert load_eagle3(tmp_path / "fresh/head", target_config=target).config.variant == "eagle3.1"

    head_dir = trained[0] / "head"
    original = _head_tensors(head_dir)
    as_31 = {"init_head": str(head_dir), "variant": "eagle3.1"}
    cont = config(data, tmp_path / "cont", model=as_31,
                  optim={"max_steps": 1, "grad_accum": 1, "lr": 1e-12})  # fmt: skip
    assert train(cont)["step"] == 1
    tensors = _head_tensors(tmp_path / "cont/head")
    for key, value in original.items():
        torch.testing.assert_close(tensors[key].float(), value.float(), atol=1e-6, rtol=0)
    for i in range(3):  # one scale a norm, the median RMS of its aux state's rows
        weight = tensors[f"fc_norm.{i}.weight"].float()
        assert torch.all(weight == weight[0]) and weight[0] > 0, weight
    # Measured (CPU, fp32): held-out step-0 loss 6.85 against the original's 6.82, acc_0
    # 0.19 and 0.19; norms at weight 1 gave 12.2 and 0.09. Later steps read post-norm
    # states now (norm_output), which no initialisation keeps, so only step 0 is compared.
    start = next(e for e in log(tmp_path / "cont") if "eval/loss" in e and e["step"] == 0)
    _, result = trained
    assert start["eval/loss_0"] == pytest.approx(result["eval/loss_0"], rel=0.02)
    assert start["eval/acc_0"] == pytest.approx(result["eval/acc_0"], abs=0.03)
    back = config(data, tmp_path / "back",
                  model={"init_head": str(tmp_path / "fresh/head"), "variant": "eagle3"},
                  optim={"max_steps": 1, "grad_accum": 1})  # fmt: skip
    with pytest.raises(ValueError, match=r"is an eagle3.1 head and the run asks for eagle3"):
        train(back)
    with pytest.raises(
        ValueError, match=r"model.variant='eagle4'; choose one of eagle3 \| eagle3.1"
    ):
        config(data, tmp_path / "bad", model={"variant": "eagle4"})


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_hybrid"])
def test_lk_losses_train_the_head(data, tmp_path, loss):
    """ttt.loss=lk_alpha|lk_hybrid (train/draft_loss.py): a fresh head trained on the
    acceptance rate; its loss falls and its step-0 accuracy rises."""
    cfg = config(data, tmp_path / loss, ttt={"loss": loss}, data={"max_tokens": 256},
                 optim={"max_steps": 30, "grad_accum": 1},
                 run={"log_every": 10, "save_every": 30})  # fmt: skip
    assert train(cfg)["step"] == 30
    entries = [e for e in log(tmp_path / loss) if "train/loss" in e]
    assert entries[-1]["train/loss"] < 0.7 * entries[0]["train/loss"]
    # Measured (CPU, fp32, 30 steps): acc_0 0.07 -> 0.21 with lk_alpha, whose gradients
    # are the smaller while the draft is far from the label (the hybrid's KL share).
    assert entries[-1]["train/acc_0"] > entries[0]["train/acc_0"] + 0.1


BLOCK = {"model": {"drafter": "block", "num_layers": 1}, "block": {"block_size": 8, "anchors": 48}}


def test_a_block_drafter_trains_on_the_same_dump(data, tmp_path):
    """model.drafter=block trains a DFlash-style drafter from the EAGLE-3 dump unchanged:
    the loss falls, slot 1's accuracy rises, and the final head loads in the project
    format with the dump's aux layers and the draft vocabulary."""
    from specdec.models.block_drafter_formats import load_block_drafter
    from specdec.train.model import TargetIO

    cfg = config(data, tmp_path, **BLOCK, data={"max_tokens": 256},
                 optim={"max_steps": 40, "grad_accum": 1, "lr": 2e-3},
                 run={"log_every": 10, "save_every": 40})  # fmt: skip
    assert train(cfg)["step"] == 40
    entries = [e for e in log(tmp_path) if "train/loss" in e]
    assert {f"train/acc_{i}" for i in range(7)} <= set(entries[0])  # one per drafted slot
    # Measured (CPU, fp32, 40 steps; 10-step windows): train loss 57 -> 18, slot 1's
    # accuracy 0.02 -> 0.07.
    assert entries[-1]["train/loss"] < 0.5 * entries[0]["train/loss"]
    assert entries[-1]["train/acc_0"] > entries[0]["train/acc_0"] + 0.03
    target = TargetIO.load(cfg.model.target).config
    drafter = load_block_drafter(tmp_path / "head", target_config=target)
    assert drafter.config.aux_layer_ids == (2, 15, 27) and drafter.config.block_size == 8
    assert drafter.config.draft_vocab_size == 512 and drafter.config.mask_token_id == 16


def test_a_block_drafter_resumes_as_an_uninterrupted_run(data, tmp_path):
    """A run stopped by run.time_limit_s after step 1 (checkpoint, RNG of the anchor draws
    included) and rerun ends with the head of a run that never stopped."""
    steps = {"optim": {"max_steps": 4, "grad_accum": 1}}
    train(config(data, tmp_path / "straight", **BLOCK, **steps))
    stopped = config(data, tmp_path / "resumed", **BLOCK, **steps, run={"time_limit_s": 1e-6})
    assert train(stopped)["step"] == 1
    assert train(config(data, tmp_path / "resumed", **BLOCK, **steps))["step"] == 4
    a, b = _head_tensors(tmp_path / "straight/head"), _head_tensors(tmp_path / "resumed/head")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)


def test_block_settings_are_checked():
    with pytest.raises(ValueError, match=r"model.drafter='dflash'; choose one of eagle3 \| block"):
        TrainConfig.load(None, ["data.path=x", "model.drafter=dflash"])
    with pytest.raises(ValueError, match=r"model.variant='eagle3.1' is an EAGLE-3 setting"):
        TrainConfig.load(None, ["data.path=x", "model.drafter=block", "model.variant=eagle3.1"])
    with pytest.raises(ValueError, match=r"block.block_size=1 must be >= 2"):
        TrainConfig.load(None, ["data.path=x", "block.block_size=1"])
    cfg = TrainConfig.load("configs/train/smollm2-block.yaml", ["data.path=d"])
    assert cfg.model.drafter == "block" and cfg.block.block_size == 16
