"""EAGLE-3 training throughput: tokens/s and model-FLOP utilisation of one training step.

One optimizer step of the real objective (``specdec.train.ttt.ttt_forward`` through
``TTTModel``: the serving head with TTT attention (--attention), 7 unrolled steps, AdamW,
bf16 autocast as accelerate runs it) on random target states, for a head shaped for
SmolLM2-135M and one shaped for Llama-3-8B (hidden 4096, vocab 128,256, draft vocab
32,000). The card's bf16 matmul rate is measured in the same run; utilisation = model
FLOPs / step time / that rate, where model FLOPs count the head's forward and backward
matmuls (fc, q/k/v/o, MLP, lm_head, attention scores and values), not the labels' lm_head
(the target's, under no_grad). The target: >= 35% for the 8B-shaped head.

    python benchmarks/bench_train.py --json out/train.json        # on the H200
    python benchmarks/bench_train.py --smoke                        # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from specdec.models import ModelConfig
from specdec.train.model import TargetIO, TTTModel, attention_backend, build_head
from specdec.train.ttt import PackedBatch

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, num_hidden_layers=30,
                    draft_vocab=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, num_hidden_layers=32,
                      draft_vocab=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, num_hidden_layers=8, draft_vocab=128),
}  # fmt: skip


@dataclass
class Row:
    shape: str
    tokens: int  # per micro-batch
    seq_len: int
    steps: int  # TTT steps
    ms: float  # median per optimizer step
    tokens_per_s: float
    model_tflops: float  # per optimizer step, forward + backward
    achieved_tflops: float
    matmul_tflops: float  # the card's, measured in the same run
    utilisation: float


def model_flops(cfg: ModelConfig, draft_vocab: int, tokens: int, seq_len: int, steps: int) -> float:
    """Forward + backward (3x forward) matmul FLOPs of the head over one micro-batch."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_step = 2 * (2 * h * (q + 2 * kv) + q * h + 3 * h * i + h * draft_vocab)
    # Scores and values against step 0's causal keys (mean context seq_len / 2) and the
    # step's own diagonal keys.
    attention = lambda s: 2 * 2 * q * (seq_len / 2 + s)  # noqa: E731
    forward = tokens * (2 * 3 * h * h + sum(per_step + attention(s) for s in range(steps)))
    return 3 * forward


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = common.measure(lambda: a @ b, device, warmup=3, repeats=10)
    return 2 * n**3 / seconds / 1e12


def run_shape(name: str, a: argparse.Namespace, device: torch.device) -> Row:
    spec = dict(SHAPES[name])
    draft_vocab = spec.pop("draft_vocab")
    hf = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "rope_theta": 5e5,
          "max_position_embeddings": 8192}  # fmt: skip
    cfg = ModelConfig.from_hf({**hf, **spec})
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = TargetIO(
        cfg,
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02,
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02,
    )
    kept = torch.randperm(cfg.vocab_size, generator=gen)[:draft_vocab].sort().values
    d2t = kept - torch.arange(draft_vocab)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    aux_ids = (2, cfg.num_layers // 2, cfg.num_layers - 3)
    head = build_head(target, name, d2t, t2d, aux_ids, attention_backend(a.attention, device))
    model = TTTModel(head.to(device), target, steps=a.steps, decay=0.8)
    model.place_target(device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    n = a.tokens
    seqs = max(1, n // a.seq_len)
    cu = torch.arange(seqs + 1) * (n // seqs)
    cu[-1] = n
    batch = PackedBatch(
        input_ids=torch.randint(cfg.vocab_size, (n,), generator=gen),
        loss_mask=torch.ones(n, dtype=torch.bool),
        aux_hidden=torch.randn(n, 3 * cfg.hidden_size, generator=gen).to(dtype),
        target_hidden=torch.randn(n, cfg.hidden_size, generator=gen).to(dtype),
        cu_seqlens=cu,
    ).to(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for it in range(a.warmup + a.iters):
        common.synchronize(device)
        t0 = time.perf_counter()
        step()
        common.synchronize(device)
        if it >= a.warmup:
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    flops = model_flops(cfg, draft_vocab, n, a.seq_len, a.steps)
    peak = matmul_tflops(device) if device.type == "cuda" else float("nan")
    achieved = flops / seconds / 1e12
    return Row(name, n, a.seq_len, a.steps, seconds * 1e3, n / seconds, flops / 1e12,
               achieved, peak, achieved / peak)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="smollm2,llama3-8b")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=7, help="TTT steps")
    p.add_argument("--attention", default="auto", choices=["auto", "flex", "reference"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    shapes = common.parse_str_list(a.shapes)
    if a.smoke:
        shapes, a.tokens, a.seq_len, a.steps, a.warmup, a.iters = ["tiny"], 64, 32, 3, 1, 2
    rows = []
    for name in shapes:
        rows.append(run_shape(name, a, device))
        print(rows[-1], flush=True)
    if a.json_path:
        Path(a.json_path).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print("| head | tokens/batch | ms/step | tokens/s | model TFLOP/s | matmul TFLOP/s | MFU |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.shape} | {r.tokens:,} | {r.ms:.1f} | {r.tokens_per_s:,.0f} | "
              f"{r.achieved_tflops:.1f} | {r.matmul_tflops:.0f} | "
              f"{r.utilisation:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
