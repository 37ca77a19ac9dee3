"""The batch-invariant attention kernel: close to the float64 reference, and bitwise the same
output for a token whatever its kind and whatever shares the launch.

Every invariance test compares against an *oracle*: each sequence's outputs from one full
prefill of it alone. A launch is a list of ``Part``s, one per sequence: some context
already cached, then new rows (prefill tokens, a decode, a chain, or a draft tree whose
true path sits at node indices other than its depths, among fake siblings). Block ids are
shuffled per launch and every slot nothing wrote holds NaN, so a kernel that reads an
unwritten or padded slot without masking it produces NaN, which equals nothing.

Under the Triton interpreter bf16 is emulated (``_bf16_dots_in_the_interpreter``); the
structure that makes the kernel invariant (fixed tiles, logical-position blocks) is what
these tests pin down, and on CUDA they run on the compiled kernel.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from functools import partial
from itertools import accumulate

import pytest
import torch
from test_kernels import DEVICE, TOL, gpu_only
from test_tree_attention import make_tree_case, mixed_batch, path_to_root, random_forest

from specdec.attention.base import get_attention_backend
from specdec.attention.invariant_backend import InvariantTritonBackend
from specdec.attention.tree_mask import build_tree_mask
from specdec.attention.triton_backend import TritonAttentionBackend
from specdec.kernels.invariant_attention import (
    MIN_SPLIT_PROGRAMS,
    PROGRAMS_PER_SM,
    InvariantAttentionConfig,
    invariant_attention_ref,
    split_programs,
    tile_bound,
)
from specdec.kernels.invariant_attention import (
    invariant_paged_attention as _invariant_paged_attention,
)
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.paged_attention import paged_attention_ref
from specdec.ops.query_tiles import (
    FEW_ROWS,
    LONG_TREE_KEYS,
    MANY_ROWS,
    NEVER,
    query_tiles,
    shared_tree_from,
    with_query_tiles,
)
from specdec.ops.tree_paths import tree_paths, with_tree_paths

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 3, 3, 64, 16  # SmolLM2's heads: 9 / 3
# The default config on CUDA. The interpreter runs every program slowly, so there two
# splits keep the structure under test (splits of several blocks, empty splits, the
# merge) at an eighth of the default's programs.
CONFIG = (
    InvariantAttentionConfig() if DEVICE.type == "cuda" else InvariantAttentionConfig(num_splits=2)
)
BLOCK_N = CONFIG.block_n


def invariant_paged_attention(q, k_cache, v_cache, meta, scale):
    return _invariant_paged_attention(q, k_cache, v_cache, meta, scale, config=CONFIG)


@pytest.fixture(autouse=True)
def _backend_config(monkeypatch):
    """The backend's launches (``through_backend``) run ``CONFIG`` too."""
    monkeypatch.setattr(InvariantTritonBackend, "config", CONFIG)


@pytest.fixture(params=[0, 45], ids=["tree_tile4", "tree_tile_by_context"])
def tree_tile(request, monkeypatch) -> int:
    """Where trees start sharing query tiles, in launches of any size: every tree four rows
    a tile, or the trees starting at cache index 45 or later (the test sequences hold trees
    on both sides, short ones a row a tile)."""
    share_trees_from(monkeypatch, request.param)
    return request.param


def share_trees_from(monkeypatch, long_keys: int) -> None:
    """Every launch, whatever its rows, shares the tiles of trees from cache index
    ``long_keys`` (four rows a tile)."""
    monkeypatch.setattr("specdec.ops.query_tiles.TREE_TILE_TOKENS", 4)
    monkeypatch.setattr("specdec.ops.query_tiles.FEW_ROWS", 0)
    monkeypatch.setattr("specdec.ops.query_tiles.MANY_ROWS", 1 << 30)
    monkeypatch.setattr("specdec.ops.query_tiles.LONG_TREE_KEYS", long_keys)


@dataclass(frozen=True, eq=False)  # compared by identity
class Sequence:
    """One sequence's true per-position q, k, v (what a model would produce)."""

    q: torch.Tensor  # [length, num_heads, head_dim]
    k: torch.Tensor  # [length, num_kv_heads, head_dim]
    v: torch.Tensor  # [length, num_kv_heads, head_dim]


