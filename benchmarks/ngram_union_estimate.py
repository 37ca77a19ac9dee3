"""How much could a prompt-lookup (n-gram) branch beside the EAGLE-3 draft add to τ?

Runs the head (a chain of 3 or the t8-d5-n32 tree) on a prompt set in fp32, where
speculative output equals plain decoding, and records every verify step's position. At
each such position it then asks what the n-gram proposer (``specdec.spec.ngram``, K
tokens) would have drafted and how many of those tokens the final (= the target's greedy)
output accepts. Printed: τ of the head, τ of the n-gram proposer alone at the same
positions, and the *union* τ, where every step keeps the longer of the two accepted runs —
an upper bound for a tree that carries both drafts (the same positions, no cost counted).

    python benchmarks/ngram_union_estimate.py --prompts .gpu/bench_sets/writingbench.jsonl \
        --shape chain3 --num-prompts 8 --max-tokens 128 --ngram-k 3

Session 28 (CPU, the session-27 head, writingbench's first 8 prompts, 128 tokens): chain of
3, τ 2.29, n-gram alone 1.65, union 2.52 (the n-gram run was longer at 11% of steps).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np

from specdec import LLM, SamplingParams
from specdec.bench.runner import encode
from specdec.bench.sets.jsonl import read_prompt_file
from specdec.config import SpeculativeConfig
from specdec.spec.ngram import NgramConfig, ngram_propose

SHAPES = {
    "chain3": {"tree": "chain", "num_speculative_tokens": 3},
    "tree": {"tree": "dynamic", "num_speculative_tokens": 5, "top_k": 8, "total_tokens": 32},
}


def accepted_run(draft: np.ndarray, tokens: np.ndarray, start: int) -> int:
    """Leading draft tokens that equal ``tokens[start:]``."""
    n = 0
    while n < len(draft) and start + n < len(tokens) and tokens[start + n] == draft[n]:
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", required=True, help="a bench-set JSONL (prompt or messages)")
    p.add_argument("--head", default="specdec/heads/smollm2-135m-instruct")
    p.add_argument("--shape", choices=sorted(SHAPES), default="chain3")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ngram-k", type=int, default=3, help="n-gram draft length")
    args = p.parse_args()

    spec = SpeculativeConfig(method="eagle3", model=args.head, **SHAPES[args.shape])
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", speculative=spec)
    convs = itertools.islice(read_prompt_file(Path(args.prompts)), args.num_prompts)
    prompts = [encode(llm, list(conv.messages)) for conv in convs]
    positions: dict[str, list[int]] = {}  # request -> its length at every verify step
    propose = llm.engine.proposer.propose

    def recording(requests, max_draft_tokens, shape):
        for r in requests:
            positions.setdefault(r.request_id, []).append(len(r.all_token_ids))
        return propose(requests, max_draft_tokens, shape)

    llm.engine.proposer.propose = recording
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)

    ngram = NgramConfig(args.ngram_k, spec.ngram_min, spec.ngram_max)  # the proposer's sizes
    steps = head = alone = union = longer = 0
    for out in outs:
        tokens = np.array([*out.prompt_token_ids, *out.outputs[0].token_ids])
        starts = sorted(positions.get(out.request_id, []))
        for start, end in zip(starts, [*starts[1:], len(tokens)], strict=True):
            emitted = end - start  # the head's accepted run + the bonus token
            lookup = 1 + accepted_run(ngram_propose(tokens[:start], ngram), tokens, start)
            lookup = min(lookup, len(tokens) - start)
            steps += 1
            head += emitted
            alone += lookup
            union += max(emitted, lookup)
            longer += lookup > emitted
    print(
        f"{args.prompts} {args.shape}, n-gram K={args.ngram_k}: {steps} steps; τ head "
        f"{head / steps:.2f}, n-gram alone {alone / steps:.2f}, union {union / steps:.2f} "
        f"(n-gram longer at {longer / steps:.0%} of steps)"
    )


if __name__ == "__main__":
    main()
