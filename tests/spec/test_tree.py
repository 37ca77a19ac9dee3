"""Draft-tree invariants: shapes grow valid trees (parents first, consistent depths, correct
paths), children are the proposer's ranked (or drawn) tokens along the right path, and
the EAGLE-2 dynamic tree keeps exactly the best-scored nodes, never an orphan."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specdec.ops.topk import CHUNK, chunked_topk
from specdec.spec.tree import DraftTree, build_tree, grow_trees
from specdec.tree_shapes import ChainShape, DynamicTreeShape, StaticTreeShape

ROOT = 3


class PathModel:
    """A toy proposer: the draft distribution after a token path is a fixed function of
    the path. It follows ``parent_rows`` exactly as a real proposer must, rebuilding each
    queried node's path from the previous call, and records what it was asked."""

    def __init__(self, vocab: int, seed: int = 0, peaked: bool = False) -> None:
        self.vocab = vocab
        self.seed = seed
        self.peaked = peaked
        self.prev_paths: list[tuple[int, ...]] = []
        self.calls: list[tuple[int, list[tuple[int, ...]]]] = []  # (depth, queried paths)

    def logprobs(self, path: tuple[int, ...]) -> torch.Tensor:  # [vocab]
        gen = torch.Generator().manual_seed(hash((self.seed, *path)) % 2**62)
        logits = torch.randn(self.vocab, generator=gen) * 2.0
        if self.peaked:
            # Probability-1 tokens make a child's score equal its parent's: ties everywhere.
            logits = torch.full((self.vocab,), float("-inf"))
            logits[sum(path) % self.vocab] = 0.0
        return logits.log_softmax(-1)

    def __call__(self, tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int):
        if depth == 0:
            assert parent_rows.tolist() == [0]
            paths = [(int(tokens[0]),)]
        else:
            paths = [
                (*self.prev_paths[r], t)
                for t, r in zip(tokens.tolist(), parent_rows.tolist(), strict=True)
            ]
        assert all(len(p) == depth + 1 for p in paths)
        self.prev_paths = paths
        self.calls.append((depth, paths))
        return torch.stack([self.logprobs(p) for p in paths])


def token_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's token path from the root (root token included)."""
    tokens = tree.token_ids.tolist()
    return [tuple(tokens[n] for n in tree.path(i)) for i in range(tree.num_nodes)]


def ranked(model: PathModel, path: tuple[int, ...]) -> list[int]:
    return model.logprobs(path).sort(descending=True, stable=True).indices.tolist()


# ---------------------------------------------------------------- DraftTree


def test_tree_validation_names_the_bad_node() -> None:
    ids = torch.tensor([5, 1, 2, 3])
    ok = DraftTree(
        token_ids=ids, parents=torch.tensor([0, 0, 1, 1]), depths=torch.tensor([0, 1, 2, 2])
    )
    ok.check()
    bad_parent = DraftTree(ids, torch.tensor([0, 0, 3, 1]), torch.tensor([0, 1, 2, 2]))
    with pytest.raises(ValueError, match=r"node 2 has parent 3"):
        bad_parent.check()
    bad_depth = DraftTree(ids, torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"node 3 has depth 3 but its parent 1 has depth 1"):
        bad_depth.check()
    twins = DraftTree(torch.tensor([5, 1, 2, 2]), ok.parents, ok.depths)
    with pytest.raises(ValueError, match=r"nodes 2 and 3 \(children of 1\) both carry token 2"):
        twins.check()
    with pytest.raises(ValueError, match=r"parents has shape \(3,\)"):
        DraftTree(ids, torch.tensor([0, 0, 1]), ok.depths)
    with pytest.raises(ValueError, match=r"sampled=True needs draft_probs"):
        DraftTree(ids, ok.parents, ok.depths, sampled=True)


