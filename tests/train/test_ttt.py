"""The training-time test: its attention rule, its attention implementations, and its
alignment with what the engine runs at inference."""

from __future__ import annotations

import pytest
import torch
from test_eagle3_head import random_head, target_config

from specdec.attention import get_attention_backend
from specdec.models.eagle3_head import Eagle3Head
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.train.ttt import PackedBatch, StepIndex, draft_rows, mix_argmax, ttt_forward, unroll
from specdec.train.ttt_attention import (
    TTTAttention,
    TTTCache,
    TTTFlexAttention,
    TTTMeta,
    _causal_by_sequence,
    ttt_visible,
)

LENGTHS = [7, 1, 12, 5]


def packed_ids(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id of every packed index, cu_seqlens)."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return seq, cu


def brute_force_visible(lengths: list[int], step: int) -> torch.Tensor:
    """Built step by step as a request drafts at inference: a query at sequence position t,
    draft step i, sees the catch-up entries at positions 0..t of its own sequence and the
    chain drafted from the same root at steps 1..i. Keys are (step j, packed index)."""
    n = sum(lengths)
    keys = [(j, m) for j in range(step + 1) for m in range(n)]
    seq, cu = packed_ids(lengths)
    mask = torch.zeros(n, len(keys), dtype=torch.bool)
    for q in range(n):
        s, t = int(seq[q]), q - int(cu[seq[q]])
        catch_up = {(0, int(cu[s]) + u) for u in range(t + 1)}
        chain = {(j, q) for j in range(1, step + 1)}
        for c, key in enumerate(keys):
            mask[q, c] = key in catch_up | chain
    return mask


def dense_visible(lengths: list[int], step: int) -> torch.Tensor:
    seq, _ = packed_ids(lengths)
    n = seq.shape[0]
    k_step = torch.arange(step + 1).repeat_interleave(n)
    k_idx = torch.arange(n).repeat(step + 1)
    q_idx = torch.arange(n)
    return ttt_visible(seq[:, None], q_idx[:, None], k_step[None], seq[k_idx][None], k_idx[None])


@pytest.mark.parametrize("step", [0, 1, 3, 6])
def test_ttt_mask_equals_brute_force(step):
    assert torch.equal(dense_visible(LENGTHS, step), brute_force_visible(LENGTHS, step))


def naive_ttt_attention(q, keys, values, mask, scale):
    """Softmax over the concatenated keys of every step, masked."""
    group = q.shape[1] // keys[0].shape[1]
    k = torch.cat(keys).repeat_interleave(group, dim=1)  # [(i+1) n, h, d]
    v = torch.cat(values).repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q, k) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(s, dim=-1), v)


def run_backend(backend, qs, ks, vs, seq, scale):
    cache = TTTCache()
    return [
        backend.forward(q, k, v, cache, cache, TTTMeta(seq, i, len(qs)), scale)
        for i, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True))
    ]


def random_steps(n, steps, heads=6, kv_heads=2, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(h):
        return [torch.randn(n, h, dim, generator=gen, requires_grad=True) for _ in range(steps)]

    return r(heads), r(kv_heads), r(kv_heads)


def test_ttt_attention_equals_masked_softmax_values_and_gradients():
    seq, _ = packed_ids(LENGTHS)
    qs, ks, vs = random_steps(seq.shape[0], 4)
    scale = 0.25
    outs = run_backend(TTTAttention(), qs, ks, vs, seq, scale)
    refs = [
        naive_ttt_attention(q, ks[: i + 1], vs[: i + 1], dense_visible(LENGTHS, i), scale)
        for i, q in enumerate(qs)
    ]
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    weights = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(
        sum((o * w).sum() for o, w in zip(outs, weights, strict=True)), qs + ks + vs
    )
    ref_grads = torch.autograd.grad(
        sum((r * w).sum() for r, w in zip(refs, weights, strict=True)), qs + ks + vs
    )
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tile", [3, 4, 64])
def test_step0_tiles_equal_attention_per_sequence(tile):
    """The reference's step-0 attention in query tiles with key windows (any tile size,
    windows spanning several tiles) equals causal attention run sequence by sequence,
    values, log-sum-exps and gradients."""
    seq, cu = packed_ids(LENGTHS)
    n, gen = seq.shape[0], torch.Generator().manual_seed(2)
    q = torch.randn(n, 6, 16, generator=gen, requires_grad=True)
    k = torch.randn(n, 2, 16, generator=gen, requires_grad=True)
    v = torch.randn(n, 2, 16, generator=gen, requires_grad=True)
    out, lse = _causal_by_sequence(q, k, v, seq, 0.25, tile=tile)
    refs, ref_lses = [], []
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        kk = k[lo:hi].repeat_interleave(3, dim=1)
        vv = v[lo:hi].repeat_interleave(3, dim=1)
        s = torch.einsum("thd,shd->hts", q[lo:hi], kk) * 0.25
        s = s.masked_fill(torch.ones(hi - lo, hi - lo, dtype=torch.bool).triu(1), float("-inf"))
        refs.append(torch.einsum("hts,shd->thd", torch.softmax(s, -1), vv))
        ref_lses.append(torch.logsumexp(s, -1).T)
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.cat(ref_lses), atol=1e-5, rtol=1e-5)
    w = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * w).sum() + lse.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(
        (torch.cat(refs) * w).sum() + torch.cat(ref_lses).sum(), (q, k, v)
    )
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)


