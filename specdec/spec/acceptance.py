"""Acceptance: which draft tokens the target keeps, and what one verification step emits.

Vocabulary (used everywhere in specdec):

- **accepted** tokens: draft tokens the target keeps. They form one path down the draft
  tree from the root (the request's last committed token, itself never a draft token).
- **bonus** token: the one token every step emits after its accepted tokens, drawn from
  the target at the last accepted node (the root when nothing was accepted), so a step
  emits ``num_accepted + 1`` tokens. When that node has children and all were rejected,
  the bonus is drawn from the *residual* distribution left by the rejections and is also
  called the **recovered** token; at a leaf it is drawn from the full target.

Greedy rows (``greedy_accept``, ``greedy_accept_batch``) accept a child iff its token is
the target's argmax at its parent; the bonus is the argmax at the last accepted node. The
emitted tokens are exactly what plain greedy decoding would produce (ties to the lowest
id, as ``torch.argmax``).

Random rows (``sample_accept``, ``sample_accept_batch``) use recursive rejection
sampling against the *filtered target distribution* p of
``specdec.sampling.sampler.probs_from_logits`` (temperature, top-k, top-p, min-p), so
speculation reproduces plain sampling exactly.

Why ``sample_accept`` is lossless. (1) One draft: x ~ q, accept with probability
min(1, p(x)/q(x)), otherwise emit a draw from r = max(p - q, 0) / Z. Rejection has
probability Z = sum(max(p - q, 0)), so P(emit y) = min(p(y), q(y)) + max(p(y) - q(y), 0)
= p(y). (2) Several siblings: after rejecting one, the remaining siblings play the same
game against r instead of p; by induction they emit a draw from r, which is all (1)
needed. That requires each next sibling to be distributed, given everything seen so far,
as the q it is tested with: for siblings drawn without replacement that is q with the
rejected tokens removed and renormalised; for deterministic candidates (fixed before any
target coin is tossed) q is their one-hot, so acceptance has probability p(x) and the
residual is p with x zeroed. (3) Depth: accepting child c moves to c, whose subtree was
built from c's context alone and whose coins are fresh, so the same argument applies with
the target at c. Hence every emitted token, given the tokens before it, is distributed as
the filtered target at that context, exactly as in plain token-by-token sampling (and the
next step continues from there the same way).

Pure functions, no module state. Every batch function returns one ``Acceptance``
(specdec.ops.accept) for the whole batch. Greedy acceptance runs on the device and never
syncs (the caller reads it with ``Acceptance.tolist``); sampled acceptance lays the trees
back to back (global node ids) and syncs twice per batch, not per request: once to read
the trees' structure and once to read the coins' outcomes; the walks down the trees then
run on the host, and its ``Acceptance`` holds host tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.device.staging import to_device
from specdec.ops.accept import Acceptance, AcceptedRow, greedy_accept_argmax
from specdec.sampling.sampler import SamplingMetadata, probs_from_logits
from specdec.sampling.seeded_stream import SeededStream, keys_tensor, row_exponentials, uniforms
from specdec.spec.tree import DraftTree, cat_on

# Divisor floor: Exp(1) draws of exactly 0 (as in the sampler) and emptied distributions.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class _Layout:
    """A batch of trees back to back: tree b owns global node ids ``offsets[b] ...
    offsets[b + 1] - 1``, its root first. Host lists; ``children`` in sibling order."""

    offsets: list[int]  # [B + 1]
    parents: torch.Tensor  # [total_nodes] int64 global; a root is its own parent
    parent_list: list[int]  # the same on the host
    token_ids: torch.Tensor  # [total_nodes] int64
    children: list[list[int]]  # per global node

    @property
    def num_nodes(self) -> int:
        return self.offsets[-1]

    def walk(self, b: int, accepts: Sequence[int]) -> list[int]:
        """Tree b's accepted path: from the root, move to the first accepted child until
        a node has none. ``accepts[c]`` (global node id) is truthy when c passes its test."""
        path: list[int] = []
        v = self.offsets[b]
        while (c := next((c for c in self.children[v] if accepts[c]), None)) is not None:
            path.append(c)
            v = c
        return path


def _layout(trees: list[DraftTree], rows: torch.Tensor, name: str) -> _Layout:
    """Concatenate ``trees`` and read their structure on the host (one sync)."""
    if not trees:
        raise ValueError("no trees; pass at least one DraftTree")
    offsets = [0]
    for t in trees:
        offsets.append(offsets[-1] + t.num_nodes)
    if rows.dim() != 2 or rows.shape[0] != offsets[-1]:
        raise ValueError(
            f"{name} has shape {tuple(rows.shape)}; expected [{offsets[-1]}, vocab] (one row "
            "per tree node, trees back to back, each root first in node order)"
        )
    device = rows.device
    shift = np.repeat(offsets[:-1], [t.num_nodes for t in trees])  # each node's tree start
    # Trees may live on the host (ngram, root-only) or on the proposer's device.
    local = cat_on(device, [t.parents for t in trees])  # [total]
    parents = local + to_device(shift, device)
    parent_list = parents.tolist()  # sync: structure
    children: list[list[int]] = [[] for _ in parent_list]
    for i, p in enumerate(parent_list):
        if p != i:
            children[p].append(i)
    return _Layout(
        offsets=offsets,
        parents=parents,
        parent_list=parent_list,
        token_ids=cat_on(device, [t.token_ids for t in trees]),
        children=children,
    )


def greedy_accept(
    tree: DraftTree,
    target_logits: torch.Tensor,  # [num_nodes, vocab]
) -> AcceptedRow:
    """``greedy_accept_batch`` for one tree, read on the host."""
    return greedy_accept_batch([tree], target_logits).tolist()[0]


def greedy_accept_batch(
    trees: list[DraftTree],
    target_logits: torch.Tensor,  # [total_nodes, vocab], trees back to back
    width: int | None = None,
) -> Acceptance:
    """From each root, repeatedly accept the child whose token is the target's argmax at
    the current node (siblings carry distinct tokens, so there is at most one); stop where
    none is, and emit the argmax there as the bonus token. This is the longest accepted
    path.

    Device ops only (no sync): each tree is padded to ``width`` nodes (default: the
    largest tree's), its padding nodes carrying token -1 under the root so they never
    pass, and ``greedy_accept_argmax`` runs on the padded batch. Rows are as wide as
    ``width``: no tree of that many nodes is deeper than ``width - 1``.
    """
    if not trees:
        raise ValueError("no trees; pass at least one DraftTree")
    counts = np.array([t.num_nodes for t in trees], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    total = int(offsets[-1])
    if target_logits.dim() != 2 or target_logits.shape[0] != total:
        raise ValueError(
            f"target_logits has shape {tuple(target_logits.shape)}; expected [{total}, vocab] "
            "(one row per tree node, trees back to back, each root first in node order)"
        )
    width = int(counts.max()) if width is None else width
    if width < counts.max():
        raise ValueError(f"width={width} is below the largest tree's {counts.max()} nodes")
    device = target_logits.device
    column = np.arange(width)
    real = column[None, :] < counts[:, None]  # [B, width]
    # Each padded node reads its tree's root row, so every index is in range.
    index = np.where(real, offsets[:-1, None] + column, offsets[:-1, None])  # [B, width]
    packed = to_device(np.stack([index, real]), device)  # one copy
    index_t, real_t = packed[0], packed[1].bool()
    # Trees may live on the host (ngram, root-only) or on the proposer's device.
    tokens = cat_on(device, [t.token_ids for t in trees])[index_t]
    tokens = torch.where(real_t, tokens, -1)  # padding never matches an argmax
    parents = torch.where(real_t, cat_on(device, [t.parents for t in trees])[index_t], 0)
    depths = torch.where(real_t, cat_on(device, [t.depths for t in trees])[index_t], 0)
    best = target_logits.argmax(dim=-1)[index_t]  # [B, width]
    return greedy_accept_argmax(tokens, parents, depths, best, width - 1)


def _host_acceptance(
    layout: _Layout, paths: list[list[int]], token_ids: list[list[int]], width: int
) -> Acceptance:
    """An ``Acceptance`` on the host from each tree's accepted ``paths`` (global node
    ids) and emitted ``token_ids``, padded as ``Acceptance`` says (node 0, token 0)."""
    batch = len(paths)
    path = np.zeros((batch, width), dtype=np.int64)
    tokens = np.zeros((batch, width), dtype=np.int64)
    for b, (nodes, emitted) in enumerate(zip(paths, token_ids, strict=True)):
        path[b, 1 : len(nodes) + 1] = [c - layout.offsets[b] for c in nodes]
        tokens[b, : len(emitted)] = emitted
    num_accepted = np.array([len(nodes) for nodes in paths], dtype=np.int64)
    return Acceptance(
        num_accepted=torch.from_numpy(num_accepted),
        path=torch.from_numpy(path),
        token_ids=torch.from_numpy(tokens),
    )


def _deterministic_tables(
    layout: _Layout,
    target_probs: torch.Tensor,  # [total_nodes, vocab] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance probabilities and residuals for one-hot drafts, in closed form.

    Returns ``accept_prob [total_nodes]`` (entry c: probability of accepting child c once
    its earlier siblings were rejected; 0 at roots) and ``residual [total_nodes, vocab]``
    (row v: the target at v after all of v's children were rejected; the target itself
    at a leaf). Rejecting candidates x_1 .. x_{j-1} zeroes them and renormalises, so x_j
    is accepted with probability p(x_j) / (1 - sum_{i<j} p(x_i)), and the residual after
    all children is p with every child's token zeroed, renormalised once.
    """
    device = target_probs.device
    order: list[int] = []  # non-root nodes grouped by parent, siblings in order
    group_start: list[int] = []  # position in ``order`` where each node's group starts
    for kids in layout.children:
        group_start += [len(order)] * len(kids)
        order += kids
    accept_prob = torch.zeros(layout.num_nodes, device=device)
    if not order:
        return accept_prob, target_probs
    order_t = torch.tensor(order, dtype=torch.int64, device=device)  # [num_children]
    start_t = torch.tensor(group_start, dtype=torch.int64, device=device)
    parent_t, token_t = layout.parents[order_t], layout.token_ids[order_t]
    px = target_probs[parent_t, token_t].double()  # [num_children]
    # float64: prefix sums run over the whole batch before the group's start is subtracted.
    before_all = px.cumsum(0) - px  # exclusive prefix over all groups
    before = before_all - before_all[start_t]  # exclusive prefix within the sibling group
    accept_prob[order_t] = (px / (1.0 - before).clamp_min(_TINY)).clamp(max=1.0).float()

    residual = target_probs.index_put((parent_t, token_t), torch.zeros((), device=device))
    mass = residual.sum(dim=-1, keepdim=True)  # [total_nodes, 1]
    # mass == 0: the candidates held all the mass, so rejecting them all had probability 0.
    residual = torch.where(mass > 0, residual / mass.clamp_min(_TINY), target_probs)
    return accept_prob, residual


