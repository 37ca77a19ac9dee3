"""The one description of a forward's attention work: which cache slots each new token
writes and which cached context each query reads.

Cache layout (every backend, every layer): ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. A *slot* is ``block_id * block_size +
offset``. Block 0 is the null block: the block pool never hands it out, so padded tokens
(CUDA-graph batch padding) write there and padded sequences read it, harmlessly.

Sequences in a batch are laid out back to back (varlen). Sequence ``s`` contributes
``q_len = query_start_loc[s+1] - query_start_loc[s]`` new tokens and has ``seq_lens[s]``
tokens of context *including* them, so its new tokens sit at absolute positions
``seq_lens[s] - q_len ... seq_lens[s] - 1`` and query ``i`` attends causally to keys
``0 ... seq_lens[s] - q_len + i``. Decode is the case ``q_len == 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs. Tensors live on the model's device.

    Invariants: ``query_start_loc[0] == 0``, ``query_start_loc[-1] == num_tokens``,
    ``1 <= q_len <= seq_lens[s]``, ``seq_lens[s] <= block_tables.shape[1] * block_size``.
    ``max_query_len``/``max_seq_len`` are host ints (grid sizes; no device sync needed) and
    are upper bounds: a CUDA graph captures with the largest values it will ever replay.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V goes to
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # Host copies for the reference backend (it loops over sequences); None under CUDA graphs.
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        """Every sequence has exactly one new token (the decode kernel's case)."""
        return self.max_query_len == 1
