"""The ``academic`` prompt source (data_gen/academic.py) and the ``documents`` stage
(data_gen/documents.py): seeded distinct paper requests whose ids say which paper and part
they are, and long requests built from a regenerate directory's answered sections, resumed
like every stage and read back by regenerate."""

from __future__ import annotations

import json

import pytest

from specdec.cli import main
from specdec.data_gen import mix as mix_module
from specdec.data_gen.academic import (
    NUM_PAPERS,
    SECTIONS,
    SHORT_TASKS,
    academic_conversations,
    paper_requests,
    papers,
    parse_part_id,
    title_of,
)
from specdec.data_gen.decontam import BenchmarkConfig, Decontaminator
from specdec.data_gen.documents import (
    TASKS,
    DocumentsConfig,
    clean_section,
    run_documents,
)
from specdec.data_gen.mix import MIX_SOURCES, MixConfig
from specdec.data_gen.prompts import PromptsConfig, run_prompts
from specdec.data_gen.records import SkipCounts, dumps_record
from specdec.data_gen.shards import RankInfo, ShardStore, load_manifest
from specdec.data_gen.sources import read_source
from specdec.data_gen.stage import finish_stage, write_plan


def test_academic_requests_are_seeded_distinct_and_say_their_paper_and_part():
    convs = list(academic_conversations(300, seed=0))
    assert [c.to_json() for c in convs] == [c.to_json() for c in academic_conversations(300, 0)]
    assert [c.prompt_text for c in convs] != [c.prompt_text for c in academic_conversations(300, 1)]
    assert len(convs) == 300 * (len(SECTIONS) + 1)
    assert len({c.prompt_text for c in convs}) == len(convs)
    assert len({p.title for p in papers(NUM_PAPERS)}) == NUM_PAPERS  # every combination
    parts = [parse_part_id(c.id) for c in convs]
    assert all(c.source == "academic" for c in convs) and None not in parts
    by_paper = {}
    for (paper, part), conv in zip(parts, convs, strict=True):
        by_paper.setdefault(paper, []).append((part, conv.prompt_text))
    assert sorted(by_paper) == list(range(300))
    short = {t.key for t in SHORT_TASKS}
    for paper in papers(300):
        got = by_paper[paper.index]
        # Six sections in document order, each naming the paper's title, then one short task.
        assert [p for p, _ in got[:-1]] == [s.key for s in SECTIONS] and got[-1][0] in short
        assert all(title_of(text) == paper.title for _, text in got[:-1])
        assert got == paper_requests(paper)
    assert {part for _, part in parts} >= short  # every task drawn
    assert parse_part_id("writing/3") is None and parse_part_id("academic/x/intro") is None
    with pytest.raises(ValueError, match=rf"count={NUM_PAPERS + 1} must be in \[0, {NUM_PAPERS}\]"):
        papers(NUM_PAPERS + 1)
    with pytest.raises(ValueError, match="academic_papers=-1 must be >= 0"):
        MixConfig(academic_papers=-1)


def test_the_academic_source_is_opt_in_and_decontaminated(tmp_path, monkeypatch):
    for name in MIX_SOURCES:  # the mix's own data is tested elsewhere; here it is empty
        monkeypatch.setitem(mix_module.BUILDERS, name, lambda config, skipped: iter(()))
    planted = next(academic_conversations(5, seed=0)).prompt_text
    (tmp_path / "wb.jsonl").write_text(json.dumps({"query": planted}) + "\n")
    bench = BenchmarkConfig(gsm_symbolic_size=5, writingbench_path=str(tmp_path / "wb.jsonl"))
    config = PromptsConfig(
        output=str(tmp_path / "out"),
        sources=("mix", "academic"),
        mix=MixConfig(academic_papers=5),
        benchmark=bench,
    )
    manifest = run_prompts(config, RankInfo())
    # The planted request goes, and with it every request sharing a 13-word run with it
    # (the same paper's title, other papers' introduction requests of the same wording).
    kept, dropped = manifest["counts"]["source_academic"], manifest["filtered"]["benchmark_overlap"]
    assert kept + dropped == 5 * 7 and 1 <= dropped < 5 * 7
    texts = [c.prompt_text for c in read_source(str(tmp_path / "out"), SkipCounts())]
    assert len(texts) == kept and planted not in texts
    decontaminator = Decontaminator({"writingbench": [planted]}, 13)
    assert not any(decontaminator.overlaps(t) for t in texts)


def _answer(paper: int, part: str, n: int) -> str:
    """A section body the way the target writes one: a heading line, then prose that the
    last call cut mid-sentence when ``n`` is odd."""
    body = " ".join(f"Paper {paper} {part} sentence {i}." for i in range(n))
    return f"## {part.replace('_', ' ').title()}\n\n{body}" + (" And then the" if n % 2 else "")


