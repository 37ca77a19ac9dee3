"""Acceptance invariants: greedy keeps exactly plain greedy decoding's tokens; rejection
sampling emits tokens distributed exactly as the filtered target (chi-square over 20,000
steps) for chains, deterministic top-k trees and sampled trees, with and without top-p;
the same test rejects deliberately broken acceptors; the batched front end agrees with the
per-tree functions and keeps seeded rows reproducible."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from specdec.ops.accept import AcceptedRow
from specdec.sampling.sampler import SamplingMetadata, probs_from_logits
from specdec.sampling.seeded_stream import SeededStream
from specdec.sampling_params import SamplingParams
from specdec.spec.acceptance import (
    accept_batch,
    greedy_accept,
    sample_accept,
    sample_accept_batch,
)
from specdec.spec.tree import DraftTree, build_tree
from specdec.tree_shapes import DynamicTreeShape, StaticTreeShape

CPU = torch.device("cpu")
VOCAB = 10
DRAWS = 20_000
PLAIN = SamplingParams(temperature=1.0)
TOP_P = SamplingParams(temperature=0.8, top_p=0.7)

# (trees, target probs of all their nodes back to back, generator) -> one result per tree
Acceptor = Callable[[list[DraftTree], torch.Tensor, torch.Generator], list[AcceptedRow]]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Thousands of tiny-tensor calls: intra-op threads only add overhead here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _meta(params: list[SamplingParams]) -> SamplingMetadata:
    streams = [SeededStream(p.seed) if p.seed is not None else None for p in params]
    return SamplingMetadata.build(params, streams, CPU)


# ---------------------------------------------------------------- a small language


@dataclass
class Context:
    """Target and draft distributions after every token path of up to two tokens after
    the root: ``p[d]`` / ``q[d]`` are ``[VOCAB] * (d + 1)``, indexed by the path."""

    p: list[torch.Tensor]  # filtered target (probs_from_logits), float32
    q: list[torch.Tensor]  # draft, related to the target but different

    def target(self, path: tuple[int, ...]) -> torch.Tensor:  # [VOCAB]
        return self.p[len(path)][path]

    def draft(self, path: tuple[int, ...]) -> torch.Tensor:  # [VOCAB]
        return self.q[len(path)][path]


def make_context(params: SamplingParams, seed: int = 0) -> Context:
    gen = torch.Generator().manual_seed(seed)
    p, q = [], []
    for depth in range(3):
        logits = torch.randn((VOCAB,) * (depth + 1), generator=gen) * 1.5
        rows = logits.reshape(-1, VOCAB)
        p.append(probs_from_logits(rows, _meta([params] * rows.shape[0])).reshape(logits.shape))
        noise = torch.randn(logits.shape, generator=gen)
        q.append((logits + 0.7 * noise).softmax(-1))
    return Context(p=p, q=q)


def path_fn(logprobs_of: Callable[[tuple[int, ...]], torch.Tensor]):
    """A step_logprobs_fn whose rows are ``logprobs_of(path)``, the path being the draft
    tokens after the root (rebuilt through parent_rows, as a real proposer must)."""
    prev: list[tuple[int, ...]] = []

    def fn(tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int) -> torch.Tensor:
        nonlocal prev
        pairs = zip(tokens.tolist(), parent_rows.tolist(), strict=True)
        paths = [()] if depth == 0 else [(*prev[r], t) for t, r in pairs]
        prev = paths
        return torch.stack([logprobs_of(path) for path in paths])

    return fn


def draft_fn(ctx: Context):
    return path_fn(lambda path: ctx.draft(path).log())


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's draft tokens after the root (the root's path is empty)."""
    tokens = tree.token_ids.tolist()
    return [tuple(tokens[n] for n in tree.path(i)[1:]) for i in range(tree.num_nodes)]


def target_rows(ctx: Context, tree: DraftTree) -> torch.Tensor:  # [num_nodes, VOCAB]
    return torch.stack([ctx.target(path) for path in node_paths(tree)])


CHAIN = StaticTreeShape([(0,), (0, 0)])
TOPK_TREE = StaticTreeShape(
    [(r,) for r in range(4)] + [(0, r) for r in range(4)] + [(1, r) for r in range(4)]
)
SAMPLED_TREE = StaticTreeShape([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0)])


