"""Switches the engine sets on a loaded model's modules (which kernel a ``Linear`` or
``RMSNorm`` runs): one attribute on every module of some types."""

from __future__ import annotations

from torch import nn


def set_on_modules(model: nn.Module, types: type | tuple[type, ...], name: str, value) -> int:
    """Set ``name`` to ``value`` on every module of ``model`` (itself included) that is an
    instance of ``types``; returns how many it set."""
    count = 0
    for m in model.modules():
        if isinstance(m, types):
            setattr(m, name, value)
            count += 1
    return count
