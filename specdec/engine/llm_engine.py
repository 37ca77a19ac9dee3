"""The engine loop: ``step()`` = schedule → prepare inputs → forward → sample → update
requests (append tokens, detokenize, check stops, free finished requests' blocks).

Under async scheduling (``EngineConfig.async_scheduling``) one step stays in flight:
``step()`` schedules and launches step N+1 (its decode rows read step N's sampled tokens
on the device), then reads step N's tokens and updates requests while the device runs
N+1, so host work and device work overlap instead of alternating. With a proposer the
engine runs plain steps asynchronously while the batch is above
``disable_by_batch_size``; speculative steps are pipelined the same way where they can be
(``spec_pipeline.py``: greedy rows of an EAGLE-3 head), else synchronous, after the step
in flight is read.

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
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.config import EngineConfig
from specdec.device.staging import to_device, to_host
from specdec.engine.block_pool import BlockPool
from specdec.engine.cuda_graph import tree_graph_batch_sizes
from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.engine.input_batch import PendingTokens
from specdec.engine.kv_cache_manager import KVCacheManager, cdiv
from specdec.engine.model_runner import ModelRunner
from specdec.engine.scheduler import ScheduledRequest, Scheduler
from specdec.engine.spec_pipeline import SpecLaunch, SpecPipeline
from specdec.models import load_config, load_tokenizer, resolve_model
from specdec.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TokenDelta,
    TokenLogprobs,
)
from specdec.request import Request, RequestStatus
from specdec.sampling.sampler import LogprobsTensors, Sampler, SamplingMetadata
from specdec.sampling.seeded_stream import SeededStream
from specdec.sampling_params import RequestOutputKind, SamplingParams
from specdec.spec.acceptance import accept_batch, greedy_accept_batch
from specdec.spec.metrics import SpecStats
from specdec.spec.proposer import PipelinedProposer, make_proposer, proposer_class
from specdec.spec.spec_exit import ExitCut, SpecExitState
from specdec.spec.spec_exit_runtime import SpecExitRuntime
from specdec.spec.tree import DraftTree, root_only_tree
from specdec.tree_shapes import TreeShape

logger = logging.getLogger(__name__)

# With deferred draft graphs (SpeculativeConfig.defer_graphs), a step under load captures
# one at most this often (counted from the last capture's end), so requests keep being
# served while they are captured.
DEFERRED_CAPTURE_INTERVAL_S = 2.0


@dataclass
class _RequestState:
    """Engine-side companions of a Request (the Request itself stays torch-free)."""

    request: Request
    prompt: str | None
    # None when the text is only needed at the end (FINAL_ONLY without stop strings):
    # the output is then decoded once instead of token by token; or not at all (TOKENS).
    detokenizer: IncrementalDetokenizer | None
    stream: SeededStream | None  # seeded random requests only
    logprobs: list[TokenLogprobs] | None = None
    pending_delta: list[str] = field(default_factory=list)
    num_sent_tokens: int = 0  # output tokens already carried by a DELTA output
    spec_stats: SpecStats = field(default_factory=SpecStats)
    spec_exit: SpecExitState | None = None  # the request opted into SpecExit
    # A pipelined step launched from an outcome that SpecExit then cut: its row for this
    # request is stale and dropped when read.
    stale_launch: SpecLaunch | None = None


class _InFlight:
    """A launched step whose sampled tokens the host has not read (async scheduling).
    Their copy to the host is queued behind the step (``to_host``), so reading them waits
    for this step only, not for the one launched after it."""

    def __init__(
        self,
        requests: list[Request],  # each sampled row's request, in row order
        token_ids: torch.Tensor,  # [num_sampled] int64, on the model's device
        logprobs: LogprobsTensors | None,
    ) -> None:
        self.requests = requests
        self.token_ids = token_ids
        self.logprobs = logprobs
        self._host = to_host(token_ids)

    def pending(self) -> PendingTokens:
        return PendingTokens(self.token_ids, {r.request_id: i for i, r in enumerate(self.requests)})

    def read(self) -> list[int]:
        return self._host.tolist()


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.resolved = resolve_model(self.config.model, cache_dir=self.config.cache_dir)
        self.tokenizer = load_tokenizer(self.resolved)
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
        self._states: dict[str, _RequestState] = {}
        self.proposer = make_proposer(spec, runner=self.runner) if spec is not None else None
        self.lookahead = self.proposer.lookahead_slots if self.proposer is not None else 0
        # SpecExit (docs/spec_exit.md) needs a proposer whose trees carry exit signals.
        signals = self.proposer.exit_signals if self.proposer is not None else ()
        self.spec_exit = (
            SpecExitRuntime(self.tokenizer, signals, self.proposer.spec_exit_defaults)
            if signals
            else None
        )
        self.runner.warm_up_kernels(trees=self.proposer is not None)
        # Pipelined speculative steps (spec_pipeline.py), on by default where steps replay
        # CUDA graphs; the one in flight.
        self.pipeline: SpecPipeline | None = None
        if isinstance(self.proposer, PipelinedProposer):
            pipelined = spec.pipelined
            if pipelined is None:
                pipelined = self.runner.runtime.use_cuda_graphs
            if pipelined:
                self.pipeline = SpecPipeline(self.runner, self.proposer)
        # The launches in flight: a step, then arrivals' prefills (SpecPipeline.arrive).
        self._spec_in_flight: list[SpecLaunch] = []
        # The draft's graphs still to capture (SpeculativeConfig.defer_graphs): one per
        # ``capture_pending_graph``; every step decodes plainly until none is left.
        self._pending_graphs: Iterator[str] | None = None
        self._capture_due = 0.0  # time.monotonic() from which step() may capture one
        self._capture_times: dict[str, list[float]] = {}  # graph family -> seconds each
        self._capture_graphs()
        self.async_scheduling = self.config.async_scheduling
        if self.async_scheduling is None:  # auto: where the device runs ahead of the host
            self.async_scheduling = self.runner.graphs is not None and (
                self.proposer is None or spec.disable_by_batch_size is not None
            )
        self._in_flight: _InFlight | None = None
        # The last step deferred its aux states (``_defer``): every running request then
        # is, so the next such step defers only its admissions.
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
        """Target graphs for decode and verify steps, then the proposer's draft steps and
        the pipelined step for batches a verify step can hold (GPU path only)."""
        runner = self.runner
        if not runner.runtime.use_cuda_graphs:
            return
        if self.proposer is None:
            runner.capture_graphs()
            return
        sizes = self._band_graph_sizes()
        if not sizes:
            runner.capture_graphs()
            return
        # Verify graphs per tree size (root included): a band's buckets for its shape.
        tree_sizes: dict[int, list[int]] = {}
        for shape, buckets in sizes.items():
            q = shape.max_draft_tokens + 1
            tree_sizes[q] = sorted({*tree_sizes.get(q, []), *buckets})
        # Chains need no tree mask, so a step that mixes prompt tokens with them (an
        # arrival) fits a prefill graph with room for their logits rows; a tree band's
        # steps (say, batch 1's) never do, and must not cost the chain bands that room.
        chains = [s.max_draft_tokens + 1 for s in sizes if s.max_draft_tokens == s.depth]
        runner.capture_graphs(tree_sizes, max(chains, default=1))
        bands = "; ".join(
            f"depth {shape.depth} ({shape.max_draft_tokens} drafts), batch {buckets}"
            for shape, buckets in sizes.items()
        )
        graphs = self.proposer.capture_graphs(sizes, runner.block_table_width, self.max_model_len)
        if self.pipeline is not None:
            graphs = itertools.chain(graphs, self.pipeline.capture_graphs(sizes))
        self._pending_graphs = graphs
        if self.config.speculative.defer_graphs:
            # Requests arriving with the engine's start are served before a capture.
            self._capture_due = time.monotonic() + DEFERRED_CAPTURE_INTERVAL_S
            logger.info(
                "the draft's CUDA graphs (%s) are captured after start-up, between steps; "
                "steps decode plainly until they are ready",
                bands,
            )
            return
        logger.info("capturing the draft's CUDA graphs (compiling first): %s", bands)
        while self.capture_pending_graph():
            pass

    @property
    def has_pending_graphs(self) -> bool:
        """Whether deferred draft graphs remain to capture (``SpeculativeConfig.
        defer_graphs``); until none does, every step decodes plainly."""
        return self._pending_graphs is not None

    @torch.inference_mode()
    def capture_pending_graph(self) -> bool:
        """Capture the draft's next pending CUDA graph; returns whether more remain. Runs
        between steps with nothing in flight (``step`` reads the step in flight first);
        ``specdec serve``'s core also calls it while idle. Speculation starts with the
        step after the last one."""
        graphs = self._pending_graphs
        if graphs is None:
            return False
        if self._in_flight is not None or self._spec_in_flight:
            raise RuntimeError("a draft graph is captured only with no step in flight")
        t0 = time.perf_counter()
        label = next(graphs, None)
        if label is not None:
            family = label.partition(":")[0]
            self._capture_times.setdefault(family, []).append(time.perf_counter() - t0)
            logger.debug("captured the draft graph of %s", label)
            return True
        self._pending_graphs = None
        logger.info(
            "captured the draft's CUDA graphs in %.1f s (%s); speculation is on",
            sum(sum(t) for t in self._capture_times.values()),
            ", ".join(
                f"{family}: {len(t)} graphs, {sum(t):.1f} s"
                for family, t in self._capture_times.items()
            ),
        )
        return False

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
    ) -> str:
        """Validate and queue one request; returns its id. Raises ValueError on bad input
        without changing the engine's state."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        self._validate(token_ids, params)
        spec_exit = None
        if params.spec_exit is not None:
            if self.spec_exit is None:
                raise ValueError(
                    "spec_exit needs an EAGLE-3 draft head with SpecExit channels; this "
                    "engine's speculation has none (leave spec_exit out)"
                )
            spec_exit = self.spec_exit.start(params.spec_exit, token_ids)
        max_tokens = params.max_tokens
        if max_tokens is None:  # until the context runs out
            max_tokens = self.max_model_len - len(token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
        )
        stream = None
        if params.seed is not None and not params.is_greedy:
            stream = SeededStream(params.seed)
        self._states[request_id] = _RequestState(
            request=request,
            prompt=text,
            detokenizer=(
                IncrementalDetokenizer(self.tokenizer, token_ids, params)
                if params.stop
                or params.output_kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA)
                else None
            ),
            stream=stream,
            logprobs=[] if params.logprobs is not None else None,
            spec_exit=spec_exit,
        )
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
        state = self._states.get(request_id)
        if state is not None:
            self.scheduler.finish(state.request, RequestStatus.FINISHED_ABORTED)
            self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or self._in_flight is not None
            or bool(self._spec_in_flight)
        )

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    # ---- the step ----------------------------------------------------------------------
    @torch.inference_mode()  # also: sampling edits the forward's (inference) logits in place
    def step(self) -> list[RequestOutput | TokenDelta]:
        """Run one step; return outputs for requests that produced tokens (per their
        ``output_kind``: a ``TokenDelta`` for TOKENS, else a ``RequestOutput``). With
        speculation, decoding requests verify a draft tree and may emit several tokens; the
        step is otherwise the same. Under async scheduling the outputs are those of the
        step launched by the previous call. While deferred draft graphs remain, a step
        captures one first every ``DEFERRED_CAPTURE_INTERVAL_S`` (a call that finds a
        step in flight only reads it)."""
        if self._pending_graphs is not None and time.monotonic() >= self._capture_due:
            if self._in_flight is not None:
                done, self._in_flight = self._in_flight, None
                return self._finish(done)
            self.capture_pending_graph()
            self._capture_due = time.monotonic() + DEFERRED_CAPTURE_INTERVAL_S
        deferring, self._deferring = self._deferring, False
        if self.pipeline is not None:
            if self._can_pipeline():
                return self._step_pipelined()
            if self._spec_in_flight:  # the next step needs every token read
                done, self._spec_in_flight = self._spec_in_flight, []
                return self._finish_specs(done)
        if self.async_scheduling and not self._speculates_next():
            return self._step_async(deferring)
        if self._in_flight is not None:  # speculation needs every sampled token on the host
            done, self._in_flight = self._in_flight, None
            return self._finish(done)
        num_running = self.scheduler.num_running
        sched = self.scheduler.schedule(self.lookahead)
        if sched.is_empty:
            return []
        observing = self.runner.aux_cache is not None
        if observing and self._decodes_plainly_at(len(sched.scheduled)):
            self._defer(num_running, deferring)
            observing = False
        trees = self._propose(sched.scheduled)
        if trees and self.uniform_verify:
            self._add_root_only_trees(sched.scheduled, trees)
        for row, tree in trees.items():
            sched.scheduled[row].num_new_tokens = tree.num_nodes
        starts = [s.request.num_computed_tokens for s in sched.scheduled]
        inputs = self.runner.prepare(sched.scheduled, trees)
        logits, aux = self.runner.execute(inputs)
        for row, s in enumerate(sched.scheduled):
            if row not in trees:  # tree rows advance by what acceptance keeps
                s.request.num_computed_tokens += s.num_new_tokens
        self.num_steps += 1
        if not inputs.sampled_rows:
            return []
        # Row offsets of each sampled request in `logits` (1 row, or its tree's nodes).
        offsets = [0]
        for count in inputs.logits_counts:
            offsets.append(offsets[-1] + count)
        emitted: dict[int, list[int]] = {}
        logprobs: dict[int, TokenLogprobs] = {}
        plain = [i for i, r in enumerate(inputs.sampled_rows) if r not in trees]
        if plain:
            if len(plain) == logits.shape[0]:  # every logits row: a plain step, no gather
                plain_logits = logits
            else:
                rows = torch.tensor([offsets[i] for i in plain], device=logits.device)
                plain_logits = logits[rows]
            tokens, lps = self._sample(
                [self._state_of(sched, inputs, i) for i in plain], plain_logits
            )
            for j, i in enumerate(plain):
                emitted[i] = [tokens[j]]
                if lps:
                    logprobs[i] = lps[j]
        spec = [i for i, r in enumerate(inputs.sampled_rows) if r in trees]
        accepted: dict[int, list[int]] = {}
        if spec:
            accepted = self._verify(sched, inputs, trees, spec, logits, offsets, emitted)
            if self.spec_exit is not None:
                self._apply_spec_exit(sched, inputs, trees, spec, emitted, accepted)
        if observing:
            self._observe(sched.scheduled, inputs, starts, accepted, aux)
        now = time.monotonic()
        outputs = []
        for i, row in enumerate(inputs.sampled_rows):
            state = self._state_of(sched, inputs, i)
            request = state.request
            for token_id in emitted[i]:
                self._append_token(state, token_id, logprobs.get(i), now)
                if request.is_finished:
                    break
            if sched.scheduled[row].num_lookahead_tokens and not request.is_finished:
                self.kv_manager.trim(request, request.num_computed_tokens)
            self._report(state, outputs)
        return outputs

    def _decodes_plainly_at(self, batch_size: int) -> bool:
        """Whether a step of ``batch_size`` requests drafts nothing: it is above the
        speculation cutoff (``disable_by_batch_size``), or deferred draft graphs are
        still to capture."""
        if self._pending_graphs is not None:
            return True
        limit = self.config.speculative.disable_by_batch_size
        return limit is not None and batch_size > limit

    def _defer(self, num_running: int, deferring: bool) -> None:
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

    def _speculates_next(self) -> bool:
        """Whether the next step may verify drafts, and so must run synchronously: there is
        a proposer, and the requests running and waiting do not exceed its batch-size
        cutoff (above it ``_propose`` drafts nothing)."""
        if self.proposer is None or self._pending_graphs is not None:
            return False
        limit = self.config.speculative.disable_by_batch_size
        return limit is None or self.scheduler.num_running + self.scheduler.num_waiting <= limit

    # ---- pipelined speculative steps ---------------------------------------------------
    def _can_pipeline(self) -> bool:
        """Whether the next step can be pipelined (spec_pipeline.py): every running
        request decodes greedily with drafts (no prefill chunk, no pending plain or
        forced token), continues a launch in flight (or, with none, can start from the
        host state), and the worst-case slots of two steps fit its context and the free
        blocks, so scheduling preempts nobody; the request first in line, if any, can
        join as an arrival (``_joins_pipeline``). With nothing running, arrivals alone
        start the pipeline."""
        scheduler = self.scheduler
        running = scheduler.running
        if (not running and not scheduler.num_waiting) or self._pending_graphs is not None:
            return False
        limit = self.config.speculative.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return False
        budget = scheduler.config.max_num_batched_tokens - len(running)
        if budget < 0:
            return False
        if scheduler.num_waiting:
            first = scheduler.waiting[0]
            # Its whole prompt next to the decodes (a prefix-cache hit may need less).
            if first.num_tokens > budget or not self._joins_pipeline(first):
                return False
        prev = self._spec_in_flight
        # What cannot change for a request after a launch (greedy, drafting, min_tokens
        # reached) was checked when its launch in flight did: only a batch that is not
        # exactly the launches' rows needs those checks again.
        if (
            not prev or running != [r for launch in prev for r in launch.requests]
        ) and not self._may_pipeline(running, prev):
            return False
        reserve = 1 + self.lookahead + self.pipeline.extra_lookahead
        bs, needed = self.block_size, 0
        for request in running:
            computed = request.num_computed_tokens
            if (
                request.num_pending_tokens
                or computed + 1 != request.num_tokens
                or computed + reserve > self.max_model_len
            ):
                return False
            needed += max(0, cdiv(computed + reserve, bs) - len(request.block_ids))
        return needed <= self.kv_manager.pool.num_free_blocks

    def _may_pipeline(self, requests: list[Request], prev: list[SpecLaunch]) -> bool:
        """``_can_pipeline``'s checks that hold for a request from its first pipelined
        launch on: greedy with drafts (min_tokens reached), and continuing a launch in
        flight or, with none, ready to start from the host state."""
        in_flight = {r.request_id for launch in prev for r in launch.requests} if prev else None
        for request in requests:
            if not request.sampling_params.is_greedy or _decodes_plainly(request):
                return False
            if in_flight is not None:
                if request.request_id not in in_flight:
                    return False
            elif not self.proposer.pipeline_ready(request):
                return False
        return True

    def _joins_pipeline(self, request: Request) -> bool:
        """Whether a waiting request can be admitted as a pipelined arrival
        (``SpecPipeline.arrive``): new (not recomputed after preemption), greedy with
        drafts from its first token, and not opted into SpecExit (whose cut is judged per
        read step with the tree's signals)."""
        return (
            request.status is RequestStatus.WAITING
            and request.sampling_params.is_greedy
            and not _decodes_plainly(request)
            and self._states[request.request_id].spec_exit is None
        )

    def _step_pipelined(self) -> list[RequestOutput | TokenDelta]:
        """Launch speculative step N+1 from the device outcomes in flight (step N and the
        arrivals prefilled with it), prefill the requests arriving now beside it (with
        nothing running, only them), then read what was in flight and update its
        requests while the device runs N+1."""
        scheduler = self.scheduler
        num_running = scheduler.num_running
        sched = scheduler.schedule(
            self.lookahead + self.pipeline.extra_lookahead,
            admit_whole=self._joins_pipeline if scheduler.num_waiting else None,
        )
        requests = [s.request for s in sched.scheduled[:num_running]]
        if sched.preempted or len(requests) != num_running:
            raise RuntimeError("a pipelined step must schedule every running request")
        launches = [self.pipeline.launch(requests, self._spec_in_flight)] if requests else []
        if arrivals := sched.scheduled[num_running:]:
            launches.append(self._arrive(arrivals))
        self.num_steps += 1
        done, self._spec_in_flight = self._spec_in_flight, launches
        return self._finish_specs(done)

    def _arrive(self, arrivals: list[ScheduledRequest]) -> SpecLaunch:
        """Prefill the arrivals' whole prompts (a step's prefill, graphs where they fit),
        pick each first token on the device and start the head over the prompt; the
        engine then holds each request one step behind, at its prompt's last token."""
        starts = [s.request.num_computed_tokens for s in arrivals]
        inputs = self.runner.prepare(arrivals)
        logits, aux = self.runner.execute(inputs)  # [n, vocab]: each prompt's last row
        if len(inputs.sampled_rows) != len(arrivals):
            raise RuntimeError("a pipelined arrival must prefill its whole prompt")
        self._observe(arrivals, inputs, starts, {}, aux)
        requests = [s.request for s in arrivals]
        for s in arrivals:
            s.request.num_computed_tokens += s.num_new_tokens
        last_aux = self.proposer.start_pipelined(requests)
        for request in requests:  # one step behind: the prompt's last token is the root
            request.num_computed_tokens -= 1
        first = logits.argmax(dim=-1)  # greedy (_joins_pipeline), min_tokens reached
        return self.pipeline.arrive(requests, first, last_aux)

    def _finish_specs(self, done: list[SpecLaunch]) -> list[RequestOutput | TokenDelta]:
        """``_finish_spec`` of each launch read (a request is a row of one of them)."""
        return [out for launch in done for out in self._finish_spec(launch)]

    def _finish_spec(self, done: SpecLaunch) -> list[RequestOutput | TokenDelta]:
        """Append a pipelined step's tokens (its host sync); each request's computed tokens
        move past the step's root and accepted nodes, and the proposer resumes from them.
        SpecExit judges the step here (``_exit_cut``); a cut also marks the request's row
        of the step in flight stale (module docstring of spec_pipeline.py)."""
        emitted = done.read()
        now = time.monotonic()
        outputs = []
        for row, (request, tokens) in enumerate(zip(done.requests, emitted, strict=True)):
            state = self._states.get(request.request_id)
            if state is None or request.status.is_finished or state.stale_launch is done:
                self.num_dropped_tokens += len(tokens)  # stopped or cut after it launched
                if state is not None and state.stale_launch is done:
                    state.stale_launch = None
                continue
            num_accepted = len(tokens) - 1
            counted = None
            if done.num_draft_tokens:  # an arrival's prefill drafted nothing: not a step
                counted = self._counted_as_synchronous(
                    request, done.num_draft_tokens, done.depth, num_accepted
                )
            if counted is not None:
                self.spec_stats.record(*counted)
                state.spec_stats.record(*counted)
            cut = None
            if state.spec_exit is not None:
                cut = self._exit_cut(state, tokens, done.exit_signals(row))
            if cut is not None:
                tokens = [*tokens[: cut.keep], *cut.tokens]
                num_accepted = min(num_accepted, cut.keep)  # the bonus has no K/V yet
                # The launch since, which holds the request's next row (none when the
                # launches in flight are being drained).
                state.stale_launch = next(
                    (launch for launch in self._spec_in_flight if request in launch.requests),
                    None,
                )
            root = request.num_computed_tokens  # one step behind: this step's root
            request.num_computed_tokens = root + 1 + num_accepted
            self.proposer.resume(
                request, root, done.state.aux, done.state_row(row), num_accepted + 1
            )
            for token_id in tokens:
                self._append_token(state, token_id, None, now)
                if request.is_finished:
                    break
            self._report(state, outputs)
        return outputs

    def _counted_as_synchronous(
        self, request: Request, num_drafted: int, depth: int, num_accepted: int
    ) -> tuple[int, int] | None:
        """(drafted, accepted) of a pipelined step as the synchronous step counts it, or
        None where that step would not have drafted. A pipelined step launches before the
        host knows its request's output length, so near ``max_tokens`` it drafts the full
        shape; the synchronous step drafts at most ``max_tokens - output - 1`` tokens (a
        chain; ``_propose``) and decodes plainly at 0, which is not a step. Counting the
        same makes τ independent of pipelining: exact for chains (a shorter chain is the
        longer one's prefix), the shortened chain's count for trees."""
        depth_left = request.max_tokens - request.num_output_tokens - 1
        if depth_left >= depth:
            return num_drafted, num_accepted
        if depth_left <= 0:
            return None
        return depth_left, min(num_accepted, depth_left)

    # ---- async scheduling ---------------------------------------------------------------
    def _step_async(self, deferring: bool) -> list[RequestOutput | TokenDelta]:
        """Launch step N+1, then read step N's tokens and update its requests while the
        device runs N+1. A request that step N stops was scheduled in N+1 too: that token
        is computed and dropped (its K/V lands in the request's own freed slots, written
        before any later step can hand them out, as the device runs steps in order). The
        step is above the speculation bands: a model proposer's aux states are deferred
        (``_defer``; ``deferring``: the step before deferred them too)."""
        num_running = self.scheduler.num_running
        sched = self.scheduler.schedule()
        if self.runner.aux_cache is not None:
            self._defer(num_running, deferring)
        launched = self._launch(sched.scheduled) if not sched.is_empty else None
        done, self._in_flight = self._in_flight, launched
        return self._finish(done) if done is not None else []

    def _launch(self, scheduled) -> _InFlight | None:
        """Prepare, run and sample one step without reading anything back (a model
        proposer's aux states stay in the runner's aux cache: ``_defer``)."""
        pending = self._in_flight.pending() if self._in_flight is not None else None
        inputs = self.runner.prepare(scheduled, pending=pending)
        logits, _ = self.runner.execute(inputs)
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        self.num_steps += 1
        if not inputs.sampled_rows:
            return None
        requests = [scheduled[row].request for row in inputs.sampled_rows]
        states = [self._states[r.request_id] for r in requests]
        token_ids, logprobs = self._sample_on_device(states, logits)
        for request in requests:
            request.num_pending_tokens += 1
        return _InFlight(requests, token_ids, logprobs)

    def _finish(self, done: _InFlight) -> list[RequestOutput | TokenDelta]:
        """Append a launched step's tokens (the step's host sync) and build its outputs."""
        token_ids = done.read()
        # Logprobs read back on the current stream, i.e. after the step launched since:
        # only requests that ask for them pay that wait.
        logprobs = _logprobs_to_host(done.logprobs, token_ids)
        now = time.monotonic()
        outputs = []
        states = self._states
        for i, (request, token_id) in enumerate(zip(done.requests, token_ids, strict=True)):
            request.num_pending_tokens -= 1
            state = states.get(request.request_id)
            if state is None or request.status.is_finished:
                self.num_dropped_tokens += 1  # stopped or aborted after this step launched
                continue
            self._append_token(state, token_id, logprobs[i] if logprobs else None, now)
            self._report(state, outputs)
        return outputs

    def _report(self, state: _RequestState, outputs: list[RequestOutput | TokenDelta]) -> None:
        """Add the request's output if its kind reports this step; forget it once done."""
        request = state.request
        finished = request.status.is_finished
        kind = request.sampling_params.output_kind
        if kind is RequestOutputKind.TOKENS:
            outputs.append(self._token_delta(state, finished))
        elif finished or kind is not RequestOutputKind.FINAL_ONLY:
            outputs.append(self._make_output(state, delta=kind is RequestOutputKind.DELTA))
        if finished:
            self._forget(request.request_id)

    def _forget(self, request_id: str) -> None:
        del self._states[request_id]
        if self.proposer is not None:
            self.proposer.release(request_id)

    def _state_of(self, sched, inputs, i: int) -> _RequestState:
        return self._states[sched.scheduled[inputs.sampled_rows[i]].request.request_id]

    def _sample(
        self, states: list[_RequestState], logits: torch.Tensor
    ) -> tuple[list[int], list[TokenLogprobs]]:
        """One token per row from [rows, vocab] logits (the step's host sync)."""
        tokens, logprobs = self._sample_on_device(states, logits)
        token_ids = tokens.tolist()
        return token_ids, _logprobs_to_host(logprobs, token_ids)

    def _sample_on_device(
        self, states: list[_RequestState], logits: torch.Tensor
    ) -> tuple[torch.Tensor, LogprobsTensors | None]:  # [rows] int64, logprobs
        """One token per row from [rows, vocab] logits, left on the device."""
        params = [st.request.sampling_params for st in states]
        self._suppress_early_stops(logits, [st.request for st in states])
        if all(p.is_greedy and p.logprobs is None for p in params):
            return logits.argmax(dim=-1), None  # no sampling tensors needed
        meta = SamplingMetadata.build(params, [st.stream for st in states], self.runner.device)
        sampled = self.sampler(logits, meta)
        return sampled.token_ids, sampled.logprobs

    def _propose(self, scheduled) -> dict[int, DraftTree]:
        """Draft trees for decoding rows that reserved lookahead slots."""
        if self.proposer is None or self._decodes_plainly_at(len(scheduled)):
            return {}
        shape = self.proposer.shape_at(len(scheduled))  # the step's band
        rows, limits = [], []
        for row, s in enumerate(scheduled):
            request = s.request
            if s.num_lookahead_tokens == 0 or _decodes_plainly(request):
                continue
            # Never draft deeper than max_tokens allows: a step emits at most depth + 1
            # tokens. With room for the whole shape the proposer grows it, else a chain.
            depth_left = request.max_tokens - request.num_output_tokens - 1
            limit = s.num_lookahead_tokens
            if depth_left < shape.depth:
                limit = min(limit, depth_left)
            if limit > 0:
                rows.append(row)
                limits.append(limit)
        if not rows:
            return {}
        drafts = self.proposer.propose([scheduled[r].request for r in rows], limits, shape)
        return {r: t for r, t in zip(rows, drafts, strict=True) if t is not None}

    def _add_root_only_trees(self, scheduled, trees: dict[int, DraftTree]) -> None:
        """A root-only tree for every other row that plainly decodes one token (no draft,
        or opted out of speculation); verifying it samples the root's next token exactly
        as plain decoding does. Rows that need per-token logprobs or min_tokens stay
        plain."""
        extra: dict[int, DraftTree] = {}
        for row, s in enumerate(scheduled):
            if row in trees:
                continue
            request = s.request
            if (
                s.num_new_tokens != 1
                or request.num_computed_tokens + 1 != request.num_tokens
                or _samples_per_token(request)
            ):
                return  # a prefill chunk or a plain-only row: the step cannot be uniform
            extra[row] = root_only_tree(request.token_id(request.num_tokens - 1))
        trees.update(extra)

    def _observe(self, scheduled, inputs, starts, accepted, aux: torch.Tensor) -> None:
        """Hand the proposer the aux states of every token the target computed this step:
        all new tokens of plain rows, the root and accepted nodes of tree rows."""
        q_lens = inputs.meta.query_lens_cpu
        # One gather for every row: each row's computed tokens, back to back.
        picked: list[int] = []
        counts: list[int] = []
        offset = 0
        for row, q_len in enumerate(q_lens):
            if row in accepted:
                picked += [offset, *(offset + node for node in accepted[row])]
                counts.append(1 + len(accepted[row]))
            else:
                picked += range(offset, offset + q_len)
                counts.append(q_len)
            offset += q_len
        index = to_device(np.array(picked, dtype=np.int64), aux.device)
        parts = aux.index_select(0, index).split(counts)
        for s, start, part in zip(scheduled, starts, parts, strict=True):
            self.proposer.observe(s.request, start, part)

    def _verify(self, sched, inputs, trees, spec, logits, offsets, emitted) -> dict[int, list[int]]:
        """Acceptance for the tree rows, then move the accepted path's K/V into place.
        Returns each tree row's accepted node indices."""
        states = [self._state_of(sched, inputs, i) for i in spec]
        tree_list = [trees[inputs.sampled_rows[i]] for i in spec]
        if len(spec) == len(inputs.sampled_rows):  # every sampled row verifies a tree
            tree_logits = logits  # [sum nodes, vocab]
        else:
            rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in spec])
            index = to_device(rows, logits.device)
            tree_logits = logits.index_select(0, index)  # [sum nodes, vocab]
        params = [st.request.sampling_params for st in states]
        if all(p.is_greedy for p in params):
            results = greedy_accept_batch(tree_list, tree_logits)  # one host sync
        else:
            meta = SamplingMetadata.build(params, [st.stream for st in states], logits.device)
            results = accept_batch(tree_list, tree_logits, meta, self.sampler.generator)
        src, dst = [], []
        bs = self.block_size
        for i, state, tree, result in zip(spec, states, tree_list, results, strict=True):
            request = state.request
            start = request.num_computed_tokens  # the root's cache index
            blocks = request.block_ids
            for depth, node in enumerate(result.accepted_nodes, start=1):
                if node != depth:  # off the chain: move it next to its parent
                    a, b = start + node, start + depth
                    src.append(blocks[a // bs] * bs + a % bs)
                    dst.append(blocks[b // bs] * bs + b % bs)
            request.num_computed_tokens = start + 1 + result.num_accepted
            emitted[i] = result.token_ids
            if tree.num_draft_tokens:  # root-only trees are plain decodes, not steps
                self.spec_stats.record(tree.num_draft_tokens, result.num_accepted)
                state.spec_stats.record(tree.num_draft_tokens, result.num_accepted)
        self.runner.move_kv(src, dst)
        return {
            inputs.sampled_rows[i]: r.accepted_nodes for i, r in zip(spec, results, strict=True)
        }

    def _apply_spec_exit(self, sched, inputs, trees, spec, emitted, accepted) -> None:
        """SpecExit after acceptance (docs/spec_exit.md): an opted-in request whose step
        emitted a step delimiter inside its think span while its signals passed keeps the
        tokens through the delimiter and gets the think-end marker's k tokens next. Rolled
        back with the cut: the later emitted tokens, their accepted nodes (``_observe``
        then reports only kept tokens) and the computed tokens past them (their K/V is
        stale).

        The forced tokens are emitted like sampled ones: ``step`` appends them one by one
        and stops at max_tokens, the context limit or a stop condition, so a request with
        fewer than k tokens of budget left gets the marker's first ones and ends there
        (force what fits). Their K/V is computed next step: the request then has more
        than one uncomputed token, which the scheduler runs as a chunk without drafts,
        sampled at its last token (the proposer observes every token of it and catches
        up on them before drafting again, as after a prefill)."""
        rows = [i for i in spec if self._state_of(sched, inputs, i).spec_exit is not None]
        if not rows:
            return
        values = self.spec_exit.read_signals([trees[inputs.sampled_rows[i]] for i in rows])
        for i, step_values in zip(rows, values, strict=True):
            state = self._state_of(sched, inputs, i)
            request, row = state.request, inputs.sampled_rows[i]
            cut = self._exit_cut(state, emitted[i], step_values)
            if cut is None:
                continue
            root = request.num_computed_tokens - 1 - len(accepted[row])  # its cache index
            emitted[i] = [*emitted[i][: cut.keep], *cut.tokens]
            # A cut at the bonus token keeps every accepted node: the bonus and the forced
            # tokens are then all uncomputed, and the next step computes them together.
            accepted[row] = accepted[row][: cut.keep]
            request.num_computed_tokens = root + 1 + len(accepted[row])

    def _exit_cut(
        self, state: _RequestState, emitted: list[int], values: list[float] | None
    ) -> ExitCut | None:
        """The SpecExit policy's verdict on a step of an opted-in request (None: keep
        every token; a request without SpecExit never exits), counted when it cuts."""
        if state.spec_exit is None:
            return None
        cut = state.spec_exit.step(state.request.output_token_ids, emitted, values)
        if cut is not None:
            self.spec_exit.stats.record(cut)
        return cut

    def _suppress_early_stops(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Rows below ``min_tokens`` must not produce EOS or a stop token id: mask them
        (in place, so the sampled distribution is the target's renormalised over the rest).
        One staged index copy for the batch: indexing with a Python list would copy from
        pageable memory, which waits for the step in flight."""
        rows: list[int] = []
        cols: list[int] = []
        for row, request in enumerate(requests):
            params = request.sampling_params
            # The row samples output token num_output + pending (async scheduling).
            if request.num_output_tokens + request.num_pending_tokens >= params.min_tokens:
                continue
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += request.eos_token_ids
            rows += [row] * len(banned)
            cols += banned
        if rows:
            index = to_device(np.array([rows, cols], dtype=np.int64), logits.device)
            logits[index[0], index[1]] = float("-inf")

    def _append_token(self, state: _RequestState, token_id: int, logprob, now: float) -> None:
        request = state.request
        request.output_token_ids.append(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        if state.logprobs is not None and logprob is not None:
            n = request.sampling_params.logprobs or 0
            state.logprobs.append(
                TokenLogprobs(
                    logprob.token_id, logprob.logprob, dict(list(logprob.top.items())[:n])
                )
            )
        stop_str = None
        if state.detokenizer is not None:
            update = state.detokenizer.append([token_id])
            state.pending_delta.append(update.text_delta)
            stop_str = update.stop_reason
        status = self._stop_status(request, token_id, stop_str)
        if status is not None:
            if state.detokenizer is not None and stop_str is None:
                # Release text held back in case it began a stop string.
                state.pending_delta.append(state.detokenizer.flush())
            self.scheduler.finish(request, status)
            request.finished_time = now

    def _stop_status(self, request: Request, token_id: int, stop_str) -> RequestStatus | None:
        params = request.sampling_params
        n_out = len(request.output_token_ids)  # per token and request: no properties
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if stop_str is not None:
                request.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if (
            n_out >= request.max_tokens
            or len(request.prompt_token_ids) + n_out >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, state: _RequestState, delta: bool = False) -> RequestOutput:
        """CUMULATIVE/FINAL_ONLY carry the whole output; DELTA the tokens (a verify step
        may emit several), logprobs and text since the previous output (``text_delta`` is
        filled in every kind)."""
        request = state.request
        finished = request.is_finished
        text_delta = "".join(state.pending_delta)
        state.pending_delta.clear()
        logprobs = state.logprobs
        if delta:
            sent, state.num_sent_tokens = state.num_sent_tokens, request.num_output_tokens
            text, token_ids = text_delta, list(request.output_token_ids[sent:])
            logprobs = logprobs[sent:] if logprobs is not None else None
        elif state.detokenizer is not None:
            text, token_ids = state.detokenizer.text, list(request.output_token_ids)
        else:
            text = self.tokenizer.decode(
                request.output_token_ids,
                skip_special_tokens=request.sampling_params.skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
            text_delta, token_ids = text, list(request.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            logprobs=list(logprobs) if logprobs is not None else None,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=self._metrics(state),
            text_delta=text_delta,
        )

    def _token_delta(self, state: _RequestState, finished: bool) -> TokenDelta:
        """TOKENS: the ids (and logprobs) since the request's last report, no text."""
        request = state.request
        sent, state.num_sent_tokens = state.num_sent_tokens, request.num_output_tokens
        return TokenDelta(
            request.request_id,
            request.output_token_ids[sent:],
            state.logprobs[sent:] if state.logprobs is not None else None,
            request.status.value if finished else None,
            request.stop_reason,
            self._metrics(state) if finished else None,
        )

    @staticmethod
    def _metrics(state: _RequestState) -> RequestMetrics:
        request, spec, exits = state.request, state.spec_stats, state.spec_exit
        return RequestMetrics(
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finished_time=request.finished_time,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            spec_steps=spec.steps,
            spec_drafted_tokens=spec.drafted_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_exits=exits.num_exits if exits else None,
            spec_exit_tokens_saved=exits.tokens_saved if exits else None,
        )


def _samples_per_token(request: Request) -> bool:
    """logprobs and min_tokens act per emitted token: such rows are sampled plainly, never
    through a tree (not even a root-only one)."""
    params = request.sampling_params
    return params.logprobs is not None or request.num_output_tokens < params.min_tokens


def _decodes_plainly(request: Request) -> bool:
    """No drafts: the request opted out of speculation, or samples per token."""
    return not request.sampling_params.speculate or _samples_per_token(request)


def _logprobs_to_host(lp: LogprobsTensors | None, token_ids: list[int]) -> list[TokenLogprobs]:
    """Batch logprobs to host objects (top-n holds the batch's largest n; rows slice)."""
    if lp is None:
        return []
    top_ids = lp.top_token_ids.tolist()
    top_lps = lp.top_logprobs.tolist()
    sampled = lp.sampled_logprobs.tolist()
    return [
        TokenLogprobs(token_id=t, logprob=s, top=dict(zip(ids, lps, strict=True)))
        for t, ids, lps, s in zip(token_ids, top_ids, top_lps, sampled, strict=True)
    ]
