"""The share of the CPU that other users' processes take while a benchmark runs.

On a shared machine the load average cannot tell a benchmark's own servers and clients
from someone else's test suite, and it lags by minutes. This counts instead: the machine's
busy CPU time (/proc/stat) minus that of this process and all its descendants, ended ones
included, over the cores times the wall time.
0 means the machine was ours alone; 1 means other jobs kept every core busy. Linux only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")  # jiffies per second


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic(), s
    busy: int  # jiffies, all cores: user + nice + system + irq + softirq + steal
    ours: int  # jiffies of this process and its descendants


def sample() -> Sample:
    cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = cpu
    return Sample(time.monotonic(), user + nice + system + irq + softirq + steal, _ours())


def others_share(before: Sample, after: Sample) -> float:
    """Other processes' CPU time between two samples, as a share of all cores."""
    wall = (after.t - before.t) * TICK * (os.cpu_count() or 1)
    foreign = (after.busy - before.busy) - (after.ours - before.ours)
    return max(0.0, foreign / wall) if wall > 0 else 0.0


def measure(seconds: float = 5.0) -> float:
    before = sample()
    time.sleep(seconds)
    return others_share(before, sample())


def wait_for_quiet(limit: float, max_wait_s: float, probe_s: float = 5.0) -> tuple[float, float]:
    """Probe until others take at most ``limit`` of the CPU or ``max_wait_s`` passes;
    returns (the last probe's share, seconds waited)."""
    start = time.monotonic()
    while True:
        share = measure(probe_s)
        waited = time.monotonic() - start
        if share <= limit or waited + probe_s > max_wait_s:
            return share, waited


def _ours() -> int:
    me = os.getpid()
    parents, jiffies = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()  # from field 3 (state) on
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        # utime + stime + cutime + cstime: a process that ended and was waited for (a
        # finished client) is counted in its parent's cutime and cstime.
        jiffies[pid] = sum(int(x) for x in fields[11:15])
    total = 0
    for pid, own in jiffies.items():
        p = pid
        while p > 1 and p != me:
            p = parents.get(p, 0)
        total += own if p == me else 0
    return total
