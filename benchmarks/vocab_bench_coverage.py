"""Which draft vocabulary covers the bench sets' answers: the share of each set's plain
greedy output tokens inside each vocabulary's ``t2d``, and the tokens most often left out;
from a bench run with ``--analysis`` (fp32), also how many verify steps stopped at a token
the vocabulary lacks and the τ those steps could have added (``cut_steps``).

A token outside the draft vocabulary can never be drafted, so a step meeting one accepts
nothing past it. This is the bench-side check of a vocabulary built by ``data-gen vocab``
(its own metadata reports the coverage of the training answers), before any training:

    specdec bench ... --json bench.json        # plain outputs; --analysis (fp32) for cut_steps
    python benchmarks/vocab_bench_coverage.py --bench bench.json \\
        --vocab specdec/heads/smollm2-135m-instruct --vocab data/smollm2/vocab/vocab.safetensors

Prints, per vocabulary and set, the coverage and the most frequent misses (``--top``), the
cut steps of each traced run, then a table of coverage per vocabulary and set.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.bench.passes import vocab_coverage
from specdec.models.loader import load_tokenizer


def load_t2d(path: str | Path) -> torch.Tensor:
    """[target vocab] bool: a ``vocab.safetensors`` file, or a head directory whose shards
    hold ``t2d``."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    for file in files:
        with safe_open(file, "pt") as f:
            if "t2d" in f.keys():  # noqa: SIM118  (safe_open has no __contains__)
                return f.get_tensor("t2d").bool()
    raise ValueError(f"no t2d tensor in {path}: pass a vocab.safetensors or a head directory")


def outputs_by_set(report: dict) -> dict[str, list[list[int]]]:
    """Each set's plain greedy output ids from a ``specdec bench`` report."""
    return {name: [p["output_ids"] for p in s["prompts"]] for name, s in report["sets"].items()}


def cut_steps(
    traces: list[list[list[int]]], outputs: list[list[int]], t2d: torch.Tensor
) -> tuple[int, int, float]:
    """From a bench's ``--analysis`` traces (per prompt, per verify step: output position
    of the step's first token, drafted, accepted), in fp32 where outputs equal plain
    decoding: (steps, steps whose first rejected draft was meant for a token outside
    ``t2d``, the accepted tokens those steps could add). The estimate gives each such step
    the chain of conditional acceptance rates measured at in-vocabulary rejections' depths:
    rate ``j`` = P(draft ``j`` accepted | drafts before it accepted, its token in ``t2d``)."""
    reached: collections.Counter = collections.Counter()  # depth -> in-vocabulary tries
    passed: collections.Counter = collections.Counter()  # depth -> accepted
    cuts: list[tuple[int, int]] = []  # (accepted, drafted) of out-of-vocabulary cuts
    steps = 0
    for prompt, out in zip(traces, outputs, strict=True):
        for position, drafted, accepted in prompt:
            steps += 1
            for j in range(min(accepted + 1, drafted)):
                at = position + j
                if at >= len(out) or not t2d[out[at]]:
                    break
                reached[j] += 1
                passed[j] += j < accepted
            miss = position + accepted
            if accepted < drafted and miss < len(out) and not t2d[out[miss]]:
                cuts.append((accepted, drafted))
    rate = {j: passed[j] / reached[j] for j in reached}
    extra = 0.0
    for accepted, drafted in cuts:
        chain = 1.0
        for j in range(accepted, drafted):
            chain *= rate.get(j, 0.0)
            extra += chain
    return steps, len(cuts), extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bench", required=True, help="a specdec bench JSON (its plain outputs)")
    p.add_argument("--vocab", action="append", required=True, help="vocab file or head dir")
    p.add_argument("--model", default="smollm2-135m-instruct", help="tokenizer for the misses")
    p.add_argument("--top", type=int, default=12, help="most frequent misses shown per set")
    a = p.parse_args()
    tokenizer = load_tokenizer(a.model)
    report = json.loads(Path(a.bench).read_text())
    sets = outputs_by_set(report)
    traces = report["traces"]  # empty without --analysis
    rows = []
    for vocab in a.vocab:
        t2d = load_t2d(vocab)
        print(f"## {vocab} ({int(t2d.sum()):,} ids)")
        cells = []
        for name, outputs in sets.items():
            ids = [i for out in outputs for i in out]
            missed = collections.Counter(i for i in ids if not t2d[i])
            share = vocab_coverage(t2d, outputs)  # what the bench's coverage column reports
            cells.append(f"{share:.3f}")
            top = ", ".join(f"{tokenizer.decode([i])!r} {n}" for i, n in missed.most_common(a.top))
            print(f"- {name}: {share:.3f} of {len(ids):,} tokens; missed: {top}")
        rows.append(f"| {vocab} | {int(t2d.sum()):,} | " + " | ".join(cells) + " |")
        for trace in traces:
            outputs = sets[trace["set"]]
            steps, cut, extra = cut_steps(trace["steps"], outputs, t2d)
            accepted = sum(n for prompt in trace["steps"] for _, _, n in prompt)
            tau = 1 + accepted / steps
            print(
                f"- {trace['set']} {trace['label']}: {cut} of {steps} steps stopped at a token "
                f"outside the vocabulary; τ {tau:.2f}, {tau + extra / steps:.2f} had each of "
                "them gone on at the measured rates"
            )
    print("\n| vocabulary | ids | " + " | ".join(sets) + " |")
    print("|---|---:|" + "---:|" * len(sets))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