def test_retrieve_indices_and_positions() -> None:
    #        0
    #      1   2
    #     3 4   5
    #     6
    tree = DraftTree(
        token_ids=torch.arange(7) + 10,
        parents=torch.tensor([0, 0, 0, 1, 1, 2, 3]),
        depths=torch.tensor([0, 1, 1, 2, 2, 2, 3]),
    )
    tree.check()
    assert tree.leaves() == [4, 5, 6]
    assert tree.path(6) == [0, 1, 3, 6]
    assert tree.path(0) == [0]
    indices, lengths = tree.retrieve_indices()
    assert indices.tolist() == [[0, 1, 4, 0], [0, 2, 5, 0], [0, 1, 3, 6]]
    assert lengths.tolist() == [3, 3, 4]
    assert tree.positions(100).tolist() == [100, 101, 101, 102, 102, 102, 103]
    root_only = DraftTree(torch.tensor([7]), torch.tensor([0]), torch.tensor([0]))
    assert root_only.retrieve_indices()[0].tolist() == [[0]]


# ---------------------------------------------------------------- chain and static


def test_chain_follows_the_draft_argmax() -> None:
    model = PathModel(vocab=20)
    tree = build_tree(ChainShape(4), ROOT, model)
    tree.check()
    assert tree.parents.tolist() == [0, 0, 1, 2, 3]
    assert tree.depths.tolist() == [0, 1, 2, 3, 4]
    assert not tree.sampled and tree.draft_probs is None
    path = (ROOT,)
    for t in tree.token_ids.tolist()[1:]:
        assert t == ranked(model, path)[0]
        path = (*path, t)
    assert [d for d, _ in model.calls] == [0, 1, 2, 3]  # the leaf is never queried


def test_static_tree_children_are_ranked_tokens_of_their_path() -> None:
    choices = [(1, 0), (0,), (0, 0, 1), (2,), (0, 1), (1,), (0, 0), (0, 0, 0), (0, 2)]
    shape = StaticTreeShape(choices)
    assert shape.choices[:3] == ((0,), (1,), (2,))  # ordered by depth, then rank
    model = PathModel(vocab=16)
    tree = build_tree(shape, ROOT, model)
    tree.check()
    assert tree.num_draft_tokens == len(choices)
    paths = token_paths(tree)
    for node, choice in enumerate(shape.choices, start=1):
        assert len(paths[node]) == len(choice) + 1
        # The node's token is rank choice[-1] among its parent path's draft tokens.
        assert paths[node][-1] == ranked(model, paths[node][:-1])[choice[-1]]
        # Its parent is the node for choice[:-1].
        parent = tree.parents[node].item()
        assert (shape.choices[parent - 1] if parent else ()) == choice[:-1]
    # Only nodes with children are queried: the root, (0,), (1,), (0, 0).
    assert [len(p) for _, p in model.calls] == [1, 2, 1]
    indices, lengths = tree.retrieve_indices()
    for row, n in zip(indices.tolist(), lengths.tolist(), strict=True):
        assert row[:n] == tree.path(row[n - 1])
        assert all(x == 0 for x in row[n:])


@pytest.mark.parametrize(
    ("choices", "message"),
    [
        ([(0,), (0, 1, 0)], r"choice \(0, 1, 0\) has no parent \(0, 1\); add \(0, 1\)"),
        ([(1, 0)], r"choice \(1, 0\) has no parent \(1,\)"),
        ([(0,), (0,)], r"choice \(0,\) appears twice"),
        ([(0,), ()], r"choice \(\) is invalid"),
        ([(0,), (-1,)], r"choice \(-1,\) is invalid"),
        ([], r"needs at least one choice"),
    ],
)
def test_static_choices_are_validated(choices: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StaticTreeShape(choices)


def test_sampled_tree_needs_contiguous_ranks_and_a_static_shape() -> None:
    model = PathModel(vocab=8)
    with pytest.raises(ValueError, match=r"sample=True needs contiguous sibling ranks"):
        build_tree(StaticTreeShape([(0,), (2,)]), ROOT, model, sample=True)
    with pytest.raises(ValueError, match=r"not lossless with DynamicTreeShape"):
        build_tree(DynamicTreeShape(2, 2, 3), ROOT, model, sample=True)
    with pytest.raises(ValueError, match=r"ChainShape\(k=0\)"):
        ChainShape(0)


def test_sampled_children_are_draws_without_replacement() -> None:
    """Root children (a, b) must follow q(a) q(b) / (1 - q(a)): chi-square, 4,000 builds."""
    vocab, draws = 6, 4000
    model = PathModel(vocab=vocab, seed=5)
    q = model.logprobs((ROOT,)).exp().double()
    gen = torch.Generator().manual_seed(11)
    shape = StaticTreeShape([(0,), (1,)])
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for _ in range(draws):
        tree = build_tree(shape, ROOT, model, sample=True, generator=gen)
        a, b = tree.token_ids.tolist()[1:]
        counts[a, b] += 1
    tree.check()
    assert tree.sampled
    torch.testing.assert_close(tree.draft_probs[1:].double(), q.expand(2, vocab))
    expected = draws * q[:, None] * q[None, :] / (1 - q[:, None])
    expected.fill_diagonal_(0.0)
    assert counts.diagonal().sum() == 0  # never the same token twice
    keep = expected.flatten() >= 5
    observed, expected = counts.flatten(), expected.flatten()
    other_obs, other_exp = observed[~keep].sum(), expected[~keep].sum()
    o = torch.cat([observed[keep], other_obs[None]])
    e = torch.cat([expected[keep], other_exp[None]])
    stat = ((o - e) ** 2 / e).sum()
    dof = o.numel() - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2), stat / 2).item()
    assert p_value > 0.01, p_value


