"""SFT throughput of the reasoning-target recipe: tokens/s of one full fine-tuning step.

One optimizer step of ``specdec train-sft``'s objective (``train.sft.SFTModel``: the
serving ``CausalLM`` through packed attention, cross-entropy on assistant tokens, AdamW,
bf16 autocast as accelerate runs it) on a random-weight model shaped like SmolLM2-135M,
over a packed micro-batch of random sequences whose last ``--answer-frac`` of tokens carry
labels (traces: ~75%). ``--check`` first compares every packed-attention implementation
with ``sdpa`` on one batch (loss and gradients), so a broken ``varlen`` shows up here.

    python benchmarks/bench_sft.py --check --json out/sft.json     # on the H200
    python benchmarks/bench_sft.py --smoke                           # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from specdec.models import ModelConfig
from specdec.models.llama import CausalLM
from specdec.train.packed_attention import PACKED_ATTENTION, packed_attention
from specdec.train.sft import SFTModel, param_groups
from specdec.train.sft_data import assemble

SHAPES = {
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        num_hidden_layers=30,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    ),
}


@dataclass
class Row:
    shape: str
    attention: str
    tokens: int  # per micro-batch
    seq_len: int
    ms: float  # median per optimizer step
    tokens_per_s: float
    peak_gib: float


def build(shape: str, attention: str, device: torch.device, seed: int = 0) -> SFTModel:
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e5,
        "max_position_embeddings": 8192,
        **SHAPES[shape],
    }
    torch.manual_seed(seed)
    lm = CausalLM(ModelConfig.from_hf(hf), packed_attention(attention, device))
    for p in lm.parameters():  # SmolLM2-like scale; the default init is for nothing here
        torch.nn.init.normal_(p, std=0.02) if p.ndim > 1 else torch.nn.init.ones_(p)
    return SFTModel(lm.to(device).train())


def batch(vocab: int, tokens: int, seq_len: int, answer_frac: float, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(max(1, tokens // seq_len)):
        ids = torch.randint(vocab, (seq_len,), generator=gen).numpy()
        mask = (torch.arange(seq_len) >= int(seq_len * (1 - answer_frac))).to(torch.uint8)
        seqs.append((ids, mask.numpy()))
    return assemble(seqs).to(device)


def check(a: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Max |difference| of loss and gradients between each implementation and sdpa."""
    data = batch(
        SHAPES[a.shape]["vocab_size"], min(a.tokens, 8192), a.seq_len, a.answer_frac, device
    )
    grads, losses = {}, {}
    for name in PACKED_ATTENTION:
        try:
            model = build(a.shape, name, device)
        except ValueError:  # not available on this device
            continue
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(data)
        out.loss.backward()
        losses[name] = out.loss.item()
        grads[name] = torch.cat([p.grad.flatten().float() for p in model.parameters()])
    diffs = {}
    for name in grads:
        scale = grads["sdpa"].abs().max().item()
        diffs[f"{name}_loss_diff"] = abs(losses[name] - losses["sdpa"])
        diffs[f"{name}_grad_rel_diff"] = (grads[name] - grads["sdpa"]).abs().max().item() / scale
    return diffs


def run(a: argparse.Namespace, attention: str, device: torch.device) -> Row:
    model = build(a.shape, attention, device)
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4, fused=device.type == "cuda")
    data = batch(SHAPES[a.shape]["vocab_size"], a.tokens, a.seq_len, a.answer_frac, device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(data)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = common.measure(step, device, warmup=a.warmup, repeats=a.repeats)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return Row(
        a.shape,
        attention,
        data.num_tokens,
        a.seq_len,
        seconds * 1e3,
        data.num_tokens / seconds,
        peak,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--attention", type=common.parse_str_list, default=["auto", "sdpa"])
    p.add_argument("--tokens", type=int, default=32768, help="per micro-batch")
    p.add_argument("--seq-len", type=int, default=340, help="tokens per packed sequence")
    p.add_argument("--answer-frac", type=float, default=0.75, help="labelled share of a sequence")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check", action="store_true", help="compare implementations first")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    p.add_argument("--json")
    a = p.parse_args()
    if a.smoke:
        a.shape, a.tokens, a.seq_len, a.warmup, a.repeats = "tiny", 512, 64, 1, 1
    device = common.resolve_device(None)
    result: dict = {"env": common.env_info(device, torch.bfloat16)}
    if a.check:
        result["check"] = check(a, device)
        print(json.dumps(result["check"], indent=1))
    rows = [run(a, name, device) for name in a.attention]
    for r in rows:
        print(
            f"{r.shape} {r.attention}: {r.tokens} tokens/step in {r.ms:.1f} ms = "
            f"{r.tokens_per_s:,.0f} tokens/s, peak {r.peak_gib:.1f} GiB"
        )
    result["rows"] = [asdict(r) for r in rows]
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
