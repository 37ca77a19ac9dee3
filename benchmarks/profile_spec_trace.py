"""Where a speculative step's device time goes: a torch-profiler trace of greedy EAGLE-3
decoding with the engine's phases labelled, summarised per step.

``profile_step.py`` times host phases with a synchronisation around each, which removes
the overlap the pipelined step exists for. This script does not synchronise: it labels
the phases with ``record_function`` (draft = the head's catch-up and growth, verify = the
target forward, accept, move_kv, continue = the next step's inputs from the step in
flight, read = the host read of a launched step), lets the profiler attribute each device
kernel to the innermost phase whose host code launched it (graph replays included: their
kernels share the replay's correlation id), and prints per step:

- kernels and device milliseconds per phase;
- host milliseconds per phase (the label's host span);
- the device's busy time (the union of kernel intervals) against the step's wall time;
  what is left is the device waiting for the host.

    python benchmarks/profile_spec_trace.py --head specdec/heads/smollm2-135m-instruct \\
        --prompts humaneval.jsonl --shapes chain3,tree --batch 1,16 --trace-dir out/

``--trace-dir`` keeps each run's Chrome trace (gzip) for chrome://tracing or Perfetto;
``summarize(trace)`` reads one back (``python profile_spec_trace.py --summarize FILE``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_int_list, parse_str_list, union_length

SHAPES: dict[str, dict | None] = {
    "plain": None,  # no speculation: the decode step the speedups are measured against
    "chain2": {"num_speculative_tokens": 2},
    "chain3": {"num_speculative_tokens": 3},
    "chain5": {"num_speculative_tokens": 5},
    "tree": {"tree": "dynamic", "num_speculative_tokens": 5, "top_k": 8, "total_tokens": 32},
}
PHASES = ("step", "launch", "draft", "verify", "accept", "move_kv", "continue", "read")
STEP = "step"  # the outermost label: one engine step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--head", help="EAGLE-3 head directory")
    p.add_argument("--prompts", help="JSONL bench set (default: the tests' varied chats)")
    p.add_argument("--shapes", type=parse_str_list, default=["chain3"], help="|".join(SHAPES))
    p.add_argument("--batch", type=parse_int_list, default=[1])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096, help="8192 for WritingBench's papers")
    p.add_argument("--pipelined", choices=["on", "off"], default="on")
    p.add_argument("--compile-head", choices=["on", "off"], default="off")
    p.add_argument(
        "--compile-growth",
        choices=["on", "off"],
        default="on",
        help="with --compile-head on: the whole draft side as one region (off: the head's "
        "layer and logits only)",
    )
    p.add_argument("--trace-dir", help="keep each run's Chrome trace here (.json.gz)")
    p.add_argument("--summarize", help="only summarise this Chrome trace (.json or .json.gz)")
    a = p.parse_args()
    if a.summarize:
        print(format_summary(summarize(load_trace(a.summarize)), a.summarize))
        return
    if a.head is None:
        p.error("--head is required (an EAGLE-3 head directory)")
    unknown = [s for s in a.shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown --shapes {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    for shape in a.shapes:
        t0 = time.perf_counter()
        llm = build(a, shape)
        print(f"## {shape}: engine built in {time.perf_counter() - t0:.1f} s", flush=True)
        for batch in a.batch:
            trace = profile(llm, prompts(llm, a.prompts, batch), a.max_tokens)
            name = f"{shape}-b{batch}"
            if SHAPES[shape] is not None:
                name += "-pipelined" if a.pipelined == "on" else "-sync"
                if a.compile_head == "on":
                    name += "-compiled" if a.compile_growth == "on" else "-regions"
            if a.trace_dir:
                path = Path(a.trace_dir) / f"trace_{name}.json.gz"
                path.parent.mkdir(parents=True, exist_ok=True)
                with gzip.open(path, "wt") as f:
                    json.dump(trace, f)
            print(format_summary(summarize(trace), name), flush=True)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def build(a: argparse.Namespace, shape: str):
    from specdec import LLM
    from specdec.config import SpeculativeConfig

    spec = None
    if SHAPES[shape] is not None:
        spec = SpeculativeConfig(
            method="eagle3",
            model=a.head,
            pipelined=a.pipelined == "on",
            compile_head=a.compile_head == "on",
            compile_growth=a.compile_growth == "on",
            **SHAPES[shape],
        )
    return LLM(
        a.model,
        speculative=spec,
        dtype=a.dtype,
        max_model_len=a.max_model_len,
        max_num_seqs=max(a.batch),
        cuda_graph_max_batch_size=max(a.batch),
        kv_cache_memory=2 << 30,
        enable_prefix_caching=False,
    )


def prompts(llm, path: str | None, batch: int) -> list[list[int]]:
    if path is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from prompts import varied_conversations

        convs = [list(c) for c in varied_conversations(batch)]
    else:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
        convs = [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in rows]
        convs = (convs * batch)[:batch]
    return [llm.apply_chat_template(c, add_generation_prompt=True) for c in convs]


def _labelled(obj, attr: str, label: str, patched: list) -> None:
    fn = getattr(obj, attr, None)
    if fn is None:
        return

    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    setattr(obj, attr, wrapper)
    patched.append((obj, attr))


def profile(llm, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    """One warm-up generation, then the profiled one; returns its Chrome trace."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from specdec import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_ids, params, use_tqdm=False)  # warm-up (graphs, compile)
    from specdec.engine.pipelined_step import PipelinedStep
    from specdec.engine.sync_step import SyncStep

    sync_mode, pipelined = engine.mode(SyncStep), engine.mode(PipelinedStep)
    patched: list = []
    targets = [
        (engine, "step", STEP),
        (engine.pipeline, "launch", "launch"),
        (engine.proposer, "grow_pipelined", "draft"),
        (sync_mode, "_propose", "draft"),
        (engine.runner, "execute", "verify"),
        (sync_mode, "_verify", "accept"),
        (engine.runner, "move_kv", "move_kv"),
        (engine.pipeline, "_continue", "continue"),
        (pipelined, "_finish", "read"),
    ]
    for obj, attr, label in targets:
        if obj is not None:
            _labelled(obj, attr, label, patched)
    # The pipelined step's acceptance is an instance attribute (the kernel or the torch
    # reference), so it is wrapped and put back rather than shadowed.
    pipeline = engine.pipeline
    accept = getattr(pipeline, "_accept_and_stage", None)
    if accept is not None:

        def labelled_accept(*args, **kwargs):
            with torch.profiler.record_function("accept"):
                return accept(*args, **kwargs)

        pipeline._accept_and_stage = labelled_accept
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate(prompt_ids, params, use_tqdm=False)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
    finally:
        if accept is not None:
            pipeline._accept_and_stage = accept
        for obj, attr in patched:  # instance attributes shadowing the methods
            delattr(obj, attr)
    tau = engine.spec_stats.tau if engine.spec_stats.steps else None  # None: plain decoding
    trace["specdec"] = {"tau": tau, "batch": len(prompt_ids)}
    return trace


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def summarize(trace: dict) -> dict:
    """Per-step figures from a Chrome trace whose host phases carry ``PHASES`` labels."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    spans: dict[int, list[tuple[float, float, str]]] = defaultdict(list)  # tid -> labels
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"] in PHASES:
            spans[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for tid in spans:  # innermost last among those containing a point: sort by start
        spans[tid].sort()

    def phase_at(tid: int, ts: float) -> str:
        inner = "other"
        for start, end, name in spans.get(tid, ()):
            if start > ts:
                break
            if ts <= end:
                inner = name  # later starts nest inside earlier ones
        return inner

    phase_of: dict[int, str] = {}  # correlation id -> phase of the launching host call
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            phase_of[e["args"]["correlation"]] = phase_at(e["tid"], e["ts"])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == STEP]
    num_steps = max(len(steps), 1)
    device_ms: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for k in kernels:
        phase = phase_of.get(k.get("args", {}).get("correlation"), "other")
        device_ms[phase] += k["dur"] / 1e3
        counts[phase] += 1
    host_ms: dict[str, float] = defaultdict(float)
    for tid_spans in spans.values():
        for start, end, name in tid_spans:
            host_ms[name] += (end - start) / 1e3
    busy = union_length((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    wall = (steps[-1]["ts"] + steps[-1]["dur"] - steps[0]["ts"]) if steps else 0.0
    graph_launches = sum(1 for e in events if e.get("name") == "cudaGraphLaunch")
    launch_names = ("cudaLaunchKernel", "cuLaunchKernel")
    kernel_launches = sum(1 for e in events if e.get("name") in launch_names)
    return {
        "steps": len(steps),
        "tau": trace.get("specdec", {}).get("tau"),
        "batch": trace.get("specdec", {}).get("batch"),
        "wall_ms_per_step": wall / 1e3 / num_steps,
        "device_busy_ms_per_step": busy / 1e3 / num_steps,
        "graph_launches_per_step": graph_launches / num_steps,
        "eager_launches_per_step": kernel_launches / num_steps,
        "phases": {
            ph: {
                "kernels": counts[ph] / num_steps,
                "device_ms": device_ms[ph] / num_steps,
                "host_ms": host_ms[ph] / num_steps,
            }
            for ph in (*PHASES, "other")
            if counts[ph] or host_ms[ph]
        },
    }


def format_summary(s: dict, name: str) -> str:
    tau = f"{s['tau']:.2f}" if s.get("tau") is not None else "-"
    lines = [
        f"## {name}: {s['steps']} steps, tau {tau}, wall {s['wall_ms_per_step']:.3f} ms/step, "
        f"device busy {s['device_busy_ms_per_step']:.3f} ms/step, "
        f"{s['graph_launches_per_step']:.1f} graph + {s['eager_launches_per_step']:.1f} "
        "eager launches/step",
        "| phase | kernels/step | device ms/step | host ms/step |",
        "|---|---:|---:|---:|",
    ]
    for phase, f in s["phases"].items():
        lines.append(
            f"| {phase} | {f['kernels']:.1f} | {f['device_ms']:.3f} | {f['host_ms']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
