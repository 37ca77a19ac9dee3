"""Stage 1, ``data-gen prompts``: sources → one deduplicated, decontaminated, shuffled list
of conversations, written as JSONL shards (``prompts-00000.jsonl``) with a manifest.

The list is a pure function of the config (sources are read in order, the shuffle is
seeded), so every rank computes it alone and writes only the shards it owns; a rerun
rewrites exactly the shards that are missing, stale or corrupt.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import asdict, dataclass, field

from specdec.data_gen.decontam import BenchmarkConfig, Decontaminator, load_benchmark_prompts
from specdec.data_gen.mix import (
    BUILTIN_SOURCES,
    MIX_SOURCES,
    MixConfig,
    MixStats,
    build_mix,
    filter_conversations,
)
from specdec.data_gen.records import Conversation, SkipCounts, dumps_record, text_hash
from specdec.data_gen.shards import RankInfo, ShardStore, chunk_ranges
from specdec.data_gen.sources import read_source
from specdec.data_gen.stage import finish_stage, write_plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptsConfig:
    """``sources``: ``mix`` (``bigbench``, ``reasoning_gym``, ``chatterbot``), built-in
    names (those, ``writing``, ``code`` and ``math``), JSONL files, stage directories or
    ``hf:NAME``."""

    output: str
    sources: tuple[str, ...] = ("mix",)
    mix: MixConfig = field(default_factory=MixConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    records_per_shard: int = 10000
    max_records: int | None = None  # after the shuffle: a uniform sample of the mix
    ngram: int = 13
    seed: int = 0

    def __post_init__(self) -> None:
        if self.records_per_shard < 1:
            raise ValueError(f"records_per_shard={self.records_per_shard} must be >= 1")
        if not self.sources:
            raise ValueError("no prompt sources given; pass at least one (e.g. mix)")


def collect(config: PromptsConfig, skipped: SkipCounts) -> tuple[list[Conversation], MixStats]:
    """Every source's conversations, filtered (first occurrence wins), then shuffled."""
    decontaminator = Decontaminator(load_benchmark_prompts(config.benchmark), config.ngram)
    expanded = [n for s in config.sources for n in (MIX_SOURCES if s == "mix" else (s,))]
    names = tuple(dict.fromkeys(n for n in expanded if n in BUILTIN_SOURCES))
    convs, stats = build_mix(
        MixConfig(**{**asdict(config.mix), "sources": names}), decontaminator, skipped
    )
    seen = {text_hash(c.prompt_text) for c in convs}
    for spec in config.sources:
        if spec in BUILTIN_SOURCES or spec == "mix":
            continue
        convs += filter_conversations(
            read_source(spec, skipped),
            decontaminator,
            config.mix.min_chars,
            config.mix.max_chars,
            stats,
            seen,
        )
    random.Random(config.seed).shuffle(convs)
    if config.max_records is not None:
        convs = convs[: config.max_records]
    return convs, stats


def run_prompts(config: PromptsConfig, rank: RankInfo | None = None) -> dict | None:
    """Write this rank's prompt shards; returns the manifest once every shard exists."""
    rank = rank or RankInfo.from_env()
    skipped = SkipCounts()
    convs, stats = collect(config, skipped)
    if not convs:
        raise ValueError(
            f"no conversations left from sources {list(config.sources)} after filtering "
            f"({stats.duplicates} duplicates, {stats.contaminated} overlapping benchmarks, "
            f"{stats.out_of_bounds} out of length bounds, {skipped.as_dict()})"
        )
    store = ShardStore(config.output, "prompts", "jsonl")
    shards = [convs[a:b] for a, b in chunk_ranges(len(convs), config.records_per_shard)]
    payloads = [
        "".join(dumps_record(c.to_json()) + "\n" for c in shard).encode() for shard in shards
    ]
    # A shard is redone whenever the records it should hold change.
    digests = [hashlib.sha256(p).hexdigest() for p in payloads]
    header = {
        "stage": "prompts",
        "sources": list(config.sources),
        "filtered": {
            "duplicates": stats.duplicates,
            "benchmark_overlap": stats.contaminated,
            "out_of_bounds": stats.out_of_bounds,
            **skipped.as_dict(),
        },
        "decontamination": {
            "ngram": config.ngram,
            "gsm_symbolic_size": config.benchmark.gsm_symbolic_size,
            "gsm_symbolic_seed": config.benchmark.gsm_symbolic_seed,
        },
        "config": _jsonable(asdict(config)),
    }
    del header["config"]["mix"]["sources"]  # the top-level sources decide
    write_plan(store, digests, header)
    for i in store.pending(digests, rank.owned(len(digests))):
        counts = {"records": len(shards[i])}
        for c in shards[i]:
            counts[f"source_{c.source}"] = counts.get(f"source_{c.source}", 0) + 1
        store.write(i, payloads[i], digests[i], counts)
    return finish_stage(store, digests, header, rank)


def _jsonable(obj):
    """The config as JSON, without paths that only say where this run happened."""
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items() if k not in ("output", "cache_dir")}
    if isinstance(obj, tuple | list):
        return [_jsonable(v) for v in obj]
    return obj
