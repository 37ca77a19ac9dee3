"""The block drafter (specdec/models/block_drafter.py) and its training objective
(train/block_loss.py, train/block_attention.py) on tiny random configs: shapes, the
attention rule (context strictly before the anchor, the block bidirectional), the
engine-style split API equal to the training forward, FlexAttention equal to the dense
reference, anchors, slot weights, and the LK losses training it."""

from __future__ import annotations

import pytest
import torch

from specdec.models.block_drafter import (
    BlockDrafter,
    BlockDrafterConfig,
    ContextKV,
    resolve_mask_token_id,
)
from specdec.train.block_attention import flex_attention, reference_attention
from specdec.train.block_loss import (
    block_logits,
    block_objective,
    default_gamma,
    sample_anchors,
    slot_weights,
)
from specdec.train.ttt import PackedBatch, draft_rows

HIDDEN, VOCAB, BLOCK = 32, 96, 4


def tiny_config(**overrides) -> BlockDrafterConfig:
    fields = dict(
        hidden_size=HIDDEN, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
        vocab_size=VOCAB, draft_vocab_size=VOCAB, aux_layer_ids=(1, 2, 3), mask_token_id=5,
        block_size=BLOCK, num_layers=2,
    )  # fmt: skip
    fields.update(overrides)
    return BlockDrafterConfig(**fields)


def tiny_drafter(seed: int = 0, **overrides) -> tuple[BlockDrafter, torch.Tensor, torch.Tensor]:
    """A drafter with a random target embedding and lm_head bound (float64: exact checks)."""
    torch.manual_seed(seed)
    drafter = BlockDrafter(tiny_config(**overrides)).double()
    embed = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    lm_head = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    drafter.bind_target(lambda ids: embed[ids], lm_head)
    return drafter, embed, lm_head


def tiny_batch(lengths=(12, 9), seed: int = 1) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[:2] = False  # a prompt
    return PackedBatch(
        input_ids=torch.randint(6, VOCAB, (n,), generator=g),
        loss_mask=loss_mask,
        aux_hidden=torch.randn(n, 3 * HIDDEN, generator=g, dtype=torch.float64),
        target_hidden=torch.randn(n, HIDDEN, generator=g, dtype=torch.float64),
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
    )


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match=r"block_size=1; .* >= 2"):
        tiny_config(block_size=1)
    with pytest.raises(ValueError, match=r"mask_token_id=96 is outside"):
        tiny_config(mask_token_id=96)
    with pytest.raises(ValueError, match=r"aux_layer_ids=\(1, 1\)"):
        tiny_config(aux_layer_ids=(1, 1))
    with pytest.raises(ValueError, match=r"draft_vocab_size=97 exceeds"):
        tiny_config(draft_vocab_size=97)


def test_mask_token_resolves_from_the_tokenizer(smollm2_tokenizer):
    """SmolLM2 has no <|MASK|>; its <empty_output> (a code-pretraining marker) is next."""
    assert resolve_mask_token_id(smollm2_tokenizer) == 16
    assert resolve_mask_token_id(smollm2_tokenizer, 7) == 7


def test_training_forward_shapes_and_sees_only_context_before_the_anchor():
    drafter, *_ = tiny_drafter()
    batch = tiny_batch()
    anchors = sample_anchors(batch, 6, torch.Generator().manual_seed(0))
    logits = block_logits(drafter, batch, anchors, reference_attention)
    assert logits.shape == (6, BLOCK - 1, VOCAB)
    # Changing the aux states at and after one anchor (and in the other sequence) leaves
    # that block's logits alone; changing one before it does not.
    a = int(anchors.index[anchors.valid][0])
    seq_end = int(batch.cu_seqlens[1]) if a < int(batch.cu_seqlens[1]) else batch.num_tokens
    later = PackedBatch(**{**batch.__dict__, "aux_hidden": batch.aux_hidden.clone()})
    later.aux_hidden[a:seq_end] += 1.0
    changed = block_logits(drafter, later, anchors, reference_attention)
    first = int((anchors.index == a).nonzero()[0])
    torch.testing.assert_close(changed[first], logits[first], rtol=0, atol=1e-12)
    if a > 0:
        earlier = PackedBatch(**{**batch.__dict__, "aux_hidden": batch.aux_hidden.clone()})
        earlier.aux_hidden[a - 1] += 1.0
        moved = block_logits(drafter, earlier, anchors, reference_attention)
        assert (moved[first] - logits[first]).abs().max() > 1e-6


def test_the_block_attends_both_ways():
    """Slot 1's logits depend on the last slot's input (bidirectional), and the anchor's."""
    drafter, embed, _ = tiny_drafter()
    ctx = drafter.context_kv(torch.randn(5, 3 * HIDDEN, dtype=torch.float64), torch.arange(5))
    context = [ContextKV(kv.k[None], kv.v[None]) for kv in ctx]
    ids = drafter.block_inputs(torch.tensor([7]))
    positions = torch.arange(5, 5 + BLOCK)[None]
    base = drafter.block_logits(embed[ids], positions, context, torch.tensor([5]))
    last = embed[ids].clone()
    last[0, -1] += 1.0
    moved = drafter.block_logits(last, positions, context, torch.tensor([5]))
    assert (moved[0, 0] - base[0, 0]).abs().max() > 1e-6
    # context rows past context_lens are unseen
    fewer = drafter.block_logits(embed[ids], positions, context, torch.tensor([3]))
    context[0].k[0, 3:] += 5.0
    again = drafter.block_logits(embed[ids], positions, context, torch.tensor([3]))
    torch.testing.assert_close(again, fewer, rtol=0, atol=1e-12)
    assert (fewer - base).abs().max() > 1e-6


