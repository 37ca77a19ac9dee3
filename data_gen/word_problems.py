"""The ``math`` prompt source: multi-step arithmetic word problems composed from seeded parts.

Why it exists: the bench's math set (gsm_symbolic, GSM8K-like) asks for short stories
with two to four arithmetic steps, and the target answers them with step-by-step
working. The default mix's reasoning-gym generators ask for bare arithmetic, puzzles and
symbol games, and gsm_symbolic itself is a bench set (never training data), so a head
trained on the mix rarely sees the target reason through a story problem in prose, and
its acceptance on gsm_symbolic lags code's (docs/default_head.md). No GSM8K ships
offline, and its templates would be the bench's, so the stories here are written for
this source: a *problem* (one of ``PROBLEMS``: shopping, wages, travel, recipes, rates,
percentages, ages, schedules, ...) whose people, items and numbers are drawn per request,
an optional *opening* and a *closing instruction* (show the working, one number, ...).
The answers, not these prompts, are what the head learns, so the numbers only need to
make a story the target works through: slot ranges are chosen to be plausible, not
checked to give whole or positive answers (a few draws leave, say, a negative
remainder, which the target answers as it would any flawed question).

Invariants: the list is a pure function of (count, seed); ids are ``math/<i>`` in order;
prompts are distinct (drawn until ``count`` distinct texts, from far more combinations
than any mix asks for); they pass through the same deduplication and decontamination
against the bench sets (gsm_symbolic included) as every source (``mix.filter_conversations``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from specdec.data_gen.records import Conversation


@dataclass(frozen=True)
class Person:
    name: str
    he: str  # subject pronoun
    him: str  # object pronoun
    his: str  # possessive


def _people(names: str, he: str, him: str, his: str) -> tuple[Person, ...]:
    return tuple(Person(n, he, him, his) for n in names.split())


PEOPLE: tuple[Person, ...] = (
    *_people(
        "Liam Noah Oliver Mateo Lucas Ethan Omar Ravi Kenji Diego Samuel Tomas Yusuf Arjun "
        "Felix Hugo Marcus Andre Dmitri Kwame",
        "he",
        "him",
        "his",
    ),
    *_people(
        "Emma Olivia Amara Sofia Mei Priya Hannah Chloe Leila Ines Fatima Grace Nadia Yuki "
        "Zara Elena Maya Rosa Ingrid Abena",
        "she",
        "her",
        "her",
    ),
)

CURRENCIES = ("$", "£", "€")
RELATIVES = ("aunt", "uncle", "grandmother", "grandfather", "cousin", "older sister")
CITIES = ("Northfield", "Lakeside", "Port Ellis", "Hillcrest", "Riverton", "Ashford", "Milbrook")
SHOP_ITEMS = ("lamp", "backpack", "water bottle", "scarf", "board game", "plant pot", "mug")
GOALS = ("bicycle", "laptop", "guitar", "camera", "pair of skates", "tent", "telescope")
FOODS = ("pancakes", "muffins", "cookies", "bread rolls", "waffles", "scones")
TRIPS = ("museum trip", "science fair", "zoo visit", "field trip", "theatre outing")
FRACTIONS = ("half", "third", "quarter", "fifth")


@dataclass(frozen=True)
class Problem:
    """A story with slots: ``{name}``/``{he}``/``{him}``/``{his}`` (and capitalised
    ``{He}``/``{His}``) for one person, ``{name2}`` for a second, ``{cur}`` a currency,
    each key of ``numbers`` an integer drawn from ``range(lo, hi + 1, step)``, each key
    of ``words`` one of its strings, and ``{frac}`` a fraction's word (half, third, ...)."""

    text: str
    numbers: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    words: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _n(lo: int, hi: int, step: int = 1) -> tuple[int, int, int]:
    return (lo, hi, step)