def make_sequence(length: int, seed: int, dtype: torch.dtype) -> Sequence:
    gen = torch.Generator().manual_seed(seed)

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(length, heads, HEAD_DIM, generator=gen).to(dtype)

    return Sequence(draw(GROUP * NUM_KV_HEADS), draw(NUM_KV_HEADS), draw(NUM_KV_HEADS))


@dataclass(frozen=True)
class Part:
    """One sequence's share of a launch: positions ``0 .. ctx - 1`` are cached, ``new`` rows
    follow at cache indices ``ctx ..``. With ``parents`` the last ``len(parents)`` rows are
    a draft tree rooted at cache index ``r``; node ``path[d]`` carries the true token at
    position ``r + d`` and every other node is a fake sibling. Plain rows are positions."""

    seq: Sequence
    ctx: int
    new: int
    parents: tuple[int, ...] = ()
    path: tuple[int, ...] = ()

    def rows(self) -> list[int | None]:
        """The true position of each new row (None: a fake tree node)."""
        r = self.ctx + self.new - len(self.parents)
        rows: list[int | None] = list(range(self.ctx, r))
        depth_of = {node: d for d, node in enumerate(self.path)}
        rows += [r + depth_of[j] if j in depth_of else None for j in range(len(self.parents))]
        return rows


def launch(
    parts: list[Part],
    attend,
    *,
    seed: int = 0,
    num_padded: int = 0,
    slack: int = 0,
    through_backend: str | None = None,
) -> list[dict[int, torch.Tensor]]:
    """Run one launch; per part, its true positions' outputs ``{position: [H, head_dim]}``.

    ``attend(q, k_cache, v_cache, meta, scale)`` computes attention over the written cache;
    with ``through_backend`` the new rows' K/V are written by that backend's ``forward``."""
    gen = torch.Generator().manual_seed(seed)
    dtype = parts[0].seq.q.dtype
    lens = [p.ctx + p.new for p in parts]
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    width = max(blocks) + 1
    num_blocks = 1 + sum(blocks) + 2
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(parts) + num_padded, width, dtype=torch.int32)
    q_rows, k_rows, v_rows, slots = [], [], [], []
    for s, part in enumerate(parts):
        row_ids = [ids.pop() for _ in range(blocks[s])]
        table[s, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.int32)

        def slot(index: int, row_ids=row_ids) -> int:
            return row_ids[index // BLOCK_SIZE] * BLOCK_SIZE + index % BLOCK_SIZE

        for pos in range(part.ctx):
            k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot(pos)] = part.seq.k[pos]
            v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot(pos)] = part.seq.v[pos]
        for i, pos in enumerate(part.rows()):
            if pos is None:
                fake = torch.randn(3, GROUP * NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                q_rows.append(fake[0])
                k_rows.append(fake[1, :NUM_KV_HEADS])
                v_rows.append(fake[2, :NUM_KV_HEADS])
            else:
                q_rows.append(part.seq.q[pos])
                k_rows.append(part.seq.k[pos])
                v_rows.append(part.seq.v[pos])
            slots.append(slot(part.ctx + i))
    q_lens = [p.new for p in parts] + [1] * num_padded
    slots += range(num_padded)  # padding tokens write the null block
    pad = [torch.zeros_like(q_rows[0])] * num_padded
    q = torch.stack(q_rows + pad).to(DEVICE)  # [num_tokens, num_heads, head_dim]
    kv_pad = [torch.zeros_like(k_rows[0])] * num_padded
    k_new = torch.stack(k_rows + kv_pad).to(DEVICE)  # [num_tokens, num_kv_heads, head_dim]
    v_new = torch.stack(v_rows + kv_pad).to(DEVICE)
    loc = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(loc, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens + [1] * num_padded, dtype=torch.int32, device=DEVICE),
        block_tables=table.to(DEVICE),
        max_query_len=max(q_lens) + slack,
        max_seq_len=max(lens) + slack,
    )
    if any(p.parents for p in parts):
        parents = [torch.tensor(p.parents, dtype=torch.int64) for p in parts]
        parents += [torch.zeros(0, dtype=torch.int64)] * num_padded
        trees = build_tree_mask([p.to(DEVICE) for p in parents])
        meta = trees.attach(meta)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    scale = HEAD_DIM**-0.5
    if through_backend is None:
        flat_k, flat_v = (c.view(-1, NUM_KV_HEADS, HEAD_DIM) for c in (k_cache, v_cache))
        flat_k[meta.slot_mapping], flat_v[meta.slot_mapping] = k_new, v_new
        out = attend(q, k_cache, v_cache, meta, scale)
    else:
        backend = get_attention_backend(through_backend)
        out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, scale)
    out = out.cpu()
    results, token = [], 0
    for part in parts:
        rows = part.rows()
        results.append({p: out[token + i] for i, p in enumerate(rows) if p is not None})
        token += len(rows)
    return results