# ---------------------------------------------------------------- dynamic (EAGLE-2)


def _score(model: PathModel, path: tuple[int, ...]) -> float:
    """Cumulative draft log-probability of the draft tokens path[1:] after the root."""
    return sum(model.logprobs(path[:i])[path[i]].item() for i in range(1, len(path)))


def _eagle2_reference(model: PathModel, top_k: int, depth: int, total: int) -> set[tuple[int, ...]]:
    """EAGLE-2 written directly on token paths (no tensors, no renumbering)."""
    candidates: list[tuple[int, ...]] = []
    frontier = [(ROOT,)]
    for _ in range(depth):
        grown = [(*p, t) for p in frontier for t in ranked(model, p)[:top_k]]
        candidates += grown
        frontier = sorted(grown, key=lambda p: -_score(model, p))[:top_k]
    return set(sorted(candidates, key=lambda p: -_score(model, p))[:total])


def test_dynamic_tree_with_full_width_keeps_the_best_sequences() -> None:
    """top_k = vocab and depth 2 grows every sequence of length <= 2, so the kept nodes must
    be exactly the best-scored sequences by brute-force enumeration."""
    vocab, total = 5, 9
    model = PathModel(vocab=vocab, seed=1)
    tree = build_tree(DynamicTreeShape(top_k=vocab, depth=2, total_tokens=total), ROOT, model)
    tree.check()
    every = [(ROOT, a) for a in range(vocab)] + [
        (ROOT, a, b) for a, b in itertools.product(range(vocab), repeat=2)
    ]
    best = sorted(every, key=lambda p: -_score(model, p))[:total]
    assert set(token_paths(tree)[1:]) == set(best)
    assert tree.num_draft_tokens == total


@pytest.mark.parametrize(("top_k", "depth", "total"), [(2, 3, 8), (3, 4, 20), (4, 3, 5)])
def test_dynamic_tree_matches_eagle2_reference(top_k: int, depth: int, total: int) -> None:
    model = PathModel(vocab=7, seed=top_k * 10 + depth)
    shape = DynamicTreeShape(top_k=top_k, depth=depth, total_tokens=total)
    tree = build_tree(shape, ROOT, model)
    tree.check()
    paths = token_paths(tree)
    assert set(paths[1:]) == _eagle2_reference(model, top_k, depth, total)
    assert tree.num_nodes == total + 1
    # Depth >= 2 levels query exactly top_k frontier nodes, each one level deeper.
    assert [(d, len(p)) for d, p in model.calls] == [(0, 1)] + [(d, top_k) for d in range(1, depth)]
    # Node 1 is the draft's best first token: no deeper node can outscore it.
    assert paths[1] == (ROOT, ranked(model, (ROOT,))[0])
    # Scores never increase from parent to child, so the kept set is closed under parents.
    for i in range(1, tree.num_nodes):
        parent = tree.parents[i].item()
        assert _score(model, paths[i]) <= _score(model, paths[parent]) + 1e-6


