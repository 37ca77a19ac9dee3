"""The block drafter in the pipelined speculative step (spec/pipeline.py,
``BlockProposer`` as a ``PipelinedProposer``).

On the real SmolLM2 (fp32, CPU) with a one-layer block drafter fitted to SmolLM2's own
greedy continuations of two prompts (drafts really accepted, so catch-ups of several rows,
tree K/V moves and dropped work all happen), pipelined steps emit the synchronous step's
tokens and plain greedy decoding's, and count the same steps, drafts and acceptances:
chains and trees; stops and an abort while steps are in flight; arrivals joining without
a drain; a pipeline started from the host state after a chunked prefill (a long
catch-up); and the GPU path's graph replays (CPU stand-ins, the block forward through the
Triton kernel under the interpreter).
"""

from __future__ import annotations

import pytest
import torch
from test_block_drafter_engine import (
    NEEDS_TRITON,
    EagerBlockGraphs,
    _save,
    fit_to_continuations,
    smollm2_drafter,
)
from test_engine import LOSSLESS_TOKENS, greedy, make_llm, token_ids
from test_spec_pipeline import PICKED, _use_graph_stand_ins

from specdec import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.engine.pipelined_step import PipelinedStep

FITTED = PICKED[:2]  # the prompts whose continuations the drafter learns
PROMPTS = PICKED[:3]  # those and one it did not learn: drafts mixed
CHAIN = {"num_speculative_tokens": 3}
TREE = {"tree": "dynamic", "num_speculative_tokens": 3, "top_k": 2, "total_tokens": 8}


@pytest.fixture(scope="module")
def reference(smollm2_dir, chats) -> dict[int, list[int]]:
    """Plain greedy decoding of PROMPTS."""
    prompts = [chats[i] for i in PROMPTS]
    outs = make_llm(smollm2_dir).generate(prompts, greedy(LOSSLESS_TOKENS), use_tqdm=False)
    return dict(zip(PROMPTS, token_ids(outs), strict=True))


@pytest.fixture(scope="module")
def drafter_dir(smollm2_dir, smollm2_hf, chats, reference, tmp_path_factory) -> str:
    prompts = [chats[i] for i in FITTED]
    sequences = [p + reference[i] for p, i in zip(prompts, FITTED, strict=True)]
    vocab = torch.tensor(sorted({t for s in sequences for t in s} | set(range(256))))
    torch.manual_seed(0)
    drafter = smollm2_drafter(smollm2_dir, vocab)
    fit_to_continuations(drafter, smollm2_hf, sequences, [len(p) for p in prompts])
    return _save(drafter, tmp_path_factory.mktemp("fitted_block_drafter"))


def _llm(smollm2_dir, drafter_dir, shape: dict, pipelined: bool, **kwargs):
    spec = SpeculativeConfig(method="dflash", model=drafter_dir, pipelined=pipelined, **shape)
    return make_llm(smollm2_dir, speculative=spec, **kwargs)


