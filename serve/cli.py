"""``specdec serve`` and ``specdec bench-serve``, registered in ``specdec.cli.COMMANDS``.

Settings come, lowest precedence first, from ServeConfig's defaults, a ``--config`` YAML
file, ``--spec-config``, then the flags given on the command line. Heavy imports (torch,
FastAPI) wait until a command runs, so ``specdec generate`` needs neither the serve extra
nor its start-up cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from specdec.cli import TREE_FLAGS, _add_engine_args, _engine_kwargs, _read_prompts, command

# Engine keyword (``_engine_kwargs``) -> the flags that set it, where the names differ.
_ENGINE_SOURCES = {"enable_prefix_caching": ("no_prefix_caching", "enable_prefix_caching")}
# Speculation flags -> SpeculativeConfig fields.
_SPEC_FLAGS = {"draft": "method", "draft_model": "model", **TREE_FLAGS}
# Server flags -> ServeConfig fields.
_SERVER_FLAGS = {
    "host": "host",
    "port": "port",
    "api_key": "api_key",
    "served_model_name": "served_model_name",
    "serve_log_level": "log_level",
    "max_waiting_requests": "max_waiting_requests",
    "max_tokens_limit": "max_tokens_limit",
    "spec_exit_by_default": "spec_exit_by_default",
    "engine_process": "engine_process",
    "tokenizer_workers": "tokenizer_workers",
    "tokenizer_max_batch": "tokenizer_max_batch",
}


def _serve_args(p: argparse.ArgumentParser) -> None:
    from specdec.serve.config import DEFAULT_DRAFT_METHOD, LOG_LEVELS, ServeConfig

    _add_engine_args(p)
    draft = _action(p, "draft")
    draft.help = (
        f"speculate with this proposer, or 'none' for plain decoding (default: the model's "
        f"shipped head, else {DEFAULT_DRAFT_METHOD})"
    )
    defaults = {f.name: f.default for f in fields(ServeConfig)}
    g = p.add_argument_group("server")
    g.add_argument(
        "--config",
        help="YAML ServeConfig (see configs/serve/); given flags override it (default: none, "
        "ServeConfig's defaults)",
    )
    g.add_argument(
        "--spec-config",
        help="speculation as JSON or a .yaml/.json file of SpeculativeConfig fields (method, "
        "num_speculative_tokens, tree, top_k, total_tokens, choices, ...); the --draft and "
        "--spec-* flags given override it (default: none, the model's shipped head or n-gram)",
    )
    g.add_argument("--host", help=f"default: {defaults['host']}")
    g.add_argument("--port", type=int, help=f"default: {defaults['port']}")
    g.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECDEC_API_KEY, else no auth)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        help="names clients may use (default: the --model string)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="share KV blocks of common prompt prefixes (default: on)",
    )
    g.add_argument(
        "--log-level",
        dest="serve_log_level",
        choices=LOG_LEVELS,
        help=f"default: {defaults['log_level']}",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        help="requests queued beyond --max-num-seqs; more get 429 "
        f"(default: {defaults['max_waiting_requests']})",
    )
    g.add_argument(
        "--max-tokens-limit",
        type=int,
        help="largest max_tokens a request may ask for (default: the context length)",
    )
    g.add_argument(
        "--spec-exit",
        help="SpecExit settings as JSON or a .yaml/.json file of SpecExitParams fields "
        "(confidence_above, progress_above, remaining_below, smoothing, alpha, think_start, "
        "think_end, delimiters, ...): they override the draft head's recorded setting, and "
        "a request's spec_exit overrides them (default: none, the head's recorded setting)",
    )
    g.add_argument(
        "--spec-exit-by-default",
        action=argparse.BooleanOptionalAction,
        help="requests that leave spec_exit out opt in too (needs a head with SpecExit "
        "channels; default: off)",
    )
    g.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        help="run the engine core in its own process, apart from HTTP work (default: on; "
        "--no-engine-process runs it on a thread of the server's process)",
    )
    g.add_argument(
        "--tokenizer-workers",
        type=int,
        help="threads that encode chat prompts off the event loop (default: half the CPU "
        "cores, at most 8)",
    )
    g.add_argument(
        "--tokenizer-max-batch",
        type=int,
        help="prompts one of those threads encodes per call (default: max(4, 16 // workers))",
    )
    # Every flag defaults to None, meaning "not given": the config (ServeConfig's defaults,
    # or --config) supplies the value, so a given flag always wins, even one that repeats
    # a default.
    serve_flags = []
    for action in p._actions:
        if action.dest != "help":
            action.default = None
            serve_flags.append(action.dest)
    p.set_defaults(serve_flags=tuple(serve_flags))


def _action(p: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in p._actions if a.dest == dest)


def serve_config_from_args(args: argparse.Namespace):
    """The ServeConfig that ``specdec serve ARGS`` runs with."""
    from specdec.config import EngineConfig, SpeculativeConfig, override_fields
    from specdec.models.packaged_heads import head_speculative, packaged_head
    from specdec.serve.config import ServeConfig, default_speculative
    from specdec.spec_exit_params import spec_exit_fields

    given = {d for d in args.serve_flags if getattr(args, d) is not None}
    base = ServeConfig.from_yaml(args.config) if args.config else ServeConfig()
    # Engine: the base's fields, flattened as EngineConfig.from_flat takes them.
    flat: dict[str, Any] = {f.name: getattr(base.engine, f.name) for f in fields(base.engine)}
    for section in ("cache", "scheduler"):
        section_config = flat.pop(section)
        flat.update({f.name: getattr(section_config, f.name) for f in fields(section_config)})
    if "model" in given:
        if flat["speculative"] == default_speculative(flat["model"]):  # the old model's
            flat["speculative"] = default_speculative(args.model)
        flat["model"] = args.model
    for key, value in _engine_kwargs(argparse.Namespace(**{**vars(args), "draft": None})).items():
        if key != "speculative" and given & set(_ENGINE_SOURCES.get(key, (key,))):
            flat[key] = value
    if args.enable_prefix_caching is not None:
        flat["enable_prefix_caching"] = args.enable_prefix_caching
    spec = flat["speculative"]
    spec_fields = _as_fields(spec) if spec is not None else None
    if args.spec_config:
        spec_fields = _load_spec_fields(args.spec_config)
    flags = {_SPEC_FLAGS[d]: getattr(args, d) for d in _SPEC_FLAGS if d in given}
    if flags.get("method") == "auto":  # the model's default, tree flags on top
        del flags["method"]
        spec_fields = _as_fields(default_speculative(flat["model"]))
    if flags.get("method") == "eagle3" and "model" not in flags:
        head = packaged_head(flat["model"])
        if head is not None:
            flags["model"] = str(head)
    if flags.get("method") == "none":
        spec_fields = None
    elif flags:
        if (
            spec_fields is None
            or flags.get("method", spec_fields["method"]) != spec_fields["method"]
        ):
            # A new proposer starts from SpeculativeConfig's defaults, not another method's
            # fields (an eagle3 head path means nothing to ngram).
            spec_fields = _as_fields(SpeculativeConfig())
            if "method" not in flags:
                spec_fields = _as_fields(default_speculative(flat["model"]))
        method = flags.get("method", spec_fields["method"])
        if method == "eagle3" and flags.get("model", spec_fields["model"]) != spec_fields["model"]:
            # Another head drafts in the tree its own config records, not the replaced one's.
            spec_fields = _as_fields(head_speculative(flags["model"]))
        spec_fields = override_fields(spec_fields, flags)
    flat["speculative"] = SpeculativeConfig(**spec_fields) if spec_fields is not None else None
    engine = EngineConfig.from_flat(flat.pop("model"), **flat)
    server = {f.name: getattr(base, f.name) for f in fields(base) if f.name != "engine"}
    for dest, name in _SERVER_FLAGS.items():
        if dest in given:
            server[name] = getattr(args, dest)
    if "api_key" not in given and os.environ.get("SPECDEC_API_KEY"):
        server["api_key"] = os.environ["SPECDEC_API_KEY"]
    if "spec_exit" in given:
        settings = spec_exit_fields(_json_or_file(args.spec_exit, "--spec-exit"))
        server["spec_exit"] = {**server["spec_exit"], **settings}  # the flag's over the file's
    return ServeConfig(engine=engine, **server)


def _as_fields(spec) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in fields(spec)}


def _json_or_file(value: str, flag: str) -> Any:
    """A flag's value: inline JSON, or a .json/.yaml file."""
    import yaml

    path = Path(value)
    if value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON ({e})") from None
    if path.is_file():
        return yaml.safe_load(path.read_text())  # YAML is a superset of JSON
    raise ValueError(f"{flag} {value!r} is neither inline JSON nor an existing file")


