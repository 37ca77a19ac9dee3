"""The offline training sources: BIG-bench task inputs, reasoning-gym generators (not
gsm_symbolic, a benchmark set), chatterbot dialogs (together the default mix, ``mix``),
composed long-form writing requests (``writing``, writing.py; opt-in), composed
programming requests (``code``, coding.py; opt-in), composed arithmetic word problems
(``math``, word_problems.py; opt-in) and composed research-paper requests (``academic``,
academic.py; opt-in), deduplicated and decontaminated.

Everything here is seeded and ordered: the same config gives the same conversations in
the same order, which is what lets the prompts stage resume byte-identically. Each source
yields ``Conversation``s with stable ids (``bigbench/<task>#<example>``,
``reasoning_gym/<generator>#<i>``, ``chatterbot/<lang>/<file>#<i>``, ``writing/<i>``,
``code/<i>``, ``math/<i>``, ``academic/<paper>/<part>``).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from specdec.data_gen.academic import academic_conversations
from specdec.data_gen.coding import code_conversations
from specdec.data_gen.decontam import Decontaminator
from specdec.data_gen.package_files import (
    BIGBENCH,
    CHATTERBOT,
    PackageDataMissing,
    iter_archive,
    iter_package_files,
)
from specdec.data_gen.records import BadRecord, Conversation, SkipCounts, text_hash
from specdec.data_gen.word_problems import math_conversations
from specdec.data_gen.writing import writing_conversations

logger = logging.getLogger(__name__)

# What ``mix`` means: the sources the shipped head was trained on (docs/default_head.md).
MIX_SOURCES = ("bigbench", "reasoning_gym", "chatterbot")
BUILTIN_SOURCES = (*MIX_SOURCES, "writing", "code", "math", "academic")
# Benchmark sets (never training data) and meta-generators that need other generators.
REASONING_GYM_EXCLUDED = frozenset({"gsm_symbolic", "composite"})


@dataclass(frozen=True)
class MixConfig:
    """Sizes are per task / generator so that no single source dominates the mix.

    ``bigbench_archive``: a bigbench sdist (tar.gz) to read instead of locating one.
    ``reasoning_gym_generators``: None = every generator except the excluded ones.
    """

    sources: tuple[str, ...] = MIX_SOURCES
    seed: int = 0
    bigbench_per_task: int = 100
    bigbench_multiple_choice: bool = False  # also the inputs of multiple-choice tasks
    bigbench_archive: str | None = None
    reasoning_gym_per_generator: int = 100
    reasoning_gym_generators: tuple[str, ...] | None = None
    chatterbot_languages: tuple[str, ...] = ("english",)
    writing_prompts: int = 5000
    code_prompts: int = 5000
    math_prompts: int = 5000
    academic_papers: int = 1000  # each gives len(academic.SECTIONS) + 1 requests
    min_chars: int = 4
    max_chars: int = 16000
    cache_dir: str | None = None
    allow_download: bool = True

    def __post_init__(self) -> None:
        unknown = [s for s in self.sources if s not in BUILTIN_SOURCES]
        if unknown:
            raise ValueError(f"unknown built-in sources {unknown}; choose from {BUILTIN_SOURCES}")
        if self.writing_prompts < 0:
            raise ValueError(f"writing_prompts={self.writing_prompts} must be >= 0")
        if self.code_prompts < 0:
            raise ValueError(f"code_prompts={self.code_prompts} must be >= 0")
        if self.math_prompts < 0:
            raise ValueError(f"math_prompts={self.math_prompts} must be >= 0")
        if self.academic_papers < 0:
            raise ValueError(f"academic_papers={self.academic_papers} must be >= 0")
        if self.reasoning_gym_generators:
            bad = REASONING_GYM_EXCLUDED & set(self.reasoning_gym_generators)
            if bad:
                raise ValueError(
                    f"reasoning_gym_generators includes {sorted(bad)}: gsm_symbolic is a "
                    "benchmark set and composite needs other generators; remove them"
                )


def bigbench_conversations(config: MixConfig, skipped: SkipCounts) -> Iterator[Conversation]:
    """Up to ``bigbench_per_task`` example inputs per JSON task (task prefix prepended),
    sampled with a per-task seed; tasks in path order."""
    if config.bigbench_archive:
        archive = Path(config.bigbench_archive)
        if not archive.is_file():
            raise FileNotFoundError(f"bigbench archive {archive} does not exist")
        files = iter_archive(archive, "bigbench", "benchmark_tasks/*task.json")
    else:
        cache = Path(config.cache_dir) if config.cache_dir else None
        try:
            files = iter_package_files(
                BIGBENCH, "benchmark_tasks/*task.json", cache, config.allow_download
            )
        except PackageDataMissing as e:
            raise PackageDataMissing(f"BIG-bench prompts: {e}") from None
    tasks: dict[str, list[Conversation]] = {}
    for rel, data in tqdm(files, desc="bigbench tasks", unit="task"):
        task = rel.removeprefix("benchmark_tasks/").removesuffix("/task.json")
        try:
            spec = json.loads(data)
        except json.JSONDecodeError:
            skipped.add("bad_json")
            continue
        tasks[task] = list(_bigbench_task(task, spec, config, skipped))
    for task in sorted(tasks):
        yield from tasks[task]


def _bigbench_task(
    task: str, spec: dict, config: MixConfig, skipped: SkipCounts
) -> Iterator[Conversation]:
    examples = spec.get("examples") or []
    if not examples:
        return
    if "target_scores" in examples[0] and not config.bigbench_multiple_choice:
        return
    prefix = str(spec.get("task_prefix") or "").strip()
    order = list(range(len(examples)))
    random.Random(f"{config.seed}:{task}").shuffle(order)
    for i in sorted(order[: config.bigbench_per_task]):
        text = examples[i].get("input") if isinstance(examples[i], dict) else None
        if not isinstance(text, str) or not text.strip():
            skipped.add("empty")
            continue
        prompt = f"{prefix}\n\n{text.strip()}" if prefix else text.strip()
        yield Conversation(
            f"bigbench/{task}#{i}", ({"role": "user", "content": prompt},), "bigbench"
        )


def reasoning_gym_conversations(config: MixConfig, skipped: SkipCounts) -> Iterator[Conversation]:
    """``reasoning_gym_per_generator`` questions from each generator (seeded); a generator
    that fails is skipped and counted, not fatal."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ImportError(
            "the reasoning_gym source needs reasoning-gym: pip install 'specdec[data]'"
        ) from None
    names = config.reasoning_gym_generators or tuple(sorted(DATASETS))
    for name in tqdm(names, desc="reasoning-gym", unit="gen"):
        if name in REASONING_GYM_EXCLUDED:
            continue
        try:
            ds = reasoning_gym.create_dataset(
                name, size=config.reasoning_gym_per_generator, seed=config.seed
            )
            questions = [entry["question"] for entry in ds]
        except Exception as e:  # third-party generators: one broken one must not stop the mix
            logger.warning("reasoning-gym generator %s failed (%s); skipped", name, e)
            skipped.add("generator_failed")
            continue
        for i, q in enumerate(questions):
            yield Conversation(
                f"reasoning_gym/{name}#{i}", ({"role": "user", "content": q},), "reasoning_gym"
            )


