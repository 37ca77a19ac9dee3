"""Drafting with a block drafter in the engine (``method="dflash"``,
specdec/spec/block_proposer.py).

- The proposer on a tiny target with a hand-driven request: the context K/V it caches
  per position (observed, chunked, deferred) equals ``context_kv`` recomputed, and the
  chain it drafts is the argmax of ``block_logits`` over the dense context.
- The real SmolLM2 (fp32, CPU): a random drafter's output equals plain greedy decoding
  (prompts of different lengths, chunked prefill, preemption, steps above
  ``disable_by_batch_size`` deferring their aux rows); a drafter fitted to SmolLM2's own
  greedy continuations gets drafts accepted and still equals plain.
- Sampling: on a tiny target the first three tokens' joint frequency matches the exact
  target distribution (chi-square), the drafts being sampled from the drafter and
  accepted or rejected against it; seeded requests reproduce.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from test_engine import LOSSLESS_TOKENS, PREEMPTING, greedy, make_llm, token_ids
from test_spec_pipeline import PICKED
from tiny_models import make_tiny_model_dir

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.models import load_config, load_model
from specdec.models.block_drafter import BlockDrafter, BlockDrafterConfig, ContextKV
from specdec.models.block_drafter_formats import save_block_drafter
from specdec.models.weights import WeightLoadError
from specdec.request import Request
from specdec.spec.block_graphs import BlockGraphs
from specdec.spec.block_proposer import BlockProposer

# The Triton path's kernels run compiled on CUDA or in the interpreter.
NEEDS_TRITON = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)

SMOLLM2 = "smollm2-135m-instruct"
MASK = 16  # SmolLM2's <empty_output>: never emitted by chat


def _save(drafter: BlockDrafter, out) -> str:
    save_block_drafter(drafter, out)
    return str(out)


# ---------------------------------------------------------------- the proposer alone

TINY_VOCAB, BS = 256, 4  # the tiny target's vocabulary; KV-cache block size


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, smollm2_dir):
    out = tmp_path_factory.mktemp("tiny_target")
    return make_tiny_model_dir(out, smollm2_dir, seed=1, logit_scale=6.0, vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def tiny_drafter_dir(tiny_target, tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = BlockDrafterConfig.for_target(
        load_config(str(tiny_target)), TINY_VOCAB, mask_token_id=3, aux_layer_ids=(1,),
        block_size=4, num_layers=2,
    )  # fmt: skip
    return _save(BlockDrafter(config), tmp_path_factory.mktemp("tiny_drafter"))


def _proposer(tiny_target, drafter_dir, paged: bool = False, **spec) -> BlockProposer:
    """The proposer on a stand-in runner: the tiny target's weights, a 16-block cache;
    ``paged``: the Triton path (the block forward's attention reads the cache in place)."""
    config = load_config(str(tiny_target))
    num_blocks, aux_width = 16, config.hidden_size
    runner = SimpleNamespace(
        device=torch.device("cpu"), dtype=torch.float32, block_size=BS, num_blocks=num_blocks,
        model_config=config, model=load_model(str(tiny_target)), max_model_len=64,
        aux_layer_ids=(1,), aux_cache=torch.zeros(num_blocks * BS, aux_width),
        runtime=SimpleNamespace(triton_kernels=paged),
    )  # fmt: skip
    spec = {"num_speculative_tokens": 3, **spec}
    return BlockProposer(
        SpeculativeConfig(method="dflash", model=drafter_dir, **spec), runner=runner
    )


def _slots(request: Request, positions) -> list[int]:
    return [request.block_ids[p // BS] * BS + p % BS for p in positions]


def _dense_chain(proposer: BlockProposer, request: Request, aux: torch.Tensor) -> list[int]:
    """The argmax chain of ``block_logits`` over context K/V recomputed from ``aux``."""
    drafter, r = proposer.drafter, request.num_computed_tokens
    context = drafter.context_kv(aux[:r], torch.arange(r))
    embeds = drafter.embed(drafter.block_inputs(torch.tensor([request.token_id(r)])))
    logits = drafter.block_logits(embeds, torch.arange(r, r + 4)[None],
                                  [ContextKV(c.k[None], c.v[None]) for c in context],
                                  torch.tensor([r]))  # fmt: skip
    return proposer.draft_ids[logits[0].argmax(-1)].tolist()


def _assert_cached(proposer: BlockProposer, request: Request, aux: torch.Tensor) -> None:
    r = request.num_computed_tokens
    expected = proposer.drafter.context_kv(aux[:r], torch.arange(r))
    slots = torch.tensor(_slots(request, range(r)))
    for cache, layer in zip(proposer.kv_cache, expected, strict=True):
        torch.testing.assert_close(cache.k[slots], layer.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[slots], layer.v, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("paged", [False, pytest.param(True, marks=NEEDS_TRITON)])
def test_cached_context_equals_recomputed_and_blocks_equal_dense(
    tiny_target, tiny_drafter_dir, paged
):
    """Context K/V is computed once per position, and drafts from the cache equal drafts
    from K/V recomputed densely: through the dense gather and through the paged kernel."""
    proposer = _proposer(tiny_target, tiny_drafter_dir, paged=paged)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=16)
    a = Request("a", list(range(20, 30)), params, block_ids=[5, 2, 9, 0, 7])
    b = Request("b", list(range(40, 45)), params, block_ids=[11, 3, 6])
    aux = {r.request_id: torch.randn(18, 64, generator=g) for r in (a, b)}
    # Prefill: a in two chunks, b whole; then each has its first output token.
    proposer.observe(a, 0, aux["a"][:6])
    proposer.observe(a, 6, aux["a"][6:10])
    proposer.observe(b, 0, aux["b"][:5])
    for request in (a, b):
        request.num_computed_tokens = request.num_prompt_tokens
        request.output_token_ids.append(50)
    trees = proposer.propose([a, b], [3, 2], proposer.shape_at(2))
    for request, tree, depth in zip((a, b), trees, (3, 2), strict=True):
        rows = aux[request.request_id]
        _assert_cached(proposer, request, rows)
        assert tree.is_chain and tree.num_draft_tokens == depth
        assert tree.token_ids.tolist() == [50, *_dense_chain(proposer, request, rows)[:depth]]
    # a verifies one draft and a bonus (root and draft observed); then a plain step
    # defers: its token's aux row is read from the runner's aux cache.
    proposer.observe(a, 10, aux["a"][10:12])
    a.output_token_ids += [60, 61]
    a.num_computed_tokens = 12
    proposer.defer(a)
    proposer.rows.aux_cache[_slots(a, [12])[0]] = aux["a"][12]
    a.output_token_ids.append(62)
    a.num_computed_tokens = 13
    (tree,) = proposer.propose([a], [3], proposer.shape_at(1))
    _assert_cached(proposer, a, aux["a"])
    assert tree.token_ids.tolist() == [62, *_dense_chain(proposer, a, aux["a"])]
    # Preempted and recomputed: the state starts over at the first observed row.
    a.num_preemptions += 1
    fresh = torch.randn(13, 64, generator=g)
    proposer.observe(a, 0, fresh)
    (tree,) = proposer.propose([a], [3], proposer.shape_at(1))
    _assert_cached(proposer, a, fresh)
    assert tree.token_ids.tolist() == [62, *_dense_chain(proposer, a, fresh)]


def test_shapes_deeper_than_the_block_are_refused(tiny_target, tiny_drafter_dir):
    with pytest.raises(ValueError, match=r"drafts 4 tokens deep, past .* block_size - 1 = 3"):
        _proposer(tiny_target, tiny_drafter_dir, num_speculative_tokens=4)
    with pytest.raises(ValueError, match=r"drafts 4 tokens deep"):
        _proposer(tiny_target, tiny_drafter_dir, tree="dynamic", num_speculative_tokens=4,
                  top_k=2, total_tokens=6)  # fmt: skip


@NEEDS_TRITON
def test_the_triton_path_drafts_losslessly(tiny_target, tiny_drafter_dir):
    """The engine on the Triton attention backend (its block forward reading the context
    cache through kernels.block_attention): greedy output equals plain decoding."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 60))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for spec in (None, SpeculativeConfig(method="dflash", model=tiny_drafter_dir,
                                         num_speculative_tokens=3)):  # fmt: skip
        llm = LLM(str(tiny_target), device="cpu" if not torch.cuda.is_available() else "cuda",
                  dtype="float32", kv_cache_memory=16 << 20, max_model_len=256,
                  attention_backend="triton", speculative=spec)  # fmt: skip
        outs.append(token_ids(llm.generate(prompts, params, use_tqdm=False)))
        if spec is not None:
            assert llm.engine.proposer.paged and llm.engine.spec_stats.steps > 0
    assert outs[1] == outs[0]


class EagerBlockGraphs(BlockGraphs):
    """A stand-in for captured block-forward graphs: "replay" reruns the forward on the
    static buffers and writes the captured logits in place, as a real replay does."""

    def _capture(self, bs):
        return self._forward(self.roots[:bs], self.tables[:bs], self.lens[:bs])

    def _replay(self, bs) -> None:
        self.outputs[bs].copy_(self._forward(self.roots[:bs], self.tables[:bs], self.lens[:bs]))


@NEEDS_TRITON
@torch.inference_mode()
def test_graphs_of_the_block_forward_keep_the_drafts(tiny_target, tiny_drafter_dir, monkeypatch):
    """The GPU path's captured block forward (static buffers at the cache's full table
    width, batches padded to their bucket with empty-context rows) drafts what the eager
    forward drafts; a batch past the largest bucket runs eagerly."""
    from specdec.spec import block_proposer

    monkeypatch.setattr(block_proposer, "BlockGraphs", EagerBlockGraphs)
    eager = _proposer(tiny_target, tiny_drafter_dir, paged=True)
    graphed = _proposer(tiny_target, tiny_drafter_dir, paged=True)
    shape = graphed.shape_at(1)
    assert list(graphed.capture_graphs({shape: [2]}, 16, 64)) == ["block drafter forward, batch 2"]
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0, max_tokens=16)
    requests = {}
    for proposer in (eager, graphed):
        reqs = [
            Request("a", list(range(20, 33)), params, block_ids=[5, 2, 9, 0]),
            Request("b", list(range(40, 46)), params, block_ids=[11, 3]),
            Request("c", list(range(60, 69)), params, block_ids=[1, 4, 6]),
        ]
        g.manual_seed(3)
        for r in reqs:
            proposer.observe(r, 0, torch.randn(r.num_prompt_tokens, 64, generator=g))
            r.num_computed_tokens = r.num_prompt_tokens
            r.output_token_ids.append(50)
        requests[proposer] = reqs
    for batch in ([0], [0, 1], [0, 1, 2]):  # padded to 2, exactly 2, eager past the bucket
        drafts = [
            p.propose([requests[p][i] for i in batch], [3] * len(batch), shape)
            for p in (eager, graphed)
        ]
        for want, got in zip(*drafts, strict=True):
            assert got.token_ids.tolist() == want.token_ids.tolist()
    assert graphed.graphs.num_replays == 2
    with pytest.raises(ValueError, match="does not fit the captured graphs"):
        graphed.graphs.run(torch.zeros(3, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int64),
                           torch.zeros(3, dtype=torch.int64))  # fmt: skip


@torch.inference_mode()
def test_trees_grow_from_the_slots_candidates(tiny_target, tiny_drafter_dir):
    """A dynamic tree's depth-d nodes are slot d's top candidates, whatever their parent,
    and the slots' argmax chain is one of its paths."""
    proposer = _proposer(tiny_target, tiny_drafter_dir, tree="dynamic", num_speculative_tokens=3,
                         top_k=2, total_tokens=10)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=16)
    a = Request("a", list(range(20, 30)), params, block_ids=[5, 2, 9, 0, 7])
    aux = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    proposer.observe(a, 0, aux)
    a.num_computed_tokens = 10
    a.output_token_ids.append(50)
    (tree,) = proposer.propose([a], [10], proposer.shape_at(1))
    chain = _dense_chain(proposer, a, aux)  # the slots' argmaxes
    slots = proposer.block_logits([a], torch.tensor([50]))[0]  # [B - 1, draft_vocab]
    top2 = [set(proposer.draft_ids[row.topk(2).indices].tolist()) for row in slots]
    tokens, parents = tree.token_ids.tolist(), tree.parent_list()
    assert tokens[0] == 50 and tree.num_nodes == 11  # every candidate: 2 + 4 + 4
    for node in range(1, tree.num_nodes):
        assert tokens[node] in top2[len(tree.path(node)) - 2], node
    node = 0
    for token in chain:
        children = [c for c in range(1, tree.num_nodes) if parents[c] == node]
        node = next(c for c in children if tokens[c] == token)


def test_a_drafter_for_another_target_is_refused(smollm2_dir, tiny_drafter_dir):
    spec = SpeculativeConfig(method="dflash", model=tiny_drafter_dir)
    with pytest.raises(WeightLoadError, match=r"hidden_size=64.*target's is 576"):
        make_llm(smollm2_dir, speculative=spec)


# ------------------------------------------------------------------ SmolLM2, greedy


@pytest.fixture(scope="module")
def reference(smollm2_dir, chats) -> list[list[int]]:
    outs = make_llm(smollm2_dir).generate([chats[i] for i in PICKED],
                                          greedy(LOSSLESS_TOKENS), use_tqdm=False)  # fmt: skip
    return token_ids(outs)


def smollm2_drafter(
    smollm2_dir, draft_vocab: torch.Tensor | None = None, intermediate_size: int | None = None
) -> BlockDrafter:
    """A one-layer drafter of block 4 for SmolLM2 (named as its target, so that export
    finds it); ``draft_vocab`` (sorted target ids) prunes its vocabulary, and
    ``intermediate_size`` narrows its MLP (default: the target's)."""
    target = load_config(str(smollm2_dir))
    size = target.vocab_size if draft_vocab is None else draft_vocab.shape[0]
    config = BlockDrafterConfig.for_target(target, size, mask_token_id=MASK, block_size=4,
                                           num_layers=1, intermediate_size=intermediate_size,
                                           target_name=SMOLLM2)  # fmt: skip
    drafter = BlockDrafter(config)
    if draft_vocab is not None:
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[draft_vocab] = True
        drafter.set_vocab_map(draft_vocab - torch.arange(size), t2d)
    return drafter


def test_a_random_drafter_is_lossless(smollm2_dir, chats, reference, tmp_path):
    torch.manual_seed(0)
    drafter_dir = _save(smollm2_drafter(smollm2_dir, torch.arange(4096)), tmp_path / "d")
    # Chunked prefill and preemption (PREEMPTING); above 4 requests plain steps defer
    # their aux rows, read back when the batch speculates again.
    spec = SpeculativeConfig(method="dflash", model=drafter_dir, num_speculative_tokens=3,
                             disable_by_batch_size=4)  # fmt: skip
    llm = make_llm(smollm2_dir, speculative=spec, **PREEMPTING)
    outs = llm.generate([chats[i] for i in PICKED], greedy(LOSSLESS_TOKENS), use_tqdm=False)
    assert token_ids(outs) == reference
    stats = llm.engine.spec_stats
    assert (
        stats.steps > 0 and stats.drafted_tokens > 2 * stats.steps
    )  # chains of 3 (cut near the end)
    assert llm.engine.scheduler.num_preemptions > 0


def fit_to_continuations(
    drafter: BlockDrafter, smollm2_hf, sequences, prompt_lens, steps: int = 80
) -> None:
    """Train ``drafter`` for ``steps`` full-batch Adam steps towards reproducing each
    sequence's continuation: every anchor from the prompt's last token on, labels the
    next B - 1 tokens, context the target's own aux states (HF ``hidden_states[l]`` = the
    stream entering layer l). The loss sits on the unigram plateau for some dozens of
    steps before it falls, longer for a wider MLP and more sequences: with a 256-wide MLP
    four 48-token continuations are memorized in ~80 steps, with SmolLM2's 1,536 in ~150."""
    embed = smollm2_hf.get_input_embeddings().weight.detach()
    drafter.bind_target(lambda ids: embed[ids])
    col = torch.full((embed.shape[0],), -100, dtype=torch.int64)
    col[drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))] = torch.arange(
        drafter.config.draft_vocab_size
    )
    block, ids = drafter.config.block_size, drafter.config.aux_layer_ids
    batches = []
    for seq, p in zip(sequences, prompt_lens, strict=True):
        x = torch.tensor(seq)
        with torch.no_grad():
            states = smollm2_hf(x[None], output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in ids], dim=-1)  # [n, 3 * hidden]
        anchors = torch.arange(p - 1, len(seq) - 1)  # [a]
        offsets = torch.arange(block)
        index = (anchors[:, None] + offsets).clamp(max=len(seq) - 1)  # [a, B]
        labels = torch.where(anchors[:, None] + offsets < len(seq), col[x[index]], -100)[:, 1:]
        batches.append((x, aux, anchors, labels))
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    # One thread: the matrices are small, so a thread team mostly waits at each op's
    # barrier, and stalls there for whole time slices while another process holds a core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            loss = 0.0
            for x, aux, anchors, labels in batches:
                context = drafter.context_kv(aux, torch.arange(len(x)))
                a = anchors.shape[0]
                dense = [
                    ContextKV(c.k.expand(a, -1, -1, -1), c.v.expand(a, -1, -1, -1)) for c in context
                ]
                embeds = drafter.embed(drafter.block_inputs(x[anchors]))
                logits = drafter.block_logits(
                    embeds, anchors[:, None] + torch.arange(block), dense, anchors
                )
                loss = loss + torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), labels.flatten(), ignore_index=-100
                )
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)


