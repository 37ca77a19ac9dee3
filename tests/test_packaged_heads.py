"""A head shipped in specdec/heads/<alias>/ is its model's default speculation in
``generate``, ``serve`` and ``bench``, in the tree its config records; explicit flags win
and ``--draft none`` turns it off. Models without a shipped head keep each command's own
default (plain decoding for generate, n-gram lookup for serve and bench)."""

from __future__ import annotations

import json
import shutil

import pytest

from specdec.bench.cli import config_from_args
from specdec.cli import _engine_kwargs, build_parser, main
from specdec.config import SpeculativeConfig
from specdec.models import packaged_heads
from specdec.models.tree_defaults import TreeDefaults
from specdec.serve.cli import serve_config_from_args
from specdec.tree_shapes import ChainShape, DynamicTreeShape

MODEL = "smollm2-135m-instruct"
TREE = {
    "tree": "dynamic",
    "num_speculative_tokens": 4,
    "top_k": 3,
    "total_tokens": 12,
    "disable_by_batch_size": 8,
}


@pytest.fixture
def shipped(tmp_path, monkeypatch, random_head_dir):
    """The random head, shipped for the smollm2 alias with a dynamic tree recorded."""
    head = tmp_path / MODEL
    shutil.copytree(random_head_dir, head)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "tree_defaults": TREE}))
    monkeypatch.setattr(packaged_heads, "HEADS_DIR", tmp_path)
    return head


def spec_of(command: str, *argv: str):
    args = build_parser().parse_args([command, *argv])
    if command == "serve":
        return serve_config_from_args(args).engine.speculative
    if command == "bench":
        return config_from_args(args)[0].speculative[0]
    return _engine_kwargs(args)["speculative"]


def test_lookup_only_finds_shipped_heads_of_aliases(shipped, tmp_path):
    assert packaged_heads.packaged_head(MODEL) == shipped
    assert packaged_heads.packaged_head(str(tmp_path)) is None  # a path, not an alias
    shutil.rmtree(shipped)
    assert packaged_heads.packaged_head(MODEL) is None


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_commands_default_to_the_shipped_head_in_its_tree(shipped, command):
    spec = spec_of(command)
    assert (spec.method, spec.model) == ("eagle3", str(shipped))
    assert (spec.tree, spec.num_speculative_tokens, spec.top_k, spec.total_tokens) == (
        "dynamic", 4, 3, 12
    )  # fmt: skip
    assert spec.disable_by_batch_size == 8  # above 8 running requests: plain decoding
    wider = spec_of(command, "--spec-disable-by-batch-size", "32")
    assert (wider.disable_by_batch_size, wider.total_tokens) == (32, 12)
    chain = spec_of(command, "--spec-tree", "chain", "--num-speculative-tokens", "2")
    assert (chain.model, chain.tree, chain.num_speculative_tokens) == (str(shipped), "chain", 2)
    explicit = spec_of(command, "--draft", "eagle3")  # eagle3 without --draft-model
    assert explicit.model == str(shipped)
    assert spec_of(command, "--draft", "ngram").method == "ngram"


def test_the_heads_depths_by_batch_size_go_with_its_shape(shipped):
    """A head that records depths by batch size drafts them by default; a flag naming
    another shape drops them, another cutoff keeps the bands below it, and the flag sets
    or clears them."""
    config = json.loads((shipped / "config.json").read_text())
    bands = {**TREE, "tree": "chain", "num_speculative_tokens_by_batch_size": [[2, 6], [4, 5]]}
    (shipped / "config.json").write_text(json.dumps({**config, "tree_defaults": bands}))
    spec = spec_of("serve")
    assert [spec.shape_at(b).depth for b in (1, 3, 8)] == [6, 5, 4]
    assert (
        spec_of("serve", "--num-speculative-tokens", "3").num_speculative_tokens_by_batch_size
        is None
    )
    cut = spec_of("serve", "--spec-disable-by-batch-size", "4")
    assert cut.num_speculative_tokens_by_batch_size == [[2, 6]]
    flag = spec_of("serve", "--num-speculative-tokens-by-batch-size", "1:7")
    assert flag.num_speculative_tokens_by_batch_size == [[1, 7]]
    off = spec_of("bench", "--num-speculative-tokens-by-batch-size", "none")
    assert [off.shape_at(b).depth for b in (1, 8)] == [4, 4]
    assert spec_of("bench", "--sweep-chain", "3").num_speculative_tokens_by_batch_size is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--num-speculative-tokens-by-batch-size", "4-5"])


