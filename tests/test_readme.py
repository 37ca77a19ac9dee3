"""README.md and the user docs it points to agree with the code they describe.

- Every ``specdec`` command in a fenced bash block of these pages parses with the real
  ``specdec`` parser (``specdec.cli.build_parser``), so a renamed or removed flag fails
  here, naming the page, the line and argparse's message. ``train-draft`` overrides are
  also resolved against their config (unknown keys are errors), and ``serve`` commands
  are resolved into the ``ServeConfig`` they would run with.
- The README's table of ``specdec serve`` defaults is written as flags; giving those flags
  must leave the resolved server config unchanged, so the table cannot drift from the
  defaults in serve/config.py, specdec/config.py and the shipped head's config.
- README.md stays a front door: at most 300 lines, and no page carries internal history.

Parsing only: nothing here loads a model or runs a command.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from functools import partial
from pathlib import Path

import pytest

from specdec.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/training.md", "docs/interop.md")
README_MAX_LINES = 300
# The tree states current facts; the history of how they were found lives in git. These
# patterns catch work-log references: numbered work sessions, machine time slots, tickets.
HISTORY = {
    "a numbered work session": re.compile(r"\bsessions?\s+\d", re.IGNORECASE),
    # Spelled in two pieces so that this file, which the check also reads, does not match.
    "a machine time slot": re.compile(r"\ble" r"ase", re.IGNORECASE),
    "an issue number": re.compile(r"(?<![\w&/])#\d+\b|\bissues?\s+#?\d", re.IGNORECASE),
}
# Where the history check looks: every text file of the product (raw results excepted).
TREE_DIRS = ("docs", "specdec", "serve", "train", "data_gen", "configs", "scripts",
             "benchmarks", "tests")  # fmt: skip
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".json", ".txt"}
# Shell words that may come before the command itself: `for ...; do specdec ...`.
SHELL_KEYWORDS = {"do", "then", "else", "time"}
# Programs that run the specdec CLI in-process: `accelerate launch ... -m specdec.cli ...`,
# `torchrun --no-python specdec ...`.
LAUNCHERS = {"accelerate", "torchrun", "python", "python3"}
# A command holding one of these tokens is an abbreviation, not a runnable line; it is
# reported as skipped (test_placeholders_are_few), never parsed.
PLACEHOLDERS = {"...", "…"}
CONTROL = {"&&", "||", ";", "|", "&"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Command:
    page: str
    line: int  # 1-based line of the command's first physical line
    argv: tuple[str, ...]  # the arguments after `specdec`
    text: str

    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def bash_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(line number of the first line, lines) of every fenced bash/sh/shell block."""
    blocks: list[tuple[int, list[str]]] = []
    fence_open: str | None = None  # the open block's language ("" for none)
    start, current = 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = line.strip()
        if fence_open is None:
            if fence.startswith("```"):
                fence_open, start, current = fence[3:].strip().lower(), number + 1, []
        elif fence == "```":
            if fence_open in ("bash", "sh", "shell"):
                blocks.append((start, current))
            fence_open = None
        else:
            current.append(line)
    assert fence_open is None, f"unclosed code fence opened at line {start - 1}"
    return blocks


def logical_lines(start: int, lines: list[str]) -> list[tuple[int, str]]:
    """Shell lines as the shell reads them: backslash continuations joined, and a quoted
    string that spans lines kept whole. (line number of the first part, the joined line)."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    first = start
    for offset, line in enumerate(lines):
        if not pending:
            first = start + offset
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        pending.append(line)
        joined = "\n".join(pending)
        if not quote_open(joined):
            out.append((first, joined))
            pending = []
    assert not pending, f"line {first}: a quote or continuation never closes"
    return out


def quote_open(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError as e:  # shlex's only error: "No closing quotation" / "No escaped character"
        assert "closing quotation" in str(e), f"{line!r}: {e}"
        return True
    return False


def split_shell(line: str) -> list[list[str]]:
    """A shell line's simple commands (split at && || ; | &), comments dropped, quotes
    removed; ``$VARS`` stay literal."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token in CONTROL:
            segments.append([])
        else:
            segments[-1].append(token)
    return [s for s in segments if s]


