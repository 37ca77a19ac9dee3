"""How close does the Triton paged decode kernel come to the GPU's copy bandwidth?

Decode attention reads every cached K/V byte of every sequence once per step, so its
ceiling is memory bandwidth. For each shape and context length this script fills a paged
bf16 cache of several GB (blocks scattered by a random permutation, as a long-running block
pool leaves them), times ``paged_decode`` under a few tile configurations, and compares the
achieved bandwidth with a device-to-device copy of a tensor the size of the K/V read,
measured in the same run.

Bytes counted for the kernel: K and V of every context token, the block-table entries, q
and the output (split-K scratch traffic is overhead and is not counted). The copy moves
its size twice (read + write). Times are medians of CUDA-event timings after warm-up.

    python benchmarks/bench_decode_kernel.py --json out/decode_bw.json   # on the H200
    python benchmarks/bench_decode_kernel.py --smoke                      # CPU, interpreter
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType

import torch

from specdec.ops.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16


# (block_n, num_warps, num_stages) tried besides the default on the GPU.
SWEEP = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3), (256, 8, 2), (256, 8, 3)]

SHAPES = [
    Shape("smollm2", num_heads=9, num_kv_heads=3, head_dim=64),
    Shape("gqa8-d128", num_heads=32, num_kv_heads=4, head_dim=128),
]


@dataclass
class Row:
    shape: str
    context: int
    batch: int
    kv_gb: float  # K+V bytes read, 1e9
    config: str  # block_n/num_warps/num_stages, "*" marks the default
    num_splits: int
    ms: float  # median
    gbps: float  # counted bytes / ms
    copy_gbps: float  # 2 * size / ms for a copy of the K+V size
    pct_of_copy: float
    max_err: float  # vs the fp32 reference on the first sequences


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write all measurements here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU (interpreter)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--gb", type=float, default=4.0, help="target K+V size per case, GB")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-sweep", action="store_true", help="time the default config only")
    return p.parse_args()


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


@dataclass
class Case:
    shape: Shape
    context: int
    q: torch.Tensor  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    kv_bytes: int  # K+V bytes the kernel must read
    counted_bytes: int  # kv_bytes + block-table entries + q + output

    @property
    def batch(self) -> int:
        return self.q.shape[0]


def make_case(shape: Shape, ctx: int, target_bytes: float, dtype, device, gen) -> Case:
    """``batch`` sequences of ``ctx`` tokens each, K+V about ``target_bytes``, pages in a
    random order."""
    elem = torch.finfo(dtype).bits // 8
    kv_bytes_per_seq = 2 * ctx * shape.num_kv_heads * shape.head_dim * elem
    batch = max(1, int(target_bytes // kv_bytes_per_seq))
    pages = -(-ctx // shape.block_size)
    num_blocks = batch * pages + 1  # block 0 is the null block
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        block_tables=perm.view(batch, pages).to(torch.int32),
        max_query_len=1,
        max_seq_len=ctx,
    )
    q = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen, device=device)
    q = q.to(dtype)
    kv_bytes = batch * kv_bytes_per_seq
    return Case(
        shape=shape,
        context=ctx,
        q=q,
        k_cache=torch.randn(cache_shape, generator=gen, device=device, dtype=dtype),
        v_cache=torch.randn(cache_shape, generator=gen, device=device, dtype=dtype),
        meta=meta,
        kv_bytes=kv_bytes,
        counted_bytes=kv_bytes + meta.block_tables.numel() * 4 + 2 * q.numel() * elem,
    )


def copy_gbps(nbytes: int, dtype, device, gen, repeats: int, warmup: int) -> float:
    """Device-to-device copy of an ``nbytes`` tensor: 2 * nbytes moved per copy."""
    src = torch.randn(nbytes // (torch.finfo(dtype).bits // 8), generator=gen, device=device)
    src = src.to(dtype)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats, warmup)
    return 2 * nbytes / ms / 1e6


def reference(case: Case, kernels: ModuleType, n_check: int = 2) -> torch.Tensor:
    """fp32 reference output of the first ``n_check`` sequences, from a compact copy of
    just their blocks (an fp32 copy of the whole multi-GB cache would not fit twice)."""
    meta = case.meta
    n_check = min(n_check, case.batch)
    used = meta.block_tables[:n_check].long()  # [n_check, pages]
    k_small = torch.cat([case.k_cache[:1], case.k_cache[used.flatten()]]).float()
    v_small = torch.cat([case.v_cache[:1], case.v_cache[used.flatten()]]).float()
    table = torch.arange(1, used.numel() + 1, dtype=torch.int32, device=case.q.device)
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:n_check],
        query_start_loc=meta.query_start_loc[: n_check + 1],
        seq_lens=meta.seq_lens[:n_check],
        block_tables=table.view(used.shape),
        max_query_len=1,
        max_seq_len=meta.max_seq_len,
    )
    scale = case.shape.head_dim**-0.5
    return kernels.paged_decode_ref(case.q[:n_check].float(), k_small, v_small, sub, scale)


def measure(
    case: Case, configs: list, default, kernels: ModuleType, copy: float, repeats: int, warmup: int
) -> list[Row]:
    """Time ``paged_decode`` on ``case`` under each config; check each against the reference."""
    ref = reference(case, kernels)
    scale = case.shape.head_dim**-0.5
    rows = []
    for config in configs:
        label = f"{config.block_n}/{config.num_warps}/{config.num_stages}"
        label += "*" if config == default else ""

        def run(config=config):
            return kernels.paged_decode(
                case.q, case.k_cache, case.v_cache, case.meta, scale, config=config
            )

        try:
            out = run()
        except Exception as e:  # e.g. a config needing more shared memory than the GPU has
            print(f"{case.shape.name} ctx={case.context} {label}: skipped ({e!r:.200})")
            continue
        err = (out[: ref.shape[0]].float() - ref).abs().max().item()
        ms = median_ms(run, case.q.device, repeats, warmup)
        plan = kernels.plan_splits(
            case.batch * case.shape.num_kv_heads, case.context, config.block_n, case.q.device
        )
        gbps = case.counted_bytes / ms / 1e6
        row = Row(
            shape=case.shape.name,
            context=case.context,
            batch=case.batch,
            kv_gb=case.kv_bytes / 1e9,
            config=label,
            num_splits=plan.num_splits,
            ms=ms,
            gbps=gbps,
            copy_gbps=copy,
            pct_of_copy=100 * gbps / copy,
            max_err=err,
        )
        rows.append(row)
        print(
            f"{row.shape} ctx={row.context} batch={row.batch} {label}: {ms:.3f} ms "
            f"{gbps:.0f} GB/s ({row.pct_of_copy:.0f}% of copy {copy:.0f}) err={err:.1e}"
        )
    return rows


def print_table(rows: list[Row]) -> None:
    """One line per case: the default config and the best one, against the copy."""
    print(
        f"\n{'shape':<10} {'ctx':>6} {'batch':>5} {'GB':>5} {'default':>8} {'best':>8} "
        f"{'best cfg':>9} {'copy':>8} {'best/copy':>9}   (GB/s; cfg = block_n/warps/stages)"
    )
    cases = dict.fromkeys((r.shape, r.context) for r in rows)
    for shape, ctx in cases:
        case = [r for r in rows if (r.shape, r.context) == (shape, ctx)]
        best = max(case, key=lambda r: r.gbps)
        dflt = next((r for r in case if r.config.endswith("*")), None)
        dflt_gbps = f"{dflt.gbps:.0f}" if dflt else "-"
        print(
            f"{shape:<10} {ctx:>6} {best.batch:>5} {best.kv_gb:>5.2f} {dflt_gbps:>8} "
            f"{best.gbps:>8.0f} {best.config:>9} {best.copy_gbps:>8.0f} {best.pct_of_copy:>8.0f}%"
        )


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if args.smoke and not cuda:
        # Must precede the kernels' import: triton picks interpret-or-compile at decoration.
        os.environ["TRITON_INTERPRET"] = "1"
    elif not cuda:
        raise SystemExit("no CUDA device: run with --smoke to check the script on CPU")
    import specdec.kernels as kernels

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    contexts, target_bytes = args.contexts, args.gb * 1e9
    repeats, warmup = args.repeats, args.warmup
    if args.smoke:
        contexts, target_bytes, repeats, warmup = [48, 100], 2e5, 2, 1
    gen = torch.Generator(device=device).manual_seed(0)

    rows: list[Row] = []
    for shape in SHAPES:
        default = kernels.default_decode_config(shape.head_dim, dtype)
        configs = [default]
        if args.smoke:
            configs = [default, kernels.DecodeConfig(16, 4, 2)]
        elif not args.no_sweep:
            sweep = [kernels.DecodeConfig(*c) for c in SWEEP]
            configs += [c for c in sweep if c != default]
        for ctx in contexts:
            case = make_case(shape, ctx, target_bytes, dtype, device, gen)
            copy = copy_gbps(case.kv_bytes, dtype, device, gen, repeats, warmup)
            rows += measure(case, configs, default, kernels, copy, repeats, warmup)
            del case  # free the cache before the next, larger batch is allocated

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        info = {
            "device": torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)",
            "dtype": str(dtype),
            "torch": torch.__version__,
            "triton": importlib.metadata.version("triton"),
            "smoke": args.smoke,
            "rows": [asdict(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    print_table(rows)


if __name__ == "__main__":
    main()