def oracle(seq: Sequence, attend=invariant_paged_attention) -> dict[int, torch.Tensor]:
    """Every position's output from one full prefill of ``seq`` alone."""
    return launch([Part(seq, 0, seq.q.shape[0])], attend)[0]


def mismatches(got: dict[int, torch.Tensor], want: dict[int, torch.Tensor]) -> list[int]:
    """Positions whose outputs are not bitwise equal (NaN equals nothing)."""
    assert got, "the launch produced no true positions"
    return [p for p, o in sorted(got.items()) if not torch.equal(o, want[p])]


def chain(n: int) -> tuple[int, ...]:
    return (0, *range(n - 1))


# A tree whose true path is nodes 0, 2, 5, 6, 9 (depths 0..4), with siblings in between.
TREE_A = (0, 0, 0, 1, 2, 2, 5, 3, 6, 6, 4)
PATH_A = (0, 2, 5, 6, 9)
# The same path (as tokens) at other node indices, among other siblings: 0, 1, 4, 8, 10.
TREE_B = (0, 0, 1, 0, 1, 2, 3, 3, 4, 4, 8, 8)
PATH_B = (0, 1, 4, 8, 10)
# A wide tree: the path is 0, 3, 4, 7, 11, 12.
TREE_C = (0, 0, 0, 0, 3, 1, 2, 4, 4, 5, 6, 7, 11)
PATH_C = (0, 3, 4, 7, 11, 12)


def test_tree_fixtures_have_their_paths():
    for parents, path in [(TREE_A, PATH_A), (TREE_B, PATH_B), (TREE_C, PATH_C)]:
        assert path_to_root(list(parents), path[-1]) == list(path)
        assert any(node != depth for depth, node in enumerate(path))


# --- metadata ----------------------------------------------------------------------------


def test_tree_paths_equal_a_walk_up_the_parents():
    """Rows are root-to-node paths by depth for trees, forests, empty trees and slack."""
    rng = random.Random(0)
    trees = [
        [0] + [rng.randrange(i) for i in range(1, 17)],
        random_forest(rng, 12, roots=4),
        [],
        [0],
        list(chain(7)),
    ]
    masks = build_tree_mask([torch.tensor(p, dtype=torch.int64) for p in trees], max_tree_len=20)
    meta = masks.attach(
        AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.int64),
            query_start_loc=torch.zeros(len(trees) + 1, dtype=torch.int32),
            seq_lens=torch.full((len(trees),), 30, dtype=torch.int32),
            block_tables=torch.zeros(len(trees), 2, dtype=torch.int32),
            max_query_len=1,
            max_seq_len=30,
        )
    )
    paths, depths = tree_paths(meta)
    assert paths.shape == (len(trees), 20, 20) and depths.shape == (len(trees), 20)
    assert paths.dtype == depths.dtype == torch.int32
    for s, parents in enumerate(trees):
        for i in range(len(parents)):
            walk = path_to_root(parents, i)
            assert depths[s, i] == len(walk) - 1
            assert paths[s, i, : len(walk)].tolist() == walk
    attached = with_tree_paths(meta)
    assert torch.equal(attached.tree_paths, paths) and with_tree_paths(attached) is attached


