"""Draft trees: the shapes a proposer's guesses can take, and one request's tree tensors.

A draft tree hangs below the *root*, the request's last committed token (not a draft
token): the target's logits at the root predict draft position 1, and the logits at a node
of depth d predict position d + 1. Nodes are numbered parents before children
(``parents[i] < i``), so a node's path is a chain of smaller indices and the verifier can
lay the nodes out in index order.

Shapes (``specdec.tree_shapes``; how many children, where):

- ``ChainShape(k)``: k draft tokens in a line (classic speculative decoding).
- ``StaticTreeShape(choices)``: a fixed tree written as choice paths (EAGLE/Medusa style);
  ``(0, 1)`` is the second-ranked child of the best child of the root.
- ``DynamicTreeShape(top_k, depth, total_tokens)``: EAGLE-2's tree grown from the draft's
  own confidence (see ``_build_dynamic``).

``grow_trees`` grows any shape below a batch of roots by querying a proposer level by
level through a ``BatchStepLogprobsFn`` (``build_tree``: one root), so tree construction
knows nothing about the proposer. By default
children are the proposer's top-ranked tokens: *deterministic candidates*
(``sampled=False``), which lossless acceptance verifies as if drawn from a one-hot draft.
With ``sample=True`` (chain and static shapes only) children are drawn at random without
replacement from the draft distribution (``sampled=True``; the tree keeps that distribution
in ``draft_probs``).

Building never reads a device value on the host: every size is fixed by the shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.attention.tree_mask import ancestor_closure
from specdec.device.staging import to_device
from specdec.ops.topk import LevelTopK, chunked_topk, log_softmax_topk_ref
from specdec.tree_shapes import ChainShape, DynamicTreeShape, StaticTreeShape, TreeShape

StepLogprobsFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``fn(node_token_ids [n] int64, parent_rows [n] int64, depth) -> logprobs [n, vocab]``.

Called once per tree level, from the root (depth 0) down. Row j asks for the draft's
log-probabilities of the token after node j, whose token is ``node_token_ids[j]`` and whose
depth is ``depth``. ``parent_rows[j]`` is the row of node j's parent in the *previous*
call (so a proposer gathers the state it kept per row, e.g. EAGLE hidden states, with
``state[parent_rows]``); in the depth-0 call the only node is the root and
``parent_rows == [0]``. Only nodes that will get children are queried: leaves never are.
The vocabulary is the target's, or a sub-vocabulary named by ``grow_trees``'
``token_map`` (EAGLE-3's draft vocabulary: column ``i`` is target id ``token_map[i]``),
which saves scattering every level's scores into the target's vocabulary and ranking
over its width; the nodes always carry target ids.
"""

BatchStepLogprobsFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``fn(node_token_ids [batch, n] int64, parent_rows [batch, n] int64, depth) -> logprobs
[batch, n, vocab]``: ``StepLogprobsFn`` for a batch of trees grown together. Row ``b`` of
every argument belongs to tree ``b``; ``parent_rows[b, j]`` indexes tree ``b``'s rows of
the previous call.
"""


@dataclass
class DraftTree:
    """One request's draft tree, on the proposer's device.

    Invariants: ``parents[0] == 0`` and ``depths[0] == 0`` (node 0 is the root); for
    i > 0, ``parents[i] < i`` and ``depths[i] == depths[parents[i]] + 1``; siblings carry
    distinct tokens. Siblings are listed in the order acceptance tries them: best-ranked
    first for deterministic candidates, draw order for sampled ones. When ``sampled``,
    ``draft_probs[i]`` is the distribution node i was drawn from (shared by siblings; row
    0 is unused). ``__post_init__`` checks shapes only (no device sync); ``check()``
    checks the structure.
    """

    token_ids: torch.Tensor  # [num_nodes] int64; token_ids[0] is the root token
    parents: torch.Tensor  # [num_nodes] int64
    depths: torch.Tensor  # [num_nodes] int64
    draft_probs: torch.Tensor | None = None  # [num_nodes, vocab] float32, sampled trees
    sampled: bool = False
    # Host-side hint: node i's parent is node i-1 (verification then needs no tree mask).
    is_chain: bool = False
    # [num_nodes, num_nodes] bool, optional: row i marks node i and its ancestors (what
    # verification's tree mask holds; growth computes it on device so steps need not).
    ancestor_mask: torch.Tensor | None = None
    # [num_signals] float32, optional: signals the proposer read while drafting, for the
    # engine's step hooks (specdec/step_hook.py), in ``Proposer.exit_signals`` order (an
    # EAGLE-3 head's SpecExit channels), left on the device.
    signals: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.token_ids.shape[0] if self.token_ids.dim() == 1 else -1
        for name in ("token_ids", "parents", "depths"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n or t.dtype != torch.int64:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)} and dtype {t.dtype}; every node "
                    f"array must be [num_nodes] int64 with num_nodes = {n} (token_ids)"
                )
        if n < 1:
            raise ValueError("a draft tree needs at least its root (num_nodes >= 1)")
        if self.sampled and self.draft_probs is None:
            raise ValueError(
                "sampled=True needs draft_probs [num_nodes, vocab]: lossless acceptance of "
                "sampled children divides by the draft probability"
            )
        if self.draft_probs is not None and (
            self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n
        ):
            raise ValueError(
                f"draft_probs has shape {tuple(self.draft_probs.shape)}; expected "
                f"[{n}, vocab] (one row per node)"
            )

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_draft_tokens(self) -> int:
        """Nodes other than the root: the draft tokens this tree asks the target to verify."""
        return self.num_nodes - 1

    def parent_list(self) -> list[int]:
        """``parents`` on the host (one device sync)."""
        return self.parents.tolist()

    def check(self) -> None:
        """Raise ValueError unless the structural invariants hold (syncs; for tests and
        for trees a proposer assembled by hand)."""
        parents = self.parents.tolist()
        depths = self.depths.tolist()
        tokens = self.token_ids.tolist()
        if parents[0] != 0 or depths[0] != 0:
            raise ValueError(
                f"root has parent {parents[0]} and depth {depths[0]}; node 0 is the root and "
                "needs parent 0, depth 0"
            )
        for i in range(1, len(parents)):
            if not 0 <= parents[i] < i:
                raise ValueError(
                    f"node {i} has parent {parents[i]}; number nodes parents first "
                    "(0 <= parents[i] < i)"
                )
            if depths[i] != depths[parents[i]] + 1:
                raise ValueError(
                    f"node {i} has depth {depths[i]} but its parent {parents[i]} has depth "
                    f"{depths[parents[i]]}; a child is one level below its parent"
                )
        if self.is_chain and parents != [0, *range(len(parents) - 1)]:
            raise ValueError(
                f"is_chain=True but parents are {parents}; a chain's are 0, 0, 1, 2, ..."
            )
        first_with: dict[tuple[int, int], int] = {}
        for i in range(1, len(parents)):
            other = first_with.setdefault((parents[i], tokens[i]), i)
            if other != i:
                raise ValueError(
                    f"nodes {other} and {i} (children of {parents[i]}) both carry token "
                    f"{tokens[i]}; siblings must differ (deduplicate the candidates)"
                )

    def path(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, both included (host; one sync)."""
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} is outside the tree's {self.num_nodes} nodes")
        parents = self.parent_list()
        out = [node]
        while node != 0:
            node = parents[node]
            out.append(node)
        return out[::-1]

    def leaves(self) -> list[int]:
        """Nodes without children, in increasing index order (host)."""
        has_child = [False] * self.num_nodes
        for p in self.parent_list()[1:]:
            has_child[p] = True
        return [i for i, h in enumerate(has_child) if not h]

    def retrieve_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every root-to-leaf path, one row per leaf (leaves in index order).

        Returns ``indices [num_leaves, max_depth + 1] int64`` and ``lengths [num_leaves]
        int64``: row r's first ``lengths[r]`` entries are the path (root first); the rest
        are 0, the root. The filler is a valid index, so gathering with ``indices`` never
        goes out of bounds, but it is not part of the path: always mask with ``lengths``.
        """
        paths = [self.path(leaf) for leaf in self.leaves()]
        width = max(len(p) for p in paths)
        rows = [p + [0] * (width - len(p)) for p in paths]
        device = self.token_ids.device
        return (
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor([len(p) for p in paths], dtype=torch.int64, device=device),
        )

    def positions(self, prefix_len: int | torch.Tensor) -> torch.Tensor:  # [num_nodes]
        """Each node's position in the sequence. ``prefix_len`` counts the tokens before
        the root, so it is the root's own position; siblings share a position."""
        return self.depths + prefix_len


