"""The block drafter's attention kernel (specdec/kernels/block_attention.py) against its
PyTorch reference: paged context read through scattered pages, the block's own keys both
ways, GQA, an empty context and contexts past one key tile. Runs compiled on CUDA, under
the Triton interpreter elsewhere (TRITON_INTERPRET=1 before triton is imported)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from specdec.kernels.block_attention import BLOCK_N, block_attention, block_attention_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def _case(block: int, heads: int, kv_heads: int, head_dim: int, lens: list[int], page: int,
          dtype: torch.dtype, seed: int = 0):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    n = len(lens)
    pages_each = max(1, -(-max(lens) // page))
    num_pages = n * pages_each + 3
    # Each request's pages scattered over the cache, never shared.
    perm = torch.randperm(num_pages, generator=g)[: n * pages_each].view(n, pages_each)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    return dict(
        q=rand(n * block, heads, head_dim),
        k=rand(n * block, kv_heads, head_dim),
        v=rand(n * block, kv_heads, head_dim),
        k_cache=rand(num_pages * page, kv_heads, head_dim),
        v_cache=rand(num_pages * page, kv_heads, head_dim),
        block_tables=perm.to(DEVICE, torch.int32),
        context_lens=torch.tensor(lens, device=DEVICE, dtype=torch.int32),
    ), dict(block_size=block, page_size=page, scale=head_dim**-0.5)


@pytest.mark.parametrize(
    "block, heads, kv_heads, head_dim, lens, page",
    [
        (4, 9, 3, 64, [0, 5, BLOCK_N + 7], 4),  # SmolLM2's heads; empty, short, two tiles
        (16, 9, 3, 64, [2 * BLOCK_N, 1], 16),  # a 16-token block: 48 rows padded to 64
        (8, 4, 4, 48, [33, 130, 64], 8),  # no GQA, head_dim off a power of two
    ],
)
def test_kernel_equals_reference(block, heads, kv_heads, head_dim, lens, page) -> None:
    dtype = torch.float32
    tensors, kw = _case(block, heads, kv_heads, head_dim, lens, page, dtype)
    got = block_attention(**tensors, **kw)
    want = block_attention_ref(**tensors, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 dots: compiled kernels only")
def test_kernel_equals_reference_in_bf16() -> None:
    tensors, kw = _case(16, 9, 3, 64, [300, 0, 1500, 17], 16, torch.bfloat16, seed=1)
    got = block_attention(**tensors, **kw).float()
    want = block_attention_ref(**tensors, **kw).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_a_blocks_output_depends_only_on_its_own_context_and_block() -> None:
    """A block's rows are the same alone as beside others (other requests' pages, lengths
    and keys change nothing), and the cache past its context is never read."""
    tensors, kw = _case(4, 9, 3, 64, [70, 9, 40], 4, torch.float32, seed=2)
    together = block_attention(**tensors, **kw)
    alone = dict(tensors)  # the second block (rows 4..7) alone; the same caches
    for name in ("q", "k", "v"):
        alone[name] = tensors[name][4:8]
    for name in ("block_tables", "context_lens"):
        alone[name] = tensors[name][1:2]
    garbage = alone["k_cache"].clone()
    pos = torch.arange(9, device=DEVICE)
    slots = alone["block_tables"][0, pos // 4].long() * 4 + pos % 4
    keep = torch.zeros(garbage.shape[0], dtype=torch.bool, device=DEVICE)
    keep[slots] = True
    garbage[~keep] = float("nan")  # rows outside the context: never read
    alone["k_cache"] = garbage
    torch.testing.assert_close(block_attention(**alone, **kw), together[4:8], atol=0, rtol=0)


def test_bad_shapes_name_the_value() -> None:
    tensors, kw = _case(4, 9, 3, 64, [3, 4], 4, torch.float32)
    with pytest.raises(ValueError, match="block_size=5"):
        block_attention(**tensors, **{**kw, "block_size": 5})
    with pytest.raises(ValueError, match="not a multiple"):
        block_attention(**{**tensors, "q": tensors["q"][:, :8]}, **kw)
