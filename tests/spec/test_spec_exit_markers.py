"""Think markers of several tokens (specdec/think_markers.py): resolution with SmolLM2's
tokenizer against the reasoning traces' own ids, span tracking over matches that straddle
engine steps and the prompt/output boundary, cuts that force the whole end marker, and
training labels on multi-token spans."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.spec.spec_exit import SpecExitState
from specdec.spec_exit_params import SpecExitParams
from specdec.think_markers import (
    MarkerMatcher,
    as_marker,
    context_mismatch,
    find_marker,
    resolve_marker,
)

OPEN, CLOSE = (44, 17400, 46), (9617, 17400, 46)  # SmolLM2's "<think>" and "</think>"
NL, NL2 = 198, 1116  # "\n" and "\n\n" (one token when nothing follows on the line)
TEXT = {44: "<", 17400: "think", 46: ">", 9617: "</", NL: "\n", NL2: "\n\n", 4: "a", 5: "b"}
SIGNALS = ("confidence", "progress", "remaining")
PASSING = [0.95, 0.9, 10.0]


def state(prompt=(9,), params: SpecExitParams | None = None) -> SpecExitState:
    params = params or SpecExitParams()
    s = SpecExitState(params, SIGNALS, params.enabled(SIGNALS), OPEN, CLOSE, TEXT.__getitem__)
    s.scan_prompt(list(prompt))
    return s


# ---------------------------------------------------------------- matching


def test_matcher_carries_partial_matches_over_pushes():
    m = MarkerMatcher(OPEN, CLOSE)
    assert [m.push(t) for t in (44, 17400)] == [None, None]
    ahead = m.copy()
    assert ahead.push(46) == 0 and m.recent == (44, 17400)  # a copy looks ahead only
    assert m.push(46) == 0
    assert [m.push(t) for t in (17400, 46, 9617, 17400, 46)] == [None, None, None, None, 1]
    one = MarkerMatcher((7,), (8,))  # one-token markers: no carried tokens at all
    assert [one.push(t) for t in (7, 3, 8)] == [0, None, 1] and one.recent == ()


def test_find_marker_over_arrays():
    ids = np.array([1, 44, 17400, 5, 44, 17400, 46, 4, 9617, 17400, 46])
    assert find_marker(ids, OPEN) == 4
    assert find_marker(ids, CLOSE, 5) == 8 and find_marker(ids, CLOSE, 9) is None
    assert find_marker(ids, (17400,)) == 2 and find_marker(ids[:2], OPEN) is None


def test_markers_given_as_ids_or_text_are_validated(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert resolve_marker(tok, "<think>") == OPEN and resolve_marker(tok, "</think>") == CLOSE
    assert resolve_marker(tok, [9617, 17400, 46]) == CLOSE
    with pytest.raises(ValueError, match=r"holds id 49152 outside this tokenizer's vocabulary"):
        resolve_marker(tok, [1, 49152], "spec_exit.think_end")
    with pytest.raises(ValueError, match="non-empty list of token ids"):
        as_marker([], "spec_exit.think_start")
    with pytest.raises(ValueError, match="negative token id"):
        as_marker([3, -1])
    params = SpecExitParams.from_dict({"think_end": [9617, 17400, 46]})
    assert params.think_end == CLOSE and hash(params)  # lists become tuples
    with pytest.raises(ValueError, match=r"think_start=\['<'\] must be text or a non-empty"):
        SpecExitParams(think_start=["<"])
    with pytest.raises(ValueError, match=r"think_end=\[46\] ends think_start=\[44, 17400, 46\]"):
        state_with(end=(46,))


def state_with(end):
    return SpecExitState(SpecExitParams(), SIGNALS, SIGNALS, OPEN, end, TEXT.__getitem__)


def test_smollm2_markers_alone_are_the_ids_the_traces_hold(smollm2_tokenizer):
    """Ground truth: every task's trace opens its reply with the ids of "<think>" alone
    and closes thinking with the ids of "</think>" alone, between newline tokens; step
    boundaries are two "\\n" tokens (not the one "\\n\\n" token the text has alone)."""
    pytest.importorskip("reasoning_gym")
    from specdec.data_gen.reasoning.format import TraceStyle, Untraceable
    from specdec.data_gen.reasoning.generate import build_record
    from specdec.data_gen.reasoning.tasks import get_tasks

    tok = smollm2_tokenizer
    assert context_mismatch(tok, "<think>") is None and context_mismatch(tok, "</think>") is None
    assert tok.encode("\n\n", add_special_tokens=False) == [NL2]
    from specdec.think_markers import find_think_span

    checked = 0
    for task in get_tasks(None):
        try:
            rec = build_record(task, "train", 3, task.entry(3), tok, TraceStyle())
        except Untraceable:
            continue
        ids, p = rec["input_ids"], rec["prompt_tokens"]
        t0, t1 = rec["think"]["tokens"]
        assert tuple(ids[p + t0 : p + t0 + 4]) == (*OPEN, NL)
        assert tuple(ids[p + t1 - 4 : p + t1 + 2]) == (NL, *CLOSE, NL, NL)
        for a, b in zip(rec["steps"], rec["steps"][1:], strict=False):
            assert ids[p + a["tokens"][1] : p + b["tokens"][0]] == [NL, NL]
        span = find_think_span(ids, OPEN, CLOSE)
        assert (span.start, span.end) == (p + t0 + 2, p + t1 - 3)
        checked += 1
    assert checked >= 8


# ---------------------------------------------------------------- span tracking


def test_span_opened_by_a_marker_split_between_prompt_and_output():
    s = state(prompt=(9, 44, 17400))
    assert not s.in_think
    assert s.step([], [46, 4, NL], PASSING) is None  # opened this step: no signals yet
    assert s.in_think is False  # folding happens at the next call
    cut = s.step([46, 4, NL], [NL, 5], PASSING)  # "\n" + "\n": a delimiter across steps
    assert s.in_think and cut is not None and (cut.keep, cut.tokens) == (1, CLOSE)


def test_start_marker_straddling_two_steps():
    s = state()
    assert s.step([], [4, 44], PASSING) is None
    assert s.step([4, 44], [17400], PASSING) is None and not s.in_think
    assert s.step([4, 44, 17400], [46, NL2], PASSING) is None  # the span opens with 46
    assert s.in_think is False
    assert s.step([4, 44, 17400, 46, NL2], [4, NL2], PASSING).keep == 2
    assert s.in_think


def test_end_marker_written_by_the_model_closes_the_span_across_steps():
    s = state(prompt=OPEN)
    out: list[int] = []
    for emitted in ([4, 9617], [17400], [46, NL2, 4, NL2]):
        assert s.step(out, emitted, PASSING) is None, emitted  # never past its own close
        out += emitted
    assert s.step(out, [NL2], PASSING) is None and not s.in_think
    s = state(prompt=OPEN)
    assert s.step([], [9617, 17400, 46, NL2], PASSING) is None  # closed before the delimiter
    s = state(prompt=OPEN)
    cut = s.step([], [9617, 17400, NL2], PASSING)  # "</think" is no marker: a step boundary
    assert cut is not None and (cut.keep, cut.tokens) == (3, CLOSE)


def test_a_closed_span_in_the_prompt_never_exits():
    assert state(prompt=(*OPEN, 4, *CLOSE)).step([], [NL2], PASSING) is None
    assert state(prompt=(9, 44, 17400)).step([], [NL2], PASSING) is None  # never opened


def test_delimiters_match_merged_and_split_newlines(smollm2_tokenizer):
    """A "\\n\\n" ends a step whether the model writes it as one token or two (SmolLM2
    writes two "\\n" tokens before text, one "\\n\\n" token before more whitespace)."""
    text_of = smollm2_tokenizer.decode
    params = SpecExitParams()
    for emitted, keep in (([4, NL, NL, 5], 3), ([4, NL2, 5], 2), ([4, 16506, 5], 2)):
        s = SpecExitState(params, SIGNALS, SIGNALS, OPEN, CLOSE, lambda t: text_of([t]))
        s.scan_prompt(list(OPEN))
        assert s.step([], emitted, PASSING).keep == keep, emitted


# ---------------------------------------------------------------- labels


def test_labels_on_a_multi_token_span():
    """p <think> t t t </think> a: span (3, 7) from the start marker's last token to the
    end marker's first, three thinking tokens in between."""
    from specdec.think_markers import find_think_span
    from specdec.train.spec_exit_labels import ExitLabeler

    ids = np.array([9, *OPEN, 4, 5, 4, *CLOSE, 5])
    span = find_think_span(ids, OPEN, CLOSE)
    assert (span.start, span.end, span.num_thinking) == (3, 7, 3)
    conf = np.full(len(ids), np.nan)
    conf[5] = 1.0
    labels = ExitLabeler(SIGNALS, OPEN, CLOSE).targets(ids, np.array([0, len(ids)]), conf)
    nan = np.nan
    np.testing.assert_allclose(labels[:, 1], [nan] * 3 + [0, 1 / 3, 2 / 3, 1] + [nan] * 4)
    np.testing.assert_allclose(labels[:, 2], [nan] * 3 + [3, 2, 1, 0] + [nan] * 4)
    # the one probe (5) labels the whole span, from the start marker's last token (3) to
    # the last thinking position (6): never the start marker's first tokens nor the end
    # marker
    np.testing.assert_allclose(labels[:, 0], [nan] * 3 + [1.0] * 4 + [nan] * 4)
    assert find_think_span(np.array([*OPEN, 4, 9617, 17400]), OPEN, CLOSE) is None  # unclosed
    assert find_think_span(np.array([44, 17400, 4, *CLOSE]), OPEN, CLOSE) is None  # no start


