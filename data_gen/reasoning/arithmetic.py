"""Tracers for tasks that compute a number: chain_sum, basic_arithmetic, products,
leg_counting. Each writes one operation per work step, then offers checks that reach the
same number another way (regrouping, reversing, re-deriving)."""

from __future__ import annotations

import ast
import random
from typing import Any

from specdec.data_gen.reasoning.format import AGREEMENTS, Check, Solution, Untraceable
from specdec.data_gen.reasoning.tasks import register

SETTLE = ("so the answer is {}.", "so the result is {}.", "which gives {}.")


class InexactDivision(Untraceable):
    """basic_arithmetic floors '/'; a trace must not teach that 7 / 2 = 3."""


def settle(rng: random.Random, answer: object) -> str:
    return rng.choice(SETTLE).format(answer)


def running_sum(terms: list[int], signs: list[str] | None = None) -> tuple[str, int]:
    """ "a + b = s1, s1 - c = s2" for ``terms`` combined left to right with ``signs``
    (default all "+"); a single term is just itself."""
    signs = signs or ["+"] * (len(terms) - 1)
    acc, parts = terms[0], []
    for sign, t in zip(signs, terms[1:], strict=True):
        new = acc + t if sign == "+" else acc - t
        parts.append(f"{acc} {sign} {t} = {new}")
        acc = new
    return (", ".join(parts) if parts else str(acc)), acc


@register("chain_sum", min_terms=2, max_terms=5, min_digits=1, max_digits=3)
def chain_sum(entry: dict[str, Any], rng: random.Random) -> Solution:
    tokens = entry["metadata"]["expression"].split()
    nums, ops = [int(t) for t in tokens[0::2]], tokens[1::2]
    work = [
        rng.choice(
            [
                "I'll work from left to right.",
                "Let me go through the terms in order.",
                f"Start with {nums[0]} and apply each operation in turn.",
            ]
        )
    ]
    acc = nums[0]
    for i, (op, n) in enumerate(zip(ops, nums[1:], strict=True)):
        new = acc + n if op == "+" else acc - n
        tail = f", {settle(rng, new)}" if i == len(ops) - 1 else "."
        work.append(f"{acc} {op} {n} = {new}{tail}")
        acc = new
    checks = [
        Check(
            "going through it once more", f"{running_sum(nums, ops)[0]}. {rng.choice(AGREEMENTS)}"
        )
    ]
    added = [nums[0]] + [n for op, n in zip(ops, nums[1:], strict=True) if op == "+"]
    taken = [n for op, n in zip(ops, nums[1:], strict=True) if op == "-"]
    if taken and len(added) > 1:
        plus, p = running_sum(added)
        minus, m = running_sum(taken)
        checks.append(
            Check(
                "adding up what is added and what is subtracted separately",
                f"added: {plus}; subtracted: {minus}; {p} - {m} = {acc}. {rng.choice(AGREEMENTS)}",
            )
        )
    back, value = [], acc
    for op, n in zip(reversed(ops), reversed(nums[1:]), strict=True):
        prev = value - n if op == "+" else value + n
        back.append(f"{value} {'-' if op == '+' else '+'} {n} = {prev}")
        value = prev
    checks.append(
        Check("working backwards from the result", f"{', '.join(back)}, which is the first number.")
    )
    return Solution(work, checks, entry["answer"])


# ---- basic_arithmetic: an expression reduced one operation at a time ----------------------
_PREC = {ast.Add: 1, ast.Sub: 1, ast.Mult: 2, ast.FloorDiv: 2}
_SYM = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "/"}


