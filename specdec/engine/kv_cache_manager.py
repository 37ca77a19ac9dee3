"""Per-request block tables on top of the block pool, with prefix caching.

A request's full blocks are hashed (chained: each hash covers the whole prefix up to the
block's end), so a new request whose prompt starts with the same full blocks reuses their
K/V instead of recomputing it — a shared system prompt is computed once.
"""

from __future__ import annotations

from specdec.engine.block_pool import BlockHash, BlockPool
from specdec.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._num_cached_blocks: dict[str, int] = {}  # request_id -> blocks registered

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Hash every full block among the first ``num_tokens`` tokens (append-only)."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1].value if i else None
            hashes.append(BlockHash(parent, tuple(request.token_ids(i * bs, (i + 1) * bs))))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks that hold a prefix of the request's tokens. At least one token is
        always left to compute, because its logits produce the next token."""
        if not self.enable_prefix_caching:
            return []
        self._extend_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for ``num_new_tokens`` (+ lookahead) beyond the computed tokens.

        ``computed_blocks`` (prefix-cache hits, only at admission) are attached first and
        advance ``num_computed_tokens``. Returns False, changing nothing, when the pool
        cannot supply the blocks.
        """
        bs = self.block_size
        if not computed_blocks:
            # Decoding: the request's blocks usually hold the new slots already.
            num_computed = request.num_computed_tokens
            if num_computed + num_new_tokens + num_lookahead_tokens <= len(request.block_ids) * bs:
                self._register_full_blocks(request, num_computed + num_new_tokens)
                return True
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * bs
        total = num_computed + num_new_tokens + num_lookahead_tokens
        needed = cdiv(total, bs) - len(request.block_ids) - len(computed_blocks)
        # Hits that sit in the free queue stop being free once touched.
        revived = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if max(needed, 0) + revived > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
            request.num_computed_tokens = num_computed
            self._num_cached_blocks[request.request_id] = len(request.block_ids)
        if needed > 0:
            request.block_ids.extend(self.pool.allocate(needed))
        self._register_full_blocks(request, num_computed + num_new_tokens)
        return True

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish blocks that will be full once ``num_tokens`` tokens are computed. They are
        published before the forward that fills them: within one forward every layer writes
        K/V before any attention reads it, so a same-step reader still sees them."""
        if not self.pool.enable_prefix_caching:
            return
        num_tokens = min(num_tokens, request.num_tokens)
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:  # no block filled up (hashes already cover the first ``start``)
            return
        self._extend_hashes(request, num_tokens)
        for i in range(start, end):
            self.pool.cache(request.block_ids[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first) and forget its table."""
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        self._num_cached_blocks.pop(request.request_id, None)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release blocks beyond those needed for ``num_tokens`` slots (speculation's
        rollback of rejected lookahead slots)."""
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(request.block_ids):
            extra = request.block_ids[keep:]
            del request.block_ids[keep:]
            self.pool.free(list(reversed(extra)))
            done = self._num_cached_blocks.get(request.request_id, 0)
            self._num_cached_blocks[request.request_id] = min(done, keep)
