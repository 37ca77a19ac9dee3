"""``train(config)``: the EAGLE-3 training loop, top to bottom.

accelerate runs it on one process, DDP or DeepSpeed (ZeRO-2/3 configs in configs/) —
``accelerate launch -m specdec.cli train-draft ...``. An optimizer step consumes
``grad_accum`` micro-batches per process; clipping, AdamW, warmup + cosine. Checkpoints
(``checkpoint.py``) are periodic and final; with ``run.resume`` a run restarts from its
newest one and continues exactly (model, optimizer, schedule, data position, RNG). Logs go
to ``<output_dir>/log.jsonl`` always, to wandb when installed (offline unless asked), and
to a progress bar. The final head is written to ``<output_dir>/head`` in the project
format, ready for ``specdec generate --draft eagle3 --draft-model <output_dir>/head``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.models.block_drafter import BlockDrafterConfig, resolve_mask_token_id
from specdec.models.head_variants import HEAD_VARIANTS
from specdec.train import checkpoint
from specdec.train.block_attention import block_attention
from specdec.train.block_init import (
    block_shape,
    check_init_drafter,
    continue_from,
    init_aux_layer_ids,
    read_init_drafter,
)
from specdec.train.block_loss import anchors_for, default_gamma
from specdec.train.block_model import BlockModel, build_block_drafter
from specdec.train.config import DRAFTER_NAMES, TrainConfig
from specdec.train.data import OfflineShards, OnlineRecords, Schedule, Source
from specdec.train.loop import (
    KILL_ENV,
    RunLogger,
    TimeLimit,
    evaluate_shards,
    lr_schedule,
    optimizer_step,
)
from specdec.train.model import (
    VOCAB_KEYS,
    TargetIO,
    TTTModel,
    attention_backend,
    build_head,
    carry_init_rows,
    init_head_state,
    load_vocab,
)
from specdec.train.norm_init import calibrate_fresh_norms
from specdec.train.spec_exit_labels import ExitLabeler
from specdec.train.spec_exit_loss import SpecExitLoss
from specdec.train.ttt import TTTOutput

logger = logging.getLogger(__name__)


@dataclass
class Tally:
    """Sums over micro-batches (device tensors until logged)."""

    loss: torch.Tensor | float = 0.0
    step_loss: torch.Tensor | float = 0.0  # sum of loss_i * valid_i
    correct: torch.Tensor | float = 0.0
    valid: torch.Tensor | float = 0.0
    leading: torch.Tensor | float = 0.0  # sum of leading-correct runs over step-0 valid
    valid0: torch.Tensor | float = 0.0
    exit_loss: torch.Tensor | float = 0.0  # [k]: SpecExit loss_s * labelled_s, summed
    exit_count: torch.Tensor | float = 0.0  # [k]: labelled positions per signal
    batches: int = 0
    tokens: int = 0

    def add(self, out: TTTOutput, tokens: int) -> None:
        self.loss = self.loss + out.loss.detach()
        self.step_loss = self.step_loss + out.step_losses * out.step_valid
        self.correct = self.correct + out.step_correct
        self.valid = self.valid + out.step_valid
        self.leading = self.leading + out.leading_correct[out.valid0].sum()
        self.valid0 = self.valid0 + out.valid0.sum()
        if out.exit is not None:
            self.exit_loss = self.exit_loss + out.exit.signal_losses * out.exit.signal_counts
            self.exit_count = self.exit_count + out.exit.signal_counts
        self.batches += 1
        self.tokens += tokens

    def summary(
        self, accelerator, prefix: str, positions: int, signals: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """Figures over every process (a collective call: all processes must call it);
        ``positions``: the TTT steps (``loss_i``, ``acc_i``); ``signals``: the head's
        SpecExit signals, reported as ``exit_loss_<signal>``. A process that summed no
        batch sends zeros of the same sizes: a size mismatch breaks the reduction."""
        device = accelerator.device

        def sums(x, n: int) -> torch.Tensor:  # [n] float64
            values = torch.as_tensor(x, dtype=torch.float64, device=device).reshape(-1)
            return values if values.numel() == n else values.new_zeros(n)

        t = [sums(self.loss, 1), sums(self.step_loss, positions), sums(self.correct, positions),
             sums(self.valid, positions), sums(self.leading, 1), sums(self.valid0, 1),
             sums(float(self.batches), 1), sums(float(self.tokens), 1),
             sums(self.exit_loss, len(signals)), sums(self.exit_count, len(signals))]  # fmt: skip
        sizes = [x.numel() for x in t]
        flat = accelerator.reduce(torch.cat(t), reduction="sum").tolist()
        parts, i = [], 0
        for n in sizes:
            parts.append(flat[i : i + n])
            i += n
        loss, step_loss, correct, valid, leading, valid0, batches, tokens, exit_sum, exit_n = parts
        out: dict[str, Any] = {
            f"{prefix}loss": loss[0] / max(batches[0], 1),
            f"{prefix}tokens": int(tokens[0]),
            f"{prefix}simulated_tau": 1.0 + leading[0] / valid0[0] if valid0[0] else 1.0,
        }
        for k, (s, c, v) in enumerate(zip(step_loss, correct, valid, strict=False)):
            out[f"{prefix}loss_{k}"] = s / v if v else float("nan")
            out[f"{prefix}acc_{k}"] = c / v if v else float("nan")
        for name, s, n in zip(signals, exit_sum, exit_n, strict=True):
            out[f"{prefix}exit_loss_{name}"] = s / n if n else float("nan")
        return out


def train(config: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training; returns the final eval figures and paths."""
    started = time.monotonic()  # run.time_limit_s counts from here
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    run, optim_cfg = config.run, config.optim
    precision = run.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() else "no"
    accelerator = Accelerator(mixed_precision=precision,
                              gradient_accumulation_steps=optim_cfg.grad_accum)  # fmt: skip
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        # DeepSpeed clips inside its own step (clip_grad_norm_ does nothing there), and
        # accelerate fills the config's "auto" clipping with 1.0, not optim.grad_clip.
        plugin.deepspeed_config["gradient_clipping"] = optim_cfg.grad_clip
    set_seed(run.seed)
    out_dir = Path(run.output_dir)
    device = accelerator.device

    target = TargetIO.load(config.model.target)
    source = _source(config, target, device)
    aux_ids = tuple(config.model.aux_layer_ids or source.aux_layer_ids)
    if tuple(source.aux_layer_ids) != aux_ids:
        raise ValueError(
            f"model.aux_layer_ids={list(aux_ids)} but the data holds layers "
            f"{list(source.aux_layer_ids)}; dump again with those ids or drop the override"
        )
    drafter = DRAFTERS[config.model.drafter]
    # A checkpoint in output_dir (loaded below) replaces the weights model.init_head gave.
    model = drafter.build(config, target, device, aux_ids, partial(_aux_sample, source))
    if config.data.max_seq_len > model.head.rotary.num_positions:
        # Positions past the head's RoPE table are clamped (train/ttt.py unroll): harmless
        # for padding, silently wrong for tokens that carry loss.
        raise ValueError(
            f"data.max_seq_len={config.data.max_seq_len} exceeds the target's context "
            f"({model.head.rotary.num_positions} positions); set data.max_seq_len <= "
            f"{model.head.rotary.num_positions}"
        )
    positions = drafter.positions(config, model)
    exit_cfg = config.spec_exit
    model.place_target(device, torch.bfloat16 if precision == "bf16" else torch.float32)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=optim_cfg.lr, betas=optim_cfg.betas, weight_decay=optim_cfg.weight_decay,
    )  # fmt: skip
    scheduler = lr_schedule(optimizer, optim_cfg)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Stepped by hand once per optimizer step (accelerate would step it per process).
    accelerator.register_for_checkpointing(scheduler)

    state = checkpoint.TrainState()
    resume_from = checkpoint.latest(out_dir) if run.resume else None
    if resume_from is not None:
        state = checkpoint.load(accelerator, resume_from)
        logger.info("resumed from %s (step %d)", resume_from, state.step)
    log = RunLogger(accelerator, out_dir, config, resumed=resume_from is not None)

    schedule = Schedule(source)
    world = accelerator.num_processes
    batches = schedule.iterate(state.consumed, accelerator.process_index, world)
    bar = tqdm(total=optim_cfg.max_steps, initial=state.step, desc="train-draft", unit="step",
               disable=not accelerator.is_local_main_process)  # fmt: skip
    tally, t0 = Tally(), time.perf_counter()
    evals: dict[str, Any] = {}
    if state.step == 0:  # the fresh head's figures: the baseline every later eval beats
        log.write(0, evaluate(model, source, accelerator, positions, exit_cfg.signals))
    kill_after = int(os.environ.get(KILL_ENV, "0"))
    limit = TimeLimit(run.time_limit_s, accelerator, started)
    model.train()
    while state.step < optim_cfg.max_steps and not limit.hit:
        optimizer_step(model, batches, device, accelerator, optimizer, optim_cfg, tally)
        scheduler.step()
        state.step += 1
        state.consumed += optim_cfg.grad_accum * world
        bar.update(1)
        last = state.step == optim_cfg.max_steps or limit.reached()
        if state.step % run.log_every == 0 or last:
            figures = tally.summary(accelerator, "train/", positions, exit_cfg.signals)
            seconds = time.perf_counter() - t0
            figures["train/tokens_per_s"] = figures["train/tokens"] / max(seconds, 1e-9)
            figures["lr"] = scheduler.get_last_lr()[0]
            state.tokens += figures["train/tokens"]
            log.write(state.step, figures)
            bar.set_postfix(loss=f"{figures['train/loss']:.3f}",
                            acc0=f"{figures['train/acc_0']:.2f}",
                            tok_s=f"{figures['train/tokens_per_s']:,.0f}")  # fmt: skip
            tally, t0 = Tally(), time.perf_counter()
        if state.step % run.eval_every == 0 or last:
            evals = evaluate(model, source, accelerator, positions, exit_cfg.signals)
            log.write(state.step, evals)
            model.train()
        if state.step % run.save_every == 0 or last:
            checkpoint.save(accelerator, out_dir, state, config.to_dict(), run.keep_last)
        if state.step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()
    batches.close()  # stops the prefetch thread
    head_dir = _save_head(accelerator, model, out_dir, drafter.save)
    log.close()
    limit.report(state.step, optim_cfg.max_steps)
    return {"step": state.step, "head": str(head_dir), "time_limited": limit.hit, **evals}


