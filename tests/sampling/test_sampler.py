"""Sampler invariants: greedy is argmax, seeds reproduce whatever the batch, samples follow
the filtered target distribution, and logprobs are log_softmax of the raw logits."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.sampling.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    probs_from_logits,
)
from specdec.sampling.seeded_stream import (
    SeededStream,
    keys_tensor,
    row_exponentials,
    row_uniforms,
    uniforms,
)
from specdec.sampling_params import RequestOutputKind, SamplingParams

CPU = torch.device("cpu")


def _meta(params: list[SamplingParams], streams=None) -> SamplingMetadata:
    if streams is None:
        streams = [SeededStream(p.seed) if p.seed is not None else None for p in params]
    return SamplingMetadata.build(params, streams, CPU)


def _kept(masked: torch.Tensor) -> set[int]:  # masked: [1, V]
    return set(torch.isfinite(masked[0]).nonzero().flatten().tolist())


# ---------------------------------------------------------------- SamplingParams


def test_params_normalise_stop_and_top_k() -> None:
    p = SamplingParams(stop="###", top_k=-1, stop_token_ids=(5, 7))
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.stop_token_ids == [5, 7]
    assert SamplingParams().stop == []
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.3).is_greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, r"temperature=-0.5 is invalid; use temperature >= 0"),
        ({"temperature": float("nan")}, r"temperature=nan"),
        ({"top_p": 0.0}, r"top_p=0.0 is invalid"),
        ({"top_p": 1.5}, r"top_p=1.5 is invalid"),
        ({"top_k": -2}, r"top_k=-2 is invalid; use top_k >= 1, or 0 / -1"),
        ({"min_p": 1.2}, r"min_p=1.2 is invalid"),
        ({"max_tokens": 0}, r"max_tokens=0 is invalid"),
        ({"min_tokens": 5, "max_tokens": 3}, r"min_tokens=5 exceeds max_tokens=3"),
        ({"logprobs": 21}, r"logprobs=21 is invalid; use 0..20"),
        ({"stop": ["ok", ""]}, r"stop contains ''"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids contains -1"),
        (
            {"stop": ["x"], "output_kind": RequestOutputKind.TOKENS},
            r"stop=\['x'\] needs text, which output_kind=TOKENS does not make",
        ),
    ],
)
def test_params_reject_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_reject_non_int_counts() -> None:
    with pytest.raises(TypeError, match=r"max_tokens=2.5"):
        SamplingParams(max_tokens=2.5)
    with pytest.raises(TypeError, match=r"top_k=True"):
        SamplingParams(top_k=True)


def test_build_requires_a_stream_for_seeded_rows() -> None:
    params = [SamplingParams(), SamplingParams(seed=3)]
    with pytest.raises(ValueError, match=r"row 1 has seed=3 but no stream"):
        SamplingMetadata.build(params, [None, None], CPU)
    with pytest.raises(ValueError, match=r"got 1 streams for 2 rows"):
        SamplingMetadata.build(params, [None], CPU)


# ---------------------------------------------------------------- filters


def test_top_k_keeps_k_highest_ties_to_lower_id() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    assert _kept(apply_top_k_top_p(logits, torch.tensor([2]), None)) == {1, 2}
    assert _kept(apply_top_k_top_p(logits, torch.tensor([1]), None)) == {1}
    assert _kept(apply_top_k_top_p(logits, torch.tensor([0]), None)) == {0, 1, 2, 3, 4}
    assert _kept(apply_top_k_top_p(logits, torch.tensor([99]), None)) == {0, 1, 2, 3, 4}


def test_top_k_without_a_sort_keeps_the_sorts_set() -> None:
    """The sort-free top-k (a host bound on k) keeps exactly the stable sort's set: ties
    at the boundary to the lower ids, -inf logits, disabled rows, k past the vocabulary."""
    torch.manual_seed(0)
    logits = torch.randint(-4, 4, (64, 50)).float()  # many ties at every rank
    logits[::7, ::3] = float("-inf")
    top_k = torch.randint(-2, 60, (64,))  # <= 0 disabled, > 50 past the vocabulary
    top_k[:4] = torch.tensor([1, 50, 49, 0])
    sorted_set = apply_top_k_top_p(logits, top_k, None)
    for bound in (int(top_k.max()), 1000):  # exact and loose bounds
        assert torch.equal(apply_top_k_top_p(logits, top_k, None, bound), sorted_set)
    assert torch.equal(apply_top_k_top_p(logits[:1], torch.tensor([2]), None, 2),
                       apply_top_k_top_p(logits[:1], torch.tensor([2]), None))  # fmt: skip
    tie = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    assert _kept(apply_top_k_top_p(tie, torch.tensor([2]), None, 2)) == {1, 2}


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # Sorted: id1 0.5, id3 0.3, id0 0.1, id2 0.05, id4 0.05 (cumulative .5 .8 .9 .95 1).
    logits = torch.tensor([[0.1, 0.5, 0.05, 0.3, 0.05]]).log()
    cases = {0.3: {1}, 0.75: {1, 3}, 0.85: {1, 3, 0}, 0.93: {1, 3, 0, 2}, 1.0: {0, 1, 2, 3, 4}}
    for top_p, expected in cases.items():
        masked = apply_top_k_top_p(logits, None, torch.tensor([top_p]))
        assert _kept(masked) == expected, top_p
        # Kept logits are untouched, so renormalising gives the conditional distribution.
        assert torch.equal(masked[torch.isfinite(masked)], logits[torch.isfinite(masked)])


def test_top_p_applies_after_top_k_per_row() -> None:
    logits = torch.tensor([[0.1, 0.5, 0.05, 0.3, 0.05]] * 2).log()
    # Row 0: top-2 renormalised is {1: .625, 3: .375}; top_p=0.6 then keeps only id 1.
    # Row 1: no top-k; top_p=0.6 needs ids 1 and 3.
    masked = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([0.6, 0.6]))
    assert _kept(masked[0:1]) == {1}
    assert _kept(masked[1:2]) == {1, 3}


def test_min_p_keeps_tokens_above_fraction_of_max() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert _kept(apply_min_p(logits, torch.tensor([0.25]))) == {0, 1, 2}
    assert _kept(apply_min_p(logits, torch.tensor([0.0]))) == {0, 1, 2, 3}


def test_probs_from_logits_rows_are_distributions_and_greedy_is_one_hot() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.7, min_p=0.05),
        SamplingParams(),
    ]
    probs = probs_from_logits(logits, _meta(params))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 30).float())
    assert (probs[1] > 0).sum() == 5
    torch.testing.assert_close(probs[3], logits[3].softmax(-1))


# ---------------------------------------------------------------- sampling


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 31] = logits[2].max() + 1.0  # tie: id 7 must win
    out = Sampler()(logits, _meta([SamplingParams(temperature=0.0)] * 6))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[2] == 7
    assert out.logprobs is None


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 40)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(8)]
    ids = Sampler()(logits, _meta(params)).token_ids
    assert torch.equal(ids[1::2], logits[1::2].argmax(-1))
    assert ids.dtype == torch.int64 and ids.shape == (8,)


def test_top_k_1_equals_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 100)
    out = Sampler()(logits, _meta([SamplingParams(temperature=1.7, top_k=1)] * 64))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def _run_steps(
    sampler: Sampler,
    rows: list[tuple[SamplingParams, SeededStream | None]],
    logits_per_step: list[torch.Tensor],
) -> torch.Tensor:  # [steps, B]
    meta = SamplingMetadata.build([p for p, _ in rows], [g for _, g in rows], CPU)
    return torch.stack([sampler(lg, meta).token_ids for lg in logits_per_step])


def test_seeded_row_is_reproducible_and_batch_independent() -> None:
    vocab, steps = 200, 6
    torch.manual_seed(3)
    row_logits = [torch.randn(vocab) for _ in range(steps)]
    seeded = SamplingParams(temperature=1.0, seed=1234)

    torch.manual_seed(100)
    alone = _run_steps(Sampler(), [(seeded, SeededStream(1234))], [lg[None] for lg in row_logits])[
        :, 0
    ]

    # Same request at row 2 among greedy, unseeded, filtered and differently seeded rows;
    # the default RNG is reseeded so borrowing it instead of the generator would show.
    torch.manual_seed(999)
    others = torch.randn(steps, 3, vocab)
    batch_logits = [
        torch.cat([others[s, :2], row_logits[s][None], others[s, 2:]]) for s in range(steps)
    ]
    rows = [
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=0.7, top_k=5, top_p=0.8), None),
        (seeded, SeededStream(1234)),
        (SamplingParams(temperature=1.2, seed=7, min_p=0.1), SeededStream(7)),
    ]
    in_batch = _run_steps(Sampler(), rows, batch_logits)[:, 2]
    assert torch.equal(alone, in_batch)

    other_seed = _run_steps(
        Sampler(), [(seeded, SeededStream(4321))], [lg[None] for lg in row_logits]
    )[:, 0]
    assert not torch.equal(alone, other_seed)


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum()
    support = expected_probs > 0
    if (counts[~support] > 0).any():
        return math.inf
    exp = expected_probs[support] * n
    return float(((counts[support] - exp) ** 2 / exp).sum())


def _reference_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Straight-line restatement of the filter order, one token at a time."""
    p = (logits / temperature).softmax(-1)
    order = sorted(range(len(p)), key=lambda i: -float(p[i]))
    kept = order[:top_k] if top_k else order
    total = sum(float(p[i]) for i in kept)
    chosen, mass = [], 0.0
    for i in kept:
        chosen.append(i)
        mass += float(p[i]) / total
        if mass >= top_p:
            break
    out = torch.zeros_like(p)
    for i in chosen:
        out[i] = p[i]
    return out / out.sum()