def test_dynamic_tree_keeps_parents_under_ties() -> None:
    """With probability-1 draft tokens a child scores exactly its parent's score (and the
    other children -inf); stable ordering must still keep every kept node's parent."""
    model = PathModel(vocab=6, peaked=True)
    for top_k, depth, total in [(2, 4, 6), (3, 3, 12), (1, 5, 5)]:
        tree = build_tree(DynamicTreeShape(top_k, depth, total), ROOT, model)
        tree.check()  # an orphan would be renumbered to the root: depth check fails
        tokens = tree.token_ids.tolist()
        for i in range(1, tree.num_nodes):
            parent = tree.parents[i].item()
            # Among top_k of its parent's draft tokens (ties in any order: check by value).
            lp = model.logprobs(token_paths(tree)[parent])
            assert lp[tokens[i]] >= lp.sort(descending=True).values[top_k - 1]
        # The probability-1 chain outranks every other node: it is kept whole.
        scores = [_score(model, p) for p in token_paths(tree)]
        chain_depths = [d for d, s in zip(tree.depths.tolist(), scores, strict=True) if s == 0]
        assert chain_depths == list(range(min(depth, total) + 1))
        assert all(s == 0.0 or math.isinf(s) for s in scores)


def test_dynamic_tree_with_top_k_1_is_the_greedy_chain() -> None:
    model = PathModel(vocab=9, seed=3)
    dynamic = build_tree(DynamicTreeShape(top_k=1, depth=5, total_tokens=5), ROOT, model)
    chain = build_tree(ChainShape(5), ROOT, PathModel(vocab=9, seed=3))
    assert torch.equal(dynamic.token_ids, chain.token_ids)
    assert torch.equal(dynamic.parents, chain.parents)
    assert torch.equal(dynamic.depths, chain.depths)


def test_dynamic_shape_is_validated() -> None:
    assert DynamicTreeShape(top_k=4, depth=3, total_tokens=36).num_candidates == 36
    with pytest.raises(ValueError, match=r"total_tokens=37 exceeds the 36 candidates"):
        DynamicTreeShape(top_k=4, depth=3, total_tokens=37)
    with pytest.raises(ValueError, match=r"top_k=0 is invalid"):
        DynamicTreeShape(top_k=0, depth=3, total_tokens=3)


def test_depth_follows_the_batch_size_bands() -> None:
    """``num_speculative_tokens_by_batch_size``: each band's depth up to its batch size,
    ``num_speculative_tokens`` above the last; dynamic trees keep top_k and total_tokens."""
    from specdec.config import SpeculativeConfig

    spec = SpeculativeConfig(
        num_speculative_tokens=3, num_speculative_tokens_by_batch_size=[[1, 6], [4, 5]]
    )
    assert [spec.shape_at(b).depth for b in (1, 2, 4, 5, 64)] == [6, 5, 5, 3, 3]
    assert spec.bands == [(1, ChainShape(6)), (4, ChainShape(5)), (None, ChainShape(3))]
    assert spec.max_draft_tokens == 6  # what verification reserves: the deepest band's
    tree = SpeculativeConfig(
        tree="dynamic", top_k=4, num_speculative_tokens=3, total_tokens=16,
        num_speculative_tokens_by_batch_size=[[2, 5]],
    )  # fmt: skip
    assert tree.shape_at(2) == DynamicTreeShape(top_k=4, depth=5, total_tokens=16)
    assert tree.shape_at(3) == DynamicTreeShape(top_k=4, depth=3, total_tokens=16)


