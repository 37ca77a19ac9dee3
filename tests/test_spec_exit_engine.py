"""SpecExit in the engine, on a tiny random target with SmolLM2's tokenizer (fp32, CPU).

The exits are forced: the draft head's exit channels are constant (zero weights, biases
at confidence = progress = 0.95, remaining = 10 tokens), or, for the oracle draft model,
a stub attaches those signals to every tree. The think markers are two single tokens of
SmolLM2's vocabulary standing in for ``<think>``/``</think>``, and the delimiter is the
text of a token plain greedy decoding emits, so the step boundary is known in advance.

Checked: the output is plain greedy decoding up to and including the delimiter, then the
think-end token, then plain greedy decoding of *that* sequence (so the cut's K/V rollback
is right, for a cut inside the accepted drafts and for one at the bonus token); no exit
outside a think span, without a delimiter, or without opting in (those outputs equal
plain decoding, in the same batch).
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
from specdec.spec.spec_exit import SpecExitParams
from specdec.spec.spec_exit_runtime import SpecExitRuntime

THINK_START, THINK_END = "<filename>", "<gh_stars>"  # ids 6 and 7 in SmolLM2's vocabulary
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


def pick_delimiter(llm: LLM, tokens: list[int], avoid_bonus: int | None = None):
    """(k, text): the first index k >= 2 whose token's text (plain ASCII, 3+ characters)
    the joined text of ``tokens`` first ends with at k — the step boundary of this test.
    ``avoid_bonus`` = K + 1 skips indices where a full step's bonus token lands."""
    text = [llm.tokenizer.decode([t]) for t in tokens]
    for k in range(2, len(tokens) - 8):
        delim = text[k]
        if not (delim.isascii() and len(delim.strip()) >= 3):
            continue
        if avoid_bonus and k % avoid_bonus == 0:
            continue
        ends = [j for j in range(len(tokens)) if "".join(text[: j + 1]).endswith(delim)]
        if ends[0] == k:
            return k, delim
    raise AssertionError(f"no usable delimiter in {text}")


def exit_params(delim: str) -> SpecExitParams:
    return SpecExitParams(think_start=THINK_START, think_end=THINK_END, delimiters=(delim,))


def check_exit(plain: LLM, prompt: list[int], out: list[int], expected: list[int], k: int):
    """Plain tokens through the delimiter, the think-end token, then plain decoding of
    the cut sequence (proof that no discarded token's K/V survived)."""
    end = plain.tokenizer.encode(THINK_END, add_special_tokens=False)[0]
    assert out[: k + 1] == expected[: k + 1]
    assert out[k + 1] == end, "the think-end token must follow the delimiter at once"
    assert out[k + 2 :] == generate(plain, [prompt + out[: k + 2]], greedy(len(out) - k - 2))[0]


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
    stats = llm.engine.spec_exit.stats
    assert (stats.requests, stats.exits, stats.tokens_saved) == (1, 1, pytest.approx(10))
    pool = llm.engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_cut_inside_accepted_drafts_rolls_back_their_kv(target_dir, plain):
    """The target as its own draft model accepts every draft, so the delimiter lands
    among accepted tokens and the drafts after it were accepted too: they are dropped
    and their K/V rolled back. Signals come from a stub on the proposer. In the same
    batch, a request without a think span and one that did not opt in decode plainly."""
    k_draft = 4
    spec = SpeculativeConfig(method="draft_model", model=str(target_dir),
                             num_speculative_tokens=k_draft)  # fmt: skip
    llm = make_llm(target_dir, speculative=spec)
    engine = llm.engine
    engine.proposer.exit_signals = SIGNALS
    engine.spec_exit = SpecExitRuntime(engine.tokenizer, SIGNALS)
    propose = engine.proposer.propose

    def propose_with_signals(requests, limits):
        trees = propose(requests, limits)
        for tree in trees:
            if tree is not None:
                tree.exit_signals = torch.tensor(SIGNAL_VALUES)
        return trees

    engine.proposer.propose = propose_with_signals
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
    assert engine.spec_exit.stats.exits == 1
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_requests_that_cannot_opt_in_are_refused(target_dir, exit_head_dir, plain):
    with pytest.raises(ValueError, match="needs an EAGLE-3 draft head with SpecExit channels"):
        plain.generate([PROMPT], greedy(spec_exit=SpecExitParams()), use_tqdm=False)
    spec = SpeculativeConfig(method="eagle3", model=str(exit_head_dir), num_speculative_tokens=2)
    llm = make_llm(target_dir, speculative=spec)
    with pytest.raises(ValueError, match=r"'<think>' is 3 tokens .* must be a single token"):
        llm.generate([PROMPT], greedy(spec_exit=SpecExitParams()), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
