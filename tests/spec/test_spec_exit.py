"""SpecExit without a model: the exit policy (smoothing, think spans, step boundaries,
thresholds), the labels the trainer builds from hand-made traces, the exit loss, and the
serving edge (request field, server config and flags, usage, /metrics)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specdec.spec.spec_exit import SpecExitState
from specdec.spec_exit_params import SMOOTHERS, SpecExitParams, spec_exit_fields, spec_exit_params

START, END = 1, 2  # think markers
DELIM = 3  # a token whose text is "\n\n"
TEXT = {START: "<think>", END: "</think>", DELIM: "\n\n", 4: "a", 5: "b", 6: ".\n", 7: "\n"}
SIGNALS = ("confidence", "progress", "remaining")
PASSING = [0.95, 0.9, 10.0]  # every default threshold passes (> 0.8, > 0.3, < 200)


def state(params: SpecExitParams | None = None, prompt=(9, START)) -> SpecExitState:
    params = params or SpecExitParams()
    s = SpecExitState(params, SIGNALS, params.enabled(SIGNALS), START, END, TEXT.__getitem__)
    s.scan_prompt(list(prompt))
    return s


# ---------------------------------------------------------------- the policy


def test_exit_cuts_at_the_first_delimiter_inside_the_span():
    s = state()
    cut = s.step([], [4, DELIM, 5, DELIM], PASSING)
    assert cut is not None and (cut.keep, cut.tokens, cut.saved) == (2, (END,), 10.0)
    assert (s.num_exits, s.tokens_saved) == (1, 10.0)


def test_delimiters_match_across_tokens_and_inside_one():
    """A delimiter may end inside a token (".\\n" + "\\n") or be split over two."""
    assert state().step([], [4, 6, 7, 5], PASSING).keep == 3  # ".\n" then "\n"
    s = state()
    assert s.step([], [4, 7], PASSING) is None  # one newline: no step boundary yet
    assert s.step([4, 7], [7, 5], PASSING).keep == 1  # the earlier "\n" joins this one


def test_never_mid_step():
    """No delimiter among the step's tokens: no exit, however sure the signals are."""
    s = state()
    for _ in range(5):
        assert s.step([], [4, 5, 4], PASSING) is None
    assert s.num_exits == 0


def test_never_outside_a_think_span():
    assert state(prompt=[9, 4]).step([], [DELIM, 4], PASSING) is None  # never opened
    assert state(prompt=[START, 4, END]).step([], [DELIM], PASSING) is None  # closed
    s = state(prompt=[9])
    assert s.step([], [4, START, 4, DELIM], PASSING) is None  # opened this step: no signals
    assert s.step([4, START, 4, DELIM], [4, DELIM], PASSING).keep == 2
    s = state()
    assert s.step([], [4, END, DELIM], PASSING) is None  # the model closed it itself


def test_every_enabled_threshold_must_pass():
    for i, failing in enumerate([0.5, 0.1, 500.0]):
        values = list(PASSING)
        values[i] = failing
        assert state().step([], [DELIM], values) is None, SIGNALS[i]
    only_conf = SpecExitParams(progress_above=None, remaining_below=None)
    assert state(only_conf).step([], [DELIM], [0.95, 0.0, 1e9]) is not None
    assert state().step([], [DELIM], None) is None  # no signals yet: nothing smoothed


def test_smoothing_delays_an_exit_until_the_average_passes():
    """EWMA with alpha 0.5 from confidence 0.5: 0.5 -> 0.75 -> 0.875 passes 0.8."""
    s = state(SpecExitParams(alpha=0.5))
    output: list[int] = []
    decisions = []
    for confidence in (0.5, 1.0, 1.0):
        decisions.append(s.step(output, [DELIM], [confidence, 0.9, 10.0]))
        output.append(DELIM)  # no exit: the step's tokens are appended as they are
    assert [d is not None for d in decisions] == [False, False, True]


