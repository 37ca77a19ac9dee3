"""Draft-tree verification attention: mask builder, reference and Triton kernel agree.

The chain of evidence: the mask builder equals a Python walk up the parent pointers; the
reference equals a brute force that runs every root-to-node path as an ordinary causal
sequence (so the reference's mask means "see the context and your ancestors"); the Triton
kernel equals the reference on ragged batches mixing trees, decodes and prefill chunks.

Besides the poison that ``make_case`` puts wherever a sequence has no context, each tree
gets one random non-root node whose whole subtree has poisoned values: every query outside
that subtree must never read those keys, and one leaked key moves its output by ~60 x its
softmax weight, orders of magnitude beyond the 1e-5 tolerance.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_kernels import DEVICE, POISON, TOL, Case, gpu_only, make_case

from specdec.attention.custom_op import OpaqueAttention
from specdec.attention.torch_backend import TorchAttentionBackend, paged_attention_batched_ref
from specdec.attention.tree_mask import (
    ancestor_closure,
    build_tree_mask,
    check_parents,
)
from specdec.attention.triton_backend import TritonAttentionBackend
from specdec.kernels import PrefillConfig, paged_attention, paged_attention_ref
from specdec.models.rope import RopeParams, RotaryEmbedding
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.paged_attention import gather_context
from specdec.ops.rope import apply_rotary


def random_parents(rng: random.Random, t: int) -> list[int]:
    """A random tree in node order: each node's parent is any earlier node."""
    return [0] + [rng.randrange(i) for i in range(1, t)]


def random_forest(rng: random.Random, t: int, roots: int) -> list[int]:
    """A draft step's forest: nodes ``0 .. roots-1`` are their own parents (the depth-1
    drafts below a root that is not in the tree), later nodes hang anywhere earlier."""
    return list(range(roots)) + [rng.randrange(i) for i in range(roots, t)]


def path_to_root(parents: list[int], node: int) -> list[int]:
    """Node indices from the (forest) root down to ``node``."""
    path = [node]
    while parents[path[-1]] != path[-1]:
        path.append(parents[path[-1]])
    return path[::-1]


def mask_py(parents: list[int]) -> list[list[bool]]:
    t = len(parents)
    rows = [set(path_to_root(parents, i)) for i in range(t)]
    return [[j in rows[i] for j in range(t)] for i in range(t)]


@dataclasses.dataclass
class TreeCase:
    case: Case  # meta carries the tree fields
    parents: list[list[int]]  # per real sequence; [] = no tree
    q_lens: list[int]
    seq_lens: list[int]