def chatterbot_conversations(config: MixConfig, skipped: SkipCounts) -> Iterator[Conversation]:
    """Every dialog of the chosen languages: turns alternate user / assistant from the
    first line (the assistant turns are regenerated later)."""
    cache = Path(config.cache_dir) if config.cache_dir else None
    for rel, data in iter_package_files(CHATTERBOT, "data/*/*.yml", cache, config.allow_download):
        _, lang, filename = rel.split("/")
        if lang not in config.chatterbot_languages:
            continue
        try:
            dialogs = (yaml.safe_load(data) or {}).get("conversations") or []
        except yaml.YAMLError:
            skipped.add("bad_yaml")
            continue
        for i, dialog in enumerate(dialogs):
            if not isinstance(dialog, list) or not dialog:
                skipped.add("empty")
                continue
            msgs = tuple(
                {"role": "user" if j % 2 == 0 else "assistant", "content": str(turn)}
                for j, turn in enumerate(dialog)
            )
            try:
                yield Conversation(
                    f"chatterbot/{lang}/{filename.removesuffix('.yml')}#{i}", msgs, "chatterbot"
                )
            except BadRecord as e:
                skipped.add(e.reason)


def composed_writing_conversations(
    config: MixConfig, skipped: SkipCounts
) -> Iterator[Conversation]:
    """``writing_prompts`` long-form writing requests (writing.py), seeded by the mix."""
    return writing_conversations(config.writing_prompts, config.seed)


def composed_code_conversations(config: MixConfig, skipped: SkipCounts) -> Iterator[Conversation]:
    """``code_prompts`` programming requests (coding.py), seeded by the mix."""
    return code_conversations(config.code_prompts, config.seed)


def composed_math_conversations(config: MixConfig, skipped: SkipCounts) -> Iterator[Conversation]:
    """``math_prompts`` arithmetic word problems (word_problems.py), seeded by the mix."""
    return math_conversations(config.math_prompts, config.seed)


def composed_academic_conversations(
    config: MixConfig, skipped: SkipCounts
) -> Iterator[Conversation]:
    """``academic_papers`` papers' section requests and short tasks (academic.py)."""
    return academic_conversations(config.academic_papers, config.seed)


BUILDERS = {
    "bigbench": bigbench_conversations,
    "reasoning_gym": reasoning_gym_conversations,
    "chatterbot": chatterbot_conversations,
    "writing": composed_writing_conversations,
    "code": composed_code_conversations,
    "math": composed_math_conversations,
    "academic": composed_academic_conversations,
}


@dataclass
class MixStats:
    """What the filter kept and dropped, per source."""

    kept: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    contaminated: int = 0
    out_of_bounds: int = 0


def filter_conversations(
    convs: Iterable[Conversation],
    decontaminator: Decontaminator,
    min_chars: int,
    max_chars: int,
    stats: MixStats,
    seen: set[str] | None = None,
) -> Iterator[Conversation]:
    """Drop conversations whose prompt text (system + user turns) is out of bounds, was
    seen before (normalised hash; first occurrence wins) or overlaps a benchmark."""
    seen = set() if seen is None else seen
    for conv in convs:
        text = conv.prompt_text
        if not min_chars <= len(text) <= max_chars:
            stats.out_of_bounds += 1
            continue
        key = text_hash(text)
        if key in seen:
            stats.duplicates += 1
            continue
        seen.add(key)
        if decontaminator.overlaps(text):
            stats.contaminated += 1
            continue
        stats.kept[conv.source] = stats.kept.get(conv.source, 0) + 1
        yield conv


def build_mix(
    config: MixConfig, decontaminator: Decontaminator, skipped: SkipCounts
) -> tuple[list[Conversation], MixStats]:
    """The filtered built-in sources, in ``config.sources`` order."""
    stats = MixStats()
    seen: set[str] = set()
    out: list[Conversation] = []
    for source in config.sources:
        convs = BUILDERS[source](config, skipped)
        out += filter_conversations(
            convs, decontaminator, config.min_chars, config.max_chars, stats, seen
        )
    return out, stats