@pytest.mark.parametrize(
    ("kind", "params", "expected"),
    [
        ("ewma", {"alpha": 0.1}, [1.0, 0.9, 0.81 + 0.1 * 0.0]),
        ("momentum", {"beta": 0.5}, [1.0, (0.25 + 0.0) / 0.75, 0.125 / 0.875]),
        ("window", {"window": 2}, [1.0, 0.5, 0.0]),
    ],
)
def test_smoothers(kind, params, expected):
    smoother = SMOOTHERS[kind](SpecExitParams(smoothing=kind, **params))
    got = [smoother.update([x])[0] for x in (1.0, 0.0, 0.0)]
    assert got == pytest.approx(expected)


class _Tokenizer:
    """Just what SpecExitRuntime reads: the vocabulary size and token texts."""

    def __len__(self) -> int:
        return 16

    def decode(self, ids) -> str:
        return "".join(TEXT.get(i, "x") for i in ids)


def test_replay_cuts_where_serving_would():
    """The policy replayed over a finished trace, 2 tokens a step: each step reads the mean
    confidence of the previous step's tokens and may cut at its own first delimiter."""
    from specdec.spec.spec_exit_replay import replay_exit
    from specdec.spec.spec_exit_runtime import SpecExitRuntime

    runtime = SpecExitRuntime(_Tokenizer(), ("confidence",))
    params = SpecExitParams(progress_above=None, remaining_below=None, smoothing="window",
                            window=1, think_start=[START], think_end=[END])  # fmt: skip
    #      prompt   | steps: [4 D] [4 4] [D 4] [4 4] [D 4] [END 5]
    ids = [9, START, 4, DELIM, 4, 4, DELIM, 4, 4, 4, DELIM, 4, END, 5]
    settled = np.zeros((len(ids), 1))
    settled[6:] = 1.0  # from position 6 on: the step [D 4] reads 0, [4 4] then [D 4] read 1
    assert replay_exit(runtime, params, ids, 2, settled, step_tokens=2) == 10
    always = np.ones((len(ids), 1))  # the first step has no signals yet; the third cuts
    assert replay_exit(runtime, params, ids, 2, always, step_tokens=2) == 6
    assert replay_exit(runtime, params, ids, 2, np.zeros((len(ids), 1)), 2) is None
    with pytest.raises(ValueError, match="step_tokens=0"):
        replay_exit(runtime, params, ids, 2, always, step_tokens=0)
    with pytest.raises(ValueError, match="13 signal rows"):
        replay_exit(runtime, params, ids, 2, always[:-1], step_tokens=2)


def test_params_are_validated_with_the_fix_named():
    with pytest.raises(ValueError, match=r"confidence_above=1.5 must be in \[0, 1\]"):
        SpecExitParams(confidence_above=1.5)
    with pytest.raises(ValueError, match=r"choose one of ewma \| momentum \| window"):
        SpecExitParams(smoothing="median")
    with pytest.raises(ValueError, match="sets no threshold"):
        SpecExitParams(confidence_above=None, progress_above=None, remaining_below=None)
    with pytest.raises(ValueError, match=r"unknown spec_exit keys \['treshold'\]"):
        SpecExitParams.from_dict({"treshold": 1})
    with pytest.raises(ValueError, match="non-empty strings"):
        SpecExitParams(delimiters=("",))
    base = SpecExitParams(alpha=0.3)
    merged = SpecExitParams.from_dict({"delimiters": ["\n\n", ".\n"]}, base=base)
    assert merged.alpha == 0.3 and merged.delimiters == ("\n\n", ".\n")