# chi-square critical value for 5 degrees of freedom at p = 1e-4 (this test uses at most 5).
_CHI2_CRIT = 25.7


def test_samples_follow_filtered_distribution() -> None:
    n = 20_000
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0])
    temperature, top_k, top_p = 0.6, 5, 0.975
    expected = _reference_probs(logits, temperature, top_k, top_p)
    # Top-k keeps 5; renormalised top-p then needs only 4 (it would need 5 if it ran first).
    assert (expected > 0).sum() == 4

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    ids = sampler(logits.repeat(n, 1), _meta([params] * n)).token_ids
    counts = torch.bincount(ids, minlength=len(logits)).float()
    assert _chi_square(counts, expected) < _CHI2_CRIT

    # The same counts must reject every nearby wrong distribution, or the check is toothless.
    wrong = {
        "no temperature": _reference_probs(logits, 1.0, top_k, top_p),
        "no top-p": _reference_probs(logits, temperature, top_k, 1.0),
        "top-p before top-k": _reference_probs(logits, temperature, 0, top_p),
        "plain softmax": logits.softmax(-1),
    }
    for name, probs in wrong.items():
        assert _chi_square(counts, probs) > 10 * _CHI2_CRIT, name


def test_seeded_rows_follow_distribution() -> None:
    # One row per seed: the per-row generator path must sample the same distribution.
    n = 4_000
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(n)]
    ids = Sampler()(logits.repeat(n, 1), _meta(params)).token_ids
    counts = torch.bincount(ids, minlength=4).float()
    assert _chi_square(counts, (logits / 0.8).softmax(-1)) < _CHI2_CRIT
    assert _chi_square(counts, logits.softmax(-1)) > _CHI2_CRIT


