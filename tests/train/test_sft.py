"""``specdec train-sft`` (train/sft*.py) on a tiny random model with SmolLM2's tokenizer:
labels are exactly the next assistant tokens, the packed training forward equals the
engine's paged forward, a short run lowers the loss and exports an HF directory of small
shards that the engine serves, and a killed run resumes to the uninterrupted result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import make_tiny_model_dir

from specdec.data_gen.decontam import Decontaminator
from specdec.data_gen.reasoning.generate import TracesConfig, run_traces
from specdec.models import load_model
from specdec.train import checkpoint
from specdec.train.loop import KILL_ENV
from specdec.train.packed_attention import PackedCausalAttention, PackedMeta
from specdec.train.sft import train_sft
from specdec.train.sft_config import SFTConfig
from specdec.train.sft_data import IGNORE, assemble, shift_labels

pytest.importorskip("reasoning_gym")
NO_BENCH = Decontaminator({"none": ["nothing to match here at all"]})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), smollm2_dir, seed=0)


@pytest.fixture(scope="module")
def traces(tmp_path_factory, smollm2_tokenizer) -> Path:
    root = tmp_path_factory.mktemp("traces")
    tasks = ("chain_sum", "gcd", "base_conversion")
    for split, n in (("train", 12), ("eval", 2)):
        run_traces(
            TracesConfig(
                output=str(root / f"{split}.jsonl"), split=split, tasks=tasks, num_per_task=n
            ),
            decontaminator=NO_BENCH,
            tokenizer=smollm2_tokenizer,
        )
    return root


def config(traces: Path, tiny: Path, out: Path, **sections) -> SFTConfig:
    base = {
        "model": {"base": str(tiny)},
        "data": {
            "train": str(traces / "train.jsonl"),
            "eval": str(traces / "eval.jsonl"),
            "max_tokens": 512,
        },
        "optim": {
            "lr": 1e-2,
            "warmup_steps": 2,
            "max_steps": 8,
            "grad_accum": 2,
            "weight_decay": 0.01,
        },
        "run": {
            "output_dir": str(out),
            "save_every": 4,
            "eval_every": 1000,
            "log_every": 4,
            "wandb": "disabled",
        },
        "export": {"dtype": "float32", "shard_mb": 0.5},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return SFTConfig.from_dict(base)


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_labels_are_the_next_assistant_tokens(traces, smollm2_tokenizer):
    ids, mask = np.array([5, 6, 7, 8, 9]), np.array([0, 0, 1, 1, 0])
    assert shift_labels(ids, mask).tolist() == [IGNORE, 7, 8, IGNORE, IGNORE]
    batch = assemble([(ids, mask), (np.array([3, 4, 5]), np.array([1, 1, 1]))])
    # no position learns across the boundary; positions restart per sequence
    assert batch.labels.tolist() == [IGNORE, 7, 8, IGNORE, IGNORE, 4, 5, IGNORE]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.loss_index.tolist() == [1, 2, 5, 6] and batch.cu_seqlens.tolist() == [0, 5, 8]

    rec = json.loads((traces / "train.jsonl").read_text().splitlines()[0])
    labels = shift_labels(np.array(rec["input_ids"]), np.array(rec["loss_mask"]))
    learned = labels[labels != IGNORE]
    p = rec["prompt_tokens"]
    assert (labels[: p - 1] == IGNORE).all()  # system prompt, user turn, headers: context
    reply = rec["conversations"][1]["content"]
    assert smollm2_tokenizer.decode(learned) == reply + "<|im_end|>"


def test_packed_training_forward_equals_the_engines_paged_forward(tiny):
    """The same weights through PackedCausalAttention (training) and the torch paged
    backend (serving) give the same hidden states, so SFT trains what the engine runs."""
    from specdec.data_gen.target import prefill_inputs

    lengths = np.array([37, 50])
    ids = torch.randint(49152, (int(lengths.sum()),), generator=torch.Generator().manual_seed(0))
    paged = load_model(str(tiny), attention="torch")
    positions, meta, blocks = prefill_inputs(lengths, 16, torch.device("cpu"))
    c = paged.config
    caches = [
        tuple(torch.zeros(blocks, 16, c.num_kv_heads, c.head_dim) for _ in "kv")
        for _ in range(c.num_layers)
    ]
    want, _ = paged(ids, positions, caches, meta)

    packed = load_model(str(tiny), attention=PackedCausalAttention())
    cu = torch.tensor([0, 37, 87], dtype=torch.int32)
    got, _ = packed(ids, positions, [(None, None)] * c.num_layers, PackedMeta(cu, [37, 50]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_varlen_attention_matches_sdpa_on_cuda():
    """FlashAttention varlen (the GPU path) equals the per-sequence reference, GQA included
    (torch 2.11's varlen_attn has no enable_gqa: the K/V heads are repeated)."""
    from specdec.train.packed_attention import packed_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(87, 9, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (
        torch.randn(87, 3, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in "kv"
    )
    meta = PackedMeta(torch.tensor([0, 37, 87], dtype=torch.int32, device="cuda"), [37, 50])
    device = torch.device("cuda")
    want = packed_attention("sdpa", device).forward(q, k, v, None, None, meta, 0.125)
    got = packed_attention("varlen", device).forward(q, k, v, None, None, meta, 0.125)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_sft_learns_and_exports_a_model_the_engine_serves(traces, tiny, tmp_path):
    out = tmp_path / "run"
    result = train_sft(
        config(
            traces,
            tiny,
            out,
            optim={"max_steps": 16, "grad_accum": 1},
            run={"save_every": 16, "eval_every": 16},
        )
    )
    train = [e for e in log(out) if "train/loss" in e]
    evals = [e for e in log(out) if "eval/loss" in e]
    # Measured (CPU, 16 steps of 512 tokens): train loss 10.8 -> 4.5, eval 10.8 -> 4.5.
    assert train[-1]["train/loss"] < 0.6 * train[0]["train/loss"]
    assert evals[0]["step"] == 0 and evals[-1]["eval/loss"] < 0.6 * evals[0]["eval/loss"]

    model = Path(result["model"])
    shards = sorted(model.glob("*.safetensors"))
    assert len(shards) > 10 and all(s.stat().st_size <= 0.5 * 2**20 for s in shards)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    assert index["metadata"]["split_tensors"]["model.embed_tokens.weight"] > 1
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (model / name).is_file()
    meta = json.loads((model / "specdec_sft.json").read_text())
    assert meta["think_format"]["close_ids"] == [9617, 17400, 46]  # "</" "think" ">"

    trained = load_file(str(out / "ckpt-00000016" / "model.safetensors"))
    exported = load_model(str(model)).state_dict()
    tied = {"lm_head.weight": "embed_tokens.weight"}  # accelerate stores a tied weight once
    for key, value in exported.items():
        stored = trained.get(f"lm.{key}", trained.get(f"lm.{tied.get(key)}"))
        torch.testing.assert_close(value, stored, atol=0, rtol=0)

    _engine_serves(model)


def test_lora_sft_trains_only_the_adapter_and_exports_a_small_peft_directory(
    traces, tiny, tmp_path
):
    """``lora.rank`` > 0: the base's weights do not move, the loss falls, and the export
    is a PEFT adapter directory (one small file naming the base) that the engine serves
    and that loads as base + the checkpoint's updates."""
    from specdec.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    out = tmp_path / "run"
    result = train_sft(
        config(
            traces,
            tiny,
            out,
            lora={"rank": 8, "alpha": 16.0},
            optim={"max_steps": 16, "grad_accum": 1, "lr": 3e-2},
            run={"save_every": 16, "eval_every": 16},
        )
    )
    evals = [e["eval/loss"] for e in log(out) if "eval/loss" in e]
    # Measured (CPU, 16 steps of 512 tokens, rank 8): eval loss 10.78 -> 10.55. The tiny
    # random model's tied embedding (most of what a full fine-tune moves) is frozen here;
    # an adapter that did not train would leave the eval loss exactly where it started.
    assert evals[-1] < evals[0] - 0.1

    adapter = Path(result["model"])
    assert sorted(p.name for p in adapter.iterdir()) == sorted(
        [ADAPTER_CONFIG, ADAPTER_WEIGHTS, "specdec_sft.json"]
    )
    assert (adapter / ADAPTER_WEIGHTS).stat().st_size <= 0.5 * 2**20
    assert json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(
        tiny
    )
    ckpt = load_file(str(out / "ckpt-00000016" / "model.safetensors"))
    base = load_model(str(tiny)).state_dict()
    tuned = load_model(str(adapter)).state_dict()
    layer = "layers.0.self_attn.qkv_proj"
    assert torch.equal(ckpt[f"lm.{layer}.base.weight"], base[f"{layer}.weight"])  # frozen
    a, b = ckpt[f"lm.{layer}.lora_A.q_proj"], ckpt[f"lm.{layer}.lora_B.q_proj"]
    q_rows = b.shape[0]
    want = base[f"{layer}.weight"][:q_rows] + 2.0 * b @ a  # alpha / rank = 2
    torch.testing.assert_close(tuned[f"{layer}.weight"][:q_rows], want, atol=1e-6, rtol=0)
    assert not torch.equal(tuned[f"{layer}.weight"], base[f"{layer}.weight"])

    _engine_serves(adapter)


def _engine_serves(model: Path) -> None:
    """The engine loads ``model`` and decodes with it."""
    from specdec import LLM, SamplingParams

    llm = LLM(
        str(model), device="cpu", dtype="float32", kv_cache_memory=16 << 20, max_model_len=512
    )
    outs = llm.chat(
        [{"role": "user", "content": "Find the GCD of 12 and 18."}],
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
    )
    assert len(outs[0].outputs[0].token_ids) == 4


def _run_killed(cfg_path: Path, kill_after: int) -> subprocess.CompletedProcess:
    code = "import sys; from specdec.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, "train-sft", "--config", str(cfg_path)],
        env={**os.environ, KILL_ENV: str(kill_after), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture
def one_thread():
    """One intra-op thread, as the killed subprocess runs (``_run_killed``): CPU kernels
    such as the tied embedding's backward reduce in a thread-count-dependent order, and
    bitwise resume is only defined for the same threading."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_kill_and_resume_equals_an_uninterrupted_run(traces, tiny, tmp_path, one_thread):
    """SIGKILL after step 6 (last checkpoint: step 4), resume: the exported model equals an
    uninterrupted run's (fp32), and so do the optimizer's moments."""
    straight = config(traces, tiny, tmp_path / "straight")
    train_sft(straight)

    resumed = config(traces, tiny, tmp_path / "resumed")
    cfg_path = tmp_path / "resumed.yaml"
    cfg_path.write_text(json.dumps(resumed.to_dict()))  # JSON is YAML
    proc = _run_killed(cfg_path, kill_after=6)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "resumed")] == ["ckpt-00000004"]
    train_sft(SFTConfig.load(cfg_path))

    a = load_model(str(tmp_path / "straight" / "model")).state_dict()
    b = load_model(str(tmp_path / "resumed" / "model")).state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)
    opt = [
        torch.load(tmp_path / run / "ckpt-00000008" / "optimizer.bin", weights_only=True)
        for run in ("straight", "resumed")
    ]
    for sa, sb in zip(opt[0]["state"].values(), opt[1]["state"].values(), strict=True):
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], atol=1e-6, rtol=0)


def test_time_limit_exports_and_the_rerun_continues(traces, tiny, tmp_path):
    """run.time_limit_s (shared with train-draft) ends train-sft at the next step with a
    checkpoint and an exported model; the same command then runs to max_steps."""
    out = tmp_path / "run"
    result = train_sft(config(traces, tiny, out, run={"time_limit_s": 1e-6}))
    assert result["step"] == 1 and result["time_limited"]
    assert [p.name for p in checkpoint.checkpoints(out)] == ["ckpt-00000001"]
    assert (out / "model" / "config.json").is_file()
    result = train_sft(config(traces, tiny, out))
    assert result["step"] == 8 and not result["time_limited"]


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"unknown keys \['optim.lrr'\]"):
        SFTConfig.load(None, ["data.train=x", "optim.lrr=1"])
    with pytest.raises(ValueError, match=r"data.train is empty"):
        SFTConfig.load(None, [])
    with pytest.raises(ValueError, match=r"model.attention='flash'; choose one of auto"):
        SFTConfig.load(None, ["data.train=x", "model.attention=flash"])
    with pytest.raises(ValueError, match=r"lora: lora targets \['qkv'\] are invalid"):
        SFTConfig.load(None, ["data.train=x", "lora.rank=4", "lora.targets=[qkv]"])
    cfg = SFTConfig.load("configs/train/smollm2_reasoning_sft.yaml", ["optim.lr=1e-4"])
    assert cfg.optim.lr == 1e-4 and cfg.export.shard_mb == 16 and cfg.model.attention == "auto"
