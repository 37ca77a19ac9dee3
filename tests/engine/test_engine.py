"""The engine on the real SmolLM2-135M-Instruct (fp32, CPU): greedy output equals HF
transformers token for token, batching/chunking/prefix caching/preemption never change a
request's tokens, and bad input fails clearly."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from tiny_models import make_tiny_model_dir

from specdec import LLM, SamplingParams
from specdec.config import EngineConfig, SpeculativeConfig
from specdec.engine.async_step import AsyncStep
from specdec.engine.cuda_graph import StepGraphs
from specdec.engine.prefill_graphs import PrefillGraphs, prefill_graph_buckets
from specdec.outputs import TokenDelta
from specdec.sampling_params import RequestOutputKind
from specdec.spec.pipeline import SpecStepGraphs
from specdec.spec.tree_draft import GrowGraphs

NEW_TOKENS = 64
# Chunked prefill and a pool so small that requests are preempted mid-speculation: 80
# blocks of 16 tokens, under half of the ~180 that LOSSLESS's 8 requests hold at their
# longest, while the longest alone fits (592 prompt tokens, 32 new, 12 tree nodes).
PREEMPTING = {"max_num_batched_tokens": 64, "kv_cache_memory": 80 * 2 * 30 * 16 * 3 * 64 * 4}
DYNAMIC = {"tree": "dynamic", "num_speculative_tokens": 4, "top_k": 4, "total_tokens": 12}
# The lossless cases whose drafts are mostly rejected (random heads and draft models) make
# nearly every token its own verify step, so they run half the chats (~40-590 tokens,
# 2,565 prompt tokens) for half the tokens; greedy decoding makes those tokens the first
# LOSSLESS_TOKENS of the reference's NEW_TOKENS.
LOSSLESS = [1, 3, 5, 7, 9, 11, 13, 15]
LOSSLESS_TOKENS = 32


def make_llm(smollm2_dir, **kwargs) -> LLM:
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("kv_cache_memory", 256 << 20)
    kwargs.setdefault("max_model_len", 2048)
    return LLM(str(smollm2_dir), **kwargs)


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return make_llm(smollm2_dir)


@pytest.fixture(scope="module")
def reference(llm, chats):
    """Each prompt alone, whole prefill, prefix caching off: the engine's baseline."""
    return token_ids(llm.generate(chats, greedy(), use_tqdm=False))


@pytest.fixture(scope="module")
def lossless(chats, reference) -> tuple[list[list[int]], list[list[int]]]:
    """The lossless cases' prompts and expected tokens (LOSSLESS, LOSSLESS_TOKENS)."""
    return [chats[i] for i in LOSSLESS], [reference[i][:LOSSLESS_TOKENS] for i in LOSSLESS]


def test_greedy_equals_hf_transformers(smollm2_hf, chats, reference):
    """8 prompts of ~40-580 tokens, 64 new tokens each, fp32: token for token."""
    picked = list(range(0, 16, 2))
    lengths = [len(chats[i]) for i in picked]
    assert min(lengths) >= 20 and max(lengths) <= 600, lengths
    for i in picked:
        assert reference[i] == hf_greedy(smollm2_hf, chats[i]), f"prompt {i} ({len(chats[i])} tok)"


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """HF transformers greedy decoding with its KV cache, EOS not special (like ignore_eos):
    a plain loop, so no generation-config default can change what is compared."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        out = model(
            torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_prefix_caching": True},
        {"enable_prefix_caching": False, "max_num_batched_tokens": 64},
        {"enable_prefix_caching": True, "max_num_batched_tokens": 64},
    ],
    ids=["prefix-cache", "chunk64", "chunk64+prefix-cache"],
)
def test_batch_invariance(smollm2_dir, lossless, kwargs):
    """Each prompt equals the same prompt batched with 7 others of other lengths (~40-590
    tokens: LOSSLESS's chats, their first LOSSLESS_TOKENS), prefilled in chunks next to
    the others' decodes and with their cached prefixes."""
    prompts, expected = lossless
    llm = make_llm(smollm2_dir, **kwargs)
    assert token_ids(llm.generate(prompts, greedy(LOSSLESS_TOKENS), use_tqdm=False)) == expected
    pool = llm.engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_alone_equals_batched(llm, chats, reference):
    alone = token_ids(llm.generate([chats[5]], greedy(), use_tqdm=False))
    assert alone[0] == reference[5]


# 32 varied prompts with every stopping and sampling mode, through a pool of ~48 blocks of
# 16 tokens (room for about 3 of these requests at a time) and 64-token prefill chunks.
MIXED_KINDS = [
    greedy(24),
    SamplingParams(temperature=0, max_tokens=24),
    SamplingParams(temperature=0, max_tokens=24, stop=["."]),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=7),
    SamplingParams(temperature=0, max_tokens=1),
    SamplingParams(temperature=0, max_tokens=8, logprobs=2),
    SamplingParams(temperature=1.0, max_tokens=24, min_tokens=12, seed=3),
]
TIGHT = {
    "kv_cache_memory": 48 * 2 * 30 * 16 * 3 * 64 * 4,
    "max_model_len": 512,
    "max_num_batched_tokens": 64,
}


