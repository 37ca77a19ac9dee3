"""SpecExit in the engine, on a tiny random target with SmolLM2's tokenizer (fp32, CPU).

The exits are forced: the draft head's exit channels are constant (zero weights, biases
at confidence = progress = 0.95, remaining = 10 tokens), or, for the oracle draft model,
a stub attaches those signals to every tree. The think markers are either two single
tokens of SmolLM2's vocabulary standing in for a Qwen3-style ``<think>``/``</think>``, or
SmolLM2's own plain-text ``<think>``/``</think>`` (three tokens each, the reasoning
target's); the delimiter is the text of a token plain greedy decoding emits, so the step
boundary is known in advance.

Checked: the output is plain greedy decoding up to and including the delimiter, then the
think-end marker's tokens (all k of them), then plain greedy decoding of *that* sequence
(so the cut's K/V rollback and the k-token catch-up are right, for a cut inside the
accepted drafts and for one at the bonus token); a marker budget cut short by max_tokens
forces what fits; no exit outside a think span, without a delimiter, or without opting in
(those outputs equal plain decoding, in the same batch).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.attention import get_attention_backend
from specdec.config import SpeculativeConfig
from specdec.models import load_config
from specdec.models.eagle3_formats import save_eagle3
from specdec.models.eagle3_head import Eagle3Config, Eagle3Head
from specdec.spec.spec_exit_runtime import SpecExitRuntime
from specdec.spec_exit_params import SpecExitParams

THINK_START, THINK_END = "<filename>", "<gh_stars>"  # ids 6 and 7 in SmolLM2's vocabulary
OPEN_IDS, CLOSE_IDS = [44, 17400, 46], [9617, 17400, 46]  # SmolLM2's "<think>", "</think>"
PROMPT = [1, 504, 3458, 282, 253, 1345, 30]
SIGNALS = ("confidence", "progress", "remaining")
SIGNAL_VALUES = [0.95, 0.95, 10.0]  # what the forced channels read: every default passes
NEW_TOKENS = 24


def make_target_dir(out: Path, smollm2_dir: Path, seed: int = 0) -> Path:
    """A 2-layer, 64-wide Llama with SmolLM2's tokenizer and an untied lm_head (a tied
    random model just repeats its last token; this one emits varied text)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((smollm2_dir / "config.json").read_text())
    config.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=False)  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    for f in smollm2_dir.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            (out / f.name).write_bytes(f.read_bytes())
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_target_dir(tmp_path_factory.mktemp("reasoner"), smollm2_dir)


@pytest.fixture(scope="module")
def exit_head_dir(tmp_path_factory, target_dir) -> Path:
    """A random EAGLE-3 head with constant exit channels (module docstring)."""
    config = Eagle3Config.for_target(
        load_config(str(target_dir)), 1024, aux_layer_ids=(0, 1, 1), exit_signals=SIGNALS
    )
    torch.manual_seed(0)
    head = Eagle3Head(config, get_attention_backend("torch"))
    with torch.no_grad():
        head.spec_exit.weight.zero_()
        head.spec_exit.bias.copy_(torch.tensor([math.log(19.0), math.log(19.0), math.log(11.0)]))
    return save_eagle3(head, tmp_path_factory.mktemp("exit_head"))


