"""Where ``data-gen regenerate``'s time goes, step by step.

Runs regenerate's own loop (``Regenerator``: chat rendering, seeded sampling at the
stage's temperature, turn-by-turn conversations, shards written) over a prompt file, and
times every ``engine.step()`` by the kind of forward it launched:

- ``graph``: a pure decode step that replayed a CUDA graph;
- ``eager``: a step that computed prompt tokens (a group's prefill chunk, with the running
  decodes), which runs the model eagerly.

The rest of the wall time is regenerate's host work between steps (rendering and
tokenizing turns, writing shards). Under async scheduling a step's wall time is its host
work plus any wait for the step before it, so a host-bound loop shows host time and a
device-bound one shows device time.

Variants change the scheduler's knobs on one engine (``admit=64/tokens=8192``: the
``admit_batch`` and ``max_num_batched_tokens`` of ``SchedulerConfig``); the engine is built
once with the largest token budget asked for. Each variant answers its own slice of the
prompt file, for ``--seconds`` at most.

    python benchmarks/bench_regen.py --prompts prompts.jsonl --max-num-seqs 256 \\
        --variants admit=64/tokens=8192,admit=64/tokens=32768 --seconds 60 --profile 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from specdec import LLM
from specdec.data_gen.records import SkipCounts
from specdec.data_gen.regenerate import RegenerateConfig, Regenerator
from specdec.data_gen.sources import read_source


@dataclass(frozen=True)
class Variant:
    admit_batch: int
    max_num_batched_tokens: int

    @classmethod
    def parse(cls, text: str) -> Variant:
        fields = dict(part.split("=", 1) for part in text.split("/"))
        unknown = set(fields) - {"admit", "tokens"}
        if unknown:
            raise ValueError(f"variant {text!r}: unknown keys {sorted(unknown)}; use admit, tokens")
        return cls(int(fields.get("admit", 64)), int(fields.get("tokens", 8192)))

    @property
    def name(self) -> str:
        return f"admit={self.admit_batch}/tokens={self.max_num_batched_tokens}"


@dataclass
class StepTally:
    """Wall seconds and counts of ``engine.step()`` calls by the kind of step launched."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # computed
    sampled: int = 0  # tokens sampled (generated), finished answers or not


def instrument(llm: LLM, tally: StepTally) -> None:
    """Wrap the runner's execute (to learn each step's kind) and the engine's step (to
    time it). Instance attributes shadow the methods; nothing else changes."""
    engine, runner = llm.engine, llm.engine.runner
    kind = {"last": "idle"}
    execute, step = runner.execute, engine.step

    def timed_execute(inputs):
        kind["last"] = "graph" if runner.replays_graph(inputs) else "eager"
        tally.tokens[kind["last"]] += int(inputs.input_ids.shape[0])
        tally.sampled += len(inputs.sampled_rows)
        return execute(inputs)

    def timed_step():
        kind["last"] = "idle"  # a step that launches nothing (the async pipeline's drain)
        t = time.perf_counter()
        out = step()
        tally.seconds[kind["last"]] += time.perf_counter() - t
        tally.steps[kind["last"]] += 1
        return out

    runner.execute = timed_execute
    engine.step = timed_step


def run_variant(llm, args, variant: Variant, convs, out_dir: Path) -> dict:
    engine = llm.engine
    engine.scheduler.config.admit_batch = variant.admit_batch
    engine.scheduler.config.max_num_batched_tokens = variant.max_num_batched_tokens
    config = RegenerateConfig(
        input=args.prompts,
        output=str(out_dir),
        model=args.model,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        records_per_shard=args.records_per_shard,
        record_workers=args.record_workers,
    )
    regen = Regenerator(config, llm)
    tally = StepTally()
    instrument(llm, tally)
    shards = [
        convs[i : i + args.records_per_shard] for i in range(0, len(convs), args.records_per_shard)
    ]
    next_shard = 0
    t0 = time.perf_counter()
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    while time.perf_counter() - t0 < args.seconds:
        while next_shard < len(shards) and regen.num_inflight < regen.max_inflight:
            regen.open_shard(next_shard, shards[next_shard])
            next_shard += 1
        if not regen.num_inflight:
            break
        regen.step()
        regen.finished_shards()
    regen.close()
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - t0
    del engine.step, engine.runner.execute  # back to the methods
    for request_id in list(regen._inflight):  # leave the engine empty for the next variant
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    step_s = sum(tally.seconds.values())
    row = {
        "variant": variant.name,
        "seconds": wall,
        "generated_tokens": regen.generated_tokens,
        "gen_tok_s": regen.generated_tokens / wall,  # finished answers only
        "sampled_tok_s": tally.sampled / wall,
        "conversations": regen.resolved,
        "host_outside_steps_s": wall - step_s,
        **{f"{k}_steps": tally.steps[k] for k in ("graph", "eager", "idle")},
        **{f"{k}_s": tally.seconds[k] for k in ("graph", "eager", "idle")},
        **{f"{k}_tokens": tally.tokens[k] for k in ("graph", "eager")},
    }
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.profile)
        row["profile"] = text.getvalue()
        print(row["profile"])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", required=True, help="any regenerate input (JSONL, dir, dataset)")
    p.add_argument("--variants", default="admit=64/tokens=8192")
    p.add_argument("--seconds", type=float, default=60.0, help="per variant")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--records-per-shard", type=int, default=100)
    p.add_argument("--record-workers", type=int, default=None, help="default: by core count")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: profiled)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    p.add_argument("--sort", default="tottime", help="cProfile order: tottime, cumulative")
    p.add_argument("--json", dest="json_path")
    args = p.parse_args()
    variants = [Variant.parse(v) for v in common.parse_str_list(args.variants)]
    engine_kwargs = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": max(v.max_num_batched_tokens for v in variants),
        "device": args.device,
        "dtype": args.dtype,
    }
    if args.kv_cache_memory:
        engine_kwargs["kv_cache_memory"] = args.kv_cache_memory
    t = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs)
    print(f"engine built in {time.perf_counter() - t:.1f} s")
    convs = list(read_source(args.prompts, SkipCounts()))
    per_variant = len(convs) // len(variants)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate(variants):
            mine = convs[i * per_variant : (i + 1) * per_variant]
            rows.append(run_variant(llm, args, variant, mine, Path(tmp) / str(i)))
    if args.json_path:
        runner = llm.engine.runner
        env = common.env_info(runner.device, runner.dtype)
        common.write_json(args.json_path, env=env, options=vars(args), rows=[])
        payload = json.loads(Path(args.json_path).read_text())
        payload["rows"] = rows  # plain dicts: this script's rows are not ResultRows
        Path(args.json_path).write_text(json.dumps(payload, indent=2) + "\n")
    print(
        "| variant | sampled tok/s | finished-answer tok/s | graph steps (ms each) "
        "| eager steps (ms each) | eager tokens/step | outside steps s | wall s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        g = r["graph_s"] / max(r["graph_steps"], 1) * 1e3
        e = r["eager_s"] / max(r["eager_steps"], 1) * 1e3
        et = r["eager_tokens"] / max(r["eager_steps"], 1)
        print(
            f"| {r['variant']} | {r['sampled_tok_s']:,.0f} | {r['gen_tok_s']:,.0f} "
            f"| {r['graph_steps']} ({g:.2f}) "
            f"| {r['eager_steps']} ({e:.2f}) | {et:,.0f} | {r['host_outside_steps_s']:.1f} "
            f"| {r['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