@pytest.fixture(scope="module")
def mixed(chats):
    prompts = [c[-(40 + 7 * i) :] for i, c in enumerate(chats * 2)]
    return prompts, [MIXED_KINDS[i % len(MIXED_KINDS)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tight_sync(smollm2_dir, mixed):
    """The mixed requests through the tight pool, synchronous steps: (llm, outputs)."""
    llm = make_llm(smollm2_dir, async_scheduling=False, **TIGHT)
    return llm, llm.generate(*mixed, use_tqdm=False)


def _output_key(out) -> tuple:
    c = out.outputs[0]
    top = [(lp.token_id, list(lp.top)) for lp in c.logprobs or []]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason, top


def _logprob_values(out) -> list[float]:
    return [v for lp in out.outputs[0].logprobs or [] for v in (lp.logprob, *lp.top.values())]


def assert_same_outputs(got, expected) -> None:
    """Tokens, text, finish and top-n ids exactly; logprob values to 1e-4 (a row's fp32
    log-softmax may round differently in another batch composition)."""
    assert [_output_key(o) for o in got] == [_output_key(o) for o in expected]
    for a, b in zip(got, expected, strict=True):
        assert _logprob_values(a) == pytest.approx(_logprob_values(b), abs=1e-4)


def assert_pool_free(engine) -> None:
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert not engine.has_unfinished_requests()


def test_preemption_keeps_outputs(smollm2_dir, mixed, tight_sync):
    """32 requests through a pool far too small for all of them at once finish with the
    outputs of a roomy pool, and the pool ends free."""
    roomy = make_llm(smollm2_dir, async_scheduling=False, kv_cache_memory=64 << 20)
    expected = roomy.generate(*mixed, use_tqdm=False)
    tight, got = tight_sync
    assert_same_outputs(got, expected)
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in got) > 0
    # A request's timeline stays ordered; re-admission after a preemption keeps the first.
    for m in (o.metrics for o in got):
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert {o.outputs[0].finish_reason for o in got} == {"stop", "length"}
    floors = [p.min_tokens for p in mixed[1]]
    assert all(len(o.outputs[0].token_ids) >= m for o, m in zip(got, floors, strict=True))
    assert_pool_free(tight.engine)


def test_prefix_cache_computes_shared_system_prompt_once(llm, chats):
    # The default system prompt (~20 tokens) spans at least one full block. Requests
    # admitted in the same step as the one that computes it cannot reuse it yet, so one
    # request runs first (whatever ran before on the shared engine); then every later
    # request hits.
    llm.generate(chats[7:8], greedy(4), use_tqdm=False)
    outs = llm.generate(chats[8:12], greedy(4), use_tqdm=False)
    assert all(o.metrics.num_cached_tokens >= 16 for o in outs)


def test_stop_conditions(llm):
    out = llm.chat(
        [{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
        SamplingParams(temperature=0, max_tokens=64, stop=["5"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "5"
    assert "5" not in out.text
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 3


def test_seeded_sampling_is_reproducible_and_batch_independent(llm, chats):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=1234)
    alone = token_ids(llm.generate([chats[3]], params, use_tqdm=False))[0]
    batched = token_ids(
        llm.generate(
            chats[:6],
            [SamplingParams(temperature=1.0, max_tokens=16)] * 3
            + [params]
            + [SamplingParams(temperature=1.0, max_tokens=16)] * 2,
            use_tqdm=False,
        )
    )[3]
    assert alone == batched


def test_logprobs(llm):
    out = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=4, logprobs=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and len(lp.top) == 3
        assert max(lp.top, key=lp.top.get) == tok  # greedy: the sampled token is the top one
        assert lp.logprob <= 0


def test_errors_name_value_and_limit(llm):
    with pytest.raises(ValueError, match=r"prompt has 3,000 tokens; max_model_len is 2,048"):
        llm.generate([[5] * 3000], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5] * 2000], greedy(100), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(FileNotFoundError, match=r"no-such-model.*smollm2-135m-instruct"):
        LLM("no-such-model")
    with pytest.raises(FileNotFoundError, match="/does/not/exist"):
        LLM("/does/not/exist")
    # A bad prompt in a batch fails before anything runs and leaves the engine clean.
    with pytest.raises(ValueError):
        llm.generate([[5] * 10, [5] * 5000], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_async_scheduling_equals_sync(smollm2_dir, mixed, tight_sync):
    """One step in flight (step N+1 launched before the host reads step N's tokens, its
    decode rows fed from the device) changes no output: greedy with and without EOS, stop
    strings, min_tokens, max_tokens=1, seeded sampling and logprobs, under chunked prefill,
    prefix caching and preemption. Stopped requests' extra tokens are dropped, and the
    pool ends free."""
    llm = make_llm(smollm2_dir, async_scheduling=True, **TIGHT)
    assert llm.engine.async_scheduling
    got = llm.generate(*mixed, use_tqdm=False)
    assert_same_outputs(got, tight_sync[1])
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.num_dropped_tokens > 0  # stops were seen one step late
    assert_pool_free(llm.engine)


def test_async_scheduling_streams_and_aborts_with_a_step_in_flight(smollm2_dir, chats, reference):
    """Streaming under async scheduling: every token reaches the client once, in order; a
    request aborted while its next step is in flight emits nothing more, and the others
    keep their greedy tokens."""
    engine = make_llm(smollm2_dir, async_scheduling=True).engine
    params = SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    ids = [engine.add_request(chats[i], params) for i in range(4)]
    got: dict[str, list[int]] = {i: [] for i in ids}
    text: dict[str, str] = {i: "" for i in ids}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.outputs[0].token_ids
            text[out.request_id] += out.outputs[0].text
        step += 1
        if step == 6:
            assert engine.mode(AsyncStep).in_flight  # the abort lands on a launched step
            engine.abort_request(ids[1])
            aborted_at = len(got[ids[1]])
    assert len(got[ids[1]]) == aborted_at < NEW_TOKENS
    assert got[ids[1]] == reference[1][:aborted_at]
    for i in (0, 2, 3):
        assert got[ids[i]] == reference[i]
        assert text[ids[i]] == engine.tokenizer.decode(reference[i], skip_special_tokens=True)
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_async_scheduling_with_speculation_needs_a_batch_cutoff():
    spec = SpeculativeConfig(method="ngram")
    with pytest.raises(ValueError, match=r"needs speculative\.disable_by_batch_size"):
        EngineConfig(async_scheduling=True, speculative=spec)
    cutoff = SpeculativeConfig(method="ngram", disable_by_batch_size=4)
    assert EngineConfig(async_scheduling=True, speculative=cutoff).async_scheduling


@pytest.mark.parametrize("proposer", ["ngram", "eagle3-dynamic"])
def test_plain_steps_run_async_above_the_speculation_cutoff(
    smollm2_dir, random_head_dir, chats, reference, proposer
):
    """Async scheduling with a proposer: while more requests run than the cutoff, steps are
    plain and asynchronous (EAGLE-3's aux states wait in the runner's aux cache:
    test_band_switch.py); once the batch shrinks to the cutoff, the step in flight is
    drained and speculation takes over. Every output equals plain greedy decoding and the
    pool ends free."""
    if proposer == "ngram":
        spec = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2)
    else:
        spec = SpeculativeConfig(
            method="eagle3", model=str(random_head_dir), disable_by_batch_size=2, **DYNAMIC
        )
    llm = make_llm(smollm2_dir, speculative=spec, async_scheduling=True)
    engine = llm.engine
    launched: list[int] = []  # batch sizes of the asynchronous (plain) steps
    mode = engine.mode(AsyncStep)
    launch = mode._launch
    mode._launch = lambda scheduled: launched.append(len(scheduled)) or launch(scheduled)
    lengths = [NEW_TOKENS * (i % 3 + 1) // 3 for i in range(6)]  # requests end at 3 steps
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    got = token_ids(llm.generate(chats[:6], params, use_tqdm=False))
    assert got == [ref[:n] for ref, n in zip(reference[:6], lengths, strict=True)]
    # Asynchronous while more than 2 requests were unfinished (a step may then schedule
    # fewer: a request whose pending token is its last is not scheduled again).
    assert launched[:3] == [6, 6, 6] and len(launched) > NEW_TOKENS // 3
    assert engine.spec_stats.steps > 0  # and speculative at or below it
    assert engine.spec_stats.accepted_tokens > 0 or proposer != "ngram"
    assert_pool_free(engine)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        PREEMPTING,
    ],
    ids=["batch8", "chunk64+preemption"],
)
def test_ngram_speculation_is_lossless(smollm2_dir, lossless, kwargs):
    """Prompt-lookup drafts (chains of 4) verified by the target: same tokens as plain
    greedy decoding, for 8 requests batched together."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    llm = make_llm(smollm2_dir, speculative=spec, **kwargs)
    prompts, expected = lossless
    assert token_ids(llm.generate(prompts, greedy(LOSSLESS_TOKENS), use_tqdm=False)) == expected
    stats = llm.engine.spec_stats
    assert stats.steps > 0 and stats.accepted_tokens > 0  # drafts were really verified
    rates = stats.acceptance_rates
    assert all(a >= b for a, b in itertools.pairwise(rates))
    if "kv_cache_memory" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    pool = llm.engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_delta_outputs_carry_every_emitted_token(smollm2_dir, chats, reference):
    """Streaming (DELTA) with speculation: a verify step may emit several tokens, and every
    one reaches the client, with its text, exactly once; TOKENS (a server's engine core)
    reports the same tokens as ``TokenDelta`` tuples, without text, and never loads the
    tokenizer."""
    spec = SpeculativeConfig(num_speculative_tokens=4)
    engine = make_llm(smollm2_dir, speculative=spec).engine
    engine._tokenizer = None  # as in a serving core: nothing has needed it yet
    params = SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    deltas: dict[str, list[list[int]]] = {"text": [], "ids": []}
    text, finish = "", None

    def run() -> None:
        nonlocal text, finish
        while engine.has_unfinished_requests():
            for out in engine.step():
                if isinstance(out, TokenDelta):
                    deltas[out.request_id].append(out.token_ids)
                    finish = out.finish_reason or finish
                else:
                    deltas[out.request_id].append(out.outputs[0].token_ids)
                    text += out.outputs[0].text

    tokens_only = dataclasses.replace(params, output_kind=RequestOutputKind.TOKENS)
    engine.add_request(chats[3], tokens_only, "ids")
    run()
    assert engine._tokenizer is None
    engine.add_request(chats[3], params, "text")
    run()
    for d in deltas.values():
        assert [t for step in d for t in step] == reference[3]
    assert max(len(d) for d in deltas["text"]) > 1  # some step really emitted several tokens
    assert text == engine.tokenizer.decode(reference[3], skip_special_tokens=True)
    assert finish == "length"


@pytest.mark.parametrize("proposer", ["ngram", "eagle3-dynamic"])
def test_speculation_alone_equals_plain(smollm2_dir, random_head_dir, chats, reference, proposer):
    """Batch 1: a request speculating alone emits the plain greedy tokens."""
    if proposer == "ngram":
        spec = SpeculativeConfig(num_speculative_tokens=3)
    else:
        spec = SpeculativeConfig(method="eagle3", model=str(random_head_dir), **DYNAMIC)
    llm = make_llm(smollm2_dir, speculative=spec)
    assert token_ids(llm.generate([chats[7]], greedy(), use_tqdm=False))[0] == reference[7]
    assert llm.engine.spec_stats.steps > 0


@pytest.mark.parametrize("uniform_verify", [False, True], ids=["mixed-step", "root-only-tree"])
def test_speculation_can_be_switched_off_per_request(smollm2_dir, chats, reference, uniform_verify):
    """``speculate=False`` decodes that request plainly (no drafts, no spec steps; with
    uniform verify steps, as on the GPU, through a root-only tree) while the rest of the
    batch speculates; every output is the plain greedy one."""
    llm = make_llm(smollm2_dir, speculative=SpeculativeConfig(num_speculative_tokens=3))
    llm.engine.uniform_verify = uniform_verify
    picked = [3, 7, 9]
    params = [greedy(), dataclasses.replace(greedy(), speculate=False), greedy()]
    outs = llm.generate([chats[i] for i in picked], params, use_tqdm=False)
    assert token_ids(outs) == [reference[i] for i in picked]
    steps = [o.metrics.spec_steps for o in outs]
    assert steps[1] == 0 and steps[0] > 0 and steps[2] > 0, steps
    with pytest.raises(TypeError, match="speculate"):
        SamplingParams(speculate="no")


@pytest.mark.parametrize("proposer", ["ngram", "eagle3-dynamic"])
def test_verify_steps_padded_to_a_graph_shape_are_lossless(
    smollm2_dir, random_head_dir, chats, reference, proposer
):
    """What the GPU path does to replay a graph: every tree padded to one size with filler
    nodes (uneven ngram chains; dynamic trees below a chain fallback). Same tokens."""
    from specdec.engine.input_batch import build_step_inputs

    if proposer == "ngram":
        spec, pad = SpeculativeConfig(num_speculative_tokens=4), 5
    else:
        spec, pad = SpeculativeConfig(method="eagle3", model=str(random_head_dir), **DYNAMIC), 13
    llm = make_llm(smollm2_dir, speculative=spec)
    runner = llm.engine.runner
    padded = []

    def prepare(scheduled, trees=None):
        inputs = build_step_inputs(
            scheduled, runner.block_size, runner.device, trees=trees, pad_trees_to=pad
        )
        if inputs.uniform_q == pad and any(t.num_nodes < pad for t in trees.values()):
            padded.append(inputs)
        return inputs

    runner.prepare = prepare
    llm.engine.uniform_verify = True  # as on the GPU: rows without a draft get root-only trees
    picked = [0, 3, 5, 9]
    outs = llm.generate([chats[i] for i in picked], greedy(), use_tqdm=False)
    assert token_ids(outs) == [reference[i] for i in picked]
    assert padded, "no step had trees shorter than the padded size"
    stats = llm.engine.spec_stats
    assert stats.steps > 0 and stats.drafted_tokens >= stats.steps  # root-only: no steps


def test_oracle_draft_model_accepts_everything(smollm2_dir, llm, chats):
    """The target as its own draft model: every draft is accepted, τ = K + 1, and the
    output equals plain greedy decoding."""
    k = 3
    spec = SpeculativeConfig(method="draft_model", model=str(smollm2_dir), num_speculative_tokens=k)
    oracle = make_llm(smollm2_dir, speculative=spec)
    params = greedy(1 + (k + 1) * 8)  # prefill's token, then 8 full steps
    expected = token_ids(llm.generate(chats[:4], params, use_tqdm=False))
    assert token_ids(oracle.generate(chats[:4], params, use_tqdm=False)) == expected
    outs = oracle.generate(chats[:2], params, use_tqdm=False)
    assert all(o.metrics.tau == k + 1 and o.metrics.spec_steps == 8 for o in outs)
    stats = oracle.engine.spec_stats
    assert stats.accepted_tokens == stats.drafted_tokens == 6 * 8 * k
    assert stats.tau == k + 1
    assert stats.acceptance_rates == [1.0] * k


def test_oracle_draft_tree_accepts_its_best_path(smollm2_dir, llm, chats):
    """A static tree drafted by the target itself: the rank-0 path is always the target's
    greedy continuation, so every step accepts the full depth (τ = depth + 1) whatever the
    side branches hold: draft steps over a tree see exactly their ancestors."""
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2, 0], [0, 0, 1]]
    spec = SpeculativeConfig(
        method="draft_model", model=str(smollm2_dir), tree="static", choices=choices
    )
    oracle = make_llm(smollm2_dir, speculative=spec)
    params = greedy(1 + 4 * 6)  # prefill's token, then 6 steps of depth 3 + bonus
    expected = token_ids(llm.generate(chats[4:8], params, use_tqdm=False))
    outs = oracle.generate(chats[4:8], params, use_tqdm=False)
    assert token_ids(outs) == expected
    assert all(o.metrics.tau == 4 and o.metrics.spec_steps == 6 for o in outs)
    assert oracle.engine.spec_stats.drafted_tokens == 4 * 6 * len(choices)


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory, smollm2_dir):
    """A 2-layer random model with SmolLM2's vocabulary: a draft that is mostly wrong."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("random_draft"), smollm2_dir, seed=0)


def test_random_draft_model_is_lossless_under_preemption(smollm2_dir, random_draft_dir, lossless):
    """Dynamic trees (chains take the same path: the oracle tests above run them)."""
    spec = SpeculativeConfig(method="draft_model", model=str(random_draft_dir), **DYNAMIC)
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    llm = make_llm(
        smollm2_dir,
        speculative=spec,
        max_num_batched_tokens=64,
        kv_cache_memory=120 * block_bytes,
    )
    prompts, expected = lossless
    assert token_ids(llm.generate(prompts, greedy(LOSSLESS_TOKENS), use_tqdm=False)) == expected
    stats = llm.engine.spec_stats
    assert stats.steps > 0 and stats.accepted_tokens < stats.drafted_tokens  # mostly wrong
    assert llm.engine.scheduler.num_preemptions > 0
    assert not llm.engine.proposer._states  # per-request draft state released


@pytest.mark.parametrize(
    ("tree", "kwargs"),
    [
        ({"num_speculative_tokens": 3}, {}),
        ({"num_speculative_tokens": 3}, PREEMPTING),
        (DYNAMIC, {}),
        (DYNAMIC, PREEMPTING),
    ],
    ids=[
        "chain-batch8",
        "chain-chunk64+preemption",
        "dynamic-batch8",
        "dynamic-chunk64+preemption",
    ],
)
def test_random_eagle3_head_is_lossless(smollm2_dir, random_head_dir, lossless, tree, kwargs):
    spec = SpeculativeConfig(method="eagle3", model=str(random_head_dir), **tree)
    llm = make_llm(smollm2_dir, speculative=spec, **kwargs)
    prompts, expected = lossless
    assert token_ids(llm.generate(prompts, greedy(LOSSLESS_TOKENS), use_tqdm=False)) == expected
    stats = llm.engine.spec_stats
    assert stats.steps > 0 and stats.accepted_tokens < stats.drafted_tokens  # mostly wrong
    if kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    assert len(llm.engine.proposer.rows) == 0


def _full_forward_inputs(n: int, block_size: int = 16):
    """Metadata for one sequence of n tokens laid out in blocks 1, 2, ... (fresh cache)."""
    from specdec.ops.attention_metadata import AttentionMetadata

    nb = (n + block_size - 1) // block_size
    blocks = torch.arange(1, nb + 1, dtype=torch.int32)
    pos = torch.arange(n)
    meta = AttentionMetadata(
        slot_mapping=blocks[pos // block_size].long() * block_size + pos % block_size,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=blocks[None, :],
        max_query_len=n,
        max_seq_len=n,
    )
    return pos, meta, nb + 1


def test_eagle3_incremental_catch_up_equals_full_recompute(smollm2_dir, random_head_dir, chats):
    """Every depth-1 draft the proposer makes (after catching up step by step, across
    accepted and rejected drafts) equals the head run from scratch over the whole
    sequence with the target's aux states: positions, shifting and paging are right."""
    spec = SpeculativeConfig(method="eagle3", model=str(random_head_dir), num_speculative_tokens=2)
    llm = make_llm(smollm2_dir, speculative=spec)
    proposer = llm.engine.proposer
    seen: list[tuple[list[int], int]] = []
    propose = proposer.propose

    def recording(requests, limits, shape):
        trees = propose(requests, limits, shape)
        for request, tree in zip(requests, trees, strict=True):
            if tree is not None:
                seen.append((list(request.all_token_ids), tree.token_ids[1:].tolist()))
        return trees

    proposer.propose = recording
    llm.generate([chats[2]], greedy(12), use_tqdm=False)
    assert len(seen) >= 4
    target, head = llm.engine.runner.model, proposer.head
    c, hc = target.config, head.config
    for tokens, drafts in seen:
        n = len(tokens) - 1  # tokens 0..n-1 are computed; tokens[n] is the root
        pos, meta, nb = _full_forward_inputs(n)
        shape = (nb, 16, c.num_kv_heads, c.head_dim)
        kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]
        with torch.inference_mode():
            _, aux = target(torch.tensor(tokens[:n]), pos, kv, meta, hc.aux_layer_ids)
            head_shape = (nb, 16, hc.num_kv_heads, hc.head_dim)
            head_kv = [(torch.zeros(head_shape), torch.zeros(head_shape))]
            out, logits = head(torch.tensor(tokens[1 : n + 1]), head.fuse(aux), pos, head_kv, meta)
            expected = [int(head.draft_to_target(logits[-1].argmax()))]
            if len(drafts) > 1:  # depth 2: the first draft at position n, previous output
                pos2, meta2, _ = _full_forward_inputs(n + 1)
                meta2.query_start_loc = torch.tensor([0, 1], dtype=torch.int32)
                meta2.slot_mapping = meta2.slot_mapping[-1:]
                meta2.max_query_len, meta2.query_lens_cpu = 1, None
                _, logits2 = head(torch.tensor(expected), out[-1:], pos2[-1:], head_kv, meta2)
                expected.append(int(head.draft_to_target(logits2[-1].argmax())))
        assert drafts == expected


# ---- CUDA-graph plumbing, on CPU -----------------------------------------------------


class EagerStepGraphs(StepGraphs):
    """A stand-in for captured step graphs: "replay" reruns the forward on the static
    buffers and writes the captured output tensors in place, as a real replay does."""

    def _capture(self, key, args):
        self.__dict__.setdefault("_args", {})[key] = args
        return self._forward(*args)

    def _replay(self, key) -> None:
        logits, aux = self._forward(*self._args[key])
        out_logits, out_aux = self.outputs[key]
        out_logits.copy_(logits)
        if aux is not None:
            out_aux.copy_(aux)


class EagerPrefillGraphs(PrefillGraphs):
    """The same stand-in for prefill graphs; the forward runs at the first replay (not at
    capture: dozens of buckets of up to thousands of tokens cost minutes on a CPU)."""

    def _capture(self, key, args):
        self.__dict__.setdefault("_args", {})[key] = args
        return None

    def _replay(self, key) -> None:
        self.outputs[key] = self._forward(*self._args[key])


class EagerGrowGraphs(GrowGraphs):
    """The same stand-in for a proposer's captured growth."""

    def _capture(self, bs, inputs):
        self.__dict__.setdefault("_inputs", {})[bs] = inputs
        return self._grow(self.shape, inputs, self.max_seq_len)

    def _replay(self, bs) -> None:
        out = self._grow(self.shape, self._inputs[bs], self.max_seq_len)
        captured = self.outputs[bs]
        for name in ("token_ids", "parents", "depths", "ancestor_mask"):
            dst = getattr(captured, name)
            if dst is not None and dst.stride(0) != 0:  # stride 0: a per-shape constant
                dst.copy_(getattr(out, name))


class EagerSpecStepGraphs(SpecStepGraphs):
    """The same stand-in for the pipelined speculative step's graphs."""

    def _capture(self, shape, bs):
        self.inputs[:bs].fill_(self.pipeline.pad_row)
        return self._run(shape, bs)

    def _replay(self, shape, bs) -> None:
        self.__dict__.setdefault("replayed", []).append((shape, bs))
        self.outputs[shape, bs].copy_(self._run(shape, bs))


@pytest.mark.parametrize("proposer", ["none-async", "ngram", "eagle3-dynamic", "draft-chain-bands"])
def test_graph_plumbing_keeps_outputs(
    smollm2_dir, random_head_dir, random_draft_dir, chats, reference, proposer, monkeypatch
):
    """The GPU path's static buffers, batch-bucket padding, tree padding, root-only rows
    and captured proposals, and plain decoding with async scheduling (decode graphs fed
    pending tokens), run on CPU with graph stand-ins: plain greedy tokens, and every
    graph path taken."""
    from specdec.engine import model_runner
    from specdec.spec import tree_draft

    spec = {
        "none-async": None,
        "ngram": SpeculativeConfig(num_speculative_tokens=4),
        "eagle3-dynamic": SpeculativeConfig(method="eagle3", model=str(random_head_dir), **DYNAMIC),
        "draft-chain-bands": SpeculativeConfig(
            method="draft_model",
            model=str(random_draft_dir),
            num_speculative_tokens=3,
            num_speculative_tokens_by_batch_size=[[4, 5]],
        ),
    }[proposer]
    llm = make_llm(
        smollm2_dir,
        speculative=spec,
        max_num_seqs=8,
        cuda_graph_max_batch_size=8,
        async_scheduling=spec is None,
    )
    engine = llm.engine
    monkeypatch.setattr(model_runner, "StepGraphs", EagerStepGraphs)
    monkeypatch.setattr(model_runner, "PrefillGraphs", EagerPrefillGraphs)
    monkeypatch.setattr(tree_draft, "GrowGraphs", EagerGrowGraphs)
    engine.runner.runtime = dataclasses.replace(engine.runner.runtime, use_cuda_graphs=True)
    engine._capture_graphs()
    engine.uniform_verify = True
    picked = [1, 2, 4, 6, 8, 11]  # 6 requests: the 8-bucket pads two sequences
    # Two stop early, so that the last steps run 4 requests (the bands' other shape).
    n = LOSSLESS_TOKENS
    lengths = [n - 8, n - 8] + [n] * 4
    outs = llm.generate([chats[i] for i in picked], [greedy(k) for k in lengths], use_tqdm=False)
    assert token_ids(outs) == [reference[i][:k] for i, k in zip(picked, lengths, strict=True)]
    assert engine.runner.prefill_graphs.num_replays > 0  # the six prompts' prefill
    if spec is None:
        assert engine.runner.graphs.num_replays.get(1, 0) > n / 2
        return
    q = engine.proposer.shape_at(len(picked)).max_draft_tokens + 1
    assert engine.runner.graphs.num_replays.get(q, 0) > 0
    grower = getattr(engine.proposer, "grower", None)
    if grower is not None:
        assert grower.num_replays > 0
    if proposer == "draft-chain-bands":  # once at most 4 requests run: chains of 5
        assert engine.runner.graphs.num_replays.get(6, 0) > 0


def test_prefill_graph_buckets_leave_room_for_a_padding_sequence() -> None:
    # The last token bucket holds the token limit plus the padding of any step.
    assert prefill_graph_buckets(2048, 32, 8192) == (
        [64, 128, 256, 512, 1024, 2048, 2080],
        [2, 4, 8, 16, 32, 33],
    )
    assert prefill_graph_buckets(300, 4, 256) == ([64, 128, 256, 260], [2, 4, 5])
    # Its padding could outgrow a padding sequence's block table: left out.
    assert prefill_graph_buckets(256, 200, 256) == ([64, 128, 256], [2, 4, 8, 16, 32, 64, 128, 201])
    assert prefill_graph_buckets(0, 32, 8192) == ([], [])
    # A step that fills the token budget (the scheduler's steps while prompts wait), over
    # any number of sequences, replays a graph instead of running eagerly.
    tokens, seqs = prefill_graph_buckets(8192, 64, 8192)
    full = EagerPrefillGraphs(None, 4, 8192, torch.device("cpu"), tokens, seqs)
    full.outputs = dict.fromkeys(full.keys)
    for num_seqs in range(1, 65):
        key = full.bucket(8192, num_seqs, num_seqs)
        assert key is not None and key[0] == 8192 + 64, (num_seqs, key)
    assert full.bucket(5000, 1, 1) == (8192, 2)  # a smaller step keeps the limit's bucket
    graphs = EagerPrefillGraphs(None, 4, 256, torch.device("cpu"), [64, 128], [2, 4, 5])
    assert graphs.bucket(1, 1, 1) is None  # nothing captured yet
    graphs.outputs = dict.fromkeys([(64, 4), (128, 4)])  # as if captured
    assert graphs.bucket(1, 1, 1) == (64, 4)  # the smallest captured bucket that holds it
    assert graphs.bucket(61, 1, 1) == (64, 4)  # 61 tokens + 3 padding sequences
    assert graphs.bucket(62, 1, 1) == (128, 4)
    graphs.outputs = dict.fromkeys(graphs.keys)
    assert graphs.bucket(1, 1, 1) == (64, 2)  # one decode row: a padding sequence of 63
    assert graphs.bucket(63, 1, 1) == (64, 2)
    assert graphs.bucket(64, 1, 1) == (128, 2)  # no token left for the padding sequence
    assert graphs.bucket(62, 2, 2) == (64, 4)  # sequence buckets are strictly larger
    assert graphs.bucket(10, 2, 5) == (64, 5)  # logits rows fit the sequence bucket
    assert graphs.bucket(127, 4, 4) == (128, 5)
    assert graphs.bucket(128, 4, 4) is None  # 128 + 1 tokens > 128
    assert graphs.bucket(10, 5, 5) is None  # 5 sequences leave no room for padding
    assert graphs.bucket(10, 2, 9) is None  # 9 logits rows: chains need logits_per_seq
    # An engine verifying chains of 4 nodes: min(T, 4 S) logits rows per graph.
    chains = EagerPrefillGraphs(None, 4, 256, torch.device("cpu"), [64, 128], [2, 4, 5], 4)
    chains.outputs = dict.fromkeys(chains.keys)
    assert chains.bucket(10, 2, 9) == (64, 4)  # a prompt next to 2 chains: 1 + 2 x 4 rows
    assert chains.bucket(10, 1, 8) == (64, 2)
    assert chains.bucket(20, 4, 17) == (64, 5)
    assert chains.bucket(20, 4, 21) is None
    assert [chains.num_logits(k) for k in [(64, 2), (64, 5), (128, 5)]] == [8, 20, 20]


@pytest.mark.parametrize(
    "case", ["arrivals", "chunked-arrivals", "prefix-cached", "arrivals-next-to-chains"]
)
def test_prefill_graphs_keep_outputs(
    smollm2_dir, trained_head_dir, chats, reference, case, monkeypatch
) -> None:
    """Steps with prefill tokens replayed from (stand-in) prefill graphs: prompts arriving
    while others decode (prefill + decode rows in one step) or verify EAGLE-3 chains
    (prefill + chain rows: several logits rows per sequence; the chain's depth set by
    batch size), prompt chunks next to decodes, and prompts whose cached prefix is
    context: every token as the eager engine's, and most such steps from a graph."""
    from specdec.engine import model_runner
    from specdec.spec import tree_draft

    kwargs = {
        "arrivals": {"async_scheduling": True},
        "chunked-arrivals": {"max_num_batched_tokens": 96, "async_scheduling": True},
        "prefix-cached": {"enable_prefix_caching": True, "async_scheduling": True},
        "arrivals-next-to-chains": {
            "speculative": SpeculativeConfig(
                method="eagle3",
                model=str(trained_head_dir),
                num_speculative_tokens=3,
                num_speculative_tokens_by_batch_size=[[2, 5]],
            )
        },
    }[case]
    llm = make_llm(
        smollm2_dir,
        max_num_seqs=4,
        prefill_graph_max_tokens=512,
        prefill_graph_max_seqs=4,
        **kwargs,
    )
    engine = llm.engine
    monkeypatch.setattr(model_runner, "StepGraphs", EagerStepGraphs)
    monkeypatch.setattr(model_runner, "PrefillGraphs", EagerPrefillGraphs)
    monkeypatch.setattr(tree_draft, "GrowGraphs", EagerGrowGraphs)
    engine.runner.runtime = dataclasses.replace(engine.runner.runtime, use_cuda_graphs=True)
    engine._capture_graphs()
    shapes = []  # the shape of every synchronous speculative step
    if engine.proposer is not None:
        propose = engine.proposer.propose
        monkeypatch.setattr(
            engine.proposer,
            "propose",
            lambda r, m, shape: shapes.append(shape) or propose(r, m, shape),
        )
    picked = [0, 3, 5, 7, 9, 12] if case != "prefix-cached" else [3, 3, 5, 5]
    # Uneven lengths, so requests finish one by one and each arrival joins running ones.
    lengths = [32 - 6 * i for i in range(len(picked))]
    if case == "arrivals-next-to-chains":
        # Rising, so the last arrivals outlive the rest and run two and then one at a
        # time (the deeper band) for many steps, whatever the head accepts.
        lengths.reverse()
    waiting = list(range(len(picked)))
    running: dict[str, int] = {}
    outs: dict[int, list[int]] = {}
    while waiting or running:
        while waiting and len(running) < 3:
            i = waiting.pop(0)
            running[engine.add_request(chats[picked[i]], greedy(lengths[i]))] = i
        for out in engine.step():
            if out.finished:
                outs[running.pop(out.request_id)] = list(out.outputs[0].token_ids)
    expected = [reference[j][:n] for j, n in zip(picked, lengths, strict=True)]
    assert [outs[i] for i in range(len(picked))] == expected
    # Every step with an arrival (the first holds three); chunked, some steps are full
    # (96 tokens leave no room for padding) and run eagerly.
    assert engine.runner.prefill_graphs.num_replays >= len(picked) - 2
    if shapes:  # three requests draft chains of 3, one or two chains of 5
        assert {s.depth for s in shapes} == {3, 5}
