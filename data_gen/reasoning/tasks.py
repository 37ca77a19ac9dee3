"""The registry of reasoning tasks: reasoning-gym generators whose worked solution we can
write programmatically, each with its difficulty settings and its tracer.

A task's entry for seed ``s`` is reasoning-gym's ``create_dataset(name, seed=s,
**params)[0]`` (generators draw item ``i`` from ``Random(seed + i)``; we read item ``s`` of
one seed-0 dataset, the same thing). Its verifier is the generator's own
``score_answer``. ``gsm_symbolic`` is a benchmark set (data_gen.mix) and can never be
registered.

Tracers live in ``arithmetic.py``, ``number_theory.py`` and ``symbolic.py`` and register
themselves with ``@register(name, **params)``; ``registry()`` imports them.
"""

from __future__ import annotations

import functools
import importlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.data_gen.mix import REASONING_GYM_EXCLUDED
from specdec.data_gen.reasoning.format import Completion, Solution

Tracer = Callable[[dict[str, Any], random.Random], Solution]

_TASKS: dict[str, ReasoningTask] = {}
_TRACER_MODULES = ("arithmetic", "number_theory", "symbolic")


@dataclass(frozen=True)
class ReasoningTask:
    """``params``: the generator's config fields we set (difficulty), JSON-compatible and
    stored in every record so evaluation rebuilds the same entries."""

    name: str
    tracer: Tracer
    params: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def dataset(self):
        try:
            import reasoning_gym
        except ImportError:
            raise ImportError(
                "reasoning traces need reasoning-gym: pip install 'specdec[data]' "
                "(or reasoning-gym==0.1.25)"
            ) from None
        return reasoning_gym.create_dataset(self.name, seed=0, size=10**9, **self.params)

    def entry(self, seed: int) -> dict[str, Any]:
        """The generator's item for ``seed``: question, answer (the oracle), metadata."""
        return self.dataset[seed]

    def solve(self, entry: dict[str, Any], rng: random.Random) -> Solution:
        return self.tracer(entry, rng)

    def score(self, answer: str | None, entry: dict[str, Any]) -> float:
        """reasoning-gym's verifier: 1.0 for a correct answer (partial credit below). Some
        verifiers raise on text they cannot parse (``int("0/0")``): that answer scores 0."""
        try:
            return float(self.dataset.score_answer(answer, entry))
        except (ValueError, TypeError, ArithmeticError, AttributeError, IndexError):
            return 0.0


def register(name: str, **params: Any) -> Callable[[Tracer], Tracer]:
    """Register ``tracer`` for the reasoning-gym generator ``name`` with these config
    ``params``."""
    if name in REASONING_GYM_EXCLUDED:
        raise ValueError(f"{name!r} is a benchmark set or a meta-generator; it cannot train")

    def wrap(tracer: Tracer) -> Tracer:
        if name in _TASKS:
            raise ValueError(f"reasoning task {name!r} is registered twice")
        _TASKS[name] = ReasoningTask(name, tracer, params)
        return tracer

    return wrap


def registry() -> dict[str, ReasoningTask]:
    """Every registered task by name, in registration order."""
    for module in _TRACER_MODULES:
        importlib.import_module(f"specdec.data_gen.reasoning.{module}")
    return dict(_TASKS)


def get_tasks(names: list[str] | tuple[str, ...] | None) -> list[ReasoningTask]:
    """The named tasks (None or empty: all), in the given order; an unknown name raises
    listing the known ones."""
    tasks = registry()
    names = list(names or tasks)
    unknown = [n for n in names if n not in tasks]
    if unknown:
        raise ValueError(f"unknown reasoning tasks {unknown}; known: {', '.join(tasks)}")
    if len(set(names)) != len(names):
        raise ValueError(f"reasoning tasks listed twice: {names}")
    return [tasks[n] for n in names]


class Scorer:
    """Verifiers by (task, params), rebuilt once each."""

    def __init__(self) -> None:
        self._tasks: dict[str, ReasoningTask] = {}
        self._registry = registry()

    def task(self, record: dict[str, Any]) -> ReasoningTask:
        name = record["task"]
        if name not in self._registry:
            raise ValueError(f"{record['id']}: unknown reasoning task {name!r}")
        key = json.dumps([name, record["params"]], sort_keys=True)
        if key not in self._tasks:
            self._tasks[key] = ReasoningTask(name, self._registry[name].tracer, record["params"])
        return self._tasks[key]

    def score(self, record: dict[str, Any], completion: Completion) -> float:
        task = self.task(record)
        entry = task.entry(record["seed"])
        if entry["question"] != record["conversations"][0]["content"]:
            raise ValueError(
                f"{record['id']}: reasoning-gym now generates another question for this seed; "
                "the traces were made with another reasoning-gym version (0.1.25 is pinned)"
            )
        return 0.0 if completion.answer is None else task.score(completion.answer, entry)