def sampled_trees(
    ctx: Context, shape: StaticTreeShape, n: int, seed: int
) -> tuple[list[DraftTree], torch.Tensor]:
    """``n`` independent sampled trees (children drawn without replacement by an
    exponential race, as ``build_tree(sample=True)`` does, but all draws at once) and
    their target rows back to back ``[n * num_nodes, VOCAB]``."""
    gen = torch.Generator().manual_seed(seed)
    template = build_tree(shape, 0, draft_fn(ctx))  # structure only
    parents = template.parents.tolist()
    paths = [(), *shape.choices]
    tokens = torch.zeros(n, len(paths), dtype=torch.int64)  # root token 0
    draft = torch.zeros(n, len(paths), VOCAB)
    target = torch.zeros(n, len(paths), VOCAB)
    target[:, 0] = ctx.p[0]
    for v in range(len(paths)):
        kids = [c for c in range(1, len(paths)) if parents[c] == v]
        path_nodes = template.path(v)[1:]
        index = tuple(tokens[:, u] for u in path_nodes)
        q_v = ctx.q[len(path_nodes)][index] if index else ctx.q[0].expand(n, VOCAB)
        if kids:
            race = torch.empty(n, VOCAB).exponential_(generator=gen)
            tokens[:, kids] = (q_v / race).topk(len(kids), dim=-1).indices
            draft[:, kids] = q_v[:, None, :]
            for c in kids:
                target[:, c] = ctx.p[len(path_nodes) + 1][(*index, tokens[:, c])]
    trees = [
        DraftTree(tokens[i], template.parents, template.depths, draft[i], sampled=True)
        for i in range(n)
    ]
    return trees, target.reshape(-1, VOCAB)


# ---------------------------------------------------------------- chi-square


def _chi2_terms(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom, merging the smallest bins until each
    expects >= 5. Any count in a bin the target forbids (expected 0) is infinite."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    if observed[expected == 0].sum() > 0:
        return float("inf"), 1
    if observed.sum() == 0:
        return 0.0, 0  # an empty row (e.g. a first token never followed by a second)
    order = expected.argsort()
    observed, expected = observed[order], expected[order]
    merge = int((expected.cumsum(0) < 5).sum()) + 1  # smallest bins merged into one
    o = torch.cat([observed[:merge].sum()[None], observed[merge:]])
    e = torch.cat([expected[:merge].sum()[None], expected[merge:]])
    return float(((o - e) ** 2 / e).sum()), o.numel() - 1


def _p_value(stat: float, dof: int) -> float:
    if dof == 0:
        return 1.0
    return torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)).item()


