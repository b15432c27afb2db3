"""Triton kernel for linear layers on AWQ/GPTQ weights (pagellm/ops/wna16.py's GroupQuantWeight): each program
computes a tile of y = x W^T, dequantizing its tile of W in registers as it goes (never in memory).

The weights are packed along the input features (GPTQ's order; AWQ checkpoints are repacked at load), so a tile
of BLOCK_K inputs x BLOCK_N outputs reads BLOCK_K / pack words per column. Each input row looks its group up in
g_idx and gathers that group's scale and offset per column: act-order (desc_act) checkpoints need no reordering.

float32 activations multiply in IEEE float32 (Triton's default on a GPU would be tf32); float16/bfloat16 ones in
their own type with float32 accumulation, as the dense layers do. Runs on CUDA, and on CPU tensors under
TRITON_INTERPRET=1, where tests/test_triton_quant.py checks it against the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.ops.wna16 import GroupQuantWeight, pack_factor

BLOCK_M = 16  # tl.dot needs at least 16 rows
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def group_quant_matmul_kernel(
    x_ptr, qweight_ptr, scales_ptr, offsets_ptr, g_idx_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_qk, stride_sg, stride_ym,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    column_ok = columns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        inputs = k0 + tl.arange(0, BLOCK_K)
        input_ok = inputs < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + inputs[None, :],
                    mask=row_ok[:, None] & input_ok[None, :], other=0.0)
        tile_ok = input_ok[:, None] & column_ok[None, :]
        words = tl.load(qweight_ptr + (inputs // PACK)[:, None].to(tl.int64) * stride_qk + columns[None, :],
                        mask=tile_ok, other=0)
        # An arithmetic shift sign-extends the top field; the mask takes the field alone.
        q = (words >> ((inputs % PACK) * BITS)[:, None]) & MASK
        groups = tl.load(g_idx_ptr + inputs, mask=input_ok, other=0).to(tl.int64)
        group_rows = groups[:, None] * stride_sg + columns[None, :]
        scale = tl.load(scales_ptr + group_rows, mask=tile_ok, other=0.0)
        offset = tl.load(offsets_ptr + group_rows, mask=tile_ok, other=0.0)
        w = q.to(tl.float32) * scale + offset
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + columns, mask=column_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + columns[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & column_ok[None, :])


def group_quant_matmul(x: torch.Tensor, weight: GroupQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in_features] @ W^T (+ bias) -> [rows, out_features] in x's dtype."""
    pack_factor(weight.bits)
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x is {tuple(x.shape)}; this weight takes [rows, {weight.in_features}]")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"the Triton kernel takes float32, float16 or bfloat16 activations, not {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, out_features = x.shape[0], weight.out_features
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    for name, tensor in (("scales", weight.scales), ("offsets", weight.offsets)):
        if tensor.stride(1) != 1 or tensor.stride() != weight.scales.stride():
            raise ValueError(f"{name} must be row-major and shaped like scales")
    if weight.qweight.stride(1) != 1:
        raise ValueError("qweight must be row-major")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({out_features},)")
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    group_quant_matmul_kernel[grid](
        x, weight.qweight, weight.scales, weight.offsets, weight.g_idx, bias if bias is not None else x, y,
        rows, out_features, weight.in_features, x.stride(0), weight.qweight.stride(0), weight.scales.stride(0),
        y.stride(0),
        BITS=weight.bits, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return y