def test_layers_override_field_by_field_lowest_first():
    """Head record < server < request: a later layer's field wins, even one that repeats a
    library default (an explicit ``"smoothing": "ewma"`` undoes the head's ``window``)."""
    head = {"smoothing": "window", "window": 2, "confidence_above": 0.7}
    server = {"confidence_above": 0.9, "think_end": "</t>"}
    assert spec_exit_params() == SpecExitParams() == spec_exit_params(None, {})
    assert spec_exit_params(head) == SpecExitParams(smoothing="window", window=2,
                                                    confidence_above=0.7)  # fmt: skip
    both = spec_exit_params(head, server)
    assert (both.smoothing, both.window, both.confidence_above, both.think_end) == (
        "window", 2, 0.9, "</t>"
    )  # fmt: skip
    request = spec_exit_params(head, server, {"smoothing": "ewma", "confidence_above": 0.95})
    assert (request.smoothing, request.window, request.confidence_above) == ("ewma", 2, 0.95)
    # Validated once, after merging: a layer may swap both markers.
    swapped = spec_exit_params(head, {"think_start": "</think>", "think_end": "<think>"})
    assert (swapped.think_start, swapped.think_end) == ("</think>", "<think>")
    with pytest.raises(ValueError, match=r"spec_exit\.window=0 must be an int >= 1"):
        spec_exit_params(head, {"window": 0})
    with pytest.raises(ValueError, match="must be a mapping"):
        spec_exit_params(head, ["window", 2])
    # A partial setting, canonical: field order, JSON values; bad ones named.
    assert list(spec_exit_fields({"window": 2, "smoothing": "window"})) == ["smoothing", "window"]
    assert spec_exit_fields({"delimiters": ("\n\n",)}) == {"delimiters": ["\n\n"]}
    with pytest.raises(ValueError, match=r"unknown spec_exit keys \['alfa'\]"):
        spec_exit_fields({"alfa": 0.2})
    with pytest.raises(ValueError, match="wrong type"):
        spec_exit_fields({"alpha": "0.2"})


# ---------------------------------------------------------------- labels and loss


def test_labels_on_a_known_trace():
    """prompt p p | <think> t t t t | </think> a a: span (2, 7), four thinking tokens."""
    from specdec.think_markers import ThinkSpan, find_think_span
    from specdec.train.spec_exit_labels import ReasoningRecord, exit_targets

    ids = np.array([9, 9, START, 4, 4, 4, 4, END, 5, 5])
    span = find_think_span(ids, START, END)
    assert (span.start, span.end, span.num_thinking) == (2, 7, 4)
    conf = np.full(len(ids), np.nan)
    conf[[2, 4, 6]] = [0.0, 0.5, 1.0]  # probes at the span's start and at two boundaries
    labels = exit_targets(ReasoningRecord(ids, span, conf), ["remaining", "progress", "confidence"])
    nan = math.nan
    np.testing.assert_array_equal(
        labels,
        np.array(
            [  # confidence, progress, remaining (canonical order)
                [nan, nan, nan],
                [nan, nan, nan],
                [0.0, 0.0, 4],
                [0.5, 0.25, 3],  # the label of the boundary that closes the token's step
                [0.5, 0.5, 2],
                [1.0, 0.75, 1],
                [1.0, 1.0, 0],
                [nan, nan, nan],  # never past the span
                [nan, nan, nan],
                [nan, nan, nan],
            ],
            dtype=np.float32,
        ),
    )
    previous = exit_targets(ReasoningRecord(ids, span, conf), ["confidence"], "previous_probe")
    np.testing.assert_array_equal(previous[2:7, 0], [0.0, 0.0, 0.5, 0.5, 1.0])
    late = np.full(len(ids), np.nan)
    late[4] = 1.0  # one probe: the tokens after it (to the span's end) take its label too
    got = exit_targets(ReasoningRecord(ids, span, late), ["confidence"])[:, 0]
    np.testing.assert_array_equal(got, [nan, nan, 1, 1, 1, 1, 1, nan, nan, nan])
    got = exit_targets(ReasoningRecord(ids, span, late), ["confidence"], "previous_probe")[:, 0]
    np.testing.assert_array_equal(got, [nan, nan, nan, nan, 1, 1, 1, nan, nan, nan])
    with pytest.raises(ValueError, match=r"confidence_hold='next'; choose one of next_probe"):
        exit_targets(ReasoningRecord(ids, span, late), ["confidence"], "next")
    assert find_think_span(np.array([START, 4, 4]), START, END) is None  # never closed
    assert find_think_span(np.array([4, END]), START, END) is None
    empty = exit_targets(ReasoningRecord(np.array([START, END]), ThinkSpan(0, 1)), SIGNALS)
    assert np.isnan(empty).all()  # no thinking, no labels
    with pytest.raises(ValueError, match="one per position"):
        ReasoningRecord(ids, span, np.zeros(3))