def specdec_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after `specdec` if this simple command runs the specdec CLI, else None."""
    i = 0
    while i < len(tokens) and (ENV_ASSIGNMENT.match(tokens[i]) or tokens[i] in SHELL_KEYWORDS):
        i += 1
    if i == len(tokens):
        return None
    if tokens[i] == "specdec":
        return tokens[i + 1 :]
    if tokens[i] in LAUNCHERS:
        for j in range(i + 1, len(tokens)):
            if tokens[j] == "-m" and tokens[j + 1 : j + 2] == ["specdec.cli"]:
                return tokens[j + 2 :]
            if tokens[j] == "specdec" and tokens[j - 1] in ("--no-python", "--no_python"):
                return tokens[j + 1 :]
    return None


def page_commands(page: str) -> tuple[list[Command], list[Command]]:
    """(commands to parse, placeholder commands skipped) of one page."""
    commands, skipped = [], []
    text = (ROOT / page).read_text()
    for start, lines in bash_blocks(text):
        for number, line in logical_lines(start, lines):
            for tokens in split_shell(line):
                argv = specdec_argv(tokens)
                if argv is None:
                    continue
                command = Command(page, number, tuple(argv), " ".join(["specdec", *argv]))
                (skipped if PLACEHOLDERS & set(argv) else commands).append(command)
    return commands, skipped


ALL = {page: page_commands(page) for page in PAGES}
COMMANDS = [c for page in PAGES for c in ALL[page][0]]


def parse(parser: argparse.ArgumentParser, argv: list[str], where: str) -> argparse.Namespace:
    """argparse's result, or a test failure carrying its error message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
    pytest.fail(f"{where}\n  the specdec parser rejects it: {lines[-1] if lines else ''}")


def resolve(build, where: str, what: str):
    """``build()``, or a test failure naming the command and the config error."""
    try:
        return build()
    except ValueError as e:
        error = e
    pytest.fail(f"{where}\n  {what} does not resolve: {error}")


def differences(a, b, prefix: str = "") -> list[str]:
    """Dotted field paths where two (nested) dataclasses differ, with both values."""
    if is_dataclass(a) and type(a) is type(b):
        return [
            d
            for f in fields(a)
            for d in differences(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}.")
        ]
    return [] if a == b else [f"{prefix[:-1]}: {a!r} != default {b!r}"]