def test_a_fitted_drafter_gets_drafts_accepted_and_stays_lossless(
    smollm2_dir, smollm2_hf, chats, reference, tmp_path
):
    fitted = [0, 1]  # of PICKED: the prompts the drafter learns the continuations of
    prompts = [chats[PICKED[i]] for i in fitted]
    sequences = [p + reference[i] for p, i in zip(prompts, fitted, strict=True)]
    vocab = torch.tensor(sorted({t for s in sequences for t in s} | set(range(256))))
    torch.manual_seed(0)
    drafter = smollm2_drafter(smollm2_dir, vocab)
    fit_to_continuations(drafter, smollm2_hf, sequences, [len(p) for p in prompts])
    drafter_dir = _save(drafter, tmp_path / "d")
    # A chain of the slots' argmaxes, and a tree of their top-2 candidates (8 of the 10).
    for shape in ({}, {"tree": "dynamic", "top_k": 2, "total_tokens": 8}):
        spec = SpeculativeConfig(method="dflash", model=drafter_dir, num_speculative_tokens=3,
                                 **shape)  # fmt: skip
        llm = make_llm(smollm2_dir, speculative=spec)
        # The fitted prompts and an unfitted one together: batches of 3, drafts mixed.
        outs = llm.generate([*prompts, chats[PICKED[2]]], greedy(LOSSLESS_TOKENS), use_tqdm=False)
        assert token_ids(outs) == [reference[0], reference[1], reference[2]], shape
        stats = llm.engine.spec_stats
        print(f"fitted block drafter {shape}: tau = {stats.tau:.2f} over {stats.steps} steps")
        assert stats.tau > 1.8