@pytest.mark.parametrize("long_keys", [0, 20, 1 << 30])
def test_query_tiles_cover_every_row_once(long_keys, monkeypatch):
    """Rows before a tree go in tiles of up to TILE_TOKENS, tree rows in tiles of their own:
    four a tile for trees starting at the launch's threshold or later, one otherwise; draft-step
    trees longer than the query and padded rows included."""
    share_trees_from(monkeypatch, long_keys)
    # (q_len, seq_len, tree_len) per sequence: a prefill of 10, a decode, 3 plain rows and
    # a 5-node tree, a draft step's 4 queries of a 9-node tree, a chain as plain rows.
    shapes = [(10, 30, 0), (1, 8, 0), (8, 40, 5), (4, 20, 9), (6, 50, 0)]
    parents = [[], [], [0, 0, 1, 1, 2], [0] * 9, []]
    masks = build_tree_mask([torch.tensor(p, dtype=torch.int64) for p in parents])
    loc = [0, *accumulate(q for q, _, _ in shapes)]
    padded = 3
    meta = masks.attach(
        AttentionMetadata(
            slot_mapping=torch.zeros(loc[-1] + padded, dtype=torch.int64),
            query_start_loc=torch.tensor(loc, dtype=torch.int32),
            seq_lens=torch.tensor([n for _, n, _ in shapes], dtype=torch.int32),
            block_tables=torch.zeros(len(shapes), 4, dtype=torch.int32),
            max_query_len=10,
            max_seq_len=50,
        )
    )
    starts, seqs = query_tiles(meta)
    # tiles: cdiv(10, 4) = 3; 1; cdiv(3, 4) + the 5-node tree from cache index 35 (5 tiles
    # of one row or cdiv(5, 4) = 2 of four); the 9-node tree from index 11 (4 or 1); cdiv(6, 4)
    counts = [3, 1, 1 + (2 if long_keys <= 35 else 5), 1 if long_keys <= 11 else 4, 2]
    assert starts.tolist() == [0, *accumulate(counts)]
    total = sum(counts)
    assert seqs.tolist() == [s for s, n in enumerate(counts) for _ in range(n)] + [5] * (
        loc[-1] + padded - total
    )
    attached = with_query_tiles(meta)
    assert torch.equal(attached.tile_starts, starts) and with_query_tiles(attached) is attached
    # The launch's host bound on the tiles holds, with trees and, for the plain rows
    # alone (four a tile plus a partial one per sequence), without.
    assert tile_bound(loc[-1] + padded, len(shapes), meta.has_tree) >= total
    plain_tiles = sum(-(-q // 4) for q in (10, 1, 3, 6))
    assert tile_bound(10 + 1 + 3 + 6, 4, False) >= plain_tiles


def test_trees_share_tiles_by_the_launch_rows_and_their_start():
    """Few rows: every tree row its own tile; many: every tree shares; between: trees from
    LONG_TREE_KEYS on. The tiles follow the launch's padded row count, as the kernel does."""
    assert [shared_tree_from(n) for n in (1, FEW_ROWS)] == [NEVER, NEVER]
    assert [shared_tree_from(n) for n in (FEW_ROWS + 1, MANY_ROWS - 1)] == [LONG_TREE_KEYS] * 2
    assert [shared_tree_from(n) for n in (MANY_ROWS, 8192)] == [0, 0]
    # One 6-node tree from cache index 2,000: a row a tile alone, shared once padding
    # brings the launch to the middle band, and at the many-row end.
    parents = build_tree_mask([torch.tensor([0, 0, 1, 1, 2, 3])])
    for padded, tiles in ((0, 6), (FEW_ROWS + 1 - 6, 2), (MANY_ROWS - 6, 2)):
        meta = parents.attach(
            AttentionMetadata(
                slot_mapping=torch.zeros(6 + padded, dtype=torch.int64),
                query_start_loc=torch.tensor([0, 6], dtype=torch.int32),
                seq_lens=torch.tensor([2006], dtype=torch.int32),
                block_tables=torch.zeros(1, 126, dtype=torch.int32),
                max_query_len=6,
                max_seq_len=2006,
            )
        )
        assert query_tiles(meta)[0].tolist() == [0, tiles], padded


def test_metadata_rejects_tree_paths_without_trees():
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=1,
    )
    with pytest.raises(ValueError, match="tree fields"):
        AttentionMetadata(**{**meta.__dict__, "tree_paths": torch.zeros(1, 1, 1)})


# --- against the references --------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_float64_reference_on_mixed_batches(dtype, atol):
    """Decodes, prefill chunks, trees (some after plain new tokens) and draft-step forests,
    with padding sequences and inflated bounds; poisoned subtrees must stay unread."""
    tc = make_tree_case(
        mixed_batch(random.Random(1), BLOCK_SIZE), group=GROUP, num_padded=2, slack=3, seed=1
    )
    c = tc.case
    q, k_cache, v_cache = c.q.to(dtype), c.k_cache.to(dtype), c.v_cache.to(dtype)

    out = invariant_paged_attention(q, k_cache, v_cache, c.meta, c.scale)

    n = sum(tc.q_lens)  # padding rows read the null block; their outputs are unused
    wide = [t.double() for t in (q, k_cache, v_cache)]
    ref = paged_attention_ref(*wide, c.meta, c.scale)[:n]
    torch.testing.assert_close(out[:n].double(), ref, atol=atol, rtol=atol)
    # The logical-position reference reads the same keys through the tree paths.
    logical = invariant_attention_ref(*wide, c.meta, c.scale)[:n]
    torch.testing.assert_close(logical, ref, rtol=1e-12, atol=1e-12)


def test_backend_is_registered_and_matches_torch_backend():
    """``triton_invariant`` writes the cache and attends like the reference backend, with
    RoPE fused into the write."""
    tc = make_tree_case(mixed_batch(random.Random(2), BLOCK_SIZE), group=GROUP, seed=2)
    c = tc.case
    backend = get_attention_backend("triton_invariant")
    assert isinstance(backend, InvariantTritonBackend) and backend.fuses_rope
    k_ref, v_ref = c.k_cache.clone(), c.v_cache.clone()
    out = backend.forward(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache, c.meta, c.scale)
    ref = get_attention_backend("torch").forward(
        c.q, c.k_new, c.v_new, k_ref, v_ref, c.meta, c.scale
    )
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(c.k_cache, k_ref) and torch.equal(c.v_cache, v_ref)


# --- invariance: one sequence, every kind ------------------------------------------------


def test_one_sequence_every_kind_is_bitwise_equal(tree_tile):
    """Token t's output from (a) a full prefill equals (b) chunked prefills, (c) decoding
    token by token, (d) chain verification with and without tree fields, and (e) trees that
    hold t's token at node indices other than its depth, among different siblings; the
    chains and trees straddle BLOCK_N boundaries in both logical and cache positions."""
    seq = make_sequence(80, seed=3, dtype=torch.bfloat16)
    want = oracle(seq)
    assert len(want) == 80 and all(torch.isfinite(o).all() for o in want.values())

    def check(parts_per_launch: list[Part]) -> None:
        for i, part in enumerate(parts_per_launch):
            got = launch([part], invariant_paged_attention, seed=i)[0]
            assert mismatches(got, want) == [], part

    for chunks in ([17, 30, 33], [5, 59, 16], [BLOCK_N, BLOCK_N + 1, 80 - 2 * BLOCK_N - 1]):
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        check([Part(seq, s, n) for s, n in zip(starts, chunks, strict=True)])
    check([Part(seq, p, 1) for p in range(80)])  # every context length 1 .. 80
    check(
        [
            Part(seq, 28, 6, chain(6), tuple(range(6))),  # logical 28..33 crosses 32
            Part(seq, 61, 5),  # a chain as a plain 5-token step
            Part(seq, 61, 5, chain(5), tuple(range(5))),
            Part(seq, 29, len(TREE_A), TREE_A, PATH_A),  # logical 29..33, cache 29..39
            Part(seq, 29, len(TREE_B), TREE_B, PATH_B),
            Part(seq, 27, len(TREE_C), TREE_C, PATH_C),  # logical 27..32, cache 27..39
            Part(seq, 60, len(TREE_A), TREE_A, PATH_A),  # logical 60..64, cache 60..70
            Part(seq, 58, 3 + len(TREE_B), TREE_B, PATH_B),  # 3 plain tokens, then the tree
        ]
    )


# --- invariance: batch composition --------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, pytest.param(torch.float32, marks=gpu_only)],  # fp32: interpreter time
)
def test_outputs_do_not_depend_on_the_batch(dtype, tree_tile):
    """Each sequence's outputs equal its solo oracle inside batches mixing prefills, chunks,
    decodes and trees of other sequences, in any order, with padding and slack bounds,
    through the backend's own cache write too."""
    seqs = [make_sequence(n, seed=10 + n, dtype=dtype) for n in (80, 50, 70)]
    wants = [oracle(s) for s in seqs]
    s1, s2, s3 = seqs
    batches = [
        [Part(s1, 64, 1), Part(s2, 0, 50), Part(s3, 31, len(TREE_A), TREE_A, PATH_A)],
        [Part(s3, 40, 30), Part(s1, 62, len(TREE_C), TREE_C, PATH_C), Part(s2, 32, 1)],
        [Part(s2, 13, 2 + len(TREE_B), TREE_B, PATH_B), Part(s1, 0, 33), Part(s3, 33, 1)],
        [Part(s1, 79, 1), Part(s3, 69, 1), Part(s2, 49, 1)],  # decode-only
    ]
    for i, batch in enumerate(batches):
        for kw in ({"num_padded": 2, "slack": 5}, {"through_backend": "triton_invariant"}):
            results = launch(batch, invariant_paged_attention, seed=100 + i, **kw)
            for part, got in zip(batch, results, strict=True):
                assert mismatches(got, wants[seqs.index(part.seq)]) == [], (i, part, kw)


