"""benchmarks/quant_error.py: each scheme rounds as its format does, and a run leaves the model as it found it."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import quant_error
from pagellm.ops.w8a8_kernels import quantize_int8_rotated, quantize_rows_int8


def test_the_int8_schemes_grid_is_the_engines():
    torch.manual_seed(0)
    weight = torch.randn(48, 128)
    q, scale = quantize_rows_int8(weight)
    engine = q.float() * scale[:, None]
    ones = torch.ones(48, 1)
    scheme = quant_error.SCHEMES[0].weights(weight, ones)
    # The two divide differently (x / s against x * (127 / max|x|)): only values at a midpoint may round apart.
    apart = (scheme - engine).abs() > 1e-6
    assert apart.float().mean() < 1e-3
    grouped = quant_error.SCHEMES[1].weights(weight, ones)
    for block in range(2):
        part = weight[:, 64 * block : 64 * (block + 1)]
        q, scale = quantize_rows_int8(part)
        assert torch.allclose(grouped[:, 64 * block : 64 * (block + 1)], q.float() * scale[:, None], atol=1e-6)


def test_the_fp8_schemes_take_e4m3s_values_on_the_scale():
    weight = torch.tensor([[448.0, 1.0, -3.3, 0.0], [2.0, -1.1, 0.3, 0.07]])
    per_tensor = quant_error.SCHEMES[2].weights(weight, torch.ones(2, 1))
    assert per_tensor[0, 0] == 448.0 and per_tensor[0, 3] == 0.0
    per_channel = quant_error.SCHEMES[3].weights(weight, torch.ones(2, 1))
    assert per_channel[1, 0] == 2.0  # the row's largest magnitude maps to e4m3's largest value, exactly
    assert not torch.equal(per_tensor[1], per_channel[1])


@pytest.mark.parametrize("scheme", quant_error.SCHEMES, ids=lambda s: s.name)
def test_a_scheme_moves_perplexity_and_leaves_the_model_as_it_was(hf_tiny, scheme):
    ids = torch.randint(0, hf_tiny.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    layers = quant_error._linear_layers(hf_tiny)
    originals = [layer.weight.data.clone() for layer in layers]
    reference = quant_error.perplexity(hf_tiny, ids)
    plain = quant_error.run_scheme(hf_tiny, originals, scheme, ids, None)
    dithered = quant_error.run_scheme(hf_tiny, originals, scheme, ids, 0)
    assert math.isfinite(plain) and plain != reference and dithered != plain
    assert quant_error.perplexity(hf_tiny, ids) == reference
    assert all(torch.equal(layer.weight, original) for layer, original in zip(layers, originals))
    assert all(not layer._forward_pre_hooks for layer in layers)


def test_the_rotated_scheme_is_quantization_int8s():
    """The last scheme's weights are what quantize_int8_rotated keeps (dequantized, in the rotated space; the two
    rotate in different orders, so only values at a midpoint may round apart), and its inputs what the kernels'
    rows quantize to."""
    torch.manual_seed(1)
    weight = torch.randn(48, 192)
    q, scale, rotation = quantize_int8_rotated(weight)
    scheme = quant_error.SCHEMES[-1]
    apart = (scheme.weights(weight, torch.ones(48, 1)) - q.float() * scale[:, None]).abs() > 1e-6
    assert rotation == 64 and apart.float().mean() < 1e-3
    x = torch.randn(3, 192)
    xq, xs = quantize_rows_int8(x, None, 64)
    assert torch.equal(scheme.inputs(x), xq.float() * xs[:, None])
