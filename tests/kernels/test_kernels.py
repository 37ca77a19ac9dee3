"""Triton paged-attention kernels equal their PyTorch references.

Runs on CUDA when present, else on CPU under the Triton interpreter (TRITON_INTERPRET=1,
which must be set before triton is first imported: this module sets it when it can and
refuses to run when triton was imported without it).

Caches are filled with large "poison" values wherever a sequence has no context, so a
kernel that reads past seq_len, past the causal diagonal or through an unused block-table
entry fails the comparison by a wide margin instead of by a rounding error.
"""

from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    # Triton decides interpret-or-compile when it decorates a function, its own
    # triton.language helpers included, so the variable must precede `import triton`.
    if "triton" in sys.modules:
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
            "on CPU; set it first (tests/conftest.py, or TRITON_INTERPRET=1 pytest ...)"
        )
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from specdec.attention.base import get_attention_backend  # noqa: E402
from specdec.attention.torch_backend import (  # noqa: E402
    TorchAttentionBackend,
    paged_attention_batched_ref,
)
from specdec.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from specdec.kernels import (  # noqa: E402
    DecodeConfig,
    PrefillConfig,
    choose_num_splits,
    default_prefill_config,
    paged_attention,
    paged_attention_ref,
    paged_decode,
    paged_decode_ref,
    plan_splits,
    rope_store_kvcache,
    rope_store_kvcache_ref,
    store_kvcache,
    store_kvcache_ref,
)
from specdec.kernels.accept import accept_and_stage, accept_and_stage_ref  # noqa: E402
from specdec.kernels.move_kv import (  # noqa: E402
    cache_pointer_table,
    move_kv_slots,
    move_kv_slots_ref,
)
from specdec.kernels.topk import log_softmax_topk, log_softmax_topk_ref  # noqa: E402
from specdec.models.rope import RopeParams, RotaryEmbedding  # noqa: E402
from specdec.ops.attention_metadata import AttentionMetadata  # noqa: E402
from specdec.spec.tree import grow_trees  # noqa: E402
from specdec.tree_shapes import DynamicTreeShape  # noqa: E402

TOL = {"atol": 1e-5, "rtol": 1e-5}
POISON = 60.0  # cache value where no context lives: large enough to dominate any softmax
gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")


