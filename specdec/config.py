"""Typed engine configuration. Every field is validated on construction; YAML files in
configs/ map onto these dataclasses one to one (unknown keys are errors)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from specdec.tree_shapes import ChainShape, DynamicTreeShape, StaticTreeShape, TreeShape

_GIB = 1 << 30


@dataclass
class CacheConfig:
    """Paged KV cache.

    The pool size comes from, in order: ``num_blocks`` if given; else ``kv_cache_memory``
    bytes; else on GPU ``gpu_memory_utilization`` of the device's memory minus weights and
    profiled peak activations; else (CPU) ``cpu_kv_cache_memory`` bytes. A byte budget
    holds each slot's K/V and, with an EAGLE-3 head, its aux states
    (``ModelRunner.aux_cache``).
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_memory: int = 1 * _GIB

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size={self.block_size} is invalid; use a power of two such as 16"
            )
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(
                f"num_blocks={self.num_blocks} is too small; the pool needs the null block "
                "plus at least one usable block"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} bytes must be positive")


@dataclass
class SchedulerConfig:
    """Continuous batching limits. ``max_model_len`` None means the model's own limit.

    ``admit_batch``: waiting requests start only once this many (or all that wait) can
    start together, unless nothing runs. A step that computes any prompt tokens runs
    eagerly while pure decode steps replay CUDA graphs, so admitting requests one by one
    as slots free makes nearly every step of a saturated batch eager; admitting them in
    groups keeps most steps graphed at the cost of time to first token. 1 (serving) admits
    at once; offline generation (``data-gen regenerate``) uses a quarter of max_num_seqs.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    admit_batch: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if not 1 <= self.admit_batch <= self.max_num_seqs:
            raise ValueError(
                f"admit_batch={self.admit_batch} must be in [1, max_num_seqs={self.max_num_seqs}]"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")


Band = list[Any]
"""One entry of ``num_speculative_tokens_by_batch_size``: ``[max_batch, k]`` (the config's
shape at depth ``k``) or ``[max_batch, {shape fields}]`` (another shape: ``SHAPE_FIELDS``
keys, the rest taken from the config), e.g. ``[1, {"tree": "dynamic",
"num_speculative_tokens": 6, "top_k": 8, "total_tokens": 32}]``. A shape may add
``"device": "cuda"`` (or "cpu"): the band holds on that device type only, and elsewhere
the next band takes its batch sizes (a 33-node tree verify is nearly free where the
GPU's forward is launch-bound, and costs ~5x a chain's on a CPU)."""

BAND_DEVICES = ("cuda", "cpu")


def check_depth_bands(
    pairs: list[Band] | None, tree: str, disable_by_batch_size: int | None
) -> None:
    """Validate ``num_speculative_tokens_by_batch_size`` (``SpeculativeConfig``): ``[max_batch,
    k | shape]`` pairs by increasing positive ``max_batch``, below the batch size where
    speculation stops; a depth ``k`` needs a shape whose depth can change (not static),
    a shape names ``SHAPE_FIELDS`` only. The shapes themselves validate where they are
    made (``SpeculativeConfig.bands``)."""
    if pairs is None:
        return
    example = (
        'e.g. [[4, 5]]: batches of at most 4 requests draft 5 tokens; [[1, {"tree": '
        '"dynamic", "num_speculative_tokens": 6}], [4, 5]]: a tree while one request runs'
    )
    last = 0
    for pair in pairs:
        ok_batch = len(pair) == 2 and isinstance(pair[0], int) and pair[0] >= 1
        value = pair[1] if len(pair) == 2 else None
        is_depth = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if not ok_batch or not (is_depth or (isinstance(value, dict) and value)):
            raise ValueError(
                f"num_speculative_tokens_by_batch_size entry {pair!r} must be [max_batch, k] "
                f"or [max_batch, {{shape fields}}] with positive integers ({example})"
            )
        if is_depth and tree == "static":
            raise ValueError(
                f"num_speculative_tokens_by_batch_size entry {pair!r} sets a depth, which a "
                "static tree's choices fix; give that band a shape ({...}), use tree='chain' "
                "or 'dynamic', or drop it"
            )
        if isinstance(value, dict):
            unknown = sorted(set(value) - SHAPE_FIELDS - {"device"})
            if unknown:
                raise ValueError(
                    f"num_speculative_tokens_by_batch_size entry {pair!r} names {unknown}; a "
                    f"band's shape takes {sorted(SHAPE_FIELDS)} and device"
                )
            if value.get("device", "cuda") not in BAND_DEVICES:
                raise ValueError(
                    f"num_speculative_tokens_by_batch_size entry {pair!r}: device "
                    f"{value['device']!r} must be one of {list(BAND_DEVICES)}"
                )
        if pair[0] <= last:
            raise ValueError(
                f"num_speculative_tokens_by_batch_size {pairs!r}: max_batch must increase "
                f"from entry to entry ({example})"
            )
        last = pair[0]
    if disable_by_batch_size is not None and last >= disable_by_batch_size:
        raise ValueError(
            f"num_speculative_tokens_by_batch_size reaches batch {last}, but speculation "
            f"stops above disable_by_batch_size={disable_by_batch_size}, so "
            f"num_speculative_tokens would never apply; keep every max_batch below "
            f"{disable_by_batch_size}"
        )


def make_shape(
    tree: str,
    num_speculative_tokens: int,
    top_k: int,
    total_tokens: int,
    choices: list[list[int]] | None,
) -> TreeShape:
    """The ``TreeShape`` that ``SHAPE_FIELDS`` values name (each shape validates its sizes)."""
    if tree not in ("chain", "dynamic", "static"):
        raise ValueError(f"tree={tree!r}; choose chain, dynamic or static")
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
    if tree == "chain":
        return ChainShape(num_speculative_tokens)
    if tree == "static":
        if not choices:
            raise ValueError("tree='static' needs choices, e.g. [[0], [1], [0, 0]]")
        return StaticTreeShape(choices)
    if not 1 <= top_k <= total_tokens:
        raise ValueError(
            f"dynamic tree needs 1 <= top_k ({top_k}) <= total_tokens ({total_tokens})"
        )
    return DynamicTreeShape(top_k, num_speculative_tokens, total_tokens)


def band_shape(bands: list[tuple[int | None, TreeShape]], batch_size: int) -> TreeShape:
    """The shape of the first band (``SpeculativeConfig.bands``) holding ``batch_size``."""
    return next(shape for high, shape in bands if high is None or batch_size <= high)


# SpeculativeConfig fields that name a draft shape; its depths by batch size go with it.
SHAPE_FIELDS = frozenset({"tree", "num_speculative_tokens", "top_k", "total_tokens", "choices"})
BANDS_FIELD = "num_speculative_tokens_by_batch_size"


def override_fields(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``SpeculativeConfig`` fields ``base`` with ``overrides`` on top, where the base's
    depths by batch size belong to its shape: overrides naming another shape drop them,
    another ``disable_by_batch_size`` keeps the bands below it (explicit bands win)."""
    merged = {**base, **overrides}
    bands = base.get(BANDS_FIELD)
    if bands and BANDS_FIELD not in overrides:
        limit = merged.get("disable_by_batch_size")
        kept = [pair for pair in bands if limit is None or pair[0] < limit]
        merged[BANDS_FIELD] = None if SHAPE_FIELDS.intersection(overrides) else kept or None
    return merged


