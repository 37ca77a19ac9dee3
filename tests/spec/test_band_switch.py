"""Speculation bands with an EAGLE-3 head (real SmolLM2-135M, fp32, CPU): a step above
``disable_by_batch_size`` is plain and does no proposer work, yet once the batch shrinks
back into the bands the head catches up on those steps' aux states (from the runner's aux
cache) exactly as if it had observed each one."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.ops.attention_metadata import AttentionMetadata

# Six requests end at different lengths: the batch stays above the cutoff (2) until the
# four short ones finish, then the last two speculate on top of a prompt and 16 output
# tokens that only plain steps computed.
PROMPTS = [0, 1, 2, 3, 4, 5]  # chats of 37-232 tokens
LENGTHS = [4, 8, 12, 16, 32, 32]
BLOCK = 16


def make_llm(smollm2_dir, **kwargs) -> LLM:
    return LLM(
        str(smollm2_dir),
        device="cpu",
        dtype="float32",
        kv_cache_memory=256 << 20,
        max_model_len=2048,
        enable_prefix_caching=False,  # every head position is then the request's own
        **kwargs,
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(smollm2_dir, chats) -> list[list[int]]:
    llm = make_llm(smollm2_dir)
    outs = llm.generate([chats[i] for i in PROMPTS], [greedy(n) for n in LENGTHS], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def head_from_scratch(engine, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """The head run once over a whole sequence whose last token (``tokens[n]``) is the
    root: the target's aux states of tokens ``0 .. n-1``, then the head over positions
    ``0 .. n-1``. Returns the depth-1 draft and the head's K/V there [2, n, kv heads, dim]
    (first layer)."""
    target, head = engine.runner.model, engine.proposer.head
    c, hc = target.config, head.config
    n = len(tokens) - 1
    num_blocks = -(-n // BLOCK) + 1  # block 0 is the null block
    blocks = torch.arange(1, num_blocks, dtype=torch.int32)
    pos = torch.arange(n)
    meta = AttentionMetadata(
        slot_mapping=blocks[pos // BLOCK].long() * BLOCK + pos % BLOCK,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=blocks[None, :],
        max_query_len=n,
        max_seq_len=n,
    )

    def cache(heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_blocks, BLOCK, heads, dim)
        return torch.zeros(shape), torch.zeros(shape)

    kv = [cache(c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]
    _, aux = target(torch.tensor(tokens[:n]), pos, kv, meta, hc.aux_layer_ids)
    head_kv = [cache(hc.num_kv_heads, hc.head_dim) for _ in range(hc.num_layers)]
    _, logits = head(torch.tensor(tokens[1 : n + 1]), head.fuse(aux), pos, head_kv, meta)
    draft = int(head.draft_to_target(logits[-1].argmax()))
    k, v = (t.flatten(0, 1)[BLOCK : BLOCK + n] for t in head_kv[0])
    return draft, torch.stack([k, v])


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_plain_steps_above_the_bands_defer_the_head_exactly(
    smollm2_dir, random_head_dir, chats, plain, async_scheduling
):
    """Above the cutoff the proposer gets one ``defer`` per request (when the batch
    first runs plain) and nothing per step: no ``observe``, no aux rows held. Each
    request's first draft after the batch shrank into the band equals the head run from
    scratch over its whole sequence, and so does the head's K/V at every position the
    plain steps computed (read back from the aux cache); outputs equal plain decoding."""
    spec = SpeculativeConfig(
        method="eagle3", model=str(random_head_dir), num_speculative_tokens=2,
        disable_by_batch_size=2,
    )  # fmt: skip
    llm = make_llm(smollm2_dir, speculative=spec, async_scheduling=async_scheduling)
    engine, proposer = llm.engine, llm.engine.proposer
    events: list[str] = []
    for name in ("observe", "defer"):
        method = getattr(proposer, name)
        setattr(proposer, name, lambda *a, _name=name, _m=method: events.append(_name) or _m(*a))
    first: dict[str, tuple[list[int], int, torch.Tensor]] = {}  # first draft after plain
    propose = proposer.propose

    def recording(requests, limits, shape):
        if not first:
            # Nothing was handed over while the batch ran plain: no rows are pending.
            assert events == ["defer"] * len(PROMPTS)
            states = proposer.rows._states.values()
            assert all(not s.pending and s.deferred is not None for s in states)
            events.append(f"propose after {engine.num_steps} steps")
        trees = propose(requests, limits, shape)
        for request, tree in zip(requests, trees, strict=True):
            if tree is None or request.request_id in first:
                continue
            n = request.num_computed_tokens
            index = torch.arange(n)
            slots = torch.tensor(request.block_ids)[index // BLOCK] * BLOCK + index % BLOCK
            kv = torch.stack([t.flatten(0, 1)[slots] for t in proposer.kv_cache[0]])
            first[request.request_id] = (list(request.all_token_ids), tree.token_ids[1], kv)
        return trees

    proposer.propose = recording
    prompts = [chats[i] for i in PROMPTS]
    outs = llm.generate(prompts, [greedy(n) for n in LENGTHS], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert events[len(PROMPTS)].startswith("propose after")
    assert int(events[len(PROMPTS)].split()[-2]) >= max(LENGTHS[:-2])  # each one plain
    assert "observe" in events  # the speculative steps observe as before
    assert len(first) == 2 and engine.spec_stats.steps > 0
    for tokens, draft, kv in first.values():
        assert len(tokens) > max(LENGTHS[:-2]) + min(len(p) for p in prompts)
        expected_draft, expected_kv = head_from_scratch(engine, tokens)
        assert draft == expected_draft
        torch.testing.assert_close(kv, expected_kv, rtol=2e-5, atol=2e-5)
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