@dataclass
class Case:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: the new tokens' K
    v_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], context written
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    group: int,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    num_padded: int = 0,
    slack: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    """A batch of real sequences plus ``num_padded`` CUDA-graph padding sequences (q_len 1,
    seq_len 1, block table all null block). ``slack`` inflates the host bounds
    max_query_len/max_seq_len the way a captured graph's bucket does."""
    assert all(1 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    num_heads = group * num_kv_heads
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    width = max(blocks_per_seq, default=1) + 2  # spare columns point at a poison block
    num_blocks = 1 + sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = POISON + torch.randn(shape, generator=gen)
    v_cache = POISON + torch.randn(shape, generator=gen)
    k_cache[0] = torch.randn(shape[1:], generator=gen)  # null block: finite, ordinary values
    v_cache[0] = torch.randn(shape[1:], generator=gen)

    ids = (torch.randperm(num_blocks - 2, generator=gen) + 1).tolist()  # last block: poison
    table = torch.full((len(seq_lens) + num_padded, width), num_blocks - 1, dtype=torch.int32)
    table[len(seq_lens) :] = 0
    slots: list[int] = []
    for s, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        row = [ids.pop() for _ in range(blocks_per_seq[s])]
        table[s, : len(row)] = torch.tensor(row, dtype=torch.int32)
        for pos in range(seq_len):
            b, off = row[pos // block_size], pos % block_size
            k_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
        slots += [
            row[p // block_size] * block_size + p % block_size
            for p in range(seq_len - q_len, seq_len)
        ]
    slots += range(num_padded)  # padding tokens write distinct slots of the null block
    all_q = q_lens + [1] * num_padded
    all_seq = seq_lens + [1] * num_padded
    loc = torch.tensor([0, *torch.tensor(all_q).cumsum(0).tolist()], dtype=torch.int32)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    flat_k, flat_v = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    k_new, v_new = flat_k[slot_mapping].clone(), flat_v[slot_mapping].clone()
    q = torch.randn(len(slots), num_heads, head_dim, generator=gen)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE)

    meta = AttentionMetadata(
        slot_mapping=dev(slot_mapping),
        query_start_loc=dev(loc),
        seq_lens=dev(torch.tensor(all_seq, dtype=torch.int32)),
        block_tables=dev(table),
        max_query_len=max(all_q) + slack,
        max_seq_len=max(all_seq) + slack,
    )
    return Case(
        q=dev(q).to(dtype),
        k_new=dev(k_new).to(dtype),
        v_new=dev(v_new).to(dtype),
        k_cache=dev(k_cache).to(dtype),
        v_cache=dev(v_cache).to(dtype),
        meta=meta,
        scale=head_dim**-0.5,
    )


def random_lengths(rng: random.Random, n: int, max_q: int, max_ctx: int) -> tuple[list, list]:
    q_lens = [rng.randint(1, max_q) for _ in range(n)]
    return q_lens, [q + rng.randint(0, max_ctx) for q in q_lens]


# --- store_kvcache -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"), [(1, 64, 16), (3, 64, 32), (8, 128, 16)]
)
def test_store_kvcache_matches_reference_from_strided_views(num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(num_kv_heads)
    num_tokens, num_heads, num_blocks = 37, 2 * num_kv_heads, 9
    # q, k, v as views of one fused projection: k and v have a token stride != kvh*d.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    _, k, v = qkv.to(DEVICE).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    k, v = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    k_ref, v_ref, k_out, v_out = cache.clone(), -cache, cache.clone(), -cache

    store_kvcache_ref(k, v, k_ref, v_ref, slots)
    store_kvcache(k, v, k_out, v_out, slots)

    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    assert not torch.equal(k_out, cache)  # the write happened


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 64), (16, 2, 128), (3, 3, 32)]
)
def test_rope_store_kvcache_matches_reference_from_strided_views(num_heads, num_kv_heads, head_dim):
    """RoPE inside the cache write: the rotated q, and the cache after the write, equal
    rotating with apply_rotary and storing (fp32); slots outside the batch keep their
    values; q, k, v are strided views of one projection, cos/sin a real table's rows."""
    gen = torch.Generator().manual_seed(num_heads * 7 + head_dim)
    num_tokens, num_blocks, block_size = 29, 7, 16
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes), generator=gen).to(DEVICE)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(sizes, dim=-1))
    rotary = RotaryEmbedding(RopeParams(head_dim, 1e5, 8192), 4096).to(DEVICE)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = rotary(positions, torch.float32)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    k_ref, v_ref, k_out, v_out = cache.clone(), -cache, cache.clone(), -cache

    q_ref = rope_store_kvcache_ref(q, k, v, cos, sin, k_ref, v_ref, slots)
    q_out = rope_store_kvcache(q, k, v, cos, sin, k_out, v_out, slots)

    assert q_out.is_contiguous() and q_out.shape == q.shape
    torch.testing.assert_close(q_out, q_ref, **TOL)
    torch.testing.assert_close(k_out, k_ref, **TOL)
    assert torch.equal(v_out, v_ref)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_out.view(-1, num_kv_heads, head_dim)[untouched],
                       cache.view(-1, num_kv_heads, head_dim)[untouched])  # fmt: skip
    # the rotation happened: position 0 aside, rotated k differs from the input
    moved = positions != 0
    assert not torch.allclose(k_out.view(-1, num_kv_heads, head_dim)[slots][moved], k[moved])


def test_rope_store_kvcache_rejects_mismatched_tables():
    q, k = torch.zeros(4, 3, 64, device=DEVICE), torch.zeros(4, 1, 64, device=DEVICE)
    cache = torch.zeros(2, 16, 1, 64, device=DEVICE)
    cos = torch.zeros(4, 1, 16, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match=r"cos \(4, 1, 16\) must be \[4, 1, 32\]"):
        rope_store_kvcache(q, k, k.clone(), cos, cos, cache, cache.clone(), slots)


def test_kv_stores_reject_a_strided_slot_mapping():
    """Kernels read ``slot_mapping[token]`` densely: a strided view (a one-wide column of
    a [batch, q] slot table, as draft levels slice it) would write other tokens' slots,
    so both stores refuse it, naming the fix."""
    q, k = torch.zeros(2, 3, 64, device=DEVICE), torch.zeros(2, 1, 64, device=DEVICE)
    cache = torch.zeros(2, 16, 1, 64, device=DEVICE)
    cos = torch.zeros(2, 1, 32, device=DEVICE)
    slots = torch.arange(8, device=DEVICE).view(2, 4)[:, 1:2].reshape(-1)  # stride 4
    assert slots.stride() == (4,)
    with pytest.raises(ValueError, match=r"slot_mapping must be contiguous.*contiguous\(\)"):
        rope_store_kvcache(q, k, k.clone(), cos, cos, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match=r"slot_mapping must be contiguous"):
        store_kvcache(k, k.clone(), cache, cache.clone(), slots)


