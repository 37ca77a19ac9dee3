"""What a benchmark figure is recorded with: versions, hardware, commit, command line."""

from __future__ import annotations

import datetime as dt
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device (CUDA work is asynchronous; host timers need it finished)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def env_info(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Versions and hardware that a figure in docs/benchmarks.md must be recorded with."""
    info = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "device": str(device),
        "device_name": (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or platform.machine()
        ),
        "dtype": str(dtype).removeprefix("torch."),
    }
    for module in ("transformers", "triton"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = "not installed"
    return info


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_commit() -> str | None:
    """HEAD of the checkout specdec runs from; None outside a git checkout."""
    return _git("rev-parse", "HEAD")


def git_dirty() -> bool | None:
    """Whether tracked files differ from HEAD (the figure is then not exactly HEAD's)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed (shell-quoted), to paste into docs/benchmarks.md."""
    argv = sys.argv if argv is None else argv
    prog = Path(argv[0]).name if argv else "specdec"
    if prog in ("cli.py", "__main__.py"):  # python -m specdec.cli: the same command
        prog = "specdec"
    return shlex.join([prog, *argv[1:]])
