"""Decode and prefill throughput of the specdec engine (plain decoding, no speculation).

Decode: ``batch`` requests with random ``prompt_len``-token prompts are prefilled, then the
engine's ``step()`` loop is timed until each has produced ``steps`` more tokens (greedy,
EOS ignored, final-only outputs as ``LLM.generate`` runs them). tokens/s = batch * steps /
seconds, the host's scheduling, input building, sampling and stop checks included — what
a user of the engine gets. With a tiny random model on CPU (``--model`` pointing at one)
the same script measures the engine's host overhead per step.
Prefill: ``prefill_batch`` prompts of ``prefill_len`` tokens with max_tokens=1, timed from
submission to completion; tokens/s = prompt tokens / seconds.

Prefix caching is off so repeats measure real work. Every figure is a median of repeats.

    python benchmarks/bench_engine.py --batch-sizes 1,64 --json out/engine.json   # on a GPU
    python benchmarks/bench_engine.py --smoke                                      # CPU check

Prints a table last: ms/step, decode tokens/s and prefill tokens/s per (variant, batch).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from specdec import LLM, SamplingParams
from specdec.sampling_params import RequestOutputKind

VARIANTS = {
    # name: engine keyword overrides
    "graphs+compile": {},  # async scheduling on (auto on the CUDA-graph path)
    "graphs+compile+sync": {"async_scheduling": False},
    # RoPE outside the cache write: the compiled code rotates q and k (one Inductor
    # kernel per layer) and the backend only stores, to measure what the fusion saves.
    "graphs+compile+rope-unfused": {},
    "graphs": {"compile": False},
    "eager": {"enforce_eager": True},
}


@contextlib.contextmanager
def rope_unfused():
    """The Triton backend without its fused RoPE: ``forward_rope`` rotates first (the
    base class's) and compiled code fuses the rotation itself."""
    from specdec.attention.base import AttentionBackend
    from specdec.attention.triton_backend import TritonAttentionBackend

    saved = TritonAttentionBackend.fuses_rope, TritonAttentionBackend.forward_rope
    TritonAttentionBackend.fuses_rope = False
    TritonAttentionBackend.forward_rope = AttentionBackend.forward_rope
    torch._dynamo.reset()  # compiled regions traced the other branch
    try:
        yield
    finally:
        TritonAttentionBackend.fuses_rope, TritonAttentionBackend.forward_rope = saved
        torch._dynamo.reset()


PATCHES = {"graphs+compile+rope-unfused": rope_unfused}


@dataclass
class Options:
    model: str
    variants: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    prompt_len: int
    steps: int
    repeats: int
    prefill_batch: int
    prefill_len: int
    kv_cache_memory: int
    device: str
    dtype: str
    attention_backend: str
    json_path: str | None


def decode_seconds(llm: LLM, batch: int, opts: Options, seed: int) -> float:
    engine = llm.engine
    prompts = common.random_prompt_ids(
        batch, opts.prompt_len, engine.model_config.vocab_size, seed, torch.device("cpu")
    ).tolist()
    params = SamplingParams(
        temperature=0,
        max_tokens=opts.steps + 1,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,  # as LLM.generate runs requests
    )
    for p in prompts:
        engine.add_request(p, params)
    # Prefill (possibly several chunks) until every request holds its first token.
    requests = list(engine.scheduler.waiting)
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    common.synchronize(engine.runner.device)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    common.synchronize(engine.runner.device)
    return time.perf_counter() - t0


def prefill_seconds(llm: LLM, opts: Options, seed: int) -> float:
    engine = llm.engine
    prompts = common.random_prompt_ids(
        opts.prefill_batch,
        opts.prefill_len,
        engine.model_config.vocab_size,
        seed,
        torch.device("cpu"),
    ).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    common.synchronize(engine.runner.device)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        engine.step()
    common.synchronize(engine.runner.device)
    return time.perf_counter() - t0


def run(opts: Options) -> list[common.ResultRow]:
    rows: list[common.ResultRow] = []
    for variant in opts.variants:
        try:
            with PATCHES.get(variant, contextlib.nullcontext)():
                rows += run_variant(opts, variant)
        except Exception as e:  # report and go on: one broken variant must not hide the rest
            print(f"variant {variant} FAILED: {type(e).__name__}: {e}"[:2000], flush=True)
            rows.append(
                common.ResultRow("specdec-engine", variant, 0, 0, 0, note=f"FAILED: {e}"[:200])
            )
        if opts.json_path:
            common.write_json(
                opts.json_path, env=common.env_info(*_device_dtype(opts)), options=opts, rows=rows
            )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print()
    print(common.markdown_table(rows))
    return rows


def _device_dtype(opts: Options) -> tuple[torch.device, torch.dtype]:
    on_gpu = torch.cuda.is_available() and opts.device in ("auto", "cuda")
    device = torch.device("cuda" if on_gpu else "cpu")
    if opts.dtype == "auto":
        return device, torch.bfloat16 if on_gpu else torch.float32
    return device, common.DTYPES[opts.dtype]


def run_variant(opts: Options, variant: str) -> list[common.ResultRow]:
    rows: list[common.ResultRow] = []
    llm = LLM(
        opts.model,
        device=opts.device,
        dtype=opts.dtype,
        attention_backend=opts.attention_backend,
        enable_prefix_caching=False,
        kv_cache_memory=opts.kv_cache_memory,
        max_model_len=max(opts.prompt_len + opts.steps + 2, opts.prefill_len + 2),
        max_num_seqs=max(max(opts.batch_sizes), opts.prefill_batch),
        cuda_graph_max_batch_size=max(opts.batch_sizes),
        **VARIANTS[variant],
    )
    runtime = llm.engine.runner.runtime
    env = common.env_info(runtime.device, runtime.dtype)
    for batch in opts.batch_sizes:
        decode_seconds(llm, batch, opts, seed=0)  # warm-up
        secs = statistics.median(
            decode_seconds(llm, batch, opts, seed=r + 1) for r in range(opts.repeats)
        )
        rows.append(
            common.ResultRow(
                bench="specdec-engine",
                variant=variant,
                batch_size=batch,
                prompt_len=opts.prompt_len,
                new_tokens=opts.steps,
                ms_per_step=secs / opts.steps * 1e3,
                decode_tokens_per_s=batch * opts.steps / secs,
            )
        )
        print(common.markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    prefill_seconds(llm, opts, seed=0)
    secs = statistics.median(prefill_seconds(llm, opts, seed=r + 1) for r in range(opts.repeats))
    rows.append(
        common.ResultRow(
            bench="specdec-engine",
            variant=variant,
            batch_size=opts.prefill_batch,
            prompt_len=opts.prefill_len,
            new_tokens=1,
            prefill_tokens_per_s=opts.prefill_batch * opts.prefill_len / secs,
        )
    )
    print(common.markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    common.print_env(env)
    del llm
    return rows


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--variants", default="graphs+compile", help=f"comma-separated, from {list(VARIANTS)}"
    )
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill-batch", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run to check the script")
    a = p.parse_args(argv)
    if a.smoke:
        a.variants, a.batch_sizes, a.steps, a.repeats = "eager", "1,2", 8, 1
        a.prompt_len, a.prefill_batch, a.prefill_len, a.kv_cache_memory = 32, 2, 64, 64 << 20
    variants = tuple(common.parse_str_list(a.variants))
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    return Options(
        model=a.model,
        variants=variants,
        batch_sizes=tuple(common.parse_int_list(a.batch_sizes)),
        prompt_len=a.prompt_len,
        steps=a.steps,
        repeats=a.repeats,
        prefill_batch=a.prefill_batch,
        prefill_len=a.prefill_len,
        kv_cache_memory=a.kv_cache_memory,
        device=a.device,
        dtype=a.dtype,
        attention_backend=a.attention_backend,
        json_path=a.json_path,
    )


if __name__ == "__main__":
    run(parse_args())