def test_a_band_may_name_its_own_shape() -> None:
    """A band given as shape fields: a dynamic tree while one request runs, a chain of 5
    up to 4, the config's chain of 3 above; unnamed fields come from the config."""
    from specdec.config import SpeculativeConfig

    tree = {"tree": "dynamic", "num_speculative_tokens": 6, "total_tokens": 32}
    spec = SpeculativeConfig(
        num_speculative_tokens=3, top_k=8, num_speculative_tokens_by_batch_size=[[1, tree], [4, 5]]
    )
    assert spec.bands == [
        (1, DynamicTreeShape(top_k=8, depth=6, total_tokens=32)),
        (4, ChainShape(5)),
        (None, ChainShape(3)),
    ]
    assert spec.max_draft_tokens == 32
    chain = SpeculativeConfig(
        tree="dynamic", num_speculative_tokens=4, top_k=4, total_tokens=16,
        num_speculative_tokens_by_batch_size=[[2, {"tree": "chain"}]],
    )  # fmt: skip
    assert chain.shape_at(2) == ChainShape(4)  # the config's depth, a chain's shape
    # A band confined to CUDA: a proposer on the CPU drafts the next band's shape there.
    gpu_tree = SpeculativeConfig(
        num_speculative_tokens=3,
        num_speculative_tokens_by_batch_size=[[1, {**tree, "device": "cuda"}], [4, 5]],
    )
    assert gpu_tree.bands_on("cuda") == spec.bands
    assert gpu_tree.bands_on("cpu") == [(4, ChainShape(5)), (None, ChainShape(3))]
    assert gpu_tree.bands == spec.bands  # every band (validation, reports)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_speculative_tokens_by_batch_size": [[4, 0]]}, r"entry \[4, 0\] must be"),
        ({"num_speculative_tokens_by_batch_size": [[4, {}]]}, r"entry \[4, \{\}\] must be"),
        (
            {"num_speculative_tokens_by_batch_size": [[1, {"tree": "dynamic", "depth": 6}]]},
            r"names \['depth'\]; a band's shape takes",
        ),
        (
            {"num_speculative_tokens_by_batch_size": [[1, {"tree": "chain", "device": "tpu"}]]},
            r"device 'tpu' must be one of \['cuda', 'cpu'\]",
        ),
        (
            {"num_speculative_tokens_by_batch_size": [[1, {"tree": "dynamic", "top_k": 64}]]},
            r"needs 1 <= top_k \(64\) <= total_tokens \(48\)",
        ),
        ({"num_speculative_tokens_by_batch_size": [[4]]}, r"entry \[4\] must be"),
        ({"num_speculative_tokens_by_batch_size": [[4, 5], [2, 6]]}, "must increase"),
        (
            {"num_speculative_tokens_by_batch_size": [[16, 5]], "disable_by_batch_size": 16},
            "keep every max_batch below 16",
        ),
        (
            {"tree": "static", "choices": [[0]], "num_speculative_tokens_by_batch_size": [[4, 5]]},
            "static tree's choices fix",
        ),
        (
            {
                "tree": "dynamic",
                "top_k": 4,
                "total_tokens": 30,
                "num_speculative_tokens_by_batch_size": [[4, 2]],
            },
            r"total_tokens=30 exceeds the 20",  # depth 2: 4 + 16 candidates (depth 3: 36)
        ),
    ],
)
def test_depth_bands_are_validated(fields: dict, message: str) -> None:
    from specdec.config import SpeculativeConfig

    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**fields)


def test_step_fn_must_return_one_row_per_node() -> None:
    with pytest.raises(
        ValueError, match=r"returned shape \(1, 2, 8\) at depth 0; expected \[1, 1, vocab\]"
    ):
        build_tree(ChainShape(2), ROOT, lambda tokens, rows, depth: torch.zeros(2, 8))


class BatchedPathModels:
    """One ``PathModel`` per tree, queried through the batched interface."""

    def __init__(self, models: list[PathModel]) -> None:
        self.models = models

    def __call__(self, tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int):
        assert tokens.shape == parent_rows.shape and tokens.shape[0] == len(self.models)
        return torch.stack(
            [m(t, r, depth) for m, t, r in zip(self.models, tokens, parent_rows, strict=True)]
        )


# One shape of each kind, for the batched-growth tests.
GROWTH_SHAPES = pytest.mark.parametrize(
    "shape",
    [
        ChainShape(3),
        StaticTreeShape([(0,), (1,), (0, 0), (0, 1), (1, 0)]),
        DynamicTreeShape(3, 4, 10),
    ],
    ids=["chain", "static", "dynamic"],
)


