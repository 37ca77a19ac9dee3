"""Host time per speculative step, by engine phase, on the CPU: what a GPU step pays on
its host between the acceptance read-back and the next launches.

A synchronous speculative step on the H200 (session 10) costs 3.1-3.6 ms at batch 1 with a
chain of 3 against ~1.4 ms of device work: the rest is host work on the critical path.
This script measures that host work where it is device-independent: a tiny random target
(2 layers, 64 wide, SmolLM2's tokenizer) and a random EAGLE-3 head on the CPU, one torch
thread, and per phase of ``LLMEngine.step`` the thread's CPU time *minus* the work that is
a graph replay on the GPU (the target forward, ``runner.execute``; the proposer's catch-up
and growth, ``TreeGrower``'s function). The remaining eager torch ops are tiny here, about
what their launches cost on a GPU.

``--accept all`` zeroes the final norms of target and head, so every logit is 0, every
argmax is token 0 and every draft is accepted (τ = depth + 1): the accepted-path work
(K/V moves, catch-up of several tokens, several tokens appended) runs every step.
``--accept none`` keeps the random weights (τ ≈ 1). Decode steps only (no prompt tokens).

``chain-pipelined`` / ``tree-pipelined`` run the pipelined step (engine/spec_pipeline.py):
its host work per step is the launch (everything enqueued for the next step; on a GPU the
device runs the previous step meanwhile) and the read of the step before (``finish``,
which includes appending tokens and reporting).

    OMP_NUM_THREADS=1 python benchmarks/host_spec_step.py --smollm2 DIR \
        --spec chain,tree,chain-pipelined,tree-pipelined
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_spec import random_head
from common import parse_str_list, time_step
from prompts import varied_conversations
from tiny_models import make_tiny_model_dir

from specdec import LLM, SamplingParams
from specdec.sampling_params import RequestOutputKind
from specdec.spec.metrics import SpecStats

SHAPES = {
    "chain": {"num_speculative_tokens": 3},
    "tree": {"num_speculative_tokens": 5, "tree": "dynamic", "top_k": 8, "total_tokens": 32},
}
# Engine methods timed as phases (nested device work subtracted): name -> (owner, attr).
PHASES = {
    "schedule": ("scheduler", "schedule"),
    "propose": ("engine", "_propose"),
    "prepare": ("runner", "prepare"),
    "verify": ("engine", "_verify"),
    "observe": ("engine", "_observe"),
    "outputs": ("engine", "_append_token"),
    "report": ("engine", "_report"),
    # The pipelined step's phases (finish includes outputs and report).
    "eligible": ("engine", "_can_pipeline"),
    "launch": ("pipeline", "launch"),
    "finish": ("engine", "_finish_spec"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smollm2", required=True, help="a SmolLM2 dir (config + tokenizer)")
    p.add_argument("--spec", type=parse_str_list, default=["chain", "tree"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--accept", choices=["all", "none"], default="all")
    p.add_argument("--vocab", type=int, default=1024, help="logits width (token ids taken mod it)")
    p.add_argument("--repeats", type=int, default=2, help="timed generations (medians pool)")
    p.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    torch.set_num_threads(1)  # the step's CPU time is then this thread's
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        # Logits of --vocab columns: their argmax is then as cheap on the CPU as a launch
        # is on a GPU (over SmolLM2's 49,152 it would be real work counted as host time).
        model = make_tiny_model_dir(Path(tmp), Path(a.smollm2), seed=0, vocab_size=a.vocab)
        # The tiny target has 2 layers: EAGLE-3's default (2, N//2, N-3) does not exist.
        head = random_head(str(model), Path(tmp), min(4096, a.vocab // 2), [0, 1, 1])
        if a.accept == "all":
            _zero_norm(model, "model.norm.weight")
            _zero_norm(head, "norm.weight")
        for spec in a.spec:
            shape, _, mode = spec.partition("-")
            if shape not in SHAPES or mode not in ("", "pipelined"):
                raise SystemExit(f"--spec {spec!r}: choose from {sorted(SHAPES)}, +-pipelined")
            config = {"method": "eagle3", "model": str(head), **SHAPES[shape]}
            config["pipelined"] = mode == "pipelined"
            llm = LLM(str(model), device="cpu", max_num_seqs=a.batch, speculative=config)
            report[spec] = run(llm, a, spec)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": report}, indent=1))


def _zero_norm(directory: Path, key: str) -> None:
    """Zero one norm weight in place: every logit after it is 0 (argmax: token 0)."""
    for f in directory.glob("*.safetensors"):
        tensors = load_file(f)
        if key in tensors:
            tensors[key] = torch.zeros_like(tensors[key])
            save_file(tensors, f, metadata={"format": "pt"})
            return
    raise SystemExit(f"{directory} has no {key}")


def run(llm: LLM, a: argparse.Namespace, spec: str) -> dict:
    engine = llm.engine
    device_s = [0.0]  # device-side work (graph replays on a GPU) inside the current step
    phase_s: dict[str, float] = defaultdict(float)
    prefill = [False]

    depth = [0]  # nested device work (the pipelined step's forwards) counts once

    def device_work(fn):
        def wrapper(*args, **kwargs):
            t0 = time.thread_time()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    device_s[0] += time.thread_time() - t0

        return wrapper

    def phase(name, fn):
        def wrapper(*args, **kwargs):
            t0, d0 = time.thread_time(), device_s[0]
            try:
                return fn(*args, **kwargs)
            finally:
                phase_s[name] += (time.thread_time() - t0) - (device_s[0] - d0)

        return wrapper

    owners = {
        "engine": engine,
        "runner": engine.runner,
        "scheduler": engine.scheduler,
        "pipeline": engine.pipeline,
    }
    engine.runner.execute = device_work(engine.runner.execute)
    grower = engine.proposer.grower
    grower._grow = device_work(grower._grow)
    if engine.pipeline is not None:  # the whole pipelined step is one graph replay there
        engine.pipeline._step = device_work(engine.pipeline._step)
    for name, (owner, attr) in PHASES.items():
        obj = owners[owner]
        if obj is not None:
            setattr(obj, attr, phase(name, getattr(obj, attr)))
    schedule = engine.scheduler.schedule

    def watch_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        prefill[0] |= any(s.num_new_tokens > 1 for s in out.scheduled)
        return out

    engine.scheduler.schedule = watch_schedule
    tok = engine.tokenizer
    prompts = [  # a narrowed vocabulary keeps the prompts' lengths, not their ids
        [t % a.vocab for t in tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"]]
        for c in varied_conversations(max(a.batch, 1))
    ]
    steps: list[dict[str, float]] = []
    profiler = cProfile.Profile() if a.profile else None
    for repeat in range(a.repeats + 1):  # the first generation warms up
        for ids in prompts[: a.batch]:
            params = SamplingParams(
                temperature=0.0,
                max_tokens=a.max_tokens,
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            engine.add_request(ids, params)
        engine.spec_stats = SpecStats()
        while engine.has_unfinished_requests():
            device_s[0], prefill[0] = 0.0, False
            phase_s.clear()
            wall, cpu = time_step(engine, profiler if repeat else None)
            if repeat and not prefill[0] and engine.scheduler.num_running == a.batch:
                steps.append({"wall": wall, "host": cpu - device_s[0], **phase_s})
    tau = engine.spec_stats.tau
    keys = ["host", *(k for k in PHASES if any(k in s for s in steps))]
    medians = {k: statistics.median(s.get(k, 0.0) for s in steps) * 1e3 for k in keys}
    print(f"{spec} batch={a.batch} accept={a.accept} τ={tau:.2f} decode steps={len(steps)}")
    print("  host ms/step (device work excluded): " + ", ".join(
        f"{k} {v:.3f}" for k, v in medians.items()
    ))  # fmt: skip
    if profiler is not None:
        s = io.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("tottime").print_stats(a.profile)
        print(s.getvalue())
    return {"tau": tau, "steps": len(steps), "median_ms": medians}


if __name__ == "__main__":
    main()