def _literal(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = node.operand
        if isinstance(inner, ast.Constant) and type(inner.value) is int:
            return -inner.value
    return None


def _negation(node: ast.AST) -> ast.AST:
    """``-( ... )`` of the generator as its own node (a call of ``neg``), so that once its
    inside is a number the negation is a step of its own, never folded into a literal."""
    for field, value in ast.iter_fields(node):
        if isinstance(value, ast.AST):
            setattr(node, field, _negation(value))
    if isinstance(node, ast.UnaryOp) and not isinstance(node.operand, ast.Constant):
        return ast.Call(ast.Name("neg"), [node.operand], [])
    return node


def _number(value: int) -> ast.AST:
    const = ast.Constant(abs(value))
    return ast.UnaryOp(ast.USub(), const) if value < 0 else const


def show(node: ast.AST, parent: int = 0, right: bool = False) -> str:
    """The expression with only the parentheses its structure needs; '/' for division."""
    value = _literal(node)
    if value is not None:
        return str(value)
    if isinstance(node, ast.Call):
        return f"-({show(node.args[0])})"
    assert isinstance(node, ast.BinOp)
    prec = _PREC[type(node.op)]
    text = f"{show(node.left, prec)} {_SYM[type(node.op)]} {show(node.right, prec, True)}"
    return f"({text})" if prec < parent or (right and prec == parent) else text


def _reduce_once(node: ast.AST) -> tuple[ast.AST, tuple[int, str, int, int] | None]:
    """The tree with its first operation in evaluation order done, and that operation as
    (left, symbol, right, result) — None when ``node`` is already a number. A negation is
    (0, "neg", operand, result)."""
    if _literal(node) is not None:
        return node, None
    if isinstance(node, ast.Call):  # -( ... ): negate once the inside is a number
        inner = _literal(node.args[0])
        if inner is None:
            operand, op = _reduce_once(node.args[0])
            return ast.Call(node.func, [operand], []), op
        return _number(-inner), (0, "neg", inner, -inner)
    assert isinstance(node, ast.BinOp)
    a, b = _literal(node.left), _literal(node.right)
    if a is None:
        left, op = _reduce_once(node.left)
        return ast.BinOp(left, node.op, node.right), op
    if b is None:
        right, op = _reduce_once(node.right)
        return ast.BinOp(node.left, node.op, right), op
    kind = type(node.op)
    if kind is ast.FloorDiv and (b == 0 or a % b):
        raise InexactDivision(f"{a} / {b} is not a whole number")
    result = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}.get(kind)
    result = a // b if result is None else result
    return _number(result), (a, _SYM[kind], b, result)


@register("basic_arithmetic", min_terms=2, max_terms=4, min_digits=1, max_digits=2)
def basic_arithmetic(entry: dict[str, Any], rng: random.Random) -> Solution:
    tree = _negation(
        ast.parse(entry["metadata"]["expression"].replace("/", "//"), mode="eval").body
    )
    forms = [show(tree)]
    work = [
        f"I need to evaluate {forms[0]}: parentheses first, then multiplication and "
        "division, then addition and subtraction."
    ]
    last = None
    while True:
        tree, op = _reduce_once(tree)
        if op is None:
            break
        last = op
        a, sym, b, result = op
        done = _literal(tree) is not None
        tail = settle(rng, result) if done else f"so the expression becomes {show(tree)}."
        if sym == "neg":
            work.append(f"The negative of {b} is {result}, {tail}")
        else:
            work.append(f"{a} {sym} {b} = {result}, {tail}")
        forms.append(show(tree))
    answer = entry["answer"]
    if last is None:
        work.append(f"There is nothing to compute, {settle(rng, answer)}")
        return Solution(work, [], answer)
    checks = []
    if len(forms) > 2:
        checks.append(
            Check(
                "evaluating it again in one line", f"{' = '.join(forms)}. {rng.choice(AGREEMENTS)}"
            )
        )
    a, sym, b, result = last
    undo = {
        "+": f"{result} - {b} = {a}",
        "-": f"{result} + {b} = {a}",
        "/": f"{result} * {b} = {a}",
        "neg": f"the negative of {result} is {b}",
    }
    if sym == "*" and b != 0:
        undo["*"] = f"{result} / {b} = {a}"
    if sym in undo:
        checks.append(Check("undoing the last operation", f"{undo[sym]}. {rng.choice(AGREEMENTS)}"))
    return Solution(work, checks, answer)


# ---- products: place-value partial products -----------------------------------------------
def place_values(n: int) -> list[int]:
    """The non-zero place-value parts of ``n >= 0``, largest first (0 -> [0])."""
    digits = str(n)
    parts = [int(d) * 10 ** (len(digits) - 1 - i) for i, d in enumerate(digits) if d != "0"]
    return parts or [0]


