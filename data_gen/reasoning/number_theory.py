"""Tracers for divisibility tasks: gcd, lcm, fraction_simplification (Euclid's algorithm,
one division per step) and prime_factorization (trial division). Checks multiply back or
compare prime factorizations."""

from __future__ import annotations

import math
import random
from functools import reduce
from typing import Any

from specdec.data_gen.reasoning.arithmetic import settle
from specdec.data_gen.reasoning.format import AGREEMENTS, Check, Solution
from specdec.data_gen.reasoning.tasks import register


def prime_factors(n: int) -> list[int]:
    """Prime factors of ``n >= 1`` with multiplicity, ascending ([] for 1)."""
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return [*factors, n] if n > 1 else factors


def product_text(factors: list[int]) -> str:
    return " × ".join(map(str, factors)) if factors else "1"


def euclid_steps(a: int, b: int) -> tuple[list[str], int]:
    """One "a = q × b + r" line per division of Euclid's algorithm on ``a >= b >= 1``; the
    last line (remainder 0) names the GCD."""
    lines = []
    while b:
        q, r = divmod(a, b)
        lines.append(f"{a} = {q} × {b} + {r}.")
        a, b = b, r
    lines[-1] += f" The remainder is 0, so the GCD is {a}."
    return lines, a


def euclid_line(a: int, b: int) -> str:
    """Euclid's algorithm on ``a >= b >= 1`` in one line: "a mod b = r, ..., so the GCD
    is g"."""
    parts = []
    while b:
        parts.append(f"{a} mod {b} = {a % b}")
        a, b = b, a % b
    return f"{', '.join(parts)}, so the GCD is {a}"


def gcd_work(numbers: list[int]) -> tuple[list[str], int]:
    """Work steps that find the GCD of ``numbers`` (pairwise, larger number first)."""
    steps, g = [], numbers[0]
    for n in numbers[1:]:
        hi, lo = max(g, n), min(g, n)
        if hi == lo:
            steps.append(f"Both numbers are {hi}, so their GCD is {hi}.")
            continue
        steps.append(f"Euclidean algorithm on {hi} and {lo}:")
        lines, g = euclid_steps(hi, lo)
        steps[-1] += " " + lines[0]  # the first division opens the algorithm's step
        steps += lines[1:]
    return steps, g


def _euclid_all(numbers: list[int]) -> str:
    lines, g = [], numbers[0]
    for n in numbers[1:]:
        hi, lo = max(g, n), min(g, n)
        lines.append(euclid_line(hi, lo))
        g = math.gcd(hi, lo)
    return "; ".join(lines)


def _common(a: list[int], b: list[int]) -> list[int]:
    rest, out = list(b), []
    for p in a:
        if p in rest:
            rest.remove(p)
            out.append(p)
    return out


@register("gcd", min_numbers=2, max_numbers=2, min_value=1, max_value=1000)
def gcd(entry: dict[str, Any], rng: random.Random) -> Solution:
    numbers: list[int] = entry["metadata"]["numbers"]
    work, g = gcd_work(numbers)
    work[-1] += f" {settle(rng, g).capitalize()}"
    quotients = " and ".join(f"{n} / {g} = {n // g}" for n in numbers)
    factored = [prime_factors(n) for n in numbers]
    common = reduce(_common, factored)
    shared = (
        f"the shared primes are {product_text(common)} = {math.prod(common)}"
        if len(common) > 1
        else f"the only shared prime is {common[0]}"
        if common
        else "they share no prime, so the GCD is 1"
    )
    checks = [
        Check(f"dividing each number by {g}", f"{quotients}, all whole numbers."),
        Check("running the algorithm again", f"{_euclid_all(numbers)}. {rng.choice(AGREEMENTS)}"),
        Check(
            "comparing prime factorizations",
            "; ".join(f"{n} = {product_text(f)}" for n, f in zip(numbers, factored, strict=True))
            + f"; {shared}. {rng.choice(AGREEMENTS)}",
        ),
    ]
    return Solution(work, checks, entry["answer"])