def test_split_programs_follow_the_launch_and_the_config():
    """Every split its own program while the tiles leave room (a decode at batch 1), fewer
    programs doing more splits each as tiles fill the GPU, never fewer than
    ``MIN_SPLIT_PROGRAMS`` (nor more than the splits); a config's count wins, and a bad one
    is refused naming the value."""
    config, sms = InvariantAttentionConfig(), 132  # 16 splits; an H100
    assert PROGRAMS_PER_SM * sms == 1056 and MIN_SPLIT_PROGRAMS == 4
    # (rows, sequences, trees) -> tiles: trees one row a tile; plain rows four a tile plus
    # one partial tile per sequence, at most one a row
    launches = {
        "b1 decode": ((1, 1, False), 1),
        "b1 tree of 32": ((32, 1, True), 32),
        "b16 chains of 6": ((96, 16, False), 40),
        "b64 decode": ((64, 64, False), 64),
        "1,024-row prefill": ((1024, 1, False), 257),
    }
    # tiles x 3 KV heads x P within 1,056, P at least 4
    programs = {"b1 decode": 16, "b1 tree of 32": 8, "b16 chains of 6": 8, "b64 decode": 4}
    programs["1,024-row prefill"] = 4
    for name, (args, tiles) in launches.items():
        assert tile_bound(*args) == tiles, name
        assert split_programs(tiles, 3, config, sms) == programs[name], name
    assert split_programs(8192, 3, config, sms) == 4
    assert split_programs(8192, 3, InvariantAttentionConfig(num_splits=2), sms) == 2
    assert split_programs(1, 3, InvariantAttentionConfig(split_programs=2), sms) == 2
    with pytest.raises(ValueError, match="split_programs 3 must be a power of two"):
        InvariantAttentionConfig(split_programs=3)
    with pytest.raises(ValueError, match="split_programs 32 must be"):
        InvariantAttentionConfig(num_splits=16, split_programs=32)
    with pytest.raises(ValueError, match="num_stages 0 must be >= 1"):
        InvariantAttentionConfig(num_stages=0)