def test_one_seeded_stream_follows_distribution_step_after_step() -> None:
    # One request sampled step after step: successive draws of one stream are independent.
    n = 3_000
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    meta = _meta([SamplingParams(temperature=0.8, seed=11)])
    sampler = Sampler()
    ids = torch.cat([sampler(logits, meta).token_ids for _ in range(n)])
    counts = torch.bincount(ids, minlength=4).float()
    assert _chi_square(counts, (logits[0] / 0.8).softmax(-1)) < _CHI2_CRIT
    assert _chi_square(counts, logits[0].softmax(-1)) > _CHI2_CRIT


# ---------------------------------------------------------------- seeded streams


def test_stream_keys_depend_on_seed_and_draw_number_only() -> None:
    a, b = SeededStream(5), SeededStream(5)
    keys = [a.next_key() for _ in range(4)]
    assert keys == [b.next_key() for _ in range(4)]
    assert len(set(keys)) == 4 and all(0 <= k < 2**62 for k in keys)
    assert SeededStream(6).next_key() != keys[0]
    assert (a.seed, a.draws) == (5, 4)


def _lowbias32(x: int) -> int:  # the mixer in plain Python integers (the specification)
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_stream_uniforms_equal_the_integer_specification() -> None:
    """The tensor hash is exact integer arithmetic (no int64 overflow), so every device
    gives the same bits: here against the mixer in Python integers."""
    keys = keys_tensor([SeededStream(s) for s in (0, 1, 2**40 + 3)], CPU)
    index = torch.tensor([0, 1, 7, 49151, 2**32 - 1])
    got = uniforms(keys[:, None], index[None, :])
    for r, key in enumerate(keys.tolist()):
        for c, i in enumerate(index.tolist()):
            x = _lowbias32(_lowbias32(i ^ (key & 0xFFFFFFFF)) ^ (key >> 32))
            assert got[r, c].item() == ((x >> 9) + 0.5) / 2**23


