"""Speculation counters read from a server's Prometheus /metrics: specdec's or vLLM's.

``bench-serve`` scrapes /metrics before and after a run and reports the difference, so τ
and per-position acceptance cover exactly that run, in one form whichever server it was.
Each server's names live in a ``MetricsSource`` in ``METRICS_SOURCES``; a new engine is a
new entry, not a branch.

Both sources count the same thing (see ``specdec/spec/metrics.py``): a *step* is one target
verification forward for one request that carried a draft — vLLM calls it a *draft*
(``SpecDecodingStats.observe_draft``, once per request per step with scheduled draft
tokens). τ = 1 + accepted / steps (bonus token included; vLLM's "mean acceptance length").
a_k = fraction of steps that accepted at least k draft tokens: vLLM's
``num_accepted_tokens_per_pos{position=k-1}`` counts steps whose k-th draft token was
accepted, which (acceptance stops at the first rejection) is the same number.

Names, as exposed (checked in vLLM 0.32.0 ``v1/spec_decode/metrics.py``; prometheus_client
appends ``_total`` to counters):

- specdec: ``specdec_spec_decode_num_steps_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``, gauge ``specdec_spec_decode_acceptance_rate{position=k}``
  (a_k, k from 1), times steps gives the count.
- vLLM: ``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
  ``vllm:spec_decode_num_accepted_tokens_total``,
  ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position=i}`` (i from 0); every
  series also has ``engine`` and ``model_name`` labels, summed over here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

# name -> [(labels, value)] for every sample in an exposition.
Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative speculation counters of one server (all engines summed)."""

    steps: float
    drafted_tokens: float
    accepted_tokens: float
    accepted_at_least: tuple[float, ...]  # [k-1]: steps that accepted >= k draft tokens

    def minus(self, before: SpecCounters) -> SpecCounters:
        """The counts accumulated since ``before`` (an earlier scrape)."""
        depth = max(len(self.accepted_at_least), len(before.accepted_at_least))
        a = self.accepted_at_least + (0.0,) * (depth - len(self.accepted_at_least))
        b = before.accepted_at_least + (0.0,) * (depth - len(before.accepted_at_least))
        return SpecCounters(
            self.steps - before.steps,
            self.drafted_tokens - before.drafted_tokens,
            self.accepted_tokens - before.accepted_tokens,
            tuple(x - y for x, y in zip(a, b, strict=True)),
        )

    def report(self, source: str) -> dict:
        """τ and a_k in the form bench-serve reports for every server."""
        steps = self.steps
        return {
            "source": source,
            "steps": steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "tau": 1 + self.accepted_tokens / steps if steps else 0.0,
            "acceptance_rates": [n / steps for n in self.accepted_at_least] if steps else [],
        }


@dataclass(frozen=True)
class MetricsSource:
    """How one server exposes its counters: ``read`` returns None when the exposition
    lacks them (another server, or speculation off)."""

    name: str
    read: Callable[[Samples], SpecCounters | None]


def _total(samples: Samples, name: str) -> float | None:
    series = samples.get(name)
    return sum(value for _, value in series) if series else None


def _by_position(samples: Samples, name: str) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for labels, value in samples.get(name, []):
        if "position" in labels:
            out[int(labels["position"])] += value
    return dict(out)


def _step_totals(samples: Samples, prefix: str, steps_name: str) -> list[float] | None:
    """(verify steps, drafted tokens, accepted tokens) counters, or None when any is
    missing (the server has no speculation, or not this source's names)."""
    names = (steps_name, "num_draft_tokens", "num_accepted_tokens")
    totals = [_total(samples, f"{prefix}{n}_total") for n in names]
    if any(t is None for t in totals):
        return None
    return [float(t) for t in totals]


def _read_specdec(samples: Samples) -> SpecCounters | None:
    prefix = "specdec_spec_decode_"
    totals = _step_totals(samples, prefix, "num_steps")
    if totals is None:
        return None
    steps, drafted, accepted = totals
    rates = _by_position(samples, f"{prefix}acceptance_rate")  # a_k, k from 1
    hits = tuple(round(rates[k] * steps) for k in sorted(rates))
    return SpecCounters(steps, drafted, accepted, tuple(float(h) for h in hits))


def _read_vllm(samples: Samples) -> SpecCounters | None:
    prefix = "vllm:spec_decode_"
    totals = _step_totals(samples, prefix, "num_drafts")  # a vLLM draft: one verify step
    if totals is None:
        return None
    steps, drafted, accepted = totals
    per_pos = _by_position(samples, f"{prefix}num_accepted_tokens_per_pos_total")  # i from 0
    return SpecCounters(steps, drafted, accepted, tuple(per_pos[i] for i in sorted(per_pos)))


METRICS_SOURCES: dict[str, MetricsSource] = {
    s.name: s
    for s in (
        MetricsSource("specdec", _read_specdec),
        MetricsSource("vllm", _read_vllm),
    )
}


def parse_exposition(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((dict(sample.labels), float(sample.value)))
    return dict(samples)


def read_counters(text: str, source: str = "auto") -> tuple[str, SpecCounters] | None:
    """The speculation counters in an exposition and the source that read them; ``auto``
    tries every source in ``METRICS_SOURCES``. None when no source finds its counters."""
    if source != "auto" and source not in METRICS_SOURCES:
        raise ValueError(
            f"unknown metrics source {source!r}; choose auto or one of {sorted(METRICS_SOURCES)}"
        )
    samples = parse_exposition(text)
    names = list(METRICS_SOURCES) if source == "auto" else [source]
    for name in names:
        counters = METRICS_SOURCES[name].read(samples)
        if counters is not None:
            return name, counters
    return None