def cat_on(device: torch.device, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` on ``device`` for tensors that live on the host or on
    ``device`` (trees from the ngram proposer and root-only trees are host-side, a model
    proposer's are not): every host part travels in one copy, not one copy each, since a
    step concatenates a field of every tree in the batch."""
    if device.type == "cpu":
        return torch.cat(list(parts))
    host = [i for i, t in enumerate(parts) if t.device.type == "cpu"]
    if not host:
        return torch.cat(list(parts))
    moved = to_device(torch.cat([parts[i] for i in host]).numpy(), device)
    if len(host) == len(parts):
        return moved
    out = list(parts)
    for i, part in zip(host, moved.split([parts[i].shape[0] for i in host]), strict=True):
        out[i] = part
    return torch.cat(out)


def root_only_tree(root: int) -> DraftTree:
    """A tree without drafts: verifying it is a plain decode of the root's next token."""
    zero = torch.zeros(1, dtype=torch.int64)
    return DraftTree(torch.tensor([root], dtype=torch.int64), zero, zero, is_chain=True)


# ---------------------------------------------------------------- building


def build_tree(
    shape: TreeShape,
    root_token: int | torch.Tensor,  # int, or [] / [1] int64 on the proposer's device
    step_logprobs_fn: StepLogprobsFn,
    *,
    sample: bool = False,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """Grow ``shape`` below one root: ``grow_trees`` for a batch of one."""
    root = torch.as_tensor(root_token, dtype=torch.int64).reshape(1)  # [1]

    def batched(tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int) -> torch.Tensor:
        return step_logprobs_fn(tokens[0], parent_rows[0], depth)[None]

    return grow_trees(shape, root, batched, sample=sample, generator=generator).unbind()[0]


@dataclass
class TreeBatch:
    """Trees of one shape grown together, stacked: row ``b`` is tree ``b``.

    Shapes: ``token_ids``, ``parents``, ``depths`` ``[batch, num_nodes]`` int64;
    ``draft_probs`` ``[batch, num_nodes, vocab]`` for sampled trees.
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    draft_probs: torch.Tensor | None = None
    sampled: bool = False
    is_chain: bool = False
    ancestor_mask: torch.Tensor | None = None  # [batch, num_nodes, num_nodes] bool
    signals: torch.Tensor | None = None  # [batch, num_signals] float32 (DraftTree's)

    def unbind(self) -> list[DraftTree]:
        """One ``DraftTree`` per row (views; no copies, no sync)."""
        return [
            DraftTree(
                token_ids=self.token_ids[b],
                parents=self.parents[b],
                depths=self.depths[b],
                draft_probs=self.draft_probs[b] if self.draft_probs is not None else None,
                sampled=self.sampled,
                is_chain=self.is_chain,
                ancestor_mask=self.ancestor_mask[b] if self.ancestor_mask is not None else None,
                signals=self.signals[b] if self.signals is not None else None,
            )
            for b in range(self.token_ids.shape[0])
        ]


def grow_trees(
    shape: TreeShape,
    roots: torch.Tensor,  # [batch] int64 on the proposer's device
    step_logprobs_fn: BatchStepLogprobsFn,
    *,
    sample: bool = False,
    generator: torch.Generator | None = None,
    token_map: torch.Tensor | None = None,
    level_topk: LevelTopK = log_softmax_topk_ref,
) -> TreeBatch:
    """Grow ``shape`` below each of ``roots`` by querying ``step_logprobs_fn`` level by
    level, every tree of the batch in the same call (they share the shape, so a level is a
    ``[batch, n]`` block of nodes).

    ``sample=False``: children are the top-ranked tokens (deterministic candidates; ties as
    ``chunked_topk`` breaks them). ``sample=True``: the children of a node are successive
    draws without replacement from softmax(logprobs) (using ``generator``), in draw order;
    only chain and static shapes allow it, and a static shape's sibling ranks must then be
    contiguous (a gap would mean a drawn token acceptance never saw).

    ``token_map`` [sub_vocab] int64: ``step_logprobs_fn`` scores a sub-vocabulary whose
    column ``i`` is target token ``token_map[i]`` (the rest of the target's vocabulary
    has probability 0); the same tree as scoring the whole vocabulary with -inf outside
    it, up to how exact ties are broken. Deterministic candidates only (sampled trees
    keep their draft distribution over the target's vocabulary).

    ``level_topk`` ranks a dynamic shape's children (log-softmax, then top k); the GPU
    path passes the Triton kernel (``kernels.topk``), which breaks ties by lowest column.

    Growth runs device ops only, on tensors whose sizes the shape fixes: no host sync, no
    host-to-device copy (index tensors come from a per-shape cache), so a proposer can
    capture it in a CUDA graph once the cache is warm.
    """
    if roots.dim() != 1 or roots.shape[0] < 1:
        raise ValueError(f"roots has shape {tuple(roots.shape)}; expected [batch >= 1]")
    if token_map is not None and sample:
        raise ValueError(
            "token_map needs sample=False: a sampled tree's draft_probs cover the target's "
            "vocabulary; score the whole vocabulary to sample"
        )
    roots = roots.to(torch.int64)
    if isinstance(shape, DynamicTreeShape):
        if sample:
            raise ValueError(
                "sample=True is not lossless with DynamicTreeShape: pruning by score keeps a "
                "sampled child depending on its value; use deterministic candidates "
                "(sample=False) or a chain/static shape"
            )
        grown = _build_dynamic(shape, roots, step_logprobs_fn, token_map, level_topk)
        return _with_mask(grown, shape.depth)
    static = shape.as_static() if isinstance(shape, ChainShape) else shape
    if sample and not static.ranks_contiguous():
        raise ValueError(
            f"sample=True needs contiguous sibling ranks, but {static.choices} skips one; "
            "add the missing ranks or use sample=False"
        )
    batch = _build_static(static, roots, step_logprobs_fn, sample, generator, token_map)
    if isinstance(shape, ChainShape):
        batch.is_chain = True  # causal: verification needs no mask
        return batch
    return _with_mask(batch, shape.depth)


def tree_plan(shape: TreeShape, device: torch.device) -> None:
    """Make ``shape``'s index constants on ``device`` now. ``grow_trees`` makes them on
    first use; a caller about to trace it (``torch.compile``) calls this first, so the
    trace reads the cached tensors instead of recording their creation."""
    device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report
    if isinstance(shape, DynamicTreeShape):
        _dynamic_plan(shape, device)
    else:
        _static_plan(shape.as_static() if isinstance(shape, ChainShape) else shape, device)


def _with_mask(batch: TreeBatch, max_depth: int) -> TreeBatch:
    batch.ancestor_mask = ancestor_closure(batch.parents, max_depth)
    return batch


def _level_scores(
    fn: BatchStepLogprobsFn, tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int
) -> torch.Tensor:  # [batch, n, vocab]: what ``fn`` returned, shape checked
    scores = fn(tokens, parent_rows, depth)
    if scores.dim() != 3 or scores.shape[:2] != tokens.shape:
        raise ValueError(
            f"step_logprobs_fn returned shape {tuple(scores.shape)} at depth {depth}; "
            f"expected [{tokens.shape[0]}, {tokens.shape[1]}, vocab] (one row per queried "
            "node)"
        )
    return scores


def _level_logprobs(
    fn: BatchStepLogprobsFn, tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int
) -> torch.Tensor:  # [batch, n, vocab] float32, normalised
    # Idempotent on log-probabilities; makes raw logits safe too.
    return _level_scores(fn, tokens, parent_rows, depth).float().log_softmax(dim=-1)


@dataclass(frozen=True)
class _StaticLevel:
    """Index tensors of one level of a static shape (device constants)."""

    expanded: torch.Tensor  # [n] nodes queried at this level (all have children)
    parent_rows: torch.Tensor  # [n] each queried node's row in the previous call
    children: torch.Tensor  # [m] nodes one level down
    child_rows: torch.Tensor  # [m] their parent's row in this call
    ranks: torch.Tensor  # [m] each child's rank among its siblings
    width: int  # ranks needed per queried node
    # Host shortcuts (each op saved is a kernel launch on the GPU): the node ranges that
    # ``expanded`` / ``children`` are when consecutive, and whether each queried node has
    # exactly its rank-0 child, in order (a chain's level).
    expanded_span: slice | None = None
    children_span: slice | None = None
    one_child_each: bool = False


@dataclass(frozen=True)
class _StaticPlan:
    parents: torch.Tensor  # [num_nodes] int64
    depths: torch.Tensor  # [num_nodes] int64
    levels: tuple[_StaticLevel, ...]


_PLANS: dict[tuple[StaticTreeShape, torch.device], _StaticPlan] = {}


def _static_plan(shape: StaticTreeShape, device: torch.device) -> _StaticPlan:
    """The shape's node layout and per-level indices, made once per device (so growing a
    static tree copies nothing from the host)."""
    key = (shape, device)
    if key in _PLANS:
        return _PLANS[key]
    paths = [(), *shape.choices]  # node index -> path; the root is ()
    index = {p: i for i, p in enumerate(paths)}
    parents = [0] + [index[p[:-1]] for p in paths[1:]]
    depths = [len(p) for p in paths]
    has_children = set(parents[1:])

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    levels = []
    expanded = [0]
    prev_row = {0: 0}  # node -> its row in the previous call
    for depth in range(shape.depth):
        row_of = {v: r for r, v in enumerate(expanded)}
        children = [i for i in range(1, len(paths)) if depths[i] == depth + 1]
        child_rows = [row_of[parents[i]] for i in children]
        ranks = [paths[i][-1] for i in children]
        levels.append(
            _StaticLevel(
                expanded=tensor(expanded),
                parent_rows=tensor([prev_row[parents[v]] for v in expanded]),
                children=tensor(children),
                child_rows=tensor(child_rows),
                ranks=tensor(ranks),
                width=max(ranks) + 1,
                expanded_span=_span(expanded),
                children_span=_span(children),
                one_child_each=child_rows == list(range(len(expanded))) and not any(ranks),
            )
        )
        prev_row = row_of
        expanded = [i for i in children if i in has_children]
        if not expanded:
            break
    plan = _StaticPlan(tensor(parents), tensor(depths), tuple(levels))
    _PLANS[key] = plan
    return plan


def _span(nodes: list[int]) -> slice | None:
    """``nodes`` as a slice when they are consecutive."""
    return slice(nodes[0], nodes[-1] + 1) if nodes == list(range(nodes[0], nodes[-1] + 1)) else None


def _build_static(
    shape: StaticTreeShape,
    roots: torch.Tensor,  # [batch] int64
    fn: BatchStepLogprobsFn,
    sample: bool,
    generator: torch.Generator | None,
    token_map: torch.Tensor | None,
) -> TreeBatch:
    device = roots.device
    batch = roots.shape[0]
    plan = _static_plan(shape, device)
    num_nodes = plan.parents.shape[0]
    token_ids = torch.empty(batch, num_nodes, dtype=torch.int64, device=device)
    token_ids[:, 0] = roots
    draft_probs: torch.Tensor | None = None
    for depth, level in enumerate(plan.levels):
        n = level.expanded.shape[0]
        span = level.expanded_span
        nodes = token_ids[:, span] if span is not None else token_ids[:, level.expanded]
        args = (fn, nodes, level.parent_rows.expand(batch, n), depth)
        if sample:
            probs = _level_logprobs(*args).exp()  # [batch, n, vocab]
            # Exponential race: sorting p / Exp(1) gives successive draws without replacement.
            race = torch.empty_like(probs).exponential_(generator=generator)
            ranked = chunked_topk(probs / race, level.width)[1]  # [batch, n, width]
            if draft_probs is None:
                draft_probs = torch.zeros(batch, num_nodes, probs.shape[2], device=device)
            draft_probs[:, level.children] = probs[:, level.child_rows]
        else:
            # Ranks within a row need no normalisation; one rank per node (chains) is an
            # argmax, a fraction of a top-k's cost over a whole vocabulary on the GPU.
            scores = _level_scores(*args)  # [batch, n, vocab]
            if level.width == 1:
                ranked = scores.argmax(dim=-1, keepdim=True)  # [batch, n, 1]
            else:
                ranked = chunked_topk(scores, level.width)[1]  # [batch, n, width]
        if level.one_child_each:
            chosen = ranked[:, :, 0]  # [batch, n] columns
        else:
            chosen = ranked[:, level.child_rows, level.ranks]  # [batch, m] columns
        ids = token_map[chosen] if token_map is not None else chosen
        if level.children_span is not None:
            token_ids[:, level.children_span] = ids
        else:
            token_ids[:, level.children] = ids
    return TreeBatch(
        token_ids=token_ids,
        parents=plan.parents.expand(batch, num_nodes),
        depths=plan.depths.expand(batch, num_nodes),
        draft_probs=draft_probs,
        sampled=sample,
    )


def _tokens(columns: torch.Tensor, token_map: torch.Tensor | None) -> torch.Tensor:
    """Target ids of ranked columns (a sub-vocabulary's through ``token_map``)."""
    return token_map[columns] if token_map is not None else columns


def _build_dynamic(
    shape: DynamicTreeShape,
    roots: torch.Tensor,
    fn: BatchStepLogprobsFn,
    token_map: torch.Tensor | None,
    level_topk: LevelTopK,
) -> TreeBatch:
    """EAGLE-2. A node's score is its cumulative draft log-probability (sum over its path).

    Grow: the root gets its top_k tokens as children (the depth-1 frontier); at each
    further level every frontier node gets its top_k tokens as candidates, and the top_k
    candidates by score become the next frontier. Rerank: keep the ``total_tokens`` best
    candidates of all levels by score, renumbered in candidate order.

    Why a kept node's parent is always kept: a child's score is its parent's plus a
    log-probability <= 0, so never larger (float addition of a non-positive number cannot
    increase a value); candidates are numbered level by level, so a parent's number is
    smaller, and a stable descending sort puts it before the child on ties. The kept set
    is a prefix of that order, hence closed under taking parents; renumbering in candidate
    order keeps parents before children.

    Every tensor carries the batch in front; trees never interact.
    """
    device = roots.device
    batch, k = roots.shape[0], shape.top_k
    plan = _dynamic_plan(shape, device)
    scores: list[torch.Tensor] = []  # per level: [batch, m] cumulative log-probs
    tokens: list[torch.Tensor] = []  # per level: [batch, m] int64
    # Per expanded level (depth 1 .. depth - 1): the [batch, k] candidate columns of its
    # frontier. Depth 1's frontier is all of its candidates.
    frontiers: list[torch.Tensor] = [plan.first_frontier.expand(batch, k)]

    zeros = plan.zeros.expand(batch, 1)  # [batch, 1]
    root_scores = _level_scores(fn, roots[:, None], zeros, 0)  # [batch, 1, vocab]
    frontier_scores, top = level_topk(root_scores[:, 0], k)  # [batch, k] each: log-probs
    frontier_tokens = _tokens(top, token_map)  # [batch, k]
    scores.append(frontier_scores)
    tokens.append(frontier_tokens)
    frontier_rows = zeros.expand(batch, k)  # [batch, k]: rows in the last call

    for depth in range(1, shape.depth):
        level = _level_scores(fn, frontier_tokens, frontier_rows, depth)  # [batch, k, V]
        values, top = level_topk(level, k)  # [batch, k, k] each: log-probs, columns
        cand_scores = (frontier_scores[:, :, None] + values).flatten(1)  # [batch, k*k]
        cand_tokens = _tokens(top, token_map).flatten(1)  # [batch, k*k]
        scores.append(cand_scores)
        tokens.append(cand_tokens)
        # Any k best make a valid frontier (ties in any order); a top-k over k * k values
        # is one short kernel where a stable sort was a radix sort (~8 µs on the H200).
        best = cand_scores.topk(k, dim=-1).indices  # [batch, k]
        if depth + 1 < shape.depth:  # the last level is never expanded
            frontiers.append(best)
        frontier_scores = cand_scores.gather(1, best)  # [batch, k]
        frontier_tokens = cand_tokens.gather(1, best)
        frontier_rows = best // k

    all_scores = torch.cat(scores, dim=1)  # [batch, num_candidates]; id = column + 1
    order = all_scores.sort(dim=-1, descending=True, stable=True).indices
    kept = order[:, : shape.total_tokens].sort(dim=-1).values  # [batch, total]: columns
    # Every candidate's parent id: the root (0) at depth 1; below, the id of the frontier
    # node its row expanded (depth d's candidate ids start at ``plan.first_id[d - 1]``).
    parent_ids = zeros.expand(batch, k)
    if shape.depth > 1:
        frontier_ids = torch.stack(frontiers, dim=1) + plan.first_id  # [batch, D - 1, k]
        below = frontier_ids[:, :, plan.cand_parent_row].flatten(1)  # [batch, (D-1) * k * k]
        parent_ids = torch.cat([parent_ids, below], dim=1)  # [batch, num_candidates]
    # new_index[b, candidate id] = node index in tree b (the root stays 0).
    new_index = torch.zeros(batch, shape.num_candidates + 1, dtype=torch.int64, device=device)
    new_index.scatter_(1, kept + 1, plan.node_numbers.expand(batch, -1))
    parents = torch.cat([zeros, new_index.gather(1, parent_ids.gather(1, kept))], dim=1)
    depths = torch.cat([zeros, plan.candidate_depth[kept]], dim=1)  # [batch, total + 1]
    token_ids = torch.cat([roots[:, None], torch.cat(tokens, dim=1).gather(1, kept)], dim=1)
    return TreeBatch(token_ids=token_ids, parents=parents, depths=depths)


@dataclass(frozen=True)
class _DynamicPlan:
    """Index constants of a dynamic shape (made once per device, like ``_StaticPlan``).
    Candidate ids: 0 is the root, then depth 1's k candidates, then k * k per level."""

    zeros: torch.Tensor  # [1, 1] int64
    first_frontier: torch.Tensor  # [1, k]: depth 1's frontier columns, 0 .. k - 1
    cand_parent_row: torch.Tensor  # [k * k]: the frontier row each candidate hangs below
    first_id: torch.Tensor  # [depth - 1, 1]: candidate id of column 0 at depth 1 .. depth-1
    node_numbers: torch.Tensor  # [1, total_tokens]: 1 .. total_tokens
    candidate_depth: torch.Tensor  # [num_candidates]: each candidate column's depth


_DYNAMIC_PLANS: dict[tuple[DynamicTreeShape, torch.device], _DynamicPlan] = {}


def _dynamic_plan(shape: DynamicTreeShape, device: torch.device) -> _DynamicPlan:
    key = (shape, device)
    if key not in _DYNAMIC_PLANS:
        k, depth = shape.top_k, shape.depth

        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        _DYNAMIC_PLANS[key] = _DynamicPlan(
            zeros=tensor([[0]]),
            first_frontier=tensor([list(range(k))]),
            cand_parent_row=tensor([c // k for c in range(k * k)]),
            first_id=tensor([[1]] + [[1 + k + (d - 2) * k * k] for d in range(2, depth)]),
            node_numbers=tensor([list(range(1, shape.total_tokens + 1))]),
            candidate_depth=tensor(
                [1] * k + [d for d in range(2, depth + 1) for _ in range(k * k)]
            ),
        )
    return _DYNAMIC_PLANS[key]
