"""``BenchConfig``: what ``specdec bench`` measures, validated on construction; and the
speculation configurations a sweep expands to."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from specdec.bench.sets import DEFAULT_SETS, SetOptions, get_set
from specdec.config import SpeculativeConfig
from specdec.tree_shapes import ChainShape, DynamicTreeShape, TreeShape


@dataclass(frozen=True)
class PeerConfig:
    """HF transformers peers measured on the same prompts and device (batch 1: HF's
    prompt lookup and assisted generation take one sequence). All off by default."""

    hf_generate: bool = False  # plain greedy generate
    hf_prompt_lookup: int | None = None  # prompt_lookup_num_tokens
    hf_assistant: str | None = None  # draft model for assisted generation

    def __post_init__(self) -> None:
        if self.hf_prompt_lookup is not None and self.hf_prompt_lookup < 1:
            raise ValueError(f"hf_prompt_lookup={self.hf_prompt_lookup} must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.hf_generate or self.hf_prompt_lookup is not None or bool(self.hf_assistant)


@dataclass(frozen=True)
class BenchConfig:
    """One bench run: every speculation config × every set × every batch size.

    ``batch_sizes`` are concurrencies: at most that many requests in flight, the next
    prompt submitted as one finishes. ``num_prompts`` per set are the set's first prompts
    that fit ``max_prompt_tokens`` (default: the context left after ``max_tokens``).
    ``waves``: a run at batch size ``b`` submits ``num_requests`` requests, the set's
    prompts cycled (request ``j`` is prompt ``j mod num_prompts``). With one wave and as
    many prompts as the batch, the batch starts to drain at the first finished request, so
    the figure mixes batch ``b`` with every smaller one down to 1; with ``waves`` batches'
    worth it stays full for all but the last wave, as a server under steady load does.
    ``engine`` holds ``LLM`` keyword arguments (device, dtype, KV cache size, ...).
    """

    model: str = "smollm2-135m-instruct"
    sets: tuple[str, ...] = DEFAULT_SETS
    prompt_files: tuple[str, ...] = ()
    num_prompts: int = 16
    max_prompt_tokens: int | None = None
    batch_sizes: tuple[int, ...] = (1, 8)
    max_tokens: int = 128
    ignore_eos: bool = False
    repeats: int = 3
    warmup: int = 1
    waves: int = 1
    speculative: tuple[SpeculativeConfig, ...] = (SpeculativeConfig(method="ngram"),)
    analysis: bool = False  # untimed passes: per-step acceptance traces, target entropy
    peers: PeerConfig = field(default_factory=PeerConfig)
    engine: dict[str, Any] = field(default_factory=dict)
    set_options: SetOptions = field(default_factory=SetOptions)
    json_path: str | None = None
    markdown_path: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for name in self.sets:
            get_set(name)  # raises naming the registered sets
        if not self.sets and not self.prompt_files:
            raise ValueError("no prompt sets: name --sets or pass --prompts FILE.jsonl")
        for name, value in (
            ("num_prompts", self.num_prompts),
            ("max_tokens", self.max_tokens),
            ("repeats", self.repeats),
            ("waves", self.waves),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes={list(self.batch_sizes)} must be positive integers")
        if not self.speculative:
            raise ValueError("no speculation config to measure against plain decoding")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"speculation configs repeat: {self.labels}")

    @cached_property
    def labels(self) -> list[str]:
        """Each speculation config's row label (``labels_of``)."""
        return labels_of(self.speculative)

    def label_of(self, spec: SpeculativeConfig) -> str:
        return self.labels[self.speculative.index(spec)]

    def num_requests(self, num_prompts: int, batch_size: int) -> int:
        """Requests one run of a set submits at ``batch_size``: ``waves`` batches' worth,
        and every prompt at least once."""
        return max(num_prompts, self.waves * batch_size)


def label(spec: SpeculativeConfig) -> str:
    """A short unique name: ``ngram-k3``, ``eagle3-tree-t8-d5-n64``, ``eagle3-static-n12``;
    ``-sync`` / ``-pipelined`` when ``pipelined`` is forced off / on."""
    suffix = {None: "", False: "-sync", True: "-pipelined"}[spec.pipelined]
    # Bands: -b4k5 = chains (or trees) of depth 5 while <= 4 requests run; -b1t8d6n32 = a
    # t8-d6-n32 tree, -b1c5 a chain of 5 (a band naming its shape; @cuda: on CUDA only).
    pairs = spec.num_speculative_tokens_by_batch_size or []
    # bands holds one more entry than pairs (the last band, tree_shape): zip stops before it
    bands = "".join(
        f"-b{m}{_band_label(b, shape)}"
        for (m, b), (_, shape) in zip(pairs, spec.bands, strict=False)
    )
    if spec.tree == "chain":
        return f"{spec.method}-k{spec.num_speculative_tokens}{bands}{suffix}"
    if spec.tree == "dynamic":
        t, d, n = spec.top_k, spec.num_speculative_tokens, spec.total_tokens
        return f"{spec.method}-tree-t{t}-d{d}-n{n}{bands}{suffix}"
    return f"{spec.method}-static-n{spec.max_draft_tokens}{suffix}"


