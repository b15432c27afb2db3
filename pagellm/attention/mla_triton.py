"""The latent decode of multi-head latent attention (attention/mla.py) in Triton: one program per (sequence,
tile of HEAD_TILE heads) streams the sequence's cached rows [rank latent | rope key] through its block table
once for the whole tile, with an online softmax:

    scores = q_tile [heads, width] @ rows^T [width, keys]       acc += p [heads, keys] @ rows[:, :rank]

Every head shares the rows (MLA is multi-query attention over the latent), which is what makes a tile of heads
one matrix product. float32 queries multiply in IEEE float32 (no TF32), as the model computes. Tested on CPU
under TRITON_INTERPRET=1 against a float64 reference of the expanded attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.attention.paged import DecodeMetadata

HEAD_TILE = 16  # tl.dot needs at least 16 rows
TILE_N = 16


@triton.jit
def mla_decode_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, scale, num_heads,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table, stride_cache_block,
    stride_cache_pos,
    WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
):
    """grid (num_seqs, cdiv(num_heads, HEADS)); out [num_seqs, num_heads, RANK]."""
    seq = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    head_mask = heads < num_heads
    dims = tl.arange(0, WIDTH_PAD)
    latent_dims = tl.arange(0, RANK_PAD)
    q = tl.load(q_ptr + seq * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
                mask=head_mask[:, None] & (dims[None, :] < WIDTH), other=0.0)
    seq_len = tl.load(seq_lens_ptr + seq)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    m = tl.full([HEADS], float("-inf"), tl.float32)
    l = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, RANK_PAD], tl.float32)
    for start in range(0, seq_len, TILE):
        positions = start + tl.arange(0, TILE)
        in_seq = positions < seq_len
        blocks = tl.load(table_row + positions // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        rows = blocks * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_pos
        keys = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=in_seq[:, None] & (dims[None, :] < WIDTH),
                       other=0.0).to(q.dtype)
        if IEEE:
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(keys))
        scores = tl.where(in_seq[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        values = tl.load(cache_ptr + rows[:, None] + latent_dims[None, :],
                         mask=in_seq[:, None] & (latent_dims[None, :] < RANK), other=0.0).to(q.dtype)
        if IEEE:
            pv = tl.dot(p.to(values.dtype), values, input_precision="ieee")
        else:
            pv = tl.dot(p.to(values.dtype), values)
        acc = acc * alpha[:, None] + pv
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_out_token + heads[:, None] * stride_out_head + latent_dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & (latent_dims[None, :] < RANK))


def triton_latent_decode(q: torch.Tensor, cache: torch.Tensor, decode: DecodeMetadata, scale: float, rank: int,
                         seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """q [num_decodes, heads, width]; cache [num_blocks, 1, block_size, width] -> [num_decodes, heads, rank] in
    q's dtype. Reads decode.block_tables_tensor and the context lengths: `seq_lens` on q's device where the
    backend put them there for the step, else decode.context_lens."""
    num_seqs, num_heads, width = q.shape
    if cache.dim() != 4 or cache.shape[1] != 1 or cache.shape[3] != width or cache.stride(3) != 1:
        raise TypeError(f"an MLA cache is [blocks, 1, block_size, {width}] with unit stride, not "
                        f"{tuple(cache.shape)}")
    q = q.contiguous()
    out = torch.empty(num_seqs, num_heads, rank, dtype=q.dtype, device=q.device)
    tables = decode.block_tables_tensor
    if seq_lens is None:
        seq_lens = torch.as_tensor(decode.context_lens, device=q.device)
    grid = (num_seqs, triton.cdiv(num_heads, HEAD_TILE))
    mla_decode_kernel[grid](
        out, q, cache, tables, seq_lens, scale, num_heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        tables.stride(0), cache.stride(0), cache.stride(2),
        WIDTH=width, WIDTH_PAD=triton.next_power_of_2(width), RANK=rank, RANK_PAD=triton.next_power_of_2(rank),
        BLOCK_SIZE=cache.shape[2], HEADS=HEAD_TILE, TILE=TILE_N, IEEE=q.dtype == torch.float32,
    )
    return out
