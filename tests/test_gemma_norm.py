"""Gemma's RMSNorm on the fused CPU kernel (given 1 + weight) against its torch ops, on every ISA this CPU runs."""

from __future__ import annotations

import pytest
import torch

from pagellm.layers.layernorm import GemmaRMSNorm
from pagellm.ops import cpu_build
from pagellm.ops.cpu_ops import cpu_ops
from tests.helpers import built_or_skip


@pytest.mark.parametrize("isa", cpu_build.runnable_isas())
def test_fused_gemma_norm_matches_the_torch_ops(isa):
    ops = built_or_skip(cpu_ops(isa), "cpu_ops(isa)")
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
    norm.use_cpu_ops(None)
    assert norm.ops is None and torch.equal(norm(x), expected)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart each pair is (both finite, of one sign or zero)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("isa", cpu_build.runnable_isas())
def test_fused_gemma_norm_rounds_bfloat16_once_as_the_torch_ops_do(isa):
    """bfloat16 rows: the float32 product with the float32 1 + weight, rounded once (not the weight rounded to
    bfloat16 first, as Llama's kernel would): equal to the torch ops but for a rare last-place step where the
    kernel's sum of squares (in another order) moves the product across a rounding tie."""
    ops = built_or_skip(cpu_ops(isa), "cpu_ops(isa)")
    gen = torch.Generator().manual_seed(1)
    norm = GemmaRMSNorm(200, 1e-6)
    norm.weight.data = (torch.randn(200, generator=gen) * 0.5).to(torch.bfloat16)
    x = torch.randn(64, 200, generator=gen).to(torch.bfloat16)
    residual = torch.randn(64, 200, generator=gen).to(torch.bfloat16)
    expected = norm(x)
    expected_normed, expected_sum = norm(x, residual.clone())
    norm.use_cpu_ops(ops)
    assert norm.offset_weight.dtype is torch.float32
    got = norm(x)
    stream = residual.clone()
    normed, summed = norm(x, stream)
    assert got.dtype is torch.bfloat16 and summed is stream
    assert torch.equal(summed, expected_sum)  # the residual add rounds as torch's bfloat16 add
    for out, reference in ((got, expected), (normed, expected_normed)):
        apart = _ulps_apart(out, reference)
        assert int(apart.max()) <= 1 and (apart == 0).float().mean() >= 0.99
    # Rounding the weight to bfloat16 first (Llama's kernel) would be further off: the test can tell them apart.
    llama_style = ops.add_rms_norm(x, None, norm.offset_weight.to(torch.bfloat16), norm.eps)
    assert (_ulps_apart(llama_style, expected) > 0).float().mean() > 0.05
