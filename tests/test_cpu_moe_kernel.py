"""The native MoE experts kernel (moe_experts.c) against the grouped torch path it replaces, per instruction set
this CPU runs: float32 and bfloat16, row tails, idle experts, one expert per row (expert parallelism's input)
and expert ids it must refuse; and, where the build has avx512_bf16's dot product, bfloat16 experts in
linear_bf16's layout, equal to the bit to one linear_bf16 call per expert product (the AMX prefill path)."""

from __future__ import annotations

import pytest
import torch

from pagellm.layers.activation import SiluAndMul
from pagellm.layers.fused_moe import grouped_experts, linear_bf16_experts
from pagellm.ops import cpu_build
from pagellm.ops.cpu_moe import CpuMoEKernel
from pagellm.ops.linear_bf16 import LinearBF16
from tests.helpers import built_or_skip

ISAS = cpu_build.runnable_isas()


def _kernel(isa: str) -> CpuMoEKernel:
    library = built_or_skip(cpu_build.native_library(isa), "cpu_build.native_library(isa)")
    return CpuMoEKernel(library)


def _experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=generator) * 0.2
    return w13.to(dtype), w2.to(dtype)


def _routed(tokens: int, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    scores = torch.randn(tokens, num_experts, generator=generator).softmax(-1)
    weights, ids = torch.topk(scores, top_k)
    return x, weights / weights.sum(-1, keepdim=True), ids


def _torch_grouped(x, weights, ids, w13, w2):
    return grouped_experts(x, weights, ids, w13.shape[0],
                           lambda e, rows, out: torch.mm(rows, w13[e].t(), out=out),
                           lambda e, rows, out: torch.mm(rows, w2[e].t(), out=out), w13.shape[1], SiluAndMul())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "hidden", "inter"), [
    (1, 8, 2, 64, 32),      # decode: one row per expert
    (5, 16, 4, 36, 10),     # tails: hidden and inter not multiples of any vector width
    (40, 6, 3, 68, 38),     # prefill: many rows per expert, tiles of 6 rows with remainders, padded panels
    (300, 4, 2, 64, 48),    # long prefill: whole tiles, whole panels
    (3, 64, 2, 32, 16),     # most experts idle
    (37, 5, 3, 48, 80),     # bf16 dot layout: an odd count of output panels, 8-row tiles with remainders
])
def test_kernel_matches_the_grouped_torch_path(isa, dtype, tokens, num_experts, top_k, hidden, inter):
    kernel = _kernel(isa)
    w13, w2 = _experts(num_experts, hidden, inter, dtype, seed=hidden)
    x, weights, ids = _routed(tokens, hidden, num_experts, top_k, dtype, seed=tokens)
    assert CpuMoEKernel.supports(w13, w2)
    packed = kernel.pack(w13, w2)
    assert (packed[1].dim() == 5) == kernel.takes_dot_layout(w13, w2)
    out = kernel(x, *packed, weights, ids)
    expected = _torch_grouped(x, weights, ids, w13, w2)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        # Both round every stored value to bfloat16 at the same points (a token's sum once, as index_add_ does);
        # only the dot products' summation order differs, which may move a rounding by one bfloat16 step.
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("isa", ISAS)
def test_one_expert_per_row_is_each_row_through_its_expert(isa):
    """Expert parallelism hands the kernel a rank's pairs as rows with one choice each."""
    kernel = _kernel(isa)
    w13, w2 = _experts(4, 32, 16, torch.float32, seed=3)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(6, 32, generator=generator)
    ids = torch.tensor([[2], [0], [2], [3], [0], [1]])
    weights = torch.rand(6, 1, generator=generator)
    out = kernel(x, *kernel.pack(w13, w2), weights, ids)
    for row in range(6):
        gate_up = w13[ids[row, 0]] @ x[row]
        activated = torch.nn.functional.silu(gate_up[:16]) * gate_up[16:]
        torch.testing.assert_close(out[row], weights[row, 0] * (w2[ids[row, 0]] @ activated), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_no_tokens_give_no_rows(isa):
    w13, w2 = _experts(4, 32, 16, torch.float32, seed=5)
    kernel = _kernel(isa)
    out = kernel(torch.empty(0, 32), *kernel.pack(w13, w2), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64))
    assert out.shape == (0, 32)