def _build_eagle3(
    config: TrainConfig,
    target: TargetIO,
    device: torch.device,
    aux_ids: tuple[int, ...],
    aux_sample: Callable[[], torch.Tensor | None],
) -> TTTModel:
    """A fresh or continued (``model.init_head``) EAGLE-3 head in its TTT objective;
    ``aux_sample`` gives fused aux states of the run's data, for a continued head's fresh
    norms (train/norm_init.py)."""
    init = _read_init_head(config.model.init_head, target) if config.model.init_head else None
    if init is not None and not config.model.vocab:
        d2t, t2d = init.d2t.cpu(), init.t2d.cpu()  # a head continues with its own vocabulary
    else:  # a fresh head, or one continued under model.vocab (_load_init_head moves its rows)
        d2t, t2d = load_vocab(_vocab_path(config))
    if config.model.draft_vocab_size not in (None, d2t.shape[0]):
        raise ValueError(
            f"model.draft_vocab_size={config.model.draft_vocab_size} but the draft vocabulary "
            f"keeps {d2t.shape[0]} ids; rebuild it with that size or drop the setting"
        )
    exit_cfg = config.spec_exit
    if exit_cfg.freeze_draft and not config.model.init_head:
        raise ValueError(
            "spec_exit.freeze_draft=true trains SpecExit channels on top of a trained head; "
            "set model.init_head to that head's directory"
        )
    backend = attention_backend(config.ttt.attention, device)
    width = config.model.intermediate_size or (init.config.intermediate_size if init else None)
    depth = config.model.num_layers or (init.config.num_layers if init else 1)
    variant = config.model.variant or (init.config.variant if init else "eagle3")
    if variant not in HEAD_VARIANTS:  # an init_head of a variant no run trains
        raise ValueError(
            f"model.init_head is an {variant} head; set model.variant to one of "
            f"{' | '.join(HEAD_VARIANTS)} to continue it as that"
        )
    head = build_head(target, config.model.target, d2t, t2d, aux_ids, backend,
                      exit_signals=exit_cfg.signals, intermediate_size=width,
                      num_layers=depth, variant=variant)  # fmt: skip
    if init is not None:
        _load_init_head(head, init, aux_sample)
    exit_loss = None
    if exit_cfg.signals:
        exit_loss = SpecExitLoss(exit_cfg.weights, exit_cfg.remaining_loss)
    model = TTTModel(head, target, steps=config.ttt.steps, decay=config.ttt.decay,
                     argmax_weight=config.ttt.argmax_weight, loss=config.ttt.loss,
                     lk_eta=config.ttt.lk_eta, exit_loss=exit_loss,
                     freeze_draft=exit_cfg.freeze_draft,
                     pad_to=config.data.max_tokens if backend.static_tokens else None)  # fmt: skip
    return model