def losslessness_p_values(
    acceptor: Acceptor, tree_kind: str, params: SamplingParams, seed: int = 0
) -> tuple[float, float, int]:
    """Run ``DRAWS`` verification steps and test (1) the first emitted token against the
    target at the root and (2) the second, on steps that emitted two, against the target
    after the first: (x1, x2) counts vs n(x1) * p(x2 | x1). Returns both p-values and
    the number of steps that emitted two tokens."""
    ctx = make_context(params, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if tree_kind == "sampled_tree":
        trees, rows = sampled_trees(ctx, SAMPLED_TREE, DRAWS, seed + 2)
    else:
        shape = CHAIN if tree_kind == "chain" else TOPK_TREE
        tree = build_tree(shape, 0, draft_fn(ctx))
        tree.check()
        trees, rows = [tree] * DRAWS, target_rows(ctx, tree).repeat(DRAWS, 1)
    first = torch.zeros(VOCAB)
    pairs = torch.zeros(VOCAB, VOCAB)
    for result in acceptor(trees, rows, gen):
        emitted = result.token_ids
        first[emitted[0]] += 1
        if len(emitted) >= 2:
            pairs[emitted[0], emitted[1]] += 1
    p_first = _p_value(*_chi2_terms(first, DRAWS * ctx.p[0]))
    stat, dof = 0.0, 0
    for x1 in range(VOCAB):
        s, d = _chi2_terms(pairs[x1], pairs[x1].sum() * ctx.p[1][x1])
        stat, dof = stat + s, dof + d
    return p_first, _p_value(stat, dof), int(pairs.sum())


# ---------------------------------------------------------------- deliberately broken


def textbook_accept(flaw: str, seed: int = 0) -> Acceptor:
    """The module docstring's algorithm written plainly in numpy, with one ``flaw``:

    - ``target_as_residual``: after a rejection keep testing/drawing from p itself
      (forgets the mass the draft already offered);
    - ``unnormalised_residual``: zero rejected mass but test later siblings against the
      unnormalised residual;
    - ``draft_not_updated``: sampled siblings tested against q still holding the tokens
      already drawn (as if drawn with replacement);
    - ``greedy``: accept only the target's argmax, emit the argmax;
    - ``none``: no flaw (the control).
    """
    rng = np.random.default_rng(seed)

    def accept(trees: list[DraftTree], rows: torch.Tensor, _gen) -> list[AcceptedRow]:
        all_rows = rows.numpy().astype(np.float64)
        results, start = [], 0
        for tree in trees:
            results.append(accept_one(tree, all_rows[start : start + tree.num_nodes]))
            start += tree.num_nodes
        return results

    def accept_one(tree: DraftTree, targets: np.ndarray) -> AcceptedRow:
        tokens = tree.token_ids.numpy()
        parents = tree.parents.tolist()
        children: list[list[int]] = [[] for _ in parents]
        for i in range(1, len(parents)):
            children[parents[i]].append(i)
        drafts = tree.draft_probs.numpy().astype(np.float64) if tree.sampled else None
        accepted: list[int] = []
        v = 0
        while True:
            p = targets[v].copy()
            q = drafts[children[v][0]].copy() if drafts is not None and children[v] else None
            chosen = None
            for c in children[v]:
                x = tokens[c]
                if flaw == "greedy":
                    if x == targets[v].argmax():
                        chosen = c
                        break
                    continue
                qx = 1.0 if q is None else q[x]
                if rng.random() < min(1.0, p[x] / qx):
                    chosen = c
                    break
                offered = np.eye(len(p))[x] if q is None else q
                if flaw != "target_as_residual":
                    p = np.maximum(p - offered, 0.0)
                    if flaw != "unnormalised_residual":
                        p /= p.sum()
                if q is not None and flaw != "draft_not_updated":
                    q[x] = 0.0
                    q /= q.sum()
            if chosen is None:
                break
            accepted.append(chosen)
            v = chosen
        if flaw == "greedy":
            bonus = int(targets[v].argmax())
        else:
            bonus = int(rng.choice(len(p), p=p / p.sum()))
        return AcceptedRow(accepted, [int(tokens[c]) for c in accepted] + [bonus])

    return accept


# ---------------------------------------------------------------- losslessness


@pytest.mark.parametrize("seeded", [False, True], ids=["batch_rng", "seeded"])
@pytest.mark.parametrize("params", [PLAIN, TOP_P], ids=["plain", "top_p"])
@pytest.mark.parametrize("tree_kind", ["chain", "topk_tree", "sampled_tree"])
def test_sample_accept_is_lossless(tree_kind: str, params: SamplingParams, seeded: bool) -> None:
    """Unseeded trees share the batch generator; seeded ones (one request each) draw
    their coins and races from their own counter-based streams."""

    def acceptor(trees, rows, gen):
        streams = [SeededStream(1000 + i) for i in range(len(trees))] if seeded else None
        return sample_accept_batch(trees, rows, streams or [None] * len(trees), gen).tolist()

    p_first, p_second, two = losslessness_p_values(acceptor, tree_kind, params)
    assert two > DRAWS // 10, f"only {two} steps emitted two tokens: the context is too weak"
    assert p_first > 0.01 and p_second > 0.01, (p_first, p_second)


@pytest.mark.parametrize(
    ("flaw", "tree_kind"),
    [
        ("target_as_residual", "chain"),
        ("unnormalised_residual", "topk_tree"),
        ("target_as_residual", "sampled_tree"),
        ("draft_not_updated", "sampled_tree"),
        ("greedy", "chain"),
    ],
)
def test_broken_acceptors_fail_the_same_test(flaw: str, tree_kind: str) -> None:
    p_first, p_second, _ = losslessness_p_values(textbook_accept(flaw), tree_kind, PLAIN)
    assert min(p_first, p_second) < 1e-6, (p_first, p_second)


def test_the_same_test_passes_the_flawless_textbook_acceptor() -> None:
    """Control: the failures above come from the flaws, not from the textbook code."""
    p_first, p_second, _ = losslessness_p_values(textbook_accept("none"), "sampled_tree", PLAIN)
    assert p_first > 0.01 and p_second > 0.01, (p_first, p_second)


def test_top_p_context_has_forbidden_draft_tokens() -> None:
    """The top-p cases are only meaningful if the draft proposes tokens the target forbids."""
    ctx = make_context(TOP_P)
    tree = build_tree(TOPK_TREE, 0, draft_fn(ctx))
    rows = target_rows(ctx, tree)
    parent_rows = rows[tree.parents[1:]]  # [num_nodes - 1, VOCAB]
    assert (parent_rows.gather(1, tree.token_ids[1:, None]) == 0).any()


# ---------------------------------------------------------------- exact cases


def _tree(tokens: list[int], parents: list[int]) -> DraftTree:
    depths = [0]
    for i in range(1, len(parents)):
        depths.append(depths[parents[i]] + 1)
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))
    tree.check()
    return tree