# --- move_kv_slots -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kv_slots_matches_reference_in_every_cache(dtype):
    """One launch moves every layer's K and V like the per-cache reference: accepted paths
    shifting left onto slots their own row reads (sources read before destinations are
    written), self-copies, and padding rows that all write the null block."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kvh, d = 6, 16, 3, 64
    caches = [
        torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(DEVICE, dtype)
        for _ in range(2 * 4)  # 4 layers, K and V
    ]
    ref = [c.clone() for c in caches]
    # Row 0: root at slot 20, accepted nodes 3, 4, 7 move to 21, 22, 23: slot 23 is read
    # (for 21) and written (from 27) by the same row. Row 1: nothing accepted (self-copies).
    # Row 2: a padding row, the null block only.
    src = torch.tensor([[23, 24, 27], [40, 41, 42], [0, 0, 0]], device=DEVICE)
    dst = torch.tensor([[21, 22, 23], [40, 41, 42], [1, 2, 3]], device=DEVICE)
    before = caches[0].view(-1, kvh, d).clone()

    move_kv_slots_ref(ref, src, dst)
    move_kv_slots(cache_pointer_table(caches), caches[0], src, dst)

    for got, want in zip(caches, ref, strict=True):
        assert torch.equal(got, want)
    after = caches[0].view(-1, kvh, d)
    for s_, d_ in [(23, 21), (24, 22), (27, 23)]:
        assert torch.equal(after[d_], before[s_])


def test_cache_pointer_table_rejects_mixed_caches():
    a = torch.zeros(2, 16, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="every cache must be contiguous"):
        cache_pointer_table([a, torch.zeros(2, 16, 2, 64, device=DEVICE)])


# --- accept_and_stage --------------------------------------------------------------------


def _random_trees(gen, batch, q, max_depth, chain):
    """Trees of one size: each node's parent an earlier node (depth <= max_depth); siblings
    carry distinct tokens (as drafts do: at most one child of a node passes), and each
    node's argmax picks one of its k children's tokens or none with odds k : 1, so long
    accepted paths are common."""
    parents = torch.zeros(batch, q, dtype=torch.int64)
    depths = torch.zeros(batch, q, dtype=torch.int64)
    for b in range(batch):
        for i in range(1, q):
            if chain:
                p = i - 1
            else:
                options = [j for j in range(i) if depths[b, j] < max_depth]
                p = options[int(torch.randint(len(options), (1,), generator=gen))]
            parents[b, i], depths[b, i] = p, depths[b, p] + 1
    tokens = torch.zeros(batch, q, dtype=torch.int64)
    best = torch.zeros(batch, q, dtype=torch.int64)
    for b in range(batch):
        for node in range(q):
            kids = [i for i in range(1, q) if parents[b, i] == node]
            tokens[b, kids] = torch.randperm(len(kids), generator=gen)
            best[b, node] = int(torch.randint(len(kids) + 1, (1,), generator=gen))
    return tokens, parents, depths, best


@pytest.mark.parametrize(
    ("batch", "q", "max_depth", "chain", "aux_width", "extra"),
    [
        (5, 4, 3, True, 24, 0),
        (7, 33, 5, False, 1728, 0),
        (3, 9, 8, True, 40, 0),
        (1, 2, 1, True, 8, 0),
        (4, 4, 3, True, 24, 2),  # a chain-3 band's step in a chain-5-wide state
    ],
)
def test_accept_and_stage_matches_reference(batch, q, max_depth, chain, aux_width, extra):
    """One launch gives the reference's acceptance (path, emitted tokens, counts, padding
    included), its packed read-back row and its catch-up state rows; rows past the batch,
    and state columns past depth + 1 (a wider band's), are left alone."""
    gen = torch.Generator().manual_seed(q * 10 + batch)
    tokens, parents, depths, best = _random_trees(gen, batch, q, max_depth, chain)
    if chain:  # one row accepts everything: the bonus goes to the last column
        best[0, :-1] = tokens[0, 1:]
        best[0, -1] = 7
    aux = torch.randn(batch * q, aux_width, generator=gen)
    root = torch.randint(100, (batch,), generator=gen)
    rows, width = batch + 2, max_depth + 1 + extra

    def state():
        g = torch.Generator().manual_seed(1)
        return (
            torch.randint(9, (rows, width), generator=g),
            torch.randn(rows, width, aux_width, generator=g),
            torch.randint(9, (rows,), generator=g),
            torch.randint(9, (rows,), generator=g),
        )

    want_state, got_state = state(), tuple(t.to(DEVICE) for t in state())
    want, want_packed = accept_and_stage_ref(
        best, tokens, parents, depths, max_depth, aux, root, want_state
    )
    on = [t.to(DEVICE) for t in (best, tokens, parents, depths)]
    got, got_packed = accept_and_stage(*on, max_depth, aux.to(DEVICE), root.to(DEVICE), got_state)
    assert torch.equal(got.num_accepted.cpu(), want.num_accepted)
    assert torch.equal(got.path.cpu(), want.path)
    assert torch.equal(got.token_ids.cpu(), want.token_ids)
    assert torch.equal(got_packed.cpu(), want_packed)
    for g, w in zip(got_state, want_state, strict=True):
        assert torch.equal(g.cpu(), w)
    untouched = state()
    assert torch.equal(want_state[0][:, max_depth + 1 :], untouched[0][:, max_depth + 1 :])
    assert torch.equal(want_state[1][:, max_depth + 1 :], untouched[1][:, max_depth + 1 :])
    if chain and q == max_depth + 1:
        assert want.num_accepted[0] == max_depth and want.token_ids[0, -1] == 7
    assert want.num_accepted.max() >= 1  # the case exercises accepted paths


def test_accept_and_stage_checks_the_state_shape():
    t = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    aux = torch.zeros(8, 6, device=DEVICE)
    state = (
        torch.zeros(2, 3, dtype=torch.int64, device=DEVICE),
        torch.zeros(2, 3, 6, device=DEVICE),
        torch.zeros(2, dtype=torch.int64, device=DEVICE),
        torch.zeros(2, dtype=torch.int64, device=DEVICE),
    )
    with pytest.raises(ValueError, match=r"state rows must be \[rows, W >= 4\] tokens"):
        accept_and_stage(t, t, t, t, 3, aux, t[:, 0], state)


# --- varlen prefill / extend -------------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "head_dim", "block_size", "config"),
    [
        (1, 64, 16, None),
        (1, 64, 16, PrefillConfig(block_m=16, block_n=16)),  # many query and key tiles
        (3, 64, 32, None),
        (3, 128, 32, PrefillConfig(block_m=32, block_n=32)),
        (8, 128, 16, None),
        (8, 64, 32, PrefillConfig(block_m=16, block_n=32)),  # two tokens per tile
    ],
)
def test_prefill_ragged_batch_matches_reference(group, head_dim, block_size, config):
    rng = random.Random(group * 1000 + head_dim + block_size)
    q_lens, seq_lens = random_lengths(rng, 4, max_q=70, max_ctx=130)
    case = make_case(
        q_lens,
        seq_lens,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        seed=rng.randint(0, 99),
    )

    out = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, config=config)

    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_block_boundaries(block_size):
    """Context lengths at k*block_size and one either side, fully and partly new."""
    seq_lens = [block_size, block_size + 1, 2 * block_size - 1, 2 * block_size, 3 * block_size + 1]
    q_lens = [block_size, 1, 2 * block_size - 1, 3, block_size + 1]
    case = make_case(q_lens, seq_lens, group=3, block_size=block_size, seed=block_size)
    config = PrefillConfig(block_m=16, block_n=16)

    out = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, config=config)

    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out, ref, **TOL)


