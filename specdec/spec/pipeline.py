"""The pipelined speculative step: step N+1 is launched from step N's acceptance while it
is still on the device, and the host reads N while the device runs N+1 (docs/DESIGN.md,
"The pipelined speculative step").

A synchronous speculative step makes the device wait for the host twice: the host reads
the acceptance, then prepares the next draft and verification. Here everything that
links one step to the next stays on the device:

- the head's catch-up over the step's root and accepted nodes (``CatchUpState``: the
  emitted tokens, the target's aux states there, the accepted count and the root's cache
  index), from which the next step takes its root (the bonus token, at ``r +
  num_accepted + 1``);
- the accepted path's K/V, moved next to the root by device index copies (trees);
- the verification's positions and slots: ``root + depth`` and the block table's slots
  from the root on.

On the GPU path the whole step (catch-up and growth, verify, acceptance, K/V move, the
next catch-up state) replays one CUDA graph (``SpecStepGraphs``): per step the host
stages one input copy (source rows and block tables), replays, and queues one read-back.

The host keeps every request one step behind: when it launches step N+1 it knows
``num_computed_tokens = r_N`` (the root of the step in flight), so it reserves slots for
the worst case of both steps (``catch_up_width`` more than a synchronous step). Reading
step N then appends its tokens, checks stops and records ``r_{N+1}``; a request that N
stopped has N+1's work dropped, whose K/V lands in its own freed slots before any later
step can reuse them (the device runs steps in order).

SpecExit rides along: the read-back row carries each tree's exit signals, and the host
judges step N when it reads it, as a synchronous step would. A cut at N keeps N's tokens
through the delimiter and forces the think-end marker; the request's row of N+1 (drafted
from the uncut outcome) is dropped when read, like a stopped request's, and the forced
tokens make the next step synchronous.

Arrivals join without a drain (``SpecPipeline.arrive``): a waiting greedy request whose
prompt fits one step is prefilled right after the step is launched, its first token picked
on the device, and the head runs over its prompt; the prefill then counts as the
request's step in flight, with root the prompt's last token and nothing accepted (its
catch-up state in a row of the arrivals' region, read back with the main step). The next
launch takes it like any other row; with nothing running, arrivals alone start the
pipeline. Without this every arrival cost a read of the step in flight and two
synchronous steps (the prefill, then the first draft from the prompt), and
at batch 16 with requests arriving as others finish about a quarter of all steps ran so.

Greedy requests of a proposer that drafts from device state only (a
``PipelinedProposer``: the EAGLE-3 head, the block drafter): sampled acceptance, logprobs,
chunked prefills, forced tokens and SpecExit's admissions run the synchronous step, after
the steps in flight are read (``LLMEngine`` decides per step).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from specdec.attention.tree_mask import ancestor_closure, uniform_tree_mask
from specdec.device.graph_capture import capture_graph
from specdec.device.staging import HostCopy, aligned, to_device, to_host
from specdec.models.compiling import compile_region
from specdec.ops.accept import accepted_path_moves, greedy_accept_and_stage
from specdec.ops.attention_metadata import AttentionMetadata, cache_slots
from specdec.ops.step_inputs import BlockTables, StepInputs
from specdec.request import Request
from specdec.spec.proposer import PipelinedProposer
from specdec.spec.tree import TreeBatch
from specdec.spec.tree_draft import GrowInputs
from specdec.tree_shapes import TreeShape


@dataclass
class CatchUpState:
    """What links a pipelined step to the next, per row: the proposer's catch-up over the
    step's root and accepted nodes (``Proposer.grow_pipelined``'s root state). Row ``b``
    after step N with root at cache index ``r`` and ``a`` accepted drafts:

    - ``tokens[b, : a + 1]``: the tokens N emitted (accepted, then the bonus), so the
      next root is ``tokens[b, a]`` at cache index ``r + a + 1``;
    - ``aux[b, : a + 1]``: the target's aux states at the root and the accepted nodes;
    - ``last[b] = a``; ``start[b] = r`` (the catch-up's first cache index).

    Entries past ``a`` are padding. A launch from the host state fills the same layout
    (``Proposer.pipeline_inputs``: catch-ups right-padded to ``catch_up_width``).
    """

    tokens: torch.Tensor  # [rows, width] int64
    aux: torch.Tensor  # [rows, width, aux width]
    last: torch.Tensor  # [rows] int64
    start: torch.Tensor  # [rows] int64

    @classmethod
    def zeros(
        cls, rows: int, width: int, aux_width: int, dtype: torch.dtype, device: torch.device
    ) -> CatchUpState:
        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        aux = torch.zeros(rows, width, aux_width, dtype=dtype, device=device)
        return cls(ints(rows, width), aux, ints(rows), ints(rows))

    def take(self, src: torch.Tensor) -> CatchUpState:
        """Copies of rows ``src`` ([batch] int32 or int64)."""
        return CatchUpState(*(t.index_select(0, src) for t in self.fields()))

    def put(self, other: CatchUpState) -> None:
        """Write ``other``'s rows over rows ``0 .. len(other)``."""
        b = other.last.shape[0]
        for dst, src in zip(self.fields(), other.fields(), strict=True):
            dst[:b].copy_(src)

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.aux, self.last, self.start


@dataclass
class SpecLaunch:
    """A launched speculative step (or arrivals' prefill: ``depth == 0``, nothing
    drafted) whose outcome the host has not read. Host row ``b`` is ``requests[b]``; the
    pipeline's ``CatchUpState`` row ``state_rows[b]`` holds its device outcome until the
    row is written again (``state.aux[state_rows[b], : accepted + 1]``: the aux rows the
    proposer resumes from), the host copy feeds ``read`` and ``signals``."""

    requests: list[Request]
    num_draft_tokens: int  # per tree (all trees have one shape: the step's band)
    depth: int  # the trees' depth
    state: CatchUpState
    # [batch, depth + 2 + num_signals] int64: num_accepted, the emitted tokens, then the
    # tree's SpecExit signals as float32 bit patterns (``pack_signals``).
    _host: HostCopy
    num_signals: int = 0
    state_rows: list[int] | None = None  # None: rows 0 .. batch (a step's outcome rows)
    _rows: list[list[int]] | None = None

    def state_row(self, b: int) -> int:
        """The catch-up state row of host row ``b``."""
        return b if self.state_rows is None else self.state_rows[b]

    def _read(self) -> list[list[int]]:
        if self._rows is None:  # the pinned buffer is reused later: read it once
            self._rows = self._host.tolist()
        return self._rows

    def read(self) -> list[list[int]]:
        """Per row: the tokens the step emitted (accepted, then the bonus). Waits for this
        step only (its copy was queued behind it)."""
        return [row[1 : row[0] + 2] for row in self._read()]

    def signals(self, row: int) -> list[float] | None:
        """Row ``row``'s signals, those the step's proposal read (the mean over the
        catch-up rows, as a synchronous step's ``DraftTree.signals``); None when the
        proposer reads none. Decoded per row: only rows a step hook follows ask."""
        if not self.num_signals:
            return None
        bits = np.array(self._read()[row][-self.num_signals :], dtype=np.int64)
        return bits.astype(np.int32).view(np.float32).tolist()


def pack_signals(
    packed: torch.Tensor,  # [batch, depth + 2] int64: the read-back row
    signals: torch.Tensor | None,  # [batch, k] float: a tree's exit signals
) -> torch.Tensor:  # [batch, depth + 2 (+ k)] int64
    """Append the signals' float32 bit patterns (sign-extended to int64) to the read-back
    row, so one device-to-host copy per step carries them (``SpecLaunch.signals``
    narrows them back, exactly)."""
    if signals is None:
        return packed
    bits = signals.float().contiguous().view(torch.int32).to(torch.int64)
    return torch.cat([packed, bits], dim=1)


def verify_inputs(
    tree: TreeBatch,  # [batch, q] trees of one shape
    root_index: torch.Tensor,  # [batch] int64: cache index of each root
    slots: torch.Tensor,  # [batch, q] int64: the slots of cache indices root_index + i
    block_tables: torch.Tensor,  # [batch, width] int32
    max_seq_len: int,  # bound on root_index + q (grid sizes; a graph's captured bound)
    root_index_cpu: list[int] | None,  # host copy (the reference backend), then exact
) -> StepInputs:
    """Verification inputs built on the device from the roots' cache indices: node ``i``
    of tree ``b`` at cache index ``root_index[b] + i`` with RoPE position ``root_index[b] +
    depth``, every node's logits returned. A uniform step, so a captured verify graph
    replays it."""
    batch, q = tree.token_ids.shape
    device = tree.token_ids.device
    meta = AttentionMetadata(
        slot_mapping=slots.reshape(-1),
        query_start_loc=torch.arange(0, (batch + 1) * q, q, dtype=torch.int32, device=device),
        seq_lens=(root_index + q).to(torch.int32),
        block_tables=block_tables,
        max_query_len=q,
        max_seq_len=max(root_index_cpu) + q if root_index_cpu is not None else max_seq_len,
        query_lens_cpu=[q] * batch if root_index_cpu is not None else None,
        seq_lens_cpu=[r + q for r in root_index_cpu] if root_index_cpu is not None else None,
    )
    if not tree.is_chain:  # a chain is plain causal attention
        mask = tree.ancestor_mask
        if mask is None:
            mask = ancestor_closure(tree.parents)  # [batch, q, q]
        meta = uniform_tree_mask(mask).attach(meta)
    return StepInputs(
        input_ids=tree.token_ids.flatten(),
        positions=(root_index[:, None] + tree.depths).flatten(),
        meta=meta,
        logits_indices=torch.arange(batch * q, device=device),
        sampled_rows=list(range(batch)),
        logits_counts=[q] * batch,
        is_decode_only=False,
        uniform_q=q,
    )


class SpecPipeline:
    """Launches pipelined speculative steps for one engine (its runner and proposer).

    A launch is ``_step``: the catch-up state's rows gathered by source row, the head's
    catch-up and growth, the verify forward, acceptance, the accepted K/V's move (trees),
    and the next catch-up state written back, device ops only. On the GPU path it replays
    a CUDA graph of the whole step per bucketed batch size (``SpecStepGraphs``), so the
    host enqueues one input copy, one replay and one read-back per step instead of some
    hundred eager kernels; other batches run it eagerly (the draft and verify forwards
    still replay their own graphs where they fit).
    """

    def __init__(self, runner, proposer: PipelinedProposer) -> None:
        self.runner = runner
        self.proposer = proposer
        # Beyond a synchronous step's reservation: the step in flight may emit up to
        # depth + 1 tokens before this one's tree starts.
        self.extra_lookahead = proposer.catch_up_width
        self.rows = runner.config.scheduler.max_num_seqs
        # State rows: a step's outcome in 0 .. rows; then one row never written and so all
        # zeros, what a graph's padding rows take (no tokens, a catch-up from cache index
        # 0 through a null block table); then the arrivals' region, used round-robin
        # (``arrive``): a step of at most ``rows`` requests never writes it, and a row is
        # reused only ``rows`` arrivals later, after the launch that took it.
        self.pad_row = self.rows
        self.arrivals_at = self.rows + 1
        self._next_arrival = 0
        self.num_arrivals = 0
        aux_width = len(proposer.aux_layer_ids) * runner.model_config.hidden_size
        self.state = CatchUpState.zeros(
            2 * self.rows + 1, proposer.catch_up_width, aux_width, runner.dtype, runner.device
        )
        # [max q] int64: node i of a tree sits at cache index root + i.
        q = max(s.max_draft_tokens for s in proposer.shapes) + 1
        self.node_offsets = torch.arange(q, device=runner.device)
        self.graphs: SpecStepGraphs | None = None
        self._graph_draft = self._draft  # what the step's graphs run (capture_graphs)
        self.num_launches = 0
        self.block_tables = BlockTables(self.rows, runner.block_table_width)
        # Acceptance, the next catch-up state and the read-back row: one launch on the
        # Triton path (kernels/accept.py), the reference's ~25 torch ops elsewhere.
        self._accept_and_stage = greedy_accept_and_stage
        if runner.runtime.triton_kernels:
            from specdec.kernels.accept import accept_and_stage

            self._accept_and_stage = accept_and_stage

    def capture_graphs(self, batch_sizes: dict[TreeShape, list[int]]) -> Iterator[str]:
        """Graphs of the whole step of each band's shape for its bucketed batch sizes (GPU
        path, after the runner's and the proposer's own graphs), one per iteration (it
        yields what it captured); launches replay them once all are captured. Where the
        proposer compiles its growth, everything before the verify forward compiles as
        one region with it: the state's gathers, the slots and the verification inputs
        fuse into a few kernels."""
        if self.proposer.compiles_growth:
            self._graph_draft = compile_region(self._draft, fullgraph=True)
        graphs = SpecStepGraphs(self, batch_sizes)
        yield from graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def launch(self, requests: list[Request], prev: list[SpecLaunch]) -> SpecLaunch:
        """Draft, verify and accept one step for ``requests`` (all decoding, greedy) without
        reading anything back. ``prev``: the launches in flight (a step, arrivals'
        prefills); every request is then a row of one of them and continues from its
        device outcome. With none, all start from the host state
        (``Proposer.pipeline_inputs``)."""
        runner = self.runner
        b = len(requests)
        shape = self.proposer.shape_at(b)  # the step's band
        if not prev:
            self.state.put(CatchUpState(*self.proposer.pipeline_inputs(requests).root_state))
            src = list(range(b))
        else:
            rows = {
                r.request_id: launch.state_row(i)
                for launch in prev
                for i, r in enumerate(launch.requests)
            }
            src = [rows[r.request_id] for r in requests]
        tables = self.block_tables.update([r.block_ids for r in requests])
        graphs = self.graphs
        bucket = graphs.bucket(shape, b) if graphs is not None else None
        if bucket is not None:
            packed = graphs.run(shape, src, tables, bucket)
        else:
            device = runner.device
            packed = self._step(  # off CUDA to_device shares the array: pass a copy
                to_device(np.array(src, dtype=np.int64), device),
                to_device(tables.copy(), device),
                shape,
            )
        self.num_launches += 1
        return SpecLaunch(
            requests=list(requests),
            num_draft_tokens=shape.max_draft_tokens,
            depth=shape.depth,
            state=self.state,
            _host=to_host(packed),
            num_signals=packed.shape[1] - (shape.depth + 2),  # what pack_signals appended
        )

    @torch.inference_mode()
    def arrive(
        self,
        requests: list[Request],
        first_tokens: torch.Tensor,  # [n] int64: each prompt's next token, picked on device
        aux: torch.Tensor,  # [n, aux width]: the target's aux states at each prompt's end
    ) -> SpecLaunch:
        """Arrivals' prefills as launches in flight: request ``i``'s prompt ends at cache
        index ``r = num_computed_tokens`` (the engine holds it one step behind, as for a
        step: the prompt's last token is the root, nothing accepted, the first token the
        bonus), so its catch-up state row gets token ``first_tokens[i]``, aux ``aux[i]``,
        ``last = 0`` and ``start = r``: the next launch catches the head up there and
        drafts from the first token. The head's K/V below ``r`` is the caller's
        (``PipelinedProposer.start_pipelined``). Device ops and a queued read-back: no host
        sync."""
        n = len(requests)
        rows = [self.arrivals_at + (self._next_arrival + i) % self.rows for i in range(n)]
        self._next_arrival = (self._next_arrival + n) % self.rows
        self.num_arrivals += n
        device = first_tokens.device
        staged = to_device(
            np.array([rows, [r.num_computed_tokens for r in requests]], dtype=np.int64), device
        )
        index, roots = staged[0], staged[1]
        state = self.state
        state.tokens[index, 0] = first_tokens
        state.aux[index, 0] = aux.to(state.aux.dtype)
        state.last[index] = 0
        state.start[index] = roots
        # The read-back row as a step's: nothing accepted, then the emitted token.
        packed = torch.stack([torch.zeros_like(first_tokens), first_tokens], dim=1)
        return SpecLaunch(
            requests=list(requests),
            num_draft_tokens=0,
            depth=0,
            state=state,
            _host=to_host(packed),
            state_rows=rows,
        )

    def _step(
        self,
        src: torch.Tensor,  # [batch] int: each row's catch-up state row (padding: pad_row)
        tables: torch.Tensor,  # [batch, width] int32: block tables
        shape: TreeShape,  # the step's band
        captured: bool = False,  # inside a graph: the head's and the target's graph paths
    ) -> torch.Tensor:  # [batch, depth + 2 + k] int64: num_accepted, emitted tokens, signals
        """One pipelined step, device ops only (capturable); rows ``0 .. batch`` of the
        catch-up state then hold its outcome."""
        runner = self.runner
        draft = self._graph_draft if captured else self._draft
        tree, step, root_index, slots = draft(src, tables, shape, captured)
        if captured:
            logits, aux = runner.graph_forward(step.input_ids, step.positions, step.meta)
        else:
            logits, aux = runner.execute(step)  # [batch * q, vocab], [batch * q, A]
        batch, q = tree.token_ids.shape
        best = logits.argmax(dim=-1).view(batch, q)  # the target's choice at every node
        # Rows 0 .. batch of the state get the outcome (tokens, aux along the path, count,
        # root); the read-back row is num_accepted, then the emitted tokens.
        acceptance, packed = self._accept_and_stage(
            best,
            tree.token_ids,
            tree.parents,
            tree.depths,
            shape.depth,
            aux,
            root_index,
            self.state.fields(),
        )
        if not tree.is_chain:  # a chain's accepted nodes already sit next to the root
            runner.move_kv(*accepted_path_moves(acceptance, slots))
        return pack_signals(packed, tree.signals)

    def _draft(
        self,
        src: torch.Tensor,  # [batch] int: each row's catch-up state row
        tables: torch.Tensor,  # [batch, width] int32
        shape: TreeShape,
        captured: bool,
    ) -> tuple[TreeBatch, StepInputs, torch.Tensor, torch.Tensor]:
        """The step's draft side, device ops only: the catch-up state's rows, the head's
        catch-up and growth, and the verification inputs of the trees. Returns (trees,
        verify inputs, root_index [batch], slots [batch, q])."""
        runner = self.runner
        state = self.state.take(src)  # copies: the writes below overwrite the rows read
        root_index = state.start + state.last + 1  # [batch]: each tree root's cache index
        # The slots of the tree's cache indices, looked up once: the head's draft levels,
        # the verification and the accepted K/V's move all address them.
        offsets = self.node_offsets[: shape.max_draft_tokens + 1]
        slots = cache_slots(tables, root_index[:, None] + offsets, runner.block_size)
        slots = slots.view(root_index.shape[0], -1)  # [batch, q]
        inputs = GrowInputs(
            roots=state.tokens.gather(1, state.last[:, None]).squeeze(1),
            start=root_index,
            block_tables=tables,
            root_state=state.fields(),
            slots=slots,
        )
        # The reference backend loops over host lengths (free off CUDA); compiled code
        # reaches attention through the opaque op, which needs none.
        if runner.device.type == "cpu" and not torch.compiler.is_compiling():
            inputs.start_cpu = root_index.tolist()
        tree = self.proposer.grow_pipelined(shape, inputs, runner.max_model_len, captured=captured)
        step = verify_inputs(
            tree, root_index, slots, tables, runner.max_model_len, inputs.start_cpu
        )
        return tree, step, root_index, slots


class SpecStepGraphs:
    """CUDA graphs of ``SpecPipeline._step``, one per band shape and bucketed batch size
    (the verify graphs' buckets). Each launch stages its inputs in one host-to-device copy
    into the graphs' int32 buffer: the source rows (padding rows: the zero ``pad_row``)
    at offset 0, the block tables (padding rows null) from a fixed offset. Padding rows
    catch up and draft from cache index 0 through null block tables: they write the null
    block only, and their outcome rows are never read."""

    def __init__(self, pipeline: SpecPipeline, batch_sizes: dict[TreeShape, list[int]]) -> None:
        self.pipeline = pipeline
        runner = pipeline.runner
        self.batch_sizes = {
            shape: sorted(bs for bs in sizes if bs <= pipeline.rows)
            for shape, sizes in batch_sizes.items()
        }
        m = max((max(s, default=0) for s in self.batch_sizes.values()), default=0)
        self.width = runner.block_table_width
        self.tables_at = aligned(m, 4)  # the block tables' offset in ``inputs``
        self.inputs = torch.zeros(
            self.tables_at + m * self.width, dtype=torch.int32, device=runner.device
        )
        self.outputs: dict[tuple[TreeShape, int], torch.Tensor] = {}
        self.graphs: dict[tuple[TreeShape, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.num_replays = 0

    def capture(self) -> Iterator[str]:
        """Capture one graph per iteration, largest batch first (the others reuse its
        pool); yields what it captured. Steps replay them once all are captured."""
        keys = [(shape, bs) for shape, sizes in self.batch_sizes.items() for bs in sizes]
        for shape, bs in sorted(keys, key=lambda k: -k[1]):
            self.outputs[shape, bs] = self._capture(shape, bs)
            drafts = shape.max_draft_tokens
            yield f"pipelined step: depth {shape.depth}, {drafts} drafts, batch {bs}"
        # The warm-up and captured runs stepped the padding rows' outcomes into rows
        # 0 .. bs: start clean.
        for t in self.pipeline.state.fields():
            t.zero_()

    def _args(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = self.inputs[:bs]
        tables = self.inputs[self.tables_at : self.tables_at + bs * self.width]
        return src, tables.view(bs, self.width)

    def _run(self, shape: TreeShape, bs: int) -> torch.Tensor:
        src, tables = self._args(bs)
        return self.pipeline._step(src, tables, shape, captured=True)

    def _capture(self, shape: TreeShape, bs: int) -> torch.Tensor:
        """Warm up, capture the step of ``bs`` rows as graph ``(shape, bs)``; returns its
        output."""
        self.inputs[:bs].fill_(self.pipeline.pad_row)  # padding rows: the null block only
        graph, out = capture_graph(lambda: self._run(shape, bs), self.pool)
        self.pool = graph.pool()
        self.graphs[shape, bs] = graph
        return out

    def _replay(self, shape: TreeShape, bs: int) -> None:
        self.graphs[shape, bs].replay()

    def bucket(self, shape: TreeShape, batch: int) -> int | None:
        return next((bs for bs in self.batch_sizes.get(shape, ()) if bs >= batch), None)

    def run(self, shape: TreeShape, src: list[int], tables: np.ndarray, bs: int) -> torch.Tensor:
        """Stage ``src`` and ``tables`` ([batch, width] int32) for graph ``(shape, bs)``
        and replay it; returns the outcome rows ``0 .. batch`` (the graph's buffer: valid
        until its next replay)."""
        b = len(src)
        staged = np.zeros(self.tables_at + bs * self.width, dtype=np.int32)
        staged[:bs] = self.pipeline.pad_row
        staged[:b] = src
        staged[self.tables_at : self.tables_at + b * self.width] = tables.reshape(-1)
        to_device(staged, self.inputs.device, out=self.inputs)
        self._replay(shape, bs)
        self.num_replays += 1
        return self.outputs[shape, bs][:b]
