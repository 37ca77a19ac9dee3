"""The pipelined speculative step (spec/pipeline.py) keeps plain greedy decoding's
tokens: device-side acceptance equals the host reference on random trees, and on the real
SmolLM2 (fp32, CPU) with a trained EAGLE-3 head (drafts really accepted, so K/V moves,
catch-ups and dropped work all happen) every output equals plain decoding: chains and
trees, stops mid-step, requests joining and leaving while steps are in flight, and graph
replays (CPU stand-ins)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_engine import (
    DYNAMIC,
    EagerGrowGraphs,
    EagerPrefillGraphs,
    EagerSpecStepGraphs,
    EagerStepGraphs,
    greedy,
    make_llm,
    token_ids,
)
from test_spec_exit_engine import CLOSE_IDS, OPEN_IDS, SIGNALS, check_exit, pick_delimiter

from specdec import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.engine.pipelined_step import PipelinedStep
from specdec.models import load_config
from specdec.models.eagle3_formats import load_eagle3, save_eagle3
from specdec.models.eagle3_head import Eagle3Head
from specdec.ops.accept import Acceptance, AcceptedRow, accepted_path_moves
from specdec.ops.attention_metadata import cache_slots
from specdec.spec.acceptance import greedy_accept_batch
from specdec.spec.spec_exit_runtime import SpecExitRuntime
from specdec.spec.tree import DraftTree
from specdec.spec.tree_draft import padded_catch_up_inputs
from specdec.spec_exit_params import SpecExitParams
from specdec.tree_shapes import ChainShape, StaticTreeShape

PICKED = [0, 3, 5, 7, 9, 12]  # six prompts of varied length


@pytest.fixture(scope="module")
def reference(smollm2_dir, chats) -> dict[int, list[int]]:
    """Plain greedy decoding of the picked prompts."""
    outs = make_llm(smollm2_dir).generate([chats[i] for i in PICKED], greedy(), use_tqdm=False)
    return dict(zip(PICKED, token_ids(outs), strict=True))


def _random_trees(batch: int, q: int, vocab: int, gen: torch.Generator) -> list[DraftTree]:
    trees = []
    for _ in range(batch):
        parents, depths, tokens = [0], [0], [int(torch.randint(vocab, (1,), generator=gen))]
        used: dict[int, set[int]] = {0: set()}
        for i in range(1, q):
            p = int(torch.randint(i, (1,), generator=gen))
            token = int(torch.randint(vocab, (1,), generator=gen))
            while token in used[p]:  # siblings carry distinct tokens
                token = (token + 1) % vocab
            used[p].add(token)
            used[i] = set()
            parents.append(p)
            depths.append(depths[p] + 1)
            tokens.append(token)
        trees.append(
            DraftTree(
                token_ids=torch.tensor(tokens),
                parents=torch.tensor(parents),
                depths=torch.tensor(depths),
            )
        )
    return trees


def _host_greedy_walk(tree: DraftTree, logits: torch.Tensor) -> AcceptedRow:
    """Greedy acceptance written plainly: from the root, move to the child whose token is
    the argmax at the current node; the bonus is the argmax where the walk stops."""
    best, tokens, parents = (
        logits.argmax(-1).tolist(),
        tree.token_ids.tolist(),
        tree.parents.tolist(),
    )
    v, path = 0, []
    while (
        c := next(
            (c for c in range(1, len(tokens)) if parents[c] == v and tokens[c] == best[v]), None
        )
    ) is not None:
        path.append(c)
        v = c
    return AcceptedRow(path, [tokens[c] for c in path] + [best[v]])


@pytest.mark.parametrize("q", [1, 2, 5, 12])
def test_greedy_acceptance_equals_the_host_walk(q: int) -> None:
    """Random trees of q and of fewer nodes in one batch, whose target mostly agrees with
    some child: the device acceptance (trees padded to one width) reads back as the plain
    walk, and its padding is as ``Acceptance`` promises."""
    gen = torch.Generator().manual_seed(q)
    vocab, batch = 16, 64
    trees = [
        t
        for pair in zip(
            _random_trees(batch // 2, q, vocab, gen),
            _random_trees(batch // 2, max(q // 2, 1), vocab, gen),
            strict=True,
        )
        for t in pair
    ]
    logits = torch.randn(sum(t.num_nodes for t in trees), vocab, generator=gen)
    start = 0
    for tree in trees:  # argmax at a node = one of its children's tokens, often
        n = tree.num_nodes
        for i in range(n):
            kids = [c for c in range(1, n) if int(tree.parents[c]) == i]
            if kids and torch.rand((), generator=gen) < 0.8:
                pick = kids[int(torch.randint(len(kids), (1,), generator=gen))]
                logits[start + i, tree.token_ids[pick]] += 100.0
        start += n
    got = greedy_accept_batch(trees, logits)
    assert got.width == q
    rows = got.tolist()
    assert sum(r.num_accepted for r in rows) > batch // 4 or q == 1  # paths exist
    start = 0
    for b, (tree, row) in enumerate(zip(trees, rows, strict=True)):
        assert row == _host_greedy_walk(tree, logits[start : start + tree.num_nodes])
        a = row.num_accepted
        assert int(got.bonus_token_ids[b]) == row.bonus_token_id
        assert got.path[b, a + 1 :].eq(0).all()  # padding: node 0
        start += tree.num_nodes


def _use_graph_stand_ins(engine, monkeypatch) -> None:
    """The GPU path's CUDA graphs with CPU stand-ins (captured by ``engine._capture_graphs``
    after this): verify, prefill, growth and whole-step graphs run eagerly from their
    static buffers."""
    from specdec.engine import model_runner
    from specdec.spec import pipeline as spec_pipeline
    from specdec.spec import tree_draft

    monkeypatch.setattr(model_runner, "StepGraphs", EagerStepGraphs)
    monkeypatch.setattr(model_runner, "PrefillGraphs", EagerPrefillGraphs)
    monkeypatch.setattr(tree_draft, "GrowGraphs", EagerGrowGraphs)
    monkeypatch.setattr(spec_pipeline, "SpecStepGraphs", EagerSpecStepGraphs)
    engine.runner.runtime = dataclasses.replace(engine.runner.runtime, use_cuda_graphs=True)


def _pipelined(smollm2_dir, head_dir, tree: dict, **kwargs):
    spec = SpeculativeConfig(method="eagle3", model=str(head_dir), pipelined=True, **tree)
    return make_llm(smollm2_dir, speculative=spec, **kwargs)


@pytest.mark.parametrize(
    ("tree", "accept"),
    [({"num_speculative_tokens": 3}, "torch"), (DYNAMIC, "torch"), (DYNAMIC, "kernel")],
    ids=["chain3", "dynamic", "dynamic-accept-kernel"],
)
def test_pipelined_steps_keep_greedy_outputs(
    smollm2_dir, trained_head_dir, chats, reference, tree, accept
) -> None:
    """``accept="kernel"``: the acceptance and catch-up state by the GPU path's one-launch
    kernel (kernels/accept.py, under the Triton interpreter), the rest as on the CPU."""
    llm = _pipelined(smollm2_dir, trained_head_dir, tree)
    engine = llm.engine
    if accept == "kernel":
        pytest.importorskip("triton")
        from specdec.kernels.accept import accept_and_stage

        engine.pipeline._accept_and_stage = accept_and_stage
    outs = llm.generate([chats[i] for i in PICKED], greedy(), use_tqdm=False)
    assert token_ids(outs) == [reference[i] for i in PICKED]
    stats = engine.spec_stats
    assert engine.pipeline.num_launches > 0.8 * stats.steps / len(PICKED)  # mostly pipelined
    assert stats.accepted_tokens / stats.steps > 0.25  # drafts accepted: moves, catch-ups
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks
    assert len(engine.proposer.rows) == 0 and not engine.mode(PipelinedStep).in_flight


def test_pipelined_stops_and_arrivals_keep_outputs(
    smollm2_dir, trained_head_dir, smollm2_tokenizer, chats
) -> None:
    """Requests stop mid-step (EOS, stop strings, max_tokens: the step in flight's work
    for them is dropped) and new requests arrive while others decode (each is prefilled
    beside the step in flight and joins the next launch, no drain): each output equals
    plain decoding's with the same params."""
    params = [
        SamplingParams(temperature=0, max_tokens=n, stop=stop)
        for n, stop in [(40, None), (7, None), (64, ["\n"]), (33, None), (64, [". "]), (21, None)]
    ]
    prompts = [chats[i] for i in PICKED]
    plain = make_llm(smollm2_dir)
    expected = token_ids(plain.generate(prompts, params, use_tqdm=False))
    llm = _pipelined(smollm2_dir, trained_head_dir, DYNAMIC)
    engine = llm.engine
    got: dict[str, list[int]] = {}
    pending = list(zip(prompts, params, strict=True))
    ids = []
    for prompt, p in pending[:3]:
        ids.append(engine.add_request(prompt, p))
    step = shortcuts = 0
    while engine.has_unfinished_requests() or pending[len(ids) :]:
        step += 1
        if step in (4, 9, 15) and len(ids) < len(pending):  # arrivals mid-decode
            prompt, p = pending[len(ids)]
            ids.append(engine.add_request(prompt, p))
        pipelined = engine.mode(PipelinedStep)
        prev, running = pipelined.launches, engine.scheduler.running
        if prev and running == [r for launch in prev for r in launch.requests]:  # shortcut
            shortcuts += 1
            assert pipelined.may_run(running, prev)  # still holds: skipping it is exact
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    assert [got[i] for i in ids] == expected
    assert shortcuts > 0
    # Every request arrived into the pipeline (the first three together, the rest while
    # others decode): no drain.
    assert engine.pipeline.num_arrivals == 6
    assert engine.pipeline.num_launches > 0 and engine.num_dropped_tokens > 0
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks


