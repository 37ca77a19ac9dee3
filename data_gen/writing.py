"""The ``writing`` prompt source: long-form writing requests composed from seeded parts.

Why it exists: the default mix (BIG-bench inputs, reasoning-gym questions, chatterbot
dialogs) asks for short answers, so a head trained on the target's answers to it sees
little long prose, and long-form writing is where its acceptance is lowest (WritingBench,
docs/default_head.md). No instruction set with long-form requests ships offline (no
Alpaca, ShareGPT or UltraChat), so requests are composed: a *form* (essay, cover letter,
short story, ...) about a *subject*, for an *audience*, in a *tone*, at a *length*, in one
of several phrasings. The target answers them itself (``data-gen regenerate``): the
answers, not these prompts, are what the head learns.

Invariants: the list is a pure function of (count, seed); ids are ``writing/<i>`` in
order; prompts are distinct (the parts' product holds ~3M combinations, drawn without
replacement); they pass through the same deduplication and WritingBench decontamination
as every source (``mix.filter_conversations``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from specdec.data_gen.records import Conversation


@dataclass(frozen=True)
class Form:
    name: str  # what is written, with its article: "an essay"
    words: tuple[int, int]  # the length range asked for, in words


FORMS: tuple[Form, ...] = (
    Form("an essay", (400, 900)),
    Form("a blog post", (400, 800)),
    Form("a short story", (500, 1000)),
    Form("a formal letter", (250, 500)),
    Form("a persuasive speech", (400, 800)),
    Form("a product description", (150, 350)),
    Form("a news article", (300, 700)),
    Form("a cover letter", (250, 450)),
    Form("a press release", (250, 500)),
    Form("an opinion column", (400, 800)),
    Form("a lesson plan", (300, 700)),
    Form("a travel guide entry", (300, 700)),
    Form("a book review", (300, 650)),
    Form("a newsletter", (250, 550)),
    Form("a personal statement", (400, 700)),
    Form("a how-to guide", (300, 800)),
    Form("a project proposal", (400, 900)),
    Form("a short biography", (300, 600)),
    Form("a dialogue scene", (300, 700)),
    Form("a report", (400, 900)),
    Form("a set of frequently asked questions with answers", (300, 700)),
    Form("a motivational talk", (300, 600)),
    Form("a eulogy", (300, 600)),
    Form("a museum exhibit description", (200, 450)),
    Form("a podcast script", (400, 800)),
    Form("a grant application summary", (300, 600)),
    Form("a policy memo", (300, 700)),
    Form("an email to a colleague", (150, 350)),
    Form("a wedding toast", (200, 450)),
    Form("a fairy tale", (400, 900)),
)

SUBJECTS: tuple[str, ...] = (
    "learning a second language as an adult",
    "the history of the bicycle",
    "urban beekeeping",
    "why sleep matters for memory",
    "a small town's first public library",
    "remote work and team culture",
    "the ethics of self-driving cars",
    "growing tomatoes on a balcony",
    "the life cycle of a star",
    "saving money on a tight budget",
    "a lighthouse keeper's last night",
    "the invention of the printing press",
    "volunteering at an animal shelter",
    "how vaccines train the immune system",
    "a family recipe passed down for generations",
    "the rise of electric buses",
    "coral reefs under threat",
    "starting a neighborhood book club",
    "the first day at a new school",
    "the importance of clean drinking water",
    "a robot that learns to paint",
    "public speaking anxiety",
    "the economics of coffee farming",
    "restoring an old wooden boat",
    "digital privacy for teenagers",
    "a journey across the Sahara",
    "composting at home",
    "the science of rainbows",
    "a chess match between rivals",
    "the benefits of walking meetings",
    "a city park's hundredth anniversary",
    "mentoring new employees",
    "the history of jazz",
    "reducing food waste in restaurants",
    "a lost letter delivered fifty years late",
    "solar panels for rural schools",
    "the migration of monarch butterflies",
    "building a treehouse with children",
    "the role of libraries in the digital age",
    "a chef opening a first restaurant",
    "how bridges stay up",
    "caring for an aging parent",
    "the discovery of penicillin",
    "learning to play the violin",
    "a rainy afternoon in an old bookshop",
    "community gardens in cities",
    "the future of space tourism",
    "a mountain rescue team",
    "time management for students",
    "the art of handwritten letters",
    "a village preparing for a festival",
    "ocean plastic and what can be done",
    "the first computer programmers",
    "adopting a rescue dog",
    "a scientist's failed experiment that led to a breakthrough",
    "the pleasure of slow travel by train",
    "teaching children to code",
    "the decline of pollinators",
    "a marathon runner's comeback",
    "the history of maps",
    "mindfulness at work",
    "a violin maker's workshop",
    "affordable housing in growing cities",
    "the night sky without light pollution",
    "a grandmother's advice",
    "recycling electronics",
    "the invention of the telephone",
    "friendship across generations",
    "a ship's cat",
    "how the internet reaches remote islands",
    "a local bakery's comeback",
    "the psychology of habits",
    "a winter storm that closed the roads",
    "the value of learning history",
    "designing a playground for all abilities",
    "the long voyage of a message in a bottle",
    "keeping bees in a changing climate",
    "a museum at night",
    "open-source software communities",
    "the first snowfall of the year",
    "a detective who cannot remember faces",
    "why people collect things",
    "farming with drones",
    "the story of a famous painting",
    "learning from failure",
    "a lighthouse turned into a hotel",
    "water conservation in dry regions",
    "the joy of amateur astronomy",
    "a teacher who changed a student's life",
    "the history of the Olympic Games",
    "a forest recovering after a fire",
    "online learning for working parents",
    "a musician's first concert",
    "the hidden life of trees",
    "choosing a first car",
    "the design of a good chair",
    "a small business surviving a recession",
    "birdwatching for beginners",
    "the importance of bees in agriculture",
    "a dragon who is afraid of fire",
    "public transport in the year 2050",
    "writing a first novel",
    "the history of chocolate",
    "an unexpected friendship between neighbors",
    "the benefits of cycling to work",
    "a town that banned cars from its center",
    "the craft of bookbinding",
    "healthy eating on a budget",
    "a ghost who haunts a library",
    "the science of earthquakes",
    "moving to a new country",
    "preserving indigenous languages",
    "the first moon landing",
    "a bakery run by robots",
    "keeping a journal",
    "wildlife corridors across highways",
    "the story of a retired racehorse",
    "how elections are counted",
    "a summer job at a lighthouse",
    "the meaning of home",
    "a carpenter's apprentice",
    "the invention of the refrigerator",
    "protecting wetlands",
    "the last bookstore in a city",
    "a child's first visit to the sea",
    "data literacy for everyone",
    "an orchestra rehearsing in a blackout",
    "the history of tea",
    "designing a quiet office",
    "a river's journey from source to sea",
    "kindness in everyday life",
    "a fox that lives in a train station",
    "the challenges of deep-sea exploration",
    "learning to cook at fifty",
    "the role of museums in education",
    "a garden planted for a lost friend",
    "the science of baking bread",
    "the future of reading",
)

AUDIENCES: tuple[str, ...] = (
    "a general audience",
    "high school students",
    "busy professionals",
    "young children",
    "retirees",
    "a company's board of directors",
    "new parents",
    "local residents",
    "university admissions officers",
    "readers of a travel magazine",
    "small business owners",
    "a community newsletter's readers",
)

TONES: tuple[str, ...] = (
    "warm and friendly",
    "formal",
    "humorous",
    "inspiring",
    "calm and reassuring",
    "persuasive",
    "reflective",
    "enthusiastic",
    "plain and practical",
    "vivid and descriptive",
)

PHRASINGS: tuple[str, ...] = (
    "Write {form} about {subject} for {audience}. Keep the tone {tone}; about {words} words.",
    "Please write {form} on {subject}. The readers are {audience}; keep the tone {tone}. "
    "Aim for roughly {words} words.",
    "I need {form} about {subject}, written for {audience}. Make it {tone}, around {words} "
    "words long, with a clear beginning, middle and end.",
    "Compose {form} on the topic of {subject}. Audience: {audience}. Tone: {tone}. "
    "Length: about {words} words.",
    "Could you draft {form} about {subject}? It is for {audience}, so keep it {tone}. "
    "Around {words} words, please.",
    "Write {form} ({words} words or so) about {subject}, aimed at {audience}. The style "
    "should be {tone}. Use paragraphs and concrete details.",
)

NUM_COMBINATIONS = len(FORMS) * len(SUBJECTS) * len(AUDIENCES) * len(TONES) * len(PHRASINGS)


def writing_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct requests, drawn without replacement from the parts' product;
    each asks for a length in its form's range, rounded to 50 words."""
    if not 0 <= count <= NUM_COMBINATIONS:
        raise ValueError(
            f"writing prompts: count={count} must be in [0, {NUM_COMBINATIONS}] (the "
            "number of distinct form x subject x audience x tone x phrasing combinations)"
        )
    rng = random.Random(f"writing:{seed}")
    out = []
    for index in rng.sample(range(NUM_COMBINATIONS), count):
        index, p = divmod(index, len(PHRASINGS))
        index, t = divmod(index, len(TONES))
        index, a = divmod(index, len(AUDIENCES))
        f, s = divmod(index, len(SUBJECTS))
        form = FORMS[f]
        words = 50 * round(rng.randint(*form.words) / 50)
        out.append(
            PHRASINGS[p].format(
                form=form.name,
                subject=SUBJECTS[s],
                audience=AUDIENCES[a],
                tone=TONES[t],
                words=words,
            )
        )
    return out


def writing_conversations(count: int, seed: int = 0) -> Iterator[Conversation]:
    """One user turn per request, ids ``writing/<i>``."""
    for i, prompt in enumerate(writing_prompts(count, seed)):
        yield Conversation(f"writing/{i}", ({"role": "user", "content": prompt},), "writing")
