"""The ``academic`` prompt source: research-paper requests composed from seeded parts, and
the paper plan that the ``documents`` stage (documents.py) builds long inputs from.

Why it exists: WritingBench's academic and engineering requests ask for a paper's outline,
abstract or introduction, often around the paper's whole text (2,000-6,000 tokens). The
``writing`` source asks for essays, letters and stories of a few hundred words, so a head
trained on it never sees a technical paper's prose, nor an answer that leans on a long
document it was given (docs/default_head.md). No offline corpus holds papers,
so they are composed: a *paper* is a research subject in a setting under a title
pattern; the target writes each of its sections itself (this source's section requests),
and ``data-gen documents`` then joins those sections into the documents that long
requests embed. Every paper also yields one short request of the kind WritingBench asks
without a document (an outline, an abstract from a summary, a proposal).

Invariants: the list is a pure function of (papers, seed). A paper's requests have ids
``academic/<paper>/<part>`` where ``part`` is a ``SECTIONS`` key or a ``SHORT_TASKS`` key:
the id is the metadata ``documents`` groups by, so it must not change meaning. Papers are
distinct (subject x setting x title pattern, drawn without replacement), so every request
is distinct. They pass the same deduplication and decontamination as every source.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from specdec.data_gen.records import Conversation

SOURCE = "academic"


@dataclass(frozen=True)
class Section:
    key: str  # the id's part
    title: str  # the heading a document gives it
    asks: str  # what the section request tells the writer to cover
    words: tuple[int, int]


# A paper's sections in document order.
SECTIONS: tuple[Section, ...] = (
    Section("introduction", "Introduction",
            "Explain the research background, why the problem matters, what is missing in "
            "current practice, and the paper's contributions", (350, 600)),
    Section("related_work", "Related Work",
            "Survey the main lines of existing research and technology, and how this work "
            "differs from them", (300, 550)),
    Section("method", "System Design and Methods",
            "Describe the proposed architecture or method, its components, how they work "
            "together, and the key design decisions", (400, 700)),
    Section("implementation", "Implementation and Case Study",
            "Describe how the approach was deployed in practice, the data and tools used, "
            "and one concrete case", (300, 600)),
    Section("results", "Experiments and Results",
            "Describe the evaluation setup, the metrics, the results with concrete figures, "
            "and what they show", (350, 650)),
    Section("conclusion", "Conclusion and Future Work",
            "Summarize the findings, the limitations, and directions for future work",
            (200, 400)),
)  # fmt: skip

SUBJECTS: tuple[str, ...] = (
    "edge computing for real-time video analytics",
    "deep reinforcement learning for building energy control",
    "digital twins for predictive maintenance of wind turbines",
    "federated learning for medical image analysis",
    "blockchain-based supply chain traceability",
    "urban traffic signal optimization",
    "intrusion detection in industrial control networks",
    "microservice architecture for high-concurrency e-commerce platforms",
    "precision irrigation with wireless sensor networks",
    "battery state-of-health estimation for electric vehicles",
    "natural language processing for customer service automation",
    "computer vision for defect detection in manufacturing",
    "smart grid demand response",
    "cloud-native platforms for online education",
    "low-code development platforms in enterprises",
    "autonomous mobile robots in warehouse logistics",
    "data governance in smart city platforms",
    "remote patient monitoring with wearable devices",
    "credit risk assessment with machine learning",
    "knowledge graphs for enterprise search",
    "structural health monitoring of bridges",
    "container orchestration for scientific computing",
    "privacy-preserving data sharing between hospitals",
    "fault diagnosis of rotating machinery",
    "recommendation systems for online learning resources",
    "5G network slicing for industrial applications",
    "carbon emission accounting for manufacturing enterprises",
    "intelligent scheduling of public bus fleets",
    "anomaly detection in financial transactions",
    "speech recognition for low-resource languages",
    "automated software testing frameworks",
    "zero-trust security architecture for enterprise networks",
    "unmanned aerial vehicles for crop monitoring",
    "energy-efficient data center cooling",
    "early warning systems for landslides",
    "artificial intelligence in radiology workflows",
    "quality inspection of printed circuit boards",
    "distributed databases for high-availability services",
    "demand forecasting in retail supply chains",
    "adaptive learning systems in secondary schools",
    "water quality monitoring in river basins",
    "soft robot control with visual feedback",
    "indoor positioning with Bluetooth beacons",
    "electronic health record interoperability",
    "traffic flow prediction with graph neural networks",
    "risk management in construction projects",
    "smart home energy management",
    "vehicle-to-grid charging coordination",
    "explainable machine learning in credit scoring",
    "cyber-physical security of power substations",
    "augmented reality for equipment maintenance",
    "natural disaster response logistics",
    "intelligent tutoring for programming courses",
    "predictive analytics for hospital bed management",
    "hydrogen fuel cell system control",
    "optical character recognition for historical archives",
    "lightweight neural networks on embedded devices",
    "e-government service platforms",
    "cold chain logistics monitoring",
    "photovoltaic power forecasting",
    "network traffic classification with deep learning",
    "smart agriculture industrial parks",
    "occupational safety monitoring on construction sites",
    "sentiment analysis of public opinion on social media",
    "rail transit operation and maintenance",
    "digital transformation of small and medium-sized enterprises",
    "robotic process automation in financial auditing",
    "air quality prediction in urban areas",
    "medical question answering with large language models",
    "automated guided vehicles in port terminals",
    "student performance prediction in online courses",
    "secure firmware updates for Internet of Things devices",
    "multi-robot path planning",
    "telemedicine in rural clinics",
    "inventory optimization for pharmaceutical distribution",
    "road surface damage detection from images",
    "energy storage scheduling in microgrids",
    "legal document analysis with text mining",
    "virtual laboratories for engineering education",
    "intelligent fault location in distribution networks",
)

SETTINGS: tuple[str, ...] = (
    "in power production enterprises",
    "in large public hospitals",
    "in a provincial capital city",
    "for small and medium-sized enterprises",
    "in higher vocational colleges",
    "in a coastal industrial park",
    "under limited computing resources",
    "in cross-border e-commerce",
    "in rural areas",
    "in a municipal water utility",
    "for a regional logistics company",
    "in high-speed railway systems",
)

TITLE_PATTERNS: tuple[str, ...] = (
    "Research on {Subject} {setting}",
    "Design and Implementation of {Subject} {setting}",
    "Application of {Subject} {setting}",
    "{Subject} {setting}: Challenges and Practice",
    "Optimization of {Subject} {setting}",
    "A Framework for {Subject} {setting}",
)

AUDIENCES: tuple[str, ...] = (
    "industry professionals",
    "graduate students",
    "journal reviewers",
    "engineering managers",
    "policy makers",
    "researchers new to the field",
)


@dataclass(frozen=True)
class ShortTask:
    key: str  # the id's part
    # formatted with title, subject, setting, audience, words; each names the title, which
    # keeps the requests of different papers distinct
    phrasings: tuple[str, ...]


# Requests WritingBench-style users make without giving the paper; a paper gets one.
SHORT_TASKS: tuple[ShortTask, ...] = (
    ShortTask("outline", (
        "Please help me draft a detailed outline for a research paper titled \"{title}\", "
        "targeting {audience}. Return it in hierarchical form.",
        "I need to write a paper on {subject}, titled \"{title}\". Please help me complete "
        "an outline for the paper, with chapters, sections and the key points of each.",
    )),
    ShortTask("abstract", (
        "Write an abstract of about {words} words for a paper titled \"{title}\". State the "
        "background, the method, the main results and the significance.",
        "Please help me write the abstract for my paper \"{title}\", for {audience}; "
        "roughly {words} words.",
    )),
    ShortTask("proposal", (
        "Please write a research proposal titled \"{title}\": the background, the research "
        "questions, the methods, the expected results and a timeline.",
        "Draft the project proposal for a study titled \"{title}\". It is read by "
        "{audience}; about {words} words.",
    )),
    ShortTask("literature_review", (
        "Write a literature review for a paper titled \"{title}\", organized by theme, for "
        "{audience}. About {words} words.",
        "Please help me write the literature review chapter for a thesis titled \"{title}\"."
        " Cover the main research directions and their open problems.",
    )),
)  # fmt: skip

SECTION_PHRASINGS: tuple[str, ...] = (
    'Write the "{section}" section of a research paper titled "{title}". {asks}. '
    "About {words} words.",
    'I am writing a paper titled "{title}". Please write its {section} section, about '
    "{words} words. {asks}.",
    'Please help me draft the {section} part of my paper titled "{title}". {asks}. '
    "Aim for roughly {words} words.",
)
# Every section phrasing names the title this way: documents.py reads it back (title_of).
_TITLE = re.compile(r'titled "([^"]+)"')

NUM_PAPERS = len(SUBJECTS) * len(SETTINGS) * len(TITLE_PATTERNS)
_PART_ID = re.compile(rf"^{SOURCE}/(\d+)/([a-z_]+)$")


@dataclass(frozen=True)
class Paper:
    index: int
    subject: str
    setting: str
    title: str
    audience: str


def papers(count: int, seed: int = 0) -> list[Paper]:
    """``count`` distinct papers, drawn without replacement from subject x setting x title
    pattern."""
    if not 0 <= count <= NUM_PAPERS:
        raise ValueError(
            f"academic papers: count={count} must be in [0, {NUM_PAPERS}] (the number of "
            "distinct subject x setting x title-pattern combinations)"
        )
    rng = random.Random(f"academic:{seed}")
    out = []
    for i, index in enumerate(rng.sample(range(NUM_PAPERS), count)):
        index, t = divmod(index, len(TITLE_PATTERNS))
        s, g = divmod(index, len(SETTINGS))
        subject, setting = SUBJECTS[s], SETTINGS[g]
        title = TITLE_PATTERNS[t].format(Subject=_title_case(subject), setting=setting)
        out.append(Paper(i, subject, setting, title, rng.choice(AUDIENCES)))
    return out


def _title_case(text: str) -> str:
    small = {"a", "an", "and", "for", "in", "of", "on", "the", "to", "with", "under"}
    return " ".join(
        w if i and w in small else w[:1].upper() + w[1:] for i, w in enumerate(text.split())
    )


def _words(rng: random.Random, bounds: tuple[int, int]) -> int:
    return 50 * round(rng.randint(*bounds) / 50)


def paper_requests(paper: Paper, seed: int = 0) -> list[tuple[str, str]]:
    """(part, request) for each section of ``paper`` in document order, then its short
    task; a pure function of (paper, seed)."""
    rng = random.Random(f"academic:{seed}:{paper.index}")
    fields = {"title": paper.title, "subject": paper.subject, "setting": paper.setting,
              "audience": paper.audience}  # fmt: skip
    out = []
    for section in SECTIONS:
        phrasing = rng.choice(SECTION_PHRASINGS)
        out.append((section.key, phrasing.format(
            section=section.title, asks=section.asks, words=_words(rng, section.words),
            **fields)))  # fmt: skip
    task = SHORT_TASKS[paper.index % len(SHORT_TASKS)]
    request = rng.choice(task.phrasings).format(words=_words(rng, (250, 600)), **fields)
    out.append((task.key, request))
    return out


def part_id(paper: int, part: str) -> str:
    return f"{SOURCE}/{paper}/{part}"


def parse_part_id(record_id: str) -> tuple[int, str] | None:
    """(paper, part) of an academic request's id, or None for any other id."""
    match = _PART_ID.match(record_id)
    return (int(match[1]), match[2]) if match else None


def title_of(section_request: str) -> str | None:
    """The paper title a section request names (every ``SECTION_PHRASINGS`` entry does)."""
    match = _TITLE.search(section_request)
    return match[1] if match else None


def academic_conversations(count: int, seed: int = 0) -> Iterator[Conversation]:
    """Each of ``count`` papers' section requests and short task, one user turn each."""
    for paper in papers(count, seed):
        for part, request in paper_requests(paper, seed):
            yield Conversation(
                part_id(paper.index, part), ({"role": "user", "content": request},), SOURCE
            )
