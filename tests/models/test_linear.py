"""The projections' CPU inference path equals ``F.linear``; training keeps ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.models.linear import (
    CPU_WEIGHT_MAJOR_MAX_ROWS,
    Linear,
    takes_weight_major,
    weight_major_linear,
)

# SmolLM2's shapes (qkv, down, lm_head) and a biased projection (Qwen2's qkv).
SHAPES = [(576, 960, False), (1536, 576, False), (576, 49152, False), (64, 96, True)]
ROWS = [1, 2, 3, 7, 11, 12, 16, 24, CPU_WEIGHT_MAJOR_MAX_ROWS, CPU_WEIGHT_MAJOR_MAX_ROWS + 1]


@pytest.mark.parametrize(("in_features", "out_features", "bias"), SHAPES)
def test_cpu_inference_equals_f_linear_at_every_row_count(in_features, out_features, bias):
    gen = torch.Generator().manual_seed(in_features + out_features)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * in_features**-0.5)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    x = torch.randn(ROWS[-1], in_features, generator=gen)
    for rows in ROWS:
        with torch.inference_mode():
            got = layer(x[:rows])
        expected = F.linear(x[:rows], layer.weight, layer.bias)
        assert got.shape == (rows, out_features) and got.is_contiguous()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_weight_major_form_only_for_cpu_float32_inference_of_few_rows():
    layer = Linear(32, 48)
    x = torch.randn(5, 32)
    with torch.inference_mode():
        assert takes_weight_major(x, layer.weight)
        assert torch.equal(layer(x), weight_major_linear(x, layer.weight, layer.bias))
        assert not takes_weight_major(torch.randn(CPU_WEIGHT_MAJOR_MAX_ROWS + 1, 32), layer.weight)
        assert not takes_weight_major(x[None], layer.weight)  # 3-d: F.linear
        assert not takes_weight_major(x.bfloat16(), layer.weight.bfloat16())
    # Training: autograd through F.linear, bit for bit.
    assert not takes_weight_major(x, layer.weight)
    out = layer(x)
    assert out.requires_grad and torch.equal(out, F.linear(x, layer.weight, layer.bias))