def _regen_dir(root, answered: dict[int, list[str]], count: int) -> None:
    """A regenerate directory holding the target's (here: made-up) answers to the
    academic requests of ``answered``'s papers and parts, plus another source's record."""
    records = [{"id": "writing/0", "source": "writing", "conversations": [
        {"role": "user", "content": "Write an essay."},
        {"role": "assistant", "content": "An essay."}]}]  # fmt: skip
    for conv in academic_conversations(count, seed=0):
        paper, part = parse_part_id(conv.id)
        if part in answered.get(paper, ()):
            records.append({**conv.to_json(), "conversations": [
                *conv.messages, {"role": "assistant", "content": _answer(paper, part, 3 + paper)}
            ], "input_ids": [1, 2], "loss_mask": [0, 1]})  # fmt: skip
    store = ShardStore(root, "regen", "jsonl")
    payload = "".join(dumps_record(r) + "\n" for r in records).encode()
    digests = ["d0"]
    write_plan(store, digests, {"stage": "regenerate"})
    store.write(0, payload, digests[0], {"records": len(records)})
    finish_stage(store, digests, {"stage": "regenerate"}, RankInfo())


def test_documents_join_a_papers_sections_around_a_task(tmp_path):
    every = [s.key for s in SECTIONS]
    answered = {0: every, 1: every[:3], 2: [k for k in every if k != "introduction"], 3: every}
    _regen_dir(tmp_path / "regen", answered, count=4)
    config = DocumentsConfig(
        input=str(tmp_path / "regen"), output=str(tmp_path / "docs"), tasks_per_paper=3
    )
    manifest = run_documents(config, RankInfo())
    # Paper 1 has three answered sections (< min_sections 4): skipped and counted.
    assert manifest["papers"] == 4
    assert manifest["filtered"] == {"skipped_documents_too_few_sections": 1}
    convs = list(read_source(str(tmp_path / "docs"), SkipCounts()))  # what regenerate reads
    assert len(convs) == 3 * 3 and {c.source for c in convs} == {"documents"}
    titles = {p.index: p.title for p in papers(4)}
    tasks = {t.key: t for t in TASKS}
    for conv in convs:
        _, paper, task = conv.id.split("/")
        text, paper = conv.prompt_text, int(paper)
        assert paper in (0, 2, 3) and titles[paper] in text
        held = tasks[task].held_out
        assert held != "introduction" or paper != 2  # nothing to hold out there
        present = [k for k in answered[paper] if k != held]
        # Every present section once, in document order, cleaned: no repeated heading
        # line, cut back to its last finished sentence.
        at = [text.index(f"Paper {paper} {k} sentence 0.") for k in present]
        assert at == sorted(at)
        for key in answered[paper]:
            assert (f"Paper {paper} {key} sentence" in text) == (key != held)
        assert "## " + "Introduction\n\nPaper" not in text and "And then the" not in text
    assert {c.id.split("/")[2] for c in convs} <= set(tasks)

    # A rerun writes nothing new: the same bytes; a damaged shard is rewritten to them.
    shard = tmp_path / "docs" / manifest["shards"][0]["file"]
    before = shard.read_bytes()
    shard.write_bytes(before[:-7])
    assert run_documents(config, RankInfo())["shards"] == manifest["shards"]
    assert shard.read_bytes() == before
    # Another seed draws other tasks and layouts for the same papers.
    other = run_documents(
        DocumentsConfig(input=config.input, output=str(tmp_path / "docs2"), seed=1), RankInfo()
    )
    assert load_manifest(tmp_path / "docs2")["counts"] == other["counts"]
    assert other["shards"][0]["sha256"] != manifest["shards"][0]["sha256"]


def test_documents_errors_name_the_fix(tmp_path):
    _regen_dir(tmp_path / "regen", {}, count=2)  # no academic answers at all
    with pytest.raises(ValueError, match=r"no document requests: 0 academic papers .*"
                       r"data-gen prompts --source academic"):  # fmt: skip
        run_documents(DocumentsConfig(input=str(tmp_path / "regen"), output=str(tmp_path / "d")))
    with pytest.raises(ValueError, match=r"documents tasks \['poem'\]: choose from"):
        DocumentsConfig(input="i", output="o", tasks=("poem",))
    with pytest.raises(ValueError, match=r"tasks_per_paper=3 must be in \[1, 2\]"):
        DocumentsConfig(input="i", output="o", tasks=("abstract", "outline"), tasks_per_paper=3)
    with pytest.raises(ValueError, match=r"min_sections=1 must be in \[2, 6\]"):
        DocumentsConfig(input="i", output="o", min_sections=1)


def test_clean_section_keeps_the_body():
    assert clean_section("Introduction\n\nText one. Text two", "Introduction") == "Text one."
    assert clean_section("**1. Introduction**\nBody.", "Introduction") == "Body."
    assert clean_section("A first line of prose.\nMore.", "Conclusion") == (
        "A first line of prose.\nMore."
    )


def test_documents_cli(tmp_path, capsys):
    every = [s.key for s in SECTIONS]
    _regen_dir(tmp_path / "regen", {0: every, 1: every}, count=2)
    args = ["data-gen", "documents", "-i", str(tmp_path / "regen"), "-o", str(tmp_path / "d"),
            "--tasks", "abstract", "outline", "--tasks-per-paper", "1"]  # fmt: skip
    assert main(args) == 0
    assert "manifest: 1 shards; records=2" in capsys.readouterr().out
    convs = list(read_source(str(tmp_path / "d"), SkipCounts()))
    assert {c.id.split("/")[2] for c in convs} <= {"abstract", "outline"}
