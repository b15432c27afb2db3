"""The Triton AWQ/GPTQ kernel against a float64 reference of the dequantized weights, on CPU tensors under
TRITON_INTERPRET=1 (small shapes: the interpreter is slow). bfloat16 is left to the device: the interpreter
mishandles it."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the interpreter tests are for machines without CUDA", allow_module_level=True)
# Read when triton.jit decorates a kernel, so it must be set before the kernel is imported.
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed: `pip install triton` runs these tests on CPU")

from pagellm.ops import wna16  # noqa: E402
from pagellm.ops.triton_quant import group_quant_matmul  # noqa: E402
from tests.quant_checkpoints import random_group_quant_weight  # noqa: E402

TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("variant", ["plain", "act_order", "uneven"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_dequantized_weights(bits, variant, dtype):
    weight = random_group_quant_weight(bits, 64, 72, variant, seed=bits)
    w = wna16.dequantize(weight).double()
    bias = torch.randn(72)
    for rows in (1, 5, 17):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(dtype)
        y = group_quant_matmul(x, weight, bias.to(dtype))
        assert y.dtype == dtype and y.shape == (rows, 72)
        expected = x.double() @ w.t() + bias.to(dtype).double()
        magnitude = x.double().abs() @ w.abs().t() + bias.abs().double()
        error = ((y.double() - expected).abs() / magnitude).max().item()
        assert torch.isfinite(y).all() and error < TOLERANCE[dtype], f"{rows} rows: relative error {error:.2e}"


def test_a_layer_on_cuda_would_take_it():
    """choose_kernel picks the Triton kernel for CUDA weights (here asked for by device type alone)."""
    weight = random_group_quant_weight(4, 64, 16, "plain", seed=1)
    kernel = wna16.choose_kernel([(0, weight)], torch.device("cuda"))
    assert isinstance(kernel, wna16.TritonGroupQuant)
    x = torch.randn(3, 64)
    expected = x.double() @ wna16.dequantize(weight).double().t()
    assert torch.allclose(kernel(x, None).double(), expected, rtol=1e-5, atol=1e-5)
