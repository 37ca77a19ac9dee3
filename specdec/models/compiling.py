"""Settings every ``torch.compile`` of model regions needs (``CausalLM.compile_regions``,
``Eagle3Head.compile_regions``)."""

from __future__ import annotations

import torch

# Recompilations allowed per code object. A compiled region specialises per captured
# shape (batch bucket x tokens per sequence, with or without a tree mask), and dynamo caches
# by code object, so every engine built in one process (a benchmark's plain engine and
# each speculative configuration) adds its variants to the same layer's entries. Past
# dynamo's default of 8 it silently runs the region eagerly, inside the CUDA graphs too.
RECOMPILE_LIMIT = 64


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise dynamo's recompilation limits to at least ``limit`` per code object (never
    lowers a larger setting)."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * limit)


def compile_region(fn, **compile_kwargs):
    """``torch.compile(fn)`` with the recompilation limits raised first."""
    allow_recompiles()
    return torch.compile(fn, **compile_kwargs)