def test_train_config_and_labeler_take_text_or_ids(smollm2_tokenizer):
    from specdec.train.config import TrainConfig
    from specdec.train.spec_exit_labels import ExitLabeler

    config = TrainConfig.load(
        None, ["data.path=x", "spec_exit.signals=[progress]",
               "spec_exit.think_end=[9617, 17400, 46]"],
    )  # fmt: skip
    assert config.spec_exit.think_end == CLOSE and config.spec_exit.think_start == "<think>"
    cfg = config.spec_exit
    labeler = ExitLabeler.for_tokenizer(
        smollm2_tokenizer, cfg.signals, cfg.think_start, cfg.think_end
    )
    assert (labeler.think_start, labeler.think_end) == (OPEN, CLOSE)


def test_serve_body_takes_marker_ids():
    from pydantic import ValidationError

    from specdec.serve.inputs import resolve_spec_exit
    from specdec.serve.protocol import CompletionRequest

    body = CompletionRequest.model_validate(
        {"prompt": "x", "spec_exit": {"think_start": "<think>", "think_end": [9617, 17400, 46]}}
    )
    params = resolve_spec_exit(body.spec_exit, (), False)
    assert (params.think_start, params.think_end) == ("<think>", CLOSE)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "spec_exit": {"think_end": []}})