# ---------------------------------------------------------------------- sampling

N = 3_000
TOP_K = 3
PROMPT = [17, 29, 88, 41, 137, 9, 52, 77]


def _filtered(logits: torch.Tensor) -> torch.Tensor:  # [V] -> [V] probabilities
    top = logits.topk(TOP_K)
    probs = torch.zeros_like(logits)
    probs[top.indices] = torch.softmax(top.values, dim=-1)
    return probs


@pytest.fixture(scope="module")
def exact_joint(tiny_target) -> dict[tuple[int, ...], float]:
    """p(t1) p(t2 | t1) p(t3 | t1, t2) of the tiny target, top-k filtered."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()

    def next_probs(tokens: list[int]) -> torch.Tensor:
        return _filtered(model(torch.tensor([PROMPT + tokens])).logits[0, -1].double())

    joint: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        p1 = next_probs([])
        for t1 in p1.nonzero().flatten().tolist():
            p2 = next_probs([t1])
            for t2 in p2.nonzero().flatten().tolist():
                p3 = next_probs([t1, t2])
                for t3 in p3.nonzero().flatten().tolist():
                    joint[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return joint


@pytest.fixture(scope="module")
def support_drafter_dir(tiny_target, exact_joint, tmp_path_factory) -> str:
    """A random drafter whose vocabulary is the tokens the target can emit here: its
    top-k filtered q_k then shares support with the target's, so drafts get accepted."""
    kept = torch.tensor(sorted({t for key in exact_joint for t in key}))
    torch.manual_seed(0)
    config = BlockDrafterConfig.for_target(
        load_config(str(tiny_target)), kept.shape[0], mask_token_id=3, aux_layer_ids=(1,),
        block_size=3, num_layers=1,
    )  # fmt: skip
    drafter = BlockDrafter(config)
    t2d = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    t2d[kept] = True
    drafter.set_vocab_map(kept - torch.arange(kept.shape[0]), t2d)
    return _save(drafter, tmp_path_factory.mktemp("support_drafter"))


