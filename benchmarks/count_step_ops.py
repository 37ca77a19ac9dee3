"""Device ops per pipelined speculative step, by phase, counted on the CPU.

On a GPU a speculative step at batch 1 is launch-bound: its time is close to its
kernel count times the launch cost (~2 µs on the H200). The work between the model
forwards — tree growth and layout, the tree masks, verification inputs, acceptance, the
K/V move, the next catch-up state — runs eagerly inside the step's CUDA graph, one kernel
per torch op, and its op count does not depend on the device. This script counts it
without a GPU: it runs ``SpecPipeline._step`` (the function the graph captures) on the CPU
under a dispatch mode that counts every torch op that does work (views and allocations
excluded) and every Triton launch (the GPU path's kernels, run by the interpreter),
attributed to the innermost phase running:

- ``head`` / ``target``: the head's and the target's forwards, attention excluded. On
  the GPU these are compiled regions (Inductor fuses their elementwise ops), so their
  counts here are an upper bound, given for scale;
- ``attention``: attention backend calls, reported as calls (the rotation and cache
  write, then one or two attention kernels each);
- ``draft glue``, ``verify inputs``, ``accept``, ``move_kv``, ``state``: eager work, which
  is what the GPU launches as is.

The target is a 30-layer, 64-wide Llama with SmolLM2's config otherwise (the real depth
sets the K/V move's and the verify's per-layer counts), the head a random EAGLE-3 head.

    TRITON_INTERPRET=1 python benchmarks/count_step_ops.py --shapes chain3,tree --batch 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_spec import random_head
from common import parse_int_list, parse_str_list
from tiny_models import make_tiny_model_dir

SHAPES = {
    "chain2": {"num_speculative_tokens": 2},
    "chain3": {"num_speculative_tokens": 3},
    "tree": {"tree": "dynamic", "num_speculative_tokens": 5, "top_k": 8, "total_tokens": 32},
}
ORDER = ("draft glue", "head", "verify inputs", "target", "accept", "move_kv", "state")


def is_work(func, args, out) -> bool:
    """Whether an aten op launched a kernel: not a bare allocation, and not a view (a
    result that aliases an input without writing it; ``contiguous`` and ``reshape`` are
    views only when they return an input's storage)."""
    schema = func._schema
    if schema.name.startswith(("aten::empty", "aten::lift_fresh", "aten::sym_")):
        return False
    if not any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return True
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(
        isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs for o in outs
    )


class OpCounter(TorchDispatchMode):
    """Counts working ops per phase (the innermost of ``self.stack``), and per op name."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = ["state"]
        self.counts: Counter[str] = Counter()
        self.by_op: dict[str, Counter[str]] = defaultdict(Counter)
        self.attention_calls: Counter[str] = Counter()
        self.host_syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in ("aten::_local_scalar_dense", "aten::item"):
            self.host_syncs += 1
        phase = self.stack[-1]
        out = func(*args, **(kwargs or {}))
        if phase not in ("attention", "triton") and is_work(func, args, out):
            self.counts[phase] += 1
            self.by_op[phase][name.removeprefix("aten::")] += 1
        return out

    @contextlib.contextmanager
    def phase(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()


def wrap(counter: OpCounter, name: str, fn):
    def wrapper(*args, **kwargs):
        if name == "attention":
            counter.attention_calls[counter.stack[-1]] += 1
        with counter.phase(name):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def patched(counter: OpCounter, engine):
    """Phase labels on what ``SpecPipeline._step`` calls; undone on exit."""
    import specdec.spec.pipeline as spec_pipeline
    from specdec.attention.torch_backend import TorchAttentionBackend
    from specdec.attention.triton_backend import TritonAttentionBackend
    from specdec.models.eagle3_head import Eagle3Head
    from specdec.models.llama import CausalLM

    targets = [
        (engine.proposer, "grow_pipelined", "draft glue"),
        (Eagle3Head, "forward", "head"),
        (spec_pipeline, "verify_inputs", "verify inputs"),
        (CausalLM, "forward", "target"),
        (CausalLM, "compute_logits", "target"),
        (engine.pipeline, "_accept_and_stage", "accept"),
        (engine.runner, "move_kv", "move_kv"),
        (TorchAttentionBackend, "forward", "attention"),
        (TorchAttentionBackend, "forward_rope", "attention"),
        (TritonAttentionBackend, "forward", "attention"),
        (TritonAttentionBackend, "forward_rope", "attention"),
    ]
    launcher = _interpreted_launcher()
    saved = [(owner, attr, owner.__dict__.get(attr)) for owner, attr, _ in targets]
    saved.append((launcher, "run", launcher.__dict__["run"]))
    run = launcher.run

    def counted_run(kernel, *args, **kwargs):  # a Triton launch is one kernel
        if counter.stack[-1] != "attention":
            counter.counts[counter.stack[-1]] += 1
            counter.by_op[counter.stack[-1]][f"triton:{kernel.fn.__name__}"] += 1
        with counter.phase("triton"):  # the interpreter's own torch calls are not kernels
            return run(kernel, *args, **kwargs)

    launcher.run = counted_run
    for owner, attr, name in targets:
        setattr(owner, attr, wrap(counter, name, getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, original in saved:
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def _interpreted_launcher():
    """The class whose ``run`` launches a Triton kernel under ``TRITON_INTERPRET=1``."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction


def count(llm, batch: int, steps: int) -> dict:
    """Ops per pipelined step (the last of ``steps`` launches, after warm-up)."""
    from specdec import SamplingParams
    from specdec.sampling_params import RequestOutputKind

    engine = llm.engine
    pipeline = engine.pipeline
    assert pipeline is not None, "the engine does not pipeline this configuration"
    counter = OpCounter()
    step = pipeline._step
    launches = []

    def counted(*args, **kwargs):
        launches.append(1)
        if len(launches) != steps:
            return step(*args, **kwargs)
        with counter, patched(counter, engine):
            return step(*args, **kwargs)

    pipeline._step = counted
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8 * steps,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    for i in range(batch):
        engine.add_request([1, 2, 3, 4, 5 + i, 6, 7, 8], params)
    while engine.has_unfinished_requests() and len(launches) < steps:
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    pipeline._step = step
    if len(launches) < steps:
        raise SystemExit(f"only {len(launches)} pipelined launches ran; raise --max-tokens")
    return {
        "ops": dict(counter.counts),
        "attention_calls": dict(counter.attention_calls),
        "host_syncs": counter.host_syncs,
        "top_ops": {p: c.most_common(12) for p, c in counter.by_op.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--smollm2",
        default="smollm2-135m-instruct",
        help="SmolLM2's config + tokenizer: an HF dir, or a model name specdec resolves",
    )
    p.add_argument("--shapes", type=parse_str_list, default=["chain3", "tree"])
    p.add_argument("--batch", type=parse_int_list, default=[1])
    p.add_argument("--layers", type=int, default=30, help="target depth (SmolLM2: 30)")
    p.add_argument("--steps", type=int, default=3, help="launches per run; the last counts")
    p.add_argument(
        "--attention-backend",
        choices=["torch", "triton"],
        default="triton",
        help="triton (the GPU path's kernels, run by the interpreter; needs "
        "TRITON_INTERPRET=1) or the torch reference",
    )
    p.add_argument("--top", action="store_true", help="the commonest ops of each phase")
    p.add_argument("--json", help="write the counts here")
    a = p.parse_args()
    unknown = [s for s in a.shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown --shapes {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    if a.attention_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error(
            "--attention-backend triton runs its kernels in the interpreter: set TRITON_INTERPRET=1"
        )
    from specdec import LLM

    results = {}
    from specdec.models.loader import resolve_model

    smollm2 = resolve_model(a.smollm2).hf_dir
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model_dir(
            Path(tmp), smollm2, seed=0, vocab_size=1024, num_layers=a.layers
        )
        n = a.layers
        head = random_head(str(model), Path(tmp), 512, [min(2, n - 1), n // 2, max(n - 3, 0)])
        for shape in a.shapes:
            config = {"method": "eagle3", "model": str(head), "pipelined": True}
            llm = LLM(
                str(model),
                device="cpu",
                attention_backend=a.attention_backend,
                max_num_seqs=max(a.batch),
                speculative=config | SHAPES[shape],
            )
            for batch in a.batch:
                results[f"{shape}-b{batch}"] = count(llm, batch, a.steps)
            del llm
    print(format_table(results))
    if a.top:
        for name, r in results.items():
            print(f"\n## {name}: commonest ops per phase")
            for phase in ORDER:
                ops = r["top_ops"].get(phase)
                if ops:
                    print(f"- {phase}: " + ", ".join(f"{op} {k}" for op, k in ops))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))


def format_table(results: dict) -> str:
    head = "| run | " + " | ".join(ORDER) + " | eager total | attention calls | host syncs |"
    rule = "|---|" + "---:|" * (len(ORDER) + 3)
    lines = [head, rule]
    for name, r in results.items():
        ops = r["ops"]
        eager = sum(ops.get(k, 0) for k in ORDER if k not in ("head", "target"))
        calls = sum(r["attention_calls"].values())
        cells = [str(ops.get(k, 0)) for k in ORDER]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {eager} | {calls} | {r['host_syncs']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
