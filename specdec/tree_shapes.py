"""The shapes a draft can take: a chain, a static tree (fixed choices) or a dynamic tree
(EAGLE-2: the top_k best frontier nodes expand each level). Plain values, validated on
construction; the speculation config (``specdec.config``) names them and
``specdec.spec.tree`` grows drafts of each.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChainShape:
    """``k`` draft tokens in a line: each node's single child is its top-ranked token."""

    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"ChainShape(k={self.k!r}) is invalid; use k >= 1 draft tokens")

    @property
    def max_draft_tokens(self) -> int:
        return self.k

    @property
    def depth(self) -> int:
        return self.k

    @property
    def num_expanded(self) -> int:
        """Draft nodes that get children (queried for the next level): all but the last."""
        return self.k - 1

    def as_static(self) -> StaticTreeShape:
        return StaticTreeShape([(0,) * d for d in range(1, self.k + 1)])


@dataclass(frozen=True)
class StaticTreeShape:
    """A fixed tree given as choice paths, one per draft node.

    ``(r0, r1, ..., rd)`` is the node reached by taking the root's rank-``r0`` child, then
    that node's rank-``r1`` child, and so on (rank 0 = best). Every proper prefix of a path
    must itself be a path. Nodes are numbered by (depth, path), so siblings come best-ranked
    first and parents before children.
    """

    choices: tuple[tuple[int, ...], ...]

    def __init__(self, choices: list[tuple[int, ...]] | list[list[int]]) -> None:
        paths = [tuple(c) for c in choices]
        if not paths:
            raise ValueError("StaticTreeShape needs at least one choice path, e.g. [(0,)]")
        seen: set[tuple[int, ...]] = set()
        for path in paths:
            if not path or any(not isinstance(r, int) or r < 0 for r in path):
                raise ValueError(
                    f"choice {path} is invalid; a choice is a non-empty tuple of ranks >= 0"
                )
            if path in seen:
                raise ValueError(f"choice {path} appears twice; list each node once")
            seen.add(path)
        for path in paths:
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(
                    f"choice {path} has no parent {path[:-1]}; add {path[:-1]} (every prefix "
                    "of a choice must be a choice)"
                )
        object.__setattr__(self, "choices", tuple(sorted(paths, key=lambda p: (len(p), p))))

    @property
    def max_draft_tokens(self) -> int:
        return len(self.choices)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.choices)

    @property
    def num_expanded(self) -> int:
        """Draft nodes (not the root) that get children."""
        return len({p[:-1] for p in self.choices if len(p) > 1})

    def ranks_contiguous(self) -> bool:
        """True when every node's children have ranks 0, 1, ..., m-1 (no gaps)."""
        present = set(self.choices)
        return all(p[-1] == 0 or (*p[:-1], p[-1] - 1) in present for p in self.choices)


@dataclass(frozen=True)
class DynamicTreeShape:
    """EAGLE-2's dynamic tree: ``depth`` levels, ``top_k`` children per expanded node,
    at most ``top_k`` expanded nodes per level, ``total_tokens`` draft nodes kept."""

    top_k: int
    depth: int
    total_tokens: int

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "total_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicTreeShape {name}={value!r} is invalid; use >= 1")
        if self.total_tokens > self.num_candidates:
            raise ValueError(
                f"total_tokens={self.total_tokens} exceeds the {self.num_candidates} "
                f"candidates that top_k={self.top_k}, depth={self.depth} can grow; lower "
                "total_tokens or raise top_k/depth"
            )

    @property
    def num_candidates(self) -> int:
        """Nodes grown before reranking: top_k at depth 1, top_k**2 at each deeper level."""
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def max_draft_tokens(self) -> int:
        return self.total_tokens

    @property
    def num_expanded(self) -> int:
        """Draft nodes that get children: the top_k frontier of every level but the last."""
        return self.top_k * (self.depth - 1)


TreeShape = ChainShape | StaticTreeShape | DynamicTreeShape
