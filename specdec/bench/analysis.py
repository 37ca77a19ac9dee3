"""Pure functions over a bench report (the JSON ``specdec bench --json`` writes), for the
acceptance-rate notebooks in notebooks/: they load a report, call these, and plot.

``load_report`` also reads a ``specdec bench-serve --json`` report of a running server —
specdec's own or vLLM's — and presents it in the same form: one set ("served"), one
config (the server's source and model), τ and a_k from the server's counters over the
run. A server reports no per-prompt figures or step traces, so only the acceptance
notebook's τ and a_k figures apply to it.

Nothing here runs a model; every function takes the report as a dict (``load_report``)
so a notebook can read a report from another machine.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from specdec.bench.report import SCHEMA

Report = dict[str, Any]


SERVED_SET = "served"


def load_report(path: str | Path) -> Report:
    """A bench JSON report, or a bench-serve report in the same form (``from_serve_report``);
    raises when the file is neither."""
    from specdec.serve.bench import SERVE_SCHEMA

    report = json.loads(Path(path).read_text())
    schema = report.get("schema")
    if schema == SERVE_SCHEMA:
        return from_serve_report(report, path)
    if schema != SCHEMA:
        raise ValueError(
            f"{path} is not a {SCHEMA} or {SERVE_SCHEMA} report (schema {schema!r}); write "
            "one with: specdec bench --json PATH, or specdec bench-serve --url URL --json PATH"
        )
    return report


def from_serve_report(serve: Report, path: str | Path = "<report>") -> Report:
    """A bench-serve report as a bench report: set ``SERVED_SET``, one row labelled
    "<metrics source>: <model>" at the run's concurrency, with the server's τ and a_k.
    Raises when the server exposed no speculation counters (nothing to analyse)."""
    spec = serve.get("speculation")
    if not spec:
        raise ValueError(
            f"{path}: the server reported no speculation counters over the run (plain "
            "decoding, or a /metrics without spec-decode counters); nothing to analyse"
        )
    settings = serve.get("settings", {})
    concurrency = settings.get("concurrency") or settings.get("num_prompts") or 1
    row = {
        "set": SERVED_SET,
        "label": f"{spec['source']}: {serve['model']}",
        "batch_size": concurrency,
        "tau": spec["tau"],
        "acceptance_rates": list(spec["acceptance_rates"]),
        "steps": spec["steps"],
        "drafted_tokens": spec["drafted_tokens"],
        "accepted_tokens": spec["accepted_tokens"],
        "tokens_per_s": serve["output_throughput"],
        "speedup": None,  # a server run has no plain baseline next to it
        "per_prompt": [],
    }
    return {
        "schema": SCHEMA,
        "source": "bench-serve",
        "command": f"specdec bench-serve --url {serve.get('base_url', '?')} ({path})",
        "git_commit": None,
        "env": {"device_name": f"{spec['source']} server at {serve.get('base_url', '?')}"},
        "config": settings,
        "sets": {SERVED_SET: {}},
        "rows": [row],
        "traces": [],
    }


def measured_rows(report: Report) -> list[dict[str, Any]]:
    """Rows that finished (failed configs carry no figures; served rows have τ but no
    speedup)."""
    return [r for r in report["rows"] if r["speedup"] is not None or r.get("tau") is not None]


def set_names(report: Report) -> list[str]:
    return list(report["sets"])


def labels(report: Report) -> list[str]:
    """Speculation configs in measurement order."""
    return list(dict.fromkeys(r["label"] for r in report["rows"]))


def acceptance_curves(report: Report) -> dict[tuple[str, str], list[float]]:
    """(set, label) → a_1, a_2, ... at the smallest batch size measured. Acceptance does
    not depend on the batch size with greedy decoding, so one curve per config suffices."""
    curves: dict[tuple[str, str], list[float]] = {}
    for r in sorted(measured_rows(report), key=lambda r: -r["batch_size"]):
        if r["tau"] is not None:
            curves[(r["set"], r["label"])] = r["acceptance_rates"]
    return curves


def taus(report: Report) -> dict[tuple[str, str], float]:
    """(set, label) → τ at the smallest batch size measured (configs that drafted)."""
    out: dict[tuple[str, str], float] = {}
    for r in sorted(measured_rows(report), key=lambda r: -r["batch_size"]):
        if r["tau"] is not None:
            out[(r["set"], r["label"])] = r["tau"]
    return out


def prompt_taus(report: Report, label: str) -> dict[str, list[float]]:
    """Set → τ of each prompt that had a verify step, for one config (smallest batch)."""
    out: dict[str, list[float]] = {}
    for r in sorted(measured_rows(report), key=lambda r: -r["batch_size"]):
        if r["label"] == label:
            out[r["set"]] = [p["tau"] for p in r["per_prompt"] if p["tau"] is not None]
    return out


def rates_from_steps(steps: list[list[int]], depth: int) -> list[float]:
    """a_1..a_depth from a trace's (position, drafted, accepted) steps."""
    if not steps:
        return []
    return [sum(a >= k for _, _, a in steps) / len(steps) for k in range(1, depth + 1)]