def make_llm(target_dir: Path, **kwargs) -> LLM:
    return LLM(str(target_dir), device="cpu", dtype="float32", kv_cache_memory=16 << 20,
               max_model_len=256, **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def plain(target_dir) -> LLM:
    return make_llm(target_dir)


def greedy(n: int = NEW_TOKENS, spec_exit: SpecExitParams | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, spec_exit=spec_exit)


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def pick_delimiter(llm: LLM, tokens: list[int], avoid_bonus: int | None = None, first: int = 2):
    """(k, text): the first index k >= ``first`` whose token's text (plain ASCII, 3+
    characters) the joined text of ``tokens`` first ends with at k — the step boundary of
    this test. ``avoid_bonus`` = K + 1 skips indices where a full step's bonus token lands."""
    text = [llm.tokenizer.decode([t]) for t in tokens]
    for k in range(first, len(tokens) - 8):
        delim = text[k]
        if not (delim.isascii() and len(delim.strip()) >= 3):
            continue
        if avoid_bonus and k % avoid_bonus == 0:
            continue
        ends = [j for j in range(len(tokens)) if "".join(text[: j + 1]).endswith(delim)]
        if ends[0] == k:
            return k, delim
    raise AssertionError(f"no usable delimiter in {text}")


def exit_params(delim: str, multi: bool = False) -> SpecExitParams:
    if multi:  # the defaults: SmolLM2's plain-text markers
        return SpecExitParams(delimiters=(delim,))
    return SpecExitParams(think_start=THINK_START, think_end=THINK_END, delimiters=(delim,))


def check_exit(
    plain: LLM, prompt: list[int], out: list[int], expected: list[int], k: int,
    end: list[int] | None = None,
):  # fmt: skip
    """Plain tokens through the delimiter, the think-end marker's tokens, then plain
    decoding of the cut sequence (proof that no discarded token's K/V survived and that
    the forced tokens' K/V was computed)."""
    end = end or plain.tokenizer.encode(THINK_END, add_special_tokens=False)
    cut = k + 1 + len(end)
    assert out[: k + 1] == expected[: k + 1]
    assert out[k + 1 : cut] == end, "the think-end marker must follow the delimiter at once"
    assert out[cut:] == generate(plain, [prompt + out[:cut]], greedy(len(out) - cut))[0]


def oracle_llm(target_dir: Path, k_draft: int = 4) -> LLM:
    """The target as its own draft model (every draft accepted), with a stub that puts
    passing exit signals on every tree."""
    spec = SpeculativeConfig(method="draft_model", model=str(target_dir),
                             num_speculative_tokens=k_draft)  # fmt: skip
    llm = make_llm(target_dir, speculative=spec)
    engine = llm.engine
    engine.proposer.exit_signals = SIGNALS
    engine.step_hooks[:] = [SpecExitRuntime(engine.tokenizer, SIGNALS)]  # shared in place
    propose = engine.proposer.propose

    def propose_with_signals(requests, limits, shape):
        trees = propose(requests, limits, shape)
        for tree in trees:
            if tree is not None:
                tree.signals = torch.tensor(SIGNAL_VALUES)
        return trees

    engine.proposer.propose = propose_with_signals
    return llm


def assert_pool_free(llm: LLM) -> None:
    pool = llm.engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_head_channels_force_the_think_end(target_dir, exit_head_dir, plain):
    """The real path: an eagle3 head whose channels are read inside the proposal. Its
    random drafts are mostly rejected, so the cut usually falls on a bonus token."""
    thinking = PROMPT + plain.tokenizer.encode(THINK_START, add_special_tokens=False)
    expected = generate(plain, [thinking], greedy())[0]
    k, delim = pick_delimiter(plain, expected)
    spec = SpeculativeConfig(method="eagle3", model=str(exit_head_dir), num_speculative_tokens=2)
    llm = make_llm(target_dir, speculative=spec)
    out = llm.generate([thinking], greedy(spec_exit=exit_params(delim)), use_tqdm=False)[0]
    check_exit(plain, thinking, out.outputs[0].token_ids, expected, k)
    assert out.metrics.spec_exits == 1
    assert out.metrics.spec_exit_tokens_saved == pytest.approx(10)  # the channels' remaining
    assert out.metrics.spec_steps > 0
    stats = llm.engine.hook(SpecExitRuntime).stats
    assert (stats.requests, stats.exits, stats.tokens_saved) == (1, 1, pytest.approx(10))
    assert_pool_free(llm)


def test_cut_inside_accepted_drafts_rolls_back_their_kv(target_dir, plain):
    """The target as its own draft model accepts every draft, so the delimiter lands
    among accepted tokens and the drafts after it were accepted too: they are dropped
    and their K/V rolled back. Signals come from a stub on the proposer. In the same
    batch, a request without a think span and one that did not opt in decode plainly."""
    k_draft = 4
    llm = oracle_llm(target_dir, k_draft)
    engine = llm.engine
    thinking = PROMPT + plain.tokenizer.encode(THINK_START, add_special_tokens=False)
    expected = generate(plain, [thinking, PROMPT], greedy())
    # Step s >= 1 emits output indices 5s-4 .. 5s; index 5s is its bonus token.
    k, delim = pick_delimiter(plain, expected[0], avoid_bonus=k_draft + 1)
    params = greedy(spec_exit=exit_params(delim))
    outs = llm.generate([thinking, PROMPT, thinking], [params, params, greedy()], use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    check_exit(plain, thinking, tokens[0], expected[0], k)
    assert tokens[1:] == [expected[1], expected[0]]  # no span; not opted in
    assert [o.metrics.spec_exits for o in outs] == [1, 0, None]
    m = outs[0].metrics
    assert m.spec_accepted_tokens == m.spec_drafted_tokens >= m.spec_steps  # an oracle
    assert engine.hook(SpecExitRuntime).stats.exits == 1
    assert_pool_free(llm)


def test_requests_that_cannot_opt_in_are_refused(target_dir, exit_head_dir, plain):
    with pytest.raises(ValueError, match="needs an EAGLE-3 draft head with SpecExit channels"):
        plain.generate([PROMPT], greedy(spec_exit=SpecExitParams()), use_tqdm=False)
    spec = SpeculativeConfig(method="eagle3", model=str(exit_head_dir), num_speculative_tokens=2)
    llm = make_llm(target_dir, speculative=spec)
    vocab = len(llm.tokenizer)
    with pytest.raises(ValueError, match=rf"think_end=\[9617, {vocab}\] holds id {vocab} outside"):
        llm.generate([PROMPT], greedy(spec_exit=SpecExitParams(think_end=(9617, vocab))),
                     use_tqdm=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"think_end=\[46\] ends think_start=\[44, 17400, 46\]"):
        llm.generate([PROMPT], greedy(spec_exit=SpecExitParams(think_end=(46,))), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---------------------------------------------------------------- multi-token markers


def test_multi_token_think_end_is_forced_whole_after_accepted_drafts(target_dir, plain):
    """SmolLM2's plain-text markers (3 tokens each; the prompt opens the span, as a chat
    template may): the delimiter lands among accepted drafts, all three ``</think>``
    tokens follow it, and the next step computes their K/V as one chunk before drafting
    resumes. In the same batch: a span the prompt already closed, a start marker the
    prompt only begins, and a request that did not opt in all decode plainly."""
    llm = oracle_llm(target_dir, k_draft=4)
    thinking = PROMPT + OPEN_IDS
    closed = PROMPT + OPEN_IDS + [504] + CLOSE_IDS
    partial = PROMPT + OPEN_IDS[:2]
    prompts = [thinking, closed, partial]
    expected = generate(plain, prompts, greedy())
    assert expected[2][0] != OPEN_IDS[2]  # else the output would complete the marker
    # Each request's own delimiter, one its plain output meets: only the span can stop it.
    delims = [pick_delimiter(plain, e, avoid_bonus=5) for e in expected]
    k = delims[0][0]
    params = [greedy(spec_exit=exit_params(d, multi=True)) for _, d in delims]
    outs = llm.generate([*prompts, thinking], [*params, greedy()], use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    check_exit(plain, thinking, tokens[0], expected[0], k, end=CLOSE_IDS)
    assert tokens[1:] == [*expected[1:], expected[0]]
    assert [o.metrics.spec_exits for o in outs] == [1, 0, 0, None]
    assert outs[0].metrics.spec_accepted_tokens == outs[0].metrics.spec_drafted_tokens
    assert_pool_free(llm)


def test_multi_token_think_end_after_a_bonus_cut(target_dir, exit_head_dir, plain):
    """The eagle3 head's own channels; its random drafts are mostly rejected, so the cut
    usually falls on the bonus token: bonus and marker (4 tokens) are computed together."""
    thinking = PROMPT + OPEN_IDS
    expected = generate(plain, [thinking], greedy())[0]
    k, delim = pick_delimiter(plain, expected)
    spec = SpeculativeConfig(method="eagle3", model=str(exit_head_dir), num_speculative_tokens=2)
    llm = make_llm(target_dir, speculative=spec)
    out = llm.generate([thinking], greedy(spec_exit=exit_params(delim, multi=True)),
                       use_tqdm=False)[0]  # fmt: skip
    check_exit(plain, thinking, out.outputs[0].token_ids, expected, k, end=CLOSE_IDS)
    assert out.metrics.spec_exits == 1
    assert_pool_free(llm)


@pytest.mark.parametrize("room", [1, 2, 3])
def test_forced_marker_never_exceeds_max_tokens(target_dir, plain, room):
    """With ``room`` < 3 tokens of budget left after the delimiter, the marker's first
    ``room`` tokens are emitted and the request ends there (force what fits); with 3 the
    whole marker fits and the request ends right after it."""
    llm = oracle_llm(target_dir)
    thinking = PROMPT + OPEN_IDS
    expected = generate(plain, [thinking], greedy())[0]
    k, delim = pick_delimiter(plain, expected, avoid_bonus=5)
    params = greedy(k + 1 + room, spec_exit=exit_params(delim, multi=True))
    out = llm.generate([thinking], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[: k + 1] + CLOSE_IDS[:room]
    assert out.outputs[0].finish_reason == "length"
    assert out.metrics.spec_exits == 1
    assert_pool_free(llm)


def test_eval_reasoning_accepts_spec_exit_for_the_smollm2_markers(
    target_dir, exit_head_dir, tmp_path, smollm2_tokenizer
):
    """``specdec eval-reasoning --spec-exit`` on a model whose markers are plain text
    (the reasoning target's tokenizer): the run is accepted, and reports the exits."""
    pytest.importorskip("reasoning_gym")
    from specdec.cli import main
    from specdec.data_gen.decontam import Decontaminator
    from specdec.data_gen.reasoning.generate import TracesConfig, run_traces

    items = tmp_path / "eval.jsonl"
    run_traces(
        TracesConfig(output=str(items), split="eval", tasks=("gcd",), num_per_task=2),
        decontaminator=Decontaminator({"none": ["nothing to match here at all"]}),
        tokenizer=smollm2_tokenizer,
    )
    args = ["eval-reasoning", "--model", str(target_dir), "--traces", str(items),
            "--out", str(tmp_path / "report"), "--max-tokens", "6",
            "--spec-exit", '{"confidence_above": 0.9, "delimiters": ["\\n\\n", "."]}',
            "--draft", "eagle3", "--draft-model", str(exit_head_dir),
            "--num-speculative-tokens", "2", "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory", str(16 << 20), "--max-model-len", "256"]  # fmt: skip
    assert main(args) == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["overall"]["items"] == 2
    assert report["sampling"]["spec_exit"]["think_end"] == "</think>"
    assert report["sampling"]["spec_exit"]["confidence_above"] == 0.9
    assert report["spec_exit"]["exits"] >= 0


def test_eval_reasoning_layers_spec_exit_over_the_heads_record(
    target_dir, exit_head_dir, tmp_path, smollm2_tokenizer
):
    """A head that records a SpecExit setting (``spec_exit_defaults``) is the base of
    ``eval-reasoning --spec-exit``: the engine hands the record on (``SpecExitRuntime``), the
    given fields override it, and the report holds the settings that ran."""
    pytest.importorskip("reasoning_gym")
    import shutil

    from specdec.cli import main
    from specdec.data_gen.decontam import Decontaminator
    from specdec.data_gen.reasoning.generate import TracesConfig, run_traces

    head = shutil.copytree(exit_head_dir, tmp_path / "head")
    config = json.loads((head / "config.json").read_text())
    record = {"confidence_above": 0.6, "smoothing": "window", "window": 2}
    (head / "config.json").write_text(json.dumps({**config, "spec_exit_defaults": record}))
    items = tmp_path / "eval.jsonl"
    run_traces(
        TracesConfig(output=str(items), split="eval", tasks=("gcd",), num_per_task=1),
        decontaminator=Decontaminator({"none": ["nothing to match here at all"]}),
        tokenizer=smollm2_tokenizer,
    )

    def ran(spec_exit: str) -> dict:
        out = tmp_path / f"report{len(list(tmp_path.iterdir()))}"
        args = ["eval-reasoning", "--model", str(target_dir), "--traces", str(items),
                "--out", str(out), "--max-tokens", "4", "--spec-exit", spec_exit,
                "--draft", "eagle3", "--draft-model", str(head),
                "--num-speculative-tokens", "2", "--device", "cpu", "--dtype", "float32",
                "--kv-cache-memory", str(16 << 20), "--max-model-len", "256"]  # fmt: skip
        assert main(args) == 0
        return json.loads((out / "report.json").read_text())["sampling"]["spec_exit"]

    head_only = ran("{}")
    assert (head_only["smoothing"], head_only["window"], head_only["confidence_above"]) == (
        "window", 2, 0.6
    )  # fmt: skip
    assert head_only["alpha"] == SpecExitParams().alpha  # fields the record leaves out
    given = ran('{"confidence_above": 0.9, "window": 3}')
    assert (given["smoothing"], given["window"], given["confidence_above"]) == ("window", 3, 0.9)
    # The check before the model loads layers over the record too: these markers clash
    # over the defaults (think_start "<think>" twice) but not over the record's.
    (head / "config.json").write_text(json.dumps(
        {**config, "spec_exit_defaults": {**record, "think_start": "<reason>"}}
    ))  # fmt: skip
    markers = ran('{"think_end": "<think>"}')
    assert (markers["think_start"], markers["think_end"]) == ("<reason>", "<think>")


def test_offline_replay_judges_settings_and_chooses(target_dir, exit_head_dir, tmp_path):
    """benchmarks/spec_exit_offline.py on one labelled trace in the reasoning format: the
    head's constant channels pass the defaults, so the replay cuts at a step boundary
    (where a probe was judged) and not under a threshold they miss; ``--judge final``
    compares the stored answers with the trace's own, and ``--choose`` keeps the setting
    that cuts most among those changing few enough answers (none if every exit changes
    the answer)."""
    import sys

    from specdec.data_gen.reasoning.confidence import step_boundaries
    from specdec.models.loader import load_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import spec_exit_offline

    tok = load_tokenizer(str(target_dir))
    reply = tok.encode("<think>\nFirst, 6 * 7 = 42.\n\nCheck: 42 / 7 = 6.\n\nSo 42.\n"
                       "</think>\n\n42", add_special_tokens=False)  # fmt: skip
    ids = [*PROMPT, *reply, 2]
    start = len(PROMPT) + len(OPEN_IDS) - 1
    end = next(i for i in range(len(ids)) if ids[i : i + 3] == CLOSE_IDS)
    bounds = step_boundaries(ids, start, end, lambda t: tok.decode([t]), ["\n\n"])
    assert len(bounds) == 2
    positions = [start, *bounds]

    def run(answers: list[str], name: str, max_changed: float) -> dict:
        record = {"id": "r0", "input_ids": ids, "loss_mask": [0] * len(PROMPT) + [1] * (
            len(ids) - len(PROMPT)), "spec_exit_confidence": {
            "positions": positions, "labels": [0.0] * 3, "answers": answers}}  # fmt: skip
        labels = tmp_path / f"{name}.jsonl"
        labels.write_text(json.dumps(record) + "\n")
        out, chosen = tmp_path / f"{name}.json", tmp_path / f"{name}-chosen.json"
        spec_exit_offline.main([
            "--model", str(target_dir), "--head", str(exit_head_dir), "--labels", str(labels),
            "--device", "cpu", "--judge", "final", "--step-tokens", "3",
            "--settings", "{}", '{"confidence_above": 0.99}', "--json", str(out),
            "--choose", str(chosen), "--max-changed", str(max_changed),
        ])  # fmt: skip
        rows = json.loads(out.read_text())["rows"]
        return {"rows": rows, "chosen": json.loads(chosen.read_text()) if chosen.exists()
                else None}  # fmt: skip

    settled = run(["7", "42", "42"], "settled", 0.02)
    cut, missed = settled["rows"]
    assert (cut["exits"], cut["unjudged"], cut["changed"]) == (1, 0, 0.0)
    assert 0 < cut["reduction"] < 1 and cut["full_think_tokens"] == end - start - 1
    assert (missed["exits"], missed["reduction"]) == (0, 0.0)
    assert settled["chosen"] == {}
    unsettled = run(["7", "7", "7"], "unsettled", 0.02)
    assert unsettled["rows"][0]["changed"] == 1.0 and unsettled["chosen"] is None
