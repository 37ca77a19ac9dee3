"""The draft shapes a shipped or trained head records as its defaults (``tree_defaults`` in
its ``config.json``). Torch-free: a server resolves its default speculation from a head's
config before the engine (and torch) loads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TreeDefaults:
    """The draft tree a head was tuned for, in ``SpeculativeConfig``'s terms (same field
    names and meaning): ``tree`` "chain" drafts ``num_speculative_tokens`` tokens in a line;
    "dynamic" grows an EAGLE-2 tree of that depth with ``top_k`` children per node and
    keeps the ``total_tokens`` best nodes; above ``disable_by_batch_size`` running requests
    the engine decodes plainly (where the benchmark showed speculation stops paying; None:
    always on); ``num_speculative_tokens_by_batch_size`` ``[[max_batch, k | shape], ...]``
    gives smaller batches another depth or shape (``config.Band``: where the benchmark
    showed a deeper draft, or a tree, pays there). The engine's speculation config may
    override."""

    tree: str
    num_speculative_tokens: int
    top_k: int = 1
    total_tokens: int = 1
    disable_by_batch_size: int | None = None
    num_speculative_tokens_by_batch_size: list[list] | None = None

    def __post_init__(self) -> None:
        if self.tree not in ("chain", "dynamic"):
            raise ValueError(f"tree defaults: tree={self.tree!r}; choose chain or dynamic")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"tree defaults: num_speculative_tokens={self.num_speculative_tokens} must be >= 1"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"tree defaults: disable_by_batch_size={self.disable_by_batch_size} must be "
                ">= 1 (or null: always speculate)"
            )
        if self.tree == "dynamic" and not 1 <= self.top_k <= self.total_tokens:
            raise ValueError(
                f"tree defaults: a dynamic tree needs 1 <= top_k ({self.top_k}) <= "
                f"total_tokens ({self.total_tokens})"
            )
        from specdec.config import check_depth_bands, make_shape

        fields = {
            "tree": self.tree,
            "num_speculative_tokens": self.num_speculative_tokens,
            "top_k": self.top_k,
            "total_tokens": self.total_tokens,
            "choices": None,
        }
        try:
            check_depth_bands(
                self.num_speculative_tokens_by_batch_size, self.tree, self.disable_by_batch_size
            )
            for _, band in self.num_speculative_tokens_by_batch_size or []:
                if isinstance(band, dict):
                    make_shape(**{**fields, **{k: v for k, v in band.items() if k != "device"}})
        except ValueError as e:
            raise ValueError(f"tree defaults: {e}") from e
