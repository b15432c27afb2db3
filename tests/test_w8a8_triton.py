"""The Triton 8-bit weight kernels (pagellm/ops/w8a8_triton.py) on CPU tensors under TRITON_INTERPRET=1, against
the torch reference: int8 W8A8 bit for bit (the same int8 activations, the same int32 sums, the same float32
epilogue), fp8 weights within float32 rounding of the float64 product with the dequantized weight. fp32 and
fp16 activations (the interpreter mishandles bf16)."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the interpreter tests are for machines without CUDA", allow_module_level=True)
# Read when triton.jit decorates a kernel, so it must be set before the kernels are imported.
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed: `pip install triton` runs these tests on CPU")

from pagellm.ops import w8a8_kernels as wk  # noqa: E402
from pagellm.ops import w8a8_triton as wt  # noqa: E402

SHAPES = [(1, 64, 16), (5, 67, 21), (33, 130, 70)]  # (M, K, N): tails of every tile


def _inputs(m: int, k: int, n: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator) * 2
    w = torch.randn(n, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    return x, w, bias


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("static", [None, 0.02])
def test_int8_equals_the_reference(m, k, n, dtype, static):
    x, w, bias = _inputs(m, k, n, m + k)
    q, scale = wk.quantize_rows_int8(w)
    x = x.to(dtype)
    if m > 2:
        x[1, 3] = float("nan")
    for b in (bias.to(dtype), None):
        y = wt.int8_linear(x, q, scale, static, b)
        expected = wk.int8_linear_reference(x, q, scale, static, b)
        assert y.dtype == dtype and torch.equal(y.isnan(), expected.isnan())
        assert torch.equal(y.nan_to_num(), expected.nan_to_num())
    xq, xs = wt.quantize_rows(x, static)
    xq_ref, xs_ref = wk.quantize_rows_int8(x, static)
    assert torch.equal(xq, xq_ref) and torch.equal(xs.nan_to_num(-1.0), xs_ref.nan_to_num(-1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotated_int8_equals_the_reference(dtype):
    """quantization="int8"'s rotated weights on CUDA: the rows rotated in torch (hadamard_rows), then the same
    kernels; bit for bit the reference's."""
    x, w, bias = _inputs(5, 192, 40, 7)
    q, scale, rotation = wk.quantize_int8_rotated(w)
    assert rotation == 64
    x = x.to(dtype)
    y = wt.int8_linear(x, q, scale, None, bias.to(dtype), rotation)
    assert y.dtype == dtype
    assert torch.equal(y, wk.int8_linear_reference(x, q, scale, None, bias.to(dtype), rotation))


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_matches_float64(m, k, n, dtype):
    x, w, bias = _inputs(m, k, n, m * k)
    w8 = (w * 40).to(torch.float8_e4m3fn)
    for block_k in (k, 32, 16):
        scales = torch.rand(n, -(-k // block_k), generator=torch.Generator().manual_seed(block_k)) * 0.02 + 1e-3
        y = wt.fp8_linear(x.to(dtype), w8, scales, block_k, bias.to(dtype))
        assert y.dtype == dtype
        x64, w64 = x.to(dtype).double(), wk.dequantize_fp8(w8, scales, block_k).double()
        reference = x64 @ w64.T + bias.to(dtype).double()
        # fp16 activations: the product is rounded once to fp16 at the end (and its partial sums are fp32).
        tolerance = 2e-6 * (x64.abs() @ w64.abs().T) + (2 ** -10 * reference.abs() if dtype == torch.float16 else 0)
        assert ((y.double() - reference).abs() <= tolerance + 1e-30).all(), block_k


def test_fp8_refuses_blocks_it_cannot_tile():
    w8 = torch.zeros(16, 40, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 16"):
        wt.fp8_linear(torch.randn(2, 40), w8, torch.ones(16, 2), 20, None)