def test_prefill_mixed_decodes_extends_prompts_and_padding():
    """One varlen launch over decodes (q_len 1, long context), speculative-verify-sized
    extends, whole prompts and null-block padding, with inflated host bounds."""
    q_lens = [1, 70, 5, 1, 8, 33]
    seq_lens = [150, 70, 121, 17, 40, 33]
    case = make_case(q_lens, seq_lens, group=3, num_padded=3, slack=20, seed=7)

    out = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)

    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize(
    ("num_splits", "config"),
    [
        (9, PrefillConfig(block_m=16, block_n=16)),  # one or two key tiles per split
        (3, PrefillConfig(block_m=32, block_n=16)),  # splits straddling the diagonal
        (2, None),  # the default tiles (block_n 64)
    ],
)
def test_prefill_split_k_matches_reference(num_splits, config):
    """Split-K (small-batch verify steps) merges partials exactly: ragged extends, decodes,
    whole prompts and padded sequences with inflated host bounds."""
    q_lens = [1, 70, 5, 1, 8, 33, 16]
    seq_lens = [150, 70, 121, 17, 40, 33, 16]
    case = make_case(q_lens, seq_lens, group=3, num_padded=2, slack=20, seed=11)

    out = paged_attention(
        case.q, case.k_cache, case.v_cache, case.meta, case.scale, config=config,
        num_splits=num_splits,
    )  # fmt: skip

    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)