def test_labeler_labels_each_packed_sequence():
    from specdec.train.spec_exit_labels import ExitLabeler

    labeler = ExitLabeler(("progress",), START, END)
    ids = np.array([START, 4, END, 9, START, 4, 4, 4, END])
    out = labeler.targets(ids, np.array([0, 4, 9]), None)[:, 0]
    np.testing.assert_allclose(
        out, [0, 1, np.nan, np.nan, 0, 1 / 3, 2 / 3, 1, np.nan], equal_nan=True
    )


def test_exit_loss_trains_the_channels_only():
    """Frozen head, channels trained on labels that a linear map of the aux states can
    fit: the labelled loss drops, unlabelled positions never count, other weights stay."""
    from specdec.attention import get_attention_backend
    from specdec.models import ModelConfig
    from specdec.models.eagle3_head import Eagle3Config, Eagle3Head
    from specdec.train.spec_exit_loss import SpecExitLoss
    from specdec.train.ttt import PackedBatch

    target = ModelConfig.from_hf(dict(
        architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    ))  # fmt: skip
    config = Eagle3Config.for_target(target, 32, exit_signals=SIGNALS)
    torch.manual_seed(0)
    head = Eagle3Head(config, get_attention_backend("torch"))
    n = 48
    aux = torch.randn(n, 3 * 32)
    direction = torch.randn(3 * 32)
    score = (aux @ direction) / direction.norm()
    targets = torch.stack(  # each a function of one linear score: the channels can fit it
        [(score > 0).float(), torch.sigmoid(score), torch.expm1(0.5 * score + 3)], dim=1
    )
    targets[::4] = torch.nan  # unlabelled positions
    batch = PackedBatch(
        input_ids=torch.zeros(n, dtype=torch.int64), loss_mask=torch.ones(n, dtype=torch.bool),
        aux_hidden=aux, target_hidden=torch.zeros(n, 32), cu_seqlens=torch.tensor([0, n]),
        exit_targets=targets,
    )  # fmt: skip
    loss_fn = SpecExitLoss({"remaining": 0.5})
    for name, p in head.named_parameters():
        p.requires_grad_(name.startswith("spec_exit."))
    before = {k: v.clone() for k, v in head.state_dict().items()}
    first = loss_fn(head, batch)
    assert first.signal_counts.tolist() == [36, 36, 36]
    optim = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=0.05)
    for _ in range(150):
        optim.zero_grad()
        loss_fn(head, batch).loss.backward()
        optim.step()
    final = loss_fn(head, batch)
    assert float(final.loss.detach()) < 0.5 * float(first.loss.detach())
    after = head.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("spec_exit"))