def _apply_sampled_tables(
    layout: _Layout,
    trees: list[DraftTree],
    target_probs: torch.Tensor,  # [total_nodes, vocab] float32
    accept_prob: torch.Tensor,  # [total_nodes], overwritten for sampled trees' children
    residual: torch.Tensor,  # [total_nodes, vocab], overwritten for their parents
) -> None:
    """Recursive rejection sampling tables for the sampled trees' nodes (same meaning as
    ``_deterministic_tables``). Siblings are processed rank by rank, every parent with
    that many children at once: test x ~ q against the residual r, then r <- normalise(
    max(r - q, 0)) and q <- q without x, renormalised (draws were without replacement)."""
    parents: list[int] = []  # one slot per sampled node that has children
    first_child_rows: list[int] = []  # its first child's row in ``drafts``
    drafts: list[torch.Tensor] = []
    base = 0  # rows of ``drafts`` so far
    for b, tree in enumerate(trees):
        if not tree.sampled:
            continue
        assert tree.draft_probs is not None
        start = layout.offsets[b]
        for v in range(start, layout.offsets[b + 1]):
            if layout.children[v]:
                parents.append(v)
                first_child_rows.append(base + layout.children[v][0] - start)
        drafts.append(tree.draft_probs)
        base += tree.num_nodes
    if not parents:
        return
    r = target_probs[parents]  # [num_slots, vocab] residual per slot
    # [num_slots, vocab] draft per slot: the distribution its children were drawn from
    q = torch.cat(drafts).to(r.device)[first_child_rows].float()
    for rank in range(max(len(layout.children[v]) for v in parents)):
        slots = [s for s, v in enumerate(parents) if len(layout.children[v]) > rank]
        kids = [layout.children[parents[s]][rank] for s in slots]
        x = layout.token_ids[kids][:, None]  # [m, 1]
        r_m, q_m = r[slots], q[slots]  # [m, vocab]
        px, qx = r_m.gather(-1, x), q_m.gather(-1, x)  # [m, 1]
        # qx == 0 only when earlier draws used up the draft's support: no real draw, skip.
        drawn = qx > 0
        ratio = (px / qx.clamp_min(_TINY)).clamp(max=1.0)  # [m, 1]
        accept_prob[kids] = torch.where(drawn, ratio, 0.0).squeeze(-1)
        left = (r_m - q_m).clamp_min(0.0)
        mass = left.sum(dim=-1, keepdim=True)  # [m, 1]
        # mass == 0 means rejection had probability 0; any distribution will do then.
        r[slots] = torch.where(drawn & (mass > 0), left / mass.clamp_min(_TINY), r_m)
        q_m = q_m.scatter(-1, x, 0.0)
        q[slots] = q_m / q_m.sum(dim=-1, keepdim=True).clamp_min(_TINY)
    residual[parents] = r


