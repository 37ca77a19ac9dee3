"""Speculative decoding through the specdec engine, against plain decoding measured in the
same run: the variants below on chat prompts, for checking the machinery on the GPU.
``specdec bench`` (``specdec.bench``, which this script is a thin front end of) is the
product version: benchmark sets, sweeps, per-prompt figures, peers.

For each variant (``plain``, or a ``SpeculativeConfig``) one ``LLM`` is built, and for each
batch size ``batch`` chat prompts (``tests/prompts.py``'s ``varied_conversations``, or
``--prompts FILE.jsonl``, rendered with the tokenizer's chat template; batch b takes the
first b, cycling if fewer) are submitted together, greedy, EOS ignored, final-only outputs
(as ``LLM.generate`` runs them). The timed region is the whole generation, from
submitting the first request to the last one finishing: prefill included, so tokens/s =
batch x max_tokens / seconds is what a user of the engine gets.

The plain engine lives for the whole run. Per (variant, batch): one untimed warm-up
generation (max_tokens 16) of each, then ``--repeats`` rounds that each time the variant
and plain decoding, interleaved (``specdec.bench.measure``); tokens/s are medians.
speedup = the variant's tokens/s / the tokens/s of the plain runs interleaved with it
(``plain_tokens_per_s`` in the JSON); the ``plain`` rows report every plain run at that
batch size. Prefix caching is off, so repeats redo the prefill.

Speculation counters come from ``engine.spec_stats`` (reset before each timed run, merged
over the timed runs). A step is one verification of one request's draft: τ = tokens
emitted per step, bonus included; a_k = fraction of steps accepting at least k draft
tokens. Steps where the proposer has no draft (an n-gram without a match) decode plainly
and are not counted. "steps" is verify steps per timed run, summed over requests.

Losslessness: every timed run's greedy output ids are compared with plain decoding's
(the first plain run interleaved with it); "identical" is the fraction of requests whose
outputs are equal token for token (MISMATCH flags a variant below 100%). In fp32 they must
all be equal; in bf16, batching the target's tokens differently may rarely flip an argmax.

Variants: ``ngram-k3``/``-k5`` (prompt lookup, chains of 3/5); ``oracle-k3``/``-k5``
(draft_model = the target itself: every draft token is accepted, so τ = K+1 except where
max_tokens truncates a request's last step; "τ exp" is that exact figure);
``oracle-tree`` (the target drafting an EAGLE-2 dynamic tree, top_k 8, depth 5, 64 nodes;
its greedy path can be pruned from the tree, so τ may fall short of "τ exp");
``eagle3-k3``/``-k5``/``-tree`` (the EAGLE-3 head ``--head DIR``, same tree). With
``--head random`` a randomly initialised head for the target is built first (as the
engine tests do): it measures the cost of drafting and verifying with a real head's
shape, but its drafts are almost always rejected (τ ~ 1), so its speedup is a floor, not
EAGLE-3's. Likewise, acceptance figures need the target's real weights: on a model with
random weights only the oracle's τ and the timings mean anything.

    python benchmarks/bench_spec.py --head specdec/heads/smollm2-135m-instruct \\
        --variants plain,eagle3-k3,eagle3-tree,oracle-k3 --batch-sizes 1,16 --json out/spec.json
    python benchmarks/bench_spec.py --smoke                                      # CPU check

Prints a table last: tokens/s, speedup, τ, a_k, steps and "identical" per (variant, batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import common
from prompts import varied_conversations

from specdec import LLM
from specdec.bench.driver import Run, RunParams
from specdec.bench.env import env_info, git_commit
from specdec.bench.measure import Agreement, Timing, measure_engines, merged_stats
from specdec.bench.runner import build_llm as build_bench_llm
from specdec.bench.runner import encode
from specdec.bench.sets.jsonl import read_prompt_file
from specdec.config import SpeculativeConfig

_TREE = {"tree": "dynamic", "top_k": 8, "num_speculative_tokens": 5, "total_tokens": 64}
# name -> (method, SpeculativeConfig keywords other than method/model); plain is None.
VARIANTS: dict[str, tuple[str, dict[str, Any]] | None] = {
    "plain": None,
    "ngram-k3": ("ngram", {"num_speculative_tokens": 3}),
    "ngram-k5": ("ngram", {"num_speculative_tokens": 5}),
    "oracle-k3": ("draft_model", {"num_speculative_tokens": 3}),
    "oracle-k5": ("draft_model", {"num_speculative_tokens": 5}),
    "oracle-tree": ("draft_model", _TREE),
    "eagle3-k3": ("eagle3", {"num_speculative_tokens": 3}),
    "eagle3-k5": ("eagle3", {"num_speculative_tokens": 5}),
    "eagle3-tree": ("eagle3", _TREE),
}


@dataclass
class Options:
    model: str
    variants: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    max_tokens: int
    repeats: int
    head: str | None
    prompts_path: str | None
    kv_cache_memory: int | None
    max_model_len: int
    device: str
    dtype: str
    attention_backend: str
    enforce_eager: bool
    json_path: str | None


@dataclass
class SpecRow:
    """One (variant, batch) measurement. Rates count every request in the batch."""

    variant: str
    batch_size: int
    max_tokens: int
    prompt_tokens: int  # of the whole batch
    seconds: float | None = None  # median whole generation
    tokens_per_s: float | None = None
    speedup: float | None = None  # vs the plain runs interleaved with it
    plain_tokens_per_s: float | None = None  # those plain runs
    tau: float | None = None  # None for plain
    tau_expected: float | None = None  # oracle variants: τ if every draft is accepted
    acceptance_rates: list[float] = field(default_factory=list)
    spec_steps: float = 0.0  # verify steps per timed run, all requests
    drafted_tokens: float = 0.0  # per timed run
    accepted_tokens: float = 0.0  # per timed run
    engine_steps: float = 0.0  # engine.step() calls per timed run
    graph_steps: float = 0.0  # of those, target forwards replayed from a CUDA graph
    draft_graph_steps: float = 0.0  # proposals replayed from the proposer's CUDA graphs
    identical: int = 0  # requests (over all timed runs) equal to plain's output
    compared: int = 0
    first_mismatch_at: int | None = None  # smallest output index where one differs
    all_seconds: list[float] = field(default_factory=list)
    note: str = ""


# ---------------------------------------------------------------------------- measuring


def expected_oracle_tau(max_tokens: int, depth: int) -> float:
    """τ when every draft is accepted: the first token comes from prefill, then steps of
    depth + 1 tokens; the last step drafts only what max_tokens leaves (none when a single
    token is left, which then decodes plainly and is no verify step)."""
    left = max_tokens - 1
    full, rest = divmod(left, depth + 1)
    if rest == 0:
        return float(depth + 1) if full else 0.0
    if rest == 1:
        return (left - 1) / full if full else 0.0
    return left / (full + 1)


def make_row(
    variant: str,
    prompts: list[list[int]],
    runs: list[Run],
    plain_runs: list[Run],
    opts: Options,
    spec: SpeculativeConfig | None,
) -> SpecRow:
    """The row of ``runs`` (the variant's), against the plain runs interleaved with them."""
    timing, plain = Timing.of(runs), Timing.of(plain_runs)
    stats = merged_stats(runs)
    agreement = Agreement.of(runs, plain_runs[0].token_ids)
    row = SpecRow(
        variant=variant,
        batch_size=len(prompts),
        max_tokens=opts.max_tokens,
        prompt_tokens=sum(len(p) for p in prompts),
        seconds=statistics.median(timing.seconds),
        tokens_per_s=timing.tokens_per_s,
        speedup=timing.tokens_per_s / plain.tokens_per_s,
        plain_tokens_per_s=plain.tokens_per_s,
        engine_steps=timing.engine_steps,
        graph_steps=timing.graph_steps,
        draft_graph_steps=timing.draft_graph_steps,
        spec_steps=stats.steps / len(runs),
        drafted_tokens=stats.drafted_tokens / len(runs),
        accepted_tokens=stats.accepted_tokens / len(runs),
        identical=agreement.identical,
        compared=agreement.compared,
        first_mismatch_at=agreement.first_mismatch_at,
        all_seconds=timing.seconds,
    )
    if spec is not None:
        row.tau = stats.tau
        rates = stats.acceptance_rates  # up to the deepest acceptance: pad to the depth
        row.acceptance_rates = rates + [0.0] * (spec.tree_shape.depth - len(rates))
        if spec.method == "draft_model" and spec.model == opts.model:
            row.tau_expected = expected_oracle_tau(opts.max_tokens, spec.tree_shape.depth)
            if spec.tree == "chain" and not math.isclose(row.tau, row.tau_expected):
                row.note = "τ below the oracle's"
    row.note = "; ".join(x for x in (row.note, agreement.note) if x)
    return row


# ---------------------------------------------------------------------------- variants


def speculative_config(variant: str, opts: Options) -> SpeculativeConfig | None:
    entry = VARIANTS[variant]
    if entry is None:
        return None
    method, kwargs = entry
    model = {"draft_model": opts.model, "eagle3": opts.head}.get(method)
    return SpeculativeConfig(method=method, model=model, **kwargs)


def build_llm(opts: Options, spec: SpeculativeConfig | None) -> LLM:
    engine = dict(
        device=opts.device,
        dtype=opts.dtype,
        attention_backend=opts.attention_backend,
        enforce_eager=opts.enforce_eager,
        kv_cache_memory=opts.kv_cache_memory,
        max_model_len=opts.max_model_len,
    )
    return build_bench_llm(opts.model, engine, spec, max(opts.batch_sizes))


def chat_prompts(llm: LLM, opts: Options) -> list[list[int]]:
    """Token ids of the prompt pool, rendered with the chat template when there is one."""
    if opts.prompts_path:
        convs = [list(c.messages) for c in read_prompt_file(Path(opts.prompts_path))]
        if not convs:
            raise ValueError(f"{opts.prompts_path} holds no prompts")
    else:
        convs = varied_conversations(max(opts.batch_sizes))
    return [encode(llm, c) for c in convs]


def random_head(
    model: str, out_dir: Path, draft_vocab: int = 4096, aux_layer_ids: list[int] | None = None
) -> Path:
    """A randomly initialised EAGLE-3 head for ``model`` (a 4,096-token draft vocabulary
    and EAGLE-3's aux layers unless given), built as tests/engine/test_engine.py's
    ``random_head_dir`` fixture builds it."""
    from specdec.attention import get_attention_backend
    from specdec.models import load_config
    from specdec.models.eagle3_formats import save_eagle3
    from specdec.models.eagle3_head import Eagle3Config, Eagle3Head

    torch.manual_seed(0)
    config = Eagle3Config.for_target(load_config(model), draft_vocab, aux_layer_ids=aux_layer_ids)
    head = Eagle3Head(config, get_attention_backend("torch"))
    with torch.no_grad():  # keep fc(aux) O(1) against a ~1e4 residual stream
        head.fc.weight.mul_(1e-3)
    return save_eagle3(head, out_dir / "random_eagle3_head")


def run_variant(
    opts: Options,
    variant: str,
    plain: LLM,
    pool: list[list[int]],
    plain_runs: dict[int, list[Run]],
) -> list[SpecRow]:
    spec = speculative_config(variant, opts)
    llm = build_llm(opts, spec)
    rows = []
    for batch in opts.batch_sizes:
        prompts = [pool[i % len(pool)] for i in range(batch)]
        run = RunParams(opts.max_tokens, ignore_eos=True)
        runs = measure_engines({"plain": plain, variant: llm}, prompts, run, opts.repeats, 1)
        plain_runs[batch] += runs["plain"]
        rows.append(make_row(variant, prompts, runs[variant], runs["plain"], opts, spec))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def run(opts: Options) -> list[SpecRow]:
    rows: list[SpecRow] = []
    with tempfile.TemporaryDirectory(prefix="bench_spec_") as tmp:
        if opts.head == "random":
            opts.head = str(random_head(opts.model, Path(tmp)))
            print(f"random EAGLE-3 head (τ ~ 1 expected) in {opts.head}", flush=True)
        plain = build_llm(opts, None)
        runtime = plain.engine.runner.runtime
        env = env_info(runtime.device, runtime.dtype)
        pool = chat_prompts(plain, opts)
        lens = sorted(len(p) for p in pool)
        print(
            f"prompts: {len(pool)}, tokens min {lens[0]} / median "
            f"{statistics.median(lens):.0f} / max {lens[-1]}",
            flush=True,
        )
        print(table([]), flush=True)
        plain_runs: dict[int, list[Run]] = {b: [] for b in opts.batch_sizes}
        for variant in opts.variants[1:]:
            try:
                rows += run_variant(opts, variant, plain, pool, plain_runs)
            except Exception as e:  # report and go on: one broken variant must not hide the rest
                traceback.print_exc()
                print(f"variant {variant} FAILED: {type(e).__name__}: {e}"[:2000], flush=True)
                rows.append(SpecRow(variant, 0, opts.max_tokens, 0, note=f"FAILED: {e}"[:200]))
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if opts.json_path:
                write_json(opts.json_path, env, opts, rows)
        plain_rows = []
        for batch in opts.batch_sizes:
            prompts = [pool[i % len(pool)] for i in range(batch)]
            runs = (
                plain_runs[batch]
                or measure_engines(
                    {"plain": plain},
                    prompts,
                    RunParams(opts.max_tokens, ignore_eos=True),
                    opts.repeats,
                    1,
                )["plain"]
            )
            plain_rows.append(make_row("plain", prompts, runs, runs, opts, None))
        rows = plain_rows + rows
    if opts.json_path:
        write_json(opts.json_path, env, opts, rows)
    print()
    print(table(rows))
    common.print_env(env)
    return rows


# ---------------------------------------------------------------------------- reporting


def _f(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def table(rows: list[SpecRow]) -> str:
    """Markdown: the header, then one line per row."""
    lines = [
        "| variant | batch | tok/s | speedup | τ | τ exp | accept a1/a2/... | steps | "
        "graphed (target, draft) | identical | note |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        rates = "/".join(f"{a:.2f}" for a in r.acceptance_rates)
        same = f"{r.identical}/{r.compared}" if r.compared else ""
        lines.append(
            f"| {r.variant} | {r.batch_size} | {_f(r.tokens_per_s, 1)} | "
            f"{_f(r.speedup, 2)} | {_f(r.tau, 2)} | {_f(r.tau_expected, 2)} | {rates} | "
            f"{r.spec_steps:g} | {r.graph_steps:g}/{r.engine_steps:g}, {r.draft_graph_steps:g} | "
            f"{same} | {r.note} |"
        )
    return "\n".join(lines)


def write_json(path: str, env: dict[str, str], opts: Options, rows: list[SpecRow]) -> None:
    """{env, git_commit, options, rows}; written after every variant so a run cut short
    still leaves its finished figures behind."""
    payload = {
        "env": env,
        "git_commit": git_commit(),
        "options": dataclasses.asdict(opts),
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n")


# ---------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated, from {list(VARIANTS)}; default all that apply (eagle3-* "
        "only with --head); plain is always measured",
    )
    p.add_argument("--head", help="EAGLE-3 head directory, or 'random' to build one")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--prompts", dest="prompts_path", help='JSONL file of {"prompt": ...} or {"messages": ...}'
    )
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes; default 4 GiB on CUDA")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run to check the script")
    a = p.parse_args(argv)
    if a.smoke:
        a.variants, a.batch_sizes, a.max_tokens, a.repeats = (
            "plain,ngram-k3,oracle-k3,eagle3-k3",
            "1,2",
            8,
            1,
        )
        a.head, a.device, a.kv_cache_memory = "random", "cpu", 128 << 20
    on_gpu = torch.cuda.is_available() and a.device in ("auto", "cuda")
    if a.kv_cache_memory is None and on_gpu:
        a.kv_cache_memory = 4 << 30
    if a.variants is None:
        variants = [v for v in VARIANTS if a.head or not v.startswith("eagle3")]
    else:
        variants = ["plain", *(v for v in common.parse_str_list(a.variants) if v != "plain")]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    if not a.head and any(v.startswith("eagle3") for v in variants):
        p.error("eagle3 variants need --head DIR (or --head random)")
    if a.max_tokens < 1 or a.repeats < 1:
        p.error("--max-tokens and --repeats must be positive")
    return Options(
        model=a.model,
        variants=tuple(dict.fromkeys(variants)),
        batch_sizes=tuple(common.parse_int_list(a.batch_sizes)),
        max_tokens=a.max_tokens,
        repeats=a.repeats,
        head=a.head,
        prompts_path=a.prompts_path,
        kv_cache_memory=a.kv_cache_memory,
        max_model_len=a.max_model_len,
        device=a.device,
        dtype=a.dtype,
        attention_backend=a.attention_backend,
        enforce_eager=a.enforce_eager,
        json_path=a.json_path,
    )


if __name__ == "__main__":
    run(parse_args())