def test_stream_uniforms_are_uniform_distinct_and_in_the_open_interval() -> None:
    keys = keys_tensor([SeededStream(s) for s in range(8)], CPU)  # [8]
    u = row_uniforms(keys, 1 << 16)  # [8, 65536]
    assert u.dtype == torch.float32 and u.min() > 0.0 and u.max() < 1.0
    # A draw's elements never collide (the hash is a bijection of indices; 23 bits kept).
    assert all(torch.unique(row).numel() > 65536 * 0.99 for row in u)
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    expected = u.numel() / 16
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 37.7  # 15 degrees of freedom, p = 1e-3
    # Neighbouring rows (seeds) and columns (indices) are uncorrelated.
    assert abs(torch.corrcoef(u[:2])[0, 1]) < 0.02
    assert abs(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1]) < 0.02
    e = row_exponentials(keys, 1 << 16)
    assert torch.isfinite(e).all() and (e > 0).all()
    assert abs(e.mean() - 1.0) < 0.01 and abs(e.var() - 1.0) < 0.03


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 25)
    params = [
        SamplingParams(temperature=0.5, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=2.0, top_k=4),
    ]
    out = Sampler()(logits, _meta(params))
    assert out.logprobs is not None
    ref = logits.log_softmax(-1)
    top_lp, top_ids = ref.topk(3, dim=-1)
    assert torch.equal(out.logprobs.top_token_ids, top_ids)
    torch.testing.assert_close(out.logprobs.top_logprobs, top_lp)
    torch.testing.assert_close(
        out.logprobs.sampled_logprobs, ref.gather(-1, out.token_ids[:, None]).squeeze(-1)
    )


def test_rejects_non_float32_logits() -> None:
    with pytest.raises(TypeError, match=r"dtype torch.bfloat16"):
        Sampler()(torch.zeros(1, 4, dtype=torch.bfloat16), _meta([SamplingParams()]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_uniforms_are_the_same_bits_on_the_gpu() -> None:
    """A seeded request samples the same tokens on CPU and GPU from equal probabilities."""
    keys = keys_tensor([SeededStream(s) for s in range(16)], CPU)
    cpu = row_exponentials(keys, 49152)
    gpu = row_exponentials(keys.cuda(), 49152).cpu()
    assert torch.equal(row_uniforms(keys, 49152), row_uniforms(keys.cuda(), 49152).cpu())
    torch.testing.assert_close(gpu, cpu, rtol=1e-6, atol=0)  # log may differ in the last ulp


def test_batch_keys_equal_the_streams_own_keys_draw_by_draw() -> None:
    """``keys_tensor`` hashes the batch in numpy; it must give each stream exactly its
    ``next_key`` sequence, a stream listed twice (acceptance's two draws) included, for
    seeds across the whole int64 range and beyond."""
    seeds = [0, 1, 5, 2**40 + 3, 2**63 - 1, -7, 2**64 + 9]
    batch = [SeededStream(s) for s in seeds]
    alone = [SeededStream(s) for s in seeds]
    for step in range(3):
        rows = [s for s in batch for _ in range(1 + step % 2)]
        expected = [s.next_key() for s in alone for _ in range(1 + step % 2)]
        assert keys_tensor(rows, CPU).tolist() == expected
    assert [s.draws for s in batch] == [s.draws for s in alone] == [4] * len(seeds)