def test_flex_attention_path_equals_reference():
    """The GPU path's block mask and concatenated keys, run by eager FlexAttention."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    seq, _ = packed_ids(LENGTHS)
    qs, ks, vs = ([t.detach() for t in x] for x in random_steps(seq.shape[0], 3, seed=1))
    ref = run_backend(TTTAttention(), qs, ks, vs, seq, 0.25)
    out = run_backend(TTTFlexAttention(compile=False), qs, ks, vs, seq, 0.25)
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)


def test_unwritten_key_slots_are_never_seen():
    """The flex path's buffer holds a slot for every step; slots of steps not yet
    written carry sequence -1 and stay invisible to every query."""
    seq, _ = packed_ids(LENGTHS)
    n = seq.shape[0]
    k_idx = torch.arange(n).repeat(3)
    k_step = torch.arange(3).repeat_interleave(n)
    key_seq = torch.cat([seq, seq, torch.full((n,), -1)])  # step 2 not written yet
    q = torch.arange(n)[:, None]
    mask = ttt_visible(seq[:, None], q, k_step[None], key_seq[None], k_idx[None])
    assert not mask[:, 2 * n :].any()
    assert torch.equal(mask[:, : 2 * n], dense_visible(LENGTHS, 1))


def test_flex_path_compiles_once_for_all_steps_and_padded_batches():
    """Compiled, the flex path keeps one shape through the unroll and across batches
    padded to one size: torch.compile builds its kernel once (each new shape recompiles,
    and past the recompile limit it falls back to the unfused path that ran out of memory
    on the H200). Forward only: FlexAttention has no CPU backward."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    n, steps = 128, 4
    flex = TTTFlexAttention(compile=True)
    graphs = []
    for b, lengths in enumerate([[40, 30, 58], [100, 28]]):  # two packings, padded to n
        seq, _ = packed_ids(lengths)
        qs, ks, vs = ([t.detach() for t in x] for x in random_steps(n, steps, seed=b))
        ref = run_backend(TTTAttention(), qs, ks, vs, seq, 0.25)
        out = run_backend(flex, qs, ks, vs, seq, 0.25)
        for o, r in zip(out, ref, strict=True):
            torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs[0] == graphs[1] and graphs[0] <= 2  # flex_attention and the block mask