def make_tree_case(
    seqs: list[tuple[int, int, list[int]]],  # (q_len, seq_len, parents) per sequence
    *,
    group: int,
    head_dim: int = 64,
    block_size: int = 16,
    num_padded: int = 0,
    slack: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> TreeCase:
    """``make_case`` plus tree fields; each tree has one poisoned subtree (module doc).
    Padding sequences carry empty trees and ``max_tree_len`` is inflated by ``slack``."""
    q_lens = [q for q, _, _ in seqs]
    seq_lens = [s for _, s, _ in seqs]
    parents = [p for _, _, p in seqs]
    case = make_case(
        q_lens,
        seq_lens,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        num_padded=num_padded,
        slack=slack,
        dtype=dtype,
        seed=seed,
    )
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    table = case.meta.block_tables.cpu()
    flat_v = case.v_cache.view(-1, *case.v_cache.shape[2:])
    for s, (seq_len, par) in enumerate(zip(seq_lens, parents, strict=True)):
        if len(par) < 2:
            continue
        top = rng.randrange(1, len(par))
        for j in range(len(par)):
            if top in path_to_root(par, j):
                pos = seq_len - len(par) + j
                slot = int(table[s, pos // block_size]) * block_size + pos % block_size
                flat_v[slot] = POISON + torch.randn(flat_v.shape[1:], generator=gen).to(flat_v)
    case.v_new = flat_v[case.meta.slot_mapping].clone()

    all_parents = [torch.tensor(p, dtype=torch.int64, device=DEVICE) for p in parents]
    all_parents += [torch.zeros(0, dtype=torch.int64, device=DEVICE)] * num_padded
    trees = build_tree_mask(all_parents, max_tree_len=max(map(len, parents)) + slack)
    case.meta = trees.attach(case.meta)
    return TreeCase(case, parents, q_lens, seq_lens)


def mixed_batch(rng: random.Random, block_size: int) -> list[tuple[int, int, list[int]]]:
    """Decodes, a prefill chunk, trees of assorted shapes (the tree's first cache index on,
    just before and just after block boundaries) and draft steps (trees longer than the
    step's queries)."""
    bs = block_size
    t1, t2 = rng.randint(8, 24), rng.randint(6, 14)
    t_long = bs + 3  # spans a page boundary
    return [
        (1, 3 * bs + 1, []),  # plain decode
        (t1, 2 * bs + t1, random_parents(rng, t1)),  # tree starts on a boundary
        (25, bs + 25, []),  # prefill chunk on a boundary
        (t2 + 3, 2 * bs - 1 + t2 + 3, random_parents(rng, t2)),  # 3 new tokens before it
        (1, bs + 1, [0]),  # a lone root
        (t_long, t_long + 5, random_parents(rng, t_long)),
        (1, 2 * bs, []),
        (t2, bs + 1 + t2, random_parents(rng, t2)),
        # Draft steps: the queries are a forest's last nodes, its earlier levels cached.
        (3, 2 * bs + 9, random_forest(rng, 9, roots=3)),
        (4, bs + 2 + 12, random_forest(rng, 12, roots=4)),
        (1, 5 + 4, [0, 0, 1, 2]),  # a chain's next node
    ]


def brute_force(tc: TreeCase) -> torch.Tensor:  # [num_real_tokens, num_heads, head_dim]
    """Each query as the last token of an ordinary causal sequence: its context plus, for a
    tree node, the nodes on its root path. float64 softmax, no masks at all."""
    case = tc.case
    num_heads, num_kv_heads = case.q.shape[1], case.k_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = []
    start = 0
    for s, (q_len, seq_len, par) in enumerate(zip(tc.q_lens, tc.seq_lens, tc.parents, strict=True)):
        keys = gather_context(case.k_cache, case.meta.block_tables[s], seq_len).double()
        vals = gather_context(case.v_cache, case.meta.block_tables[s], seq_len).double()
        tree_lo = seq_len - len(par)
        for i in range(q_len):
            pos = seq_len - q_len + i
            if pos < tree_lo:
                idx = list(range(pos + 1))
            else:
                idx = list(range(tree_lo)) + [tree_lo + j for j in path_to_root(par, pos - tree_lo)]
            k = keys[idx].repeat_interleave(group, dim=1)  # [n, H, d]
            v = vals[idx].repeat_interleave(group, dim=1)
            q = case.q[start + i].double()  # [H, d]
            p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * case.scale, dim=-1)
            rows.append(torch.einsum("hn,nhd->hd", p, v).to(case.q.dtype))
        start += q_len
    return torch.stack(rows)


# --- the mask builder --------------------------------------------------------------------


def test_tree_mask_matches_python_reference():
    rng = random.Random(0)
    trees = [random_parents(rng, rng.randint(1, 40)) for _ in range(12)]
    trees += [[0, *range(63)], [0] * 30, [], [0]]  # deepest chain, star, none, lone root
    trees += [random_forest(rng, 24, roots=8), [0, 1, 2]]  # draft-step forests
    out = build_tree_mask([torch.tensor(p, dtype=torch.int64, device=DEVICE) for p in trees])

    assert out.tree_lens.dtype == torch.int32 and out.tree_mask_offsets.dtype == torch.int64
    assert out.tree_lens.tolist() == [len(p) for p in trees]
    assert out.max_tree_len == 64
    offset = 0
    for s, par in enumerate(trees):
        assert out.tree_mask_offsets[s] == offset
        got = out.tree_mask[offset : offset + len(par) ** 2].view(len(par), len(par))
        assert got.tolist() == mask_py(par), f"tree {s}: {par}"
        offset += len(par) ** 2
    assert out.tree_mask.shape == (offset,)


def test_ancestor_closure_on_padded_batch():
    """Padded nodes (parent 0) never enter a real node's row."""
    parents = torch.tensor([[0, 0, 1, 2, 3], [0, 0, 1, 0, 0]])  # chain; 3 nodes + 2 pads
    anc = ancestor_closure(parents)
    assert anc[0].tolist() == torch.ones(5, 5).tril().bool().tolist()
    assert anc[1, :3, :3].tolist() == mask_py([0, 0, 1])
    assert not anc[1, :3, 3:].any()


def test_ancestor_closure_bounded_by_depth_equals_the_full_closure():
    """With ``max_depth`` = the deepest node's depth the closure takes fewer rounds and is
    the same; a bound one short of it misses ancestors (the bound is not a no-op)."""
    rng = random.Random(5)
    short = 0
    for _ in range(20):
        n = rng.randint(2, 40)
        parents = random_parents(rng, n)
        depths = [0] * n
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        tree = torch.tensor([parents])
        full = ancestor_closure(tree)
        assert torch.equal(ancestor_closure(tree, max_depth=max(depths)), full)
        if max(depths) >= 3 and max(depths) - 1 in (2, 4, 8, 16):  # rounds drop by one
            assert not torch.equal(ancestor_closure(tree, max_depth=max(depths) - 1), full)
            short += 1
    assert short  # the negative case ran


def test_bad_parents_are_rejected():
    check_parents(torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="root's parent is 2"):
        check_parents(torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="node 2 has parent 2"):
        check_parents(torch.tensor([0, 0, 2]))
    with pytest.raises(ValueError, match="max_tree_len 2 < the largest tree"):
        build_tree_mask([torch.tensor([0, 0, 1])], max_tree_len=2)


def test_metadata_rejects_partial_tree_fields():
    case = make_case([2], [5], group=1)
    with pytest.raises(ValueError, match="tree fields come together"):
        dataclasses.replace(case.meta, tree_lens=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_tree_len 3 needs the tree tensors"):
        dataclasses.replace(case.meta, max_tree_len=3)


# --- reference semantics -----------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 3, 8])
def test_reference_equals_root_path_brute_force(group):
    rng = random.Random(group)
    tc = make_tree_case(mixed_batch(rng, 16), group=group, seed=group)
    case = tc.case

    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)

    torch.testing.assert_close(ref, brute_force(tc), **TOL)
    # The mask matters: plain causal attention differs on tree rows past a branch.
    plain = dataclasses.replace(
        case.meta, tree_lens=None, tree_mask_offsets=None, tree_mask=None, max_tree_len=0
    )
    causal = paged_attention_ref(case.q, case.k_cache, case.v_cache, plain, case.scale)
    assert (ref - causal).abs().max() > 1.0


@pytest.mark.parametrize(("num_padded", "slack"), [(0, 0), (2, 5)])
def test_batched_reference_equals_root_path_brute_force(num_padded, slack):
    """The CPU backend's padded one-call path (short-query batches: verify and draft steps)
    applies the same rule as the per-sequence loop: padded sequences, an inflated
    max_tree_len, draft-step forests and prefill chunks included."""
    rng = random.Random(7)
    tc = make_tree_case(mixed_batch(rng, 16), group=3, num_padded=num_padded, slack=slack)
    case = tc.case
    out = paged_attention_batched_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    n = sum(tc.q_lens)
    torch.testing.assert_close(out[:n], brute_force(tc), **TOL)
    plain = dataclasses.replace(
        case.meta, tree_lens=None, tree_mask_offsets=None, tree_mask=None, max_tree_len=0
    )
    causal = paged_attention_ref(case.q, case.k_cache, case.v_cache, plain, case.scale)
    batched = paged_attention_batched_ref(case.q, case.k_cache, case.v_cache, plain, case.scale)
    torch.testing.assert_close(batched, causal, **TOL)


# --- Triton kernel -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "head_dim", "block_size", "config"),
    [
        (1, 64, 16, None),
        (1, 128, 32, PrefillConfig(block_m=16, block_n=16)),  # many tiles straddle the tree
        (3, 64, 32, None),
        (3, 128, 16, PrefillConfig(block_m=32, block_n=32)),
        (8, 64, 16, PrefillConfig(block_m=16, block_n=16)),  # two tokens per tile
        (8, 128, 32, None),
    ],
)
def test_triton_tree_matches_reference(group, head_dim, block_size, config):
    rng = random.Random(group * 1000 + head_dim + block_size)
    tc = make_tree_case(
        mixed_batch(rng, block_size),
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        num_padded=2,
        slack=5,
        seed=rng.randint(0, 99),
    )
    case = tc.case

    out = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, config=config)

    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_triton_tree_split_k_matches_reference(num_splits):
    """Split-K keys (how small-batch verify steps run): splits that end inside the tree,
    start inside it, or hold it whole all merge to the reference."""
    rng = random.Random(num_splits)
    tc = make_tree_case(
        mixed_batch(rng, 16), group=3, num_padded=1, slack=5, seed=rng.randint(0, 99)
    )
    case = tc.case
    config = PrefillConfig(block_m=16, block_n=16)

    out = paged_attention(
        case.q, case.k_cache, case.v_cache, case.meta, case.scale, config=config,
        num_splits=num_splits,
    )  # fmt: skip

    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)