def _build_block(
    config: TrainConfig,
    target: TargetIO,
    device: torch.device,
    aux_ids: tuple[int, ...],
    aux_sample: Callable[[], torch.Tensor | None],  # unused: a block drafter has no norms to fit
) -> BlockModel:
    """A fresh or continued (``model.init_head``, train/block_init.py) block drafter in its
    block objective (train/block_loss.py)."""
    from specdec.models import load_tokenizer, resolve_model

    cfg = config.block
    init = read_init_drafter(config.model.init_head, target) if config.model.init_head else None
    if init is not None:
        check_init_drafter(config, init, aux_ids)
    if cfg.target_lm_head:
        d2t = t2d = None
    elif init is not None and not config.model.vocab:
        d2t, t2d = init.d2t, init.t2d  # a drafter continues with its own vocabulary
    else:
        d2t, t2d = load_vocab(_vocab_path(config))
    vocab = target.config.vocab_size if d2t is None else d2t.shape[0]
    if config.model.draft_vocab_size not in (None, vocab):
        raise ValueError(
            f"model.draft_vocab_size={config.model.draft_vocab_size} but the drafter "
            f"drafts {vocab} ids; rebuild the vocabulary with that size or drop the setting"
        )
    shape = block_shape(config, init)
    mask_id = shape.mask_token_id
    if mask_id is None:
        mask_id = resolve_mask_token_id(load_tokenizer(resolve_model(config.model.target)))
    drafter_config = BlockDrafterConfig.for_target(
        target.config, vocab, mask_token_id=mask_id, aux_layer_ids=aux_ids,
        block_size=shape.block_size, num_layers=shape.num_layers,
        intermediate_size=shape.intermediate_size, target_name=config.model.target,
    )  # fmt: skip
    head = build_block_drafter(target, drafter_config, d2t, t2d)
    if init is not None:
        continue_from(head, init)
    attention, static = block_attention(cfg.attention, device)
    return BlockModel(
        head, target, attention=attention,
        anchors=cfg.anchors or anchors_for(shape.block_size, config.data.max_tokens),
        gamma=cfg.gamma or default_gamma(shape.block_size), loss=cfg.loss, lk_eta=cfg.lk_eta,
        argmax_weight=cfg.argmax_weight, pad_to=config.data.max_tokens if static else None,
    )  # fmt: skip