def _run(llm, prompts, params) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """Each request's tokens, and its (steps, drafted, accepted tokens)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    counts = [
        (m.spec_steps, m.spec_drafted_tokens, m.spec_accepted_tokens)
        for m in (o.metrics for o in outs)
    ]
    return token_ids(outs), counts


def _assert_clean(engine) -> None:
    """Every block back in the pool, no aux rows kept, nothing in flight."""
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks
    assert len(engine.proposer.rows) == 0
    if engine.pipeline is not None:
        assert not engine.mode(PipelinedStep).in_flight


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain3", "dynamic"])
def test_pipelined_block_steps_equal_synchronous_and_plain(
    smollm2_dir, drafter_dir, chats, reference, shape
) -> None:
    """The same tokens pipelined, synchronous and plain; each request's steps, drafted and
    accepted tokens as the synchronous step counts them (τ does not depend on
    pipelining); nearly every step pipelined, drafts accepted.

    A chain's counts are equal. A tree's may differ by a rare acceptance: its second
    candidates come from near-ties of the slot logits, and the pipelined step computes
    the drafter's context K/V in other batch shapes than the synchronous one, so the fp32
    rounding that decides a near-tie can differ (it does at one thread, not at two)."""
    prompts = [chats[i] for i in PROMPTS]
    runs = {}
    for pipelined in (False, True):
        llm = _llm(smollm2_dir, drafter_dir, shape, pipelined)
        runs[pipelined] = _run(llm, prompts, greedy(LOSSLESS_TOKENS))
        _assert_clean(llm.engine)
    assert runs[True][0] == runs[False][0] == [reference[i] for i in PROMPTS]
    if shape is CHAIN:
        assert runs[True][1] == runs[False][1]
    else:
        for got, want in zip(runs[True][1], runs[False][1], strict=True):
            assert abs(got[0] - want[0]) <= 2 and abs(got[2] - want[2]) <= 2, (got, want)
    engine = llm.engine
    stats = engine.spec_stats
    assert engine.pipeline.num_launches > 0.8 * stats.steps / len(PROMPTS)  # mostly pipelined
    assert stats.accepted_tokens / stats.steps > 0.5  # catch-ups of several rows


def test_pipelined_block_stops_aborts_and_arrivals(smollm2_dir, drafter_dir, chats) -> None:
    """Requests stop mid-step (max_tokens, stop strings: the step in flight's work for
    them is dropped), one is aborted while its steps are in flight, and new requests
    arrive while others decode (prefilled beside the step in flight, no drain): each
    finished output equals plain decoding's with the same params and the synchronous
    step's drafts and counts, the aborted one's tokens are a prefix of plain's."""
    prompts = [chats[i] for i in PICKED]
    params = [
        SamplingParams(temperature=0, max_tokens=n, stop=stop)
        for n, stop in [(32, None), (7, None), (40, ["\n"]), (29, None), (40, [". "]), (21, None)]
    ]
    expected = token_ids(make_llm(smollm2_dir).generate(prompts, params, use_tqdm=False))
    synchronous = _run(_llm(smollm2_dir, drafter_dir, TREE, pipelined=False), prompts, params)
    assert synchronous[0] == expected
    llm = _llm(smollm2_dir, drafter_dir, TREE, pipelined=True)
    engine = llm.engine
    ids = [engine.add_request(p, s) for p, s in zip(prompts[:3], params[:3], strict=True)]
    aborted = engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=64))
    got: dict[str, list[int]] = {}
    counts: dict[str, tuple[int, int, int]] = {}
    partial: list[int] = []
    step = 0
    while engine.has_unfinished_requests() or len(ids) < len(prompts):
        step += 1
        if step in (4, 9, 15) and len(ids) < len(prompts):  # arrivals mid-decode
            ids.append(engine.add_request(prompts[len(ids)], params[len(ids)]))
        if step == 6:
            assert engine.mode(PipelinedStep).in_flight
            engine.abort_request(aborted)
        for out in engine.step():
            if out.request_id == aborted:
                partial = out.outputs[0].token_ids
            elif out.finished:
                got[out.request_id] = out.outputs[0].token_ids
                m = out.metrics
                counts[out.request_id] = (
                    m.spec_steps,
                    m.spec_drafted_tokens,
                    m.spec_accepted_tokens,
                )
    assert [got[i] for i in ids] == expected
    assert [counts[i] for i in ids] == synchronous[1]  # the same drafts
    plain_long = token_ids(make_llm(smollm2_dir).generate([prompts[0]], greedy(64), use_tqdm=False))
    assert 0 < len(partial) < 64 and partial == plain_long[0][: len(partial)]
    assert engine.pipeline.num_arrivals == 7  # every request arrived into the pipeline
    assert engine.pipeline.num_launches > 0 and engine.num_dropped_tokens > 0
    _assert_clean(engine)


