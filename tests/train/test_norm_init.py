"""Fresh norms of a head continued as EAGLE-3.1 start at the data's scale
(train/norm_init.py): a row of the median RMS passes them unchanged, so ``fc`` reads what
it read before; others are rescaled to that RMS."""

import torch

from specdec.train.model import TargetIO, build_head
from specdec.train.norm_init import calibrate_fresh_norms, median_rms
from specdec.train.ttt_attention import TTTAttention


def _heads(hidden: int = 32):
    from specdec.models import ModelConfig

    config = ModelConfig.from_hf(dict(
        architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=hidden,
        intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    ))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    target = TargetIO(
        config, torch.randn(64, hidden, generator=gen), torch.randn(64, hidden, generator=gen)
    )
    d2t, t2d = torch.zeros(64, dtype=torch.int64), torch.ones(64, dtype=torch.bool)
    torch.manual_seed(0)
    old = build_head(target, "t", d2t, t2d, (1, 2, 3), TTTAttention())
    new = build_head(target, "t", d2t, t2d, (1, 2, 3), TTTAttention(), variant="eagle3.1")
    new.load_state_dict(old.state_dict(), strict=False)  # every weight but the fresh norms
    return old, new


def test_a_row_of_the_median_rms_fuses_as_before_and_others_are_rescaled():
    old, new = _heads()
    gen = torch.Generator().manual_seed(1)
    # Three aux states of very different scales (as a target's layers have), rows whose
    # RMS spreads over 4x within each state.
    scales = torch.tensor([0.5, 8.0, 40.0]).repeat_interleave(32)
    rows = torch.randn(101, 96, generator=gen) * scales
    rows *= torch.linspace(0.5, 2.0, 101)[:, None]
    weights = calibrate_fresh_norms(new, ("fc_norm.",), rows)
    for i, chunk in enumerate(rows.chunk(3, dim=-1)):
        assert weights[f"fc_norm.{i}"] == median_rms(chunk)
        assert torch.all(new.fc_norm[i].weight == weights[f"fc_norm.{i}"])
    with torch.no_grad():
        # Each state's own median-RMS row, put together: every norm leaves it unchanged.
        typical = torch.cat([
            chunk[torch.argmin((torch.sqrt(chunk.square().mean(-1)) - median_rms(chunk)).abs())]
            for chunk in rows.chunk(3, dim=-1)
        ])[None]  # fmt: skip
        torch.testing.assert_close(new.fuse(typical), old.fuse(typical), rtol=2e-2, atol=1e-3)
        # Any row: each state comes out at the median RMS.
        normed = [norm(c) for norm, c in zip(new.fc_norm, rows.chunk(3, dim=-1), strict=True)]
        for i, n in enumerate(normed):
            rms = torch.sqrt(n.square().mean(-1))
            torch.testing.assert_close(rms, torch.full_like(rms, weights[f"fc_norm.{i}"]))


def test_only_fresh_norms_change():
    _, new = _heads()
    before = {k: v.clone() for k, v in new.state_dict().items()}
    rows = torch.randn(16, 96) * 10
    assert calibrate_fresh_norms(new, (), rows) == {}
    after = new.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
