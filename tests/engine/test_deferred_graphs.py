"""Deferred graphs (``EngineConfig.defer_graphs``): the engine starts with the target's
decode and narrower prefill graphs and captures the rest (the target's verify graphs, the
draft's growth, the pipelined step, then the wider prefill graphs) afterwards, one per
call between steps or while the serving core is idle. Until speculation's last one is
captured every step decodes plainly; then the head catches up and speculates. Steps
whose prefill graph is still pending run eagerly. Real SmolLM2 (fp32, CPU) with a trained
EAGLE-3 head, the GPU path's graphs as CPU stand-ins (test_engine.py)."""

from __future__ import annotations

import queue
import time

import pytest
from test_engine import greedy, make_llm, token_ids
from test_spec_pipeline import _use_graph_stand_ins

from specdec.config import SpeculativeConfig
from specdec.engine import llm_engine
from specdec.serve.engine_core import EngineCore

PICKED = [0, 3, 5, 7]
LENGTHS = [40, 48, 36, 44]


@pytest.fixture(scope="module")
def reference(smollm2_dir, chats) -> list[list[int]]:
    outs = make_llm(smollm2_dir).generate(
        [chats[i] for i in PICKED], [greedy(n) for n in LENGTHS], use_tqdm=False
    )
    return token_ids(outs)


def _deferred_engine(smollm2_dir, head_dir, monkeypatch, **kwargs):
    """An engine of at most 4 sequences with deferred graphs (CPU stand-ins), speculating
    with ``head_dir`` (None: plain)."""
    spec = head_dir and SpeculativeConfig(
        method="eagle3",
        model=str(head_dir),
        num_speculative_tokens=3,
        disable_by_batch_size=4,
        pipelined=True,
    )
    llm = make_llm(
        smollm2_dir,
        speculative=spec,
        max_num_seqs=4,
        cuda_graph_max_batch_size=4,
        defer_graphs=True,
        **kwargs,
    )
    engine = llm.engine
    _use_graph_stand_ins(engine, monkeypatch)
    engine._capture_graphs()
    return llm, engine


def _count_speculation(engine, monkeypatch) -> list[bool]:
    """Record, for every draft the engine asks for (synchronous proposals and pipelined
    launches), whether speculation's deferred graphs were still pending then."""
    seen: list[bool] = []
    propose, launch = engine.proposer.propose, engine.pipeline.launch

    def counted_propose(*args):
        seen.append(engine.speculation_graphs_pending)
        return propose(*args)

    def counted_launch(*args):
        seen.append(engine.speculation_graphs_pending)
        return launch(*args)

    monkeypatch.setattr(engine.proposer, "propose", counted_propose)
    monkeypatch.setattr(engine.pipeline, "launch", counted_launch)
    return seen


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_steps_decode_plainly_until_the_deferred_graphs_are_captured(
    smollm2_dir, trained_head_dir, chats, reference, async_scheduling, monkeypatch
) -> None:
    """Steps capture one pending graph each (the interval set to 0) after reading the
    step in flight; no draft is made before the last one, the head speculates after it
    (catching up on the plain steps' aux states), and every token equals plain
    decoding's."""
    monkeypatch.setattr(llm_engine, "DEFERRED_CAPTURE_INTERVAL_S", 0.0)
    llm, engine = _deferred_engine(
        smollm2_dir, trained_head_dir, monkeypatch, async_scheduling=async_scheduling
    )
    assert engine.has_pending_graphs
    assert not engine.proposer.grower.graphs and engine.pipeline.graphs is None
    assert not engine.runner.graphs.batch_sizes.get(4)  # no verify graph of 4-node chains
    seen = _count_speculation(engine, monkeypatch)
    outs = llm.generate([chats[i] for i in PICKED], [greedy(n) for n in LENGTHS], use_tqdm=False)
    assert token_ids(outs) == reference
    assert not engine.has_pending_graphs
    assert seen and not any(seen)  # drafts only once every graph was there
    assert engine.spec_stats.accepted_tokens > 0
    # Every planned graph was captured: a verify, a growth and a whole-step graph per
    # bucket.
    assert engine.runner.graphs.batch_sizes[4] == [1, 2, 4]
    (growth,) = engine.proposer.grower.graphs.values()
    assert growth.batch_sizes == growth.planned == [1, 2, 4]
    assert sorted(bs for _, bs in engine.pipeline.graphs.outputs) == [1, 2, 4]
    assert engine.pipeline.graphs.num_replays > 0


def test_steps_wait_the_interval_between_captures(
    smollm2_dir, trained_head_dir, chats, reference, monkeypatch
) -> None:
    """With the interval longer than the run, no step captures a graph (the first may
    capture one only an interval after the engine started): the whole run decodes
    plainly, with the same tokens."""
    monkeypatch.setattr(llm_engine, "DEFERRED_CAPTURE_INTERVAL_S", 3600.0)
    llm, engine = _deferred_engine(smollm2_dir, trained_head_dir, monkeypatch)
    seen = _count_speculation(engine, monkeypatch)
    outs = llm.generate([chats[i] for i in PICKED], [greedy(n) for n in LENGTHS], use_tqdm=False)
    assert token_ids(outs) == reference
    assert engine.has_pending_graphs and not seen
    assert not engine.deferred_graphs.times


