"""LoRA's segmented shrink and expand as Triton kernels (Punica's SGMV), the GPU path of the adapted layers
(tested on CPU tensors under TRITON_INTERPRET=1).

The step's adapted tokens, grouped by slot (punica.py), are cut into tiles of up to BLOCK_M rows of one slot.
`shrink_kernel`: one program per (tile, block of rank columns) computes h = x[rows] @ A[slot]^T over K with
tl.dot; `expand_kernel`: one program per (tile, block of output columns) adds h @ Bt[slot] into out[rows] (each
token's row is written by one program per column block: no atomics). A slot's padded columns are zero in A and
B, so every slot runs over the full capacity. One launch of each covers every segment of the step.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from pagellm.lora.punica import LoRAStepMapping

BLOCK_M = 16
BLOCK_K = 32
BLOCK_R = 16
BLOCK_N = 32


@triton.jit
def shrink_kernel(x_ptr, a_ptr, h_ptr, rows_ptr, tiles_ptr, K, CAP, stride_x, stride_a_slot, stride_a_row,
                  stride_h, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    tile = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_R
    slot = tl.load(tiles_ptr + 3 * tile).to(tl.int64)
    start = tl.load(tiles_ptr + 3 * tile + 1)
    end = tl.load(tiles_ptr + 3 * tile + 2)
    m = start + tl.arange(0, BLOCK_M)
    m_mask = m < end
    rows = tl.load(rows_ptr + m, mask=m_mask, other=0).to(tl.int64)
    r = r0 + tl.arange(0, BLOCK_R)
    r_mask = r < CAP
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_a_slot + r[None, :] * stride_a_row + k[:, None],
                    mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    tl.store(h_ptr + m[:, None] * stride_h + r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def expand_kernel(h_ptr, b_ptr, out_ptr, rows_ptr, tiles_ptr, N, CAP, stride_h, stride_b_slot, stride_b_row,
                  stride_out, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    slot = tl.load(tiles_ptr + 3 * tile).to(tl.int64)
    start = tl.load(tiles_ptr + 3 * tile + 1)
    end = tl.load(tiles_ptr + 3 * tile + 2)
    m = start + tl.arange(0, BLOCK_M)
    m_mask = m < end
    rows = tl.load(rows_ptr + m, mask=m_mask, other=0).to(tl.int64)
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, CAP, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < CAP
        h = tl.load(h_ptr + m[:, None] * stride_h + r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_b_slot + r[:, None] * stride_b_row + n[None, :],
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(h, b.to(tl.float32), input_precision="ieee")
    mask = m_mask[:, None] & n_mask[None, :]
    pointers = out_ptr + rows[:, None] * stride_out + n[None, :]
    current = tl.load(pointers, mask=mask, other=0.0)
    tl.store(pointers, (current.to(tl.float32) + acc).to(current.dtype), mask=mask)


def tiles_of(mapping: LoRAStepMapping, device: torch.device) -> torch.Tensor:
    """(slot, start, end) of each tile: the segments cut into runs of at most BLOCK_M rows."""
    tiles = [(slot, begin, min(begin + BLOCK_M, end))
             for slot, start, end in mapping.segments for begin in range(start, end, BLOCK_M)]
    return torch.from_numpy(np.array(tiles, dtype=np.int32).reshape(-1, 3)).to(device)


def add_lora_triton(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
                    mapping: LoRAStepMapping) -> torch.Tensor:
    """out[t] += (x[t] @ A[s]^T) @ Bt[s] for each adapted token t of slot s, in two launches."""
    if mapping.tiles is None:
        mapping.tiles = tiles_of(mapping, x.device)
        mapping.rows_tensor = torch.from_numpy(mapping.rows).to(x.device)
    x = x.contiguous()
    cap = a.shape[1]
    h = torch.empty(mapping.num_grouped, cap, dtype=torch.float32, device=x.device)
    num_tiles = mapping.tiles.shape[0]
    shrink_kernel[(num_tiles, triton.cdiv(cap, BLOCK_R))](
        x, a, h, mapping.rows_tensor, mapping.tiles, x.shape[1], cap, x.stride(0), a.stride(0), a.stride(1),
        h.stride(0), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=BLOCK_R)
    expand_kernel[(num_tiles, triton.cdiv(out.shape[1], BLOCK_N))](
        h, b_t, out, mapping.rows_tensor, mapping.tiles, out.shape[1], cap, h.stride(0), b_t.stride(0),
        b_t.stride(1), out.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N)
    return out
