"""Stage 2, ``data-gen regenerate``: every conversation answered by the target itself,
turn by turn, on the specdec engine; written as JSONL shards (``regen-00000.jsonl``) of
records with ``conversations``, ``input_ids`` and ``loss_mask`` (``chat.py``). An answer's
tokens in ``input_ids`` are the ids the target generated (re-encoding its text can split
it differently), followed by the template's end of turn.

Turn by turn: a conversation's original assistant turns are dropped; for each user turn
the target answers the history so far (system, earlier users, its own earlier answers),
rendered with the chat template. All turns of all open conversations share one engine, so
batches stay large (continuous batching across conversations, turns and shards).

Shard ``i`` holds input conversations ``[i*R, (i+1)*R)`` (skipped ones leave no line) and
belongs to rank ``i % world_size``. Sampling is seeded per request from (seed, record id,
turn), so a redone shard gets the same answers whatever else shares its batches. Finished
conversations become records in worker processes (``record_pool``) while the engine runs;
a shard is written once all its records are built.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec.data_gen.chat import check_chat_template, render
from specdec.data_gen.record_pool import RecordPool, default_workers
from specdec.data_gen.records import Conversation, SkipCounts, dumps_record
from specdec.data_gen.shards import RankInfo, ShardStore, chunk_ranges, digest_json
from specdec.data_gen.sources import read_source
from specdec.data_gen.stage import finish_stage, write_plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegenerateConfig:
    """``engine`` holds ``LLM`` keyword arguments (device, dtype, max_num_seqs, ...).

    ``max_tokens`` bounds each answer; a turn whose prompt plus ``max_tokens`` does not fit
    ``max_model_len`` ends the conversation there (a first turn that does not fit skips it).
    """

    input: str
    output: str
    model: str = "smollm2-135m-instruct"
    engine: dict[str, Any] = field(default_factory=dict)
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 1024
    max_turns: int | None = None
    seed: int = 0
    chat_template: str | None = None  # a Jinja file overriding the tokenizer's
    records_per_shard: int = 1000
    max_inflight: int | None = None  # requests queued in the engine; default 4 x max_num_seqs
    verify: bool = True
    record_workers: int | None = None  # processes building records; None: by core count

    # Settings that change how fast shards are made, never what they hold: left out of the
    # shard digests, so changing them does not redo finished shards.
    RUN_ONLY = ("input", "output", "engine", "max_inflight", "verify", "record_workers")

    def __post_init__(self) -> None:
        if self.records_per_shard < 1:
            raise ValueError(f"records_per_shard={self.records_per_shard} must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns} must be >= 1 (or None for all)")
        if self.record_workers is not None and self.record_workers < 0:
            raise ValueError(
                f"record_workers={self.record_workers} must be >= 0 (0 builds records inline)"
            )


@dataclass
class _Conv:
    """One conversation in flight: the history so far and the user turns still to answer."""

    shard: int
    slot: int  # position within the shard
    conv: Conversation
    history: list[dict[str, str]]
    users: deque[str]
    turn: int = 0
    emitted: list[list[int]] = field(default_factory=list)  # per answer: the generated ids


@dataclass
class _Shard:
    records: list[dict | None]  # by slot; None while open or when skipped
    open: int  # conversations still generating
    counts: SkipCounts = field(default_factory=SkipCounts)
    generated_tokens: int = 0
    building: list[tuple[_Conv, Future]] = field(default_factory=list)  # records in the pool

    @property
    def ready(self) -> bool:
        return self.open == 0 and all(f.done() for _, f in self.building)

    def collect(self) -> None:
        """Move built records into their slots (every future done)."""
        for c, future in self.building:
            built = future.result()
            if isinstance(built, str):
                self.counts.add(built)
                continue
            input_ids, loss_mask = built
            self.records[c.slot] = {
                "id": c.conv.id,
                "source": c.conv.source,
                "conversations": c.history,
                "input_ids": input_ids,
                "loss_mask": loss_mask,
            }
        self.building = []


def request_seed(seed: int, record_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}\0{record_id}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # non-negative int64


def start_conversation(conv: Conversation, shard: int, slot: int, max_turns: int | None) -> _Conv:
    msgs = list(conv.messages)
    history = [msgs[0]] if msgs[0]["role"] == "system" else []
    users = [m["content"] for m in msgs if m["role"] == "user" and m["content"].strip()]
    return _Conv(shard, slot, conv, history, deque(users[:max_turns]))


class Regenerator:
    """Drives one ``LLMEngine`` over this rank's shards (``run``)."""

    def __init__(self, config: RegenerateConfig, llm) -> None:
        from specdec.sampling_params import RequestOutputKind, SamplingParams

        self.config = config
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        template = Path(config.chat_template).read_text() if config.chat_template else None
        if template is not None:
            self.tokenizer.chat_template = template
        check_chat_template(self.tokenizer, config.model)
        workers = config.record_workers
        self.records = RecordPool(
            self.tokenizer,
            self.engine.resolved.hf_dir,
            template,
            default_workers() if workers is None else workers,
        )
        self.max_model_len = self.engine.max_model_len
        self._params = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            max_tokens=config.max_tokens,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self._inflight: dict[str, _Conv] = {}
        self._shards: dict[int, _Shard] = {}
        max_seqs = self.engine.config.scheduler.max_num_seqs
        self.max_inflight = config.max_inflight or 4 * max_seqs
        self.generated_tokens = 0
        self.resolved = 0  # conversations finished or skipped

    def _submit(self, c: _Conv) -> bool:
        """Queue the next turn of ``c``; False when it does not fit the context."""
        history = [*c.history, {"role": "user", "content": c.users[0]}]
        ids = self.tokenizer.encode(
            render(self.tokenizer, history, add_generation_prompt=True), add_special_tokens=False
        )
        if len(ids) + self.config.max_tokens > self.max_model_len:
            return False
        params = replace(self._params, seed=request_seed(self.config.seed, c.conv.id, c.turn))
        request_id = f"{c.shard}/{c.slot}/{c.turn}"
        try:
            self.engine.add_request(ids, params, request_id=request_id)
        except ValueError as e:  # e.g. more KV blocks than the whole cache holds
            logger.debug("record %s turn %d rejected: %s", c.conv.id, c.turn, e)
            return False
        c.history = history
        self._inflight[request_id] = c
        return True

    def _advance(self, c: _Conv) -> None:
        """Submit the next turn, or finish the conversation."""
        shard = self._shards[c.shard]
        if c.users and self._submit(c):
            return
        if c.turn == 0:
            shard.counts.add("too_long")
        else:
            if c.users:
                shard.counts.add("turns_truncated")
            shard.building.append((c, self.records.build(c.history, c.emitted)))
        shard.open -= 1
        self.resolved += 1

    def open_shard(self, index: int, convs: list[Conversation]) -> None:
        self._shards[index] = _Shard([None] * len(convs), len(convs))
        for slot, conv in enumerate(convs):
            self._advance(start_conversation(conv, index, slot, self.config.max_turns))

    def step(self) -> None:
        """One engine step; finished turns are answered and the next ones queued."""
        for out in self.engine.step():
            if not out.finished:
                continue
            c = self._inflight.pop(out.request_id)
            completion = out.outputs[0]
            c.history.append({"role": "assistant", "content": completion.text})
            c.emitted.append(list(completion.token_ids))
            c.users.popleft()
            c.turn += 1
            n = len(completion.token_ids)
            self._shards[c.shard].generated_tokens += n
            self.generated_tokens += n
            self._advance(c)

    def finished_shards(self, block: bool = False) -> list[tuple[int, _Shard]]:
        """Shards whose conversations are all answered and records all built; ``block``
        first waits for the records of answered shards (when nothing else is left)."""
        if block:
            wait([f for s in self._shards.values() if s.open == 0 for _, f in s.building])
        ready = [(i, s) for i, s in self._shards.items() if s.ready]
        for i, shard in ready:
            shard.collect()
            del self._shards[i]
        return ready

    def close(self) -> None:
        self.records.close()

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def num_open_shards(self) -> int:
        return len(self._shards)