@pytest.mark.parametrize(("sms", "num_splits"), [(1, CONFIG.num_splits), (64, 8)])
def test_programs_per_split_change_no_bit(sms, num_splits, monkeypatch):
    """One mixed batch (a decode, a prefill chunk, a tree after plain rows, a long tree
    whose rows share tiles) launched with every split its own program, with one program
    computing all splits, and sized to the launch on a GPU of ``sms`` SMs (64 SMs and 8
    splits: the host's bound gives 4 programs a row slot, and the kernel deals the spare
    slots of the 17 real tiles to 8 programs each): each equal to each sequence's solo
    oracle, bit for bit."""
    monkeypatch.setattr("specdec.kernels.invariant_attention.num_sms", lambda device: sms)
    share_trees_from(monkeypatch, 45)
    base = replace(CONFIG, num_splits=num_splits)
    seqs = [make_sequence(n, seed=40 + n, dtype=torch.bfloat16) for n in (70, 50, 60, 80)]
    wants = [oracle(seq, partial(_invariant_paged_attention, config=base)) for seq in seqs]
    s1, s2, s3, s4 = seqs
    batch = [
        Part(s1, 69, 1),
        Part(s2, 20, 25),
        Part(s3, 40, 3 + len(TREE_B), TREE_B, PATH_B),
        Part(s4, 60, len(TREE_A), TREE_A, PATH_A),
    ]
    for programs in (1, num_splits, None):
        config = replace(base, split_programs=programs)
        outs = launch(batch, partial(_invariant_paged_attention, config=config), seed=7)
        for part, got in zip(batch, outs, strict=True):
            assert mismatches(got, wants[seqs.index(part.seq)]) == [], (programs, part)