def _load_spec_fields(value: str) -> dict[str, Any]:
    """``--spec-config``: inline JSON, or a .json/.yaml file; keys must be fields."""
    from specdec.config import SpeculativeConfig

    data = _json_or_file(value, "--spec-config")
    known = {f.name for f in fields(SpeculativeConfig)}
    if not isinstance(data, dict) or set(data) - known:
        extra = sorted(set(data) - known) if isinstance(data, dict) else data
        raise ValueError(f"--spec-config has unknown keys {extra}; known keys: {sorted(known)}")
    return {**_as_fields(SpeculativeConfig()), **data}


@command("serve", _serve_args)
def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a model over an OpenAI-compatible HTTP API (completions, chat, SSE, /metrics)."""
    from specdec.serve.launch import launch, missing_serve_module

    config = serve_config_from_args(args)
    level = config.log_level.upper()
    logging.getLogger().setLevel("DEBUG" if level == "TRACE" else level)
    if missing := missing_serve_module():
        raise SystemExit(_missing_extra(missing))
    # The engine core starts before this process imports FastAPI (and, on the tokenizer's
    # thread, torch): those imports then overlap the core's.
    started = launch(config)
    try:
        from specdec.serve.app import run_server
    except ImportError as e:
        started.abort()
        raise SystemExit(_missing_extra(e.name)) from None
    run_server(config, started)
    return 0


def _missing_extra(module: str | None) -> str:
    return (
        f"error: specdec serve needs the serve extra ({module} is missing); "
        "install it with: pip install 'specdec[serve]'"
    )


def _bench_args(p: argparse.ArgumentParser) -> None:
    from specdec.serve.bench import BenchConfig
    from specdec.serve.spec_metrics import METRICS_SOURCES

    d = BenchConfig()
    p.add_argument(
        "--base-url", "--url", dest="base_url", default=d.base_url,
        help="the server: specdec serve, vLLM or any OpenAI-compatible one (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--endpoint", default=d.endpoint, choices=["chat", "completions"],
        help="/v1/chat/completions or /v1/completions (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument(
        "--prompts-file",
        help=".txt (one per line) or .jsonl ({prompt} or {messages} objects) (default: a "
        "built-in set of short chat prompts)",
    )
    p.add_argument(
        "--num-prompts", type=int, default=d.num_prompts,
        help="requests to send; prompts cycle (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, default=d.max_tokens,
        help="max_tokens of every request (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--temperature", type=float, default=d.temperature,
        help="sampling temperature, 0 for greedy (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    p.add_argument(
        "--concurrency", type=int, default=None,
        help="most requests in flight (default: unbounded)",
    )  # fmt: skip
    p.add_argument(
        "--request-rate", type=float, default=d.request_rate,
        help="requests/s, Poisson arrivals (default: inf, all at once)",
    )  # fmt: skip
    p.add_argument(
        "--seed", type=int, default=d.seed,
        help="seed of the Poisson arrival times (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--api-key", default=os.environ.get("SPECDEC_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $SPECDEC_API_KEY, else none)",
    )  # fmt: skip
    p.add_argument(
        "--json", dest="json_out",
        help="write the report to this file (default: none, print only)",
    )  # fmt: skip
    p.add_argument(
        "--metrics-source", default=d.metrics_source, choices=["auto", *METRICS_SOURCES],
        help="whose /metrics names τ is read from (default: auto, whichever are there)",
    )  # fmt: skip


@command("bench-serve", _bench_args)
def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Benchmark a running OpenAI-compatible server under load.

    Sends requests at a concurrency and request rate and reports throughput and
    TTFT/TPOT/ITL/end-to-end percentiles, like vLLM's serving benchmark, plus τ and
    per-position acceptance from its /metrics (specdec's or vLLM's)."""
    from specdec.serve.bench import DEFAULT_PROMPTS, BenchConfig, format_report, run_benchmark

    config = BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        prompts=_read_prompts(args.prompts_file) if args.prompts_file else list(DEFAULT_PROMPTS),
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        api_key=args.api_key,
        metrics_source=args.metrics_source,
    )
    report = asyncio.run(run_benchmark(config))
    print(format_report(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return 0 if report["completed"] else 1
