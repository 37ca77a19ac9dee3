"""``LLMEngine``: requests in, one step per ``step()`` call, outputs out.

Every step has one shape, schedule → execute → update (step_mode.py); the engine holds
the shared parts (scheduler, KV cache manager, model runner, proposer, request state and
outputs in ``OutputProcessor``) and asks its step modes, in order of preference, which
runs the next step: pipelined speculative steps (greedy rows of a ``PipelinedProposer``,
an EAGLE-3 head or a block drafter; pipelined_step.py), async plain steps (async_step.py:
step N+1 launched before step N is read), else the synchronous step (sync_step.py), after
any other mode's step in flight is read. With a proposer, plain steps run while the batch
is above ``disable_by_batch_size`` (or speculation's deferred graphs, deferred_graphs.py,
are still being captured).

Steps above ``disable_by_batch_size`` do no proposer work: an EAGLE-3 head is not handed
their aux states per request (``Proposer.defer``); the forward leaves them in the runner's
aux cache at each token's KV slot, and the head reads them there once the batch is back in
its bands and it catches up. So a plain step costs what it costs without a proposer, and
the head drafts after a band switch exactly as if it had observed every step."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import TypeVar

import torch

from specdec.config import EngineConfig
from specdec.engine.async_step import AsyncStep
from specdec.engine.block_pool import BlockPool
from specdec.engine.cuda_graph import tree_graph_batch_sizes
from specdec.engine.deferred_graphs import DeferredGraphs
from specdec.engine.kv_cache_manager import KVCacheManager, cdiv
from specdec.engine.model_runner import ModelRunner
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.pipelined_step import PipelinedStep
from specdec.engine.scheduler import Scheduler
from specdec.engine.step_mode import StepMode, StepOutputs
from specdec.engine.step_sampling import StepSampler
from specdec.engine.sync_step import SyncStep
from specdec.models import ResolvedModel, load_config, load_tokenizer, resolve_model
from specdec.request import Request, RequestStatus
from specdec.sampling.sampler import Sampler
from specdec.sampling_params import SamplingParams
from specdec.spec.metrics import SpecStats
from specdec.spec.pipeline import SpecPipeline
from specdec.spec.proposer import (
    PipelinedProposer,
    make_proposer,
    make_step_hooks,
    proposer_class,
)
from specdec.step_hook import StepHook
from specdec.tree_shapes import TreeShape

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=StepMode)
H = TypeVar("H")

# With deferred graphs (EngineConfig.defer_graphs), a step under load captures one at most
# this often (counted from the last capture's end), so requests keep being served while
# they are captured.
DEFERRED_CAPTURE_INTERVAL_S = 2.0


class LLMEngine:
    def __init__(
        self, config: EngineConfig | None = None, resolved: ResolvedModel | None = None
    ) -> None:
        """``resolved``: ``config.model`` already resolved (default: resolve it here)."""
        self.config = config or EngineConfig()
        self.resolved = resolved or resolve_model(self.config.model, self.config.cache_dir)
        self._tokenizer = None  # loaded on first use (``tokenizer``)
        spec = self.config.speculative
        aux_layer_ids = ()  # what a model proposer reads, collected by every forward
        if spec is not None:
            aux_layer_ids = proposer_class(spec).aux_layers_of(spec, load_config(self.resolved))
        self.runner = ModelRunner(self.config, self.resolved, aux_layer_ids)
        self.model_config = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        self.block_size = self.config.cache.block_size
        pool = BlockPool(self.runner.num_blocks, self.config.cache.enable_prefix_caching)
        self.kv_manager = KVCacheManager(pool, self.block_size)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_manager, self.max_model_len)
        self.sampler = Sampler(torch.Generator(self.runner.device).manual_seed(self.config.seed))
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        self.proposer = make_proposer(spec, runner=self.runner) if spec is not None else None
        # Hooks on the update step (specdec/step_hook.py), in the order they judge a verify
        # row; fixed here: every step mode applies their cuts (hook_cuts.py).
        self.step_hooks: list[StepHook] = make_step_hooks(self.proposer, lambda: self.tokenizer)
        self.outputs = OutputProcessor(
            lambda: self.tokenizer,
            self.scheduler,
            self.max_model_len,
            self.proposer.release if self.proposer is not None else lambda request_id: None,
            self.step_hooks,
        )
        self.step_sampler = StepSampler(self.sampler, self.runner.device)
        self.lookahead = self.proposer.lookahead_slots if self.proposer is not None else 0
        # The tree-mask variants only speculative steps need: now, or with speculation's
        # deferred graphs (``_capture_graphs``).
        self.runner.warm_up_kernels(trees=False, draft=self._drafts_attend)
        # Pipelined speculative steps (spec/pipeline.py), on by default where steps replay
        # CUDA graphs.
        self.pipeline: SpecPipeline | None = None
        if isinstance(self.proposer, PipelinedProposer):
            pipelined = spec.pipelined
            if pipelined is None:
                pipelined = self.runner.runtime.use_cuda_graphs
            if pipelined:
                self.pipeline = SpecPipeline(self.runner, self.proposer)
        # How steps run (step_mode.py), in order of preference; set once graphs are.
        self.modes: list[StepMode] = []
        # Graphs still to capture (EngineConfig.defer_graphs), one per
        # ``capture_pending_graph``: while speculation's are, every step decodes plainly.
        self.deferred_graphs = DeferredGraphs()
        self._capture_due = 0.0  # time.monotonic() from which step() may capture one
        self._capture_graphs()
        self.async_scheduling = self.config.async_scheduling
        if self.async_scheduling is None:  # auto: where the device runs ahead of the host
            self.async_scheduling = self.runner.graphs is not None and (
                self.proposer is None or spec.disable_by_batch_size is not None
            )
        self.modes = [
            *([PipelinedStep(self)] if self.pipeline is not None else []),
            *([AsyncStep(self)] if self.async_scheduling else []),
            SyncStep(self),
        ]
        # The last step deferred its aux states (``defer_observation``): every running
        # request then is, so the next such step defers only its admissions.
        self._deferring = False
        self.num_dropped_tokens = 0  # async: tokens computed for requests already stopped
        self.spec_stats = SpecStats()
        # Give decoding rows without a draft a root-only tree when some row has one, so
        # verify steps keep the uniform shape CUDA graphs replay (the GPU path).
        self.uniform_verify = self.runner.graphs is not None
        self._ids = itertools.count()
        self.num_steps = 0

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """The target's decode and prefill graphs, then speculation's (the target's verify
        steps, the proposer's draft steps, the pipelined step, for the batches each band
        holds) and the target's graphs of wider steps: all captured now, or the last two
        left to ``capture_pending_graph`` with ``EngineConfig.defer_graphs`` (GPU path
        only)."""
        runner, defer = self.runner, bool(self.config.defer_graphs)
        on_graphs = runner.runtime.use_cuda_graphs
        sizes = self._band_graph_sizes() if on_graphs and self.proposer is not None else {}
        if self.proposer is not None and not sizes:  # no speculation graphs to wait for
            runner.warm_up_kernels(plain=False, trees=True, draft=self._drafts_attend)
        if not on_graphs:
            return
        # Chains need no tree mask, so a step that mixes prompt tokens with them (an
        # arrival) fits a prefill graph with room for their logits rows; a tree band's
        # steps (say, batch 1's) never do, and must not cost the chain bands that room.
        chains = [s.max_draft_tokens + 1 for s in sizes if s.max_draft_tokens == s.depth]
        runner.capture_graphs(max(chains, default=1), defer=defer)
        if sizes:
            # Verify graphs per tree size (root included): a band's buckets for its shape.
            tree_sizes: dict[int, list[int]] = {}
            for shape, buckets in sizes.items():
                q = shape.max_draft_tokens + 1
                tree_sizes[q] = sorted({*tree_sizes.get(q, []), *buckets})
            graphs = itertools.chain(
                self._tree_kernel_warm_up(),
                runner.verify_graph_captures(tree_sizes),
                self.proposer.capture_graphs(sizes, runner.block_table_width, self.max_model_len),
                self.pipeline.capture_graphs(sizes) if self.pipeline is not None else (),
            )
            self.deferred_graphs.add("speculation's CUDA graphs", graphs, gates_speculation=True)
            bands = "; ".join(
                f"depth {shape.depth} ({shape.max_draft_tokens} drafts), batch {buckets}"
                for shape, buckets in sizes.items()
            )
            logger.info(
                "speculation's CUDA graphs (%s) %s",
                bands,
                "are captured after start-up, between steps; steps decode plainly until "
                "they are ready"
                if defer
                else "are captured now (compiling first)",
            )
        self.deferred_graphs.add(
            "the graphs of wider steps", runner.deferred_graph_captures(), gates_speculation=False
        )
        if defer:
            # Requests arriving with the engine's start are served before a capture.
            self._capture_due = time.monotonic() + DEFERRED_CAPTURE_INTERVAL_S
            return
        while self.deferred_graphs.capture_next():
            pass

    def _tree_kernel_warm_up(self) -> Iterator[str]:
        """The tree-mask attention variants' compilation as the first item of speculation's
        graphs: before speculation starts either way, and after the engine reports ready
        when they are deferred (seconds of compilation where Triton's cache is cold)."""
        if self.runner.warm_up_kernels(plain=False, trees=True, draft=self._drafts_attend):
            yield "attention warm-up: tree-mask kernel variants"

    @property
    def _drafts_attend(self) -> bool:
        """Whether the proposer's drafts run attention kernels (``warm_up_kernels``)."""
        return self.proposer is not None and self.proposer.uses_draft_attention

    @property
    def tokenizer(self):
        """The model's tokenizer, loaded on first use: a serving core whose requests come
        as token ids and leave as token ids (``RequestOutputKind.TOKENS``) never needs
        it, and its start-up skips the load (the API process has its own)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.resolved)
        return self._tokenizer

    @property
    def has_pending_graphs(self) -> bool:
        """Whether deferred graphs (``EngineConfig.defer_graphs``) remain to capture."""
        return self.deferred_graphs.pending

    @property
    def speculation_graphs_pending(self) -> bool:
        """Whether speculation's deferred graphs remain; until none does, every step
        decodes plainly."""
        return self.deferred_graphs.gate_speculation

    @torch.inference_mode()
    def capture_pending_graph(self) -> bool:
        """Capture the next deferred CUDA graph; returns whether more remain. Runs between
        steps with nothing in flight (``step`` reads the step in flight first);
        ``specdec serve``'s core also calls it while idle. Speculation starts with the
        step after its last one."""
        if not self.deferred_graphs.pending:
            return False
        if self._mode_in_flight() is not None:
            raise RuntimeError("a deferred graph is captured only with no step in flight")
        return self.deferred_graphs.capture_next()

    def _band_graph_sizes(self) -> dict[TreeShape, list[int]]:
        """The bucketed batch sizes each band's shape needs graphs for: the buckets of the
        batch sizes in its band (``SpeculativeConfig.bands``) that a verify step can hold
        (a step of b trees of q nodes computes b * q tokens) and that speculate
        (``disable_by_batch_size``)."""
        cfg = self.config
        limit = min(cfg.cuda_graph_max_batch_size, cfg.scheduler.max_num_seqs)
        if cfg.speculative.disable_by_batch_size is not None:
            limit = min(limit, cfg.speculative.disable_by_batch_size)
        sizes: dict[TreeShape, list[int]] = {}
        low = 0  # batches above the previous band's bound
        for high, shape in self.proposer.bands:
            fits = min(limit, cfg.scheduler.max_num_batched_tokens // (shape.max_draft_tokens + 1))
            top = fits if high is None else min(fits, high)
            if top > low:
                buckets = tree_graph_batch_sizes(fits)  # the largest holds `fits` trees
                needed = {next(bs for bs in buckets if bs >= b) for b in range(low + 1, top + 1)}
                sizes[shape] = sorted({*sizes.get(shape, []), *needed})
            if high is not None:
                low = high
        return sizes

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue one request; returns its id. Raises ValueError on bad input
        without changing the engine's state. ``arrival_time``: when the request arrived,
        ``time.monotonic()`` seconds (default: now), where a caller queued it earlier."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        self._validate(token_ids, params)
        max_tokens = params.max_tokens
        if max_tokens is None:  # until the context runs out
            max_tokens = self.max_model_len - len(token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        )
        self.outputs.add(request, text)  # the step hooks admit it (or refuse: ValueError)
        self.scheduler.add_request(request)
        return request_id

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; pass at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n:,} tokens; max_model_len is {self.max_model_len:,} "
                "(the prompt plus at least one new token must fit)"
            )
        max_tokens = params.max_tokens
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n:,} tokens) + max_tokens ({max_tokens:,}) = {n + max_tokens:,} "
                f"exceeds max_model_len {self.max_model_len:,}; lower max_tokens to "
                f"{self.max_model_len - n:,} or less"
            )
        total = n + (max_tokens if max_tokens is not None else self.max_model_len - n)
        needed = cdiv(total, self.block_size)
        usable = self.kv_manager.pool.num_usable_blocks
        if needed > usable:
            raise ValueError(
                f"the request needs {needed:,} KV blocks ({total:,} tokens) but the cache has "
                f"{usable:,}; raise the KV cache size or lower max_tokens"
            )

    def abort_request(self, request_id: str) -> None:
        state = self.outputs.states.get(request_id)
        if state is not None:
            self.scheduler.finish(state.request, RequestStatus.FINISHED_ABORTED)
            self.outputs.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._mode_in_flight() is not None

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    @property
    def num_graph_steps(self) -> int:
        """Target forwards replayed from a CUDA graph so far (0 off the GPU path); the
        rest of ``num_steps`` ran eagerly."""
        return self.runner.num_graph_replays

    # ---- the step ----------------------------------------------------------------------
    @torch.inference_mode()  # also: sampling edits the forward's (inference) logits in place
    def step(self) -> StepOutputs:
        """Run one step; return outputs for requests that produced tokens (per their
        ``output_kind``: a ``TokenDelta`` for TOKENS, else a ``RequestOutput``). With
        speculation, decoding requests verify a draft tree and may emit several tokens; the
        step is otherwise the same. Under async scheduling the outputs are those of the
        step launched by the previous call. While deferred graphs remain, a step captures one
        first every ``DEFERRED_CAPTURE_INTERVAL_S`` (a call that finds a step in flight
        only reads it)."""
        if self.deferred_graphs.pending and time.monotonic() >= self._capture_due:
            if (busy := self._mode_in_flight()) is not None:
                return busy.drain()
            self.capture_pending_graph()
            self._capture_due = time.monotonic() + DEFERRED_CAPTURE_INTERVAL_S
        deferring, self._deferring = self._deferring, False
        mode = next(m for m in self.modes if m.can_run())
        busy = self._mode_in_flight()
        if busy is not None and busy is not mode:  # one mode's steps in flight at a time
            return busy.drain()
        return mode.step(deferring)

    def _mode_in_flight(self) -> StepMode | None:
        return next((m for m in self.modes if m.in_flight), None)

    def mode(self, kind: type[M]) -> M | None:
        """This engine's step mode of class ``kind``, if it runs one."""
        return next((m for m in self.modes if isinstance(m, kind)), None)

    def hook(self, kind: type[H]) -> H | None:
        """This engine's step hook of class ``kind``, if it has one."""
        return next((h for h in self.step_hooks if isinstance(h, kind)), None)

    def decodes_plainly_at(self, batch_size: int) -> bool:
        """Whether a step of ``batch_size`` requests drafts nothing: it is above the
        speculation cutoff (``disable_by_batch_size``), or deferred speculation graphs are
        still to capture."""
        if self.deferred_graphs.gate_speculation:
            return True
        limit = self.config.speculative.disable_by_batch_size
        return limit is not None and batch_size > limit

    def defer_observation(self, num_running: int, deferring: bool) -> None:
        """Leave the aux states of the step about to run in the runner's aux cache instead
        of observing them (``Proposer.defer``): the requests it computes do not speculate.
        ``deferring``: the step before deferred too, so every request that ran then is
        deferred and only those admitted by this step's schedule (past the
        ``num_running`` running before it) are new; otherwise every running request is
        deferred now, once."""
        running = self.scheduler.running
        for request in running[num_running:] if deferring else running:
            self.proposer.defer(request)
        self._deferring = True

    def speculates_next(self) -> bool:
        """Whether the next step may verify drafts, and so must run synchronously: there is
        a proposer, and the requests running and waiting do not exceed its batch-size
        cutoff (above it the synchronous step drafts nothing)."""
        if self.proposer is None or self.deferred_graphs.gate_speculation:
            return False
        limit = self.config.speculative.disable_by_batch_size
        return limit is None or self.scheduler.num_running + self.scheduler.num_waiting <= limit