# --- negative controls: the same comparisons catch the non-invariant kernels -------------


def triton_attend(q, k_cache, v_cache, meta, scale):
    """The ``triton`` backend's kernel choice (split-K decode or the varlen kernel)."""
    return TritonAttentionBackend._attend(q, k_cache, v_cache, meta, scale)


def test_controls_triton_backend_is_not_invariant(monkeypatch):
    """The comparisons have power: the ``triton`` backend's kernels give other bits for
    (1) a tree node at a node index other than its depth than for the same token in a
    prefill (its key tiles follow cache indices), and (2) a decode alone (split-K across
    two programs: few programs for the device) than inside a batch (one split). The
    invariant kernel passes both. The launchers see a one-SM device here, as on CPU, so
    their split choices are the same on any machine."""
    monkeypatch.setattr("specdec.kernels.launch.num_sms", lambda device: 1)
    monkeypatch.setattr("specdec.kernels.prefill.num_sms", lambda device: 1)
    seq = make_sequence(80, seed=5, dtype=torch.float32)
    tree = Part(seq, 60, len(TREE_A), TREE_A, PATH_A)
    for attend, invariant in [(triton_attend, False), (invariant_paged_attention, True)]:
        got = launch([tree], attend)[0]
        assert (mismatches(got, oracle(seq, attend)) == []) == invariant, attend

    # Decode splits: cdiv(4 * SMs, programs) ways, capped at 2 by a 300-token context (fp32
    # decode tiles are 64 keys): one sequence's 3 programs get 2 splits, six programs 1.
    long_seq, other = make_sequence(300, 6, torch.float32), make_sequence(20, 7, torch.float32)
    alone, batched = [Part(long_seq, 299, 1)], [Part(long_seq, 299, 1), Part(other, 19, 1)]
    for attend, invariant in [(triton_attend, False), (invariant_paged_attention, True)]:
        got_alone = launch(alone, attend)[0]
        got_batched = launch(batched, attend)[0]
        assert (mismatches(got_alone, got_batched) == []) == invariant, attend


# --- CUDA graphs ---------------------------------------------------------------------------


@gpu_only
@pytest.mark.gpu
def test_backend_replays_in_a_cuda_graph_bitwise():
    """A tree batch without tree paths captures (the paths are built inside the graph: no
    host sync) and its replay equals the eager forward bit for bit."""
    batch = mixed_batch(random.Random(4), BLOCK_SIZE)
    tc = make_tree_case(batch, group=GROUP, num_padded=2, seed=4, dtype=torch.bfloat16)
    c = tc.case
    backend = InvariantTritonBackend()
    eager = backend.forward(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache, c.meta, c.scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache, c.meta, c.scale)
    out.zero_()
    graph.replay()
    assert torch.equal(out, eager)
