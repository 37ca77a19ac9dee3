"""The ``code`` prompt source: programming requests composed from seeded parts.

Why it exists: the default mix (BIG-bench inputs, reasoning-gym questions, chatterbot
dialogs) and the ``writing`` source hold almost no programming requests, so a head trained
on the target's answers to them rarely sees the target write code, and its acceptance on
HumanEval lags (docs/default_head.md). No code instruction set ships offline, so requests
are composed: a *task* (a small function from coding_tasks.py: name, typed parameters and a
one-line spec), a *request style* (write it; complete a stub; fix a bug; type-hint and
document it; test it; explain then implement; a class method), a *constraint* (no imports,
doctests, edge cases, O(n log n), ...) and a *language*. Python requests are most of them;
JavaScript, Java and C take the same functions under their naming, and classes, SQL queries
and shell scripts have parts of their own. The target answers them itself (``data-gen
regenerate``): the answers, not these prompts, are what the head learns.

Invariants: the list is a pure function of (count, seed); ids are ``code/<i>`` in order;
prompts are distinct (every index of the parts' product, 140,138 combinations, renders a
different text; drawn without replacement); no task is a HumanEval function
(coding_tasks.py), and the prompts pass through the same deduplication and HumanEval
decontamination as every source (``mix.filter_conversations``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from specdec.data_gen.coding_tasks import CLASSES, GROUPS, QUERIES, SCRIPTS, Group, Task
from specdec.data_gen.records import Conversation

SYMPTOMS: tuple[str, ...] = (
    "crashes on empty input",
    "gives wrong answers at the boundaries",
    "is far too slow on large inputs",
    "changes its input by accident",
    "fails on some valid inputs I did not expect",
)

# Python stubs, in four docstring conventions; none is HumanEval's (imperative summary,
# ``>>>`` examples): summaries here are the task's third-person spec.
STUBS: tuple[str, ...] = (
    'def {name}({params}) -> {returns}:\n    """{Spec}."""\n    ...\n',
    'def {name}({params}) -> {returns}:\n    """{Spec}.\n\n    Args:\n{google_args}\n'
    '    Returns:\n        {returns}\n    """\n    raise NotImplementedError\n',
    "# {name}: {spec}\ndef {name}({params}) -> {returns}:\n    pass  # TODO\n",
    'def {name}({params}) -> {returns}:\n    """\n    {Spec}.\n\n{sphinx_args}\n'
    '    :rtype: {returns}\n    """\n',
)
STUB_INTROS: tuple[str, ...] = (
    "Complete this Python function:",
    "Fill in the body of the following Python stub so that it works:",
    "Implement the Python function below.",
)

PYTHON_TEMPLATES: tuple[str, ...] = (
    "Write a Python function `{name}({params}) -> {returns}` that {spec}.",
    "In Python, implement `{name}`, a function that {spec}.",
    "I need a Python function called `{name}` that {spec}. Its signature is "
    "`def {name}({params}) -> {returns}`.",
    "Can you write `{name}({args})` in Python? It {spec}.",
    *(f"{intro}\n\n```python\n{{stub{i}}}```" for intro in STUB_INTROS for i in range(len(STUBS))),
    *(
        f"I wrote a Python function `{{name}}({{args}})` that {{spec}}, but it {symptom}. "
        "Write a correct version and explain what was wrong."
        for symptom in SYMPTOMS
    ),
    "Write `{name}` in Python with full type hints and a docstring that documents the "
    "arguments, the return value and any exceptions raised. It {spec}.",
    "Write pytest tests for a Python function `{name}({params}) -> {returns}` that {spec}. "
    "Cover typical cases and edge cases.",
    "Write unittest test cases for `{name}({args})`, a Python function that {spec}.",
    "Explain step by step how to write a function that {spec}, then give a Python "
    "implementation named `{name}`.",
    "First describe your approach in a few sentences, then write `{name}` in Python. "
    "The function {spec}.",
    "Add a method `{name}` to a Python class `{cls}`: it {spec}.",
    "Implement `{cls}.{name}` in Python as a static method that {spec}.",
    "Write `{name}` in Python twice, once with plain loops and once in a more functional "
    "style, and compare the two. It {spec}.",
)
PYTHON_CONSTRAINTS: tuple[str, ...] = (
    "",
    "Do not use any imports.",
    "Use only the standard library.",
    "Include doctests in the docstring.",
    "Handle edge cases such as empty input.",
    "Aim for O(n log n) time or better.",
    "Raise a ValueError with a helpful message on invalid input.",
    "Keep it short and readable.",
    "Add comments that explain the tricky parts.",
    "Show an example call and its output.",
    "Avoid recursion.",
    "Follow PEP 8 and use descriptive variable names.",
)


