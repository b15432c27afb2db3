"""Gemma's RMSNorm on the fused CPU kernel (given 1 + weight) against its torch ops, on every ISA this CPU runs."""

from __future__ import annotations

import pytest
import torch

from pagellm.attention import native
from pagellm.layers.layernorm import GemmaRMSNorm


@pytest.mark.parametrize("isa", native.runnable_isas())
def test_fused_gemma_norm_matches_the_torch_ops(isa):
    ops = native.cpu_ops(isa)
    if ops is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(0)
    norm = GemmaRMSNorm(200, 1e-6)  # a width with a tail past the 8-float vectors
    norm.weight.data = torch.randn(200, generator=gen) * 0.5
    x, residual = torch.randn(3, 200, generator=gen), torch.randn(3, 200, generator=gen)
    expected = norm(x)
    expected_sum_normed, expected_sum = norm(x, residual.clone())
    norm.use_cpu_ops(ops)
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)
    stream = residual.clone()
    normed, summed = norm(x, stream)
    assert summed is stream  # the sum is written into the residual stream in place, as RMSNorm's kernel does
    torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(normed, expected_sum_normed, rtol=1e-5, atol=1e-6)
    # bfloat16 activations keep the torch ops (the kernel would round 1 + weight to bfloat16 first)
    x16 = x.to(torch.bfloat16)
    assert torch.equal(norm(x16), norm._norm(x16))
    norm.use_cpu_ops(None)
    assert norm.ops is None and torch.equal(norm(x), expected)