@dataclass
class SpeculativeConfig:
    """How to speculate. ``method`` picks a proposer from the registry (``ngram``,
    ``eagle3``, ``draft_model``, ``dflash``: a block drafter); ``model`` is its head or
    model when it needs one.

    Tree shape: ``tree="chain"`` drafts ``num_speculative_tokens`` tokens in a line;
    ``tree="dynamic"`` grows an EAGLE-2 tree (``top_k`` children per node, depth
    ``num_speculative_tokens``, the ``total_tokens`` best nodes kept); ``tree="static"``
    uses ``choices`` (paths such as [[0], [1], [0, 0]]).

    Draft length by load: ``num_speculative_tokens_by_batch_size`` pairs ``[max_batch,
    k]`` (ascending ``max_batch``) give the steps of at most ``max_batch`` running
    requests a depth of ``k`` instead; larger batches keep ``num_speculative_tokens``.
    Each pair is a *band* (``bands``): deeper drafts pay where the target's forward costs
    little more for their extra nodes (small batches), shallower ones where it does. A
    band may name a whole shape instead of a depth (``Band``): a tree while one request
    runs, where its verify costs what a chain's does and its drafting is cheap enough
    (docs/benchmarks.md, "Tree against chain by batch size"), chains above.
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 3
    tree: str = "chain"
    top_k: int = 8
    total_tokens: int = 48
    choices: list[list[int]] | None = None
    ngram_min: int = 2
    ngram_max: int = 4
    # Above this many running requests, speculation stops paying; None = always on.
    disable_by_batch_size: int | None = None
    # [[max_batch, k | {shape fields}], ...]: steps of at most max_batch running requests
    # draft to depth k, or another shape (``Band``; the class docstring); None:
    # num_speculative_tokens at every batch size.
    num_speculative_tokens_by_batch_size: list[Band] | None = None
    # Pipelined speculative steps (spec/pipeline.py: the next step launches before
    # the host reads this one) for greedy requests of proposers that support it (eagle3,
    # dflash).
    # None: on where the device runs ahead of the host (the GPU path with CUDA graphs).
    pipelined: bool | None = None
    # torch.compile the EAGLE-3 head's layer and logits inside its captured graphs (the
    # GPU path with EngineConfig.compile). On by default: on the H200 (bf16, chain K=3) it
    # lifts the speedup from 1.39 to 1.60x at batch 1 and from 1.22 to 1.48x at batch 16
    # (docs/benchmarks.md, "Engine defaults and the A/B behind each").
    compile_head: bool = True
    # With compile_head: the whole draft side of a captured step (the catch-up state's
    # index arithmetic, the head's catch-up forward, every draft level, the tree's ranking
    # and bookkeeping) compiles as one region, so inductor fuses the dozens of small index
    # kernels between the head's layers. Off: only the head's layer and logits compile.
    # On by default: on the H200 (bf16, chain of 3, humaneval, on and off measured on one
    # machine) the draft side before verify is 64 kernels and 175 us against 117 kernels
    # and ~280 us off, and the speedup 1.92x against 1.74x at batch 1, 1.71x against 1.57x
    # at batch 16 (docs/benchmarks.md, "Engine defaults and the A/B behind each"). The
    # cost is start-up: the engine starts in 32 s (chain) to 42 s (t8-d5-n32 tree) on the
    # H200, compilation included.
    compile_growth: bool = True

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1")
        if self.tree not in ("chain", "dynamic", "static"):
            raise ValueError(f"tree={self.tree!r}; choose chain, dynamic or static")
        if self.tree == "static" and not self.choices:
            raise ValueError("tree='static' needs choices, e.g. [[0], [1], [0, 0]]")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size={self.disable_by_batch_size} must be >= 1 (or None: "
                "always speculate)"
            )
        if self.tree == "dynamic" and not 1 <= self.top_k <= self.total_tokens:
            raise ValueError(
                f"dynamic tree needs 1 <= top_k ({self.top_k}) <= total_tokens "
                f"({self.total_tokens})"
            )

        check_depth_bands(
            self.num_speculative_tokens_by_batch_size, self.tree, self.disable_by_batch_size
        )
        try:
            self.bands  # noqa: B018  (every band's shape validates its own sizes)
        except ValueError as e:
            raise ValueError(f"{e} (the tree's depth is num_speculative_tokens)") from e

    @property
    def tree_shape(self) -> TreeShape:
        """The draft-tree shape of the largest batches (depth ``num_speculative_tokens``;
        ``specdec.spec.tree``)."""
        return self._shape(self.num_speculative_tokens)

    def _shape(self, depth: int | dict[str, Any]) -> TreeShape:
        """This config's shape at ``depth``, or with a band's shape fields on top."""
        fields = {
            "tree": self.tree,
            "num_speculative_tokens": self.num_speculative_tokens,
            "top_k": self.top_k,
            "total_tokens": self.total_tokens,
            "choices": self.choices,
        }
        if isinstance(depth, dict):
            fields.update({k: v for k, v in depth.items() if k != "device"})
        else:
            fields["num_speculative_tokens"] = depth
        return make_shape(**fields)

    @property
    def bands(self) -> list[tuple[int | None, TreeShape]]:
        """``(max_batch, shape)`` by ascending ``max_batch``: a step of ``b`` running
        requests drafts the first band's shape with ``b <= max_batch``; the last band
        (``max_batch`` None) holds ``tree_shape``."""
        return self.bands_on(None)

    def bands_on(self, device_type: str | None) -> list[tuple[int | None, TreeShape]]:
        """``bands`` without those a band's ``device`` confines to another device type
        (``Band``); what a proposer on ``device_type`` drafts. None: every band."""

        def holds(band: int | dict[str, Any]) -> bool:
            device = band.get("device") if isinstance(band, dict) else None
            return device_type is None or device is None or device == device_type

        pairs = self.num_speculative_tokens_by_batch_size or []
        kept = [(m, self._shape(k)) for m, k in pairs if holds(k)]
        return [*kept, (None, self.tree_shape)]

    def shape_at(self, batch_size: int) -> TreeShape:
        """The shape a step of ``batch_size`` running requests drafts."""
        return band_shape(self.bands, batch_size)

    @property
    def max_draft_tokens(self) -> int:
        """Draft nodes per request per step at most (what verification computes)."""
        return max(s.max_draft_tokens for _, s in self.bands)


@dataclass
class EngineConfig:
    """Everything the engine needs to start.

    ``dtype``/``device``/``attention_backend`` = "auto" pick bf16 + cuda + triton when a GPU
    is present and fp32 + cpu + torch otherwise.

    ``async_scheduling``: keep one step in flight, so the host schedules and prepares step
    N+1 and handles step N's outputs while the device runs them (vLLM's async scheduling).
    Outputs are the same; a request that stops at step N has one more token computed and
    dropped. None (auto) turns it on on the CUDA-graph path. It applies to plain steps:
    speculative steps wait for their acceptance (the next draft starts from it) and run
    synchronously, so with speculation the engine runs plain steps asynchronously while
    more requests run than ``speculative.disable_by_batch_size`` and speculates (in step)
    at or below it.

    ``triton_gemm_max_tokens``: on CUDA, projections of at most this many token rows (the
    target's and a draft head's: decode and verify steps, draft levels) run the skinny
    Triton GEMM (``kernels/skinny_gemm.py``) instead of cuBLAS. 0 (the default) keeps
    cuBLAS for all: on the H200 the Triton path makes SmolLM2's batch-1 decode step slower
    (TPOT 1.10 ms against 0.97; docs/benchmarks.md, "Kernel micro-benchmarks"). The CPU
    path always uses torch's.

    ``prefill_graph_max_tokens`` / ``prefill_graph_max_seqs``: on the CUDA-graph path, steps
    with prefill tokens (prompts, prompt chunks, their mix with decodes; no draft tree) of
    at most this many tokens and sequences replay a CUDA graph per (token, sequence)
    bucket (``prefill_graphs.PrefillGraphs``) instead of launching ~800 kernels from Python.
    On the H200 a 100-token SmolLM2 prompt's TTFT is 3.4 ms with them against 18 ms
    eager (docs/benchmarks.md, "Prefill, TTFT and start-up"). A server meets such steps
    at every arrival, and an eager one holds up every decode beside it, so the sequence
    bound defaults to the decode graphs' largest batch (None: ``cuda_graph_max_batch_size``
    capped by ``max_num_seqs``). The token bound is capped by ``max_num_batched_tokens``
    and ``max_model_len`` (one bucket past it holds the padding sequences of a step that
    fills the token budget, so such a step replays a graph too); 0 for either: such steps
    run eagerly.

    ``deterministic``: speculative output equals plain output token for token, in bf16
    too: every op on the target's path gives a token's logits the same bits whatever the
    step that computes them (its number of query rows, the batch around it, the chunking
    of its prompt, prefill, decode or verified draft token). The target's projections and
    norms run batch-invariant Triton kernels at every row count (``models/invariant.py``)
    and attention the ``INVARIANT_ATTENTION`` backend; its layers stay uncompiled (CUDA
    graphs and the pipelined step still run; the draft side compiles as usual). Refused
    with another ``attention_backend`` or ``compile=True``, and on a CPU without the
    Triton interpreter (``engine/runtime.py``). Slower than the default path: cuBLAS and
    the compiled regions are off the target's path.

    ``compile``: ``torch.compile`` the target's layers (and the draft head, per
    ``SpeculativeConfig.compile_head``) inside the CUDA graphs. None (auto): on where steps
    replay graphs, except the target's layers in deterministic mode.

    ``defer_graphs``: GPU path: capture (and compile) after the engine starts, one graph
    at a time between steps (or while idle), the CUDA graphs its first requests do not
    need: speculation's (the target's verify steps, the draft's growth, the pipelined
    step), until which every step decodes plainly, and the target's decode and prefill
    graphs of steps over more than ``model_runner.STARTUP_GRAPH_SEQS`` (64) sequences,
    until which such steps run eagerly. The tokens are the same either way, only slower
    for a while; the engine is up sooner. None: off for ``LLM`` and
    ``specdec bench``, on for ``specdec serve``, whose /health then answers sooner.
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    compile: bool | None = None
    cuda_graph_max_batch_size: int = 256
    seed: int = 0
    cache_dir: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    async_scheduling: bool | None = None
    triton_gemm_max_tokens: int = 0
    prefill_graph_max_tokens: int = 8192
    prefill_graph_max_seqs: int | None = None
    defer_graphs: bool | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        spec = self.speculative
        if self.deterministic:
            _check_deterministic(self)
        if self.triton_gemm_max_tokens < 0:
            raise ValueError(
                f"triton_gemm_max_tokens={self.triton_gemm_max_tokens} must be >= 0 (0: "
                "every projection on cuBLAS)"
            )
        if self.async_scheduling and spec is not None and spec.disable_by_batch_size is None:
            raise ValueError(
                "async_scheduling=True with speculative decoding needs "
                "speculative.disable_by_batch_size: speculative steps run synchronously (a "
                "verify step needs its acceptance before the next draft), so only batches "
                "above that size, which decode plainly, can run asynchronously; set it, or "
                "leave async_scheduling unset (auto) or False"
            )
        for name in ("prefill_graph_max_tokens", "prefill_graph_max_seqs"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(
                    f"{name}={getattr(self, name)} must be >= 0 (prefill_graph_max_tokens=0 "
                    "runs steps with prefill tokens eagerly)"
                )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid; choose one of {sorted(_DTYPES)}")
        if self.cuda_graph_max_batch_size < 1:
            raise ValueError(
                f"cuda_graph_max_batch_size={self.cuda_graph_max_batch_size} must be >= 1"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Build from a nested dict (a YAML file); unknown keys raise."""
        data = dict(data)
        cache = _strict(CacheConfig, data.pop("cache", {}) or {})
        scheduler = _strict(SchedulerConfig, data.pop("scheduler", {}) or {})
        spec = data.pop("speculative", None)
        if isinstance(spec, dict):
            spec = _strict(SpeculativeConfig, spec)
        _check_keys(cls, data, exclude={"cache", "scheduler", "speculative"})
        return cls(**data, cache=cache, scheduler=scheduler, speculative=spec)

    @classmethod
    def from_flat(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments, vLLM style (``block_size=16,
        max_num_seqs=64``): cache and scheduler fields go to their sections; unknown
        keywords raise. Torch-free, so a server's API process can resolve its engine's
        config and start the engine core before importing torch."""
        cache = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_FIELDS}
        sched = {k: kwargs.pop(k) for k in list(kwargs) if k in _SCHEDULER_FIELDS}
        return cls.from_dict({"model": model, **kwargs, "cache": cache, "scheduler": sched})


INVARIANT_ATTENTION = "triton_invariant"
"""The attention backend of deterministic mode: batch-invariant paged attention."""


def _check_deterministic(config: EngineConfig) -> None:
    """Refuse the settings under which ``deterministic`` cannot hold (what needs the
    device resolved is checked in ``engine.runtime.choose_runtime``)."""
    backend = config.attention_backend
    if backend not in ("auto", INVARIANT_ATTENTION):
        raise ValueError(
            f"deterministic=True with attention_backend={backend!r}: that backend's results "
            "for a token depend on the step around it (reductions split or padded by the "
            f"step's shape); leave attention_backend='auto' or set "
            f"{INVARIANT_ATTENTION!r}"
        )
    if config.compile:
        raise ValueError(
            "deterministic=True with compile=True: torch.compile fuses the target's "
            "elementwise ops into kernels that round differently from the eager modules "
            "that prefill steps run, so a token's logits would depend on its step; leave "
            "compile unset (deterministic mode runs the target's layers eagerly inside the "
            "CUDA graphs) or set compile=False"
        )


_CACHE_FIELDS = frozenset(f.name for f in fields(CacheConfig))
_SCHEDULER_FIELDS = frozenset(f.name for f in fields(SchedulerConfig))


_DTYPES = {"auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"}


def _check_keys(cls: type, data: dict[str, Any], exclude: set[str] = frozenset()) -> None:
    known = {f.name for f in fields(cls)} - exclude
    unknown = set(data) - known
    if unknown:
        raise ValueError(
            f"unknown {cls.__name__} keys {sorted(unknown)}; known keys: {sorted(known)}"
        )


def _strict(cls: type, data: dict[str, Any]):
    _check_keys(cls, data)
    return cls(**data)