@dataclass(frozen=True)
class Language:
    """How function tasks are asked for in a language other than Python."""

    name: str
    camel_case: bool  # JavaScript and Java name functions in camelCase
    tests: str  # the test framework asked for
    method: str  # where a class method is asked for ("" = no classes)
    constraints: tuple[str, ...]


OTHER_LANGUAGES: tuple[Language, ...] = (
    Language(
        "JavaScript",
        True,
        "Jest",
        "a method",
        (
            "",
            "Use modern ES2020+ syntax and no libraries.",
            "Add JSDoc comments.",
            "Handle edge cases such as empty input.",
            "Make it run in Node.js and show an example call.",
        ),
    ),
    Language(
        "Java",
        True,
        "JUnit 5",
        "a static method",
        (
            "",
            "Use only the Java standard library.",
            "Add Javadoc comments.",
            "Handle edge cases such as null or empty input.",
            "Aim for O(n log n) time or better.",
        ),
    ),
    Language(
        "C",
        False,
        "assert-based",
        "",
        (
            "",
            "Use only the C standard library.",
            "Free everything you allocate.",
            "Handle edge cases such as empty input or NULL pointers.",
            "Include a main() that demonstrates it.",
        ),
    ),
)
OTHER_TEMPLATES: tuple[str, ...] = (
    "Write a {lang} function `{call}` that {spec}.",
    "Implement `{call}` in {lang}. It {spec}.",
    "How would I write a function in {lang} that {spec}? Please call it `{fname}`.",
    *(
        f"I wrote a {{lang}} function `{{call}}` that {{spec}}, but it {symptom}. "
        "Write a correct version and explain what was wrong."
        for symptom in SYMPTOMS
    ),
    "Write {tests} unit tests for a {lang} function `{call}` that {spec}.",
    "Explain how to write a function that {spec}, then implement it in {lang} as `{fname}`.",
)
METHOD_TEMPLATE = "Add {method} `{fname}` to a {lang} class `{cls}` that {spec}."

CLASS_LANGUAGES = ("Python", "Java", "JavaScript")
CLASS_TEMPLATES: tuple[str, ...] = (
    "Write a {lang} class `{name}`: {spec}.",
    "Design and implement a `{name}` class in {lang}: {spec}. Include a short usage example.",
    "Implement {spec} in {lang}, as a class named `{name}`.",
    "Write unit tests for a {lang} class `{name}`, {spec}.",
    "Explain how you would design a {lang} class `{name}`, {spec}, then write it.",
)
CLASS_CONSTRAINTS: tuple[str, ...] = (
    "",
    "Keep the public interface small.",
    "Document every public method.",
    "Validate arguments so that invalid states cannot be constructed.",
    "Make instances printable in a readable form.",
)

SQL_DIALECTS = ("PostgreSQL", "SQLite", "MySQL")
SQL_TEMPLATES: tuple[str, ...] = (
    "Given the tables {schema}, write a {dialect} query that returns {what}.",
    "Write a {dialect} query for {what}. The tables are {schema}.",
    "Tables: {schema}. I need {what}. Write the SQL for {dialect} and explain how it works.",
    "My {dialect} query for {what} is slow on large tables ({schema}). Write an efficient "
    "version and suggest indexes.",
)
SQL_CONSTRAINTS: tuple[str, ...] = (
    "",
    "Use a common table expression.",
    "Use window functions where they help.",
    "Avoid correlated subqueries.",
    "Format it with one clause per line.",
)

SHELLS = ("bash", "POSIX sh")
SHELL_TEMPLATES: tuple[str, ...] = (
    "Write a {shell} script that {what}.",
    "I need a {shell} script that {what}. Explain each part briefly.",
    "How can I write a short {shell} script that {what}?",
    "My {shell} script that {what} breaks on file names with spaces. Write a robust version.",
)
SHELL_CONSTRAINTS: tuple[str, ...] = (
    "",
    "Stop on the first error and quote every variable.",
    "Print a usage message when arguments are missing.",
    "Avoid GNU-only options so that it also runs on macOS.",
    "Comment each step.",
)


def _split_params(params: str) -> list[str]:
    """'a: dict[str, int], b: int' -> ['a: dict[str, int]', 'b: int'] (commas in brackets
    stay)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(params):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(params[start:i].strip())
            start = i + 1
    return [*out, params[start:].strip()] if params.strip() else out


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def _python_fields(task: Task, group: Group) -> dict[str, str]:
    """What Python templates name: the task's parts and its four stubs (``stub0``...)."""
    params = _split_params(task.params)
    names = [p.split(":")[0] for p in params]
    fields = dict(
        name=task.name,
        params=task.params,
        returns=task.returns,
        args=", ".join(names),
        spec=task.spec,
        Spec=task.spec[0].upper() + task.spec[1:],
        cls=group.cls,
        google_args="\n".join(f"        {p}" for p in params),
        sphinx_args="\n".join(
            f"    :param {n}:\n    :type {n}: {p.split(':', 1)[1].strip()}"
            for n, p in zip(names, params, strict=True)
        ),
    )
    return fields | {f"stub{i}": stub.format(**fields) for i, stub in enumerate(STUBS)}


