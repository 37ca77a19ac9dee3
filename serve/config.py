"""``ServeConfig``: everything ``specdec serve`` needs, typed and validated on construction.

A YAML file (configs/serve/*.yaml) maps onto it one to one: top-level keys are the fields
below, ``engine`` is an ``EngineConfig`` (its ``cache``, ``scheduler`` and ``speculative``
sections nested). Unknown keys are errors. Leaving ``engine.speculative`` out keeps the
server's default speculation for the model (its shipped head, else n-gram lookup);
``speculative: null`` turns speculation off.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.spec_exit_params import spec_exit_fields

if TYPE_CHECKING:  # specdec.config imports torch; the CLI parser must stay light
    from specdec.config import EngineConfig, SpeculativeConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

# The server's default speculation for a model that ships no EAGLE-3 head: n-gram prompt
# lookup (model-free). A model with a shipped head (specdec/heads) drafts with it.
DEFAULT_DRAFT_METHOD = "ngram"
# ...speculating while at most this many requests run; larger batches decode plainly with
# async scheduling. On the H200 n-gram chains win at batch 1 (1.37x on humaneval) and lose
# from batch 16 on (0.74x): docs/benchmarks.md, "N-gram prompt lookup".
DEFAULT_DRAFT_CUTOFF = 4


def default_speculative(model: str | None = None) -> SpeculativeConfig:
    """``model``'s shipped head in its tree (``packaged_heads``), else n-gram lookup;
    ``model`` None: the engine's default model."""
    from specdec.config import EngineConfig, SpeculativeConfig
    from specdec.models.packaged_heads import default_speculative as shipped

    spec = shipped(model or EngineConfig.model)
    if spec is not None:
        return spec
    return SpeculativeConfig(
        method=DEFAULT_DRAFT_METHOD, disable_by_batch_size=DEFAULT_DRAFT_CUTOFF
    )


def default_engine_config() -> EngineConfig:
    from specdec.config import EngineConfig

    return EngineConfig(speculative=default_speculative())


@dataclass
class ServeConfig:
    """The server: the engine it drives, where it listens, and its admission limits.

    Admission: at most ``engine.scheduler.max_num_seqs + max_waiting_requests`` requests
    are in flight (running or queued); one more is refused with 429 and ``Retry-After:
    retry_after_s`` instead of queueing without bound.

    SpecExit (docs/spec_exit.md): ``spec_exit`` holds the server's settings, some
    ``SpecExitParams`` fields (canonical as ``spec_exit_fields`` makes them): they override
    the draft head's recorded setting field by field, and a request's ``"spec_exit"``
    fields override them (``spec_exit_params`` layers the three over the library
    defaults). With ``spec_exit_by_default`` a request that leaves the field out opts in
    too (the draft head must have exit channels).
    """

    engine: EngineConfig = field(default_factory=default_engine_config)
    host: str = "127.0.0.1"
    port: int = 8000
    # Names clients may pass as ``model``; the first is reported by /v1/models and in
    # responses. None serves the engine's ``model`` string.
    served_model_name: list[str] | None = None
    api_key: str | None = None  # None: no authentication
    log_level: str = "info"
    max_waiting_requests: int = 1024
    retry_after_s: int = 1
    # Largest ``max_tokens`` one request may ask for (None: only the context limits it);
    # also the default for chat requests that leave max_tokens out.
    max_tokens_limit: int | None = None
    spec_exit: dict[str, Any] = field(default_factory=dict)  # SpecExitParams fields
    spec_exit_by_default: bool = False
    # The engine core runs in its own process, so HTTP work never holds the engine's
    # interpreter lock; False runs it on a thread of the server's process (debugging).
    engine_process: bool = True
    # Chat prompts are encoded off the event loop by this many threads, each encoding up
    # to ``tokenizer_max_batch`` queued prompts per call; None: sized to the machine's
    # cores (serve/prompt_encoder.py, ``default_shape``).
    tokenizer_workers: int | None = None
    tokenizer_max_batch: int | None = None

    def __post_init__(self) -> None:
        from specdec.config import EngineConfig

        if not isinstance(self.engine, EngineConfig):
            raise TypeError(f"engine={self.engine!r} is invalid; pass an EngineConfig")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is invalid; use 0..65535 (0 picks a free port)")
        if self.served_model_name is not None and (
            not self.served_model_name or not all(self.served_model_name)
        ):
            raise ValueError(
                f"served_model_name={self.served_model_name!r} is invalid; give one or more "
                "non-empty names, or leave it out to use the model's"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key is empty; give a key, or leave it out for no auth")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level={self.log_level!r} is invalid; choose one of {LOG_LEVELS}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={self.max_waiting_requests} must be >= 0")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s={self.retry_after_s} must be >= 1")
        for name in ("tokenizer_workers", "tokenizer_max_batch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(
                    f"{name}={getattr(self, name)} must be >= 1, or None to size it to the cores"
                )
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(
                f"max_tokens_limit={self.max_tokens_limit} must be >= 1, or None for no limit"
            )
        if not isinstance(self.spec_exit, dict):
            raise TypeError(
                f"spec_exit={self.spec_exit!r} is invalid; pass a mapping of SpecExitParams "
                "fields (the ones the server sets)"
            )
        self.spec_exit = spec_exit_fields(self.spec_exit)

    @property
    def model_names(self) -> list[str]:
        """Names a request's ``model`` may take; the first is the one reported."""
        return list(self.served_model_name or [self.engine.model])

    @property
    def max_in_flight(self) -> int:
        return self.engine.scheduler.max_num_seqs + self.max_waiting_requests

    @property
    def core_engine(self) -> EngineConfig:
        """``engine`` as the server's core builds it: the graphs its first requests do not
        need deferred (``EngineConfig.defer_graphs``) unless the config chose, so /health
        answers once the target's decode graphs are ready, and speculation starts when its
        graphs are."""
        if self.engine.defer_graphs is not None:
            return self.engine
        return replace(self.engine, defer_graphs=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServeConfig:
        """Build from a nested dict (a parsed YAML file); unknown keys raise."""
        from specdec.config import EngineConfig

        if not isinstance(data, dict):
            raise ValueError(f"a serve config must be a mapping, got {type(data).__name__}")
        data = dict(data)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown ServeConfig keys {sorted(unknown)}; known keys: {sorted(known)}"
            )
        if isinstance(data.get("served_model_name"), str):  # one name needs no list in YAML
            data["served_model_name"] = [data["served_model_name"]]
        engine = data.pop("engine", None)
        if engine is None:
            return cls(**data)
        if not isinstance(engine, dict):
            raise ValueError(f"engine must be a mapping, got {type(engine).__name__}")
        engine = dict(engine)
        engine.setdefault("speculative", _as_dict(default_speculative(engine.get("model"))))
        return cls(engine=EngineConfig.from_dict(engine), **data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServeConfig:
        import yaml

        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"serve config {str(path)!r} does not exist")
        try:
            return cls.from_dict(yaml.safe_load(file.read_text()) or {})
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None


def _as_dict(spec: SpeculativeConfig) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in fields(spec)}
