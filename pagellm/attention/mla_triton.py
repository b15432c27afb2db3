"""The latent decode of multi-head latent attention (attention/mla.py) in Triton: one program per (sequence,
tile of HEAD_TILE heads) streams the sequence's cached rows [rank latent | rope key] through its block table
once for the whole tile, with an online softmax:

    scores = q_tile [heads, width] @ rows^T [width, keys]       acc += p [heads, keys] @ rows[:, :rank]

Every head shares the rows (MLA is multi-query attention over the latent), which is what makes a tile of heads
one matrix product. float32 queries multiply in IEEE float32 (no TF32), as the model computes. Tested on CPU
under TRITON_INTERPRET=1 against a float64 reference of the expanded attention.

A quantized cache (kv_spec.py: fp8 e4m3 / e5m2 or int8 codes, each block one run of [block_size][width] codes
then block_size bfloat16 scales) is read as it is stored, with QUANT its format's code: the codes as bytes, the
scales through an int16 view of the same memory, dequantized in registers by triton_kernels._dequantize (bit
manipulation, no float8 types) and cast to the queries' dtype for the products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.attention.kv_spec import KVCacheFormat
from pagellm.attention.paged import DecodeMetadata
from pagellm.attention.triton_kernels import _dequantize

HEAD_TILE = 16  # tl.dot needs at least 16 rows
TILE_N = 16


@triton.jit
def _load_rows(cache_ptr, scale_ptr, rows, scale_rows, dims, mask, in_seq, dtype, QUANT: tl.constexpr):
    """Cached rows [TILE, len(dims)] in `dtype`: loaded, or dequantized from their codes and scales."""
    if QUANT == 0:
        return tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=mask, other=0.0).to(dtype)
    codes = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=mask, other=0)
    scales = tl.load(scale_ptr + scale_rows, mask=in_seq, other=0)
    return _dequantize(codes, scales, QUANT).to(dtype)


@triton.jit
def mla_decode_kernel(
    out_ptr, q_ptr, cache_ptr, scale_ptr, block_tables_ptr, seq_lens_ptr, scale, num_heads,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table, stride_cache_block,
    stride_cache_pos, stride_scale_block, scale_offset,
    WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr,
):
    """grid (num_seqs, cdiv(num_heads, HEADS)); out [num_seqs, num_heads, RANK]. With QUANT, scale_ptr is the
    cache as int16 and a block's scales start scale_offset int16s into its stride_scale_block."""
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
        scale_rows = blocks * stride_scale_block + scale_offset + positions % BLOCK_SIZE
        keys = _load_rows(cache_ptr, scale_ptr, rows, scale_rows, dims, in_seq[:, None] & (dims[None, :] < WIDTH),
                          in_seq, q.dtype, QUANT)
        if IEEE:
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(keys))
        scores = tl.where(in_seq[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        values = _load_rows(cache_ptr, scale_ptr, rows, scale_rows, latent_dims,
                            in_seq[:, None] & (latent_dims[None, :] < RANK), in_seq, q.dtype, QUANT)
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
                         seq_lens: torch.Tensor | None = None,
                         kv_format: KVCacheFormat | None = None) -> torch.Tensor:
    """q [num_decodes, heads, width]; cache [num_blocks, 1, block_size, width], or the [num_blocks, 1, run bytes]
    of a quantized `kv_format` -> [num_decodes, heads, rank] in q's dtype. Reads decode.block_tables_tensor and
    the context lengths: `seq_lens` on q's device where the backend put them there for the step, else
    decode.context_lens."""
    num_seqs, num_heads, width = q.shape
    quant = kv_format.code if kv_format is not None and kv_format.quantized else 0
    if quant:
        run = cache.shape[-1] if cache.dim() == 3 else 0
        block_size = run // (width + 2)
        # The scales are read as int16: a run, and the codes before its scales, span whole int16s.
        if (cache.dtype != torch.uint8 or cache.shape[1] != 1 or run % (width + 2) or run % 2
                or block_size * width % 2 or not cache.is_contiguous()):
            raise TypeError(f"a {kv_format.name} MLA cache is contiguous uint8 runs [blocks, 1, block_size * "
                            f"{width + 2}] with block_size * {width} even, not {cache.dtype} {tuple(cache.shape)}")
        scales, stride_pos, scale_offset = cache.view(torch.int16), width, block_size * width // 2
    else:
        if cache.dim() != 4 or cache.shape[1] != 1 or cache.shape[3] != width or cache.stride(3) != 1:
            raise TypeError(f"an MLA cache is [blocks, 1, block_size, {width}] with unit stride, not "
                            f"{tuple(cache.shape)}")
        block_size, scales, stride_pos, scale_offset = cache.shape[2], cache, cache.stride(2), 0
    q = q.contiguous()
    out = torch.empty(num_seqs, num_heads, rank, dtype=q.dtype, device=q.device)
    tables = decode.block_tables_tensor
    if seq_lens is None:
        seq_lens = torch.as_tensor(decode.context_lens, device=q.device)
    grid = (num_seqs, triton.cdiv(num_heads, HEAD_TILE))
    mla_decode_kernel[grid](
        out, q, cache, scales, tables, seq_lens, scale, num_heads, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), tables.stride(0), cache.stride(0), stride_pos, cache.stride(0) // 2, scale_offset,
        WIDTH=width, WIDTH_PAD=triton.next_power_of_2(width), RANK=rank, RANK_PAD=triton.next_power_of_2(rank),
        BLOCK_SIZE=block_size, HEADS=HEAD_TILE, TILE=TILE_N, IEEE=q.dtype == torch.float32, QUANT=quant,
    )
    return out