@pytest.mark.parametrize("bad_id", [-1, 4])
def test_an_expert_id_out_of_range_is_refused(bad_id):
    w13, w2 = _experts(4, 32, 16, torch.float32, seed=6)
    ids = torch.tensor([[0, bad_id]])
    with pytest.raises(ValueError, match=r"expert id is outside \[0, experts\)"):
        kernel = _kernel(cpu_build.best_isa())
        kernel(torch.randn(1, 32), *kernel.pack(w13, w2), torch.full((1, 2), 0.5), ids)


def test_stacks_the_kernel_cannot_take_are_not_claimed_nor_run_unpacked():
    assert not CpuMoEKernel.supports(*(w.half() for w in _experts(4, 32, 16, torch.float32, seed=7)))
    w13, w2 = _experts(4, 32, 16, torch.float32, seed=7)
    assert not CpuMoEKernel.supports(w13, w2[:, :, :8])  # w2's intermediate size is not w13's
    kernel = _kernel(cpu_build.best_isa())
    with pytest.raises(ValueError, match="not CpuMoEKernel.pack's"):
        kernel(torch.randn(1, 32), w13.view(4, 2, 2, 8, 32), w2.view(4, 2, 16, 16), torch.ones(1, 1),
               torch.zeros(1, 1, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_puts_each_panels_features_side_by_side_zero_padded(dtype):
    kernel = _kernel(cpu_build.best_isa())
    w13, w2 = _experts(3, 20, 18, dtype, seed=7)  # 18 features: a full panel of 16 and a padded one
    w13p, w2p = kernel.pack(w13, w2)
    assert w13p.shape == (3, 2, 2, 20, 16) and w2p.shape == (3, 2, 18, 16)
    for e, f, k in [(0, 0, 0), (1, 17, 19), (2, 5, 7)]:
        assert w13p[e, f // 16, 0, k, f % 16] == w13[e, f, k]  # gate
        assert w13p[e, f // 16, 1, k, f % 16] == w13[e, 18 + f, k]  # up
    assert (w13p[:, 1, :, :, 2:] == 0).all() and (w2p[:, 1, :, 4:] == 0).all()
    for e, h, k in [(0, 0, 0), (1, 19, 17), (2, 16, 3)]:
        assert w2p[e, h // 16, k, h % 16] == w2[e, h, k]


def _dot_kernel() -> CpuMoEKernel:
    if "avx512" not in ISAS:
        pytest.skip("this CPU has no AVX-512")
    kernel = _kernel("avx512")
    if not kernel.bf16_dot:
        pytest.skip("this CPU has no avx512_bf16 dot product")
    return kernel


@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "hidden", "inter"), [
    (1, 8, 2, 64, 32), (37, 5, 3, 48, 80), (300, 4, 2, 64, 48), (16, 32, 8, 128, 64)])
def test_bf16_dot_layout_is_linear_bf16_per_expert_to_the_bit(tokens, num_experts, top_k, hidden, inter):
    kernel = _dot_kernel()
    linear = LinearBF16(cpu_build.native_library("avx512"))
    w13, w2 = _experts(num_experts, hidden, inter, torch.bfloat16, seed=inter)
    x, weights, ids = _routed(tokens, hidden, num_experts, top_k, torch.bfloat16, seed=tokens)
    w13d, w2d = kernel.pack(w13, w2)
    out = kernel(x, w13d, w2d, weights, ids)
    torch.testing.assert_close(out, linear_bf16_experts(x, w13d, w2d, weights, ids, linear, SiluAndMul()),
                               rtol=0, atol=0)


def test_bf16_dot_packing_is_linear_bf16s_per_expert():
    kernel = _dot_kernel()
    w13, w2 = _experts(3, 32, 48, torch.bfloat16, seed=8)
    w13d, w2d = kernel.pack(w13, w2)
    assert w13d.shape == (3, 6, 16, 16, 2) and w2d.shape == (3, 2, 24, 16, 2)
    for e in range(3):
        assert torch.equal(w13d[e], LinearBF16.pack(w13[e]))
        assert torch.equal(w2d[e], LinearBF16.pack(w2[e]))


def test_bf16_sizes_off_the_dot_layout_keep_the_panels():
    """hidden or intermediate sizes that are not multiples of 16 fall back to the widening panels, still native."""
    kernel = _dot_kernel()
    for hidden, inter in [(36, 32), (32, 24)]:
        w13, w2 = _experts(2, hidden, inter, torch.bfloat16, seed=9)
        assert not kernel.takes_dot_layout(w13, w2)
        assert kernel.pack(w13, w2)[1].dim() == 4