PROBLEMS: tuple[Problem, ...] = (
    Problem(
        "{name} buys {a} notebooks at {cur}{p} each and {b} pens at {cur}{q} each. {He} "
        "pays with a {cur}100 note. How much change does {he} get?",
        dict(a=_n(2, 6), p=_n(2, 9), b=_n(2, 8), q=_n(1, 4)),
    ),
    Problem(
        "A bakery makes {a} trays of {food} every morning, with {b} on each tray. It sells "
        "{pct}% of them before noon and half of the rest in the afternoon. How many are "
        "left at closing time?",
        dict(a=_n(4, 12), b=_n(6, 24, 2), pct=_n(20, 80, 10)),
        dict(food=FOODS),
    ),
    Problem(
        "{name} drives {d} kilometres to visit {his} {relative} at an average speed of {s} "
        "kilometres per hour. On the way back {he} drives {e} kilometres per hour faster. "
        "How many hours does the round trip take?",
        dict(d=_n(60, 360, 30), s=_n(40, 80, 10), e=_n(10, 40, 10)),
        dict(relative=RELATIVES),
    ),
    Problem(
        "{name} works {h} hours a day, {d} days a week, and earns {cur}{w} an hour. {He} "
        "saves {pct}% of {his} pay. How much does {he} save in {n} weeks?",
        dict(h=_n(3, 9), d=_n(3, 6), w=_n(9, 30), pct=_n(10, 40, 5), n=_n(2, 12)),
    ),
    Problem(
        "A recipe for {a} {food} needs {f} cups of flour and {e} eggs. {name} wants to make "
        "{b} {food} for a party. How many cups of flour and how many eggs does {he} need?",
        dict(a=_n(6, 12, 2), f=_n(2, 5), e=_n(2, 4), b=_n(18, 60, 6)),
        dict(food=FOODS),
    ),
    Problem(
        "A rectangular garden is {l} metres long and {w} metres wide. {name} wants to fence "
        "it, and fencing costs {cur}{c} per metre. A gate {g} metres wide needs no fencing. "
        "How much will the fencing cost?",
        dict(l=_n(8, 40), w=_n(5, 25), c=_n(4, 15), g=_n(1, 3)),
    ),
    Problem(
        "{name} is {a} years old, and {his} {relative} is {k} times as old. In {n} years, "
        "what will their ages add up to?",
        dict(a=_n(6, 15), k=_n(3, 6), n=_n(2, 10)),
        dict(relative=RELATIVES),
    ),
    Problem(
        "{name} has {a} marbles. {He} gives a {frac} of them to {name2} and {b} to {his} "
        "{relative}, then buys {c} more. How many marbles does {name} have now?",
        dict(a=_n(60, 600, 60), b=_n(3, 12), c=_n(5, 30)),
        dict(relative=RELATIVES),
    ),
    Problem(
        "{name} wants to buy a {goal} that costs {cur}{price}. {He} already has {cur}{have} "
        "and saves {cur}{s} every week. How many weeks will it take before {he} can "
        "afford it?",
        dict(price=_n(200, 900, 25), have=_n(20, 150, 10), s=_n(10, 45, 5)),
        dict(goal=GOALS),
    ),
    Problem(
        "A store sells each {item} for {cur}{p}. During a sale everything is {pct}% off, "
        "and anyone who buys more than {k} gets another {cur}{e} off the total. {name} buys "
        "{n} of them. How much does {he} pay?",
        dict(p=_n(10, 60, 5), pct=_n(10, 40, 5), k=_n(2, 4), e=_n(5, 15, 5), n=_n(3, 9)),
        dict(item=SHOP_ITEMS),
    ),
    Problem(
        "A water tank holds {v} litres. A pipe fills it at {r} litres per minute while a "
        "leak drains {l} litres per minute. If the tank starts a {frac} full, how many "
        "minutes will it take to fill?",
        dict(v=_n(600, 3000, 120), r=_n(12, 40, 2), l=_n(1, 6)),
    ),
    Problem(
        "{name} is reading a {pages}-page book. {He} reads {a} pages on each weekday and "
        "{b} pages on each day of the weekend. How many days will it take {him} to finish "
        "the book if {he} starts on a Monday?",
        dict(pages=_n(180, 640, 20), a=_n(10, 30, 5), b=_n(30, 70, 5)),
    ),
    Problem(
        "A school has {c} classes of {s} students. {pct}% of the students signed up for "
        "the {trip}, and each bus holds {bus} passengers. Each class also sends {t} "
        "teachers. How many buses does the school need?",
        dict(c=_n(4, 12), s=_n(20, 32), pct=_n(40, 90, 10), bus=_n(30, 60, 5), t=_n(1, 2)),
        dict(trip=TRIPS),
    ),
    Problem(
        "A farmer keeps {a} hens. Each hen lays {e} eggs a week, and the farmer sells the "
        "eggs in cartons of {k} for {cur}{p} a carton. How much money do the eggs bring in "
        "over {w} weeks?",
        dict(a=_n(12, 90, 6), e=_n(3, 6), k=_n(6, 12, 6), p=_n(2, 6), w=_n(2, 8)),
    ),
    Problem(
        "On a farm there are {a} chickens, {b} goats, {c} ducks and {d} horses. How many "
        "legs do the animals have altogether, and how many more legs do the four-legged "
        "animals have than the birds?",
        dict(a=_n(5, 40), b=_n(2, 20), c=_n(3, 25), d=_n(1, 8)),
    ),
    Problem(
        "{name}'s phone plan costs {cur}{base} a month and includes {g} GB of data. Every "
        "extra gigabyte costs {cur}{x}. Last month {he} used {u} GB. How much was {his} "
        "bill, and how much would a {cur}{unl} unlimited plan have saved {him}?",
        dict(base=_n(15, 35, 5), g=_n(5, 20, 5), x=_n(2, 8), u=_n(22, 40), unl=_n(40, 60, 5)),
    ),
    Problem(
        "Cinema tickets cost {cur}{a} for adults and {cur}{c} for children. A family of "
        "{na} adults and {nc} children also buys {k} buckets of popcorn at {cur}{p} each. "
        "How much does the family spend?",
        dict(a=_n(9, 16), c=_n(5, 9), na=_n(1, 3), nc=_n(1, 5), k=_n(1, 4), p=_n(4, 8)),
    ),
    Problem(
        "{name} can paint a room in {h} hours, and {name2} can paint the same room in {h2} "
        "hours. Working together, how long will it take them to paint {n} such rooms?",
        dict(h=_n(2, 6), h2=_n(3, 8), n=_n(2, 6)),
    ),
    Problem(
        "In a basketball game {name} made {a} two-point shots, {b} three-point shots and "
        "{c} free throws worth one point each. {name2} scored {d} points fewer than {name}. "
        "How many points did the two of them score together?",
        dict(a=_n(2, 10), b=_n(1, 6), c=_n(0, 8), d=_n(2, 9)),
    ),
    Problem(
        "{name} leaves home at {hh}:{mm} and walks {d} minutes to the bus stop. {He} waits "
        "{w} minutes, the ride takes {r} minutes, and then {he} walks another {e} minutes "
        "to work. At what time does {he} arrive?",
        dict(hh=_n(6, 9), d=_n(5, 20), w=_n(2, 12), r=_n(15, 55), e=_n(3, 15)),
        dict(mm=("00", "10", "15", "30", "40", "45")),
    ),
    Problem(
        "{name} puts {cur}{p} into a savings account that pays {r}% simple interest a year. "
        "{He} adds another {cur}{q} at the start of the second year. How much is in the "
        "account at the end of year {n}?",
        dict(p=_n(500, 5000, 250), r=_n(2, 8), q=_n(100, 1000, 100), n=_n(2, 5)),
    ),
    Problem(
        "{n} friends share a restaurant bill of {cur}{f}. They leave a {t}% tip, and "
        "{name} pays {cur}{x} more than the others because {he} ordered dessert. The rest "
        "is split evenly. How much does each of the other friends pay?",
        dict(n=_n(3, 8), f=_n(60, 300, 10), t=_n(10, 20, 5), x=_n(4, 12)),
    ),
    Problem(
        "A factory has {m} machines, and each makes {a} toys an hour. The machines run {h} "
        "hours a day, but {pct}% of the toys fail inspection. How many toys pass "
        "inspection in {d} days?",
        dict(m=_n(3, 12), a=_n(20, 120, 10), h=_n(6, 16), pct=_n(2, 10), d=_n(2, 7)),
    ),
    Problem(
        "{name}'s car uses {l} litres of fuel for every 100 kilometres, and fuel costs "
        "{cur}{p} per litre. How much does the fuel cost for a trip of {k} kilometres each "
        "way, there and back?",
        dict(l=_n(5, 12), p=_n(1, 3), k=_n(50, 400, 25)),
    ),
    Problem(
        "{name} scored {a}, {b}, {c} and {d} on {his} first four tests. What score does "
        "{he} need on the fifth test to finish with an average of {avg}?",
        dict(a=_n(60, 95), b=_n(60, 95), c=_n(60, 95), d=_n(60, 95), avg=_n(75, 90)),
    ),
    Problem(
        "A shop starts the week with {a} {item}s. It sells {b} on Monday, twice as many on "
        "Tuesday, and {c} on each of the other five days. A delivery of {d} arrives on "
        "Wednesday. How many {item}s are left at the end of the week?",
        dict(a=_n(80, 300, 10), b=_n(5, 20), c=_n(3, 12), d=_n(20, 80, 10)),
        dict(item=SHOP_ITEMS),
    ),
    Problem(
        "{name} orders {p} pizzas, each cut into {s} slices. {He} eats {a} slices, each of "
        "{his} {n} friends eats {b}, and the rest is saved for later. How many slices are "
        "saved?",
        dict(p=_n(3, 8), s=_n(6, 12, 2), a=_n(2, 4), n=_n(2, 6), b=_n(2, 3)),
    ),
    Problem(
        "{name} earns {cur}{w} an hour for the first 40 hours of a week and one and a half "
        "times that rate for every hour beyond 40. Last week {he} worked {h} hours. How "
        "much did {he} earn?",
        dict(w=_n(10, 40, 2), h=_n(42, 60)),
    ),
    Problem(
        "A ribbon is {m} metres long. {name} cuts it into pieces of {c} centimetres each. "
        "How many pieces does {he} get, and how many centimetres are left over?",
        dict(m=_n(3, 20), c=_n(15, 45)),
    ),
    Problem(
        "{name} runs {a} kilometres on Monday and adds {b} kilometres to {his} distance "
        "each day after that. How far does {he} run in total from Monday to Sunday?",
        dict(a=_n(2, 6), b=_n(1, 2)),
    ),
    Problem(
        "{name} and {name2} share a flat. The rent is {cur}{r} a month, and {name} pays "
        "{pct}% of it because {he} has the bigger room. The utilities, {cur}{u} a month, "
        "are split equally. How much does {name2} pay in a year?",
        dict(r=_n(800, 2400, 100), pct=_n(55, 70, 5), u=_n(60, 200, 10)),
    ),
    Problem(
        "A library has {a} books. It gives away {pct}% of them, then receives {b} donated "
        "books and buys {c} boxes of {k} books each. How many books does it have now?",
        dict(
            a=_n(1000, 9000, 500), pct=_n(5, 25, 5), b=_n(40, 300, 20), c=_n(3, 12), k=_n(12, 30, 6)
        ),
    ),
    Problem(
        "{name} makes candles. Each candle needs {w} grams of wax, and a {kg}-kilogram "
        "block of wax costs {cur}{p}. {He} sells each candle for {cur}{s}. What is {his} "
        "profit from making and selling {n} candles?",
        dict(w=_n(100, 250, 50), kg=_n(1, 5), p=_n(10, 30, 2), s=_n(8, 20), n=_n(20, 80, 5)),
    ),
    Problem(
        "A train goes from {city} to {city2} at {s} kilometres per hour and takes {h} "
        "hours. A bus on the same route is {d} kilometres per hour slower. How much longer "
        "does the bus take, in hours and minutes?",
        dict(s=_n(80, 160, 10), h=_n(2, 5), d=_n(20, 50, 10)),
        dict(city=CITIES[:3], city2=CITIES[3:]),
    ),
    Problem(
        "{name} baked {a} {food}. {He} packed them into bags of {b}, gave {c} bags to {his} "
        "neighbours and {d} bags to {name2}. How many {food} does {he} have left?",
        dict(a=_n(36, 120, 12), b=_n(3, 6), c=_n(2, 4), d=_n(1, 3)),
        dict(food=FOODS),
    ),
    Problem(
        "{name}'s goal is {g} steps a day, on average, over a week. For the first {n} days "
        "{he} walked {a} steps a day. How many steps a day does {he} need on each of the "
        "remaining days to reach the goal?",
        dict(g=_n(6000, 12000, 500), n=_n(2, 5), a=_n(3000, 9000, 500)),
    ),
    Problem(
        "One plant is {h} centimetres tall and grows {g} centimetres a week. A second "
        "plant is {d} centimetres taller but grows {e} centimetres a week less. After how "
        "many weeks will the two plants be the same height?",
        dict(h=_n(5, 30), g=_n(3, 8), d=_n(4, 24, 2), e=_n(1, 2)),
    ),
    Problem(
        "A teacher buys {b} boxes of pencils with {k} pencils in each box. {He} gives {n} "
        "pencils to each of {his} {s} students and keeps a {frac} of what is left for the "
        "next term. How many pencils are left over after that?",
        dict(b=_n(4, 12), k=_n(12, 24, 6), n=_n(2, 4), s=_n(18, 30)),
    ),
    Problem(
        "A hall has {r} rows of {s} seats. {pct}% of the seats for a concert are sold in "
        "advance at {cur}{p} each, and the rest are sold at the door for {cur}{q} more. If "
        "every seat is filled, how much money does the concert take in?",
        dict(r=_n(10, 40), s=_n(12, 30), pct=_n(40, 90, 10), p=_n(15, 60, 5), q=_n(2, 10)),
    ),
    Problem(
        "{name} borrows {cur}{a} from {his} {relative} and pays back {cur}{p} a month. "
        "After {n} months {he} pays off the rest in one payment, adding {pct}% of that "
        "amount as thanks. How much is the last payment?",
        dict(a=_n(600, 3000, 100), p=_n(50, 150, 10), n=_n(3, 6), pct=_n(5, 10)),
        dict(relative=RELATIVES),
    ),
    Problem(
        "A swimming pool charges {cur}{d} per visit or {cur}{m} for a monthly pass. "
        "{name} swims {k} times a week. Over a four-week month, which option is cheaper, "
        "and by how much?",
        dict(d=_n(3, 9), m=_n(30, 80, 5), k=_n(2, 5)),
    ),
    Problem(
        "{name} has {a} stickers and {name2} has {b} more than {him}. Together they give "
        "away a {frac} of all their stickers. How many stickers do they have left in all?",
        dict(a=_n(20, 120, 10), b=_n(10, 60, 10)),
    ),
)

