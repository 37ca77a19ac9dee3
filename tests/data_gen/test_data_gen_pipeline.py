"""data_gen end to end on SmolLM2 (CPU, fp32): regenerate → dump → vocab.

The invariants: dumped aux and last hidden states are the target's own (bit-exact against
fresh forwards of ours, and HF ``hidden_states[2], [N//2], [N-3], [N]`` within fp32
noise); regenerated records mask exactly the assistant tokens; a SIGKILLed run resumes to
byte-identical shards; a corrupt or missing shard is detected and redone; bad records are
skipped and counted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from prompts import QUESTIONS
from safetensors import safe_open

from specdec.data_gen.dump import DumpConfig, run_dump
from specdec.data_gen.dump_plan import plan_groups, plan_shards
from specdec.data_gen.regenerate import RegenerateConfig, run_regenerate
from specdec.data_gen.shards import KILL_ENV, RankInfo, load_manifest, verify_manifest
from specdec.data_gen.vocab import VocabConfig, run_vocab
from specdec.ops.attention_metadata import AttentionMetadata

MODEL = "smollm2-135m-instruct"
ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 64 << 20, "max_num_seqs": 4}
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", str(64 << 20)]
REGEN = {"max_tokens": 8, "temperature": 0.7, "records_per_shard": 5}
DUMP = {"dtype": "float32", "compute_dtype": "float32", "shard_bytes": 1 << 20}


def _conversations() -> list[dict]:
    """24 usable conversations (16 single-turn, 8 two-turn in ShareGPT form) and 5 bad
    lines: broken JSON, blank, an empty prompt, an unknown speaker, an over-long prompt."""
    recs: list[dict] = [{"id": f"q{i}", "prompt": q} for i, q in enumerate(QUESTIONS)]
    recs += [
        {"id": f"w{i}", "prompt": f"Give one word that rhymes with {w}."}
        for i, w in enumerate(["cat", "tree", "light", "stone", "rain", "cloud", "sea", "fire"])
    ]
    for i, topic in enumerate(["bread", "rivers", "chess", "tea", "owls", "maps", "bees", "ice"]):
        recs.append(
            {
                "id": f"m{i}",
                "conversations": [
                    {"from": "human", "value": f"Tell me a fact about {topic}."},
                    {"from": "gpt", "value": "an old answer that must be replaced"},
                    {"from": "human", "value": "Now say it in five words."},
                    {"from": "gpt", "value": "another old answer"},
                ],
            }
        )
    lines = [json.dumps(r) for r in recs]
    lines.insert(3, '{"prompt": "broken')
    lines.insert(7, "")
    lines.insert(9, json.dumps({"prompt": "   "}))
    lines.insert(11, json.dumps({"conversations": [{"from": "robot", "value": "beep"}]}))
    lines.insert(13, json.dumps({"id": "long", "prompt": "word " * 400}))
    return lines


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(_conversations()) + "\n")
    return path


def _regen_config(prompts_file: Path, out: Path) -> RegenerateConfig:
    engine = {**ENGINE, "max_model_len": 256}
    return RegenerateConfig(input=str(prompts_file), output=str(out), engine=engine, **REGEN)


@pytest.fixture(scope="module")
def regen_dir(tmp_path_factory, prompts_file) -> Path:
    out = tmp_path_factory.mktemp("regen")
    stats = run_regenerate(_regen_config(prompts_file, out), RankInfo())
    assert stats["manifest"] is not None and stats["generated_tokens"] > 0
    return out


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory, regen_dir) -> Path:
    out = tmp_path_factory.mktemp("dump")
    config = DumpConfig(input=str(regen_dir), output=str(out), batch_tokens=400, **DUMP)
    assert run_dump(config, RankInfo())["manifest"] is not None
    return out


def _records(regen_dir: Path) -> list[dict]:
    manifest = load_manifest(regen_dir)
    return [
        json.loads(line)
        for s in manifest["shards"]
        for line in (regen_dir / s["file"]).read_text().splitlines()
    ]


def _read_shards(dump_dir: Path) -> list[dict[str, torch.Tensor]]:
    out = []
    for s in load_manifest(dump_dir)["shards"]:
        with safe_open(dump_dir / s["file"], "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
            out.append({**tensors, "meta": f.metadata()})
    return out


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    code = "import sys; from specdec.cli import main; sys.exit(main())"
    return subprocess.Popen(
        [sys.executable, "-c", code, "data-gen", *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


# ---- regenerate ------------------------------------------------------------------------


def test_regenerate_answers_every_turn_and_counts_bad_records(regen_dir, smollm2_tokenizer):
    manifest = load_manifest(regen_dir)
    assert manifest["input_skipped"] == {"bad_json": 1, "bad_message": 1, "empty": 2}
    assert manifest["counts"]["skipped_too_long"] == 1  # 400 words > max_model_len 256
    records = _records(regen_dir)
    assert len(records) == manifest["counts"]["records"] == 24
    multi = [r for r in records if r["id"].startswith("m")]
    assert len(multi) == 8
    for r in records:
        roles = [m["role"] for m in r["conversations"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert "old answer" not in json.dumps(r["conversations"])  # replaced by the target
        assert len(r["input_ids"]) == len(r["loss_mask"])
    assert all(len(r["conversations"]) == 4 for r in multi)
    # Each masked run is one assistant answer followed by <|im_end|>.
    for r in records:
        runs = _mask_runs(r["input_ids"], r["loss_mask"])
        answers = [m["content"] for m in r["conversations"] if m["role"] == "assistant"]
        assert [smollm2_tokenizer.decode(run) for run in runs] == [
            a + "<|im_end|>" for a in answers
        ]


def _mask_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return [*runs, cur] if cur else runs


def test_regenerate_answers_are_the_targets_own(regen_dir, prompts_file):
    """A turn's answer is what the engine samples for that prompt with the request's seed,
    whatever else shared its batches."""
    from specdec import LLM, SamplingParams
    from specdec.data_gen.regenerate import request_seed

    record = next(r for r in _records(regen_dir) if r["id"] == "m2")
    llm = LLM(MODEL, **ENGINE)
    history = record["conversations"][:3]  # user, assistant, user: the second turn
    params = SamplingParams(temperature=0.7, max_tokens=8, seed=request_seed(0, "m2", 1))
    out = llm.chat([history], params, use_tqdm=False)[0].outputs[0]
    assert out.text == record["conversations"][3]["content"]
    # The record holds the ids the engine emitted for that answer, not its text re-encoded.
    runs = _mask_runs(record["input_ids"], record["loss_mask"])
    assert runs[1][: len(out.token_ids)] == list(out.token_ids)


def test_regenerate_resumes_after_sigkill_byte_identical(regen_dir, prompts_file, tmp_path):
    """SIGKILL from outside once the first shard is on disk, then resume."""
    out = tmp_path / "regen"
    args = ["regenerate", "-i", str(prompts_file), "-o", str(out), *ENGINE_ARGS]
    args += ["--max-tokens", "8", "--temperature", "0.7", "--records-per-shard", "5"]
    args += ["--max-model-len", "256", "--max-num-seqs", "4", "--max-inflight", "4"]
    proc = _cli(*args)
    marker = out / "progress" / "regen-00000.json"
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read()
    assert not (out / "manifest.json").exists()  # killed mid-run: shards still missing
    # Resume in this process (another process than the one killed; saves a model load).
    stats = run_regenerate(_regen_config(prompts_file, out), RankInfo())
    assert 0 < stats["shards_written"] < 5
    _assert_same_files(regen_dir, out)


def test_regenerate_builds_the_same_records_in_worker_processes(regen_dir, prompts_file, tmp_path):
    """Records built by the worker pool (spawned processes, their own tokenizer) equal the
    inline ones byte for byte, bad records counted the same (the manifest compares too)."""
    config = replace(_regen_config(prompts_file, tmp_path / "regen"), record_workers=2)
    assert run_regenerate(config, RankInfo())["shards_written"] == 5
    _assert_same_files(regen_dir, tmp_path / "regen")


# ---- dump ------------------------------------------------------------------------------


def test_dump_equals_fresh_forward_of_the_same_batches(dump_dir, regen_dir):
    """Bit-exact: every forward batch of the plan recomputed by a fresh model."""
    from specdec.data_gen.target import TargetForward

    config = DumpConfig(input=str(regen_dir), output="unused", batch_tokens=400, **DUMP)
    records = _records(regen_dir)
    per_token = 4 * 576 * 4 + 5
    shards = plan_shards([len(r["input_ids"]) for r in records], per_token, config.shard_bytes)
    groups = plan_groups(shards, config.batch_tokens)
    assert len(groups) > 1 and any(len(g.shards) > 1 for g in groups)  # real batching
    dumped = _read_shards(dump_dir)
    assert len(dumped) == len(shards)
    forward = TargetForward.for_dump(config)
    for g in groups:
        recs = [records[i] for i in g.records]
        lengths = np.array([len(r["input_ids"]) for r in recs])
        ids = np.concatenate([r["input_ids"] for r in recs]).astype(np.int32)
        hidden, aux = forward(ids, lengths)
        got_aux = torch.cat([dumped[s.index]["aux_hidden_states"] for s in g.shards])
        got_hidden = torch.cat([dumped[s.index]["hidden_states"] for s in g.shards])
        assert torch.equal(got_aux, aux) and torch.equal(got_hidden, hidden)


def test_dump_matches_hf_hidden_states(dump_dir, regen_dir, smollm2_hf):
    """Aux = HF hidden_states[2], [15], [27] (the residual stream entering those layers),
    last hidden = hidden_states[30] (after the final norm), per conversation."""
    records = _records(regen_dir)
    manifest = load_manifest(dump_dir)
    assert manifest["aux_layer_ids"] == [2, 15, 27] and manifest["dtype"] == "float32"
    shards = _read_shards(dump_dir)
    aux_all = torch.cat([s["aux_hidden_states"] for s in shards])
    hidden_all = torch.cat([s["hidden_states"] for s in shards])
    row = 0
    for r in records[:6]:
        ids = torch.tensor([r["input_ids"]])
        with torch.no_grad():
            hs = smollm2_hf(ids, output_hidden_states=True).hidden_states
        n = ids.shape[1]
        want_aux = torch.cat([hs[2][0], hs[15][0], hs[27][0]], dim=-1)  # [n, 3 * 576]
        got_aux = aux_all[row : row + n]
        scale = want_aux.abs().amax(dim=-1, keepdim=True)
        assert ((got_aux - want_aux).abs() / scale).max() < 1e-4
        assert ((hidden_all[row : row + n] - hs[30][0]).abs()).max() < 1e-3
        row += n


def test_dump_single_conversation_is_exact(regen_dir, tmp_path):
    """One conversation per forward equals a fresh stand-alone forward of our model."""
    from specdec.models import load_model

    records = _records(regen_dir)[:3]
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    one = tmp_path / "one"
    _stage_dir_from(src, one)
    out = tmp_path / "dump"
    config = DumpConfig(
        input=str(one), output=str(out), dtype="float32", batch_tokens=1, shard_bytes=1
    )
    run_dump(config, RankInfo())
    model = load_model(MODEL)
    c = model.config
    for r, shard in zip(records, _read_shards(out), strict=True):
        n = len(r["input_ids"])
        shape = (n, 1, c.num_kv_heads, c.head_dim)  # block size 1: block i = position i
        kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            block_tables=torch.arange(n, dtype=torch.int32)[None],
            max_query_len=n,
            max_seq_len=n,
            query_lens_cpu=[n],
            seq_lens_cpu=[n],
        )
        with torch.inference_mode():
            hidden, aux = model(
                torch.tensor(r["input_ids"]), torch.arange(n), kv, meta, (2, 15, 27)
            )
        assert torch.equal(shard["aux_hidden_states"], aux)
        assert torch.equal(shard["hidden_states"], hidden)
        assert shard["input_ids"].tolist() == r["input_ids"]
        assert shard["loss_mask"].tolist() == [bool(m) for m in r["loss_mask"]]
        assert json.loads(shard["meta"]["specdec"])["record_ids"] == [r["id"]]


def _stage_dir_from(jsonl: Path, out: Path) -> None:
    """A one-shard stage directory holding ``jsonl`` (what regenerate writes)."""
    from specdec.data_gen.shards import ShardStore, digest_json

    store = ShardStore(out, "regen", "jsonl")
    store.write(0, jsonl.read_bytes(), "x", {"records": 1})
    store.merge(["x"], {"stage": "regenerate", "digest": digest_json(jsonl.read_text())})


def test_dump_resumes_after_sigkill_mid_shard_byte_identical(dump_dir, regen_dir, tmp_path):
    """The test hook SIGKILLs the process halfway through writing its second shard."""
    out = tmp_path / "dump"
    args = ["dump", "-i", str(regen_dir), "-o", str(out)]  # device auto, as the fixture
    args += ["--dtype", "float32", "--compute-dtype", "float32", "--batch-tokens", "400"]
    args += ["--shard-mb", "1", "--num-writers", "1"]
    killed = _cli(*args, env={KILL_ENV: "1"})
    assert killed.wait() == -signal.SIGKILL, killed.stdout.read()
    assert list(out.glob(".hidden-*.tmp-*")), "the kill should leave a torn temporary file"
    assert not (out / "manifest.json").exists()
    config = DumpConfig(input=str(regen_dir), output=str(out), batch_tokens=400, **DUMP)
    config = replace(config, num_writers=1)
    assert run_dump(config, RankInfo())["shards_written"] == len(list(dump_dir.glob("h*"))) - 1
    _assert_same_files(dump_dir, out)


def test_dump_redoes_corrupt_and_missing_shards(dump_dir, regen_dir, tmp_path):
    out = tmp_path / "dump"
    shutil.copytree(dump_dir, out)
    files = sorted(out.glob("hidden-*.safetensors"))
    original = files[1].read_bytes()
    with open(files[1], "r+b") as f:  # flip one byte deep in the tensor data
        f.seek(len(original) // 2)
        f.write(bytes([original[len(original) // 2] ^ 0xFF]))
    files[2].unlink()
    assert verify_manifest(out) == [files[1].name, files[2].name]
    config = DumpConfig(input=str(regen_dir), output=str(out), batch_tokens=400, **DUMP)
    stats = run_dump(config, RankInfo())
    assert stats["shards_written"] == 2
    assert verify_manifest(out) == []
    _assert_same_files(dump_dir, out)


def test_dump_split_over_two_ranks_equals_one(dump_dir, regen_dir, tmp_path):
    """Rank r computes forward groups r, r + 2, ...; the rank finishing last writes the
    manifest; shards and manifest equal the single-process run's."""
    config = DumpConfig(input=str(regen_dir), output=str(tmp_path), batch_tokens=400, **DUMP)
    first = run_dump(config, RankInfo(0, 2))
    assert first["manifest"] is None and first["shards_written"] > 0
    second = run_dump(config, RankInfo(1, 2))
    assert second["manifest"] is not None
    assert first["shards_written"] + second["shards_written"] == len(list(dump_dir.glob("h*")))
    _assert_same_files(dump_dir, tmp_path)


