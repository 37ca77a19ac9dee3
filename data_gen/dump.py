"""Stage 3, ``data-gen dump``: the target runs over the regenerated conversations (prefill
only, no sampling) and stores, per token, what EAGLE-3 training reads. One safetensors
shard (``hidden-00000.safetensors``) holds a run of whole conversations:

    input_ids          [num_tokens] int32
    loss_mask          [num_tokens] bool     1 on assistant tokens
    aux_hidden_states  [num_tokens, 3 * hidden] dtype   residual streams entering the aux
                                             layers, concatenated low | mid | high
    hidden_states      [num_tokens, hidden] dtype   after the final norm: the target's
                                             logits are lm_head(hidden_states)
    cu_seqlens         [num_records + 1] int64   conversation boundaries
    spec_exit_confidence [num_tokens] float32    only when some input record carries
                                             SpecExit confidence labels (``data-gen
                                             exit-labels``): the label at each labelled
                                             token, NaN elsewhere (and in every shard)

and, in its metadata, one JSON string under ``specdec`` (record ids, target, dtype). The
manifest names the target, aux layer ids, dtype and every shard's sha256. Plan:
``dump_plan.py``.

GPU path: one forward per group of shards (``batch_tokens``), outputs cast to the storage
dtype on the device, copied into pinned host buffers without blocking, and serialised,
hashed and written by background threads while the next group computes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as save_safetensors
from tqdm.auto import tqdm

from specdec.data_gen.dump_plan import (
    CONFIDENCE_KEY,
    DumpGroup,
    TokenRecord,
    parse_token_record,
    plan_groups,
    plan_shards,
)
from specdec.data_gen.records import SkipCounts
from specdec.data_gen.shards import RankInfo, ShardStore, digest_json
from specdec.data_gen.sources import read_stage_records
from specdec.data_gen.stage import finish_stage, write_plan
from specdec.data_gen.target import DTYPES, TargetForward
from specdec.data_gen.writers import HostBuffers, ShardWriters

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DumpConfig:
    """``dtype``: what is stored (bf16 by default; float32 for exact comparisons).
    ``compute_dtype``: the model's ("auto": bf16 on GPU, float32 on CPU)."""

    input: str
    output: str
    model: str = "smollm2-135m-instruct"
    device: str = "auto"
    compute_dtype: str = "auto"
    dtype: str = "bfloat16"
    attention_backend: str = "auto"
    aux_layer_ids: tuple[int, ...] | None = None  # None: EAGLE-3's (2, N//2, N-3)
    max_seq_len: int = 4096
    shard_bytes: int = 16 << 20
    batch_tokens: int = 65536
    block_size: int = 16
    num_writers: int = 4
    verify: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid; choose one of {sorted(DTYPES)}")
        if self.compute_dtype != "auto" and self.compute_dtype not in DTYPES:
            raise ValueError(
                f"compute_dtype={self.compute_dtype!r}; choose auto or one of {sorted(DTYPES)}"
            )
        for name in ("max_seq_len", "shard_bytes", "batch_tokens", "num_writers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


def load_records(root: str, vocab_size: int, max_seq_len: int, skipped: SkipCounts):
    out: list[TokenRecord] = []
    for obj in tqdm(read_stage_records(root, skipped), desc="read records", unit="rec"):
        rec = parse_token_record(obj, vocab_size, max_seq_len, skipped)
        if rec is not None:
            out.append(rec)
    return out


def shard_bytes_of(
    records: list[TokenRecord],
    aux: torch.Tensor,
    hidden: torch.Tensor,
    meta: dict[str, str],
    confidence: bool = False,  # store CONFIDENCE_KEY (NaN for records without labels)
) -> bytes:
    lengths = [len(r.input_ids) for r in records]
    tensors = {
        "input_ids": torch.from_numpy(np.concatenate([r.input_ids for r in records])),
        "loss_mask": torch.from_numpy(np.concatenate([r.loss_mask for r in records])),
        "aux_hidden_states": aux,
        "hidden_states": hidden,
        "cu_seqlens": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
    }
    if confidence:
        labels = [r.confidence if r.confidence is not None
                  else np.full(len(r.input_ids), np.nan, dtype=np.float32)
                  for r in records]  # fmt: skip
        tensors[CONFIDENCE_KEY] = torch.from_numpy(np.concatenate(labels))
    # One metadata key: safetensors writes the metadata map in hash order, which varies
    # between processes, and shards must be byte-identical across runs.
    info = json.dumps({**meta, "record_ids": [r.id for r in records]}, sort_keys=True)
    return save_safetensors(tensors, metadata={"specdec": info})


def run_dump(config: DumpConfig, rank: RankInfo | None = None) -> dict[str, Any]:
    """Dump this rank's groups. Returns stats (``tokens``, ``seconds``, ``tokens_per_s``)
    and ``manifest`` (None until every rank's shards exist)."""
    from specdec.data_gen.shards import load_manifest
    from specdec.models import load_config

    rank = rank or RankInfo.from_env()
    model_config = load_config(config.model)
    skipped = SkipCounts()
    records = load_records(config.input, model_config.vocab_size, config.max_seq_len, skipped)
    if not records:
        raise ValueError(f"{config.input} holds no usable records ({skipped.as_dict()})")
    from specdec.models.eagle3_head import default_aux_layer_ids

    aux_ids = tuple(config.aux_layer_ids or default_aux_layer_ids(model_config.num_layers))
    hidden_size = model_config.hidden_size
    elem = torch.empty((), dtype=DTYPES[config.dtype]).element_size()
    per_token = (len(aux_ids) + 1) * hidden_size * elem + 4 + 1  # + int32 id + bool mask
    shards = plan_shards([len(r.input_ids) for r in records], per_token, config.shard_bytes)
    groups = plan_groups(shards, config.batch_tokens)
    confidence = any(r.confidence is not None for r in records)
    header = {
        "stage": "dump",
        "target": config.model,
        "input": config.input,
        "input_manifest_shards": [s["sha256"] for s in load_manifest(config.input)["shards"]],
        "aux_layer_ids": list(aux_ids),
        "num_layers": model_config.num_layers,
        "hidden_size": hidden_size,
        "vocab_size": model_config.vocab_size,
        "dtype": config.dtype,
        "compute_dtype": config.compute_dtype,
        "max_seq_len": config.max_seq_len,
        "tensors": {
            "input_ids": "[num_tokens] int32",
            "loss_mask": "[num_tokens] bool",
            "aux_hidden_states": f"[num_tokens, {len(aux_ids) * hidden_size}] {config.dtype}",
            "hidden_states": f"[num_tokens, {hidden_size}] {config.dtype} (final-normed)",
            "cu_seqlens": "[num_records + 1] int64",
            **({CONFIDENCE_KEY: "[num_tokens] float32 (NaN: no label)"} if confidence else {}),
        },
        "input_skipped": skipped.as_dict(prefix=""),
    }
    digests = [
        digest_json(
            [
                header,
                # The forward batches and backend decide the exact float bits.
                [config.batch_tokens, config.device, config.attention_backend],
                [
                    # Labels join the digest only when there are some: older dumps keep theirs.
                    (r.id, r.input_ids.tolist(), r.loss_mask.tolist())
                    + ((r.confidence_labels(),) if confidence else ())
                    for r in records[s.start : s.end]
                ],
            ]
        )
        for s in shards
    ]
    store = ShardStore(config.output, "hidden", "safetensors")
    store.root.mkdir(parents=True, exist_ok=True)
    write_plan(store, digests, header)
    owned = [s.index for g in groups if rank.owns(g.index) for s in g.shards]
    pending = set(store.pending(digests, owned, verify=config.verify))
    todo = [g for g in groups if rank.owns(g.index) and any(s.index in pending for s in g.shards)]
    stats: dict[str, Any] = {"tokens": 0, "seconds": 0.0, "shards_written": 0}
    if todo:
        stats.update(_dump_groups(config, rank, store, records, todo, pending, header))
    stats["manifest"] = finish_stage(store, digests, header, rank)
    return stats


def _dump_groups(config, rank, store, records, todo: list[DumpGroup], pending, header):
    forward = TargetForward.for_dump(config, rank.local_rank)
    storage = DTYPES[config.dtype]
    hidden_size = header["hidden_size"]
    aux_width = len(header["aux_layer_ids"]) * hidden_size
    max_tokens = max(g.num_tokens for g in todo)
    pin = forward.device.type == "cuda"
    buffers = [
        HostBuffers(
            torch.empty((max_tokens, aux_width), dtype=storage, pin_memory=pin),
            torch.empty((max_tokens, hidden_size), dtype=storage, pin_memory=pin),
        )
        for _ in range(2)
    ]
    writers = ShardWriters(config.num_writers, buffers)
    meta = {"format": "specdec.data_gen.hidden.v1", "target": config.model, "dtype": config.dtype}
    digests = json.loads((store.root / "plan.json").read_text())["digests"]
    confidence = CONFIDENCE_KEY in header["tensors"]
    total = sum(g.num_tokens for g in todo)
    bar = tqdm(total=total, desc=f"dump {Path(config.output).name}", unit="tok", unit_scale=True)
    t0 = time.perf_counter()
    try:
        for group in todo:
            writers.check()
            recs = [records[i] for i in group.records]
            lengths = np.array([len(r.input_ids) for r in recs], dtype=np.int64)
            ids = np.concatenate([r.input_ids for r in recs])
            hidden, aux = forward(ids, lengths)
            buf = writers.free.get()
            n = ids.shape[0]
            buf.aux[:n].copy_(aux.to(storage), non_blocking=pin)
            buf.hidden[:n].copy_(hidden.to(storage), non_blocking=pin)
            event = None
            if pin:
                event = torch.cuda.Event()
                event.record()
            writes, row = [], 0
            for shard in group.shards:
                rows = sum(len(records[i].input_ids) for i in range(shard.start, shard.end))
                if shard.index in pending:
                    writes.append(
                        _shard_write(
                            store, shard, records, buf, row, rows, meta, digests, confidence
                        )
                    )
                row += rows
            if writes:
                writers.submit(writes, buf, event)
            else:
                writers.free.put(buf)
            bar.update(n)
    finally:
        bar.close()
        writers.close()
    seconds = time.perf_counter() - t0
    return {
        "tokens": total,
        "seconds": seconds,
        "tokens_per_s": total / seconds,
        "shards_written": writers.written,
    }


def _shard_write(
    store, shard, records, buf: HostBuffers, row: int, rows: int, meta, digests, confidence: bool
):
    def write() -> None:
        recs = records[shard.start : shard.end]
        aux, hidden = buf.aux[row : row + rows], buf.hidden[row : row + rows]
        data = shard_bytes_of(recs, aux, hidden, meta, confidence)
        counts = {
            "records": len(recs),
            "tokens": rows,
            "loss_tokens": int(sum(int(r.loss_mask.sum()) for r in recs)),
        }
        store.write(shard.index, data, digests[shard.index], counts)

    return write