#        root(0)
#      5(1)    7(2)
#    2(3) 9(4)   1(5)
#    4(6)
HAND_TREE = _tree([0, 5, 7, 2, 9, 1, 4], [0, 0, 0, 1, 1, 2, 3])


def _logits_with_argmax(argmaxes: list[int]) -> torch.Tensor:  # [len, VOCAB]
    logits = torch.zeros(len(argmaxes), VOCAB)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 3.0
    return logits


def test_greedy_accepts_the_longest_argmax_path() -> None:
    # argmax: root -> 5 (node 1), node 1 -> 2 (node 3), node 3 -> 4 (node 6), node 6 -> 8.
    result = greedy_accept(HAND_TREE, _logits_with_argmax([5, 2, 0, 4, 0, 0, 8]))
    assert result.accepted_nodes == [1, 3, 6]
    assert result.token_ids == [5, 2, 4, 8]  # bonus: argmax at the leaf
    # Rejection in the middle: node 3 wants 6, which is not drafted.
    result = greedy_accept(HAND_TREE, _logits_with_argmax([7, 2, 1, 6, 0, 0, 0]))
    assert result.accepted_nodes == [2, 5]
    assert result.token_ids == [7, 1, 0]
    # Nothing accepted: the bonus is the root's argmax.
    result = greedy_accept(HAND_TREE, _logits_with_argmax([3, 2, 1, 4, 0, 0, 8]))
    assert (result.accepted_nodes, result.token_ids) == ([], [3])
    assert result.num_accepted == 0 and result.bonus_token_id == 3


def test_greedy_ties_go_to_the_lowest_token_id_like_plain_greedy() -> None:
    logits = torch.zeros(HAND_TREE.num_nodes, VOCAB)
    logits[0, [5, 7]] = 2.0  # tie at the root: 5 wins
    logits[1, [2, 9]] = 2.0  # tie below 5: 2 wins
    logits[3, [3, 4]] = 2.0  # tie below 2: undrafted 3 beats drafted 4
    result = greedy_accept(HAND_TREE, logits)
    assert result.token_ids == [5, 2, 3]
    assert result.token_ids[-1] == logits[3].argmax().item()


def _target_logits(path: tuple[int, ...], vocab: int = 12) -> torch.Tensor:  # [vocab]
    gen = torch.Generator().manual_seed(hash((7, *path)) % 2**62)
    return torch.randn(vocab, generator=gen)


