"""``train_sft(config)``: full fine-tuning of a target model on chat records, top to bottom.

The model is our own ``CausalLM`` (``load_model`` returns it frozen; the copy trained here
has ``requires_grad_(True)``), run outside the engine through ``packed_attention`` on
packed sequences. Loss: token-mean cross-entropy on assistant tokens only
(``sft_data.shift_labels``). AdamW (no weight decay on norms), linear warmup + cosine,
gradient clipping, accelerate for devices, DDP and mixed precision — the loop, logging
and checkpoints are train-draft's (``trainer.py``, ``checkpoint.py``): with
``run.resume`` a killed run continues exactly from its newest checkpoint.

At the end the model is written in HF layout to ``<output_dir>/<export.name>``
(``models.hf_save``: safetensors shards of at most ``export.shard_mb``, the base's
config, tokenizer and chat template, and ``specdec_sft.json`` with the recipe and final
figures), ready for ``specdec generate --model <that dir>``. With ``lora.rank`` > 0 the
base stays frozen, low-rank updates train (``models.lora``), and the export is a PEFT
adapter directory naming the base: a few MB that every loader here merges.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from specdec.train import checkpoint
from specdec.train.data import Schedule
from specdec.train.loop import (
    KILL_ENV,
    RunLogger,
    TimeLimit,
    evaluate_shards,
    lr_schedule,
    optimizer_step,
)
from specdec.train.packed_attention import PackedMeta, packed_attention
from specdec.train.sft_config import SFTConfig
from specdec.train.sft_data import ChatRecords, SFTBatch, read_chat_records, spread

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class SFTOutput:
    loss: torch.Tensor  # []: mean cross-entropy over the batch's labelled positions
    correct: torch.Tensor  # []: labelled positions whose argmax is the label
    count: int  # labelled positions


class SFTModel(nn.Module):
    """``forward(batch) -> SFTOutput``: the whole objective in one module call (one
    forward per backward, as DDP and DeepSpeed want)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, batch: SFTBatch) -> SFTOutput:
        meta = PackedMeta(batch.cu_seqlens, batch.lengths)
        caches = [(None, None)] * self.lm.config.num_layers  # no cache: PackedMeta attends
        hidden, _ = self.lm(batch.input_ids, batch.positions, caches, meta)
        count = batch.loss_index.shape[0]
        if count == 0:  # every labelled token was cut by max_seq_len: nothing to learn
            zero = hidden.sum() * 0.0
            return SFTOutput(zero, zero.detach(), 0)
        logits = self.lm.compute_logits(hidden.index_select(0, batch.loss_index))  # [m, vocab]
        targets = batch.labels.index_select(0, batch.loss_index)
        loss = F.cross_entropy(logits, targets)
        correct = (logits.detach().argmax(-1) == targets).sum()
        return SFTOutput(loss, correct, count)


@dataclass
class Tally:
    """Sums over micro-batches (device tensors until logged)."""

    loss: torch.Tensor | float = 0.0  # sum of loss * count (token-weighted)
    correct: torch.Tensor | float = 0.0
    count: int = 0
    tokens: int = 0

    def add(self, out: SFTOutput, tokens: int) -> None:
        self.loss = self.loss + out.loss.detach() * out.count
        self.correct = self.correct + out.correct
        self.count += out.count
        self.tokens += tokens

    def summary(self, accelerator, prefix: str) -> dict[str, Any]:
        """Figures over every process (a collective call: all processes must call it)."""
        t = torch.stack(
            [
                torch.as_tensor(x, dtype=torch.float64, device=accelerator.device)
                for x in (self.loss, self.correct, self.count, self.tokens)
            ]
        )
        loss, correct, count, tokens = accelerator.reduce(t, reduction="sum").tolist()
        return {
            f"{prefix}loss": loss / count if count else float("nan"),
            f"{prefix}acc": correct / count if count else float("nan"),
            f"{prefix}tokens": int(tokens),
            f"{prefix}loss_tokens": int(count),
        }


