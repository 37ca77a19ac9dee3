"""``specdec --help`` and every command's help document what a user needs: each command
has a complete one-line summary, and each flag has help text that states its default (for
a flag whose default is None, what None means). Parsing only: no model loads."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from specdec.cli import COMMANDS, build_parser, main, summary

MAX_SUMMARY = 100


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def _rendered(value: object) -> set[str]:
    """Ways a default may be written in help text: 0.9, 16 for 16.0, 1,8 for [1, 8],
    \\n\\n for two newlines."""

    def one(v: object) -> str:
        if isinstance(v, str):
            return v.encode("unicode_escape").decode()
        if isinstance(v, float):
            return f"{v:g}"
        return str(v)

    if isinstance(value, list | tuple):
        items = [one(v) for v in value]
        return {",".join(items), ", ".join(items), " ".join(items)}
    forms = {one(value)}
    if isinstance(value, int) and not isinstance(value, bool):
        forms.add(f"{value:,}")
    return forms


def _trivial(value: object) -> bool:
    """Defaults that need no mention: None (checked separately), off switches, empties."""
    return value is None or value is argparse.SUPPRESS or isinstance(value, bool)


def _problem(parser: argparse.ArgumentParser, action: argparse.Action) -> str | None:
    """Why ``action``'s help falls short, or None."""
    if not action.help or action.help is argparse.SUPPRESS:
        return "no help text"
    text = parser._get_formatter()._expand_help(action)  # also catches a stray %
    default = action.default
    takes_value = action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction)
    states_default = re.search(r"\bdefault\b", text, re.IGNORECASE)
    if default is None or (isinstance(default, list | tuple | dict) and not default):
        says = states_default or re.search(r"\brequired\b", text)  # checked by the command
        if takes_value and not action.required and not says:
            return f"default {default!r}: the help does not say what it means"
        return None
    if _trivial(default):
        return None
    after = text[states_default.end() :] if states_default else ""
    if not any(form in after for form in _rendered(default)):
        return f"default {default!r} is not shown after 'default' in {text!r}"
    return None


def _problems() -> dict[tuple[str, str], str]:
    found = {}
    for path, parser in _parsers(build_parser()):
        for action in _options(parser):
            why = _problem(parser, action)
            if why is not None:
                found[(" ".join(path), action.option_strings[0])] = why
    return found


def test_every_flag_has_help_that_states_its_default():
    problems = _problems()
    assert not problems, "\n".join(f"{' '.join(k)}: {v}" for k, v in problems.items())


def test_every_command_has_a_complete_one_line_summary_and_a_description():
    parser = build_parser()
    listing = "".join(parser.format_help().split())  # argparse rewraps: compare sans spaces
    too_long = set()
    for path, sub in _parsers(parser):
        if path:
            assert sub.description, f"specdec {' '.join(path)} --help has no description"
            sub.format_help()  # renders
    for name, (_, fn) in COMMANDS.items():
        line = summary(fn)
        assert line.endswith(".") and not line.endswith(("..", "…")), f"{name}: {line!r}"
        assert "".join(line.split()) in listing, f"{name}'s summary is cut in --help"
        if len(line) > MAX_SUMMARY:
            too_long.add(name)
    assert not too_long, f"summaries over {MAX_SUMMARY} chars: {too_long}"
    stages = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    data_gen = stages.choices["data-gen"]
    for action in data_gen._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert choice.help.endswith("."), f"data-gen {choice.dest}: {choice.help!r}"


def test_top_level_help_is_for_users():
    text = build_parser().format_help()
    assert "COMMANDS" not in text and "register" not in text
    assert "specdec COMMAND --help" in text


def test_max_tokens_takes_none_and_refuses_with_the_values_it_accepts(capsys):
    parser = build_parser()
    assert parser.parse_args(["generate", "--max-tokens", "none"]).max_tokens is None
    assert parser.parse_args(["generate", "--max-tokens", "5"]).max_tokens == 5
    for bad in ("0", "-3", "lots"):
        with pytest.raises(SystemExit):
            main(["generate", "--max-tokens", bad])
        err = capsys.readouterr().err
        assert "use an integer >= 1, or none" in err and "None" not in err
    with pytest.raises(SystemExit):
        main(["bench", "--max-tokens", "0"])
    assert "use an integer >= 1" in capsys.readouterr().err


def test_engine_flag_defaults_are_the_engine_config_defaults():
    """The help of the engine flags states these values as literals (``specdec serve``
    resets argparse defaults), so they must stay the config's."""
    from specdec.config import EngineConfig

    config = EngineConfig()
    args = build_parser().parse_args(["generate"])
    assert args.model == config.model
    assert (args.device, args.dtype, args.attention_backend) == (
        config.device,
        config.dtype,
        config.attention_backend,
    )
    assert args.block_size == config.cache.block_size
    assert args.gpu_memory_utilization == config.cache.gpu_memory_utilization
    assert args.max_num_seqs == config.scheduler.max_num_seqs
    assert args.seed == config.seed
    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0]
             .choices["generate"]._actions}  # fmt: skip
    assert f"default: {config.scheduler.max_num_batched_tokens}" in helps["max_num_batched_tokens"]
    assert f"default: {config.scheduler.admit_batch}," in helps["admit_batch"]
    assert f"default: {config.triton_gemm_max_tokens}:" in helps["triton_gemm_max_tokens"]
    assert f"default: {config.prefill_graph_max_tokens}," in helps["prefill_graph_max_tokens"]
    assert config.cache.cpu_kv_cache_memory == 1 << 30 and "1 GiB" in helps["kv_cache_memory"]


def test_deterministic_flag_reaches_the_engine_config_and_refuses_inexact_settings():
    """``--deterministic`` on every engine command (one shared flag group) sets
    ``EngineConfig.deterministic``; settings under which a token's logits would still
    depend on its step are refused at construction, naming the setting and the fix."""
    from specdec.cli_engine import engine_kwargs
    from specdec.config import INVARIANT_ATTENTION, EngineConfig
    from specdec.serve.cli import serve_config_from_args

    parser = build_parser()
    for command in ("generate", "bench"):
        assert engine_kwargs(parser.parse_args([command, "--deterministic"]))["deterministic"]
        assert not engine_kwargs(parser.parse_args([command]))["deterministic"]
    serve = serve_config_from_args(
        parser.parse_args(["serve", "--deterministic", "--draft", "none"])
    )
    assert serve.engine.deterministic and serve.engine.compile is None
    assert not serve_config_from_args(parser.parse_args(["serve"])).engine.deterministic
    assert EngineConfig.from_flat("m", deterministic=True).deterministic
    assert EngineConfig(deterministic=True, attention_backend=INVARIANT_ATTENTION).deterministic
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=rf"attention_backend='{backend}'.*'triton_invariant'"):
            EngineConfig(deterministic=True, attention_backend=backend)
    with pytest.raises(ValueError, match=r"compile=True.*leave compile unset .* compile=False"):
        EngineConfig(deterministic=True, compile=True)
    assert not EngineConfig(deterministic=True, compile=False).compile