def test_prefill_tiles_and_splits_fill_the_gpu():
    """On an H200-sized GPU (132 SMs): a 64-node verify step at batch 1 gets the smallest
    tiles plus split-K; at batch 16 bigger tiles fill the SMs alone; long prefills keep
    128-row tiles; on CPU (one 'SM') tiles are sized to the work only."""

    def choose(q_len, num_seqs, max_seq_len, sms=132):
        config = default_prefill_config(
            q_len, 3, torch.bfloat16, num_seqs=num_seqs, num_kv_heads=3, num_sms=sms
        )
        tiles = -(-q_len // (config.block_m // 3))
        return config.block_m, choose_num_splits(tiles * 3 * num_seqs, max_seq_len, 64, sms)

    # 13 tiles x 3 heads = 39 programs, x14 splits: four programs per SM
    assert choose(65, 1, 2048) == (16, 14)
    assert choose(4, 16, 4096) == (16, 11)  # a chain-3 verify at batch 16: 48 programs
    assert choose(65, 16, 2048) == (64, 1)
    assert choose(2048, 1, 2048) == (128, 1)
    assert choose(4, 16, 100) == (16, 1)  # 100 keys: two key tiles already
    assert choose(65, 1, 2048, sms=1) == (128, 1)


def test_warm_up_compiles_every_variant_the_launchers_choose(monkeypatch):
    """Every (tile rows, warps, split-K, tree) the varlen launcher picks over a sweep of
    batch shapes on an H200-sized GPU, and both decode paths, are among the warm-up's
    launches: no request compiles a kernel on its first token."""
    import specdec.kernels.decode as decode_module
    import specdec.kernels.prefill as prefill_module
    from specdec.kernels.warmup import warm_up_attention

    launched: set[tuple] = set()

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kw):
                keys = ("BLOCK_M", "num_warps", "SINGLE_SPLIT", "HAS_TREE")
                launched.add((self.name, *(kw.get(k) for k in keys)))

            return launch

    for module, kernel in [
        (prefill_module, "_prefill_kernel"),
        (prefill_module, "_prefill_combine_kernel"),
        (decode_module, "_decode_split_kernel"),
        (decode_module, "_decode_combine_kernel"),
    ]:
        monkeypatch.setattr(module, kernel, Recorder(kernel))
    num_heads, num_kv_heads, head_dim = 9, 3, 64  # SmolLM2-135M
    k_cache = torch.zeros(8, 16, num_kv_heads, head_dim, dtype=torch.bfloat16)
    launches = warm_up_attention(k_cache, k_cache, num_heads, torch.bfloat16, trees=True)
    assert launches == 4 * 2 * 2 + 2  # tile sizes 16-128 x split x tree, + decode x split
    warmed = set(launched)
    for q_len in (1, 2, 5, 17, 33, 65, 129, 300, 581, 1000, 2048, 8192):
        for num_seqs in (1, 2, 3, 8, 16, 64):
            for tree in (False, True):
                config = prefill_module.default_prefill_config(
                    q_len, 3, torch.bfloat16, num_seqs=num_seqs, num_kv_heads=3, num_sms=132
                )
                tiles = -(-q_len // (config.block_m // 3))
                splits = choose_num_splits(tiles * 3 * num_seqs, 4096, config.block_n, 132)
                key = ("_prefill_kernel", config.block_m, config.num_warps, splits == 1, tree)
                assert key in warmed, key
    assert {k[3] for k in warmed if k[0] == "_decode_split_kernel"} == {True, False}


def test_warm_up_runs_and_leaves_the_caches_alone():
    from specdec.kernels.warmup import warm_up_attention

    k_cache = torch.randn(8, 16, 2, 32, device=DEVICE)
    v_cache = torch.randn(8, 16, 2, 32, device=DEVICE)
    k0, v0 = k_cache.clone(), v_cache.clone()
    assert warm_up_attention(k_cache, v_cache, 4, torch.float32, trees=True) == 3 * 2 * 2 + 2
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def test_warm_up_halves_cover_the_whole(monkeypatch):
    """The plain half (start-up) and the tree-mask half (with speculation's deferred
    graphs) launch together exactly what one warm-up of both launches."""
    import specdec.kernels.prefill as prefill_module
    from specdec.kernels.warmup import warm_up_attention

    calls: list[tuple] = []
    real = prefill_module.paged_attention

    def record(q, k, v, meta, *args, **kw):
        calls.append((q.shape[0], meta.has_tree, kw["num_splits"]))
        return real(q, k, v, meta, *args, **kw)

    import specdec.kernels.warmup as warmup_module

    monkeypatch.setattr(warmup_module, "paged_attention", record)
    k_cache = torch.randn(8, 16, 2, 32, device=DEVICE)
    both = warm_up_attention(k_cache, k_cache, 4, torch.float32, trees=True)
    whole, calls[:] = sorted(calls), []
    plain = warm_up_attention(k_cache, k_cache, 4, torch.float32, trees=False)
    trees = warm_up_attention(k_cache, k_cache, 4, torch.float32, plain=False, trees=True)
    assert (plain, trees) == (3 * 2 + 2, 3 * 2) and plain + trees == both
    assert sorted(calls) == whole
    assert warm_up_attention(k_cache, k_cache, 4, torch.float32, plain=False, trees=False) == 0


# --- decode ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "head_dim", "block_size", "split_size", "block_n"),
    [
        (1, 64, 16, 16, 16),  # one iteration per split, many splits
        (3, 64, 16, 48, 16),  # 3 pages per split
        (3, 128, 32, 64, 32),
        (8, 128, 16, 32, 16),
        (8, 64, 32, None, 64),  # the heuristic (one split on CPU): the direct-write path
    ],
)
def test_decode_split_k_matches_reference(group, head_dim, block_size, split_size, block_n):
    rng = random.Random(group + head_dim + block_size)
    seq_lens = [rng.randint(1, 200) for _ in range(4)]
    seq_lens += [block_size, 2 * block_size + 1, 4 * block_size - 1]  # page boundaries
    case = make_case(
        [1] * len(seq_lens),
        seq_lens,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        num_padded=2,
        slack=37,
        seed=rng.randint(0, 99),
    )

    out = paged_decode(
        case.q,
        case.k_cache,
        case.v_cache,
        case.meta,
        case.scale,
        split_size=split_size,
        config=DecodeConfig(block_n=block_n),
    )

    ref = paged_decode_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)


