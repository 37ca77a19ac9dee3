"""EAGLE-3 heads with SpecExit channels: they round-trip through our format with identical
signals and drafts, heads without channels load as before, and exports for vLLM, SGLang
and EAGLE drop the channels, say so, validate, and draft exactly like the original."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specdec.attention import get_attention_backend
from specdec.cli import main
from specdec.interop.export import export_head
from specdec.models import WeightLoadError, load_config
from specdec.models.eagle3_formats import checkpoint_shapes, load_eagle3, save_eagle3
from specdec.models.eagle3_head import Eagle3Config, Eagle3Head

SMOLLM2 = "smollm2-135m-instruct"
SIGNALS = ("confidence", "progress", "remaining")


@pytest.fixture(scope="module")
def target():
    return load_config(SMOLLM2)


def plain_head(target) -> Eagle3Head:
    config = Eagle3Config.for_target(target, 512, target_name=SMOLLM2)
    return Eagle3Head(config, get_attention_backend("torch"))


def head_with_channels(target, signals=SIGNALS, seed: int = 0) -> Eagle3Head:
    config = Eagle3Config.for_target(target, 512, target_name=SMOLLM2, exit_signals=signals)
    torch.manual_seed(seed)
    head = Eagle3Head(config, get_attention_backend("torch"))
    with torch.no_grad():
        head.fc.weight.mul_(1e-3)
        head.spec_exit.weight.normal_(0, 0.02)
        head.spec_exit.bias.normal_()
    return head


def test_config_orders_and_checks_signal_names(target):
    config = Eagle3Config.for_target(target, 512, exit_signals=("remaining", "confidence"))
    assert config.exit_signals == ("confidence", "remaining")
    with pytest.raises(ValueError, match="unknown SpecExit signal"):
        Eagle3Config.for_target(target, 512, exit_signals=("certainty",))
    plain = Eagle3Config.for_target(target, 512)
    assert plain.exit_signals == () and "spec_exit.weight" not in checkpoint_shapes(plain)
    assert checkpoint_shapes(config)["spec_exit.weight"] == (2, 3 * target.hidden_size)


def test_channels_round_trip_in_our_format(target, tmp_path: Path):
    head = head_with_channels(target)
    out = save_eagle3(head, tmp_path / "head")
    assert json.loads((out / "config.json").read_text())["spec_exit_signals"] == list(SIGNALS)
    loaded = load_eagle3(out, target_config=target)
    assert loaded.config == head.config
    aux = torch.randn(5, 3 * target.hidden_size)
    signals = loaded.exit_signals(aux)
    assert torch.equal(signals, head.exit_signals(aux))
    assert ((signals[:, :2] > 0) & (signals[:, :2] < 1)).all() and (signals[:, 2] >= 0).all()
    # Missing channel weights are an error, never a silent random init.
    config = json.loads((out / "config.json").read_text())
    config["spec_exit_signals"] = list(SIGNALS)
    broken = save_eagle3(plain_head(target), tmp_path / "broken")
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"spec_exit\.weight"):
        load_eagle3(broken, target_config=target)


@pytest.mark.parametrize("to", ["vllm", "sglang", "eagle"])
def test_export_drops_the_channels_and_validates(target, tmp_path: Path, to: str, capsys):
    head = head_with_channels(target)
    source = save_eagle3(head, tmp_path / "head")
    out = tmp_path / to
    assert main(["export", "--to", to, str(source), str(out), "--target", SMOLLM2]) == 0
    assert "dropped spec_exit.weight, spec_exit.bias (SpecExit channels" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert "spec_exit_signals" not in config
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not any(k.startswith("spec_exit") for k in f.keys())  # noqa: SIM118
        assert f.metadata()["specdec_dropped"] == "SpecExit channels " + ", ".join(SIGNALS)
    # The export drafts exactly like the original head.
    exported = load_eagle3(out, target_config=target)
    assert exported.config.exit_signals == () and exported.spec_exit is None
    original = head.state_dict()
    for key, tensor in exported.state_dict().items():
        assert torch.equal(tensor, original[key]), key


def test_export_result_names_the_dropped_keys(target, tmp_path: Path):
    source = save_eagle3(head_with_channels(target, ("progress",)), tmp_path / "head")
    result = export_head(source, tmp_path / "vllm", "vllm", target=SMOLLM2)
    assert result.report.ok and result.dropped == ("spec_exit.weight", "spec_exit.bias")
    plain = save_eagle3(plain_head(target), tmp_path / "plain")
    assert export_head(plain, tmp_path / "plain-vllm", "vllm", target=SMOLLM2).dropped == ()


def test_proposal_signals_average_each_catch_up(target):
    """What a tree carries: the mean of the rows' signals over each request's real
    catch-up rows (padding after ``last`` never counts)."""
    from types import SimpleNamespace

    from specdec.spec.eagle3 import Eagle3Proposer

    head = head_with_channels(target)
    aux = torch.randn(2, 3, 3 * target.hidden_size)  # [batch, width, 3H]
    last = torch.tensor([0, 2])
    got = Eagle3Proposer._mean_exit_signals(SimpleNamespace(head=head), aux, last)
    per_row = head.exit_signals(aux.flatten(0, 1)).view(2, 3, -1)
    torch.testing.assert_close(got, torch.stack([per_row[0, 0], per_row[1].mean(0)]))


def test_validator_names_unexported_channels(target, tmp_path: Path):
    from specdec.interop.validate import validate_head

    head_dir = save_eagle3(head_with_channels(target), tmp_path / "head")
    assert validate_head(head_dir, "specdec", target=target, target_name=SMOLLM2).ok
    report = validate_head(head_dir, "vllm", target=target, target_name=SMOLLM2)
    assert not report.ok and "specdec export --to vllm" in report.render()
    assert "SpecExit channels" in report.render()


# ---------------------------------------------------------------- the recorded setting

SETTING = {"smoothing": "window", "window": 2}


def test_import_records_the_spec_exit_setting_and_it_round_trips(target, tmp_path: Path, capsys):
    """``specdec import ... --spec-exit JSON`` records the setting measured best for a head
    (``spec_exit_defaults``, canonical field order); it survives load and save, and a
    re-import without the flag keeps it."""
    source = save_eagle3(head_with_channels(target), tmp_path / "trained")
    assert "spec_exit_defaults" not in json.loads((source / "config.json").read_text())
    out = tmp_path / "shipped"
    given = {"window": 2, "smoothing": "window"}
    argv = ["import", str(source), str(out), "--target", SMOLLM2, "--spec-exit", json.dumps(given)]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert list(config["spec_exit_defaults"].items()) == list(SETTING.items())
    loaded = load_eagle3(out, target_config=target)
    assert loaded.config.spec_exit_defaults == SETTING
    again = load_eagle3(save_eagle3(loaded, tmp_path / "saved"), target_config=target)
    assert again.config == loaded.config
    assert main(["import", str(out), str(tmp_path / "kept"), "--target", SMOLLM2]) == 0
    kept = json.loads((tmp_path / "kept" / "config.json").read_text())
    assert kept["spec_exit_defaults"] == SETTING
    # Other engines' formats have no place for it (nor for the channels).
    assert main(["export", "--to", "vllm", str(out), str(tmp_path / "vllm")]) == 0
    assert "spec_exit_defaults" not in (tmp_path / "vllm" / "config.json").read_text()
    capsys.readouterr()


def test_a_bad_or_misplaced_setting_is_refused_with_the_fix(target, tmp_path: Path, capsys):
    source = save_eagle3(head_with_channels(target), tmp_path / "trained")
    plain = save_eagle3(plain_head(target), tmp_path / "plain")

    def run(head: Path, setting: str) -> str:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        assert (
            main(["import", str(head), str(out), "--target", SMOLLM2, "--spec-exit", setting]) == 2
        )
        assert not out.exists() or not any(out.iterdir())  # nothing half-written
        return capsys.readouterr().err

    assert "no SpecExit channels" in run(plain, json.dumps(SETTING))
    assert "spec_exit.window=0 must be an int >= 1" in run(source, '{"window": 0}')
    assert "unknown spec_exit keys ['windw']" in run(source, '{"windw": 2}')
    assert "give a JSON object" in run(source, "[2]")
    # A bad record in config.json: loading names the file, the value and the fix.
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(
        json.dumps({**config, "spec_exit_defaults": {"smoothing": "median"}})
    )
    with pytest.raises(WeightLoadError) as err:
        load_eagle3(source, target_config=target)
    message = str(err.value)
    assert str(source / "config.json") in message and "'median'" in message
    assert "choose one of ewma | momentum | window" in message and "fix the record" in message
    # ...and so does a record on a head without channels, or one that thresholds none of
    # the head's signals.
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "spec_exit_defaults": SETTING}))
    with pytest.raises(WeightLoadError, match="no SpecExit channels"):
        load_eagle3(plain, target_config=target)
    only_progress = Eagle3Config.for_target(target, 512, exit_signals=("progress",))
    with pytest.raises(ValueError, match="thresholds none of this head's signals"):
        replace(only_progress, spec_exit_defaults={"progress_above": None})