def _save_eagle3(head, directory: Path) -> None:
    from specdec.models.eagle3_formats import save_eagle3

    save_eagle3(head, directory)


def _save_block(head, directory: Path) -> None:
    from specdec.models.block_drafter_formats import save_block_drafter

    save_block_drafter(head, directory)


@dataclass(frozen=True)
class Drafter:
    """One kind of drafter train-draft trains: ``build`` its model (a module whose
    ``forward(batch)`` returns a ``TTTOutput`` and whose ``head`` is the drafter saved at
    the end) from the config, the target, the device, the aux layer ids and a loader of
    fused aux states from the run's data (``_aux_sample``); ``positions`` of its
    per-position figures (loss_i, acc_i) for a config and its built model; ``save`` its
    head in the project format."""

    build: Callable[
        [TrainConfig, TargetIO, torch.device, tuple[int, ...], Callable[[], torch.Tensor | None]],
        torch.nn.Module,
    ]
    positions: Callable[[TrainConfig, torch.nn.Module], int]
    save: Callable[[torch.nn.Module, Path], None]


DRAFTERS: dict[str, Drafter] = {
    "eagle3": Drafter(_build_eagle3, lambda c, m: c.ttt.steps, _save_eagle3),
    "block": Drafter(_build_block, lambda c, m: m.head.config.block_size - 1, _save_block),
}
if tuple(DRAFTERS) != DRAFTER_NAMES:  # the config validates names without this module
    raise RuntimeError(f"trainer.DRAFTERS {tuple(DRAFTERS)} != config.DRAFTER_NAMES")


