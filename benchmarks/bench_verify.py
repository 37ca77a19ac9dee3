"""Cost of a verify step against a plain decode step, on the engine's CUDA graphs.

The target's forward for a batch where every sequence computes ``q`` tokens at a context of
``--context`` tokens, replayed from the same CUDA graphs the engine uses (``StepGraphs``,
inputs copied in as the engine copies them): ``q = 1`` is a plain decode step; ``q = K + 1``
is the size of a chain of K drafts; ``q = 65`` a 64-node tree. Every ``q > 1`` is a random
tree in node order (graphs send chains through the same tree-mask path, so a chain costs
what a tree of its size does). The KV cache holds random values and every
sequence has its own blocks. Reported: ms per step (median of repeats of ``--iters``
back-to-back replays, CUDA events) and the ratio to the ``q = 1`` step at the same batch.
The target: a 64-node verify step costs <= 1.3x a decode step at batch 1.

    python benchmarks/bench_verify.py --batch-sizes 1,16 --q 1,4,6,65 --json out/verify.json

Prints a table last: ms per step and the ratio to ``q = 1`` per (batch, q). Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from specdec import LLM
from specdec.attention.tree_mask import build_tree_mask
from specdec.ops.attention_metadata import AttentionMetadata


def step_inputs(q: int, batch: int, context: int, block_size: int, vocab: int, seed: int):
    """Inputs of one uniform step: sequence b owns blocks 1 + b*nb ... (nb per sequence)."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = context + q
    nb = -(-seq_len // block_size)
    tables = torch.arange(batch * nb, dtype=torch.int32).view(batch, nb) + 1
    pos = torch.arange(context, seq_len)
    slots = (tables[:, pos // block_size].long() * block_size + pos % block_size).flatten()
    parents = [0] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, q)]
    depth = [0] * q
    for i in range(1, q):
        depth[i] = depth[parents[i]] + 1
    positions = (context + torch.tensor(depth)).repeat(batch)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(0, (batch + 1) * q, q, dtype=torch.int32),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32),
        block_tables=tables,
        max_query_len=q,
        max_seq_len=seq_len,
    )
    if q > 1:
        meta = build_tree_mask([torch.tensor(parents)] * batch).attach(meta)
    ids = torch.randint(vocab, (batch * q,), generator=gen)
    return ids, positions, meta, batch * nb + 1


def to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    fields = {
        k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()
    }
    return AttentionMetadata(**fields)


def print_top_kernels(fn, title: str, iters: int, top: int = 12) -> None:
    """Device time per kernel name (summed over one call of ``fn`` = ``iters`` steps),
    as the profiler sees the kernels inside graph replays."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / iters
    print(f"-- {title}: kernels {total:.1f} us per step")
    for e in events[:top]:
        per_step = e.device_time_total / iters
        print(f"  {per_step:8.1f} us  {e.count // iters:4d}x  {e.key[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--q", default="1,4,6,65", help="tokens per sequence (1 = decode)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--json", dest="json_path")
    p.add_argument(
        "--profile", action="store_true", help="also print each step's top kernels (profiler)"
    )
    a = p.parse_args()
    qs = common.parse_int_list(a.q)
    batches = common.parse_int_list(a.batch_sizes)
    if 1 not in qs:
        qs = [1, *qs]
    llm = LLM(
        a.model,
        device="cuda",
        max_model_len=max(2048, a.context + max(qs)),
        max_num_seqs=max(batches),
        cuda_graph_max_batch_size=max(batches),
        compile=not a.no_compile,
        kv_cache_memory=2 << 30,
    )
    runner = llm.engine.runner
    device = runner.device
    graphs = runner.graphs
    assert graphs is not None, "the GPU path captures graphs; is CUDA visible?"
    with torch.inference_mode():
        for k, v in runner.kv_caches:
            k.normal_()
            v.normal_()
        for q in qs:
            if q > 1:
                graphs.capture(q, batches)
    env = common.env_info(device, runner.dtype)
    common.print_env(env)
    rows: list[common.ResultRow] = []
    base: dict[int, float] = {}
    for batch in batches:
        for q in qs:
            ids, positions, meta, blocks_needed = step_inputs(
                q, batch, a.context, runner.block_size, runner.model_config.vocab_size, q
            )
            if blocks_needed > runner.num_blocks:
                raise SystemExit(f"need {blocks_needed} blocks; the cache has {runner.num_blocks}")
            ids, positions, meta = ids.to(device), positions.to(device), to(meta, device)

            def replay(ids=ids, positions=positions, meta=meta, q=q) -> None:
                for _ in range(a.iters):
                    graphs.run(q, ids, positions, meta)

            with torch.inference_mode():
                seconds = common.measure(replay, device, warmup=2, repeats=a.repeats) / a.iters
            if q == 1:
                base[batch] = seconds
            ratio = seconds / base[batch]
            rows.append(
                common.ResultRow(
                    bench="verify",
                    variant=f"q={q}" + (" (decode)" if q == 1 else f" ({q - 1} drafts)"),
                    batch_size=batch,
                    prompt_len=a.context,
                    new_tokens=q,
                    ms_per_step=seconds * 1e3,
                    note=f"{ratio:.2f}x decode",
                )
            )
            print(f"batch {batch} q {q}: {seconds * 1e3:.3f} ms ({ratio:.2f}x)", flush=True)
            if a.profile:
                with torch.inference_mode():
                    print_top_kernels(replay, f"batch {batch} q {q}", a.iters)
            if a.json_path:
                common.write_json(a.json_path, env=env, options=vars(a), rows=rows)
    print(common.markdown_table(rows))


if __name__ == "__main__":
    main()