def depth_of(report: Report, label: str) -> int:
    return next(r["shape"]["depth"] for r in report["rows"] if r["label"] == label)


def position_outcomes(steps: list[list[int]], depth: int) -> dict[int, bool]:
    """Output position → whether the draft proposed for it was accepted. A step at
    position p accepting a of its drafts accepts positions p .. p+a-1 and rejects p+a
    when a draft reached that far (a < depth, and for chains a < drafted)."""
    outcomes: dict[int, bool] = {}
    for p, drafted, accepted in steps:
        for j in range(accepted):
            outcomes[p + j] = True
        if accepted < min(drafted, depth):
            outcomes[p + accepted] = False
    return outcomes


def entropy_outcomes(report: Report, label: str, set_name: str) -> list[tuple[float, bool]]:
    """(target entropy, draft accepted) at every output position where ``label`` tested a
    draft, over the set's prompts. Needs a report written with ``--analysis``."""
    prompts = report["sets"][set_name]["prompts"]
    depth = depth_of(report, label)
    pairs: list[tuple[float, bool]] = []
    for trace in report["traces"]:
        if trace["label"] != label or trace["set"] != set_name:
            continue
        for prompt, steps in zip(prompts, trace["steps"], strict=True):
            entropy = prompt.get("target_entropy") or []
            for pos, ok in position_outcomes(steps, depth).items():
                if pos < len(entropy):
                    pairs.append((entropy[pos], ok))
    return pairs


def binned_acceptance(
    pairs: list[tuple[float, bool]], edges: list[float]
) -> tuple[list[float | None], list[int]]:
    """P(accepted) and counts per bin [edges[i], edges[i+1]); the last bin is closed."""
    hits, counts = [0] * (len(edges) - 1), [0] * (len(edges) - 1)
    for h, ok in pairs:
        for i in range(len(edges) - 1):
            last = i == len(edges) - 2
            if edges[i] <= h < edges[i + 1] or (last and h == edges[i + 1]):
                hits[i] += ok
                counts[i] += 1
                break
    return [h / c if c else None for h, c in zip(hits, counts, strict=True)], counts


def tree_ablation(report: Report) -> list[dict[str, Any]]:
    """One record per measured row: set, label, batch, shape fields, τ, speedup."""
    return [
        {
            "set": r["set"],
            "label": r["label"],
            "batch_size": r["batch_size"],
            **r["shape"],
            "tau": r["tau"],
            "speedup": r["speedup"],
        }
        for r in measured_rows(report)
    ]


def token_counts(report: Report, set_name: str | None = None) -> Counter:
    """Target token ids in the plain greedy outputs (one set, or all)."""
    counts: Counter = Counter()
    for name, s in report["sets"].items():
        if set_name is None or name == set_name:
            for p in s["prompts"]:
                counts.update(p["output_ids"])
    return counts


def frequency_coverage(counts: Counter, sizes: list[int]) -> list[float]:
    """Fraction of the counted tokens covered by a vocabulary of the ``n`` most frequent
    ones, for each n in ``sizes``: how a frequency-pruned draft vocabulary would fare on
    these outputs (in-sample, so an upper bound for a vocabulary built elsewhere)."""
    total = sum(counts.values())
    ranked = [c for _, c in counts.most_common()]
    covered, out, acc = 0, [], 0
    for n in sorted(sizes):
        while covered < min(n, len(ranked)):
            acc += ranked[covered]
            covered += 1
        out.append(acc / total if total else 0.0)
    return out


def head_coverage(report: Report) -> dict[tuple[str, str], tuple[float | None, int | None]]:
    """(set, label) → (fraction of output tokens in the head's draft vocabulary, that
    vocabulary's size); (None, None) — n/a — for proposers without one (ngram, draft
    model)."""
    return {
        (r["set"], r["label"]): (r["vocab_coverage"], r["draft_vocab_size"])
        for r in measured_rows(report)
    }