def labels_of(specs: tuple[SpeculativeConfig, ...] | list[SpeculativeConfig]) -> list[str]:
    """``label`` of each config; configs sharing one (a shape drafted by two drafters of
    one method) name their drafter's directory as well: ``eagle3[head-b]-k3``."""
    plain = [label(s) for s in specs]
    counts = Counter(plain)
    return [
        text.replace(s.method, f"{s.method}[{Path(s.model).name}]", 1)
        if counts[text] > 1 and s.model
        else text
        for s, text in zip(specs, plain, strict=True)
    ]


def _band_label(band: int | dict, shape: TreeShape) -> str:
    if not isinstance(band, dict):
        return f"k{band}"
    where = f"@{band['device']}" if "device" in band else ""
    if isinstance(shape, DynamicTreeShape):
        return f"t{shape.top_k}d{shape.depth}n{shape.total_tokens}{where}"
    if isinstance(shape, ChainShape):
        return f"c{shape.depth}{where}"
    return f"s{shape.max_draft_tokens}{where}"


def shape_fields(spec: SpeculativeConfig) -> dict[str, Any]:
    """The tree shape as flat report fields (depth, nodes; top_k/total for trees)."""
    return {
        "tree": spec.tree,
        "depth": spec.tree_shape.depth,
        "max_draft_tokens": spec.max_draft_tokens,
        "top_k": spec.top_k if spec.tree == "dynamic" else None,
        "total_tokens": spec.total_tokens if spec.tree == "dynamic" else None,
        "depth_by_batch_size": spec.num_speculative_tokens_by_batch_size or None,
    }


def sweep(
    base: SpeculativeConfig,
    chain: list[int] | None = None,
    top_k: list[int] | None = None,
    depth: list[int] | None = None,
    total_tokens: list[int] | None = None,
    pipelined: list[bool] | None = None,
) -> tuple[list[SpeculativeConfig], list[str]]:
    """The configs a sweep names, with ``base``'s method and model: chains of each K in
    ``chain``, then the dynamic-tree grid top_k × depth × total_tokens (a dimension not
    given takes ``base``'s value). No sweep at all gives ``[base]``. ``pipelined``: each
    config once per value (off: the synchronous step; on: spec/pipeline.py). Grid points the
    shape rejects (top_k > total_tokens, ...) are returned as reasons, not raised."""
    configs: list[SpeculativeConfig] = []
    skipped: list[str] = []
    # Sweep points name one shape: the base's depths by batch size do not apply.
    base = (
        replace(base, num_speculative_tokens_by_batch_size=None)
        if (chain or top_k or depth or total_tokens)
        else base
    )
    for k in chain or ():
        configs.append(replace(base, tree="chain", num_speculative_tokens=k))
    if top_k or depth or total_tokens:
        grid = itertools.product(
            top_k or [base.top_k],
            depth or [base.num_speculative_tokens],
            total_tokens or [base.total_tokens],
        )
        for t, d, n in grid:
            try:
                configs.append(
                    replace(base, tree="dynamic", top_k=t, num_speculative_tokens=d, total_tokens=n)
                )
            except ValueError as e:
                skipped.append(f"top_k={t} depth={d} total_tokens={n}: {e}")
    if not configs and not skipped:
        configs = [base]
    if pipelined:  # each shape with the speculative step synchronous and/or pipelined
        configs = [replace(c, pipelined=p) for c in configs for p in pipelined]
    return list({label(c): c for c in configs}.values()), skipped


def compare_drafters(
    configs: list[SpeculativeConfig], drafters: list[str]
) -> tuple[list[SpeculativeConfig], list[str]]:
    """``configs`` (the sweep's shapes) once more for each drafter in ``drafters``
    (``METHOD`` or ``METHOD:MODEL``, e.g. ``dflash:runs/block``): the same shapes, so every
    drafter is measured at the same verify budget (draft tokens the target checks per
    step). A shape the drafter's proposer cannot draft (``Proposer.cannot_draft``: one
    deeper than a block drafter's block) is returned as a reason, not raised."""
    from specdec.spec.proposer import proposer_class

    out: list[SpeculativeConfig] = []
    skipped: list[str] = []
    for entry in drafters:
        method, _, model = entry.partition(":")
        for c in configs:
            spec = replace(c, method=method, model=model or None)
            reason = proposer_class(spec).cannot_draft(spec)
            if reason is not None:
                skipped.append(f"{entry} {label(c)}: {reason}")
                continue
            out.append(spec)
    return out, skipped
