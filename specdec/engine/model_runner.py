"""Owns the target's weights, the paged KV tensors and the CUDA graphs, and runs one
forward per step from explicit inputs (no global context, so a draft model can live in the
same process with its own runner)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import torch

from specdec.attention import get_attention_backend
from specdec.attention.base import AttentionBackend
from specdec.attention.custom_op import OpaqueAttention
from specdec.config import EngineConfig
from specdec.engine.cuda_graph import (
    StepGraphs,
    graph_batch_sizes,
)
from specdec.engine.input_batch import build_step_inputs
from specdec.engine.kv_cache_manager import cdiv
from specdec.engine.prefill_graphs import PrefillGraphs, prefill_graph_buckets
from specdec.engine.runtime import choose_runtime, decide_max_model_len, kv_bytes_per_block
from specdec.engine.scheduler import ScheduledRequest
from specdec.models import load_config, load_model
from specdec.models.config import ModelConfig
from specdec.models.invariant import use_invariant_kernels
from specdec.models.linear import use_triton_gemm
from specdec.models.llama import use_kernel_norms
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.paged_attention import move_kvcache_ref
from specdec.ops.step_inputs import BlockTables, PendingTokens, StepInputs

logger = logging.getLogger(__name__)

# With deferred graphs (EngineConfig.defer_graphs), start-up captures the decode and prefill
# graphs of steps over at most this many sequences (the load a server meets first); those
# of wider steps follow between steps.
STARTUP_GRAPH_SEQS = 64


class ModelRunner:
    """``aux_layer_ids``: layers whose entering residual stream a proposer reads (EAGLE-3).
    Every forward then also writes each token's aux states [len(aux_layer_ids) * hidden]
    into ``aux_cache`` at the token's KV slot, so a proposer that skips steps (no per-step
    hand-over above the speculation bands) reads them from there later; the KV budget
    counts that cache per slot like the K/V."""

    def __init__(
        self, config: EngineConfig, model_source, aux_layer_ids: Sequence[int] = ()
    ) -> None:
        self.config = config
        self.runtime = choose_runtime(config)
        self.device = self.runtime.device
        self.dtype = self.runtime.dtype
        self.block_size = config.cache.block_size
        # Under torch.compile attention must be one opaque op (see custom_op.py), wherever
        # something compiles: the target's layers, or a draft model's.
        self.use_compile = self.runtime.compile_target
        self.compile_draft = self.runtime.compile_draft
        self.attention = self._attention(self.runtime.attention_backend)
        # A draft model's attention (RuntimeChoice.draft_attention_backend): the target's
        # backend, or in deterministic mode the fast one, its drafts deciding no token.
        draft = self.runtime.draft_attention_backend
        same = draft == self.runtime.attention_backend
        self.draft_attention = self.attention if same else self._attention(draft)
        self.model_config: ModelConfig = load_config(model_source)
        self.max_model_len = decide_max_model_len(config, self.model_config)
        t0 = time.perf_counter()
        self.model = load_model(
            model_source,
            dtype=self.dtype,
            device=self.device,
            attention=self.attention,
            max_positions=self.max_model_len,  # RoPE table only as long as needed
        )
        logger.info(
            "loaded the target's weights (%.0f MiB, %s on %s) in %.1f s",
            sum(p.numel() * p.element_size() for p in self.model.parameters()) / 2**20,
            str(self.dtype).removeprefix("torch."),
            self.device,
            time.perf_counter() - t0,
        )
        # Few-row projections on the skinny Triton GEMM where steps replay CUDA graphs (a
        # Triton launch from eager Python costs more host time than cuBLAS's).
        self.triton_gemm_max_rows = (
            config.triton_gemm_max_tokens if self.runtime.use_cuda_graphs else 0
        )
        use_triton_gemm(self.model, self.triton_gemm_max_rows)
        if self.runtime.use_cuda_graphs and self.runtime.triton_kernels:
            # Steps with prefill tokens run the eager modules (captured as prefill graphs,
            # so a kernel's launch costs no host time there): one launch per norm.
            use_kernel_norms(self.model)
        if self.runtime.deterministic:
            # Every projection and norm at every row count, prefill included (on top of
            # the few-row switch above, which it overrides).
            n = use_invariant_kernels(self.model)
            logger.info("deterministic mode: %d target modules on batch-invariant kernels", n)
        self.block_table_width = cdiv(self.max_model_len, self.block_size)
        # The step's block-table array, kept between steps (only changed rows rewritten).
        self.block_tables = BlockTables(config.scheduler.max_num_seqs, self.block_table_width)
        self.aux_layer_ids: tuple[int, ...] = tuple(aux_layer_ids)
        self.aux_width = len(self.aux_layer_ids) * self.model_config.hidden_size
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        # Slot s holds the aux states of the token last computed into slot s (a write per
        # forward, next to the K/V's). Tree nodes' rows are not moved with their K/V after
        # acceptance: verified steps hand their accepted rows to the proposer directly.
        self.aux_cache: torch.Tensor | None = None  # [num_blocks * block_size, aux_width]
        if self.aux_width:
            self.aux_cache = torch.zeros(
                self.num_blocks * self.block_size,
                self.aux_width,
                dtype=self.dtype,
                device=self.device,
            )
        # Every cache's base address, for the one-launch K/V move (Triton path only).
        self._kv_table: torch.Tensor | None = None
        if self.runtime.triton_kernels:
            from specdec.kernels.move_kv import cache_pointer_table, move_kv_slots

            self._kv_table = cache_pointer_table([c for pair in self.kv_caches for c in pair])
            self._move_kv_slots = move_kv_slots
        self.graphs: StepGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None

    def _attention(self, name: str) -> AttentionBackend:
        """Backend ``name``, behind the opaque op where something compiles."""
        return OpaqueAttention(name) if self.compile_draft else get_attention_backend(name)

    # ---- memory ------------------------------------------------------------------------
    def _decide_num_blocks(self) -> int:
        cache = self.config.cache
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)
        per_block += self.block_size * self.aux_width * self.dtype.itemsize  # aux_cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_free_memory()
        else:
            budget = cache.cpu_kv_cache_memory
        # More blocks than every sequence at full length can use is wasted memory.
        limit = self.config.scheduler.max_num_seqs * self.block_table_width + 1
        num_blocks = min(budget // per_block, limit)
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget of {budget / 2**20:.1f} MiB holds {num_blocks} blocks of "
                f"{per_block / 2**20:.2f} MiB; raise kv_cache_memory / "
                "gpu_memory_utilization or lower max_num_batched_tokens"
            )
        logger.info(
            "KV cache: %d blocks x %d tokens (%.2f GiB%s)",
            num_blocks,
            self.block_size,
            num_blocks * per_block / 2**30,
            ", aux states included" if self.aux_width else "",
        )
        return int(num_blocks)

    @torch.inference_mode()
    def _profile_free_memory(self) -> int:
        """Run the largest step the scheduler can produce (``max_num_batched_tokens`` of
        prefill) against a scratch cache, and return what the utilisation target leaves for
        KV after weights and that peak activation memory."""
        t0 = time.perf_counter()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        scratch_blocks = cdiv(num_tokens, self.block_size) + 1
        scratch = self._allocate_kv_cache(scratch_blocks)
        scratch_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in scratch)
        ids = torch.randint(0, self.model_config.vocab_size, (num_tokens,), device=self.device)
        blocks = torch.arange(1, scratch_blocks, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device) + self.block_size,
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=blocks[None, :],
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_lens_cpu=[num_tokens],
            seq_lens_cpu=[num_tokens],
        )
        positions = torch.arange(num_tokens, device=self.device)
        hidden, _ = self.model(ids, positions, scratch, meta)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_bytes
        del scratch, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak
        logger.info(
            "memory profile (a %d-token prefill, %.1f s): peak %.2f GiB (weights + "
            "activations), KV budget %.2f GiB",
            num_tokens,
            time.perf_counter() - t0,
            peak / 2**30,
            budget / 2**30,
        )
        return max(budget, 0)

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One separate tensor per layer and per K/V. Views into one shared buffer would
        alias each other, and torch.compile then clones every cache the attention op
        mutates instead of updating it in place."""
        c = self.model_config
        shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)

        def make() -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        return [(make(), make()) for _ in range(c.num_layers)]

    # ---- forward -----------------------------------------------------------------------
    def _forward(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        meta: AttentionMetadata,
        compiled: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # hidden [n, hidden], aux [n, A] or None
        """The target's forward over the KV cache; the aux states also land in
        ``aux_cache`` at each token's slot (padding tokens' in the null block's)."""
        meta = self.attention.prepare(meta)  # once for every layer
        hidden, aux = self.model(
            input_ids, positions, self.kv_caches, meta, self.aux_layer_ids, compiled=compiled
        )
        if self.aux_cache is not None:
            self.aux_cache.index_copy_(0, meta.slot_mapping, aux)
        return hidden, aux

    def graph_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [n, vocab] float32, aux
        """The forward CUDA graphs capture: every row's logits, compiled regions where the
        runner compiles. For graphs of larger steps that contain a forward."""
        hidden, aux = self._forward(input_ids, positions, meta, compiled=self.use_compile)
        return self.model.compute_logits(hidden), aux

    def rows_forward(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits] int64
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [num_logits, vocab] float32, aux
        """The forward prefill graphs capture: the eager modules (the kernels an eager
        step of the same shape runs) and the lm_head on the sampled rows only."""
        hidden, aux = self._forward(input_ids, positions, meta)
        return self.model.compute_logits(hidden.index_select(0, logits_indices)), aux

    def warms_up_kernels(self, *, draft: bool = False) -> bool:
        """Whether ``warm_up_kernels`` compiles anything here: on a GPU, where the target's
        attention or, with ``draft``, a draft model's runs the Triton backend (in
        deterministic mode only the draft's does)."""
        backends = {self.runtime.attention_backend}
        if draft:
            backends.add(self.runtime.draft_attention_backend)
        return self.device.type == "cuda" and "triton" in backends

    def warm_up_kernels(self, *, plain: bool = True, trees: bool, draft: bool = False) -> int:
        """Compile the Triton attention variants serving could need (kernels/warmup.py)
        now rather than on some request's first token: those of steps without a tree mask
        when ``plain``, the tree-mask ones of verify and draft steps when ``trees``, for
        the target and, with ``draft`` (a proposer whose drafts attend,
        ``Proposer.uses_draft_attention``), for its draft model: the variants of the
        target's head layout, which an EAGLE-3 head shares (a draft model with other head
        counts compiles its own on first use). Returns the variants launched; none off the
        Triton path."""
        if not self.warms_up_kernels(draft=draft) or not (plain or trees):
            return 0
        from specdec.kernels.warmup import warm_up_attention  # imports triton

        t0 = time.perf_counter()
        k_cache, v_cache = self.kv_caches[0]
        n = warm_up_attention(
            k_cache, v_cache, self.model_config.num_heads, self.dtype, plain=plain, trees=trees
        )
        logger.info(
            "warmed up %d attention kernel variants%s in %.1f s",
            n,
            "" if plain else " (tree masks)",
            time.perf_counter() - t0,
        )
        return n

    @torch.inference_mode()
    def capture_graphs(self, prefill_logits_per_seq: int = 1, defer: bool = False) -> None:
        """CUDA graphs for decode steps and for steps with prefill tokens (with room for
        ``prefill_logits_per_seq`` logits rows per sequence: the largest chain's nodes on
        an engine that verifies chains, so that arrivals next to them replay too)
        (``EngineConfig.prefill_graph_max_tokens``), in one memory pool that
        ``verify_graph_captures`` shares; no-op off the GPU path. Call once. ``defer``:
        only those of steps over at most ``STARTUP_GRAPH_SEQS`` sequences; the rest are
        ``deferred_graph_captures``'."""
        if not self.runtime.use_cuda_graphs or self.graphs is not None:
            return
        max_bs = self._max_graph_batch
        bound = STARTUP_GRAPH_SEQS if defer else None
        if self.use_compile:
            # Per-region compilation (compile_regions); automatic dynamic shapes: the
            # first bucket compiles static, the second turns the token dim dynamic for
            # every later bucket, batch 1 gets its own (0/1 specialisation).
            self.model.compile_regions()
        self.graphs = StepGraphs(
            self.graph_forward, self.block_table_width, self.max_model_len, self.device
        )
        sizes = graph_batch_sizes(max_bs)
        now = [bs for bs in sizes if bound is None or bs <= bound]
        logger.info(
            "capturing CUDA graphs for decode batch sizes %s%s",
            now,
            " (compiling the target's layers first)" if self.use_compile else "",
        )
        t0 = time.perf_counter()
        for _ in self.graphs.captures(1, now, max_bs):
            pass
        logger.info("captured the decode graphs in %.1f s", time.perf_counter() - t0)
        max_seqs = self.config.prefill_graph_max_seqs
        tokens, seqs = prefill_graph_buckets(
            self.config.prefill_graph_max_tokens,
            min(max_bs if max_seqs is None else max_seqs, self.config.scheduler.max_num_seqs),
            min(self.max_model_len, self.config.scheduler.max_num_batched_tokens),
        )
        if not tokens:
            return
        t0 = time.perf_counter()
        self.prefill_graphs = PrefillGraphs(
            self.rows_forward,
            self.block_table_width,
            self.max_model_len,
            self.device,
            tokens,
            seqs,
            prefill_logits_per_seq,
        )
        captured = list(self.prefill_graphs.captures(self.graphs.pool, bound))
        self.graphs.pool = self.prefill_graphs.pool
        logger.info(
            "captured %d prefill CUDA graphs (tokens %s x sequences %s) in %.1f s",
            len(captured),
            tokens,
            [s for s in seqs if bound is None or s <= bound],
            time.perf_counter() - t0,
        )
        if bound is not None and (max_bs > bound or seqs[-1] > bound):
            logger.info("the graphs of steps over %d sequences follow after start-up", bound)

    @property
    def _max_graph_batch(self) -> int:
        """The largest batch a decode graph holds."""
        return min(self.config.cuda_graph_max_batch_size, self.config.scheduler.max_num_seqs)

    def deferred_graph_captures(self) -> Iterator[str]:
        """The graphs ``capture_graphs(defer=True)`` left (decode, then prefill), one per
        iteration, which yields what it captured; until each is, steps of its shape run
        eagerly."""
        if self.graphs is None:
            return
        # Sizes already captured are skipped, so this takes exactly the ones left.
        for bs in self.graphs.captures(1, graph_batch_sizes(self._max_graph_batch)):
            yield f"decode: batch {bs}"
        if self.prefill_graphs is not None:
            for tokens, seqs in self.prefill_graphs.captures(self.graphs.pool):
                self.graphs.pool = self.prefill_graphs.pool
                yield f"prefill: {tokens} tokens, {seqs} sequences"

    def verify_graph_captures(self, tree_sizes: dict[int, list[int]]) -> Iterator[str]:
        """CUDA graphs for verify steps of each tree size in ``tree_sizes`` (nodes, root
        included -> the bucketed batch sizes of trees that size), after
        ``capture_graphs``: one per iteration, which yields what it captured (the engine
        captures them with the draft's and the pipelined step's, before it starts or deferred)."""
        for q, sizes in tree_sizes.items():
            if q > 1 and sizes and self.graphs is not None:
                for bs in self.graphs.captures(q, sizes):
                    yield f"verify: {q}-node trees, batch {bs}"

    def prepare(
        self,
        scheduled: list[ScheduledRequest],
        trees=None,
        pending: PendingTokens | None = None,
    ) -> StepInputs:
        """Step inputs; a verify step is padded to the smallest captured tree size that
        holds every tree (shorter chains near a request's end, ngram chains of uneven
        length), so that it replays a graph instead of running eagerly. ``pending``: the
        tokens of the step in flight (async scheduling). A step that will replay a graph is
        built in the graph's own input buffers (``StepGraphs.staging``)."""
        pad = None
        if self.graphs is not None and trees and len(trees) == len(scheduled):
            largest = max(t.num_nodes for t in trees.values())
            pad = next(
                (
                    q
                    for q in sorted(self.graphs.batch_sizes)
                    if q >= largest and self.graphs.bucket(q, len(scheduled)) is not None
                ),
                None,
            )
        return build_step_inputs(
            scheduled,
            self.block_size,
            self.device,
            trees=trees,
            pad_trees_to=pad,
            pending=pending,
            staging=self.graphs.staging if self.graphs is not None else None,
            block_tables=self.block_tables,
        )

    @torch.inference_mode()
    def move_kv(
        self,
        src: torch.Tensor,  # [rows, n] int64 cache slots, on the device
        dst: torch.Tensor,  # [rows, n] int64 cache slots, src's shape
    ) -> None:
        """Compact K/V after verification: copy slot ``src[r, i]`` to ``dst[r, i]`` in every
        layer (the accepted path's entries move next to their root; every mode's one
        compaction call). A row's sources are all read before any of its destinations is
        written, so a node may shift onto a slot another move of its row reads; rows share
        no slots outside the null block. One launch for every layer where the Triton
        kernel runs (``kernels/move_kv.py``), else the reference."""
        if src.numel() == 0:
            return
        if self._kv_table is None:
            move_kvcache_ref([c for pair in self.kv_caches for c in pair], src, dst)
            return
        self._move_kv_slots(self._kv_table, self.kv_caches[0][0], src, dst)

    @torch.inference_mode()
    def replays_graph(self, inputs: StepInputs) -> bool:
        """Whether ``execute`` runs the step as a CUDA graph replay (else eagerly)."""
        q = inputs.uniform_q
        return (
            q is not None
            and self.graphs is not None
            and self.graphs.bucket(q, inputs.meta.num_seqs) is not None
        )

    def prefill_graph_key(self, inputs: StepInputs) -> tuple[int, int] | None:
        """The prefill graph (``prefill_graphs.PrefillGraphs``) ``execute`` replays for a step
        that no uniform-step graph holds; None: none (no tree mask, and a bucket that
        holds its tokens, sequences and logits rows)."""
        if self.prefill_graphs is None or inputs.meta.has_tree:
            return None
        return self.prefill_graphs.bucket(
            inputs.input_ids.shape[0], inputs.meta.num_seqs, inputs.logits_indices.shape[0]
        )

    @property
    def num_graph_replays(self) -> int:
        """Target forwards replayed from CUDA graphs so far, of every kind."""
        steps = sum(self.graphs.num_replays.values()) if self.graphs is not None else 0
        prefills = self.prefill_graphs.num_replays if self.prefill_graphs is not None else 0
        return steps + prefills

    def execute(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward. Returns float32 logits of the logits rows [num_logits, vocab], and
        the aux residual streams of every token [num_tokens, len(aux_layer_ids) * hidden]
        when ``aux_layer_ids`` is set (else None; also written into ``aux_cache``). Uniform
        steps replay a step graph, others a prefill graph where one holds them, the rest
        run eagerly."""
        if self.replays_graph(inputs):
            logits, aux = self.graphs.run(
                inputs.uniform_q,
                inputs.input_ids,
                inputs.positions,
                inputs.meta,
                staged=inputs.staged,
            )
            if logits.shape[0] != inputs.logits_indices.shape[0]:  # padding, unsampled rows
                logits = logits.index_select(0, inputs.logits_indices)
            return logits, aux
        key = self.prefill_graph_key(inputs)
        if key is not None:
            return self.prefill_graphs.run(
                key, inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices
            )
        hidden, aux = self._forward(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices]), aux
