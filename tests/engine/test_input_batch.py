"""Step inputs: the decode-only fast path of ``build_step_inputs`` builds exactly what
the general loop builds for the same rows, and a step staged in a CUDA graph's buffers
builds what an unstaged one does, laid out as the graph reads it."""

from __future__ import annotations

import random

import torch

from specdec.engine.input_batch import build_step_inputs
from specdec.engine.scheduler import ScheduledRequest
from specdec.ops.step_inputs import BlockTables, PendingTokens, block_table_array
from specdec.request import Request
from specdec.sampling_params import SamplingParams

CPU = torch.device("cpu")
BS = 16


def _request(rng: random.Random, i: int, pending: bool) -> Request:
    n, o = rng.randint(1, 70), rng.randint(0, 40)
    r = Request(str(i), [rng.randrange(1000) for _ in range(n)], SamplingParams(), max_tokens=99)
    r.output_token_ids = [rng.randrange(1000) for _ in range(o)]
    if rng.random() < 0.2 and n + o > 2:  # a one-token chunk inside the known tokens
        r.num_computed_tokens = rng.randrange(n + o - 1)
    elif pending:  # async scheduling: the input is the step in flight's token
        r.num_computed_tokens, r.num_pending_tokens = n + o, 1
    else:
        r.num_computed_tokens = n + o - 1
    r.block_ids = rng.sample(range(5000), (n + o + 1) // BS + 1 + rng.randint(0, 2))
    return r


def test_decode_rows_match_the_general_path() -> None:
    """A decode-only batch takes the fast path; the same rows followed by a prefill row
    take the general loop. Every per-row input of the decode rows must agree."""
    rng = random.Random(0)
    for trial in range(60):
        asyncish = trial % 3
        rows = [_request(rng, i, pending=asyncish and rng.random() < 0.7) for i in range(20)]
        in_flight = [r for r in rows if r.num_pending_tokens]
        pending = PendingTokens(
            torch.randint(1000, (max(len(in_flight), 1),)),
            {r.request_id: k for k, r in enumerate(in_flight)},
        )
        prefill = Request("p", list(range(40)), SamplingParams(), max_tokens=9)
        prefill.block_ids = [4999, 4998, 4997]
        decode = [ScheduledRequest(r, 1) for r in rows]
        fast = build_step_inputs(decode, BS, CPU, pending=pending)
        general = build_step_inputs(
            [*decode, ScheduledRequest(prefill, 40)], BS, CPU, pending=pending
        )
        assert fast.is_decode_only and not general.is_decode_only
        n = len(rows)
        assert torch.equal(fast.input_ids, general.input_ids[:n])
        assert torch.equal(fast.positions, general.positions[:n])
        assert torch.equal(fast.meta.slot_mapping, general.meta.slot_mapping[:n])
        assert torch.equal(fast.logits_indices, general.logits_indices[:-1])
        assert fast.sampled_rows == general.sampled_rows[:-1]
        assert fast.logits_counts == general.logits_counts[:-1]
        assert torch.equal(fast.meta.seq_lens, general.meta.seq_lens[:n])
        assert torch.equal(fast.meta.query_start_loc, general.meta.query_start_loc[: n + 1])
        width = fast.meta.block_tables.shape[1]
        assert torch.equal(fast.meta.block_tables, general.meta.block_tables[:n, :width])
        assert not general.meta.block_tables[:n, width:].any()


def test_staged_inputs_are_the_plain_ones_laid_out_for_their_graph() -> None:
    """A uniform step built into a CUDA graph's buffers (``GraphStaging``) yields the same
    tensors as one built on its own, and the buffers hold what the graph of its bucket
    reads: token rows padded to ``bucket * q`` with zeros (the null block's slot 0) and
    seq_lens padded with ``q``, so the replay needs no device-side copy of them."""
    from specdec.engine.cuda_graph import GraphStaging, _Buffers

    rng = random.Random(1)
    buffers = _Buffers(1, 32, width=64, device=CPU)
    for trial in range(30):
        rows = [_request(rng, i, pending=trial % 2 == 1) for i in range(rng.randint(1, 32))]
        in_flight = [r for r in rows if r.num_pending_tokens]
        # The step in flight's rows in its order, or (some trials) shuffled among more rows.
        more = trial % 4 == 3
        where = rng.sample(range(len(in_flight) + 3), len(in_flight)) if more else None
        pending = PendingTokens(
            torch.randint(1000, (max(len(in_flight) + 3 * more, 1),)),
            {r.request_id: where[k] if more else k for k, r in enumerate(in_flight)},
        )
        n = len(rows)
        bucket = next(b for b in (1, 2, 4, 8, 16, 24, 32) if b >= n)
        buffers.int64.fill_(-7)  # whatever an earlier step left
        buffers.int32.fill_(-7)

        def staging(q: int, num_seqs: int, bucket=bucket) -> GraphStaging | None:
            return GraphStaging(q, bucket, buffers.int64, buffers.int32) if q == 1 else None

        decode = [ScheduledRequest(r, 1) for r in rows]
        plain = build_step_inputs(decode, BS, CPU, pending=pending)
        staged = build_step_inputs(decode, BS, CPU, pending=pending, staging=staging)
        assert staged.staged and not plain.staged
        for name in ("input_ids", "positions", "logits_indices"):
            assert torch.equal(getattr(staged, name), getattr(plain, name)), name
        for name in ("slot_mapping", "seq_lens", "query_start_loc", "block_tables"):
            assert torch.equal(getattr(staged.meta, name), getattr(plain.meta, name)), name
        for row, r in enumerate(rows):  # pending inputs: the step in flight's tokens
            if r.num_pending_tokens:
                assert plain.input_ids[row] == pending.token_ids[pending.rows[r.request_id]]
        ids, positions, slots = buffers.tokens(bucket)
        assert torch.equal(ids[:n], plain.input_ids) and not ids[n:].any()
        assert torch.equal(positions[:n], plain.positions) and not positions[n:].any()
        assert torch.equal(slots[:n], plain.meta.slot_mapping) and not slots[n:].any()
        assert torch.equal(buffers.seq_lens[:n], plain.meta.seq_lens)
        assert (buffers.seq_lens[n:bucket] == 1).all()
        # Views of the buffers: what the graph's static inputs are.
        assert staged.input_ids.data_ptr() == ids.data_ptr()
        assert staged.meta.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()


def test_block_tables_cache_equals_a_rebuilt_table() -> None:
    """``BlockTables`` rows always equal ``block_table_array``'s over a run of the changes
    a batch's block lists go through: appends, trims then appends back to the same
    length with other ids (the row must not be taken as unchanged), preemption (the list
    emptied and replaced), requests finishing and arriving (rows shift), list objects
    mutated in place after an update."""
    rng = random.Random(0)
    width = 12
    tables = BlockTables(rows=6, width=width)
    batch = [[rng.randrange(1, 500) for _ in range(rng.randrange(0, 5))] for _ in range(4)]
    kinds = set()
    for _ in range(400):
        got = tables.update(batch)
        assert got.shape == (len(batch), width)
        assert (got == block_table_array(batch, width)).all()
        kind = rng.choice(["same", "append", "trim-regrow", "preempt", "finish", "arrive"])
        kinds.add(kind)
        row = rng.randrange(len(batch)) if batch else 0
        if kind == "append" and batch and len(batch[row]) < width:
            batch[row].append(rng.randrange(1, 500))  # in place: the cache held a copy
        elif kind == "trim-regrow" and batch and batch[row]:
            n = len(batch[row])
            del batch[row][rng.randrange(n) :]
            batch[row].extend(rng.randrange(500, 900) for _ in range(n - len(batch[row])))
        elif kind == "preempt" and batch:
            batch[row] = []
        elif kind == "finish" and len(batch) > 1:
            del batch[row]
        elif kind == "arrive" and len(batch) < 6:
            batch.insert(row, [rng.randrange(1, 500) for _ in range(rng.randrange(0, width))])
    assert len(kinds) == 6


def test_kept_block_tables_build_the_same_steps() -> None:
    """A runner's ``BlockTables`` kept over a run of steps (batches that grow, shrink,
    shift and mix in prefill rows) gives every step the block tables and slots that
    ``block_table_array`` gives it; a batch wider than the kept array falls back to it."""
    rng = random.Random(1)
    kept = BlockTables(rows=12, width=10)
    pool = [_request(rng, i, pending=False) for i in range(16)]
    for _ in range(40):
        batch = rng.sample(pool, rng.randint(1, 14))
        for r in batch:  # now and then a request gains a block
            if rng.random() < 0.3:
                r.block_ids = [*r.block_ids, rng.randrange(5000, 6000)]
        scheduled = [ScheduledRequest(r, 1) for r in batch]
        if rng.random() < 0.3:
            prefill = Request("p", list(range(20)), SamplingParams(), max_tokens=9)
            prefill.block_ids = [rng.randrange(6000, 7000) for _ in range(2)]
            scheduled.append(ScheduledRequest(prefill, 20))
        want = build_step_inputs(scheduled, BS, CPU)
        got = build_step_inputs(scheduled, BS, CPU, block_tables=kept)
        assert torch.equal(got.meta.block_tables, want.meta.block_tables)
        assert torch.equal(got.meta.slot_mapping, want.meta.slot_mapping)