def objective_case(seed: int, lengths: list[int], mask_every: int):
    """(a random head with the reference TTT attention, a target lm_head, a packed batch
    whose every ``mask_every``-th token is outside the loss mask)."""
    target = target_config()
    paged, embed = random_head(target, seed=seed)
    head = Eagle3Head(paged.config, TTTAttention(), embed=embed)
    head.load_state_dict(paged.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    n = sum(lengths)
    lm_head = torch.randn(target.vocab_size, target.hidden_size, generator=gen)
    batch = PackedBatch(
        input_ids=torch.randint(target.vocab_size, (n,), generator=gen),
        loss_mask=torch.arange(n) % mask_every != 0,
        aux_hidden=torch.randn(n, 3 * target.hidden_size, generator=gen),
        target_hidden=torch.randn(n, target.hidden_size, generator=gen),
        cu_seqlens=packed_ids(lengths)[1],
    )
    return head, lm_head, batch


def test_padding_leaves_the_objective_unchanged():
    """``PackedBatch.padded`` appends a loss-free pseudo-sequence: loss, per-step counts
    and accuracy equal the unpadded batch's."""
    head, lm_head, batch = objective_case(7, [8, 12], mask_every=4)
    n = batch.num_tokens
    batch.exit_targets = torch.rand(n, 2)
    padded = batch.padded(32)
    assert padded.num_tokens == 32 and padded.cu_seqlens.tolist() == [0, 8, 20, 32]
    assert torch.isnan(padded.exit_targets[n:]).all() and not padded.loss_mask[n:].any()
    a = ttt_forward(head, batch, lm_head, steps=3)
    b = ttt_forward(head, padded, lm_head, steps=3)
    torch.testing.assert_close(b.loss, a.loss, atol=1e-6, rtol=1e-6)
    assert torch.equal(a.step_valid, b.step_valid) and torch.equal(a.step_correct, b.step_correct)
    assert batch.padded(n) is batch
    with pytest.raises(ValueError, match="cannot be padded to 10"):
        batch.padded(10)


def test_padding_past_the_rope_table_on_the_flex_path():
    """The trainer pads every flex batch to ``data.max_tokens``, which may exceed the
    head's RoPE table (SmolLM2: 8192 positions, max_tokens 16384): the padding
    pseudo-sequence's positions (and t + i past a sequence's end) are clamped into the
    table (on GPU an index past it is a device-side assert; on CPU an IndexError), and
    the objective equals the unpadded batch's."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    head, lm_head, batch = objective_case(3, [8, 12], mask_every=4)
    table = head.rotary.num_positions
    flex = Eagle3Head(head.config, TTTFlexAttention(compile=False), embed=head.__dict__["_embed"])
    flex.load_state_dict(head.state_dict())
    padded = batch.padded(batch.num_tokens + table + 8)  # padding runs past the table
    with torch.no_grad():  # FlexAttention has no CPU backward
        a = ttt_forward(head, batch, lm_head, steps=3)
        b = ttt_forward(flex, padded, lm_head, steps=3)
    torch.testing.assert_close(b.loss, a.loss, atol=1e-5, rtol=1e-5)
    assert torch.equal(a.step_valid, b.step_valid) and torch.equal(a.step_correct, b.step_correct)
    # A sequence as long as the table: t + i passes it on the last steps (invalid rows).
    head, lm_head, batch = objective_case(4, [table], mask_every=3)
    ttt_forward(head, batch, lm_head, steps=3)


def paged_chain_logits(head: Eagle3Head, ids, aux, t: int, steps: int) -> list[torch.Tensor]:
    """The engine's own computation for one root: catch-up over positions 0..t (tokens
    x[1..t+1], fc(aux[0..t])) on a fresh paged cache, then a chain of teacher-forced
    draft steps at positions t+1, t+2, ... Returns the logits of each step."""
    block = 16
    cfg = head.config
    cache_shape = (8, block, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(cache_shape), torch.zeros(cache_shape)) for _ in range(cfg.num_layers)]
    table = torch.arange(1, 8, dtype=torch.int32)[None]

    def meta(start: int, q: int) -> AttentionMetadata:
        pos = torch.arange(start, start + q)
        return AttentionMetadata(
            slot_mapping=table[0, pos // block].long() * block + pos % block,
            query_start_loc=torch.tensor([0, q], dtype=torch.int32),
            seq_lens=torch.tensor([start + q], dtype=torch.int32),
            block_tables=table,
            max_query_len=q,
            max_seq_len=start + q,
        )

    catch_up = (ids[1 : t + 2], head.fuse(aux[: t + 1]), torch.arange(t + 1))
    out, logits = head(*catch_up, kv, meta(0, t + 1))
    result = [logits[-1]]
    hidden = out[-1:]
    for i in range(1, steps):
        if t + 1 + i >= ids.shape[0]:
            break
        pos = torch.tensor([t + i])
        hidden, logits = head(ids[t + 1 + i : t + 2 + i], hidden, pos, kv, meta(t + i, 1))
        result.append(logits[-1])
    return result


@pytest.mark.parametrize("num_layers", [1, 2])
def test_unrolled_steps_equal_the_engines_draft_steps(num_layers: int):
    """TTT step i at sequence position t computes exactly the logits the engine's head
    computes for a depth-(i+1) draft from root x[t+1] whose earlier drafts were right:
    training optimises the computation that serving runs (a deeper head too: each of its
    layers attends over its own keys in both)."""
    target = target_config()
    paged, embed = random_head(target, seed=3, num_layers=num_layers)
    trained = Eagle3Head(paged.config, TTTAttention(), embed=embed)
    trained.load_state_dict(paged.state_dict())
    gen = torch.Generator().manual_seed(4)
    lengths = [9, 13]
    n = sum(lengths)
    batch = PackedBatch(
        input_ids=torch.randint(target.vocab_size, (n,), generator=gen),
        loss_mask=torch.ones(n, dtype=torch.bool),
        aux_hidden=torch.randn(n, 3 * target.hidden_size, generator=gen),
        target_hidden=torch.randn(n, target.hidden_size, generator=gen),
        cu_seqlens=torch.tensor([0, 9, 22]),
    )
    steps = 4
    with torch.no_grad():
        unrolled = [s.logits for s in unroll(trained, batch, steps)]
        index = StepIndex.of(batch.cu_seqlens, n)
        for s, (lo, hi) in enumerate([(0, 9), (9, 22)]):
            ids, aux = batch.input_ids[lo:hi], batch.aux_hidden[lo:hi]
            for t in range(hi - lo - 1):  # x[t+1] must exist
                expected = paged_chain_logits(paged, ids, aux, t, steps)
                for i, logits in enumerate(expected):
                    assert int(index.local[lo + t]) == t and int(index.seq_ids[lo + t]) == s
                    torch.testing.assert_close(unrolled[i][lo + t], logits, atol=1e-5, rtol=1e-5)


def test_objective_masks_and_accuracy():
    """Loss and acc_i count only positions whose label exists, is an assistant token and
    whose target argmax is a kept id; a head trained towards the labels gains accuracy."""
    head, lm_head, batch = objective_case(5, [10, 14], mask_every=3)
    n = batch.num_tokens
    out = ttt_forward(head, batch, lm_head, steps=3)
    top = (batch.target_hidden @ lm_head.T).argmax(-1)
    usable = batch.loss_mask & head.t2d[top]
    index = StepIndex.of(batch.cu_seqlens, n)
    for i in range(3):
        src, inside = index.source(i)
        assert int(out.step_valid[i]) == int((inside & usable[src]).sum())
    assert torch.isfinite(out.loss) and out.loss > 0
    optim = torch.optim.Adam(head.parameters(), lr=3e-3)
    first = float(out.loss.detach())
    for _ in range(60):
        optim.zero_grad()
        loss = ttt_forward(head, batch, lm_head, steps=3).loss
        loss.backward()
        optim.step()
    final = ttt_forward(head, batch, lm_head, steps=3)
    assert float(final.loss.detach()) < 0.5 * first
    assert final.step_acc[0] > 0.9 and final.simulated_tau > out.simulated_tau


def test_mix_argmax_keeps_rows_distributions_with_their_argmax():
    gen = torch.Generator().manual_seed(3)
    labels = torch.softmax(torch.randn(6, 11, generator=gen), dim=-1)
    top = labels.argmax(-1)
    half = mix_argmax(labels.clone(), top, 0.5)
    torch.testing.assert_close(half.sum(-1), torch.ones(6))
    assert torch.equal(half.argmax(-1), top)
    torch.testing.assert_close(half, 0.5 * labels + 0.5 * torch.eye(11)[top])
    assert torch.equal(mix_argmax(labels.clone(), top, 0.0), labels)
    assert torch.equal(mix_argmax(labels.clone(), top, 1.0), torch.eye(11)[top])


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_argmax_weight_mixes_distillation_and_hard_cross_entropy(weight):
    """Each step's loss is (1 - w) x the soft cross-entropy + w x the cross-entropy of the
    target's argmax, over the same valid positions; counts and accuracy do not change."""
    head, lm_head, batch = objective_case(9, [11, 9], mask_every=4)
    steps, decay = 3, 0.8
    with torch.no_grad():
        out = ttt_forward(head, batch, lm_head, steps=steps, decay=decay, argmax_weight=weight)
        soft = ttt_forward(head, batch, lm_head, steps=steps, decay=decay)
        labels = torch.softmax(batch.target_hidden @ draft_rows(head, lm_head).T, dim=-1)
        top = labels.argmax(-1)
        usable = batch.loss_mask & head.t2d[(batch.target_hidden @ lm_head.T).argmax(-1)]
        expected = torch.zeros(())
        for i, step in enumerate(unroll(head, batch, steps)):
            valid = step.inside & usable[step.source]
            log_q = torch.log_softmax(step.logits, dim=-1)
            hard = -log_q.gather(1, top[step.source][:, None])[:, 0]
            mean_hard = (hard * valid).sum() / valid.sum()
            assert float(soft.step_losses[i]) > 0
            mixed = (1 - weight) * soft.step_losses[i] + weight * mean_hard
            torch.testing.assert_close(out.step_losses[i], mixed, rtol=1e-5, atol=1e-5)
            expected = expected + decay**i * mixed
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.step_correct, soft.step_correct)
    assert torch.equal(out.step_valid, soft.step_valid)


