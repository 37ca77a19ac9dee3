"""Where a pipelined speculative step's wall time goes on the real device, without a
profiler: the host's phases timed with ``perf_counter`` around methods, nothing
synchronised that the engine does not synchronise itself.

A profiler (``profile_spec_trace.py``) or cProfile adds 10-60 µs to every torch call and
so changes what it measures at batch 1, where the step is ~1 ms. Here each wrapped method
costs two ``perf_counter`` calls. Per engine step it prints:

- ``ms/step``: the drive's wall time per engine step (prefills included), and ``tpot``:
  decode time per token (TTFT excluded);
- ``wait``: time blocked in ``Event.synchronize`` (the read-back of the step in flight,
  the staging rings' reuse checks) — the device ahead of the host;
- each wrapped phase's host time per step (nested phases are included in their parents);
- ``host busy`` = wall - wait: when it is near wall the device waits for the host.

    python benchmarks/host_gap.py --head specdec/heads/smollm2-135m-instruct \\
        --prompts humaneval.jsonl --shapes chain3 --batch 1,16 --max-tokens 256
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_int_list, parse_str_list

SHAPES = {
    "plain": None,
    "chain3": {"num_speculative_tokens": 3},
    "chain5": {"num_speculative_tokens": 5},
    "tree": {"tree": "dynamic", "num_speculative_tokens": 5, "top_k": 8, "total_tokens": 32},
}
# "module:Class.method" -> label. Nested phases are timed inside their parents.
PHASES = {
    "specdec.engine.llm_engine:LLMEngine.step": "step",
    "specdec.engine.pipelined_step:PipelinedStep.can_run": "can_pipeline",
    "specdec.engine.scheduler:Scheduler.schedule": "schedule",
    "specdec.spec.pipeline:SpecPipeline.launch": "launch",
    "specdec.spec.pipeline:SpecStepGraphs.run": "graph_run",
    "specdec.spec.pipeline:SpecStepGraphs._replay": "replay_call",
    "specdec.engine.pipelined_step:PipelinedStep._finish": "finish_spec",
    "specdec.device.staging:HostCopy.tolist": "read_back",
    "torch.cuda:Event.synchronize": "wait",
    "torch.cuda:Event.record": "event_record",
    "specdec.device.staging:_PinnedRing.copy": "stage_h2d",
    "specdec.device.staging:_PinnedRing.copy_to_host": "stage_d2h",
}


class Timers:
    """Seconds and calls per label, accumulated while ``on``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, target: str, label: str) -> None:
        module_name, attr = target.split(":")
        owner_name, method = attr.split(".")
        owner = getattr(importlib.import_module(module_name), owner_name)
        original = getattr(owner, method)
        timers = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not timers.on:
                return original(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.seconds[label] += time.perf_counter() - t0
                timers.calls[label] += 1

        setattr(owner, method, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def run_one(
    args, shape: str, batch: int, chats: list[list[dict]], timers: Timers, variant: str
) -> dict:
    from specdec.bench.driver import RunParams, generate
    from specdec.bench.runner import build_llm, encode
    from specdec.config import SpeculativeConfig

    spec = None
    if SHAPES[shape] is not None:
        spec = SpeculativeConfig(
            method="eagle3", model=args.head, pipelined=True,
            compile_head=args.compile_head == "on", **SHAPES[shape],
        )  # fmt: skip
    llm = build_llm(args.model, {"dtype": args.dtype, **engine_options(variant)}, spec, batch)
    prompts = [encode(llm, messages) for messages in chats]
    run = RunParams(max_tokens=args.max_tokens, concurrency=batch)
    generate(llm, prompts[:batch], RunParams(max_tokens=32, concurrency=batch))  # warm-up
    timers.reset()
    timers.on = True
    t0 = time.perf_counter()
    result = generate(llm, prompts, run)
    wall = time.perf_counter() - t0
    timers.on = False
    steps = result.engine_steps
    records = result.requests
    tokens = sum(len(r.output_ids) for r in records)
    ttft = sum(r.ttft_s or 0.0 for r in records)
    decode_s = sum((r.tpot_s or 0.0) * (len(r.output_ids) - 1) for r in records) / max(
        batch, 1
    )  # requests overlap at batch > 1: per-slot time
    row = {
        "shape": shape, "batch": batch, "variant": variant, "steps": steps, "tokens": tokens,
        "wall_s": wall, "ttft_ms_mean": 1e3 * ttft / len(records),
        "tau": result.stats.tau if result.stats.steps else 1.0,
        "tpot_ms": 1e3 * decode_s / max(tokens / batch - 1, 1),
        "ms_per_step": 1e3 * wall / max(steps, 1),
        "phases_ms_per_step": {k: 1e3 * v / max(steps, 1) for k, v in timers.seconds.items()},
        "calls_per_step": {k: v / max(steps, 1) for k, v in timers.calls.items()},
        "output_ids": [r.output_ids for r in records],
    }  # fmt: skip
    del llm
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--head", default="specdec/heads/smollm2-135m-instruct")
    p.add_argument("--prompts", required=True, help="JSONL bench set (exported)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--shapes", type=parse_str_list, default=["plain", "chain3"])
    p.add_argument("--batch", type=parse_int_list, default=[1])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile-head", choices=["on", "off"], default="on")
    p.add_argument(
        "--variants", type=lambda s: s.split(";"), default=["default"],
        help="engine variants, ';'-separated: 'default' or KEY=VALUE[+KEY=VALUE] LLM "
        "keywords, e.g. 'default;async_scheduling=false'",
    )  # fmt: skip
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()

    timers = Timers()
    for target, label in PHASES.items():
        timers.wrap(target, label)
    lines = [json.loads(x) for x in Path(args.prompts).read_text().splitlines() if x.strip()]
    chats = [line["messages"] for line in lines[: args.num_prompts]]
    rows = []
    for variant in args.variants:
        for shape in args.shapes:
            for batch in args.batch:
                row = run_one(args, shape, batch, chats, timers, variant)
                first = next((r for r in rows if (r["shape"], r["batch"]) == (shape, batch)), row)
                # bf16: a batch's composition may flip near-tied tokens (the engine's lossless
                # check is in fp32); equal outputs across variants show nothing else changed.
                pairs = zip(row["output_ids"], first["output_ids"], strict=True)
                row["same_as_first_variant"] = sum(a == b for a, b in pairs)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "output_ids"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    head = "variant                  shape   batch  tau   ms/step  tpot  ttft  same  "
    print("\n" + head + "  ".join(_COLUMNS))
    for r in rows:
        ph = r["phases_ms_per_step"]
        cells = "  ".join(f"{ph.get(c, 0.0):{len(c)}.3f}" for c in _COLUMNS)
        print(
            f"{r['variant'][:24]:24s} {r['shape']:7s} {r['batch']:5d} {r['tau']:5.2f} "
            f"{r['ms_per_step']:8.3f} {r['tpot_ms']:5.3f} {r['ttft_ms_mean']:5.1f} "
            f"{r['same_as_first_variant']:3d}/{len(r['output_ids'])}  {cells}"
        )


def engine_options(variant: str) -> dict:
    """``KEY=VALUE[+KEY=VALUE]`` as LLM keywords (true/false/ints parsed); 'default': none."""
    if variant == "default":
        return {}
    out = {}
    for item in variant.split("+"):
        key, _, value = item.partition("=")
        out[key] = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(out[key], str) and value.lstrip("-").isdigit():
            out[key] = int(value)
    return out


_COLUMNS = ("step", "wait", "launch", "graph_run", "replay_call", "finish_spec", "schedule",
            "event_record", "stage_h2d")  # fmt: skip


if __name__ == "__main__":
    main()
