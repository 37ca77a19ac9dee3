"""Physical KV blocks: a free list, reference counts and the prefix-cache hash table.

Invariants:
- Block 0 is the null block. It is never handed out; padded tokens write into it.
- A block is in the free queue iff its ``ref_cnt`` is 0. Free blocks keep their hash, so
  a later request with the same prefix can revive them (prefix caching); the least
  recently freed block is reused first, and reusing it drops its hash.
- ``ref_cnt`` counts the requests whose block table holds the block (prefix sharing).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class BlockHash:
    """Key of one full block: chained through the parent so equal token ids at different
    prefixes never collide. ``tokens`` is kept to make a hash collision harmless."""

    parent: int | None
    tokens: tuple[int, ...]

    @property
    def value(self) -> int:
        return hash((self.parent, self.tokens))


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns ``num_blocks`` blocks (including the null block)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the null block plus one more")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1  # pinned forever
        # Insertion order = eviction order (least recently freed first).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 .. 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks off the free queue (ref_cnt 0 → 1). Caller checks capacity."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its cached contents
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Share cached blocks with one more request (revives free cached blocks)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue in
        the given order (callers pass a request's blocks tail first, so shared prefixes
        outlive the suffixes that depend on them)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0 or block_id == NULL_BLOCK_ID:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        self.prefix_queries += 1
        block_id = self._cached.get(block_hash)
        if block_id is not None:
            self.prefix_hits += 1
        return block_id

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that ``block_id`` holds the full block ``block_hash``. If another block
        already holds the same contents, the first one stays the canonical copy."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, block_id)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.block_id != NULL_BLOCK_ID:
                block.block_hash = None
        self._cached.clear()