def test_a_heads_band_may_record_a_tree(shipped):
    """tree_defaults with a tree while one request runs: the default serve config drafts
    it at batch 1, the chains above; a band shape the head cannot grow is refused."""
    config = json.loads((shipped / "config.json").read_text())
    tree = {"tree": "dynamic", "num_speculative_tokens": 6, "top_k": 8, "total_tokens": 32}
    bands = {"tree": "chain", "num_speculative_tokens": 3,
             "num_speculative_tokens_by_batch_size": [[1, tree], [4, 5]]}  # fmt: skip
    (shipped / "config.json").write_text(json.dumps({**config, "tree_defaults": bands}))
    spec = spec_of("serve")
    assert spec.shape_at(1) == DynamicTreeShape(top_k=8, depth=6, total_tokens=32)
    assert [spec.shape_at(b).depth for b in (2, 8)] == [5, 3]
    on_cuda = [[1, {**tree, "device": "cuda"}], [4, 5]]
    (shipped / "config.json").write_text(json.dumps({**config, "tree_defaults": {
        **bands, "num_speculative_tokens_by_batch_size": on_cuda}}))  # fmt: skip
    assert spec_of("serve").bands_on("cpu")[0] == (4, ChainShape(5))
    with pytest.raises(ValueError, match=r"tree defaults: .*top_k \(8\) <= total_tokens \(4\)"):
        TreeDefaults(
            **{**bands, "num_speculative_tokens_by_batch_size": [[1, {**tree, "total_tokens": 4}]]}
        )


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_a_head_named_by_directory_drafts_in_its_recorded_tree(shipped, random_head_dir, command):
    """``--draft eagle3 --draft-model DIR`` takes DIR's recorded tree as the shipped head
    does, flags still win; a head recording none, or a hub name, keeps the defaults."""
    spec = spec_of(command, "--draft", "eagle3", "--draft-model", str(shipped))
    assert (spec.model, spec.tree, spec.num_speculative_tokens, spec.top_k, spec.total_tokens,
            spec.disable_by_batch_size) == (str(shipped), "dynamic", 4, 3, 12, 8)  # fmt: skip
    chain = spec_of(command, "--draft", "eagle3", "--draft-model", str(shipped),
                    "--spec-tree", "chain", "--num-speculative-tokens", "2")  # fmt: skip
    assert (chain.tree, chain.num_speculative_tokens, chain.disable_by_batch_size) == (
        "chain", 2, 8
    )  # fmt: skip
    default = SpeculativeConfig(method="eagle3", model=str(random_head_dir))
    assert spec_of(command, "--draft", "eagle3", "--draft-model", str(random_head_dir)) == default
    hub = spec_of(command, "--draft", "eagle3", "--draft-model", "org/some-eagle3-head")
    assert hub == SpeculativeConfig(method="eagle3", model="org/some-eagle3-head")


def test_draft_none_turns_it_off(shipped):
    assert spec_of("generate", "--draft", "none") is None
    assert spec_of("serve", "--draft", "none") is None
    with pytest.raises(ValueError, match="drop --draft none"):
        spec_of("bench", "--draft", "none")


def test_without_a_shipped_head_each_command_keeps_its_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(packaged_heads, "HEADS_DIR", tmp_path)  # nothing shipped
    assert spec_of("generate") is None  # plain decoding
    assert spec_of("serve").method == "ngram"
    assert spec_of("bench").method == "ngram"
    assert main(["generate", "--draft", "eagle3", "--max-tokens", "1"]) == 2
    assert f"--draft eagle3 needs --draft-model HEAD_DIR: '{MODEL}' ships no head" in (
        capsys.readouterr().err
    )


def test_serve_with_another_model_does_not_inherit_the_default_models_head(shipped, tmp_path):
    assert spec_of("serve", "--model", str(tmp_path)).method == "ngram"
    # A head named for it drafts in that head's recorded tree.
    spec = spec_of("serve", "--model", str(tmp_path), "--draft", "eagle3",
                   "--draft-model", str(shipped))  # fmt: skip
    assert (spec.model, spec.tree, spec.total_tokens) == (str(shipped), "dynamic", 12)


def test_generate_runs_the_shipped_head(shipped, capsys):
    """End to end: generate with no speculation flags drafts with the shipped head."""
    argv = ["generate", "hello", "--max-tokens", "4", "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory", str(32 << 20), "--max-model-len", "256"]  # fmt: skip
    assert main(argv) == 0
    assert f"speculation (eagle3, {shipped})" in capsys.readouterr().out


def test_shipping_a_head_is_one_import(tmp_path, monkeypatch, random_head_dir, capsys):
    """``specdec import HEAD specdec/heads/<alias> --dtype bfloat16 --tree JSON`` ships a
    head: bf16 shards of at most 16 MB and the tree it was tuned for, used by default."""
    monkeypatch.setattr(packaged_heads, "HEADS_DIR", tmp_path)
    out = tmp_path / MODEL
    argv = ["import", str(random_head_dir), str(out), "--target", MODEL,
            "--dtype", "bfloat16", "--tree", json.dumps(TREE)]  # fmt: skip
    assert main(argv) == 0
    assert all(f.stat().st_size <= 16_000_000 for f in out.glob("*.safetensors"))
    spec = packaged_heads.default_speculative(MODEL)
    assert (spec.model, spec.tree, spec.top_k, spec.total_tokens) == (str(out), "dynamic", 3, 12)
    assert spec.disable_by_batch_size == 8
    bad = ["import", str(random_head_dir), str(tmp_path / "x"), "--target", MODEL,
           "--tree", '{"tree": "ring", "num_speculative_tokens": 3}']  # fmt: skip
    assert main(bad) == 2
    assert "tree='ring'; choose chain or dynamic" in capsys.readouterr().err
    bad[-1] = '{"tree": "chain", "num_speculative_tokens": 3, "disable_by_batch_size": 0}'
    assert main(bad) == 2
    assert "disable_by_batch_size=0 must be >= 1" in capsys.readouterr().err
