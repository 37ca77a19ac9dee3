"""Stage ``data-gen documents``: long requests built around documents the target wrote.

Input: a regenerate directory holding the target's answers to the ``academic`` source's
section requests (academic.py). The sections of one paper, in document order, make a
document of 2,000-4,000 tokens; each paper then gets ``tasks_per_paper`` requests of the
kinds WritingBench users make around a paper they paste in: write its abstract, write or
improve its introduction, write its conclusion, outline it, summarise it, review it.
``regenerate`` answers them (with ``--max-model-len`` large enough, e.g. 8192), and the
head learns from answers that lean on a long context: copied terms, restated findings,
positions far past the short requests' (docs/default_head.md).

A task may hold a section out of the document (``write the introduction`` sees every
section but the introduction). The instruction comes before the document, after it, or
around it, as WritingBench's requests do.

Invariants: the output is a pure function of (the input's records, the config); a paper
with fewer than ``min_sections`` answered sections is skipped (counted); ids are
``documents/<paper>/<task>``; shards are prompts-format JSONL that ``regenerate -i``
reads, resumed like every stage (a shard is rewritten only when the records it should
hold change).
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from dataclasses import asdict, dataclass, field

from tqdm.auto import tqdm

from specdec.data_gen.academic import SECTIONS, parse_part_id, title_of
from specdec.data_gen.records import Conversation, SkipCounts, dumps_record
from specdec.data_gen.shards import RankInfo, ShardStore, chunk_ranges
from specdec.data_gen.sources import read_stage_records
from specdec.data_gen.stage import finish_stage, write_plan

logger = logging.getLogger(__name__)

SOURCE = "documents"
_ORDER = {s.key: i for i, s in enumerate(SECTIONS)}
_HEADINGS = {s.key: s.title for s in SECTIONS}


@dataclass(frozen=True)
class DocTask:
    key: str  # the id's part
    phrasings: tuple[str, ...]  # formatted with title, audience, words
    held_out: str | None = None  # the section the document leaves out (the one to write)


TASKS: tuple[DocTask, ...] = (
    DocTask("abstract", (
        "Please help me write an abstract for this paper, about {words} words.",
        "This is a research paper. Please write an abstract for it based on the content "
        "provided, covering the background, methods, results and conclusions.",
    )),
    DocTask("write_introduction", (
        "Please help me write an introduction for this paper. The other parts of the paper "
        "are as follows.",
        "Write the introduction chapter for the paper below, explaining the research "
        "background and significance; about {words} words.",
    ), held_out="introduction"),
    DocTask("improve_introduction", (
        "Please help me revise the introduction of this paper and expand it, adding the "
        "research background and the research significance.",
        "Please check and improve the introduction of this paper, describing the pain "
        "points and the solutions in more detail.",
    )),
    DocTask("write_conclusion", (
        "Based on the paper below, write its conclusion: the main findings, the limitations "
        "and future work, in about {words} words.",
    ), held_out="conclusion"),
    DocTask("outline", (
        "Please turn this paper into a detailed hierarchical outline, with the key point "
        "of every section.",
    )),
    DocTask("summary", (
        "Summarize the key contributions and findings of this paper for {audience}.",
        "Please write a one-page summary of the paper below for {audience}.",
    )),
    DocTask("review", (
        "Act as a journal reviewer for this paper: list its strengths, its weaknesses and "
        "concrete suggestions for revision.",
    )),
)  # fmt: skip

AUDIENCES = ("busy managers", "a general audience", "graduate students", "policy makers")

TITLE_STYLES = ("**{title}**", "# {title}", "{title}", "Title: {title}")
HEADING_STYLES = ("{n} {name}", "### {n}. {name}", "**{n}. {name}**", "## {name}")
# Where the instruction goes relative to the document.
LAYOUTS = ("{instruction}\n\n{document}", "{document}\n\n{instruction}",
           "{instruction} The paper is as follows:\n\n{document}")  # fmt: skip

_LEADING_HEADING = re.compile(r"^\s*(#+\s*|\*\*)?[^\n]{0,80}\n+")
_SENTENCE_END = re.compile(r"[.!?:)\]\"'*]\s*$")


@dataclass(frozen=True)
class DocumentsConfig:
    input: str  # a regenerate directory with the academic source's answered sections
    output: str
    tasks_per_paper: int = 2
    min_sections: int = 4
    records_per_shard: int = 10000
    seed: int = 0
    tasks: tuple[str, ...] = field(default_factory=lambda: tuple(t.key for t in TASKS))

    def __post_init__(self) -> None:
        known = {t.key for t in TASKS}
        bad = [t for t in self.tasks if t not in known]
        if bad or not self.tasks:
            raise ValueError(f"documents tasks {bad or '[]'}: choose from {sorted(known)}")
        if not 1 <= self.tasks_per_paper <= len(self.tasks):
            raise ValueError(
                f"tasks_per_paper={self.tasks_per_paper} must be in [1, {len(self.tasks)}] "
                "(the number of tasks)"
            )
        if not 2 <= self.min_sections <= len(SECTIONS):
            raise ValueError(f"min_sections={self.min_sections} must be in [2, {len(SECTIONS)}]")
        if self.records_per_shard < 1:
            raise ValueError(f"records_per_shard={self.records_per_shard} must be >= 1")


@dataclass
class Paper:
    title: str
    sections: dict[str, str] = field(default_factory=dict)  # key -> the target's text


def clean_section(text: str, heading: str) -> str:
    """The answer as a document's section body: without a first line that only repeats
    the heading or title, and cut back to its last finished sentence (an answer that hit
    ``max_tokens`` stops mid-sentence)."""
    text = text.strip()
    first = _LEADING_HEADING.match(text)
    if first and (heading.lower() in first[0].lower() or first[0].lstrip().startswith("#")):
        text = text[first.end() :].strip()
    if not _SENTENCE_END.search(text):
        cut = max(text.rfind(". "), text.rfind(".\n"))
        text = text[: cut + 1] if cut > 0 else text
    return text


def collect_papers(root: str, skipped: SkipCounts) -> dict[int, Paper]:
    """Every academic paper's answered sections in ``root``, by paper index."""
    out: dict[int, Paper] = {}
    for obj in tqdm(read_stage_records(root, skipped), desc="read answers", unit="rec"):
        parsed = parse_part_id(str(obj.get("id", "")))
        if parsed is None or parsed[1] not in _ORDER:
            continue  # another source's record, or a short task
        turns = obj.get("conversations") or []
        users = [m.get("content", "") for m in turns if m.get("role") == "user"]
        answers = [m.get("content", "") for m in turns if m.get("role") == "assistant"]
        title = title_of(users[0]) if users else None
        if title is None or not answers or not answers[-1].strip():
            skipped.add("documents_bad_section")
            continue
        paper = out.setdefault(parsed[0], Paper(title))
        paper.sections[parsed[1]] = clean_section(answers[-1], _HEADINGS[parsed[1]])
    return out


