"""The GGUF conversion cache (``models/gguf.py``): converted once, reused while the GGUF is
unchanged, rebuilt when the GGUF changes or the entry is damaged, and exact.

Most tests convert with a stand-in converter that writes a small HF directory, so they
check the cache's rules without transformers' ~15 s dequantization; the last one runs
the real conversion of SmolLM2's GGUF and compares it with the cached entry bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.models import gguf as gguf_module
from specdec.models import load_model, resolve_model
from specdec.models.gguf import cache_entry_dir, entry_problem, gguf_to_hf_dir


class StandInConverter:
    """Writes config.json and one safetensors file whose tensor records the GGUF's bytes,
    so an entry shows which version of the file it was converted from."""

    def __init__(self) -> None:
        self.calls: list[Path] = []

    def __call__(self, src: Path, out: Path) -> None:
        self.calls.append(src)
        (out / "config.json").write_text("{}")
        weights = torch.tensor(list(src.read_bytes()), dtype=torch.float32)
        save_file({"w": weights}, str(out / "model.safetensors"))


def _write_gguf(path: Path, content: bytes, mtime_ns: int) -> None:
    path.write_bytes(content)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def _stored(entry: Path) -> bytes:
    return bytes(load_file(str(entry / "model.safetensors"))["w"].to(torch.uint8).tolist())


def test_conversion_is_atomic_reused_and_logged(tmp_path: Path, monkeypatch, caplog) -> None:
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    convert = StandInConverter()

    def killed(src: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gguf_to_hf_dir(gguf, cache, convert=killed)
    assert list((cache / "gguf").iterdir()) == []  # neither an entry nor a temp dir

    caplog.set_level(logging.INFO, logger="specdec.models.gguf")
    entry = gguf_to_hf_dir(gguf, cache, convert=convert)
    assert "converting" in caplog.text and "using the cached" not in caplog.text
    assert entry_problem(entry) is None and entry.parent == cache / "gguf"
    caplog.clear()
    assert gguf_to_hf_dir(gguf, cache, convert=convert) == entry
    assert "using the cached float32 conversion of fake.gguf" in caplog.text
    assert "converting" not in caplog.text
    monkeypatch.setattr(gguf_module, "convert_gguf", convert)  # the default converter
    resolved = resolve_model(str(gguf), cache_dir=cache)
    assert (resolved.name, resolved.hf_dir, resolved.source) == ("fake", entry, "gguf")
    assert len(convert.calls) == 1
    assert [p.name for p in (cache / "gguf").iterdir()] == [entry.name]


@pytest.mark.parametrize(
    "content", [b"GGUF v2, longer", b"GGUF v2", b"GGUF v1"], ids=["resized", "rewritten", "touched"]
)
def test_a_changed_gguf_is_converted_again_and_its_old_entry_removed(
    tmp_path: Path, content: bytes
) -> None:
    gguf, cache = tmp_path / "model.gguf", tmp_path / "cache"
    _write_gguf(gguf, b"GGUF v1", 1_000_000_000)
    # Another GGUF with the same name elsewhere: its entry is not an old version of ours.
    (tmp_path / "other").mkdir()
    other = tmp_path / "other" / "model.gguf"
    _write_gguf(other, b"GGUF other", 1_000_000_000)
    convert = StandInConverter()
    old = gguf_to_hf_dir(gguf, cache, convert=convert)
    other_entry = gguf_to_hf_dir(other, cache, convert=convert)

    _write_gguf(gguf, content, 2_000_000_000)  # a new mtime, as any write gives
    new = gguf_to_hf_dir(gguf, cache, convert=convert)
    assert new != old and len(convert.calls) == 3
    assert _stored(new) == gguf.read_bytes()
    assert not old.exists() and other_entry.exists()
    assert gguf_to_hf_dir(gguf, cache, convert=convert) == new and len(convert.calls) == 3


def _truncate(entry: Path) -> None:
    shard = entry / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])


def _garbage_header(entry: Path) -> None:
    (entry / "model.safetensors").write_bytes(b"\xff" * 64)


def _no_weights(entry: Path) -> None:
    (entry / "model.safetensors").unlink()


def _bad_config(entry: Path) -> None:
    (entry / "config.json").write_text('{"vocab_size": ')


def _missing_shard(entry: Path) -> None:
    index = {"metadata": {}, "weight_map": {"w": "model-00002-of-00002.safetensors"}}
    (entry / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "damage", [_truncate, _garbage_header, _no_weights, _bad_config, _missing_shard]
)
def test_a_damaged_entry_is_converted_again(tmp_path: Path, caplog, damage) -> None:
    gguf, cache = tmp_path / "model.gguf", tmp_path / "cache"
    gguf.write_bytes(b"GGUF weights")
    convert = StandInConverter()
    entry = gguf_to_hf_dir(gguf, cache, convert=convert)
    damage(entry)
    assert entry_problem(entry) is not None

    caplog.set_level(logging.INFO, logger="specdec.models.gguf")
    assert gguf_to_hf_dir(gguf, cache, convert=convert) == entry
    assert "is damaged" in caplog.text and len(convert.calls) == 2
    assert entry_problem(entry) is None and _stored(entry) == gguf.read_bytes()
    assert not (entry / "model.safetensors.index.json").exists()


@pytest.mark.slow
def test_cached_weights_equal_a_fresh_dequantization(smollm2_dir: Path) -> None:
    """The cached entry holds exactly what dequantizing the GGUF gives now, and a model
    loaded from it in bf16 holds exactly those values rounded to bf16."""
    from transformers import AutoModelForCausalLM, GgufConfig

    from specdec.models import ALIASES

    gguf = ALIASES["smollm2-135m-instruct"].locate()
    assert cache_entry_dir(gguf) == smollm2_dir
    fresh = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    ).state_dict()
    cached = load_file(str(smollm2_dir / "model.safetensors"))
    assert set(cached) <= set(fresh)
    for key, tensor in cached.items():
        assert torch.equal(tensor, fresh[key]), key

    model = load_model(resolve_model("smollm2-135m-instruct"), dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        row = 0
        for key, rows in model.checkpoint_layout(name):
            expected = fresh[key].to(torch.bfloat16)
            assert torch.equal(param[row : row + rows], expected), (name, key)
            row += rows
