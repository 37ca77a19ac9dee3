"""ServeConfig and the ``specdec serve`` flags, without a model: YAML maps one to one
(unknown keys are errors), ``specdec serve`` with no arguments is the documented default,
and flags given on the command line override a config file."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from specdec.cli import build_parser
from specdec.config import SpeculativeConfig
from specdec.models.packaged_heads import packaged_head
from specdec.serve.cli import serve_config_from_args
from specdec.serve.config import DEFAULT_DRAFT_CUTOFF, DEFAULT_DRAFT_METHOD, ServeConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "serve").glob("*.yaml"))


def _config(*argv: str) -> ServeConfig:
    return serve_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_every_shipped_yaml_maps_onto_serve_config():
    assert {p.name for p in CONFIGS} >= {"default.yaml", "ngram.yaml", "eagle3.yaml"}
    for path in CONFIGS:
        assert isinstance(ServeConfig.from_yaml(path), ServeConfig)
    assert ServeConfig.from_yaml(CONFIGS[[p.name for p in CONFIGS].index("default.yaml")]) == (
        ServeConfig()
    )


def test_no_arguments_serve_the_default_model_with_default_speculation(monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    config = _config()
    assert config == ServeConfig()
    assert (config.host, config.port, config.api_key) == ("127.0.0.1", 8000, None)
    assert config.engine.model == "smollm2-135m-instruct"
    assert config.engine.device == "auto"  # the GPU when there is one
    # The default model ships a head: the server drafts with it in its recorded shape.
    spec = config.engine.speculative
    assert (spec.method, spec.model) == ("eagle3", str(packaged_head("smollm2-135m-instruct")))
    recorded = json.loads((packaged_head("smollm2-135m-instruct") / "config.json").read_text())
    tree = recorded["tree_defaults"]
    assert (spec.tree, spec.num_speculative_tokens) == ("chain", tree["num_speculative_tokens"])
    assert spec.num_speculative_tokens_by_batch_size == tree["num_speculative_tokens_by_batch_size"]
    # Large batches decode plainly and asynchronously (the head's chain loses there).
    assert spec.disable_by_batch_size == 16
    assert config.model_names == ["smollm2-135m-instruct"]


def test_a_model_without_a_shipped_head_serves_with_ngram_lookup(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    spec = _config("--model", str(tmp_path)).engine.speculative
    assert (spec.method, spec.model) == (DEFAULT_DRAFT_METHOD, None)
    assert spec.disable_by_batch_size == DEFAULT_DRAFT_CUTOFF
    yaml_spec = ServeConfig.from_dict({"engine": {"model": str(tmp_path)}}).engine.speculative
    assert yaml_spec == spec


def test_flags_map_onto_the_config(monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    config = _config(
        "--port", "9001", "--api-key", "k", "--served-model-name", "a", "b",
        "--max-model-len", "1024", "--max-num-seqs", "8", "--kv-cache-memory", "1000000",
        "--no-enable-prefix-caching", "--num-speculative-tokens", "5", "--log-level", "debug",
        "--tokenizer-workers", "3", "--tokenizer-max-batch", "8",
    )  # fmt: skip
    assert (config.port, config.api_key, config.model_names) == (9001, "k", ["a", "b"])
    assert config.engine.scheduler.max_model_len == 1024
    assert config.engine.scheduler.max_num_seqs == 8
    assert config.engine.cache.kv_cache_memory == 1_000_000
    assert config.engine.cache.enable_prefix_caching is False
    assert config.engine.speculative.num_speculative_tokens == 5
    assert config.log_level == "debug"
    assert (config.tokenizer_workers, config.tokenizer_max_batch) == (3, 8)
    assert _config("--draft", "none").engine.speculative is None
    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    assert _config().api_key == "from-env"


def test_given_flags_override_the_yaml(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "host": "0.0.0.0",
                "port": 9000,
                "engine": {
                    "model": "some-model",
                    "scheduler": {"max_num_seqs": 4},
                    "speculative": {"method": "eagle3", "model": "head-dir", "tree": "dynamic"},
                },
            }
        )
    )
    config = _config("--config", str(path), "--port", "9100", "--num-speculative-tokens", "6")
    assert (config.host, config.port) == ("0.0.0.0", 9100)  # host from the file
    assert config.engine.model == "some-model" and config.engine.scheduler.max_num_seqs == 4
    spec = config.engine.speculative
    assert (spec.method, spec.model, spec.tree, spec.num_speculative_tokens) == (
        "eagle3",
        "head-dir",
        "dynamic",
        6,
    )
    # A different proposer starts from its own flags, not the file's eagle3 head.
    ngram = _config("--config", str(path), "--draft", "ngram").engine.speculative
    assert (ngram.method, ngram.model, ngram.tree) == ("ngram", None, "chain")
    assert _config("--config", str(path), "--draft", "none").engine.speculative is None


def test_spec_config_json_or_file(tmp_path):
    spec = _config("--spec-config", '{"method": "ngram", "num_speculative_tokens": 5}')
    assert spec.engine.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    file = tmp_path / "spec.yaml"
    file.write_text("method: ngram\nngram_max: 6\n")
    assert _config("--spec-config", str(file)).engine.speculative.ngram_max == 6
    flagged = _config("--spec-config", str(file), "--num-speculative-tokens", "2")
    assert flagged.engine.speculative.num_speculative_tokens == 2  # flags win
    with pytest.raises(ValueError, match="unknown keys"):
        _config("--spec-config", '{"bogus": 1}')
    with pytest.raises(ValueError, match="neither inline JSON nor an existing file"):
        _config("--spec-config", "no/such/file.yaml")


def test_speculative_left_out_keeps_the_default_and_null_turns_it_off():
    assert ServeConfig.from_dict({"engine": {"model": "m"}}).engine.speculative == (
        SpeculativeConfig(method=DEFAULT_DRAFT_METHOD, disable_by_batch_size=DEFAULT_DRAFT_CUTOFF)
    )
    assert ServeConfig.from_dict({"engine": {"speculative": None}}).engine.speculative is None
    assert ServeConfig.from_dict({"served_model_name": "x"}).model_names == ["x"]


def test_the_server_defers_graphs_unless_told_otherwise(monkeypatch):
    """The core builds ``core_engine``: graphs deferred when the config leaves it open, as
    given when it says so, with or without a draft; the config itself stays as given."""
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    config = _config()
    assert config.engine.defer_graphs is None
    assert config.core_engine == replace(config.engine, defer_graphs=True)
    assert _config("--defer-graphs", "off").core_engine.defer_graphs is False
    assert _config("--defer-graphs", "on").engine.defer_graphs is True
    assert _config("--draft", "none").core_engine.defer_graphs is True


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"prot": 1}, "unknown ServeConfig keys ['prot']"),
        ({"engine": {"modle": "x"}}, "unknown EngineConfig keys ['modle']"),
        ({"engine": {"scheduler": {"max_seqs": 1}}}, "unknown SchedulerConfig keys"),
        ({"engine": {"speculative": {"metod": "ngram"}}}, "unknown SpeculativeConfig keys"),
        ({"port": 70000}, "port=70000 is invalid"),
        ({"log_level": "loud"}, "log_level='loud' is invalid"),
        ({"max_tokens_limit": 0}, "max_tokens_limit=0 must be >= 1"),
        ({"tokenizer_workers": 0}, "tokenizer_workers=0 must be >= 1"),
        ({"tokenizer_max_batch": 0}, "tokenizer_max_batch=0 must be >= 1"),
        ({"api_key": ""}, "api_key is empty"),
        ({"served_model_name": []}, "served_model_name=[] is invalid"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, data, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ServeConfig.from_yaml(path)


def test_missing_config_file_is_a_clear_error(capsys):
    from specdec.cli import main

    assert main(["serve", "--config", "no/such.yaml"]) == 2
    assert "serve config 'no/such.yaml' does not exist" in capsys.readouterr().err


def test_resolving_the_server_config_imports_no_torch():
    """The API process resolves its config (the shipped head's bands included) and
    imports its HTTP stack without torch, so it starts the engine core, which needs torch,
    within a second of launch instead of after its own torch import."""
    code = (
        "import sys\n"
        "from specdec.cli import build_parser\n"
        "from specdec.serve.cli import serve_config_from_args\n"
        "config = serve_config_from_args(build_parser().parse_args(['serve']))\n"
        "assert config.engine.speculative.method == 'eagle3', config.engine.speculative\n"
        "import uvicorn\n"
        "import specdec.serve.app, specdec.serve.core_client\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(loaded), loaded[:5])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("0 "), f"torch was imported before the engine core starts: {out}"
