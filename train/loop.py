"""The parts of a training loop that train-draft (``trainer.py``) and train-sft (``sft.py``)
share: the learning-rate schedule, one optimizer step over ``grad_accum`` micro-batches,
the run log, the wall-clock limit (``run.time_limit_s``) and the kill hook the resume tests
use.

Both loops keep their own objective, data and tallies; what is here is the same for every
model trained through accelerate.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)
# Tests set it to N: the process kills itself right after step N's checkpoint, as a
# preempted job would, so that resuming can be compared with an uninterrupted run.
KILL_ENV = "SPECDEC_TRAIN_KILL_AFTER_STEP"


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_schedule(optimizer: torch.optim.Optimizer, optim_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """``lr_lambda`` over ``optim_cfg``'s warmup_steps, max_steps and min_lr_ratio; the
    loops step it by hand, once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_lambda(s, optim_cfg.warmup_steps, optim_cfg.max_steps, optim_cfg.min_lr_ratio),
    )


def evaluate_shards(
    model: torch.nn.Module,
    plan: list,  # the held-out batches (refs), the same list on every process
    load,  # ref -> batch with .to(device) and .num_tokens
    accelerator,
    tally: Tally,
) -> None:
    """Held-out forwards, each process taking every world-th batch of ``plan``, summed
    into ``tally`` (then ``tally.summary``, a collective).

    Every process runs the same number of forwards: a process whose share is one short
    repeats a batch and drops its output. A wrapped model's forward can be a collective
    itself (DDP broadcasts buffers before a forward, ZeRO-3 gathers parameters), so one
    forward more on one process than on another deadlocks the run (a 2-process run on
    CPU hangs at its first evaluation without the repeated batch).
    """
    rank, world = accelerator.process_index, accelerator.num_processes
    share = plan[rank::world]
    rounds = -(-len(plan) // world)
    model.eval()
    with torch.no_grad():
        for i in range(rounds):
            counted = i < len(share)
            batch = load(share[i] if counted else plan[0]).to(accelerator.device)
            out = model(batch)
            if counted:
                tally.add(out, batch.num_tokens)


class Tally(Protocol):
    """What a loop sums its micro-batches' outputs into (``trainer.Tally``, ``sft.Tally``)."""

    def add(self, out: Any, tokens: int) -> None: ...


def optimizer_step(
    model: torch.nn.Module,
    batches: Iterator[tuple[Any, Any]],  # (unit, batch) with batch.to(device), batch.num_tokens
    device: torch.device,
    accelerator,
    optimizer: torch.optim.Optimizer,
    optim_cfg,
    tally: Tally,  # each micro-batch's output is added to it
) -> None:
    """One optimizer step: ``optim_cfg.grad_accum`` micro-batches, each a forward whose
    output has ``.loss``, a backward, and (on the last) clipping to ``optim_cfg.grad_clip``
    and the update; accelerate's ``accumulate`` skips gradient sync until then."""
    for _ in range(optim_cfg.grad_accum):
        _, batch = next(batches)
        batch = batch.to(device)
        with accelerator.accumulate(model):
            out = model(batch)
            accelerator.backward(out.loss)
            if accelerator.sync_gradients and optim_cfg.grad_clip > 0:
                accelerator.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad()
        tally.add(out, batch.num_tokens)


class RunLogger:
    """JSONL always (``<out_dir>/log.jsonl``, main process); wandb when installed and not
    disabled (``config.run.wandb``). ``config`` is any sectioned config with a ``run``
    section and ``to_dict``."""

    def __init__(self, accelerator, out_dir: Path, config, resumed: bool) -> None:
        self.main = accelerator.is_main_process
        self.file = None
        self.wandb = None
        if not self.main:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = (out_dir / "log.jsonl").open("a" if resumed else "w")
        if config.run.wandb != "disabled":
            try:
                import wandb
            except ImportError:
                return
            self.wandb = wandb.init(project=config.run.wandb_project, dir=str(out_dir),
                                    mode=config.run.wandb, config=config.to_dict(),
                                    resume="allow")  # fmt: skip

    def write(self, step: int, figures: dict[str, Any]) -> None:
        if not self.main:
            return
        assert self.file is not None
        self.file.write(json.dumps({"step": step, **figures}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(figures, step=step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


class TimeLimit:
    """``run.time_limit_s``: ``reached()`` turns True at the first optimizer step past the
    limit, on every process at once (the processes' clocks are combined, so none leaves
    the loop while another waits in a collective). The loop then ends that step as it
    would at max_steps: evaluation, checkpoint, the final export; a rerun continues.

    The clock starts at ``started`` (``time.monotonic()`` when the command began), not at
    the loop: a job's wall-clock limit also covers loading the target, reading the data,
    compiling the first step and the step-0 evaluation, which take minutes on a fresh
    machine."""

    def __init__(self, seconds: float | None, accelerator, started: float) -> None:
        self.seconds = seconds
        self.deadline = None if seconds is None else started + seconds
        self.accelerator = accelerator
        self.hit = False

    def reached(self) -> bool:
        if self.deadline is None:
            return False
        mine = torch.tensor([float(time.monotonic() >= self.deadline)],
                            device=self.accelerator.device)  # fmt: skip
        self.hit = bool(self.accelerator.reduce(mine, reduction="sum").item() > 0)
        return self.hit

    def report(self, step: int, max_steps: int) -> None:
        if self.hit:
            logger.warning("run.time_limit_s=%s reached at step %d of %d: checkpoint and "
                           "model saved; rerun the same command to continue", self.seconds,
                           step, max_steps)  # fmt: skip