def test_greedy_output_equals_plain_greedy_decoding() -> None:
    """On random dynamic trees from a related draft, the emitted tokens are the prefix of
    plain greedy decoding, and the next greedy token was not drafted (maximality)."""
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        noise = torch.randn(12, generator=gen) * (1 + seed % 3)
        fn = path_fn(lambda path, noise=noise: _target_logits(path) + noise)
        tree = build_tree(DynamicTreeShape(3, 4, 12), 0, fn)
        paths = [
            tuple(tree.token_ids[n].item() for n in tree.path(i)[1:]) for i in range(tree.num_nodes)
        ]
        logits = torch.stack([_target_logits(p) for p in paths])
        result = greedy_accept(tree, logits)
        plain: list[int] = []
        for _ in range(len(result.token_ids)):
            plain.append(_target_logits(tuple(plain)).argmax().item())
        assert result.token_ids == plain
        last = result.accepted_nodes[-1] if result.accepted_nodes else 0
        kids = [c for c in range(1, tree.num_nodes) if tree.parents[c].item() == last]
        drafted = [tree.token_ids[c].item() for c in kids]
        assert result.token_ids[-1] not in drafted


def test_sample_accept_with_one_hot_target_is_greedy() -> None:
    """A greedy row's filtered target is one-hot: rejection sampling then reproduces
    greedy acceptance exactly, for deterministic and sampled trees alike."""
    ctx = make_context(PLAIN, seed=4)
    trees = [build_tree(TOPK_TREE, 0, draft_fn(ctx))]
    trees += sampled_trees(ctx, SAMPLED_TREE, 10, seed=5)[0]
    gen = torch.Generator().manual_seed(0)
    for tree in trees:
        for _ in range(5):
            logits = torch.randn(tree.num_nodes, VOCAB, generator=gen)
            logits[0, tree.token_ids[1]] = 9.0  # make some acceptance likely
            one_hot = probs_from_logits(
                logits, _meta([SamplingParams(temperature=0.0)] * len(logits))
            )
            assert sample_accept(tree, one_hot, generator=gen) == greedy_accept(tree, logits)


def test_sample_accept_edge_probabilities() -> None:
    """Candidates with p = 1 are always accepted, p = 0 never, and a recovered token is
    never a rejected deterministic candidate."""
    tree = _tree([0, 1, 2, 3], [0, 0, 0, 0])  # three candidates below the root
    gen = torch.Generator().manual_seed(0)
    sure = torch.zeros(4, 5)
    sure[:, 2] = 1.0  # the target is certain of token 2 (node 2) everywhere
    for _ in range(50):
        assert sample_accept(tree, sure, generator=gen).token_ids == [2, 2]
    forbid = torch.full((4, 5), 0.5)
    forbid[:, 1:4] = 0.0  # only tokens 0 and 4: no candidate can be accepted
    for _ in range(50):
        result = sample_accept(tree, forbid, generator=gen)
        assert result.accepted_nodes == [] and result.token_ids[0] in (0, 4)
    partial = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1]]).expand(4, 5)
    for _ in range(200):
        result = sample_accept(tree, partial, generator=gen)
        if not result.accepted_nodes:
            assert result.token_ids[0] in (0, 4)


