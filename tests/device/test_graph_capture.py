"""``capture_graph``: warm-ups run before the capture, and no cyclic garbage collection can
run inside it (a graph freed by a sweep mid-capture invalidates the capture), while the
collector's own state is left as the caller had it. The CUDA calls are stood in for, so
this runs on the CPU."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from specdec.device import graph_capture


class _FakeGraph:
    def pool(self):
        return "pool"


@pytest.fixture
def fake_cuda(monkeypatch):
    events: list[str] = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        events.append(f"capture begins, gc {'on' if gc.isenabled() else 'off'}")
        yield
        events.append("capture ends")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    return events


@pytest.mark.parametrize("collector_on", [True, False])
def test_the_capture_runs_with_the_collector_paused_and_restores_it(fake_cuda, collector_on):
    was = gc.isenabled()
    (gc.enable if collector_on else gc.disable)()
    calls = []

    def fn():
        calls.append(gc.isenabled())
        return len(calls)

    try:
        graph, out = graph_capture.capture_graph(fn, warmups=2)
        after = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert isinstance(graph, _FakeGraph) and out == 3
    # Warm-ups with the caller's collector, the captured call without any.
    assert calls == [collector_on, collector_on, False]
    assert fake_cuda == ["sync", "capture begins, gc off", "capture ends", "sync"]
    assert after is collector_on


def test_a_failed_capture_still_restores_the_collector(fake_cuda):
    was = gc.isenabled()
    gc.enable()

    def fn():
        if not gc.isenabled():
            raise RuntimeError("capture invalidated")

    try:
        with pytest.raises(RuntimeError, match="capture invalidated"):
            graph_capture.capture_graph(fn, warmups=1)
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
