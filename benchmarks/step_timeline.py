"""Where an offline run's wall time goes, step by step: the engine at a fixed concurrency
(as ``specdec bench --waves`` drives it), every ``LLMEngine.step`` call recorded with the
requests in flight, the mode that ran it, the running/waiting split and the tokens it
returned. One engine per variant (``none`` = plain, ``default`` = the model's shipped
head), run one after another on the same prompts.

The summary splits each run into its full-batch phase (every slot taken) and its drain
(fewer requests in flight than the concurrency: the last wave finishing), and the drain
again at the speculation cutoff, with steps, seconds and tokens per step mode: a variant
that loses throughput only in its drain shows it there.

    python benchmarks/step_timeline.py --prompts wb.jsonl --batch 128 --waves 2 \
        --max-tokens 256 --variants none,default --json steps.json

Greedy, ``ignore_eos`` (every request produces ``--max-tokens``), prefix caching off, one
warm-up run per engine (16 tokens for ``2 x batch`` prompts, as the bench warms up).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_str_list

from specdec.bench.env import synchronize
from specdec.bench.runner import build_llm, encode
from specdec.bench.sets import SetOptions, file_set
from specdec.engine.llm import LLM
from specdec.models.packaged_heads import default_speculative
from specdec.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class StepRow:
    start: float  # seconds since the run began, when step() was called
    seconds: float  # until the next call (or the run's end)
    in_flight: int  # submitted and unfinished
    running: int  # the scheduler's, before the step
    waiting: int
    mode: str  # the StepMode class whose step() ran, "" for a drain-only call
    tokens: int  # output tokens the call returned


def record_modes(llm: LLM) -> list[str]:
    """Wrap each step mode's ``step`` (once per engine) so the returned list's one item
    names the mode whose step ran last."""
    last = [""]
    for mode in llm.engine.modes:
        mode.step = _named_step(mode.step, type(mode).__name__, last)
    return last


def _named_step(original, name: str, last: list[str]):
    def step(deferring):
        last[0] = name
        return original(deferring)

    return step


def timeline(
    llm: LLM, last: list[str], prompts: list[list[int]], batch: int, max_tokens: int
) -> list[StepRow]:
    """Drive ``prompts`` at ``batch`` in flight; ``last``: ``record_modes``'s list."""
    engine = llm.engine
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.TOKENS
    )
    pending = iter(prompts)
    in_flight, rows = 0, []
    synchronize(engine.runner.device)
    t0 = time.perf_counter()
    while True:
        while in_flight < batch and (p := next(pending, None)) is not None:
            engine.add_request(p, params)
            in_flight += 1
        if not engine.has_unfinished_requests():
            break
        sched = engine.scheduler
        start = time.perf_counter() - t0
        last[0] = ""
        row = StepRow(start, 0.0, in_flight, sched.num_running, sched.num_waiting, "", 0)
        for out in engine.step():
            row.tokens += len(out.token_ids)
            in_flight -= out.finish_reason is not None
        row.mode = last[0]
        rows.append(row)
    synchronize(engine.runner.device)
    end = time.perf_counter() - t0
    for row, nxt in zip(rows, [r.start for r in rows[1:]] + [end], strict=True):
        row.seconds = nxt - row.start
    return rows


def summarize(name: str, rows: list[StepRow], batch: int, cutoff: int | None) -> list[str]:
    total = sum(r.seconds for r in rows)
    tokens = sum(r.tokens for r in rows)
    out = [
        f"{name}: {len(rows)} steps, {total:.3f} s, {tokens} tokens, {tokens / total:,.0f} tok/s"
    ]
    phases: dict[tuple[str, str], list[StepRow]] = defaultdict(list)
    for r in rows:
        if r.in_flight >= batch:
            phase = "full batch"
        elif cutoff is not None and r.in_flight <= cutoff:
            phase = f"drain <= {cutoff}"
        else:
            phase = "drain"
        phases[(phase, r.mode or "(read)")].append(r)
    out.append("| phase | mode | steps | s | share | tokens | ms/step |")
    out.append("|---|---|---:|---:|---:|---:|---:|")
    for (phase, mode), rs in sorted(phases.items()):
        s = sum(r.seconds for r in rs)
        out.append(
            f"| {phase} | {mode} | {len(rs)} | {s:.3f} | {s / total:.1%} | "
            f"{sum(r.tokens for r in rs)} | {1e3 * s / len(rs):.2f} |"
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", required=True, help=".jsonl of {prompt} or {messages}")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--variants", type=parse_str_list, default=["none", "default"])
    p.add_argument(
        "--kv-gib", type=float, help="KV cache per engine (default: as `specdec bench` sizes it)"
    )
    p.add_argument("--json", help="every step of every variant")
    a = p.parse_args()
    unknown = [v for v in a.variants if v not in ("none", "default")]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}; choose from none, default")
    convs = list(file_set(a.prompts).load(SetOptions()))
    report, lines = {}, []
    for variant in a.variants:
        spec = default_speculative(a.model) if variant == "default" else None
        engine = {} if a.kv_gib is None else {"kv_cache_memory": int(a.kv_gib * (1 << 30))}
        llm = build_llm(a.model, engine, spec, a.batch)
        ids = [encode(llm, c.messages) for c in convs]
        n = max(len(ids), a.waves * a.batch)
        prompts = [ids[i % len(ids)] for i in range(n)]
        last = record_modes(llm)
        timeline(llm, last, prompts[: 2 * a.batch], a.batch, 16)  # warm-up
        preempted = llm.engine.scheduler.num_preemptions
        rows = timeline(llm, last, prompts, a.batch, a.max_tokens)
        preempted = llm.engine.scheduler.num_preemptions - preempted
        slots = llm.engine.kv_manager.pool.num_usable_blocks * llm.engine.block_size
        lines.append(f"{variant}: {slots:,} KV slots, {preempted} preemptions")
        cutoff = spec.disable_by_batch_size if spec is not None else None
        lines += [*summarize(variant, rows, a.batch, cutoff), ""]
        report[variant] = [asdict(r) for r in rows]
        del llm
    if a.json:
        Path(a.json).write_text(json.dumps(report))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