def exact(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` and all its subcommands' parsers with abbreviations off, so a page's
    ``--max-token`` for ``--max-tokens`` is an error, not a silent prefix match."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                exact(sub)
    return parser


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return exact(build_parser())


def test_pages_have_commands():
    """The extraction finds the commands (a broken extractor would pass everything)."""
    for page in PAGES:
        assert ALL[page][0], f"{page}: no `specdec` command found in its bash blocks"
    assert len(COMMANDS) >= 30, [c.text for c in COMMANDS]


def test_placeholders_are_few():
    skipped = [c.where() for page in PAGES for c in ALL[page][1]]
    assert len(skipped) <= 2, f"commands abbreviated with '...' are not checked: {skipped}"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.page}:{c.line}")
def test_command_parses(command: Command, parser, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs/... paths in the docs are relative to the checkout
    args = parse(parser, list(command.argv), command.where())
    if args.command == "train-draft":
        from specdec.train.config import TrainConfig

        resolve(
            partial(TrainConfig.load, args.config, args.overrides), command.where(), "its config"
        )
    if args.command == "serve":
        from specdec.serve.cli import serve_config_from_args

        monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
        resolve(partial(serve_config_from_args, args), command.where(), "its ServeConfig")
    if args.command == "import" and args.tree is not None:
        from specdec.interop.cli import _tree_defaults
        from specdec.models.packaged_heads import tree_defaults

        tree = resolve(partial(_tree_defaults, args.tree), command.where(), "its --tree")
        shipped = ROOT / args.out_dir
        if shipped.parent == ROOT / "specdec" / "heads":  # the command that ships a head
            assert asdict(tree) == tree_defaults(shipped), (
                f"{command.where()}\n  records another tree than {args.out_dir}/config.json"
            )


def code_flags(cell: str) -> list[str]:
    """The arguments in a table cell's code spans that start with ``--``."""
    spans = re.findall(r"`([^`]+)`", cell)
    return [token for span in spans if span.startswith("--") for token in shlex.split(span)]


def serve_default_rows() -> list[tuple[str, list[str], list[str]]]:
    """(setting, its context flags, its default flags) for each row of the README's table
    of serve defaults: the table right after the HTML comment that names this test. A flag
    in the setting cell (``--model path/to/model``) is the context the defaults hold in."""
    lines = (ROOT / "README.md").read_text().splitlines()
    marker = next(
        (i for i, line in enumerate(lines) if "<!--" in line and "test_readme.py" in line), None
    )
    assert marker is not None, "README.md: the serve-defaults table's marker comment is gone"
    header = next(i for i in range(marker, len(lines)) if lines[i].startswith("|"))
    rows = []
    for line in lines[header + 2 :]:  # past the header and its separator
        if not line.startswith("|"):
            break
        setting, value = (cell.strip() for cell in line.strip().strip("|").split("|", 1))
        rows.append((setting, code_flags(setting), code_flags(value)))
    assert rows, "README.md: no rows under the serve-defaults marker"
    return rows


SERVE_ROWS = serve_default_rows()


def test_serve_speculates_by_default(parser, monkeypatch):
    from specdec.serve.cli import serve_config_from_args

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    plain = serve_config_from_args(parse(parser, ["serve"], "specdec serve"))
    assert plain.engine.speculative is not None, "specdec serve speculates by default"


def test_default_yaml_is_the_defaults(parser, monkeypatch):
    """README: configs/serve/default.yaml writes the serve defaults out."""
    from specdec.serve.cli import serve_config_from_args

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    argv = ["serve", "--config", "configs/serve/default.yaml"]
    diff = differences(
        serve_config_from_args(parse(parser, argv, "specdec " + shlex.join(argv))),
        serve_config_from_args(parse(parser, ["serve"], "specdec serve")),
    )
    assert not diff, "configs/serve/default.yaml differs from the defaults:\n  " + "\n  ".join(diff)


@pytest.mark.parametrize("row", SERVE_ROWS, ids=lambda row: row[0])
def test_readme_serve_defaults(row, parser, monkeypatch):
    """A row's flags, given to `specdec serve` (after its context flags), change nothing:
    they are the defaults."""
    from specdec.serve.cli import serve_config_from_args

    setting, context, flags = row
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    assert flags, f"README serve defaults, row {setting!r}: no `--flag value` to check"
    where = f"README serve defaults, row {setting!r}: " + shlex.join(["specdec", "serve", *context])
    default = serve_config_from_args(parse(parser, ["serve", *context], where))
    where = f"{where} {shlex.join(flags)}"
    given = serve_config_from_args(parse(parser, ["serve", *context, *flags], where))
    # What the server runs: the config with its engine as the core builds it.
    diff = differences(
        replace(given, engine=given.core_engine),
        replace(default, engine=default.core_engine),
    )
    assert not diff, f"{where}\n  is not the default:\n  " + "\n  ".join(diff)


def test_serve_defaults_check_can_fail(parser, monkeypatch):
    """A value other than the default is caught (the comparison is not vacuous)."""
    from specdec.serve.cli import serve_config_from_args

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    default = serve_config_from_args(parse(parser, ["serve"], "specdec serve"))
    for flags in (["--port", "8001"], ["--num-speculative-tokens", "4"], ["--max-num-seqs", "8"]):
        assert serve_config_from_args(parse(parser, ["serve", *flags], str(flags))) != default


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--max-new-tokens", "8"],  # a flag generate does not have
        ["generate", "--max-token", "8"],  # an abbreviation of --max-tokens
        ["data-gen", "vocab", "-i", "d", "-o", "v", "--draft-vocab", "16384"],  # nested
        ["serve", "--spec-tree", "wide"],  # a value outside the choices
    ],
)
def test_bad_command_fails(parser, argv):
    """A command the parser rejects is a test failure carrying argparse's message."""
    with pytest.raises(pytest.fail.Exception, match=r"the specdec parser rejects it: .*error"):
        parse(parser, argv, "specdec " + " ".join(argv))


def test_readme_length():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it at most {README_MAX_LINES} and move "
        "detail to docs/"
    )


def _tree_texts() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for top in TREE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).parts
            if path.suffix not in TEXT_SUFFIXES or "__pycache__" in rel:
                continue
            if rel[:2] == ("benchmarks", "results"):  # git-ignored raw output
                continue
            files.append(path)
    return files


def test_no_internal_history_in_the_tree():
    found = []
    for path in _tree_texts():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [
            f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}"
            for number, line in enumerate(text.splitlines(), 1)
            for what, pattern in HISTORY.items()
            if pattern.search(line)
        ]
    assert not found, "the tree states current facts, not history:\n" + "\n".join(found)
