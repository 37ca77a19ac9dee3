"""The bench report: dataclasses that are the JSON schema, and the Markdown table.

JSON (``SCHEMA``): ``{schema, command, git_commit, git_dirty, env, config, sets, rows,
traces, peers}``. ``sets`` keeps every prompt (id, messages, token count, plain greedy
output ids and text, and with ``--analysis`` the target's entropy per output position);
``rows`` hold one (set, speculation config, batch size) measurement each, with per-prompt
counters; ``traces`` (``--analysis``) every verify step of every prompt. Counters are
totals over the timed runs; τ and a_k are ratios of them, so they do not depend on the
number of repeats.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.measure import Timing

SCHEMA = "specdec.bench/1"


@dataclass
class PromptInfo:
    id: str
    messages: list[dict[str, str]]
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)  # plain greedy decoding
    output_text: str = ""
    target_entropy: list[float] | None = None  # nats per output position (lower bound)


@dataclass
class SetReport:
    name: str
    description: str
    source: str  # pip requirement or file
    prompts: list[PromptInfo]
    skipped_too_long: int = 0  # prompts passed over for exceeding max_prompt_tokens


@dataclass
class PromptRow:
    """One prompt within a row (engine ``RequestMetrics``, summed over the timed runs and
    over the prompt's requests when ``waves`` cycles the prompts)."""

    index: int  # into the set's prompts
    output_tokens: int
    steps: int
    drafted_tokens: int
    accepted_tokens: int
    tau: float | None  # None when the prompt never had a draft
    ttft_s: float | None  # median over timed runs, with speculation
    tpot_s: float | None


@dataclass
class BenchRow:
    """One (set, speculation config, batch size). Invariants: speedup =
    spec.tokens_per_s / plain.tokens_per_s; tau = (accepted + steps) / steps;
    tau_per_verified = (accepted + steps) / (steps + drafted): tokens emitted per token
    the target verified (each step's root and drafts), what drafters at one verify budget
    compare by;
    acceptance_rates[k-1] = accepted_at_least[k-1] / steps, non-increasing; per_prompt
    counters sum to the row's."""

    set: str
    label: str
    speculative: dict[str, Any]  # SpeculativeConfig fields
    shape: dict[str, Any]  # tree, depth, max_draft_tokens, top_k, total_tokens
    batch_size: int
    num_prompts: int
    max_tokens: int
    repeats: int
    num_requests: int = 0  # per run: the prompts cycled to waves x batch_size (BenchConfig)
    plain: Timing | None = None
    spec: Timing | None = None
    speedup: float | None = None
    tau: float | None = None
    tau_per_verified: float | None = None
    acceptance_rates: list[float] = field(default_factory=list)  # a_1, a_2, ... to depth
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at_least: list[int] = field(default_factory=list)
    identical: int = 0  # spec outputs equal to plain's, request by request, all runs
    compared: int = 0
    first_mismatch_at: int | None = None
    # Per distinct first divergence of a spec output from plain's: plain decoding's logprob
    # of its own token minus the spec token's there (passes.divergence_gaps; ~0: a near-tie).
    divergence_gaps: list[float] = field(default_factory=list)
    vocab_coverage: float | None = None  # None: the proposer has no draft vocabulary
    draft_vocab_size: int | None = None  # the head's draft vocabulary (ids in its t2d)
    pipelined_launches: int = 0  # pipelined speculative steps (spec/pipeline.py)
    per_prompt: list[PromptRow] = field(default_factory=list)
    note: str = ""


@dataclass
class TraceReport:
    """Every verify step per prompt: (output position, drafted, accepted)."""

    set: str
    label: str
    concurrency: int
    steps: list[list[tuple[int, int, int]]]  # [prompt][step]


@dataclass
class PeerRow:
    set: str
    peer: str
    batch_size: int
    timing: Timing
    identical: int = 0  # outputs equal to the engine's plain greedy outputs
    compared: int = 0
    note: str = ""


@dataclass
class Report:
    command: str
    git_commit: str | None
    git_dirty: bool | None
    config: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    sets: dict[str, SetReport] = field(default_factory=dict)
    rows: list[BenchRow] = field(default_factory=list)
    traces: list[TraceReport] = field(default_factory=list)
    peers: list[PeerRow] = field(default_factory=list)
    skipped_configs: list[str] = field(default_factory=list)
    schema: str = SCHEMA

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write_json(self, path: str | Path) -> None:
        """Written after every row, so a run cut short leaves its finished rows behind."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        tmp.replace(out)


# ---------------------------------------------------------------------------- Markdown


def _f(value: float | None, digits: int, scale: float = 1.0) -> str:
    return "" if value is None else f"{value * scale:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


PEER_NAMES = ("hf-generate", "hf-prompt-lookup", "hf-assisted")


def markdown(report: Report) -> str:
    """Header, one line per row; peer tokens/s (batch 1 only) as extra columns when any
    peer was measured."""
    peers = [p for p in PEER_NAMES if any(r.peer == p for r in report.peers)]
    peer_rate = {(r.set, r.peer): r.timing.tokens_per_s for r in report.peers}
    head = (
        "| set | proposer | batch | requests | in flight plain/spec, time at full batch "
        "| plain tok/s | spec tok/s "
        "| speedup | τ | τ / verified "
        "| accept a1/a2/... | drafted | accepted | TTFT ms plain/spec | TPOT ms plain/spec "
        "| identical | coverage "
    )
    head += "".join(f"| {p} tok/s " for p in peers) + "| note |"
    lines = [
        head,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines[-1] += "---:|" * len(peers) + "---|"
    for r in report.rows:
        plain, spec = r.plain, r.spec
        rates = "/".join(f"{a:.2f}" for a in r.acceptance_rates)
        ttft = f"{_f(plain and plain.ttft_s, 1, 1e3)}/{_f(spec and spec.ttft_s, 1, 1e3)}"
        tpot = f"{_f(plain and plain.tpot_s, 2, 1e3)}/{_f(spec and spec.tpot_s, 2, 1e3)}"
        flight = (
            f"{_f(plain and plain.mean_in_flight, 1)}/{_f(spec and spec.mean_in_flight, 1)}, "
            f"{_pct(plain and plain.full_batch_share)}/{_pct(spec and spec.full_batch_share)}"
        )
        same = f"{r.identical}/{r.compared}" if r.compared else ""
        coverage = "n/a" if r.vocab_coverage is None else f"{r.vocab_coverage:.3f}"
        cells = [
            r.set,
            r.label,
            str(r.batch_size),
            str(r.num_requests or r.num_prompts),
            flight,
            _f(plain and plain.tokens_per_s, 1),
            _f(spec and spec.tokens_per_s, 1),
            _f(r.speedup, 2),
            _f(r.tau, 2),
            _f(r.tau_per_verified, 3),
            rates,
            str(r.drafted_tokens),
            str(r.accepted_tokens),
            ttft,
            tpot,
            same,
            coverage,
            *(_f(peer_rate.get((r.set, p)), 1) if r.batch_size == 1 else "" for p in peers),
            r.note,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
