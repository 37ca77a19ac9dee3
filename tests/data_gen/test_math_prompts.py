"""The ``math`` prompt source (data_gen/word_problems.py): seeded, distinct arithmetic word
problems, none overlapping the gsm_symbolic bench set, filtered against it like every
source, and reachable from ``specdec data-gen prompts --source math --math-prompts N``."""

from __future__ import annotations

import random
import string

import pytest

from specdec.cli import main
from specdec.data_gen import decontam
from specdec.data_gen import mix as mix_module
from specdec.data_gen import prompts as prompts_module
from specdec.data_gen.decontam import BenchmarkConfig, Decontaminator
from specdec.data_gen.mix import MIX_SOURCES, MixConfig
from specdec.data_gen.prompts import PromptsConfig, run_prompts
from specdec.data_gen.records import SkipCounts
from specdec.data_gen.shards import RankInfo, load_manifest
from specdec.data_gen.sources import read_source
from specdec.data_gen.word_problems import (
    CLOSINGS,
    PROBLEMS,
    _render,
    math_conversations,
    math_prompts,
)


@pytest.fixture(scope="module")
def gsm_symbolic() -> list[str]:
    """The bench's math prompts as decontamination indexes them (reasoning-gym's
    gsm_symbolic, the default size and seed)."""
    return decontam._gsm_symbolic(BenchmarkConfig())


def _story_mark(problem) -> str:
    """The longest slot-free run of a story's text: what tells its problems apart."""
    return max((literal for literal, *_ in string.Formatter().parse(problem.text)), key=len)


def test_math_prompts_are_seeded_distinct_word_problems():
    prompts = math_prompts(20000, seed=0)
    assert prompts == math_prompts(20000, seed=0)
    assert prompts != math_prompts(20000, seed=1)
    assert len(set(prompts)) == len(prompts)
    # Every story is drawn, every slot filled (format would raise on a missing one, and
    # no brace or doubled space is left), every closing instruction used.
    for i, problem in enumerate(PROBLEMS):
        text = _render(problem, random.Random(i))
        fields = {name for _, name, _, _ in string.Formatter().parse(problem.text) if name}
        assert fields, i
        assert "{" not in text and "}" not in text and "  " not in text, text
    # Stories are drawn uniformly: each of the 42 tells ~1/42 of the problems.
    marks = [_story_mark(problem) for problem in PROBLEMS]
    told = [sum(mark in p for p in prompts) for mark in marks]
    assert min(told) > 0.5 * len(prompts) / len(PROBLEMS), told
    assert sum(told) == len(prompts)  # every problem is exactly one story's
    for closing in CLOSINGS[1:]:
        assert any(p.endswith(closing) for p in prompts), closing
    assert all(any(ch.isdigit() for ch in p) and "?" in p for p in prompts)
    convs = list(math_conversations(30, seed=0))
    assert [c.id for c in convs] == [f"math/{i}" for i in range(30)]
    assert {c.source for c in convs} == {"math"}
    assert [c.messages[0]["content"] for c in convs] == prompts[:30]
    assert math_prompts(0) == []
    with pytest.raises(ValueError, match=r"count=-1 must be >= 0"):
        math_prompts(-1)
    with pytest.raises(ValueError, match="math_prompts=-3 must be >= 0"):
        MixConfig(math_prompts=-3)


def test_no_math_prompt_overlaps_gsm_symbolic(gsm_symbolic):
    """5,000 composed problems pass the real gsm_symbolic decontaminator, which does flag
    a bench problem dressed in this source's opening and closing."""
    dec = Decontaminator({"gsm_symbolic": gsm_symbolic})
    prompts = math_prompts(5000, seed=0)
    assert not [p for p in prompts if dec.overlaps(p)]
    for problem in gsm_symbolic[::100]:
        assert dec.overlaps(f"Solve this word problem. {problem} {CLOSINGS[2]}")


def test_cli_math_prompts_flag_reaches_the_mix(tmp_path, monkeypatch, capsys, gsm_symbolic):
    """End to end through ``specdec data-gen prompts``: ``mix`` holds no word problems,
    ``math`` adds them, filtered against gsm_symbolic like every source (a bench problem
    planted among the composed ones is dropped)."""
    for name in MIX_SOURCES:  # the mix's own data is tested elsewhere; here it is empty
        monkeypatch.setitem(mix_module.BUILDERS, name, lambda config, skipped: iter(()))
    planted = math_prompts(25, seed=3)[11]
    sets = {"gsm_symbolic": [*gsm_symbolic, planted]}
    monkeypatch.setattr(prompts_module, "load_benchmark_prompts", lambda config: sets)
    with pytest.raises(SystemExit):
        main(["data-gen", "prompts", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--math-prompts" in help_text and "math (composed arithmetic word problems)" in help_text
    out = tmp_path / "out"
    args = ["data-gen", "prompts", "-o", str(out), "--source", "math", "--math-prompts", "25"]
    assert main([*args, "--no-download", "--seed", "3"]) == 0
    manifest = load_manifest(out)
    assert manifest["config"]["mix"]["math_prompts"] == 25
    assert manifest["filtered"]["benchmark_overlap"] >= 1
    assert manifest["counts"]["source_math"] == 25 - manifest["filtered"]["benchmark_overlap"]
    texts = {c.prompt_text for c in read_source(str(out), SkipCounts())}
    assert planted not in texts and texts < set(math_prompts(25, seed=3))
    only_mix = PromptsConfig(
        output=str(tmp_path / "mix"),
        mix=MixConfig(math_prompts=25),
        benchmark=BenchmarkConfig(gsm_symbolic_size=5),
    )
    with pytest.raises(ValueError, match=r"no conversations left from sources \['mix'\]"):
        run_prompts(only_mix, RankInfo())