def test_widened_mlp_computes_what_the_trained_head_did_and_trains():
    """``widen_mlp``: a head widened from I to 3I units gives the same logits at every TTT
    step; its new units are silent (zero down columns) but not frozen: one backward gives
    those columns a gradient."""
    from dataclasses import replace

    from specdec.train.model import widen_mlp

    head, lm_head, batch = objective_case(11, [9, 13], mask_every=5)
    narrow = head.config.intermediate_size
    wide = Eagle3Head(replace(head.config, intermediate_size=3 * narrow), TTTAttention(),
                      embed=head.__dict__["_embed"])  # fmt: skip
    state = head.state_dict()
    assert widen_mlp(state, wide) == narrow
    wide.load_state_dict(state)
    with torch.no_grad():
        for a, b in zip(unroll(head, batch, 3), unroll(wide, batch, 3), strict=True):
            torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    ttt_forward(wide, batch, lm_head, steps=3).loss.backward()
    down = wide.midlayer.mlp.down_proj.weight
    assert torch.equal(down[:, narrow:], torch.zeros_like(down[:, narrow:]))
    assert down.grad[:, narrow:].abs().sum() > 0
    with pytest.raises(ValueError, match=r"intermediate_size=.* is narrower"):
        widen_mlp(wide.state_dict(), head)