@GROWTH_SHAPES
@pytest.mark.parametrize("peaked", [False, True], ids=["random", "ties"])
def test_batched_growth_equals_one_tree_at_a_time(shape, peaked: bool) -> None:
    """Trees grown together never interact: each equals the tree grown alone."""
    roots = [3, 7, 3, 11]
    batched = BatchedPathModels([PathModel(16, seed=s, peaked=peaked) for s in range(4)])
    trees = grow_trees(shape, torch.tensor(roots), batched).unbind()
    for seed, (root, tree) in enumerate(zip(roots, trees, strict=True)):
        alone = build_tree(shape, root, PathModel(16, seed=seed, peaked=peaked))
        tree.check()
        for name in ("token_ids", "parents", "depths"):
            assert getattr(tree, name).tolist() == getattr(alone, name).tolist(), name


@GROWTH_SHAPES
def test_sub_vocabulary_growth_equals_scattered_scores(shape) -> None:
    """Ranking in a sub-vocabulary (``token_map``, EAGLE-3's draft vocabulary) grows the
    trees that scoring the whole vocabulary with -inf outside it grows."""
    vocab = 16
    token_map = torch.tensor([1, 3, 4, 6, 7, 9, 10, 12, 13, 15])  # target ids, ascending
    roots = torch.tensor([3, 7, 3, 12])

    def models() -> BatchedPathModels:
        return BatchedPathModels([PathModel(vocab, seed=s) for s in range(4)])

    full_model, sub_model = models(), models()

    def full(tokens, parent_rows, depth):  # [batch, n, vocab], -inf outside the map
        scores = full_model(tokens, parent_rows, depth)
        masked = torch.full_like(scores, float("-inf"))
        masked[..., token_map] = scores[..., token_map]
        return masked

    def sub(tokens, parent_rows, depth):  # [batch, n, len(token_map)]
        return sub_model(tokens, parent_rows, depth)[..., token_map]

    expected = grow_trees(shape, roots, full)
    got = grow_trees(shape, roots, sub, token_map=token_map)
    for name in ("token_ids", "parents", "depths"):
        assert getattr(got, name).tolist() == getattr(expected, name).tolist(), name
    assert set(got.token_ids[:, 1:].flatten().tolist()) <= set(token_map.tolist())
    with pytest.raises(ValueError, match="token_map needs sample=False"):
        grow_trees(ChainShape(2), roots, sub, token_map=token_map, sample=True)


