"""Tracers for tasks that rewrite a representation: simple_equations (isolate the variable
one operation per step; check by substitution) and base_conversion (place values to
decimal, repeated division to the target base; check by converting back)."""

from __future__ import annotations

import random
from typing import Any

from specdec.data_gen.reasoning.arithmetic import settle
from specdec.data_gen.reasoning.format import AGREEMENTS, Check, Solution, Untraceable
from specdec.data_gen.reasoning.tasks import register


def _term(a: int, x: str) -> str:
    return x if a == 1 else f"-{x}" if a == -1 else f"{a}*{x}"


@register("simple_equations", min_terms=2, max_terms=4, min_value=1, max_value=100)
def simple_equations(entry: dict[str, Any], rng: random.Random) -> Solution:
    import sympy
    from sympy.parsing.sympy_parser import parse_expr

    meta = entry["metadata"]
    x_name = meta["variable"]
    left, right = meta["equation"].split(" = ")
    x = sympy.Symbol(x_name)
    lhs = sympy.expand(parse_expr(left, local_dict={x_name: x}))
    a, b, rhs = int(lhs.coeff(x, 1)), int(lhs.subs(x, 0)), int(right)
    if a == 0 or lhs != a * x + b:
        raise Untraceable(f"{meta['equation']!r} is not linear in {x_name}")
    if (rhs - b) % a:
        raise Untraceable(f"{meta['equation']!r} has no integer solution")
    sol = (rhs - b) // a
    form = f"{_term(a, x_name)} {'+' if b >= 0 else '-'} {abs(b)}" if b else _term(a, x_name)
    work = [f"I need to isolate {x_name}. The left side is {form}."]
    c = rhs - b
    moves = []  # the equations of the solving steps, without the prose
    if b:
        verb = f"Subtract {b} from" if b > 0 else f"Add {-b} to"
        moves.append(f"{_term(a, x_name)} = {rhs} {'-' if b > 0 else '+'} {abs(b)} = {c}")
        work.append(
            f"{verb} both sides: {moves[-1]}" + (f", so {x_name} = {c}." if a == 1 else ".")
        )
    if a != 1:
        moves.append(f"{x_name} = {c} / {a} = {sol}")
        work.append(f"Divide both sides by {a}: {moves[-1]}.")
    if len(work) == 1:
        work.append(f"That already says {x_name} = {rhs}.")
    work[-1] = work[-1][:-1] + f", {settle(rng, sol)}"
    value = a * sol
    plug = f"{a} × {sol} = {value}" + (
        f", and {value} {'+' if b >= 0 else '-'} {abs(b)} = {value + b}" if b else ""
    )
    checks = [
        Check(
            f"substituting {x_name} = {sol} back",
            f"{plug}, which equals the right side {rhs}. {rng.choice(AGREEMENTS)}",
        )
    ]
    if len(moves) > 1:
        checks.append(Check("solving it again", f"{'; '.join(moves)}. {rng.choice(AGREEMENTS)}"))
    if a not in (1, -1):
        checks.append(Check("redoing the division", f"{a} × {sol} = {c}. {rng.choice(AGREEMENTS)}"))
    return Solution(work, checks, entry["answer"])


def _digit(d: int) -> str:
    return str(d) if d < 10 else chr(ord("a") + d - 10)


def _to_decimal(text: str, base: int) -> tuple[str, int]:
    """ "1 × 121 + 1 × 11 + 5 × 1 = 137"-style place-value sum (non-zero digits only)."""
    digits = [int(ch, 36) for ch in text]
    terms = [(d, base ** (len(digits) - 1 - i)) for i, d in enumerate(digits) if d]
    value = sum(d * p for d, p in terms)
    if not terms:
        return "0", 0
    parts = " + ".join(f"{d} × {p}" for d, p in terms)
    sums = " + ".join(str(d * p) for d, p in terms)
    return (f"{parts} = {value}" if len(terms) == 1 else f"{parts} = {sums} = {value}"), value


def _name(base: int) -> str:
    return {2: "binary", 10: "decimal", 16: "hexadecimal"}.get(base, f"base {base}")


@register("base_conversion", min_base=2, max_base=16, min_value=0, max_value=1000)
def base_conversion(entry: dict[str, Any], rng: random.Random) -> Solution:
    meta = entry["metadata"]
    src, sb, tb = meta["source_repr"], meta["source_base"], meta["target_base"]
    answer = entry["answer"]
    if sb == 10:
        value = int(src)
        work = [f"{src} is already decimal, so I convert it straight to {_name(tb)}."]
    else:
        text, value = _to_decimal(src, sb)
        settled = f", {settle(rng, value)}" if tb == 10 else "."
        digits = ", ".join(f"{ch} = {int(ch, 36)}" for ch in sorted(set(src)) if ch.isalpha())
        note = f" (digits {digits})" if digits else ""
        work = [f"First convert {src} from {_name(sb)} to decimal{note}: {text}{settled}"]
    if tb != 10:
        n = value
        while True:
            q, r = divmod(n, tb)
            letter = f" ({_digit(r)})" if r >= 10 else ""
            work.append(f"{n} / {tb} = {q} remainder {r}{letter}.")
            n = q
            if n == 0:
                break
        work.append(f"Reading the remainders from last to first gives {answer}.")
    checks = []
    if tb != 10:
        back, _ = _to_decimal(answer, tb)
        checks.append(
            Check(f"converting {answer} back to decimal", f"{back}. {rng.choice(AGREEMENTS)}")
        )
        size = len(answer)
        low, high = tb ** (size - 1), tb**size
        if size > 1:
            checks.append(
                Check(
                    "counting digits",
                    f"{tb}^{size - 1} = {low} <= {value} < "
                    f"{high} = {tb}^{size}, so the answer has {size} digits, and "
                    f"{answer} does.",
                )
            )
    if sb != 10:
        text, _ = _to_decimal(src, sb)
        checks.append(
            Check(f"recomputing the decimal value of {src}", f"{text}. {rng.choice(AGREEMENTS)}")
        )
    return Solution(work, checks, answer)
