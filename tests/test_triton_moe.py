"""The Triton fused-MoE kernel against the grouped torch path of FusedMoE, on CPU tensors in fp32 under
TRITON_INTERPRET=1 (small shapes: the interpreter is slow)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("the interpreter tests are for machines without CUDA", allow_module_level=True)
# Read when triton.jit decorates a kernel, so it must be set before the kernel is imported.
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed: `pip install triton` runs these tests on CPU")

from pagellm.layers.fused_moe import Routing, grouped_experts  # noqa: E402
from pagellm.ops.triton_moe import align_to_blocks, fused_experts  # noqa: E402


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_pairs_are_sorted_into_per_expert_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]])
    blocks = align_to_blocks(ids, num_experts=4, block_size=4)
    pairs = ids.numel()
    # Pairs in token-major order: expert 0 has pairs 1, 4, 7; expert 1 pair 3; expert 2 pairs 0, 2, 5, 6.
    assert int(blocks.num_padded) == 12
    assert blocks.sorted_pairs[:12].tolist() == [1, 4, 7, pairs, 3, pairs, pairs, pairs, 0, 2, 5, 6]
    assert blocks.block_experts[:3].tolist() == [0, 1, 2]
    assert (blocks.sorted_pairs[12:] == pairs).all()


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("routing", ["softmax", "deepseek_v3"])
def test_matches_the_grouped_torch_path(tokens, routing):
    num_experts, hidden, intermediate, top_k = 6, 40, 24, 2
    generator = torch.Generator().manual_seed(tokens)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.2
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.2
    x = torch.randn(tokens, hidden, generator=generator)
    logits = torch.randn(tokens, num_experts, generator=generator)
    if routing == "softmax":
        router = Routing.softmax_top_k(top_k, False)
    else:
        router = Routing(top_k, "sigmoid", True, 3, 2, "top2_sum", 2.5, sorted_choice=False)
    weights, ids = router.select(logits)
    ours = fused_experts(x, w13, w2, weights, ids)
    expected = grouped_experts(x, weights, ids, num_experts, lambda e, rows, out: out.copy_(F.linear(rows, w13[e])),
                               lambda e, rows, out: out.copy_(F.linear(rows, w2[e])), 2 * intermediate,
                               _silu_and_mul)
    assert ours.shape == x.shape and ours.dtype == x.dtype
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7])
def test_biases_and_clamped_swiglu_match_the_grouped_torch_path(tokens):
    """gpt-oss's experts: gate_up and down biases (down's weighted with its row) and ClampedSwiGLU."""
    from pagellm.layers.fused_moe import ClampedSwiGLU

    num_experts, hidden, intermediate, top_k = 5, 40, 24, 2
    generator = torch.Generator().manual_seed(tokens)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.3
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.3
    b13 = torch.randn(num_experts, 2 * intermediate, generator=generator)
    b2 = torch.randn(num_experts, hidden, generator=generator)
    x = torch.randn(tokens, hidden, generator=generator)
    weights, ids = Routing.softmax_top_k(top_k, True).select(torch.randn(tokens, num_experts, generator=generator))
    act = ClampedSwiGLU(1.702, 1.0)
    ours = fused_experts(x, w13, w2, weights, ids, b13, b2, act)
    expected = grouped_experts(x, weights, ids, num_experts,
                               lambda e, rows, out: out.copy_(F.linear(rows, w13[e], b13[e])),
                               lambda e, rows, out: out.copy_(F.linear(rows, w2[e], b2[e])), 2 * intermediate, act)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
