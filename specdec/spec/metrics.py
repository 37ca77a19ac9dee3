"""Speculation counters, per request and for the engine.

A *step* is one target verification forward for one request. τ (mean acceptance length)
= tokens emitted per step, bonus included = 1 + accepted / steps. Per-position acceptance
a_k = fraction of steps that accepted at least k draft tokens (non-increasing in k).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # accepted_at_least[k-1] = steps that accepted >= k draft tokens
    accepted_at_least: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafted tokens")
        self.steps += 1
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        if len(self.accepted_at_least) < num_accepted:
            self.accepted_at_least += [0] * (num_accepted - len(self.accepted_at_least))
        for k in range(num_accepted):
            self.accepted_at_least[k] += 1

    def merge(self, other: SpecStats) -> None:
        self.steps += other.steps
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        for k, n in enumerate(other.accepted_at_least):
            if k < len(self.accepted_at_least):
                self.accepted_at_least[k] += n
            else:
                self.accepted_at_least.append(n)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per step (bonus included); 0 before any step."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """a_k for k = 1, 2, ...: fraction of steps accepting at least k draft tokens."""
        return [n / self.steps for n in self.accepted_at_least] if self.steps else []

    def summary(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_rates[:8])
        return (
            f"τ={self.tau:.2f} over {self.steps} steps; drafted {self.drafted_tokens}, "
            f"accepted {self.accepted_tokens}; per-position acceptance [{rates}]"
        )
