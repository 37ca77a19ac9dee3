"""CUDA graphs captured after the engine starts (``EngineConfig.defer_graphs``), one per
call between steps, in groups: speculation's graphs first (every step decodes plainly
until they are all captured), then the target's graphs of wider steps (such steps run
eagerly until theirs is). Without deferral the engine captures every group before it
starts, through the same calls."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    name: str  # what the log calls the group ("speculation's CUDA graphs")
    captures: Iterator[str]  # one graph per next(), yielding "family: what it captured"
    gates_speculation: bool
    times: dict[str, list[float]] = field(default_factory=dict)  # family -> seconds each


class DeferredGraphs:
    """Groups of pending captures, taken in the order added."""

    def __init__(self) -> None:
        self._groups: deque[_Group] = deque()
        self.times: dict[str, list[float]] = {}  # family -> seconds each, every group

    def add(self, name: str, captures: Iterator[str], *, gates_speculation: bool) -> None:
        self._groups.append(_Group(name, captures, gates_speculation))

    @property
    def pending(self) -> bool:
        return bool(self._groups)

    @property
    def gate_speculation(self) -> bool:
        """Whether a group that speculation waits for is still pending."""
        return any(g.gates_speculation for g in self._groups)

    def capture_next(self) -> bool:
        """Capture the next pending graph; returns whether more remain. A group found
        exhausted is closed (its time logged) and the next one's first graph captured."""
        while self._groups:
            group = self._groups[0]
            t0 = time.perf_counter()
            label = next(group.captures, None)
            if label is not None:
                family = label.partition(":")[0]
                seconds = time.perf_counter() - t0
                group.times.setdefault(family, []).append(seconds)
                self.times.setdefault(family, []).append(seconds)
                logger.debug("captured the graph of %s", label)
                return True
            self._groups.popleft()
            if group.times:
                logger.info(
                    "captured %s in %.1f s (%s)%s",
                    group.name,
                    sum(sum(t) for t in group.times.values()),
                    ", ".join(f"{f}: {len(t)} in {sum(t):.1f} s" for f, t in group.times.items()),
                    "; speculation is on" if group.gates_speculation else "",
                )
        return False