def sample_accept(
    tree: DraftTree,
    target_probs: torch.Tensor,  # [num_nodes, vocab] float32, rows sum to 1
    stream: SeededStream | None = None,
    generator: torch.Generator | None = None,
) -> AcceptedRow:
    """``sample_accept_batch`` for one tree, drawing from ``stream`` if given, else from
    ``generator`` (torch's default RNG if None)."""
    return sample_accept_batch([tree], target_probs, [stream], generator).tolist()[0]


def sample_accept_batch(
    trees: list[DraftTree],
    target_probs: torch.Tensor,  # [total_nodes, vocab] float32, trees back to back
    streams: list[SeededStream | None],
    generator: torch.Generator | None = None,
    width: int | None = None,
) -> Acceptance:
    """Lossless recursive rejection sampling of every tree (see the module docstring),
    as host tensors ``width`` wide (default: the largest tree's node count).

    ``target_probs`` row of node v must be the filtered target distribution at v's
    context (``probs_from_logits`` of its verify row). From the root, children are tried
    in sibling order; accepting one moves to it; when a node's children are all rejected,
    or it has none, the bonus token is drawn from its residual and the tree is done.

    Randomness: each tree uses one uniform coin per node and one Exp(1) per vocabulary
    entry. Tree b draws them (two keys: coins, then race) from ``streams[b]`` when it is
    not None, so a seeded request's tokens do not depend on the rest of the batch; the
    other trees share one batched draw from ``generator`` (torch's default RNG if None).
    """
    if len(streams) != len(trees):
        raise ValueError(
            f"got {len(streams)} streams for {len(trees)} trees; pass one per tree "
            "(None to draw from the batch generator)"
        )
    layout = _layout(trees, target_probs, "target_probs")
    target_probs = target_probs.float()
    accept_prob, residual = _deterministic_tables(layout, target_probs)
    if any(t.sampled for t in trees):
        _apply_sampled_tables(layout, trees, target_probs, accept_prob, residual)

    device, vocab = target_probs.device, target_probs.shape[1]
    coins = torch.empty(layout.num_nodes, device=device)  # [total_nodes]
    race = torch.empty(len(trees), vocab, device=device)  # [B, vocab]
    if any(g is None for g in streams):
        coins.uniform_(generator=generator)
        race.exponential_(generator=generator)
    seeded = [b for b, g in enumerate(streams) if g is not None]
    if seeded:
        _seeded_draws(layout, [streams[b] for b in seeded], seeded, coins, race)
    counts = torch.tensor([t.num_nodes for t in trees], device=device)
    race = race.clamp_min(_TINY).repeat_interleave(counts, dim=0, output_size=layout.num_nodes)
    # Exponential race: argmax r / E is a draw from r. Every node of a tree shares the
    # tree's race, which is fine: only the node where the walk stops uses its draw.
    bonus = (residual / race).argmax(dim=-1)  # [total_nodes]
    accepts_t = coins < accept_prob  # [total_nodes]; always False at roots
    accepts, bonus_h, tokens_h = torch.stack(
        [accepts_t.long(), bonus, layout.token_ids]
    ).tolist()  # sync: outcomes
    paths, emitted = [], []
    for b in range(len(trees)):
        path = layout.walk(b, accepts)
        last = path[-1] if path else layout.offsets[b]
        paths.append(path)
        emitted.append([tokens_h[c] for c in path] + [bonus_h[last]])
    width = max(t.num_nodes for t in trees) if width is None else width
    return _host_acceptance(layout, paths, emitted, width)


