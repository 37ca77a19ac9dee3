"""The ``specdec`` command: generate prints and saves completions and speculation metrics,
and bad input exits with a clear message instead of a traceback."""

from __future__ import annotations

import json

import pytest

from specdec import LLM, SamplingParams
from specdec.cli import main

CPU = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", str(64 << 20)]
PROMPT = "List the first five prime numbers: 2, 3,"


def test_generate_with_draft_compares_with_plain(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "out.json"
    args = ["generate", PROMPT, "--raw", "--max-tokens", "12", "--model", str(smollm2_dir)]
    args += ["--draft", "ngram", "--num-speculative-tokens", "3", "--compare-plain"]
    args += ["--json", str(out), *CPU]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "speculation (ngram): τ=" in printed and "speedup" in printed
    report = json.loads(out.read_text())
    assert report["identical_outputs"] == 1  # lossless: the same tokens as plain decoding
    assert report["speculation"]["steps"] >= 1 and report["speedup"] > 0
    llm = LLM(str(smollm2_dir), device="cpu", dtype="float32", kv_cache_memory=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert report["outputs"][0]["token_ids"] == expected


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--compare-plain"], "--compare-plain compares speculation with plain decoding"),
        (["--draft", "ngram", "--spec-tree", "static"], "tree='static' needs choices"),
        (["--draft", "ngram", "--spec-tree", "dynamic"], "drafts the one continuation"),
        (["--model", "/no/such/model"], "/no/such/model"),
    ],
)
def test_generate_bad_input_is_a_clear_error(smollm2_dir, capsys, extra, message):
    args = ["generate", PROMPT, "--max-tokens", "2", *CPU]
    if "--model" not in extra:
        args += ["--model", str(smollm2_dir)]
    assert main([*args, *extra]) == 2
    assert message in capsys.readouterr().err


def test_prompt_files_take_prompt_and_messages_lines(tmp_path):
    """A bench set's exported file (``{"messages": ...}`` lines) feeds generate and
    bench-serve as is; a line that is neither kind names its line and both formats."""
    from specdec.cli import _read_prompts

    good = tmp_path / "p.jsonl"
    system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "a"}
    lines = [
        {"prompt": "one"},
        {"id": "x", "messages": [system, {"role": "user", "content": "two"}]},
        {"messages": [user, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "three"}]},
    ]  # fmt: skip
    good.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    assert _read_prompts(str(good)) == ["one", "two", "three"]
    for bad in ({"text": "x"}, {"messages": [{"role": "system", "content": "s"}]}, {"prompt": 3}):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(SystemExit, match=r"bad.jsonl:2 is neither"):
            _read_prompts(str(path))