def test_frozen_draft_trains_only_the_channels_on_top_of_a_trained_head(tmp_path):
    """``freeze_draft``: TTT still runs (its figures), gradients reach the channels only;
    an init head without channels loads under fresh ones, one with others is refused."""
    from specdec.models import ModelConfig
    from specdec.models.eagle3_formats import save_eagle3
    from specdec.train.model import TargetIO, TTTModel, build_head
    from specdec.train.spec_exit_labels import ExitLabeler
    from specdec.train.spec_exit_loss import SpecExitLoss
    from specdec.train.trainer import _load_init_head, _read_init_head
    from specdec.train.ttt import PackedBatch
    from specdec.train.ttt_attention import TTTAttention

    config = ModelConfig.from_hf(dict(
        architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    ))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    target = TargetIO(
        config, torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    )
    d2t, t2d = torch.zeros(64, dtype=torch.int64), torch.ones(64, dtype=torch.bool)
    trained = build_head(target, "t", d2t, t2d, (1, 2, 3), TTTAttention())
    save_eagle3(trained, tmp_path / "trained")
    head = build_head(target, "t", d2t, t2d, (1, 2, 3), TTTAttention(), exit_signals=SIGNALS)
    _load_init_head(head, _read_init_head(str(tmp_path / "trained"), target), lambda: None)
    assert torch.equal(head.fc.weight, trained.fc.weight)
    save_eagle3(head, tmp_path / "with_channels")
    other = build_head(target, "t", d2t, t2d, (1, 2, 3), TTTAttention(), exit_signals=("progress",))
    with pytest.raises(ValueError, match=r"set spec_exit\.signals="):
        _load_init_head(
            other, _read_init_head(str(tmp_path / "with_channels"), target), lambda: None
        )

    model = TTTModel(head, target, steps=2, decay=0.8, exit_loss=SpecExitLoss({}),
                     freeze_draft=True)  # fmt: skip
    model.place_target(torch.device("cpu"), torch.float32)
    n = 12
    ids = torch.randint(64, (n,), generator=gen)
    ids[2], ids[9] = START, END
    labels = ExitLabeler(SIGNALS, START, END).targets(ids.numpy(), np.array([0, n]))
    batch = PackedBatch(
        input_ids=ids, loss_mask=torch.ones(n, dtype=torch.bool),
        aux_hidden=torch.randn(n, 96, generator=gen),
        target_hidden=torch.randn(n, 32, generator=gen),
        cu_seqlens=torch.tensor([0, n]), exit_targets=torch.from_numpy(labels),
    )  # fmt: skip
    out = model(batch)
    out.loss.backward()
    assert out.exit is not None and out.exit.signal_counts.tolist() == [0, 7, 7]
    assert out.step_valid.sum() > 0  # TTT's figures are still there
    grads = {name for name, p in head.named_parameters() if p.grad is not None}
    assert grads == {"spec_exit.weight", "spec_exit.bias"}


def test_train_config_section():
    from specdec.train.config import TrainConfig

    config = TrainConfig.load(
        None, ["data.path=x", "spec_exit.signals=[remaining, confidence]", "model.init_head=h",
               "spec_exit.freeze_draft=true", "spec_exit.remaining_weight=0.1"],
    )  # fmt: skip
    assert config.spec_exit.signals == ("confidence", "remaining")
    assert config.spec_exit.weights == {"confidence": 1.0, "remaining": 0.1}
    with pytest.raises(ValueError, match="unknown SpecExit signal"):
        TrainConfig.load(None, ["data.path=x", "spec_exit.signals=[certainty]"])
    with pytest.raises(ValueError, match=r"set spec_exit\.signals too"):
        TrainConfig.load(None, ["data.path=x", "spec_exit.freeze_draft=true"])


# ---------------------------------------------------------------- serving edge


def test_request_field_merges_with_the_server_defaults():
    from specdec.serve.errors import APIError
    from specdec.serve.inputs import resolve_spec_exit
    from specdec.serve.protocol import CompletionRequest

    server = {"confidence_above": 0.9, "think_start": "<t>", "think_end": "</t>"}
    defaults = SpecExitParams(**server)

    def resolve(field, by_default=False, head=None):
        body = CompletionRequest.model_validate({"prompt": "x", **field})
        return resolve_spec_exit(body.spec_exit, (head, server), by_default)

    assert resolve({}) is None and resolve({}, by_default=True) == defaults
    assert resolve({"spec_exit": True}) == defaults
    assert resolve({"spec_exit": False}, by_default=True) is None
    merged = resolve({"spec_exit": {"progress_above": 0.5, "smoothing": "window"}})
    assert (merged.progress_above, merged.smoothing, merged.think_start) == (0.5, "window", "<t>")
    # The draft head's record is the base: the server's fields, then the request's, win.
    head = {"smoothing": "window", "window": 2, "confidence_above": 0.7}
    opted = resolve({"spec_exit": True}, head=head)
    assert (opted.smoothing, opted.window, opted.confidence_above) == ("window", 2, 0.9)
    assert resolve({}, by_default=True, head=head) == opted
    asked = resolve({"spec_exit": {"window": 4, "confidence_above": 0.95}}, head=head)
    assert (asked.smoothing, asked.window, asked.confidence_above) == ("window", 4, 0.95)
    assert resolve({"spec_exit": {"smoothing": "ewma"}}, head=head).smoothing == "ewma"
    assert resolve({"spec_exit": {"remaining_below": None}}).remaining_below is None
    with pytest.raises(APIError, match="must be in"):
        resolve({"spec_exit": {"confidence_above": 2}})
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="treshold"):
        resolve({"spec_exit": {"treshold": 0.5}})