def _other_fields(lang: Language, task: Task, group: Group) -> dict[str, str]:
    """What other languages' templates name: the task under the language's naming."""
    fname = _camel(task.name) if lang.camel_case else task.name
    args = [p.split(":")[0] for p in _split_params(task.params)]
    args = [_camel(a) for a in args] if lang.camel_case else args
    return dict(
        lang=lang.name,
        call=f"{fname}({', '.join(args)})",
        fname=fname,
        spec=task.spec,
        tests=lang.tests,
        method=lang.method,
        cls=group.cls,
    )


def _function_request(fields: dict[str, str], template: str, constraint: str) -> str:
    return _join(template.format(**fields), constraint)


def _join(request: str, constraint: str) -> str:
    """The request and its constraint: on a line of its own after a code block."""
    if not constraint:
        return request
    return f"{request}\n\n{constraint}" if request.endswith("```") else f"{request} {constraint}"


@dataclass(frozen=True)
class _Family:
    """One language's requests: the product of ``parts``, rendered by ``render``."""

    parts: tuple[tuple, ...]
    render: Callable[..., str]

    @property
    def size(self) -> int:
        n = 1
        for part in self.parts:
            n *= len(part)
        return n

    def request(self, index: int) -> str:
        picks = []
        for part in reversed(self.parts):
            index, k = divmod(index, len(part))
            picks.append(part[k])
        return self.render(*reversed(picks))


def _families() -> tuple[_Family, ...]:
    def tasks(lang: str) -> list[tuple[Task, Group]]:
        return [(t, g) for g in GROUPS if lang in g.languages for t in g.tasks]

    def other(lang: Language) -> _Family:
        fields = tuple(_other_fields(lang, t, g) for t, g in tasks(lang.name))
        templates = OTHER_TEMPLATES + ((METHOD_TEMPLATE,) if lang.method else ())
        return _Family((fields, templates, lang.constraints), _function_request)

    python = tuple(_python_fields(t, g) for t, g in tasks("Python"))
    return (
        _Family((python, PYTHON_TEMPLATES, PYTHON_CONSTRAINTS), _function_request),
        *(other(lang) for lang in OTHER_LANGUAGES),
        _Family(
            (CLASSES, CLASS_LANGUAGES, CLASS_TEMPLATES, CLASS_CONSTRAINTS),
            lambda c, lang, t, k: _join(t.format(lang=lang, name=c[0], spec=c[1]), k),
        ),
        _Family(
            (QUERIES, SQL_DIALECTS, SQL_TEMPLATES, SQL_CONSTRAINTS),
            lambda q, d, t, k: _join(t.format(schema=q[0], what=q[1], dialect=d), k),
        ),
        _Family(
            (SCRIPTS, SHELLS, SHELL_TEMPLATES, SHELL_CONSTRAINTS),
            lambda s, sh, t, k: _join(t.format(shell=sh, what=s), k),
        ),
    )


FAMILIES = _families()
NUM_COMBINATIONS = sum(f.size for f in FAMILIES)


def code_request(index: int) -> str:
    """The request at ``index`` of the parts' product, ``0 <= index < NUM_COMBINATIONS``
    (families in ``FAMILIES`` order: Python first)."""
    if not 0 <= index < NUM_COMBINATIONS:
        raise IndexError(f"index={index} must be in [0, {NUM_COMBINATIONS})")
    for family in FAMILIES:
        if index < family.size:
            return family.request(index)
        index -= family.size
    raise AssertionError("unreachable")


def code_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct requests, drawn without replacement from the parts' product."""
    if not 0 <= count <= NUM_COMBINATIONS:
        raise ValueError(
            f"code prompts: count={count} must be in [0, {NUM_COMBINATIONS}] (the number of "
            "distinct task x style x constraint x language combinations)"
        )
    rng = random.Random(f"code:{seed}")
    return [code_request(i) for i in rng.sample(range(NUM_COMBINATIONS), count)]


def code_conversations(count: int, seed: int = 0) -> Iterator[Conversation]:
    """One user turn per request, ids ``code/<i>``."""
    for i, prompt in enumerate(code_prompts(count, seed)):
        yield Conversation(f"code/{i}", ({"role": "user", "content": prompt},), "code")