OPENINGS: tuple[str, ...] = (
    "",
    "",
    "Solve this word problem. ",
    "Here is a maths question. ",
    "Can you help me with this problem? ",
    "Question: ",
)

CLOSINGS: tuple[str, ...] = (
    "",
    "Show your work.",
    "Explain your reasoning step by step.",
    "Think it through step by step, then give the final answer.",
    "Answer with a single number.",
    "Give the final answer on its own line at the end.",
    "Explain each step briefly.",
    "Write out each calculation.",
)


def _capitalised(fields: dict[str, str]) -> dict[str, str]:
    """``{He}`` and ``{His}`` for sentences that start with the pronoun."""
    return fields | {k.capitalize(): fields[k].capitalize() for k in ("he", "his")}


def _render(problem: Problem, rng: random.Random) -> str:
    """One request: the problem's slots filled from ``rng``, an opening and a closing."""
    person, other = rng.sample(PEOPLE, 2)
    fields = _capitalised(
        dict(name=person.name, he=person.he, him=person.him, his=person.his)
    ) | dict(name2=other.name, cur=rng.choice(CURRENCIES), frac=rng.choice(FRACTIONS))
    for key, (lo, hi, step) in problem.numbers.items():
        fields[key] = str(rng.randrange(lo, hi + 1, step))
    for key, choices in problem.words.items():
        fields[key] = rng.choice(choices)
    story = problem.text.format(**fields)
    return " ".join(s for s in (rng.choice(OPENINGS) + story, rng.choice(CLOSINGS)) if s)


def math_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct problems, each from a uniformly drawn story of ``PROBLEMS``."""
    if count < 0:
        raise ValueError(f"math prompts: count={count} must be >= 0")
    rng = random.Random(f"math:{seed}")
    out: dict[str, None] = {}  # distinct texts in draw order
    # Every story has thousands of fillings or more, so repeats are rare; the bound only
    # stops a count no set of these stories can reach.
    draws = 20 * count + 100
    for _ in range(draws):
        if len(out) == count:
            break
        out.setdefault(_render(rng.choice(PROBLEMS), rng))
    if len(out) < count:
        raise ValueError(
            f"math prompts: count={count} is more than the stories yield distinct requests "
            f"({len(out)} after {draws} draws); ask for fewer"
        )
    return list(out)


def math_conversations(count: int, seed: int = 0) -> Iterator[Conversation]:
    """One user turn per problem, ids ``math/<i>``."""
    for i, prompt in enumerate(math_prompts(count, seed)):
        yield Conversation(f"math/{i}", ({"role": "user", "content": prompt},), "math")