def _partials(a: int, b: int) -> tuple[str, list[int]]:
    parts = place_values(b)
    return "; ".join(f"{a} × {p} = {a * p}" for p in parts), [a * p for p in parts]


@register("products", min_terms=2, max_terms=2, min_digits=1, max_digits=3)
def products(entry: dict[str, Any], rng: random.Random) -> Solution:
    a, b = (int(t) for t in entry["metadata"]["expression"].split(" * "))
    r = a * b
    if a == 0 or b == 0:
        work = [f"One factor is 0, and anything times 0 is 0, {settle(rng, r)}"]
    elif len(place_values(b)) == 1:
        work = [f"{a} × {b} = {r}, {settle(rng, r)}"]
    else:
        work = [f"I'll split {b} into place values: {b} = {' + '.join(map(str, place_values(b)))}."]
        for p in place_values(b):
            work.append(f"{a} × {p} = {a * p}.")
        text, _ = running_sum([a * p for p in place_values(b)])
        work.append(f"Adding the partial products: {text}, {settle(rng, r)}")
    checks = [
        Check(
            "looking at the last digit",
            f"{a % 10} × {b % 10} = {(a % 10) * (b % 10)}, "
            f"which ends in {(a % 10) * (b % 10) % 10}, and {r} ends in {r % 10}.",
        )
    ]
    if a >= 10 and b != 0:
        text, partials = _partials(b, a)
        sums, _ = running_sum(partials)
        checks.append(Check(f"splitting {a} instead", f"{text}; {sums}. {rng.choice(AGREEMENTS)}"))
    if a >= 10 and b >= 10:
        ra, rb = _round1(a), _round1(b)
        if abs(ra * rb - r) <= 0.5 * r:
            checks.append(
                Check(
                    "estimating",
                    f"{a} is about {ra} and {b} is about {rb}, and "
                    f"{ra} × {rb} = {ra * rb}, close to {r}.",
                )
            )
    return Solution(work, checks, entry["answer"])


def _round1(n: int) -> int:
    """``n`` rounded to one significant digit."""
    scale = 10 ** (len(str(n)) - 1)
    return max(1, round(n / scale)) * scale


# ---- leg_counting -------------------------------------------------------------------------
def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


@register("leg_counting", min_animals=2, max_animals=6, min_instances=1, max_instances=15)
def leg_counting(entry: dict[str, Any], rng: random.Random) -> Solution:
    from reasoning_gym.arithmetic.leg_counting import ANIMALS

    animals: dict[str, int] = entry["metadata"]["animals"]
    work = [
        rng.choice(
            [
                "I need each animal's number of legs times how many there are.",
                "Let me count the legs animal by animal.",
            ]
        )
    ]
    totals = []
    for animal, count in animals.items():
        legs = ANIMALS[animal]
        name = f"{count} {animal}{'s' if count > 1 else ''}"
        work.append(
            f"{_article(animal).capitalize()} {animal} has {legs} legs, so {name} "
            f"have {count} × {legs} = {count * legs} legs."
        )
        totals.append(count * legs)
    text, total = running_sum(totals)
    work.append(f"Adding them up: {text}, {settle(rng, total)}")
    by_legs: dict[int, int] = {}
    for animal, count in animals.items():
        by_legs[ANIMALS[animal]] = by_legs.get(ANIMALS[animal], 0) + count
    groups = "; ".join(
        f"{n} animals with {legs} legs give {n * legs}" for legs, n in sorted(by_legs.items())
    )
    checks = [
        Check(
            "re-adding in reverse order",
            f"{running_sum(totals[::-1])[0]}. {rng.choice(AGREEMENTS)}",
        ),
        Check(
            "recomputing each product",
            ", ".join(f"{c} × {ANIMALS[a]} = {c * ANIMALS[a]}" for a, c in animals.items())
            + ", all as before.",
        ),
    ]
    if len(by_legs) < len(animals):
        subtotal = [n * legs for legs, n in sorted(by_legs.items())]
        checks.append(
            Check(
                "grouping animals with the same number of legs",
                f"{groups}; {running_sum(subtotal)[0]}. {rng.choice(AGREEMENTS)}",
            )
        )
    return Solution(work, checks, entry["answer"])
