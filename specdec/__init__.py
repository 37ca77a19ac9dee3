"""specdec: lossless speculative decoding — EAGLE-3 draft heads, a paged-KV engine.

The public names load lazily, so importing a torch-free part (the scheduler, the block
pool) does not pull in the model stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

_LAZY = {
    "LLM": "specdec.engine.llm",
    "CompletionOutput": "specdec.outputs",
    "RequestOutput": "specdec.outputs",
    "SamplingParams": "specdec.sampling_params",
}

if TYPE_CHECKING:
    from specdec.engine.llm import LLM
    from specdec.outputs import CompletionOutput, RequestOutput
    from specdec.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