def test_chain_tree_equals_plain_causal_kernel():
    """A chain (each node's parent is the previous node) is an ordinary causal extend."""
    seqs = [(t, ctx + t, [0, *range(t - 1)]) for t, ctx in [(12, 40), (1, 7), (33, 32), (5, 0)]]
    seqs.append((20, 50, []))
    tc = make_tree_case(seqs, group=3, seed=4)
    case = tc.case
    plain = dataclasses.replace(
        case.meta, tree_lens=None, tree_mask_offsets=None, tree_mask=None, max_tree_len=0
    )
    config = PrefillConfig(block_m=16, block_n=16)

    out = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, config=config)

    causal = paged_attention(case.q, case.k_cache, case.v_cache, plain, case.scale, config=config)
    torch.testing.assert_close(out, causal, **TOL)


def test_all_empty_trees_equal_plain_causal_kernel():
    """Tree tensors present but every tree empty (speculation off): the causal result."""
    case = make_case([1, 9, 1], [30, 40, 17], group=3, seed=6)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    meta = build_tree_mask([empty] * 3, max_tree_len=4).attach(case.meta)
    assert meta.has_tree  # the bound says trees may come; the mask path runs

    out = paged_attention(case.q, case.k_cache, case.v_cache, meta, case.scale)

    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out, ref, **TOL)