def test_server_config_and_flags(tmp_path):
    import yaml

    from specdec.cli import build_parser
    from specdec.serve.cli import serve_config_from_args
    from specdec.serve.config import ServeConfig

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"spec_exit": {"alpha": 0.2, "delimiters": ["\n\n", ".\n"]}}))
    config = ServeConfig.from_yaml(path)
    assert config.spec_exit == {"alpha": 0.2, "delimiters": ["\n\n", ".\n"]}  # only those set
    assert not config.spec_exit_by_default
    args = build_parser().parse_args(
        ["serve", "--config", str(path), "--spec-exit", '{"think_end": "</reason>"}',
         "--spec-exit-by-default"]
    )  # fmt: skip
    config = serve_config_from_args(args)
    assert config.spec_exit == {
        "alpha": 0.2, "think_end": "</reason>", "delimiters": ["\n\n", ".\n"]
    }  # fmt: skip
    assert config.spec_exit_by_default
    with pytest.raises(ValueError, match="unknown spec_exit keys"):
        ServeConfig.from_dict({"spec_exit": {"alfa": 0.2}})
    with pytest.raises(ValueError, match=r"spec_exit\.window=0"):
        ServeConfig(spec_exit={"window": 0})


def test_the_server_layers_its_settings_over_the_heads_record():
    """``OpenAIServing`` reads the draft head's record from the engine core's info
    (``EngineInfo.spec_exit_head_defaults``, from its ``SpecExitRuntime``) and puts the
    server's settings over it; a combination no request could use fails at start-up,
    naming both."""
    from types import SimpleNamespace

    from specdec.serve.config import ServeConfig
    from specdec.serve.inputs import resolve_spec_exit
    from specdec.serve.serving import OpenAIServing

    def serving(head, server):
        info = SimpleNamespace(max_model_len=256, spec_exit_head_defaults=head)
        engine = SimpleNamespace(info=info)
        return OpenAIServing(engine, ServeConfig(spec_exit=server), None, None)

    head = {"smoothing": "window", "window": 2}
    s = serving(head, {"window": 3, "alpha": 0.5})
    assert s.spec_exit_base == (head, {"alpha": 0.5, "window": 3})
    params = resolve_spec_exit(True, s.spec_exit_base, False)
    assert (params.smoothing, params.window, params.alpha) == ("window", 3, 0.5)
    assert resolve_spec_exit(True, serving(head, {}).spec_exit_base, False).window == 2
    assert resolve_spec_exit(True, serving(None, {}).spec_exit_base, False) == SpecExitParams()
    with pytest.raises(ValueError, match="over the draft head's recorded"):
        serving({"think_end": "</t>"}, {"think_start": "</t>"})


def test_usage_and_metrics_report_exits():
    from specdec.serve.async_engine import EngineSnapshot
    from specdec.serve.metrics import ServerMetrics
    from specdec.serve.protocol import SpecExitUsage, Usage

    plain = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    assert "spec_exit" not in plain.model_dump()
    opted = Usage(
        prompt_tokens=3, completion_tokens=4, total_tokens=7,
        spec_exit=SpecExitUsage(exits=1, think_tokens_saved_estimate=12.5),
    )  # fmt: skip
    assert opted.model_dump()["spec_exit"] == {"exits": 1, "think_tokens_saved_estimate": 12.5}
    snapshot = EngineSnapshot(spec_exit_requests=3, spec_exit_exits=2, spec_exit_tokens_saved=40)
    text = ServerMetrics(lambda: snapshot).render().decode()
    assert "specdec_spec_exit_requests_total 3.0" in text
    assert "specdec_spec_exit_triggered_total 2.0" in text
    assert "specdec_spec_exit_think_tokens_saved_total 40.0" in text