def test_pipeline_starts_from_a_long_host_catch_up(
    smollm2_dir, drafter_dir, chats, reference, monkeypatch
) -> None:
    """Prompts longer than the token budget are prefilled synchronously in chunks; the
    first pipelined launch then starts from the host state with the whole prompt to catch
    up on (``pipeline_inputs`` writes all but the last ``catch_up_width`` rows, the launch
    the rest), no synchronous verify step first: the synchronous run's drafts and counts,
    plain greedy tokens."""
    prompts = [chats[i] for i in FITTED]
    assert min(len(p) for p in prompts) > 32
    llm = _llm(smollm2_dir, drafter_dir, CHAIN, pipelined=True, max_num_batched_tokens=32)
    engine, proposer = llm.engine, llm.engine.proposer
    pending: list[int] = []
    inputs = proposer.pipeline_inputs

    def recording(requests):
        pending.extend(proposer.rows.pending_len(r) for r in requests)
        return inputs(requests)

    monkeypatch.setattr(proposer, "pipeline_inputs", recording)
    got = _run(llm, prompts, greedy(LOSSLESS_TOKENS))
    synchronous = _llm(smollm2_dir, drafter_dir, CHAIN, pipelined=False, max_num_batched_tokens=32)
    assert got == _run(synchronous, prompts, greedy(LOSSLESS_TOKENS))  # drafts alike
    assert got[0] == [reference[i] for i in FITTED]
    assert max(pending) > proposer.catch_up_width
    _assert_clean(engine)


@NEEDS_TRITON
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain3", "dynamic"])
def test_pipelined_block_graph_replays_keep_outputs(
    smollm2_dir, drafter_dir, chats, reference, monkeypatch, shape
) -> None:
    """The GPU path's replays with CPU stand-ins: the whole pipelined step's graph (the
    catch-up state gathered by source row, the context K/V written, the block forward
    through the paged Triton kernel, the trees, verify, acceptance) at bucketed batch
    sizes, padding rows drafting from the null block: the eager synchronous run's drafts
    and counts, plain greedy tokens, every launch a replay, no synchronous step but the
    prompts' prefill."""
    from specdec.spec import block_proposer

    monkeypatch.setattr(block_proposer, "BlockGraphs", EagerBlockGraphs)
    llm = _llm(smollm2_dir, drafter_dir, shape, pipelined=True, max_num_seqs=4,
               cuda_graph_max_batch_size=4)  # fmt: skip
    engine = llm.engine
    engine.proposer.paged = True  # the Triton path's block forward (the target's stays torch)
    _use_graph_stand_ins(engine, monkeypatch)
    engine._capture_graphs()
    assert engine.proposer.graphs is not None and engine.pipeline.graphs is not None
    prompts = [chats[i] for i in PROMPTS]
    params = [greedy(n) for n in (32, 24, 16)]  # the batch shrinks 3 -> 1, padded to buckets
    got = _run(llm, prompts, params)
    synchronous = _llm(smollm2_dir, drafter_dir, shape, pipelined=False)
    want = _run(synchronous, prompts, params)
    assert got[0] == want[0]
    if shape is CHAIN:
        assert got[1] == want[1]  # drafts alike: each slot's argmax
    else:
        # A dynamic tree keeps nodes by their probability products, whose last bits follow
        # the block forward's batch (bucketed and padded here, not in the synchronous
        # run), so a near-tie may keep another node: steps and drafts match one for one.
        assert [c[:2] for c in got[1]] == [c[:2] for c in want[1]]
    assert got[0] == [reference[i][: p.max_tokens] for i, p in zip(PROMPTS, params, strict=True)]
    pipeline = engine.pipeline
    assert pipeline.graphs.num_replays == pipeline.num_launches > 0
    assert engine.num_steps - pipeline.num_launches == 1
    _assert_clean(engine)
