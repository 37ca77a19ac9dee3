"""Where an engine step's time goes: host wall time per phase of ``LLMEngine.step``.

Each phase (propose, prepare, execute, verify/sample, observe) is wrapped with a timer that
synchronises the device before and after, so a phase's figure is its own host work plus
the device work it launched. Synchronising changes the overlap the real loop has, so the
sum is an upper bound of a step; the split is what matters (under async scheduling, plain
decoding's default on the GPU, the phases lose their overlap entirely: `step (total)` is
then a synchronous step's cost, not the async loop's). Greedy decoding of
``--batch`` chat prompts, ``--max-tokens`` each, after one warm-up generation; medians per
step over the timed generation (``--prompts FILE``: that file's chats that fit, cycled to
the batch, instead; with ``--max-tokens 1`` a run is its prompts' prefill steps).
``--spec`` and ``--batch`` take lists: one engine per spec, every batch size on it.
"graphed" counts target forwards replayed from a CUDA graph and whole proposals replayed
from the proposer's growth graphs; ``--kernels N`` adds the N costliest device kernels of
the timed generation (torch profiler, unsynchronised run).
EAGLE-3 specs draft with a random head: their timings are real, their τ is ~1; ``default``
is the model's shipped head with its own tree and batch-size bands.
``--deterministic`` builds every engine in deterministic mode (batch-invariant kernels on
the target's path); run the two modes as two invocations, one engine per process.

    python benchmarks/profile_step.py --spec none,eagle3-k3,eagle3-tree --batch 1,16
    python benchmarks/profile_step.py --batch 64 --kernels 8 --deterministic

Prints, per (spec, batch), a table of phases: calls, median ms and total ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_spec import random_head
from common import parse_int_list, parse_str_list
from prompts import varied_conversations

from specdec import LLM, SamplingParams
from specdec.bench.driver import draft_graph_replays, graph_replays
from specdec.bench.sets import SetOptions, file_set
from specdec.config import SpeculativeConfig
from specdec.models.packaged_heads import default_speculative
from specdec.spec.metrics import SpecStats

DEFAULT = "default"  # the model's shipped head (``packaged_heads.default_speculative``)
SPECS = {
    "none": None,
    DEFAULT: None,
    "ngram-k3": {"method": "ngram", "num_speculative_tokens": 3},
    "eagle3-k3": {"method": "eagle3", "num_speculative_tokens": 3},
    "eagle3-tree": {
        "method": "eagle3",
        "tree": "dynamic",
        "num_speculative_tokens": 5,
        "top_k": 8,
        "total_tokens": 64,
    },
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--spec", type=parse_str_list, default=["none"], help=" | ".join(SPECS))
    p.add_argument("--batch", type=parse_int_list, default=[1])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", help=".jsonl of {prompt} or {messages} (default: varied chats)")
    p.add_argument("--kernels", type=int, default=0, help="also list the N costliest kernels")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic mode (EngineConfig.deterministic) for every engine",
    )
    p.add_argument(
        "--plain-first",
        action="store_true",
        help="build a plain engine first and keep it alive (as bench_spec's runs do)",
    )
    a = p.parse_args()
    unknown = [s for s in a.spec if s not in SPECS]
    if unknown:
        p.error(f"unknown --spec {unknown[0]!r}; choose from {', '.join(SPECS)}")
    plain = build(a, None) if a.plain_first else None
    with tempfile.TemporaryDirectory() as tmp:
        head = None
        for name in a.spec:
            spec = SPECS[name]
            if spec is not None and spec["method"] == "eagle3":
                head = head or str(random_head(a.model, Path(tmp)))
                spec = {**spec, "model": head}
            config = SpeculativeConfig(**spec) if spec else None
            if name == DEFAULT:
                config = default_speculative(a.model)
                if config is None:
                    p.error(f"--spec {DEFAULT}: {a.model!r} ships no head")
            llm = build(a, config)
            for batch in a.batch:
                profile(llm, name, batch, a.max_tokens, a.kernels, a.prompts)
            del llm
    del plain


def build(a: argparse.Namespace, spec: SpeculativeConfig | None) -> LLM:
    return LLM(
        a.model,
        speculative=spec,
        max_model_len=2048,
        max_num_seqs=max(a.batch),
        cuda_graph_max_batch_size=max(a.batch),
        kv_cache_memory=2 << 30,
        enable_prefix_caching=False,
        deterministic=a.deterministic,
    )


def profile(
    llm: LLM, name: str, batch: int, max_tokens: int, kernels: int, prompts_file: str | None
) -> None:
    engine = llm.engine
    tok = engine.tokenizer
    ids = [
        list(tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"])
        for c in conversations(batch, prompts_file)
    ]
    limit = engine.max_model_len - max_tokens  # a file's longest chats may not fit
    ids = [p for p in ids if len(p) <= limit]
    if not ids:
        raise SystemExit(f"no prompt of {prompts_file} fits the {limit}-token limit")
    prompts = [ids[i % len(ids)] for i in range(batch)]
    times: dict[str, list[float]] = defaultdict(list)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    if kernels and torch.cuda.is_available():
        print_kernels(llm, prompts, params, kernels)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            times[name].append(time.perf_counter() - t0)
            return out

        return wrapper

    from specdec.engine import sync_step
    from specdec.engine.async_step import AsyncStep
    from specdec.engine.sync_step import SyncStep

    sync_mode, async_mode = engine.mode(SyncStep), engine.mode(AsyncStep)
    originals = []
    for obj, attr in [
        (sync_mode, "_propose"),
        (engine.runner, "prepare"),
        (engine.runner, "execute"),
        (sync_mode, "_verify"),
        (engine.step_sampler, "on_device"),  # sampling (the synchronous read-back: step)
        (async_mode, "_finish"),  # async scheduling: reading a launched step's tokens
        (sync_step, "observe"),
        (engine.runner, "move_kv"),
        (engine.scheduler, "schedule"),
        (engine, "step"),
    ]:
        if obj is None:
            continue
        original = getattr(obj, attr)
        originals.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, timed("step (total)" if attr == "step" else attr, original))
    replays, draft_replays = graph_replays(engine), draft_graph_replays(engine)
    engine.spec_stats = SpecStats()
    llm.generate(prompts, params, use_tqdm=False)
    # Restored for the next batch size: an instance's wrapper shadowing its class's method
    # is deleted, a module's function put back.
    for obj, attr, own in originals:
        if own is None:
            delattr(obj, attr)
        else:
            setattr(obj, attr, own)
    steps = len(times["step (total)"])
    print(
        f"spec={name} batch={batch} deterministic={engine.config.deterministic} "
        f"steps={steps} tau={engine.spec_stats.tau:.2f} "
        f"graphed: target {graph_replays(engine) - replays}/{steps}, "
        f"proposals {draft_graph_replays(engine) - draft_replays}"
    )
    print("| phase | calls | median ms | total ms |")
    print("|---|---:|---:|---:|")
    for phase, values in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"| {phase} | {len(values)} | {statistics.median(values) * 1e3:.3f} | "
            f"{sum(values) * 1e3:.1f} |"
        )


def conversations(n: int, prompts_file: str | None) -> list[list[dict]]:
    """The file's chats, else ``n`` of ``tests/prompts.py``'s varied ones."""
    if prompts_file is None:
        return varied_conversations(n)
    return [list(c.messages) for c in file_set(prompts_file).load(SetOptions())]


def print_kernels(llm: LLM, prompts, params, top: int) -> None:
    """The ``top`` device kernels by total time over one generation."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=top, max_name_column_width=60
    )
    print(table)


if __name__ == "__main__":
    main()