def shard_payload(shard: _Shard) -> tuple[bytes, dict[str, int]]:
    records = [r for r in shard.records if r is not None]
    data = "".join(dumps_record(r) + "\n" for r in records).encode()
    counts = {
        "records": len(records),
        "tokens": sum(len(r["input_ids"]) for r in records),
        "loss_tokens": sum(sum(r["loss_mask"]) for r in records),
        "generated_tokens": shard.generated_tokens,
        **shard.counts.as_dict(),
    }
    return data, counts


def run_regenerate(config: RegenerateConfig, rank: RankInfo | None = None, llm=None) -> dict:
    """Regenerate this rank's shards. Returns stats (``generated_tokens``, ``seconds``,
    ``tokens_per_s``) and ``manifest`` (None until every rank's shards exist)."""
    rank = rank or RankInfo.from_env()
    skipped = SkipCounts()
    convs = list(read_source(config.input, skipped))
    if not convs:
        raise ValueError(f"{config.input} holds no usable conversations ({skipped.as_dict()})")
    ranges = list(chunk_ranges(len(convs), config.records_per_shard))
    gen = {k: v for k, v in asdict(config).items() if k not in RegenerateConfig.RUN_ONLY}
    if config.chat_template:
        gen["chat_template"] = Path(config.chat_template).read_text()
    digests = [digest_json([gen, [c.to_json() for c in convs[a:b]]]) for a, b in ranges]
    header = {"stage": "regenerate", "target": config.model, "input": config.input, **gen}
    header["input_skipped"] = skipped.as_dict(prefix="")
    store = ShardStore(config.output, "regen", "jsonl")
    store.root.mkdir(parents=True, exist_ok=True)
    write_plan(store, digests, header)
    todo = deque(store.pending(digests, rank.owned(len(ranges)), verify=config.verify))
    stats: dict[str, Any] = {"generated_tokens": 0, "seconds": 0.0, "shards_written": 0}
    if todo:
        if llm is None:
            import torch

            from specdec.engine.llm import LLM

            if rank.world_size > 1 and torch.cuda.is_available():
                torch.cuda.set_device(rank.local_rank)  # "cuda" = this rank's GPU

            llm = LLM(config.model, **config.engine)
        stats.update(_drive(config, llm, store, todo, ranges, convs, digests))
    stats["manifest"] = finish_stage(store, digests, header, rank)
    return stats