def evaluate(
    model, source: Source, accelerator, positions: int, signals: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Held-out loss_i, acc_i, simulated τ and SpecExit losses of ``signals`` (each
    process takes every world-th batch)."""
    tally = Tally()
    evaluate_shards(model, source.eval_plan(), source.load, accelerator, tally)
    return tally.summary(accelerator, "eval/", positions, signals)


def _exit_labeler(config: TrainConfig) -> ExitLabeler | None:
    """SpecExit labels from think spans, markers resolved with the target's tokenizer."""
    cfg = config.spec_exit
    if not cfg.signals:
        return None
    from specdec.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(config.model.target))
    return ExitLabeler.for_tokenizer(
        tokenizer, cfg.signals, cfg.think_start, cfg.think_end, cfg.confidence_hold
    )


def _source(config: TrainConfig, target: TargetIO, device: torch.device) -> Source:
    data = config.data
    labeler = _exit_labeler(config)
    if data.mode == "offline":
        shards = OfflineShards(data.paths[0], max_tokens=data.max_tokens,
                               max_seq_len=data.max_seq_len, eval_shards=data.eval_shards,
                               seed=data.seed,
                               labeler=labeler)  # fmt: skip
        cfg, dumped = target.config, shards.manifest
        if (dumped["hidden_size"], dumped["vocab_size"]) != (cfg.hidden_size, cfg.vocab_size):
            raise ValueError(
                f"{data.path} was dumped from {dumped['target']!r} (hidden "
                f"{dumped['hidden_size']}, vocab {dumped['vocab_size']}), not a model shaped like "
                "model.target="
                f"{config.model.target!r} (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}); "
                "set model.target to the dump's target"
            )
        return shards
    from specdec.data_gen.target import TargetForward

    # float32 states, as an fp32 dump would hold (autocast still runs the head in bf16).
    # A block drafter continued from model.init_head reads the layers it was trained on.
    aux_ids = config.model.aux_layer_ids or init_aux_layer_ids(config, target)
    forward = TargetForward(
        config.model.target, device=device, dtype=torch.float32,
        aux_layer_ids=aux_ids, max_seq_len=data.max_seq_len,
    )  # fmt: skip
    return OnlineRecords(data.paths, forward, max_tokens=data.max_tokens,
                         max_seq_len=data.max_seq_len, eval_records=data.eval_records,
                         seed=data.seed, vocab_size=target.config.vocab_size,
                         labeler=labeler)  # fmt: skip


def _vocab_path(config: TrainConfig) -> Path:
    if config.model.vocab:
        return Path(config.model.vocab)
    data = Path(config.data.paths[0])
    for candidate in (data / "vocab.safetensors", data.parent / "vocab.safetensors"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"no vocab.safetensors in {data} or {data.parent}; build one with `specdec data-gen "
        "vocab` and pass model.vocab=<path>"
    )