def test_engine_split_api_equals_the_training_forward():
    """context_kv per position, gathered per block (the positions before its anchor),
    then block_logits: the training forward's logits for the same anchors."""
    drafter, embed, _ = tiny_drafter()
    batch = tiny_batch()
    anchors = sample_anchors(batch, 8, torch.Generator().manual_seed(3))
    trained = block_logits(drafter, batch, anchors, reference_attention)
    starts = batch.cu_seqlens[:-1]
    for i in anchors.valid.nonzero().flatten().tolist():
        a, seq = int(anchors.index[i]), int(anchors.seq[i])
        start = int(starts[seq])
        # the engine computes each position's K/V once, from its own states only
        kv = drafter.context_kv(batch.aux_hidden[start:a], torch.arange(a - start))
        pad = 3  # padded rows past context_lens must not matter
        context = [
            ContextKV(torch.cat([x.k, torch.randn(pad, *x.k.shape[1:], dtype=x.k.dtype)])[None],
                      torch.cat([x.v, torch.randn(pad, *x.v.shape[1:], dtype=x.v.dtype)])[None])
            for x in kv
        ]  # fmt: skip
        ids = drafter.block_inputs(batch.input_ids[a : a + 1])
        positions = (a - start + torch.arange(BLOCK))[None]
        out = drafter.block_logits(embed[ids], positions, context, torch.tensor([a - start]))
        torch.testing.assert_close(out[0], trained[i], rtol=1e-9, atol=1e-9)


def test_flex_attention_equals_the_reference():
    drafter, *_ = tiny_drafter()
    drafter = drafter.float()
    batch = tiny_batch()
    batch.aux_hidden = batch.aux_hidden.float()
    anchors = sample_anchors(batch, 7, torch.Generator().manual_seed(5))
    with torch.no_grad():  # FlexAttention has no CPU backward; the GPU runs it compiled
        ref = block_logits(drafter, batch, anchors, reference_attention)
        flex = block_logits(drafter, batch, anchors, flex_attention(compile=False))
    torch.testing.assert_close(flex, ref, rtol=1e-4, atol=1e-4)


def test_anchors_are_eligible_distinct_and_padded():
    batch = tiny_batch(lengths=(6, 5))
    batch.loss_mask[7] = False  # in the second sequence: 6 is not eligible (7 is not masked)
    anchors = sample_anchors(batch, 20)  # more than there are eligible positions
    valid = anchors.index[anchors.valid].tolist()
    # eligible: loss_mask[a] and loss_mask[a+1] inside its sequence
    assert valid == [2, 3, 4, 8, 9]
    assert not anchors.valid[len(valid) :].any() and (anchors.seq[~anchors.valid] == -1).all()
    assert anchors.local[anchors.valid].tolist() == [2, 3, 4, 2, 3]
    few = sample_anchors(batch, 3, torch.Generator().manual_seed(0))
    assert few.valid.all() and len(set(few.index.tolist())) == 3
    assert set(few.index.tolist()) <= set(valid)


def test_slot_weights_decay_from_one():
    torch.testing.assert_close(slot_weights(4, 2.0), torch.exp(-torch.tensor([0.0, 0.5, 1.0])))
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0
    with pytest.raises(ValueError, match=r"block_size=12 .* set block.gamma"):
        default_gamma(12)


@pytest.mark.parametrize("loss", ["ce", "lk_alpha", "lk_hybrid"])
def test_objective_trains_a_pruned_drafter(loss):
    """Every draft loss applies per slot; a few Adam steps on one batch lower it, and
    the figures have one entry per slot."""
    kept = torch.arange(0, VOCAB, 2)  # a pruned draft vocabulary of 48 ids
    drafter, _, lm_head = tiny_drafter(draft_vocab_size=kept.shape[0])
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[kept] = True
    drafter.set_vocab_map(kept - torch.arange(kept.shape[0]), t2d)
    batch = tiny_batch()
    # labels the drafter can learn: the target's argmax is kept everywhere
    batch.target_hidden = lm_head[kept[torch.arange(batch.num_tokens) % kept.shape[0]]] * 3
    rows = draft_rows(drafter, lm_head)
    anchors = sample_anchors(batch, 10, torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)

    def run():
        return block_objective(drafter, batch, anchors, reference_attention, lm_head, rows,
                               gamma=2.0, loss=loss, argmax_weight=0.5)  # fmt: skip

    first = run()
    assert first.step_losses.shape == (BLOCK - 1,) and first.leading_correct.shape == (10,)
    assert int(first.step_valid[0]) == int(anchors.valid.sum())
    for _ in range(15):
        opt.zero_grad()
        out = run()
        out.loss.backward()
        opt.step()
    assert float(run().loss.detach()) < 0.7 * float(first.loss.detach())