def _sampling_llm(tiny_target, drafter_dir, shape: dict) -> LLM:
    # Depth 2: the second step verifies tokens 2 and 3, drafts drawn from q_1, q_2 (a chain)
    # or the slots' top candidates (a tree).
    spec = SpeculativeConfig(method="dflash", model=drafter_dir, num_speculative_tokens=2,
                             **shape)  # fmt: skip
    return LLM(str(tiny_target), device="cpu", dtype="float32", kv_cache_memory=256 << 20,
               max_model_len=64, max_num_seqs=1000, max_num_batched_tokens=1000 * len(PROMPT),
               speculative=spec, enable_prefix_caching=False)  # fmt: skip


def _chi_square_p(counts, joint) -> float:
    n = sum(counts.values())
    if any(c not in joint for c in counts):
        return 0.0
    stat = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in joint.items())
    dof = len(joint) - 1
    # Wilson-Hilferty normal approximation of the chi-square tail.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize(
    "shape", [{}, {"tree": "dynamic", "top_k": 2, "total_tokens": 4}], ids=["chain", "tree"]
)
def test_sampled_drafts_keep_the_target_distribution(
    tiny_target, support_drafter_dir, exact_joint, shape
):
    torch.manual_seed(0)
    llm = _sampling_llm(tiny_target, support_drafter_dir, shape)
    # max_tokens=4: the first verify step drafts 2 deep (tokens 2 and 3) after prefill.
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=4, ignore_eos=True)
    outs = llm.generate([PROMPT] * N, params, use_tqdm=False)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    stats = llm.engine.spec_stats
    # Drafts really are accepted and rejected; drawn chains at both depths (a tree's
    # candidates are the same for every request here: the slots' top tokens).
    assert stats.steps >= N and 0 < stats.accepted_tokens < stats.drafted_tokens
    if not shape:
        assert len(stats.accepted_at_least) == 2 and stats.accepted_at_least[1] > 0
    assert _chi_square_p(counts, exact_joint) > 0.01
    # Seeded requests reproduce, whatever else runs in the batch.
    seeded = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=s)
              for s in (1, 2, 3)]  # fmt: skip
    first = token_ids(llm.generate([PROMPT] * 3, seeded, use_tqdm=False))
    again = token_ids(llm.generate([PROMPT, PROMPT[:5]] * 2, [seeded[0], params] * 2,
                                   use_tqdm=False))  # fmt: skip
    assert again[0] == again[2] == first[0]


def test_the_cli_drafts_a_whole_block_by_default(tiny_drafter_dir):
    from specdec.cli import build_parser
    from specdec.cli_engine import speculative_config

    parser = build_parser()
    base = ["generate", "--draft", "dflash", "hello"]
    spec = speculative_config(parser.parse_args([*base, "--draft-model", tiny_drafter_dir]))
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("dflash", tiny_drafter_dir, 3)
    given = [*base, "--draft-model", tiny_drafter_dir, "--num-speculative-tokens", "2"]
    assert speculative_config(parser.parse_args(given)).num_speculative_tokens == 2
    with pytest.raises(ValueError, match="--draft dflash needs --draft-model"):
        speculative_config(parser.parse_args(base))