def render_document(paper: Paper, rng: random.Random, held_out: str | None) -> str:
    keys = sorted((k for k in paper.sections if k != held_out), key=_ORDER.__getitem__)
    heading = rng.choice(HEADING_STYLES)
    parts = [rng.choice(TITLE_STYLES).format(title=paper.title)]
    for n, key in enumerate(keys, 1):
        parts.append(heading.format(n=n, name=_HEADINGS[key]) + "\n\n" + paper.sections[key])
    return "\n\n".join(parts)


def document_conversations(
    papers: dict[int, Paper], config: DocumentsConfig, skipped: SkipCounts
) -> list[Conversation]:
    """``tasks_per_paper`` requests per paper with enough sections, in paper order."""
    tasks = [t for t in TASKS if t.key in config.tasks]
    out = []
    for index in sorted(papers):
        paper = papers[index]
        if len(paper.sections) < config.min_sections:
            skipped.add("documents_too_few_sections")
            continue
        rng = random.Random(f"documents:{config.seed}:{index}")
        usable = [t for t in tasks if t.held_out is None or t.held_out in paper.sections]
        for task in rng.sample(usable, min(config.tasks_per_paper, len(usable))):
            instruction = rng.choice(task.phrasings).format(
                title=paper.title,
                audience=rng.choice(AUDIENCES),
                words=50 * round(rng.randint(250, 500) / 50),
            )
            document = render_document(paper, rng, task.held_out)
            text = rng.choice(LAYOUTS).format(instruction=instruction, document=document)
            out.append(
                Conversation(
                    f"{SOURCE}/{index}/{task.key}", ({"role": "user", "content": text},), SOURCE
                )
            )
    return out


def run_documents(config: DocumentsConfig, rank: RankInfo | None = None) -> dict | None:
    """Write this rank's shards of document requests; the manifest once all exist."""
    rank = rank or RankInfo.from_env()
    skipped = SkipCounts()
    papers = collect_papers(config.input, skipped)
    convs = document_conversations(papers, config, skipped)
    if not convs:
        raise ValueError(
            f"{config.input} gave no document requests: {len(papers)} academic papers found "
            f"({skipped.as_dict()}); regenerate the academic source's prompts (data-gen "
            "prompts --source academic) into it first, or lower --min-sections"
        )
    store = ShardStore(config.output, "prompts", "jsonl")
    shards = [convs[a:b] for a, b in chunk_ranges(len(convs), config.records_per_shard)]
    payloads = [
        "".join(dumps_record(c.to_json()) + "\n" for c in shard).encode() for shard in shards
    ]
    digests = [hashlib.sha256(p).hexdigest() for p in payloads]
    settings = {k: v for k, v in asdict(config).items() if k not in ("input", "output")}
    header = {
        "stage": SOURCE,
        "papers": len(papers),
        "filtered": skipped.as_dict(),
        "config": {**settings, "tasks": list(config.tasks)},
    }
    write_plan(store, digests, header)
    for i in store.pending(digests, rank.owned(len(digests))):
        store.write(i, payloads[i], digests[i], {"records": len(shards[i])})
    return finish_stage(store, digests, header, rank)