def test_shape_sizes() -> None:
    assert (ChainShape(4).depth, ChainShape(4).num_expanded) == (4, 3)
    static = StaticTreeShape([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert (static.depth, static.num_expanded) == (3, 3)  # (0,), (1,), (0, 0) have children
    dynamic = DynamicTreeShape(8, 5, 48)
    assert (dynamic.depth, dynamic.num_expanded, dynamic.num_candidates) == (5, 32, 264)


LAYOUT_SHAPES = pytest.mark.parametrize(
    "shape",
    [
        ChainShape(4),
        # a chain of two levels, then branching: the mask starts after a maskless prefix
        StaticTreeShape([(0,), (0, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0), (0, 0, 1, 0)]),
        DynamicTreeShape(3, 4, 10),
    ],
    ids=["chain", "chain-then-tree", "dynamic"],
)


@LAYOUT_SHAPES
def test_draft_layout_feeds_each_node_at_its_slot_with_its_ancestors(shape) -> None:
    """``TreeDraftLayout``'s inputs for every level equal a host-side layout: fed node
    ``j`` of tree ``b`` at cache index ``start[b] + j`` through the block table (slot),
    at position ``start[b] + depth - 1``, seeing the context and exactly its fed
    ancestors (the tree mask; none while the fed nodes form a chain)."""
    from specdec.spec.tree_draft import GrowInputs, TreeDraftLayout

    block_size, batch = 4, 3
    start = [5, 0, 13]
    tables = torch.tensor([[7, 2, 9, 4, 1, 0], [3, 8, 0, 0, 0, 0], [6, 5, 11, 10, 12, 0]])
    inputs = GrowInputs(
        roots=torch.tensor([3, 7, 3]),
        start=torch.tensor(start),
        block_tables=tables.to(torch.int32),
        root_state=(),
        start_cpu=start,
    )
    layout = TreeDraftLayout(inputs, block_size, None, shape.num_expanded)
    model = BatchedPathModels([PathModel(16, seed=s) for s in range(batch)])
    parents: list[list[int | None]] = [[] for _ in range(batch)]  # fed node -> fed parent
    offsets = [0]  # first fed index of each level

    def step(tokens, parent_rows, depth):
        if depth > 0:
            x = layout.level(tokens, parent_rows, depth)
            n, prev = tokens.shape[1], len(parents[0])
            total = prev + n
            for b in range(batch):
                for r in parent_rows[b].tolist():
                    parents[b].append(offsets[-1] + r if depth > 1 else None)
            offsets.append(prev)
            slots = [
                int(tables[b, (start[b] + j) // block_size]) * block_size
                + (start[b] + j) % block_size
                for b in range(batch)
                for j in range(prev, total)
            ]
            assert x.meta.slot_mapping.tolist() == slots
            # Kernels index these densely: a strided view would address other entries.
            assert x.meta.slot_mapping.is_contiguous() and x.positions.is_contiguous()
            positions = [start[b] + depth - 1 for b in range(batch) for _ in range(n)]
            assert x.positions.tolist() == positions
            assert x.meta.seq_lens.tolist() == [s + total for s in start]
            assert x.meta.query_start_loc.tolist() == list(range(0, (batch + 1) * n, n))
            if n == 1 and prev == depth - 1:  # the fed nodes form a chain: causal
                assert not x.meta.has_tree
            else:
                assert x.meta.has_tree and x.meta.max_tree_len == total
                mask = x.meta.tree_mask.view(batch, total, total)
                for b in range(batch):
                    for i in range(total):
                        seen, node = set(), i
                        while node is not None:
                            seen.add(node)
                            node = parents[b][node]
                        assert mask[b, i].tolist() == [j in seen for j in range(total)], (b, i)
        return model(tokens, parent_rows, depth)

    grow_trees(shape, inputs.roots, step)
    assert layout.num_fed == shape.num_expanded


# ---------------------------------------------------------------- two-pass top-k


@pytest.mark.parametrize("k", [1, 8, 40])
def test_chunked_topk_returns_topks_values_in_order(k: int) -> None:
    """The two passes return exactly one ``topk``'s values, largest first, with indices
    that point at them; rows with ties and -inf included (bf16-like logits tie often)."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(3, 5, 4096, generator=gen).mul(4).round()  # many exact ties
    x[0, 0, 100:3000] = float("-inf")
    values, indices = chunked_topk(x, k, chunk=512)
    expected = x.topk(k, dim=-1).values
    assert torch.equal(values, expected)
    assert torch.equal(x.gather(-1, indices), values)
    assert (indices.sort(dim=-1).values.diff(dim=-1) > 0).all()  # no index twice
    # Distinct values: the very same indices as topk.
    y = torch.randn(2, 2048, generator=gen)
    assert torch.equal(chunked_topk(y, k, chunk=256)[1], y.topk(k, dim=-1).indices)


def test_chunked_topk_falls_back_to_one_topk() -> None:
    x = torch.randn(2, 1000)  # not a multiple of the chunk
    assert torch.equal(chunked_topk(x, 3, chunk=256)[0], x.topk(3).values)
    assert torch.equal(chunked_topk(x[:, :300], 3, chunk=256)[0], x[:, :300].topk(3).values)


def test_dynamic_tree_over_a_chunked_vocabulary_matches_eagle2_reference() -> None:
    """A draft vocabulary of several ``topk.CHUNK``s takes the two-pass top-k at every
    level; the kept tree is still EAGLE-2's."""
    model = PathModel(vocab=4 * CHUNK, seed=11)
    tree = build_tree(DynamicTreeShape(top_k=4, depth=4, total_tokens=16), ROOT, model)
    tree.check()
    assert set(token_paths(tree)[1:]) == _eagle2_reference(model, 4, 4, 16)
