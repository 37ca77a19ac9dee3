"""The exit policy replayed over a finished trace: where SpecExit would have cut it.

Given a trace's token ids and the head's signals at every position (``exit_signals``:
what the channels read after each token), ``replay_exit`` runs the serving policy
(``SpecExitState``, unchanged) as if the trace had been generated ``step_tokens`` tokens per
speculative step: each step's decision reads the mean signals of the previous step's
tokens (serving's catch-up rows) and may cut at the first delimiter among the step's own
tokens. The answer is settled at that cut when the trace's confidence label there says so
(``data-gen exit-labels``: an answer forced at that delimiter equals the trace's own).

This is how thresholds and smoothing are chosen without a GPU sweep
(``benchmarks/spec_exit_offline.py``). It is an approximation of serving in two ways: real
steps emit a varying number of tokens (1 to K + 1), and a cut trace is not continued (the
answer forced at the cut is judged by the label, not generated).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specdec.spec.spec_exit_runtime import SpecExitRuntime
from specdec.spec_exit_params import SpecExitParams


def replay_exit(
    runtime: SpecExitRuntime,
    params: SpecExitParams,
    token_ids: Sequence[int],  # [n]: prompt then output
    prompt_len: int,
    signals: np.ndarray,  # [n, len(runtime.signals)]: activated, at each position
    step_tokens: int = 4,
) -> int | None:
    """Index in ``token_ids`` of the delimiter token the policy cuts after, or None when it
    never exits. Steps cover the output ``step_tokens`` tokens at a time."""
    if step_tokens < 1:
        raise ValueError(f"step_tokens={step_tokens} must be >= 1")
    if signals.shape[0] != len(token_ids):
        raise ValueError(f"{signals.shape[0]} signal rows for a {len(token_ids)}-token trace")
    state = runtime.start(params, list(token_ids[:prompt_len]))
    output: list[int] = []
    previous: slice | None = None
    for s in range(prompt_len, len(token_ids), step_tokens):
        step = [int(t) for t in token_ids[s : s + step_tokens]]
        values = signals[previous].mean(axis=0).tolist() if previous is not None else None
        cut = state.step(output, step, values)
        if cut is not None:
            return s + cut.keep - 1
        output.extend(step)
        previous = slice(s, s + len(step))
    return None
