"""Held-out reasoning items for the tests: the first items of chosen tasks in the eval
split of ``data-gen reasoning-traces``, decontaminated against nothing (the benchmark sets
are not needed to pick eval items)."""

from __future__ import annotations

from pathlib import Path

from specdec.data_gen.decontam import Decontaminator
from specdec.data_gen.reasoning.generate import TracesConfig, run_traces


def write_eval_items(path: Path, tokenizer, tasks: tuple[str, ...], num_per_task: int) -> Path:
    run_traces(
        TracesConfig(output=str(path), split="eval", tasks=tasks, num_per_task=num_per_task),
        decontaminator=Decontaminator({"none": ["nothing to match here at all"]}),
        tokenizer=tokenizer,
    )
    return path