def test_dump_skips_and_counts_bad_records(regen_dir, tmp_path):
    records = _records(regen_dir)[:4]
    bad = [
        {"id": "mismatch", "input_ids": [1, 2, 3], "loss_mask": [1]},
        {"id": "empty", "input_ids": [], "loss_mask": []},
        {"id": "no_loss", "input_ids": [1, 2], "loss_mask": [0, 0]},
        {"id": "vocab", "input_ids": [1, 10**6], "loss_mask": [1, 1]},
        {"id": "long", "input_ids": [5] * 300, "loss_mask": [1] * 300},
    ]
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records + bad) + "{not json\n")
    _stage_dir_from(src, tmp_path / "in")
    config = DumpConfig(
        input=str(tmp_path / "in"), output=str(tmp_path / "out"), max_seq_len=256, **DUMP
    )
    manifest = run_dump(config, RankInfo())["manifest"]
    assert manifest["counts"]["records"] == 4
    assert manifest["input_skipped"] == {
        "bad_json": 1,
        "bad_structure": 1,
        "bad_token_ids": 1,
        "empty": 1,
        "no_loss_tokens": 1,
        "too_long": 1,
    }


# ---- vocab -----------------------------------------------------------------------------


def test_vocab_from_regenerated_data_round_trips(regen_dir, dump_dir, tmp_path):
    meta = run_vocab(VocabConfig((str(regen_dir),), str(tmp_path / "a"), draft_vocab_size=500))
    with safe_open(meta["path"], "pt") as f:
        d2t, t2d, counts = f.get_tensor("d2t"), f.get_tensor("t2d"), f.get_tensor("token_counts")
    kept = torch.arange(500) + d2t
    assert t2d[kept].all() and int(t2d.sum()) == 500 and t2d.shape == (49152,)
    assert bool((kept[1:] > kept[:-1]).all())  # ascending
    records = _records(regen_dir)
    loss_ids = {t for r in records for t, m in zip(r["input_ids"], r["loss_mask"], strict=1) if m}
    assert len(loss_ids) < 500 and loss_ids <= set(kept.tolist())  # padded with unused ids
    assert int(counts.sum()) == load_manifest(regen_dir)["counts"]["loss_tokens"]
    assert meta["coverage"] == 1.0
    # The dump directory gives the same counts (it stores ids and masks too).
    meta2 = run_vocab(VocabConfig((str(dump_dir),), str(tmp_path / "b"), draft_vocab_size=500))
    with safe_open(meta2["path"], "pt") as f:
        assert torch.equal(f.get_tensor("token_counts"), counts)
    # Several inputs count together (a mix's answers and the documents' ones).
    both = run_vocab(
        VocabConfig((str(regen_dir), str(dump_dir)), str(tmp_path / "c"), draft_vocab_size=500)
    )
    with safe_open(both["path"], "pt") as f:
        assert torch.equal(f.get_tensor("token_counts"), 2 * counts)
    assert both["inputs"] == [str(regen_dir), str(dump_dir)]
    assert both["loss_tokens"] == 2 * meta["loss_tokens"]
    with pytest.raises(ValueError, match="non-empty tuple"):
        VocabConfig(str(regen_dir), str(tmp_path / "d"))


def _assert_same_files(want: Path, got: Path) -> None:
    names = sorted(p.name for p in want.iterdir() if p.is_file())
    assert names == sorted(p.name for p in got.iterdir() if p.is_file() and p.name[0] != ".")
    for name in names:
        assert (want / name).read_bytes() == (got / name).read_bytes(), name