def test_pipelined_arrival_on_a_cached_prompt_keeps_outputs(
    smollm2_dir, trained_head_dir, chats, reference
) -> None:
    """One slot, the same prompt three times: each request arrives into an empty pipeline
    once the previous one finished, its prompt in the prefix cache but the last token,
    so its prefill computes one token and the head resumes from the cached blocks (the
    first's K/V): every output equals plain decoding, and all three arrived pipelined."""
    llm = _pipelined(smollm2_dir, trained_head_dir, {"num_speculative_tokens": 3}, max_num_seqs=1)
    engine = llm.engine
    prompt = chats[PICKED[1]]
    outs = llm.generate([prompt] * 3, greedy(24), use_tqdm=False)
    assert token_ids(outs) == [reference[PICKED[1]][:24]] * 3
    assert engine.pipeline.num_arrivals == 3
    assert outs[2].metrics.num_cached_tokens >= len(prompt) - engine.block_size
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks


def test_pipelined_steps_count_as_synchronous_ones(smollm2_dir, trained_head_dir, chats) -> None:
    """Near max_tokens a pipelined step has drafted a full chain before its request's
    length is known; it is counted as the synchronous step would count it (drafts capped
    at the tokens left, none at the last token), so every request's steps, drafted and
    accepted tokens, hence τ, do not depend on pipelining."""
    params = [greedy(n) for n in (40, 7, 33, 21, 2, 1)]
    prompts = [chats[i] for i in PICKED]
    chain = {"num_speculative_tokens": 3}

    def counts(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        m = [o.metrics for o in outs]
        return token_ids(outs), [
            (x.spec_steps, x.spec_drafted_tokens, x.spec_accepted_tokens) for x in m
        ]

    synchronous = SpeculativeConfig(
        method="eagle3", model=str(trained_head_dir), pipelined=False, **chain
    )
    want_ids, want = counts(make_llm(smollm2_dir, speculative=synchronous))
    llm = _pipelined(smollm2_dir, trained_head_dir, chain)
    got_ids, got = counts(llm)
    assert got_ids == want_ids
    assert llm.engine.pipeline.num_launches > 0
    assert got == want
    assert sum(a for _, _, a in want) > 0  # drafts accepted


@pytest.mark.parametrize(
    ("compile_head", "compile_growth", "tree"),
    [
        (False, False, DYNAMIC),
        (True, False, DYNAMIC),
        (True, True, DYNAMIC),
        # Chains of 3 while more than 4 requests run, of 5 at most 4: the step's shape
        # changes between pipelined launches as requests finish.
        (
            True,
            True,
            {"num_speculative_tokens": 3, "num_speculative_tokens_by_batch_size": [[4, 5]]},
        ),
        # A dynamic tree while one request runs, chains above (the shipped head's bands).
        (
            True,
            True,
            {
                "num_speculative_tokens": 3,
                "num_speculative_tokens_by_batch_size": [
                    [1, DYNAMIC],
                    [4, 5],
                ],
            },
        ),
    ],
    ids=[
        "eager-head",
        "compiled-head",
        "compiled-growth",
        "compiled-growth-chain-bands",
        "compiled-growth-tree-band",
    ],
)
def test_pipelined_graph_replays_keep_outputs(
    smollm2_dir, trained_head_dir, chats, reference, monkeypatch, compile_head, compile_growth, tree
) -> None:
    """The GPU path's replays (verify graphs fed device-built inputs, captured growth fed
    the step in flight's outcome, optionally compiled: the head's layer and logits, or the
    whole draft side as one region without a graph break; chains whose length follows
    the batch size) with CPU stand-ins: plain greedy tokens."""
    from specdec.attention.custom_op import OpaqueAttention

    spec = SpeculativeConfig(
        method="eagle3",
        model=str(trained_head_dir),
        pipelined=True,
        compile_head=compile_head,
        compile_growth=compile_growth,
        **tree,
    )
    llm = make_llm(smollm2_dir, speculative=spec, max_num_seqs=8, cuda_graph_max_batch_size=8)
    engine = llm.engine
    _use_graph_stand_ins(engine, monkeypatch)
    compiled_calls = [0]
    if compile_head:  # the compiled regions, traced by dynamo without code generation
        real_compile = torch.compile

        def counting_compile(fn, **kwargs):
            compiled = real_compile(fn, backend="eager", fullgraph=kwargs.get("fullgraph", False))

            def run(*args, **kw):
                compiled_calls[0] += 1
                return compiled(*args, **kw)

            return run

        monkeypatch.setattr(torch, "compile", counting_compile)
        engine.proposer.compile = True  # as on the GPU path with EngineConfig.compile
        # Compiled code reaches attention through the opaque op (EngineConfig.compile).
        engine.proposer.head.midlayer.self_attn.backend = OpaqueAttention("torch")
    engine._capture_graphs()
    assert engine.proposer.compiles_growth == compile_growth
    picked = PICKED[:5]  # the 8-bucket pads three sequences
    # Staggered ends: the running batch shrinks 5 -> 1, through every band.
    lengths = [48, 40, 32, 24, 16]
    outs = llm.generate([chats[i] for i in picked], [greedy(n) for n in lengths], use_tqdm=False)
    assert token_ids(outs) == [reference[i][:n] for i, n in zip(picked, lengths, strict=True)]
    q = engine.proposer.shape_at(len(picked)).max_draft_tokens + 1
    assert engine.pipeline.num_launches > 0
    # Every launch replayed the whole step's graph; the prompts arrived into the pipeline
    # (a step of their own, the one step without a launch), so no synchronous verify
    # step replayed the runner's verify graphs.
    assert engine.pipeline.graphs.num_replays == engine.pipeline.num_launches
    assert engine.num_steps - engine.pipeline.num_launches == 1
    assert engine.runner.graphs.num_replays.get(q, 0) == 0
    replayed = {shape for shape, _ in engine.pipeline.graphs.replayed}
    assert replayed == set(engine.proposer.shapes)  # both bands' shapes launched
    assert engine.runner.prefill_graphs.num_replays > 0  # the five prompts' prefill
    assert (compiled_calls[0] > 0) == compile_head


def test_pipelined_arrivals_replay_graphs_and_keep_outputs(
    smollm2_dir, trained_head_dir, chats, reference, monkeypatch
) -> None:
    """Six prompts through three slots on the GPU path's replays (CPU stand-ins): the
    first three are prefilled in a step of their own, each later one as a request
    finishes, beside the step in flight (a prefill graph); all join the next launch (the
    whole step's graph), so no step is synchronous; plain greedy tokens."""
    spec = SpeculativeConfig(
        method="eagle3", model=str(trained_head_dir), pipelined=True, num_speculative_tokens=3
    )
    llm = make_llm(smollm2_dir, speculative=spec, max_num_seqs=3, cuda_graph_max_batch_size=4)
    engine = llm.engine
    _use_graph_stand_ins(engine, monkeypatch)
    engine._capture_graphs()
    lengths = [20, 36, 28, 24, 32, 16]
    outs = llm.generate([chats[i] for i in PICKED], [greedy(n) for n in lengths], use_tqdm=False)
    assert token_ids(outs) == [reference[i][:n] for i, n in zip(PICKED, lengths, strict=True)]
    pipeline = engine.pipeline
    assert pipeline.num_arrivals == 6
    assert pipeline.graphs.num_replays == pipeline.num_launches > 0
    # Only the first step, the first three prompts' prefill, launched no step.
    assert engine.num_steps - pipeline.num_launches == 1
    assert engine.runner.prefill_graphs.num_replays > 0


def test_pipelining_is_off_by_default_on_cpu(smollm2_dir, trained_head_dir) -> None:
    spec = SpeculativeConfig(method="eagle3", model=str(trained_head_dir))
    assert make_llm(smollm2_dir, speculative=spec).engine.pipeline is None
    ngram = SpeculativeConfig(num_speculative_tokens=3, pipelined=True)  # host-side drafts
    assert make_llm(smollm2_dir, speculative=ngram).engine.pipeline is None


def test_chain_drafts_equal_a_masked_tree_path(
    smollm2_dir, trained_head_dir, chats, monkeypatch
) -> None:
    """A chain's draft levels attend causally (no tree mask): each level's head output
    equals, to fp32 rounding, that of the same node in a static tree grown from the same
    state through the masked path (two nodes fed at level 1, then one)."""
    spec = SpeculativeConfig(method="eagle3", model=str(trained_head_dir))
    engine = make_llm(smollm2_dir, speculative=spec).engine
    engine.add_request(chats[2], greedy())
    for _ in range(4):  # the prefill, then verify steps: the head has a short catch-up
        engine.step()
    request = engine.scheduler.running[0]
    assert engine.kv_manager.allocate_slots(request, 1, num_lookahead_tokens=16)
    proposer = engine.proposer
    spans, aux = proposer._take_catch_ups([request])
    inputs = padded_catch_up_inputs([request], spans, aux, proposer.catch_up_width, "cpu")
    outs: list[torch.Tensor] = []
    forward = proposer.head.forward

    def recording(*args, **kwargs):
        out, logits = forward(*args, **kwargs)
        outs.append(out)
        return out, logits

    monkeypatch.setattr(proposer.head, "forward", recording)
    with torch.inference_mode():
        chain = proposer._grow(ChainShape(3), inputs, None)
        chain_outs, outs[:] = outs[1:], []  # the levels (the catch-up comes first)
        tree = proposer._grow(
            StaticTreeShape([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]), inputs, None
        )
    assert chain.is_chain and tree.ancestor_mask is not None
    # Level 1 fed (0,) and (1,); level 2 fed (0, 0) alone, after a two-node level.
    assert [o.shape[0] for o in outs[1:]] == [2, 1]
    for level, (c, t) in enumerate(zip(chain_outs, outs[1:], strict=True)):
        torch.testing.assert_close(c[0], t[0], rtol=0, atol=1e-4, msg=f"level {level + 1}")
    # Static node order is the choices' order after the root: (0,) 1, (0, 0) 3, (0, 0, 0) 5.
    assert chain.token_ids[0, 1:].tolist() == tree.token_ids[0, [1, 3, 5]].tolist()


def test_accepted_kv_moves_in_one_launch_as_per_layer_copies(smollm2_dir, tmp_path) -> None:
    """The Triton path moves every layer's accepted K/V in one launch (the interpreter
    here): caches end equal to the per-layer copies of the torch path, for paths that
    shift nodes onto slots their own row reads, rows with nothing accepted and a padding
    row on a null block table."""
    pytest.importorskip("triton")
    from tiny_models import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path, smollm2_dir, seed=0, vocab_size=256, num_layers=3)
    runners = [
        make_llm(model, attention_backend=backend, kv_cache_memory=8 << 20).engine.runner
        for backend in ("torch", "triton")
    ]
    assert runners[0]._kv_table is None and runners[1]._kv_table is not None
    gen = torch.Generator().manual_seed(0)
    for pair_a, pair_b in zip(runners[0].kv_caches, runners[1].kv_caches, strict=True):
        for a, b in zip(pair_a, pair_b, strict=True):
            a.copy_(torch.randn(a.shape, generator=gen))
            b.copy_(a)
    acceptance = Acceptance(
        num_accepted=torch.tensor([3, 0, 2, 1]),
        path=torch.tensor([[0, 2, 5, 9], [0, 0, 0, 0], [0, 1, 4, 0], [0, 3, 0, 0]]),
        token_ids=torch.zeros(4, 4, dtype=torch.int64),
    )
    root_index = torch.tensor([17, 40, 3, 0])
    tables = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 7], [6, 0, 0, 0], [0, 0, 0, 0]])
    q = 10  # nodes per tree
    index = root_index[:, None] + torch.arange(q)  # each tree's nodes from its root
    slots = cache_slots(tables.to(torch.int32), index, 16).view(4, q)
    before = runners[0].kv_caches[1][0].clone()
    for runner in runners:
        runner.move_kv(*accepted_path_moves(acceptance, slots))
    for pair_a, pair_b in zip(runners[0].kv_caches, runners[1].kv_caches, strict=True):
        for a, b in zip(pair_a, pair_b, strict=True):
            assert torch.equal(a, b)
    # Row 0: nodes 2, 5, 9 at cache index 19, 22, 26 moved to 18, 19, 20 (block 2 from 16).
    after = runners[0].kv_caches[1][0].view(-1, *before.shape[2:])
    flat = before.view(-1, *before.shape[2:])
    for src, dst in [(19, 18), (22, 19), (26, 20)]:
        assert torch.equal(after[2 * 16 + dst - 16], flat[2 * 16 + src - 16])