def _seeded_draws(
    layout: _Layout,
    streams: list[SeededStream],
    trees_b: list[int],  # the seeded trees' indices
    coins: torch.Tensor,  # [total_nodes] float32, written at the seeded trees' nodes
    race: torch.Tensor,  # [B, vocab] float32, written at the seeded trees' rows
) -> None:
    """Every seeded tree's coins (one per node) and race (one Exp(1) per vocabulary entry)
    from its stream's next two keys, all trees in one device op each."""
    device = coins.device
    keys = keys_tensor([k for s in streams for k in (s, s)], device).view(-1, 2)  # [n, 2]
    # Per seeded node: its global index, its index in its tree, its tree's row in `keys`.
    nodes, local, owner = [], [], []
    for j, b in enumerate(trees_b):
        lo, hi = layout.offsets[b], layout.offsets[b + 1]
        nodes += range(lo, hi)
        local += range(hi - lo)
        owner += [j] * (hi - lo)
    packed = to_device(np.array(nodes + local + owner + trees_b, dtype=np.int64), device)
    nodes_t, local_t, owner_t, rows = packed.split([len(nodes)] * 3 + [len(trees_b)])  # one copy
    coins.index_copy_(0, nodes_t, uniforms(keys[owner_t, 0], local_t))
    race.index_copy_(0, rows, row_exponentials(keys[:, 1], race.shape[1]))


