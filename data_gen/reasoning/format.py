"""The one definition of the reasoning format: how a worked solution is written as
``<think>steps</think>answer`` (``render``) and how a completion is read back (``parse``).

Layout of an assistant reply (``STEP_SEP`` between steps)::

    <think>\\n{step 0}\\n\\n{step 1}\\n\\n ... {step k}\\n</think>\\n\\n{answer}

Steps come in two kinds: *work* steps compute the answer, and the last work step states
it (the answer is *settled* there); *check* steps follow — re-derivations, inverse checks
and restatements that change nothing, the over-thinking real reasoning models show after
they already know the answer. SpecExit learns to cut them.

``<think>`` and ``</think>`` are plain text to SmolLM2's tokenizer (``<`` ``think`` ``>``
and ``</`` ``think`` ``>``, ids [44, 17400, 46] and [9617, 17400, 46]); the tokens of a
step never straddle ``STEP_SEP`` (each ``\\n`` is its own token), so character spans map
to token spans exactly (``generate.token_spans``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
STEP_SEP = "\n\n"
_HEAD = THINK_OPEN + "\n"
_TAIL = "\n" + THINK_CLOSE + "\n\n"

# "{opener} {method}: {computation}" reads as one sentence for every (opener, method).
CHECK_OPENERS = (
    "Let me double-check by",
    "Wait, let me verify this by",
    "To be safe, let me check by",
    "Hmm, let me confirm by",
    "Let me make sure by",
    "Before answering, let me check by",
)
# How a check's computation ends once it agrees with the answer.
AGREEMENTS = ("That matches.", "Same result.", "That is consistent.", "Good, it agrees.")
RESTATEMENTS = (
    "So the final answer is {answer}.",
    "Everything checks out, so the answer is {answer}.",
    "Yes, the answer is {answer}.",
    "I'm confident the answer is {answer}.",
)


class Untraceable(ValueError):
    """A generator item the tracer cannot write a correct solution for (a degenerate
    equation, a division the generator floors); generation skips it and counts it."""


@dataclass(frozen=True)
class Check:
    """One verification after the answer is settled: ``method`` is a gerund phrase
    ("re-adding in reverse order"), ``work`` the computation that confirms the answer."""

    method: str
    work: str


@dataclass(frozen=True)
class Solution:
    """A tracer's output: ``work`` steps (the last one states ``answer``), the checks it
    can offer afterwards, and ``answer`` exactly as the verifier should read it."""

    work: list[str]
    checks: list[Check]
    answer: str

    def __post_init__(self) -> None:
        if not self.work or any(not s.strip() or STEP_SEP in s for s in self.work):
            raise ValueError(f"work steps must be non-empty single paragraphs: {self.work!r}")
        if any(STEP_SEP in c.work for c in self.checks):
            raise ValueError(f"a check spans paragraphs: {self.checks!r}")


@dataclass(frozen=True)
class TraceStyle:
    """How much over-thinking follows the settled answer: ``min_checks``..``max_checks``
    checks (as many as the task offers, at most), then a restatement with probability
    ``restate_prob``."""

    min_checks: int = 2
    max_checks: int = 4
    restate_prob: float = 0.8

    def __post_init__(self) -> None:
        if not 0 <= self.min_checks <= self.max_checks:
            raise ValueError(
                f"checks range [{self.min_checks}, {self.max_checks}] is empty or negative; "
                "use 0 <= min_checks <= max_checks"
            )
        if not 0 <= self.restate_prob <= 1:
            raise ValueError(f"restate_prob={self.restate_prob} must lie in [0, 1]")


@dataclass(frozen=True)
class Step:
    kind: str  # "work" | "check"
    start: int  # [start, end): characters of the step in the reply
    end: int


@dataclass(frozen=True)
class RenderedTrace:
    """The assistant reply and where things are in it (character offsets into ``text``).

    Invariants: ``text[:think_end]`` ends with ``THINK_CLOSE``; ``text[answer_start:] ==
    answer``; steps are ordered, disjoint, inside the think span; ``steps[settled_step]``
    is the last work step and every later step is a check."""

    text: str
    steps: list[Step]
    settled_step: int
    think_end: int  # one past THINK_CLOSE (the think span is [0, think_end))
    answer_start: int
    answer: str


def render(solution: Solution, rng: random.Random, style: TraceStyle) -> RenderedTrace:
    """Write ``solution`` as a reply: its work, then ``style``'s checks (drawn from the
    solution's, in a random order, each behind a random opener) and maybe a restatement."""
    k = min(len(solution.checks), rng.randint(style.min_checks, style.max_checks))
    checks = rng.sample(solution.checks, k)
    paragraphs = [(s, "work") for s in solution.work]
    paragraphs += [(f"{rng.choice(CHECK_OPENERS)} {c.method}: {c.work}", "check") for c in checks]
    if rng.random() < style.restate_prob:
        paragraphs.append((rng.choice(RESTATEMENTS).format(answer=solution.answer), "check"))
    text, steps = _HEAD, []
    for i, (paragraph, kind) in enumerate(paragraphs):
        if i:
            text += STEP_SEP
        steps.append(Step(kind, len(text), len(text) + len(paragraph)))
        text += paragraph
    text += _TAIL
    think_end = len(text) - 2  # the two newlines after THINK_CLOSE
    answer_start = len(text)
    text += solution.answer
    return RenderedTrace(
        text, steps, len(solution.work) - 1, think_end, answer_start, solution.answer
    )


@dataclass(frozen=True)
class Completion:
    """A generated reply read back. ``think`` is the stripped text inside the think span;
    ``answer`` the stripped text after ``</think>`` (None when the reply opened a think
    span and never closed it: generation stopped while thinking); ``think_end`` the
    character offset where thinking ends in the reply (one past ``</think>``; the reply's
    length when unclosed; 0 without a think span)."""

    think: str
    answer: str | None
    opened: bool
    closed: bool
    think_end: int


def parse(text: str) -> Completion:
    """Split a reply at its first ``</think>`` after an opening ``<think>``. A reply
    without either tag is all answer; one with a close tag but no open tag thought until
    it; an unclosed one is all thinking."""
    body = text.lstrip()
    lead = len(text) - len(body)
    opened = body.startswith(THINK_OPEN)
    start = len(THINK_OPEN) if opened else 0
    close = body.find(THINK_CLOSE, start)
    if close < 0:
        if opened:
            return Completion(body[start:].strip(), None, True, False, len(text))
        return Completion("", text.strip(), False, False, 0)
    end = close + len(THINK_CLOSE)
    return Completion(body[start:close].strip(), body[end:].strip(), opened, True, lead + end)
