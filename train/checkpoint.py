"""Training checkpoints: atomic, newest-N kept, exact resume.

A checkpoint is a directory ``ckpt-<step:08d>`` under the run's output directory holding
accelerate's state (model, optimizer, LR scheduler, every process's RNG states; DeepSpeed
writes its own shards there) and ``train_state.json`` (optimizer step, micro-batches
consumed, the config). It is written as ``ckpt-<step>.tmp`` by every process, then renamed
by the main process once all have finished: a checkpoint directory without ``.tmp`` is
always complete, and a killed save leaves only a ``.tmp`` that the next save replaces.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "train_state.json"
_NAME = re.compile(r"^ckpt-(\d{8})$")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    consumed: int = 0  # micro-batches consumed by all processes together
    tokens: int = 0  # tokens trained on (all processes)


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest(output_dir: str | Path) -> Path | None:
    found = checkpoints(output_dir)
    return found[-1] if found else None


def save(accelerator, output_dir: str | Path, state: TrainState, config: dict[str, Any],
         keep_last: int) -> Path:  # fmt: skip
    """Write a checkpoint of ``state.step`` (every process calls this)."""
    root = Path(output_dir)
    final = root / f"ckpt-{state.step:08d}"
    tmp = root / f"ckpt-{state.step:08d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        payload = {"state": state.__dict__, "config": config}
        (tmp / STATE_FILE).write_text(json.dumps(payload, indent=1))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load(accelerator, path: str | Path) -> TrainState:
    """Restore accelerate's state from ``path``; returns the loop's position."""
    path = Path(path)
    accelerator.load_state(str(path))
    data = json.loads((path / STATE_FILE).read_text())
    return TrainState(**data["state"])