def accept_batch(
    trees: list[DraftTree],
    target_logits: torch.Tensor,  # [total_nodes, vocab] float32, trees back to back
    meta: SamplingMetadata,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Acceptance for one step's batch: row b of ``meta`` samples tree b.

    ``target_logits`` holds the raw verify logits of tree 0's nodes, then tree 1's, ...
    (node order, tree after tree). Greedy rows go to
    ``greedy_accept_batch`` on the raw logits; random rows to ``sample_accept_batch`` on
    ``probs_from_logits`` of their nodes (one batched call), with the row's stream when
    seeded and ``generator`` (the engine's batch RNG) otherwise, as the sampler does.
    Host syncs: the greedy mask of a mixed batch, plus those of the two batch functions.
    The result is as wide as the largest tree; a mixed batch's is on the logits' device,
    an all-random one's on the host.
    """
    if meta.num_rows != len(trees):
        raise ValueError(
            f"sampling metadata has {meta.num_rows} rows for {len(trees)} trees; build it "
            "with one row per request"
        )
    counts = [t.num_nodes for t in trees]
    if target_logits.dim() != 2 or target_logits.shape[0] != sum(counts):
        raise ValueError(
            f"target_logits has shape {tuple(target_logits.shape)}; expected "
            f"[{sum(counts)}, vocab] (every tree's nodes back to back, in tree order)"
        )
    if meta.all_greedy:
        return greedy_accept_batch(trees, target_logits)
    if meta.all_random:
        probs = probs_from_logits(target_logits, _per_node(meta, counts))  # [total, vocab]
        return sample_accept_batch(trees, probs, meta.streams, generator)

    greedy = meta.greedy.tolist()  # sync
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    device, width, batch = target_logits.device, max(counts), len(trees)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    path = torch.zeros(batch, width, dtype=torch.int64, device=device)
    token_ids = torch.zeros(batch, width, dtype=torch.int64, device=device)
    for flag in (True, False):
        rows_b = [b for b in range(batch) if greedy[b] == flag]
        index = torch.tensor(
            [i for b in rows_b for i in range(offsets[b], offsets[b + 1])], device=device
        )
        logits = target_logits[index]  # [group_nodes, vocab]
        group_trees = [trees[b] for b in rows_b]
        if flag:
            part = greedy_accept_batch(group_trees, logits, width)
        else:
            group_meta = _select_rows(meta, rows_b)
            probs = probs_from_logits(logits, _per_node(group_meta, [counts[b] for b in rows_b]))
            part = sample_accept_batch(group_trees, probs, group_meta.streams, generator, width)
            part = part.to(device)
        rows_t = torch.tensor(rows_b, device=device)
        num_accepted[rows_t] = part.num_accepted
        path[rows_t] = part.path
        token_ids[rows_t] = part.token_ids
    return Acceptance(num_accepted=num_accepted, path=path, token_ids=token_ids)


def _take_rows(meta: SamplingMetadata, index: torch.Tensor, **flags) -> SamplingMetadata:
    """``meta``'s per-row tensors gathered at ``index``; ``flags`` replace fields whose
    value the gather changes (host flags, streams)."""
    return dataclasses.replace(
        meta,
        temperature=meta.temperature[index],
        top_k=meta.top_k[index],
        top_p=meta.top_p[index],
        min_p=meta.min_p[index],
        greedy=meta.greedy[index],
        **flags,
    )


def _select_rows(meta: SamplingMetadata, rows: list[int]) -> SamplingMetadata:
    """Rows ``rows`` (all random) of ``meta``. The no_* host flags are kept: for a subset
    they can only over-state the filtering work (a filter run with every row disabled),
    never skip needed work; recomputing them exactly would need a sync."""
    index = torch.tensor(rows, device=meta.temperature.device)
    return _take_rows(
        meta,
        index,
        all_greedy=False,
        all_random=True,
        streams=[meta.streams[b] for b in rows],
    )


def _per_node(meta: SamplingMetadata, counts: list[int]) -> SamplingMetadata:
    """``meta`` with row b repeated ``counts[b]`` times: every node samples like its
    request. Host flags stay exact because repeating rows changes no summary."""
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(
        meta.temperature.device
    )  # [total_nodes]
    return _take_rows(
        meta,
        index,
        streams=[g for g, n in zip(meta.streams, counts, strict=True) for _ in range(n)],
        max_num_logprobs=None,
    )