def _aux_sample(source: Source) -> torch.Tensor | None:
    """Fused aux states of the first held-out batch (else the first training batch), read
    without moving the run's place in its data; None where batches carry none."""
    plan = source.eval_plan() or source.epoch_plan(0)
    return source.load(plan[0]).aux_hidden if plan else None


def _read_init_head(directory: str, target: TargetIO):
    from specdec.models.eagle3_formats import load_eagle3

    return load_eagle3(directory, target_config=target.config)


def _load_init_head(head, init, aux_sample: Callable[[], torch.Tensor | None]) -> None:
    have, want = init.config.exit_signals, head.config.exit_signals
    if have and have != want:
        raise ValueError(
            f"model.init_head has SpecExit channels {list(have)}; set spec_exit.signals="
            f"{list(have)} to keep training them (the run asks for {list(want)})"
        )
    state, rows = init_head_state(head, init)
    # A trained head without channels: its weights, and fresh channels on top. One
    # without the variant's norms (an EAGLE-3 head continued as EAGLE-3.1): fresh norms.
    fresh_channels = bool(want) and not have
    fresh_norms = tuple(
        prefix
        for prefix, flag in (("fc_norm.", "fc_norm"), ("input_norm.", "norm_before_fc"))
        if getattr(head.config, flag) and not getattr(init.config, flag)
    )
    missing, unexpected = head.load_state_dict(state, strict=False)
    lacking = [k for k in missing
               if not (fresh_channels and k.startswith("spec_exit."))
               and not (fresh_norms and k.startswith(fresh_norms))
               and not (rows is not None and k in VOCAB_KEYS)]  # fmt: skip
    if unexpected and any(k.startswith(("fc_norm.", "input_norm.")) for k in unexpected):
        raise ValueError(
            f"model.init_head is an {init.config.variant} head and the run asks for "
            f"{head.config.variant} (model.variant): its norms {unexpected} would be dropped; "
            "leave model.variant unset to keep its variant"
        )
    if lacking or unexpected:
        raise ValueError(
            f"model.init_head lacks {lacking} and has extra {unexpected}; it is not a head "
            "for this run"
        )
    if rows is not None:
        carry_init_rows(head, init, rows)
    if fresh_norms:
        _init_fresh_norms(head, init, fresh_norms, aux_sample)


def _init_fresh_norms(
    head, init, fresh_norms: tuple[str, ...], aux_sample: Callable[[], torch.Tensor | None]
) -> None:
    """The norms a continued head gains, calibrated to the run's data (train/norm_init.py),
    or left at weight 1 with a warning where the data carries no aux states."""
    names = ", ".join(p.rstrip(".") for p in fresh_norms)
    sample = aux_sample()
    if sample is None:
        logger.warning("model.init_head (%s) continues as %s: no aux states in the data to "
                       "calibrate its new %s on, so they start at weight 1 and its first "
                       "drafts differ until training adapts them", init.config.variant,
                       head.config.variant, names)  # fmt: skip
        return
    weights = calibrate_fresh_norms(head, fresh_norms, sample)
    logger.info("model.init_head (%s) continues as %s: its new %s start at the median RMS "
                "of their input rows in the data (%s), so its first drafts stay close to "
                "the original's", init.config.variant, head.config.variant, names,
                ", ".join(f"{k} {v:.3g}" for k, v in weights.items()))  # fmt: skip


def _save_head(accelerator, model, out_dir: Path, save: Callable[..., None]) -> Path:
    """The final head in the project format (``save``), written to a temporary directory
    and renamed."""
    import shutil

    final = out_dir / "head"
    state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards
    if accelerator.is_main_process:
        head = accelerator.unwrap_model(model).head
        head.load_state_dict({k.removeprefix("head."): v for k, v in state.items()})
        tmp = out_dir / "head.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save(head, tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    accelerator.wait_for_everyone()
    return final
