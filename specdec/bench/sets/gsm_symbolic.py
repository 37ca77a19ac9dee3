"""gsm_symbolic (math, GSM8K-like): questions from reasoning-gym's seeded generator.
Item ``i`` depends only on the seed and ``i``, so the first N are the same whatever N."""

from __future__ import annotations

from collections.abc import Iterator

from specdec.bench.sets import BenchSet, SetOptions
from specdec.data_gen.package_files import PackageDataMissing
from specdec.data_gen.records import Conversation

REQUIREMENT = "reasoning-gym==0.1.25"
# The generator is lazy: a large size costs nothing until items are drawn.
_SIZE = 100_000


def load(options: SetOptions) -> Iterator[Conversation]:
    try:
        import reasoning_gym
    except ImportError:
        raise PackageDataMissing(
            f"bench set gsm_symbolic needs reasoning-gym: pip install '{REQUIREMENT}'"
        ) from None
    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=_SIZE, seed=options.seed)
    for i, entry in enumerate(dataset):
        message = {"role": "user", "content": entry["question"]}
        yield Conversation(f"gsm_symbolic/{options.seed}#{i}", (message,), "gsm_symbolic")


SET = BenchSet("gsm_symbolic", "reasoning-gym gsm_symbolic questions (math)", REQUIREMENT, load)