def test_decode_splits_agree_with_each_other():
    """Any split size gives the same numbers (the combine is exact up to rounding)."""
    case = make_case([1, 1], [190, 97], group=3, seed=3)
    outs = [
        paged_decode(
            case.q,
            case.k_cache,
            case.v_cache,
            case.meta,
            case.scale,
            split_size=s,
            config=DecodeConfig(block_n=16),
        )
        for s in (16, 64, 256)
    ]
    torch.testing.assert_close(outs[0], outs[2], **TOL)
    torch.testing.assert_close(outs[1], outs[2], **TOL)


def test_plan_splits_covers_context_and_fills_the_gpu(monkeypatch):
    monkeypatch.setattr("specdec.kernels.launch.num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    for num_seqs, max_seq_len in [(1, 32768), (4, 4096), (256, 8192), (1, 1), (8, 100)]:
        plan = plan_splits(num_seqs * 3, max_seq_len, 128, cuda)
        assert plan.split_size % 128 == 0
        assert (
            (plan.num_splits - 1) * plan.split_size
            < max_seq_len
            <= plan.num_splits * plan.split_size
        )
    assert plan_splits(3, 32768, 128, cuda).num_splits >= 32  # batch 1: split for parallelism
    assert plan_splits(256 * 3, 8192, 128, cuda).num_splits == 1  # enough programs already
    assert plan_splits(6, 1000, 128, cuda, split_size=100).split_size == 128


# --- backend end to end ------------------------------------------------------------------


def fused_qkv_views(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one [num_tokens, (H + 2*KVH) * D] tensor, as a fused
    projection hands them to the backend."""
    t, h, d = case.q.shape
    kvh = case.k_new.shape[1]
    fused = torch.cat([x.reshape(t, -1) for x in (case.q, case.k_new, case.v_new)], dim=1)
    q, k, v = fused.split([h * d, kvh * d, kvh * d], dim=1)
    return q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)


@pytest.mark.parametrize(
    ("q_lens", "seq_lens"),
    [([1, 1, 1, 1], [1, 64, 100, 17]), ([1, 12, 40, 1], [90, 12, 100, 33])],
    ids=["decode_only", "mixed"],
)
def test_backend_forward_and_cache_match_torch_backend(q_lens, seq_lens):
    case = make_case(q_lens, seq_lens, group=3, num_kv_heads=3, num_padded=2, seed=len(q_lens))
    # The new tokens' slots start out holding poison; forward must write them.
    flat = case.meta.slot_mapping
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, *cache.shape[2:])[flat] = POISON
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    q, k, v = fused_qkv_views(case)

    backend = get_attention_backend("triton")
    assert isinstance(backend, TritonAttentionBackend)
    out = backend.forward(q, k, v, case.k_cache, case.v_cache, case.meta, case.scale)

    ref = TorchAttentionBackend().forward(q, k, v, k_ref, v_ref, case.meta, case.scale)
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)


def test_backend_forward_rope_matches_torch_backend():
    """The fused RoPE path (rotation inside the cache write) equals the reference
    backend's rotate-then-store on a mixed batch, output and cache."""
    case = make_case([1, 12, 40, 1], [90, 12, 100, 33], group=3, num_kv_heads=3, num_padded=2)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    q, k, v = fused_qkv_views(case)
    head_dim = q.shape[2]
    rotary = RotaryEmbedding(RopeParams(head_dim, 1e4, 4096), 512).to(DEVICE)
    positions = case.meta.seq_lens.new_tensor(range(q.shape[0])).long() * 3
    cos, sin = rotary(positions, q.dtype)

    backend = get_attention_backend("triton")
    assert backend.fuses_rope
    args = (case.meta, case.scale)
    out = backend.forward_rope(q, k, v, cos, sin, case.k_cache, case.v_cache, *args)

    reference = TorchAttentionBackend()
    assert not reference.fuses_rope
    ref = reference.forward_rope(q, k, v, cos, sin, k_ref, v_ref, *args)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(case.k_cache, k_ref, **TOL)
    assert torch.equal(case.v_cache, v_ref)


@pytest.mark.parametrize(
    ("q_lens", "seq_lens"),
    [([1, 1, 1, 1, 1], [1, 64, 200, 17, 33]), ([1, 4, 7, 1], [90, 12, 150, 33])],
    ids=["decode_only", "short_queries"],
)
def test_padded_references_ignore_nan_outside_every_context(q_lens, seq_lens):
    """The CPU backend's padded one-call paths (decode-only batches, short-query batches)
    gather every context padded to the longest: slots no context covers may hold anything
    (here NaN, which a zero attention weight would still spread) and must leave each
    output equal to the per-sequence loop's, which never reads them."""
    case = make_case(q_lens, seq_lens, group=3, num_kv_heads=3, num_padded=2, seed=11)
    expected = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    block_size = case.k_cache.shape[1]
    table = case.meta.block_tables.cpu()
    covered = torch.zeros(case.k_cache.shape[0] * block_size, dtype=torch.bool)
    for s, seq_len in enumerate(case.meta.seq_lens.tolist()):  # padding sequences: slot 0
        pos = torch.arange(seq_len)
        covered[table[s, pos // block_size].long() * block_size + pos % block_size] = True
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, *cache.shape[2:])[~covered.to(DEVICE)] = float("nan")
    padded = paged_decode_ref if max(q_lens) == 1 else paged_attention_batched_ref

    out = padded(case.q, case.k_cache, case.v_cache, case.meta, case.scale)

    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOL)


def test_mismatched_heads_are_rejected():
    case = make_case([3], [10], group=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        paged_attention(case.q[:, :5], case.k_cache, case.v_cache, case.meta, case.scale)


# --- GPU only ----------------------------------------------------------------------------


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("decode", [True, False])
def test_bf16_matches_fp32_reference(decode):
    rng = random.Random(11)
    q_lens, seq_lens = random_lengths(rng, 6, max_q=1 if decode else 300, max_ctx=3000)
    case = make_case(
        q_lens, seq_lens, group=3, num_kv_heads=3, num_padded=2, seed=5, dtype=torch.bfloat16
    )
    kernel, ref_fn = (
        (paged_decode, paged_decode_ref) if decode else (paged_attention, paged_attention_ref)
    )

    out = kernel(case.q, case.k_cache, case.v_cache, case.meta, case.scale)

    ref = ref_fn(case.q.float(), case.k_cache.float(), case.v_cache.float(), case.meta, case.scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@gpu_only
@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph():
    """Captured once with the bucket's bounds, replayed on new lengths and tables."""
    bound = make_case([1] * 8, [3000] * 8, group=3, num_kv_heads=3, seed=1)
    backend = TritonAttentionBackend()
    q, k, v = bound.q.clone(), bound.k_new.clone(), bound.v_new.clone()
    k_cache, v_cache, meta = bound.k_cache.clone(), bound.v_cache.clone(), bound.meta
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, k_cache, v_cache, meta, bound.scale)  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, meta, bound.scale)

    rng = random.Random(2)
    new = make_case(
        [1] * 8, [rng.randint(1, 3000) for _ in range(8)], group=3, num_kv_heads=3, seed=2
    )
    for dst, src in [
        (q, new.q),
        (k, new.k_new),
        (v, new.v_new),
        (meta.slot_mapping, new.meta.slot_mapping),
        (meta.seq_lens, new.meta.seq_lens),
    ]:
        dst.copy_(src)
    meta.block_tables.zero_()
    meta.block_tables[:, : new.meta.block_tables.shape[1]] = new.meta.block_tables
    k_cache[: new.k_cache.shape[0]] = new.k_cache
    v_cache[: new.v_cache.shape[0]] = new.v_cache
    graph.replay()

    ref = paged_decode_ref(new.q, new.k_cache, new.v_cache, new.meta, new.scale)
    torch.testing.assert_close(out, ref, **TOL)


# --- log_softmax_topk (a dynamic tree level's ranking) ---------------------------------


@pytest.mark.parametrize(
    ("shape", "k", "dtype"),
    [
        ((3, 16384), 8, torch.float32),  # a draft vocabulary: 16 whole chunks
        ((2, 4, 3000), 8, torch.bfloat16),  # [batch, n, vocab]; the last chunk partial
        ((5, 700), 1, torch.float32),  # one partial chunk
        ((2, 40), 40, torch.float32),  # k = vocab
    ],
)
def test_log_softmax_topk_equals_the_reference(shape, k, dtype):
    """Values (log-probabilities, descending) and ids equal the reference's; values are
    distinct here, so the ids must be the very same."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(shape, generator=gen).mul(4).to(dtype).to(DEVICE)
    if dtype == torch.bfloat16:  # bf16 rounding makes ties: keep the first of each value
        x = x.float() + torch.arange(shape[-1], device=DEVICE) * 1e-4
    values, ids = log_softmax_topk(x, k)
    ref_values, ref_ids = log_softmax_topk_ref(x, k)
    assert values.shape == ids.shape == (*shape[:-1], k)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64
    torch.testing.assert_close(values, ref_values, atol=1e-5, rtol=1e-5)
    assert torch.equal(ids, ref_ids)


def test_log_softmax_topk_breaks_ties_by_lowest_id():
    """Few distinct values (many ties across and within chunks), -inf entries and a row
    with fewer finite values than k: the k best by (value descending, id ascending), as a
    stable descending sort ranks them."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (4, 2500), generator=gen).float()
    x[1, 1000:] = float("-inf")
    x[2] = float("-inf")
    x[2, [2100, 7]] = 1.0  # two finite values, in two chunks
    x = x.to(DEVICE)
    k = 6
    values, ids = log_softmax_topk(x, k)
    logprobs = x.log_softmax(dim=-1)
    order = logprobs.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(ids, order.indices[:, :k])
    torch.testing.assert_close(values, order.values[:, :k], atol=1e-5, rtol=1e-5)
    assert ids[2].tolist() == [7, 2100, 0, 1, 2, 3]  # then -inf ids, lowest first


def test_log_softmax_topk_rejects_a_bad_k():
    with pytest.raises(ValueError, match=r"k=9 must be in \[1, min\(vocab=8"):
        log_softmax_topk(torch.zeros(2, 8, device=DEVICE), 9)


def test_log_softmax_topk_is_a_well_formed_custom_op():
    """The op torch.compile sees in the compiled draft region: fake (meta) shapes agree
    with the real kernel's outputs."""
    x = torch.randn(2, 3, 2048, device=DEVICE)
    torch.library.opcheck(torch.ops.specdec.log_softmax_topk.default, (x, 4))


def test_dynamic_tree_grown_with_the_kernel_equals_the_reference():
    """``grow_trees``' dynamic levels ranked by the kernel keep the same tree."""
    gen = torch.Generator().manual_seed(5)
    vocab, batch = 3000, 3
    table = torch.randn(vocab, vocab, generator=gen).to(DEVICE)  # next-token logits by token
    token_map = torch.randperm(vocab, generator=gen).to(DEVICE)

    def step(tokens, parent_rows, depth):  # [batch, n] -> [batch, n, vocab]
        return table[tokens % vocab] + depth

    shape = DynamicTreeShape(top_k=4, depth=4, total_tokens=20)
    roots = torch.tensor([1, 20, 300], device=DEVICE)
    ref = grow_trees(shape, roots, step, token_map=token_map)
    got = grow_trees(shape, roots, step, token_map=token_map, level_topk=log_softmax_topk)
    for name in ("token_ids", "parents", "depths", "ancestor_mask"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.token_ids.shape == (batch, 21)