# --- backends and the custom op ----------------------------------------------------------


def test_backends_and_custom_op_route_tree_batches():
    """Triton backend, torch backend and the custom op (both inners) agree on a tree batch
    and write the new tokens' K/V; single-node trees in an all-q_len-1 batch are not sent
    to the decode path."""
    rng = random.Random(9)
    tc = make_tree_case(mixed_batch(rng, 16), group=3, num_padded=1, seed=9)
    case = tc.case
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, *cache.shape[2:])[case.meta.slot_mapping] = POISON  # forward writes

    outs, caches = [], []
    calls = [b.forward for b in (TorchAttentionBackend(), TritonAttentionBackend())]
    for inner in ("torch", "triton"):  # eager calls skip the op; compiled code runs it
        calls += [OpaqueAttention(inner).forward, OpaqueAttention(inner).through_op]
    for call in calls:
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        outs.append(call(case.q, case.k_new, case.v_new, k_cache, v_cache, case.meta, case.scale))
        caches.append((k_cache, v_cache))

    k_written = caches[0][0].view(-1, *case.k_cache.shape[2:])[case.meta.slot_mapping]
    assert torch.equal(k_written, case.k_new)
    ref = paged_attention_ref(case.q, *caches[0], case.meta, case.scale)
    torch.testing.assert_close(outs[0], ref, **TOL)
    for out, (k_cache, v_cache) in zip(outs[1:], caches[1:], strict=True):
        torch.testing.assert_close(out, outs[0], **TOL)
        assert torch.equal(k_cache, caches[0][0]) and torch.equal(v_cache, caches[0][1])

    roots = make_tree_case([(1, 20, [0]), (1, 9, [])], group=3, seed=2).case.meta
    assert isinstance(roots, AttentionMetadata) and roots.max_query_len == 1
    assert not roots.is_decode_only


def test_rope_routes_through_backends_and_custom_op():
    """q and k before RoPE (``forward_rope``): every backend, and the custom op with the
    rotation passed in (what compiled code runs for a backend that fuses it), equal
    rotating first and calling ``forward``, output and cache."""
    rng = random.Random(4)
    case = make_tree_case(mixed_batch(rng, 12), group=3, num_padded=1, seed=4).case
    rotary = RotaryEmbedding(RopeParams(case.q.shape[2], 1e5, 4096), 2048).to(DEVICE)
    positions = torch.arange(case.q.shape[0], device=DEVICE) * 37 % 2048
    cos, sin = rotary(positions, case.q.dtype)
    rope_args = (case.q, case.k_new, case.v_new, cos, sin)

    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    q_rot, k_rot = apply_rotary(case.q, cos, sin), apply_rotary(case.k_new, cos, sin)
    ref = TorchAttentionBackend().forward(q_rot, k_rot, case.v_new, k_ref, v_ref, case.meta,
                                          case.scale)  # fmt: skip
    calls = [b.forward_rope for b in (TorchAttentionBackend(), TritonAttentionBackend())]
    for inner in ("torch", "triton"):
        opaque = OpaqueAttention(inner)
        calls.append(opaque.forward_rope)
        calls.append(
            lambda q, k, v, c, s, kc, vc, m, sc, o=opaque: o.through_op(
                q, k, v, kc, vc, m, sc, rope=(c, s)
            )
        )
    for call in calls:
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        out = call(*rope_args, k_cache, v_cache, case.meta, case.scale)
        torch.testing.assert_close(out, ref, **TOL)
        torch.testing.assert_close(k_cache, k_ref, **TOL)
        assert torch.equal(v_cache, v_ref)


# --- GPU only ----------------------------------------------------------------------------


@gpu_only
@pytest.mark.gpu
def test_bf16_tree_matches_fp32_reference():
    """Long contexts and 60-node trees, default tiles, bf16 against the fp32 reference."""
    rng = random.Random(12)
    seqs = [(t, rng.randint(500, 3000) + t, random_parents(rng, t)) for t in (60, 1, 33, 17)]
    seqs += [(1, 2900, []), (200, 1200, [])]
    tc = make_tree_case(seqs, group=3, num_padded=2, slack=8, dtype=torch.bfloat16, seed=12)
    case = tc.case

    out = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)

    ref = paged_attention_ref(
        case.q.float(), case.k_cache.float(), case.v_cache.float(), case.meta, case.scale
    )
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
