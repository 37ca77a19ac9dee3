"""Shared helpers for benchmark scripts: timing, result rows, tables, JSON, environment.

Timing invariant: every figure is the median over ``repeats`` timed runs that follow
``warmup`` untimed runs. On CUDA a run is timed with CUDA events recorded on the current
stream (so only the end of the timed region synchronises); elsewhere with
``time.perf_counter``. Times are in seconds unless a name says otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.bench.env import env_info, synchronize  # noqa: F401  (re-exported)

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


# ---------------------------------------------------------------------------- CLI helpers


def parse_int_list(text: str) -> list[int]:
    """Parse "1,8,64" into [1, 8, 64]; every value must be a positive integer."""
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def parse_str_list(text: str) -> list[str]:
    """Parse "eager,sdpa" into ["eager", "sdpa"]."""
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values:
        raise ValueError(f"expected a comma-separated list, got {text!r}")
    return values


def resolve_device(name: str | None) -> torch.device:
    """``None`` means cuda when available, else cpu."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} requested but torch.cuda.is_available() is False")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``None`` means bf16 on cuda and fp32 elsewhere."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def random_prompt_ids(
    batch_size: int, prompt_len: int, vocab_size: int, seed: int, device: torch.device
) -> torch.Tensor:  # [batch_size, prompt_len] int64
    """Random token ids from a fixed seed. Ids below 16 (special tokens in SmolLM2's
    vocabulary) are avoided so prompts look like text, never like padding or zeros."""
    low = 16 if vocab_size > 64 else 1
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(low, vocab_size, (batch_size, prompt_len), generator=gen)
    return ids.to(device)


# ---------------------------------------------------------------------------- timing


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds taken by ``fn()``, measured on the device's timeline on CUDA."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
    setup: Callable[[], object] | None = None,
) -> float:
    """Median seconds of ``repeats`` timed calls of ``fn`` after ``warmup`` untimed ones.

    ``setup`` (if given) runs before every call, outside the timed region, e.g. to reset
    a decode position.
    """
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    synchronize(device)
    times: list[float] = []
    for _ in range(repeats):
        if setup is not None:
            setup()
            synchronize(device)
        times.append(time_once(fn, device))
    return statistics.median(times)


# ---------------------------------------------------------------------------- results


@dataclass
class ResultRow:
    """One measured configuration. Token rates count every sequence in the batch."""

    bench: str
    variant: str
    batch_size: int
    prompt_len: int
    new_tokens: int
    ms_per_step: float | None = None  # one decode step: one new token for every sequence
    decode_tokens_per_s: float | None = None  # batch_size * steps / decode seconds
    prefill_tokens_per_s: float | None = None  # batch_size * prompt_len / prefill seconds
    note: str = ""


def _fmt(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def markdown_table(rows: list[ResultRow]) -> str:
    """A short Markdown table of the rows, in order."""
    header = (
        "| bench | variant | batch | prompt | new | ms/step | decode tok/s | prefill tok/s | note |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(
            f"| {r.bench} | {r.variant} | {r.batch_size} | {r.prompt_len} | {r.new_tokens} | "
            f"{_fmt(r.ms_per_step, 3)} | {_fmt(r.decode_tokens_per_s, 1)} | "
            f"{_fmt(r.prefill_tokens_per_s, 1)} | {r.note} |"
        )
    return "\n".join(lines)


def print_env(env: dict[str, str]) -> None:
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)


def write_json(
    path: str | Path, *, env: dict[str, str], options: object, rows: list[ResultRow]
) -> None:
    """Write {env, options, rows} as JSON. Called after every row so a run cut short by a
    time limit still leaves its finished figures behind."""
    options_dict = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else options
    payload = {
        "env": env,
        "options": options_dict,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def union_length(intervals) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once): a
    device's busy time from its kernels' intervals."""
    covered, last_end = 0.0, float("-inf")
    for start, end in sorted(intervals):
        covered += max(0.0, end - max(start, last_end))
        last_end = max(last_end, end)
    return covered


# ---------------------------------------------------------------------------- models


def make_random_tiny_model_dir(out_dir: str | Path, *, seed: int = 0, tied: bool = False) -> Path:
    """Save a tiny random Llama (HF format: config.json + model.safetensors) to ``out_dir``.

    Shapes keep every feature the peers must handle: GQA (4 query / 2 KV heads), a
    non-default rope_theta, and untied lm_head by default (the real SmolLM2 is tied, so
    running both covers both paths). Weights use a wider init than HF's default so greedy
    argmax is not decided by rounding noise.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