def test_sample_accept_is_reproducible_from_the_stream() -> None:
    ctx = make_context(PLAIN, seed=6)
    tree = build_tree(TOPK_TREE, 0, draft_fn(ctx))
    rows = target_rows(ctx, tree)
    a = [sample_accept(tree, rows, SeededStream(42)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    gen = SeededStream(42)
    runs = [sample_accept(tree, rows, gen).token_ids for _ in range(30)]
    assert len({tuple(r) for r in runs}) > 1  # the stream advances between steps


def test_rows_must_match_the_tree() -> None:
    with pytest.raises(
        ValueError, match=r"target_probs has shape \(3, 10\); expected \[7, vocab\]"
    ):
        sample_accept(HAND_TREE, torch.full((3, VOCAB), 0.1))
    with pytest.raises(ValueError, match=r"target_logits has shape \(7,\)"):
        greedy_accept(HAND_TREE, torch.zeros(7))


# ---------------------------------------------------------------- batch front end


def test_accept_batch_matches_per_tree_functions() -> None:
    """One step of four requests (greedy, seeded with top-p, unseeded, seeded), their
    nodes' rows gathered from a fake verify output."""
    ctx = make_context(PLAIN, seed=7)
    trees = [
        build_tree(TOPK_TREE, 0, draft_fn(ctx)),
        sampled_trees(ctx, SAMPLED_TREE, 1, seed=8)[0][0],
        build_tree(CHAIN, 0, draft_fn(ctx)),
        DraftTree(torch.tensor([4]), torch.tensor([0]), torch.tensor([0])),  # no draft
    ]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.8, seed=11),
        SamplingParams(temperature=1.2, top_k=5),
        SamplingParams(temperature=0.9, min_p=0.05, seed=12),
    ]
    # The verify forward also holds a prefill chunk's rows: trees start at rows 0, 20, 31, 40.
    num_nodes = [t.num_nodes for t in trees]
    assert num_nodes == [13, 9, 3, 1]
    rows = [s + i for s, n in zip([0, 20, 31, 40], num_nodes, strict=True) for i in range(n)]
    offsets = [0, 13, 22, 25, 26]

    verify_out = torch.randn(41, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    logits = verify_out[rows]  # [26, VOCAB]: node order, tree after tree
    batch_rng = torch.Generator().manual_seed(99)
    meta = SamplingMetadata.build(params, [None, SeededStream(11), None, SeededStream(12)], CPU)
    results = accept_batch(trees, logits, meta, batch_rng).tolist()

    assert results[0] == greedy_accept(trees[0], logits[: offsets[1]])
    # The random rows: per-node filtered targets, each row's own stream or the batch's RNG.
    probs = torch.cat(
        [
            probs_from_logits(logits[offsets[b] : offsets[b + 1]], _meta([params[b]] * counts))
            for b, counts in ((1, 9), (2, 3), (3, 1))
        ]
    )
    streams = [SeededStream(11), None, SeededStream(12)]
    generator = torch.Generator().manual_seed(99)
    expected = sample_accept_batch(trees[1:], probs, streams, generator).tolist()
    assert results[1:] == expected
    for tree, result in zip(trees, results, strict=True):
        assert len(result.token_ids) == result.num_accepted + 1
        assert all(
            tree.parents[n].item() in (0, *result.accepted_nodes) for n in result.accepted_nodes
        )


def test_accept_batch_seeded_rows_ignore_the_rest_of_the_batch() -> None:
    ctx = make_context(PLAIN, seed=9)
    tree = build_tree(TOPK_TREE, 0, draft_fn(ctx))
    logits = target_rows(ctx, tree).log()
    seeded = SamplingParams(temperature=1.0, seed=5)
    alone_meta = SamplingMetadata.build([seeded], [SeededStream(5)], CPU)
    alone = accept_batch([tree], logits, alone_meta).tolist()
    other = build_tree(CHAIN, 0, draft_fn(ctx))
    mixed_meta = SamplingMetadata.build(
        [SamplingParams(temperature=1.0), seeded], [None, SeededStream(5)], CPU
    )
    mixed_logits = torch.cat([torch.randn(3, VOCAB), logits])
    mixed = accept_batch([other, tree], mixed_logits, mixed_meta).tolist()
    assert mixed[1] == alone[0]


def test_accept_batch_all_greedy_is_greedy_per_tree() -> None:
    ctx = make_context(PLAIN, seed=10)
    trees = [
        build_tree(TOPK_TREE, 0, draft_fn(ctx)),
        HAND_TREE,
        build_tree(CHAIN, 0, draft_fn(ctx)),
    ]
    logits = torch.randn(sum(t.num_nodes for t in trees), VOCAB) * 3
    results = accept_batch(trees, logits, _meta([SamplingParams(temperature=0.0)] * 3)).tolist()
    start = 0
    for tree, result in zip(trees, results, strict=True):
        assert result == greedy_accept(tree, logits[start : start + tree.num_nodes])
        start += tree.num_nodes


def test_accept_batch_checks_its_inputs() -> None:
    meta = _meta([PLAIN, PLAIN])
    with pytest.raises(ValueError, match=r"2 rows for 1 trees"):
        accept_batch([HAND_TREE], torch.zeros(7, VOCAB), meta)
    with pytest.raises(
        ValueError, match=r"target_logits has shape \(6, 10\); expected \[7, vocab\]"
    ):
        accept_batch([HAND_TREE], torch.zeros(6, VOCAB), _meta([PLAIN]))
