"""When each request of a burst of chat arrivals has its prompt ids, per encoder shape.

The API process renders a chat's template on its event loop and encodes the text off it
(``serve/prompt_encoder.py``: ``workers`` threads, each encoding up to ``max_batch``
queued texts per call). This script replays what the server does for a burst of
``--burst`` chats arriving at once (a wave of clients whose requests finished together):
each arrival's template rendered on the loop, then ``encoder.encode``; it records when
each request's ids are ready, from the burst's start. A request reaches the engine core at
that time, so the mean is what the burst adds to time to first token, and early
arrivals ready early let the engine start prefilling them while the rest encode.

For each ``--shapes`` entry WORKERSxMAX_BATCH it prints the ready time's mean, p50 and
max (ms, median over ``--repeats`` bursts), beside two floors measured in the same run:
every text encoded one after another on one thread, and the whole burst in one batch call.

    python benchmarks/serve_prompt_encoding.py --prompts writingbench100.jsonl \
        --burst 64 --shapes 1x256,1x16,2x16,4x16,4x4,8x4,8x1 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import measure
from transformers import AutoTokenizer

from specdec.models.loader import load_tokenizer
from specdec.serve.prompt_encoder import PromptEncoder, encode_texts


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            workers, batch = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: {part!r} is not WORKERSxMAX_BATCH (e.g. 4x16)") from None
        shapes.append((workers, batch))
    return shapes


def render(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


async def one_burst(encoder: PromptEncoder, tokenizer, chats) -> list[float]:
    """Seconds from the burst's start until each request's ids are ready."""
    ready = [0.0] * len(chats)
    start = time.perf_counter()

    async def request(i: int, messages) -> None:
        text = render(tokenizer, messages)  # on the loop, as the chat handler does
        await encoder.encode(text)
        ready[i] = time.perf_counter() - start

    await asyncio.gather(*(request(i, m) for i, m in enumerate(chats)))
    return ready


def summary(readies: list[list[float]]) -> dict[str, float]:
    """Median over bursts of each burst's mean, p50 and max ready time, in ms."""

    def med(stat):
        return statistics.median(stat(r) for r in readies) * 1e3

    return {
        "mean_ms": med(statistics.mean),
        "p50_ms": med(statistics.median),
        "max_ms": med(max),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="its tokenizer is used; a directory holding only tokenizer files works too",
    )
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL with 'messages'")
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--shapes", default="1x256,1x16,2x16,4x16,4x4,8x4,8x1")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    def tokenizer_of(model: str):
        if Path(model).is_dir() and not list(Path(model).glob("*.safetensors")):
            return AutoTokenizer.from_pretrained(model)
        return load_tokenizer(model)

    tokenizer = tokenizer_of(args.model)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    if len(rows) < args.burst:
        raise SystemExit(f"--prompts has {len(rows)} chats; --burst {args.burst} needs as many")
    chats = [r["messages"] for r in rows[: args.burst]]
    texts = [render(tokenizer, m) for m in chats]
    worker = tokenizer_of(args.model)
    tokens = sum(len(ids) for ids in encode_texts(worker, texts))

    def timed(fn) -> float:
        return 1e3 * measure(fn, torch.device("cpu"), warmup=1, repeats=args.repeats)

    results = {
        "burst": args.burst,
        "prompt_tokens": tokens,
        "cpus": os.cpu_count(),
        "one_thread_each_ms": timed(lambda: [encode_texts(worker, [t]) for t in texts]),
        "one_batch_call_ms": timed(lambda: encode_texts(worker, texts)),
        "render_all_ms": timed(lambda: [render(tokenizer, m) for m in chats]),
        "shapes": {},
    }
    for workers, batch in parse_shapes(args.shapes):

        async def bursts(workers=workers, batch=batch) -> list[list[float]]:
            encoder = PromptEncoder(tokenizer, workers=workers, max_batch=batch)
            await one_burst(encoder, tokenizer, chats)  # warm-up: threads, copies
            return [await one_burst(encoder, tokenizer, chats) for _ in range(args.repeats)]

        results["shapes"][f"{workers}x{batch}"] = summary(asyncio.run(bursts()))

    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(
        f"\n{args.burst} chats, {tokens} prompt tokens, {results['cpus']} CPUs: render all "
        f"{results['render_all_ms']:.1f} ms on the loop; encode one after another "
        f"{results['one_thread_each_ms']:.1f} ms, in one batch call "
        f"{results['one_batch_call_ms']:.1f} ms"
    )
    print("| workers x max_batch | ids ready: mean ms | p50 | max |")
    print("|---|---:|---:|---:|")
    for shape, s in results["shapes"].items():
        print(f"| {shape} | {s['mean_ms']:.1f} | {s['p50_ms']:.1f} | {s['max_ms']:.1f} |")


if __name__ == "__main__":
    main()