def test_the_idle_serving_core_captures_the_deferred_graphs(
    smollm2_dir, trained_head_dir, chats, reference, monkeypatch
) -> None:
    """An idle core iteration captures one pending graph instead of waiting for a command
    (and returns at once); a command that is waiting is applied first. Once all are
    captured, the core's requests speculate and keep plain decoding's tokens."""
    from specdec.serve.engine_core import core_params

    monkeypatch.setattr(llm_engine, "DEFERRED_CAPTURE_INTERVAL_S", 3600.0)  # idle only
    _, engine = _deferred_engine(smollm2_dir, trained_head_dir, monkeypatch)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    sent: list[tuple] = []
    core = EngineCore(engine, inbox, sent.append)
    prompt = chats[PICKED[0]]
    inbox.put(("add", "a", prompt, core_params(greedy(LENGTHS[0])), time.monotonic()))
    assert core._iteration()  # the add, then a (plain) step: no capture
    assert ("added", [("a", None)]) in sent
    assert not engine.deferred_graphs.times
    while engine.has_unfinished_requests():
        assert core._iteration()
    captures = 0
    while engine.has_pending_graphs:  # idle, empty inbox: one graph per iteration
        assert core._iteration()
        captures += 1
    assert captures == 10  # nine graphs, then the iteration that finds none left
    assert inbox.empty()
    inbox.put(("add", "b", prompt, core_params(greedy(LENGTHS[0])), time.monotonic()))
    while True:
        assert core._iteration()
        if not engine.has_unfinished_requests():
            break
    # /metrics' view: pending while idle after "a", not pending once idle after the last.
    snapshots = [m[2] for m in sent[: sent.index(("added", [("b", None)]))] if m[0] == "step"]
    pending = [s.spec_graphs_pending for s in snapshots if s is not None]
    assert pending[0] and not pending[-1]
    pending = [s.graphs_pending for s in snapshots if s is not None]
    assert pending[0] and not pending[-1]
    tokens = {
        rid: [t for m in sent if m[0] == "step" for d in m[1] if d[0] == rid for t in d[1]]
        for rid in ("a", "b")
    }
    assert tokens["a"] == tokens["b"] == reference[0]
    assert engine.spec_stats.accepted_tokens > 0


def test_wider_prefill_graphs_follow_start_up(smollm2_dir, chats, reference, monkeypatch) -> None:
    """A plain engine with deferred graphs starts with the decode and prefill graphs of
    steps over at most ``STARTUP_GRAPH_SEQS`` sequences (2 here): four prompts arriving
    together and their decodes run eagerly, and replay graphs once the wider ones are
    captured between steps. The tokens are plain decoding's either way, and speculation
    never waited on them."""
    from specdec.engine import model_runner

    monkeypatch.setattr(llm_engine, "DEFERRED_CAPTURE_INTERVAL_S", 3600.0)
    monkeypatch.setattr(model_runner, "STARTUP_GRAPH_SEQS", 2)
    llm, engine = _deferred_engine(smollm2_dir, None, monkeypatch, prefill_graph_max_tokens=512)
    decode, prefill = engine.runner.graphs, engine.runner.prefill_graphs
    assert prefill.seq_buckets == [2, 4, 5]  # up to the decode graphs' largest batch
    assert {s for _, s in prefill.outputs} == {2}
    assert decode.batch_sizes[1] == [1, 2]
    assert engine.has_pending_graphs and not engine.speculation_graphs_pending
    prompts, params = [chats[i] for i in PICKED], [greedy(n) for n in LENGTHS]
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == reference
    # Four prompts in one step, then four decodes a step: no graph yet (two decode at the
    # end, as requests finish).
    assert prefill.num_replays == 0
    assert decode.num_replays.get(1, 0) < max(LENGTHS) - min(LENGTHS)
    while engine.capture_pending_graph():
        pass
    assert {s for _, s in prefill.outputs} == {2, 4, 5}
    assert decode.batch_sizes[1] == [1, 2, 4]
    assert {f: len(t) for f, t in engine.deferred_graphs.times.items()} == {
        "decode": 1,
        "prefill": len(prefill.keys) - len(prefill.token_buckets),  # all but S = 2
    }
    replays = decode.num_replays[1]
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert prefill.num_replays > 0 and decode.num_replays[1] - replays >= min(LENGTHS) - 1


def test_tree_kernels_compile_first_among_speculations_deferred_graphs(
    smollm2_dir, trained_head_dir, monkeypatch
) -> None:
    """With deferred graphs the engine reports ready having compiled only the attention
    variants of plain steps; the tree-mask variants compile as speculation's first
    deferred item, before any verify graph (the Triton path's warm-up, recorded here)."""
    from specdec.engine.model_runner import ModelRunner

    warmed: list[tuple[bool, bool]] = []

    def warm_up(self, *, plain: bool = True, trees: bool, draft: bool = False) -> int:
        assert draft, "an EAGLE-3 head's drafts attend: their variants are warmed too"
        warmed.append((plain, trees))
        return 8

    monkeypatch.setattr(ModelRunner, "warm_up_kernels", warm_up)
    _, engine = _deferred_engine(smollm2_dir, trained_head_dir, monkeypatch)
    # Built on the CPU path (no graphs), the engine warmed both halves at once; the
    # stand-in graphs' capture planned the tree half lazily, as the GPU path does.
    assert warmed == [(True, False), (False, True)]
    warmed.clear()
    assert engine.deferred_graphs.capture_next()
    assert warmed == [(False, True)]
    assert not engine.runner.graphs.batch_sizes.get(4)  # no verify graph yet
    assert engine.deferred_graphs.capture_next()
    assert engine.runner.graphs.batch_sizes.get(4)  # then the verify graphs
    assert warmed == [(False, True)]
    assert next(iter(engine.deferred_graphs.times)) == "attention warm-up"