def test_deepened_head_computes_what_the_trained_head_did_and_trains():
    """``deepen``: a 1-layer head given two more layers gives the same logits at every TTT
    step; the new layers are silent (zero o_proj and down_proj) but not frozen: one
    backward gives both zero matrices a gradient. Cutting layers is refused."""
    from dataclasses import replace

    from specdec.train.model import deepen

    head, lm_head, batch = objective_case(12, [9, 13], mask_every=5)
    deep = Eagle3Head(replace(head.config, num_layers=3), TTTAttention(),
                      embed=head.__dict__["_embed"])  # fmt: skip
    state = head.state_dict()
    deepen(state, deep, 1)
    deep.load_state_dict(state)
    with torch.no_grad():
        for a, b in zip(unroll(head, batch, 3), unroll(deep, batch, 3), strict=True):
            torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    ttt_forward(deep, batch, lm_head, steps=3).loss.backward()
    for layer in deep.layers.values():
        for silent in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
            assert torch.equal(silent, torch.zeros_like(silent))
            assert silent.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"num_layers=1 is fewer than .* 3 layers"):
        deepen(deep.state_dict(), head, 3)


def test_step_index_bounds():
    index = StepIndex.of(torch.tensor([0, 3, 4, 6]), 6)
    src, inside = index.source(1)
    assert index.local.tolist() == [0, 1, 2, 0, 0, 1]
    assert inside.tolist() == [True, False, False, False, False, False]
    assert src[0] == 2


def test_paged_backend_is_the_serving_one():
    """The engine's head uses the registered backend; TTT backends are not registered."""
    assert get_attention_backend("torch").name == "torch"
    assert not hasattr(TTTAttention, "name")


def test_auto_attention_is_compiled_flex_on_cuda_and_the_reference_elsewhere():
    from specdec.train.model import attention_backend
    from specdec.train.ttt_attention import TTTFlexAttention

    cuda = attention_backend("auto", torch.device("cuda"))
    assert isinstance(cuda, TTTFlexAttention) and cuda.compile and cuda.static_tokens
    cpu = attention_backend("auto", torch.device("cpu"))
    assert type(cpu) is TTTAttention
    flex_cpu = attention_backend("flex", torch.device("cpu"))  # eager flex: no compile
    assert isinstance(flex_cpu, TTTFlexAttention) and not flex_cpu.compile
    assert type(attention_backend("reference", torch.device("cuda"))) is TTTAttention