def build_model(config: SFTConfig, device: torch.device):
    """The base model, trainable, on ``device`` in float32 (autocast does mixed precision),
    with packed attention; and the directory it came from."""
    from specdec.models import load_model, resolve_model

    resolved = resolve_model(config.model.base)
    lm = load_model(
        resolved,
        dtype=torch.float32,
        device=device,
        attention=packed_attention(config.model.attention, device),
        max_positions=config.data.max_seq_len,
    )
    if config.lora.enabled:
        from specdec.models.lora import apply_lora

        apply_lora(lm, config.lora.spec())  # the base stays frozen
        return lm.train(), resolved
    return lm.requires_grad_(True).train(), resolved


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on norms or biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def train_sft(config: SFTConfig) -> dict[str, Any]:
    """Run (or resume) fine-tuning; returns the final eval figures and the model path."""
    started = time.monotonic()  # run.time_limit_s counts from here
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from specdec.models import load_tokenizer

    run, optim_cfg, data = config.run, config.optim, config.data
    precision = run.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() else "no"
    accelerator = Accelerator(
        mixed_precision=precision, gradient_accumulation_steps=optim_cfg.grad_accum
    )
    set_seed(run.seed)
    out_dir = Path(run.output_dir)
    lm, resolved = build_model(config, accelerator.device)
    tokenizer = load_tokenizer(resolved)
    vocab = lm.config.vocab_size
    evals = read_chat_records(data.eval, tokenizer, vocab) if data.eval else []
    source = ChatRecords(
        read_chat_records(data.train, tokenizer, vocab),
        spread(evals, data.eval_records),
        max_tokens=data.max_tokens,
        max_seq_len=data.max_seq_len,
        seed=data.seed,
    )
    model = SFTModel(lm)
    optimizer = torch.optim.AdamW(
        param_groups(model, optim_cfg.weight_decay), lr=optim_cfg.lr, betas=optim_cfg.betas
    )
    scheduler = lr_schedule(optimizer, optim_cfg)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped by hand, once per step

    state = checkpoint.TrainState()
    resume_from = checkpoint.latest(out_dir) if run.resume else None
    if resume_from is not None:
        state = checkpoint.load(accelerator, resume_from)
        logger.info("resumed from %s (step %d)", resume_from, state.step)
    log = RunLogger(accelerator, out_dir, config, resumed=resume_from is not None)

    world = accelerator.num_processes
    batches = Schedule(source).iterate(state.consumed, accelerator.process_index, world)
    bar = tqdm(
        total=optim_cfg.max_steps,
        initial=state.step,
        desc="train-sft",
        unit="step",
        disable=not accelerator.is_local_main_process,
    )
    tally, t0 = Tally(), time.perf_counter()
    evals: dict[str, Any] = {}
    if state.step == 0 and source.units[1]:  # the base model's figures: the baseline
        log.write(0, evaluate(model, source, accelerator))
    kill_after = int(os.environ.get(KILL_ENV, "0"))
    limit = TimeLimit(run.time_limit_s, accelerator, started)
    model.train()
    while state.step < optim_cfg.max_steps and not limit.hit:
        optimizer_step(model, batches, accelerator.device, accelerator, optimizer, optim_cfg, tally)
        scheduler.step()
        state.step += 1
        state.consumed += optim_cfg.grad_accum * world
        bar.update(1)
        last = state.step == optim_cfg.max_steps or limit.reached()
        if state.step % run.log_every == 0 or last:
            figures = tally.summary(accelerator, "train/")
            figures["train/tokens_per_s"] = figures["train/tokens"] / max(
                time.perf_counter() - t0, 1e-9
            )
            figures["lr"] = scheduler.get_last_lr()[0]
            state.tokens += figures["train/tokens"]
            log.write(state.step, figures)
            bar.set_postfix(
                loss=f"{figures['train/loss']:.3f}",
                acc=f"{figures['train/acc']:.3f}",
                tok_s=f"{figures['train/tokens_per_s']:,.0f}",
            )
            tally, t0 = Tally(), time.perf_counter()
        if source.units[1] and (state.step % run.eval_every == 0 or last):
            evals = evaluate(model, source, accelerator)
            log.write(state.step, evals)
            model.train()
        if state.step % run.save_every == 0 or last:
            checkpoint.save(accelerator, out_dir, state, config.to_dict(), run.keep_last)
        if state.step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()
    batches.close()  # stops the prefetch thread
    model_dir = _export(accelerator, model, config, resolved.hf_dir, state, evals)
    log.close()
    limit.report(state.step, optim_cfg.max_steps)
    return {"step": state.step, "model": str(model_dir), "time_limited": limit.hit, **evals}


def evaluate(model, source: ChatRecords, accelerator) -> dict[str, Any]:
    """Held-out loss and next-token accuracy on assistant tokens (each process takes
    every world-th batch)."""
    tally = Tally()
    evaluate_shards(model, source.eval_plan(), source.load, accelerator, tally)
    return tally.summary(accelerator, "eval/")


def _export(accelerator, model, config: SFTConfig, base_dir: Path, state, evals) -> Path:
    """The tuned model, written to a temporary directory and renamed: in HF layout, or
    with LoRA the PEFT adapter directory (which names ``model.base``)."""
    from specdec.data_gen.reasoning.format import THINK_CLOSE, THINK_OPEN
    from specdec.models.hf_save import save_hf_model
    from specdec.models.lora import adapter_tensors, save_adapter

    out_dir = Path(config.run.output_dir)
    final = out_dir / config.export.name
    weights = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards
    if accelerator.is_main_process:
        lm = accelerator.unwrap_model(model).lm
        lm.load_state_dict({k.removeprefix("lm."): v for k, v in weights.items()})
        tokenizer_ids = _think_ids(base_dir, (THINK_OPEN, THINK_CLOSE))
        provenance = {
            "base": config.model.base,
            "step": state.step,
            "tokens": state.tokens,
            "train_sha256": _sha256(config.data.train),
            "eval_sha256": _sha256(config.data.eval) if config.data.eval else None,
            "final_eval": evals,
            "think_format": {"open": THINK_OPEN, "close": THINK_CLOSE, **tokenizer_ids},
            "config": config.to_dict(),
        }
        tmp = out_dir / f"{config.export.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        dtype, limit = _DTYPES[config.export.dtype], int(config.export.shard_mb * 2**20)
        if config.lora.enabled:
            tensors = adapter_tensors(lm, dtype)
            save_adapter(tmp, tensors, config.lora.spec(), config.model.base, limit)
            (tmp / "specdec_sft.json").write_text(json.dumps(provenance, indent=1) + "\n")
        else:
            save_hf_model(
                lm,
                tmp,
                source_dir=base_dir,
                dtype=dtype,
                max_shard_bytes=limit,
                extra_files={"specdec_sft.json": provenance},
            )
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    accelerator.wait_for_everyone()
    return final


def _think_ids(base_dir: Path, tags: tuple[str, str]) -> dict[str, list[int]]:
    """How the think tags tokenise (plain text, several tokens each)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    open_ids, close_ids = (tok.encode(t, add_special_tokens=False) for t in tags)
    return {"open_ids": open_ids, "close_ids": close_ids}


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