@register("lcm", min_numbers=2, max_numbers=2, min_value=1, max_value=200)
def lcm(entry: dict[str, Any], rng: random.Random) -> Solution:
    numbers: list[int] = entry["metadata"]["numbers"]
    work = ["The LCM of two numbers is their product divided by their GCD."]
    acc = numbers[0]
    for n in numbers[1:]:
        steps, g = gcd_work([acc, n])
        work += steps
        new = acc * n // g
        work.append(f"{acc} × {n} = {acc * n}, and {acc * n} / {g} = {new}.")
        acc = new
    work[-1] = work[-1][:-1] + f", {settle(rng, acc)}"
    highest: dict[int, int] = {}
    for n in numbers:
        for p in set(prime_factors(n)):
            highest[p] = max(highest.get(p, 0), prime_factors(n).count(p))
    combined = [p for p in sorted(highest) for _ in range(highest[p])]
    checks = [
        Check("recomputing the GCD", f"{_euclid_all(numbers)}. {rng.choice(AGREEMENTS)}"),
        Check(
            "dividing the LCM by each number",
            " and ".join(f"{acc} / {n} = {acc // n}" for n in numbers) + ", all whole numbers.",
        ),
        Check(
            "using prime factorizations",
            "; ".join(f"{n} = {product_text(prime_factors(n))}" for n in numbers)
            + f"; the highest power of each prime gives {product_text(combined)} = "
            f"{math.prod(combined)}. {rng.choice(AGREEMENTS)}",
        ),
    ]
    return Solution(work, checks, entry["answer"])


@register("fraction_simplification", min_value=1, max_value=100, min_factor=1, max_factor=20)
def fraction_simplification(entry: dict[str, Any], rng: random.Random) -> Solution:
    meta = entry["metadata"]
    num, den = meta["numerator"], meta["denominator"]
    answer = entry["answer"]
    work = [f"To simplify {num}/{den}, I divide the numerator and the denominator by their GCD."]
    steps, g = gcd_work([den, num])
    work += steps
    sn, sd = num // g, den // g
    if g == 1:
        work.append(
            f"The GCD is 1, so {num}/{den} is already in lowest terms; the answer is {answer}."
        )
    else:
        work.append(
            f"{num} / {g} = {sn} and {den} / {g} = {sd}, so the simplified fraction is {answer}."
        )
    fs, fd = prime_factors(sn), prime_factors(sd)
    checks = [
        Check(
            "multiplying back",
            f"{sn} × {g} = {num} and {sd} × {g} = {den}. {rng.choice(AGREEMENTS)}",
        ),
        Check("recomputing the GCD", f"{_euclid_all([den, num])}. {rng.choice(AGREEMENTS)}"),
        Check(
            f"factoring {sn} and {sd}",
            f"{sn} = {product_text(fs)} and {sd} = {product_text(fd)}, no prime in common.",
        ),
    ]
    return Solution(work, checks, answer)


def _listing(numbers: list[int]) -> str:
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


@register("prime_factorization", min_value=2, max_value=10000)
def prime_factorization(entry: dict[str, Any], rng: random.Random) -> Solution:
    n: int = entry["metadata"]["number"]
    work = [f"I'll divide {n} by primes, starting from 2."]
    m, p, tried, factors = n, 2, [], []
    while p * p <= m:
        if m % p:
            if prime_factors(p) == [p]:
                tried.append(p)
            p += 1
            continue
        lead = f"{m} is not divisible by {_listing(tried)}. " if tried else ""
        work.append(f"{lead}{m} / {p} = {m // p}.")
        factors.append(p)
        m, tried = m // p, []
    if m > 1:
        factors.append(m)
        if tried:
            work.append(
                f"{m} is not divisible by {_listing(tried)}, and {p} × {p} = {p * p} is "
                f"more than {m}, so {m} is prime."
            )
        else:
            work.append(f"{m} is prime.")
    answer = entry["answer"]
    work.append(f"So {n} = {answer}.")
    divisions, m = [], n
    for f in factors[:-1]:
        divisions.append(f"{m} / {f} = {m // f}")
        m //= f
    running, acc = [], factors[0]
    for f in factors[1:]:
        running.append(f"{acc} × {f} = {acc * f}")
        acc *= f
    checks = [
        Check(
            "looking at each factor",
            f"{_listing(sorted(set(factors))).replace(' or ', ' and ')} "
            f"{'are' if len(set(factors)) > 1 else 'is'} prime.",
        )
    ]
    if divisions:
        checks.append(
            Check(
                "dividing again",
                f"{', '.join(divisions)}, and {m} is prime. {rng.choice(AGREEMENTS)}",
            )
        )
    if running:
        checks.append(
            Check("multiplying the factors back", f"{', '.join(running)}. {rng.choice(AGREEMENTS)}")
        )
    return Solution(work, checks, answer)