@pytest.fixture(scope="module")
def exit_trained_head_dir(tmp_path_factory, smollm2_dir, trained_head_dir):
    """The trained head plus constant SpecExit channels (zero weights; biases read
    confidence = progress = 0.95, remaining = 10): its drafts are accepted, so cuts land
    inside accepted drafts and at bonus tokens while steps are in flight."""
    trained = load_eagle3(trained_head_dir, target_config=load_config(str(smollm2_dir)))
    config = dataclasses.replace(trained.config, exit_signals=SIGNALS)
    head = Eagle3Head(config, trained.attention, max_positions=trained.rotary.num_positions)
    missing, unexpected = head.load_state_dict(trained.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("spec_exit.") for k in missing)
    with torch.no_grad():
        head.spec_exit.weight.zero_()
        head.spec_exit.bias.copy_(torch.tensor([math.log(19.0), math.log(19.0), math.log(11.0)]))
    return save_eagle3(head, tmp_path_factory.mktemp("exit_trained_head"))


def test_pipelined_spec_exit_cuts_as_the_synchronous_step(
    smollm2_dir, exit_trained_head_dir, chats
) -> None:
    """SpecExit requests pipeline (the read-back carries the signals) and exit exactly as
    in the synchronous step: plain greedy tokens through the delimiter, the think-end
    marker, then plain decoding of the cut sequence; the step in flight's row for a cut
    request is dropped; a request in the same batch that did not opt in stays plain. A
    dynamic tree: accepted K/V moves, then the cut rolls some back."""
    plain = make_llm(smollm2_dir)
    prompts = [chats[i] + OPEN_IDS for i in (0, 5, 9)]  # "<think>" opens a span
    expected = token_ids(plain.generate(prompts, greedy(48), use_tqdm=False))
    params, cuts = [], []
    for i, tokens in enumerate(expected):
        if i == 2:  # does not opt in
            params.append(greedy(48))
            continue
        k, delim = pick_delimiter(plain, tokens, first=12)  # after a few pipelined steps
        cuts.append(k)
        exit_params = SpecExitParams(delimiters=(delim,))
        params.append(dataclasses.replace(greedy(48), spec_exit=exit_params))
    outputs = {}
    for pipelined in (True, False):
        spec = SpeculativeConfig(method="eagle3", model=str(exit_trained_head_dir),
                                 pipelined=pipelined, **DYNAMIC)  # fmt: skip
        llm = make_llm(smollm2_dir, speculative=spec)
        outputs[pipelined] = token_ids(llm.generate(prompts, params, use_tqdm=False))
        engine = llm.engine
        assert engine.hook(SpecExitRuntime).stats.exits == 2
        assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks
        if pipelined:
            assert engine.pipeline.num_launches > 0 and engine.num_dropped_tokens > 0
            assert len(engine.proposer.rows) == 0 and not engine.mode(PipelinedStep).in_flight
    assert outputs[True] == outputs[False]
    for i, k in enumerate(cuts):
        check_exit(plain, prompts[i], outputs[True][i], expected[i], k, end=CLOSE_IDS)
    assert outputs[True][2] == expected[2]


def test_resumed_aux_rows_read_what_a_view_would() -> None:
    """``AuxRows.resume`` (the EAGLE-3 proposer's after a pipelined step) keeps (buffer,
    row, count) and slices only when a synchronous step takes the catch-up: the rows equal
    a view taken at resume time (memory written in between included), followed by the rows
    observed since."""
    from specdec.request import Request
    from specdec.spec.aux_rows import AuxRows

    rows = AuxRows(None, block_size=16, device=torch.device("cpu"))
    request = Request("r", list(range(10)), SamplingParams(max_tokens=8), block_ids=[0])
    aux = torch.randn(4, 5, 6)  # [rows, catch_up_width, aux width]
    rows.resume(request, 10, aux, 2, 3)
    view = aux[2, :3]
    observed = torch.randn(2, 6)
    rows.observe(request, 13, observed)
    aux[2, 1] += 1.0  # e.g. a device write before the read: a view sees it too
    request.num_computed_tokens = 15
    assert rows.pending_len(request) == 5
    (span,), (taken,) = rows.take([request])
    assert span == (10, 15) and torch.equal(taken, torch.cat([view, observed]))
    assert rows.pending_len(request) == 0
