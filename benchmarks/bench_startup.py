"""Cold start of the specdec engine: where the seconds before the first token go.

A server restart pays these on every deploy, and a request whose shape the process has not
seen yet pays the rest on its first token. Measured from a cold process with empty Triton
and Inductor caches (fresh temporary dirs unless ``--warm-caches``):

- build: ``LLM(...)`` end to end (weights, memory profile, KV cache, CUDA-graph capture with
  its compilation), the capture of each graph batch size, and Dynamo's frame compilations;
- first requests: one request at a time, ``max_tokens=1``, prompts of each length in
  ``--prompt-lens``, twice. The first pass pays any kernel compilation a new shape triggers
  (counted as Triton cache entries written during the request); the second pass is the
  warm time. A first-pass time far above the second means requests pay compilation.

    python benchmarks/bench_startup.py --variants graphs+compile,graphs   # on a GPU

Prints, per variant, the build's seconds, each graph's capture and Dynamo's compilations,
then a table of milliseconds to the first token per pass and prompt length.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import common  # this script's folder is on sys.path
from bench_engine import VARIANTS


@dataclass
class Options:
    model: str
    variants: tuple[str, ...]
    prompt_lens: tuple[int, ...]
    max_num_seqs: int
    kv_cache_memory: int
    warm_caches: bool


def _isolate_caches() -> Path:
    """Fresh Triton and Inductor cache dirs (both read their variable when they compile)."""
    root = Path(tempfile.mkdtemp(prefix="specdec-startup-"))
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    return root


def _count_entries(root: Path | None) -> int:
    """Compiled kernels on disk under ``root`` (one folder per Triton compilation)."""
    if root is None or not root.exists():
        return 0
    return sum(1 for p in root.rglob("*") if p.is_dir())


def run_variant(opts: Options, variant: str, cache_root: Path | None) -> None:
    import torch
    from torch._dynamo.utils import counters

    from specdec import LLM, SamplingParams
    from specdec.engine import cuda_graph

    capture_s: dict[tuple[int, int], float] = {}
    original = cuda_graph.StepGraphs._capture

    def timed_capture(self, key, args):
        t0 = time.perf_counter()
        out = original(self, key, args)
        capture_s[key] = time.perf_counter() - t0
        return out

    cuda_graph.StepGraphs._capture = timed_capture
    frames0 = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    try:
        llm = LLM(
            opts.model,
            enable_prefix_caching=False,
            kv_cache_memory=opts.kv_cache_memory,
            max_num_seqs=opts.max_num_seqs,
            **VARIANTS[variant],
        )
    finally:
        cuda_graph.StepGraphs._capture = original
    build_s = time.perf_counter() - t0
    frames = counters["stats"]["unique_graphs"] - frames0
    print(f"\n## {variant}: build {build_s:.1f} s, {frames} Dynamo graph(s) compiled")
    if capture_s:
        print("| q | batch | capture s |\n|---:|---:|---:|")
        for (q, bs), s in sorted(capture_s.items()):
            print(f"| {q} | {bs} | {s:.2f} |")
    vocab = llm.engine.runner.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for rep in ("first", "again"):
        for n in opts.prompt_lens:
            ids = torch.randint(16, vocab, (n,), generator=gen).tolist()
            before = _count_entries(cache_root)
            t = time.perf_counter()
            llm.generate([ids], params, use_tqdm=False)
            rows.append(
                (rep, n, (time.perf_counter() - t) * 1e3, _count_entries(cache_root) - before)
            )
    print("| pass | prompt tokens | ms to first token | new kernel cache entries |")
    print("|---|---:|---:|---:|")
    for rep, n, ms, new in rows:
        print(f"| {rep} | {n} | {ms:.1f} | {new} |")
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--variants", default="graphs+compile", help=f"comma-separated, from {list(VARIANTS)}"
    )
    p.add_argument("--prompt-lens", default="37,64,100,128,257,581,1000,1357")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30)
    p.add_argument("--warm-caches", action="store_true", help="keep the user's kernel caches")
    a = p.parse_args(argv)
    variants = tuple(common.parse_str_list(a.variants))
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    return Options(
        model=a.model,
        variants=variants,
        prompt_lens=tuple(common.parse_int_list(a.prompt_lens)),
        max_num_seqs=a.max_num_seqs,
        kv_cache_memory=a.kv_cache_memory,
        warm_caches=a.warm_caches,
    )


if __name__ == "__main__":
    options = parse_args()
    root = None if options.warm_caches else _isolate_caches()
    for name in options.variants:
        run_variant(options, name, root / "triton" if root else None)
