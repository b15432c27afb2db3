"""Triton fused mixture-of-experts (the layout of vLLM's fused_moe): a step's (token, expert) pairs are sorted by
expert and padded to whole blocks of BLOCK_M rows per expert, so that each program multiplies one block of rows,
all routed to the same expert, by one tile of that expert's weight, gathering the rows' inputs as it loads them.

Two launches of the same kernel make an expert MLP: gate_up over the gathered hidden states, then (after the
gated SiLU) down, whose rows are scaled by their routing weights; each token's k rows are then summed.

float32 multiplies in IEEE float32 (Triton's default on a GPU would be tf32); half types in their own type with
float32 accumulation. Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1, where tests/models/test_moe.py
checks it against the grouped torch path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16  # tl.dot needs at least 16 rows
BLOCK_N = 64
BLOCK_K = 32


@dataclass(frozen=True)
class ExpertBlocks:
    """The (token, expert) pairs sorted by expert, each expert's run padded to a multiple of the block size.
    `sorted_pairs[i]` is a pair index (token * k + slot) or, in padding, the pair count; `block_experts[b]` is
    the expert of block b; blocks from `num_padded` / block_size on are empty. Sized for the worst case, so
    building it never waits for the device."""

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    block_size: int

    @property
    def max_blocks(self) -> int:
        return self.block_experts.numel()


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_size: int = BLOCK_M) -> ExpertBlocks:
    """vLLM's moe_align_block_size in torch ops."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    # scatter_add_ rather than bincount, which reads the largest id back to the host (no capture in a graph).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat.index_select(0, order)
    starts = counts.cumsum(0) - counts
    rank_in_expert = torch.arange(pairs, device=device) - starts.index_select(0, sorted_experts)
    destination = (padded_ends - padded).index_select(0, sorted_experts) + rank_in_expert
    capacity = pairs + num_experts * (block_size - 1)
    max_blocks = triton.cdiv(capacity, block_size)
    sorted_pairs = torch.full((max_blocks * block_size,), pairs, dtype=torch.int64, device=device)
    sorted_pairs.index_copy_(0, destination, order)
    block_starts = torch.arange(max_blocks, device=device) * block_size
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(sorted_pairs, block_experts, padded_ends[-1:].clone(), block_size)


@triton.jit
def expert_matmul_kernel(
    a_ptr, w_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
    N, K, num_pairs, stride_am, stride_we, stride_wn, stride_cm,
    ROWS_PER_A: tl.constexpr, MUL_WEIGHTS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[pair] = A[pair // ROWS_PER_A] @ W[expert of pair]^T (* the pair's routing weight), for the BLOCK_M
    pairs of block program_id(0) and the BLOCK_N output features of program_id(1)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    columns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    column_ok = columns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        inputs = k0 + tl.arange(0, BLOCK_K)
        input_ok = inputs < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + inputs[None, :],
                    mask=pair_ok[:, None] & input_ok[None, :], other=0.0)
        # The weight tile transposed: [BLOCK_K inputs, BLOCK_N outputs] of W[expert] [N, K].
        w = tl.load(w_ptr + expert * stride_we + columns[None, :].to(tl.int64) * stride_wn + inputs[:, None],
                    mask=input_ok[:, None] & column_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs[:, None].to(tl.int64) * stride_cm + columns[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & column_ok[None, :])


def expert_matmul(a: torch.Tensor, w: torch.Tensor, blocks: ExpertBlocks, num_pairs: int, rows_per_a: int,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """[num_pairs, N]: row p is a[p // rows_per_a] @ w[expert of p]^T, times weights[p] if given."""
    if a.stride(1) != 1:
        a = a.contiguous()
    if w.stride(2) != 1:
        w = w.contiguous()
    n, k = w.shape[1], w.shape[2]
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return c
    grid = (blocks.max_blocks, triton.cdiv(n, BLOCK_N))
    expert_matmul_kernel[grid](
        a, w, c, weights if weights is not None else a, blocks.sorted_pairs, blocks.block_experts, blocks.num_padded,
        n, k, num_pairs, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        ROWS_PER_A=rows_per_a, MUL_WEIGHTS=weights is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=blocks.block_size, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return c


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  act_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ x[t]), e = topk_ids[t, j]: [T, H] in x's dtype.

    gpt-oss's experts: `w13_bias` [E, 2I] and `w2_bias` [E, H] added after their products (down's weighted with
    its row), and `act_fn` ([pairs, 2I] -> [pairs, I]) in place of SiLU-and-mul; torch ops on the pair rows, no
    host sync, so a CUDA graph can hold them."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"the Triton MoE kernel takes float32, float16 or bfloat16 activations, not {x.dtype}")
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    blocks = align_to_blocks(topk_ids, w13.shape[0])
    gate_up = expert_matmul(x, w13, blocks, num_pairs, top_k)
    pair_ids = topk_ids.reshape(-1)
    if w13_bias is not None:
        gate_up += w13_bias.index_select(0, pair_ids).to(gate_up.dtype)
    if act_fn is None:
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
    else:
        hidden = act_fn(gate_up)
    pair_weights = topk_weights.reshape(-1).float().contiguous()
    out = expert_matmul(hidden, w2, blocks, num_pairs, 1, pair_weights)
    if w2_bias is not None:
        out += (w2_bias.index_select(0, pair_ids).float() * pair_weights[:, None]).to(out.dtype)
    return out.view(tokens, top_k, -1).sum(dim=1)
