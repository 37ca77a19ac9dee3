"""The target model's prefill over packed whole sequences, on a scratch paged cache."""

from __future__ import annotations

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prefill_inputs(lengths: np.ndarray, block_size: int, device: torch.device):
    """Positions and attention metadata for prefilling whole sequences back to back into
    a scratch cache: sequence ``s`` owns consecutive blocks after the null block 0."""
    from specdec.ops.attention_metadata import AttentionMetadata

    blocks = -(-lengths // block_size)  # [num_seqs]
    first = 1 + np.concatenate([[0], np.cumsum(blocks)[:-1]])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    total = int(starts[-1])
    within = np.arange(total) - np.repeat(starts[:-1], lengths)  # [num_tokens]
    slots = np.repeat(first, lengths) * block_size + within
    width = int(blocks.max())
    table = first[:, None] + np.arange(width)[None, :]
    table = np.where(np.arange(width)[None, :] < blocks[:, None], table, 0)

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        slot_mapping=dev(slots, torch.int64),
        query_start_loc=dev(starts, torch.int32),
        seq_lens=dev(lengths, torch.int32),
        block_tables=dev(table, torch.int32),
        max_query_len=int(lengths.max()),
        max_seq_len=int(lengths.max()),
        query_lens_cpu=lengths.tolist(),
        seq_lens_cpu=lengths.tolist(),
    )
    return dev(within, torch.int64), meta, int(blocks.sum()) + 1


class TargetForward:
    """The target model over a scratch paged cache: ``(ids, lengths) -> (hidden, aux)``:
    final-normed hidden states and the aux residual streams of every token, for whole
    sequences packed back to back (data_gen's dump; train-draft's online mode)."""

    def __init__(
        self,
        model: str,
        *,
        device: str | torch.device = "auto",
        dtype: torch.dtype | None = None,  # None: bf16 on GPU, float32 on CPU
        attention_backend: str = "auto",  # auto: triton on GPU, torch on CPU
        aux_layer_ids: tuple[int, ...] | None = None,  # None: EAGLE-3's (2, N//2, N-3)
        max_seq_len: int = 4096,
        block_size: int = 16,
    ) -> None:
        from specdec.models import load_model, resolve_model
        from specdec.models.eagle3_head import default_aux_layer_ids

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
        if attention_backend == "auto":
            attention_backend = "triton" if on_gpu else "torch"
        self.model_name = model
        self.resolved = resolve_model(model)
        self.model = load_model(
            self.resolved,
            dtype=self.dtype,
            device=self.device,
            attention=attention_backend,
            max_positions=max_seq_len,
        )
        c = self.model.config
        self.aux_layer_ids = tuple(aux_layer_ids or default_aux_layer_ids(c.num_layers))
        self.block_size = block_size
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._cache_blocks = 0

    @classmethod
    def for_dump(cls, config, local_rank: int = 0) -> TargetForward:
        """From a ``DumpConfig``; device ``auto`` is this rank's GPU."""
        device = config.device
        if device == "auto" and torch.cuda.is_available():
            device = f"cuda:{local_rank}"
        return cls(
            config.model,
            device=device,
            dtype=None if config.compute_dtype == "auto" else DTYPES[config.compute_dtype],
            attention_backend=config.attention_backend,
            aux_layer_ids=config.aux_layer_ids,
            max_seq_len=config.max_seq_len,
            block_size=config.block_size,
        )

    def _scratch(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if num_blocks > self._cache_blocks:
            c = self.model.config
            shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
            self._cache = []  # free the old cache before allocating the larger one
            self._cache = [
                tuple(torch.empty(shape, dtype=self.dtype, device=self.device) for _ in "kv")
                for _ in range(c.num_layers)
            ]
            self._cache_blocks = num_blocks
        return self._cache

    @torch.inference_mode()
    def __call__(
        self, ids: np.ndarray, lengths: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, hidden], [num_tokens, 3 * hidden]
        positions, meta, num_blocks = prefill_inputs(lengths, self.block_size, self.device)
        input_ids = torch.from_numpy(ids.astype(np.int64)).to(self.device)
        hidden, aux = self.model(
            input_ids, positions, self._scratch(num_blocks), meta, self.aux_layer_ids
        )
        return hidden, aux