def _drive(config, llm, store, todo, ranges, convs, digests) -> dict[str, Any]:
    regen = Regenerator(config, llm)
    total = sum(ranges[i][1] - ranges[i][0] for i in todo)
    bar = tqdm(total=total, desc=f"regenerate {store.root.name}", unit="conv")
    t0 = time.perf_counter()
    written = 0
    try:
        while todo or regen.num_inflight or regen.num_open_shards:
            while todo and regen.num_inflight < regen.max_inflight:
                i = todo.popleft()
                a, b = ranges[i]
                regen.open_shard(i, convs[a:b])
            if regen.num_inflight:
                regen.step()
            bar.update(regen.resolved - bar.n)
            # With nothing left to generate, wait for the last records instead of spinning.
            for i, shard in regen.finished_shards(block=not (todo or regen.num_inflight)):
                data, counts = shard_payload(shard)
                store.write(i, data, digests[i], counts)
                written += 1
            elapsed = time.perf_counter() - t0
            bar.set_postfix(gen_tok_s=f"{regen.generated_tokens / max(elapsed, 1e-9):,.0f}")
    finally:
        bar.close()
        regen.close()
    seconds = time.perf_counter() - t0
    return {
        "generated_tokens": regen.generated_tokens,
        "seconds": seconds,
        "tokens_per_s": regen.generated_tokens / seconds if seconds else 0.0,
        "shards_written": written,
    }
