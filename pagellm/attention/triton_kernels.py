"""Triton kernels for paged attention: K/V write by slot mapping, split-K decode, paged prefill.

All three read and write the pool's per-layer views [num_blocks, kv_heads, block_size, head_dim]
(head-major blocks: one head's keys of one block are block_size * head_dim contiguous elements, so a
tile of consecutive positions inside a block is one contiguous run).

GQA: a program owns one KV head and all query heads that share it (the group), so each K/V tile is
loaded once per group. The group's rows are padded to at least 16 because tl.dot needs M >= 16;
decode is bound by K/V bytes, not by the wasted matrix rows.

They run on CUDA and, under TRITON_INTERPRET=1, on CPU tensors (fp32/fp16; the interpreter mishandles
bf16). float32 dots ask for IEEE precision: Triton's default for a float32 dot on a GPU is tf32, which
would break equality with the float32 reference.

Sliding windows: the attention kernels take `window` (in tokens; a value past any sequence length, such as
NO_WINDOW, means full attention). The query at position p sees keys in (p - window, p]; key tiles wholly
before the lowest window start are skipped and positions before it are never loaded, so block-table
entries there may be holes (blocks given back to the pool).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The window argument meaning full attention: wider than any sequence.
NO_WINDOW = 1 << 30


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_cache_block, stride_cache_head, stride_cache_pos,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: every KV head of the token goes to slot // BLOCK_SIZE, slot % BLOCK_SIZE.
    A negative slot (the padding rows of a CUDA-graph batch) writes nothing."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, KV_HEADS_PAD)
        dims = tl.arange(0, DIM_PAD)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
        v = tl.load(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
        dest = (block * stride_cache_block + offset * stride_cache_pos + heads[:, None] * stride_cache_head
                + dims[None, :])
        tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    q, m, l, acc, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head, start, seq_len, query_positions,
    key_lo, window, scale, stride_cache_block, stride_cache_head, stride_cache_pos,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr,
):
    """One online-softmax step over keys start..start+TILE_N of one sequence, through its block table.

    q: [M, DIM_PAD]; m, l: [M] running max and sum; acc: [M, DIM_PAD] unnormalised output.
    With CAUSAL, row r sees keys at positions in (query_positions[r] - window, query_positions[r]] (lower-right
    aligned chunks). Positions below key_lo are neither read nor seen.
    """
    positions = start + tl.arange(0, TILE_N)
    in_seq = (positions < seq_len) & (positions >= key_lo)
    blocks = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    rows = blocks * stride_cache_block + kv_head * stride_cache_head + (positions % BLOCK_SIZE) * stride_cache_pos
    dims = tl.arange(0, DIM_PAD)
    kv_mask = in_seq[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * scale
    if CAUSAL:
        visible = (in_seq[None, :] & (positions[None, :] <= query_positions[:, None])
                   & (positions[None, :] > query_positions[:, None] - window))
    else:
        visible = in_seq[None, :] & (query_positions[:, None] >= 0)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # A row that has seen no visible key yet keeps m = -inf; shift by 0 there so exp gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    l = l * alpha + tl.sum(p, axis=1)
    return m_new, l, acc


@triton.jit
def paged_decode_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale, window,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table,
    stride_cache_block, stride_cache_head, stride_cache_pos,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    """grid (num_seqs, num_kv_heads, NUM_SPLITS). Split s of a sequence attends to its s-th share of the
    key tiles; with one split the program writes the output, else normalised partials plus (max, sum)
    per head for reduce_splits_kernel. A sequence of length 0 (CUDA-graph padding) gets zeros."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The one query sits at seq_len - 1: its window starts at key_lo, and the splits share the tiles from there.
    key_lo = tl.maximum(seq_len - window, 0)
    window_tile = key_lo // TILE_N
    num_tiles = tl.cdiv(seq_len, TILE_N) - window_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first_tile = window_tile + split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, window_tile + num_tiles)

    group_rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group_rows
    row_mask = group_rows < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    query_positions = tl.zeros([GROUP_PAD], tl.int32)  # unused without CAUSAL, but >= 0
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for tile in range(first_tile, last_tile):
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head, tile * TILE_N,
                                 seq_len, query_positions, key_lo, window, scale, stride_cache_block,
                                 stride_cache_head, stride_cache_pos, HEAD_DIM, DIM_PAD, BLOCK_SIZE, TILE_N, False,
                                 IEEE)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    store_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # partials: [num_seqs, num_heads, NUM_SPLITS, DIM_PAD] and [num_seqs, num_heads, NUM_SPLITS].
        num_heads = tl.num_programs(1) * GROUP
        stat_index = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(partial_out_ptr + stat_index[:, None] * DIM_PAD + dims[None, :], out, mask=store_mask)
        tl.store(partial_max_ptr + stat_index, m, mask=row_mask)
        tl.store(partial_sum_ptr + stat_index, l, mask=row_mask)


@triton.jit
def reduce_splits_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, stride_out_token, stride_out_head,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """grid (num_seqs, num_heads): weight each split's normalised output by its share of the softmax sum."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, NUM_SPLITS)
    stat_index = (seq * num_heads + head) * NUM_SPLITS + splits
    maxes = tl.load(partial_max_ptr + stat_index)
    sums = tl.load(partial_sum_ptr + stat_index)
    overall = tl.max(maxes, axis=0)
    overall = tl.where(overall == float("-inf"), 0.0, overall)
    weights = sums * tl.exp(maxes - overall)
    total = tl.sum(weights, axis=0)
    dims = tl.arange(0, DIM_PAD)
    partial = tl.load(partial_out_ptr + stat_index[:, None] * DIM_PAD + dims[None, :])
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_token + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_starts_ptr,
    tile_seqs_ptr, tile_first_queries_ptr, scale, window,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table,
    stride_cache_block, stride_cache_head, stride_cache_pos,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, IEEE: tl.constexpr,
):
    """grid (num_query_tiles, num_kv_heads). A query tile is BLOCK_Q consecutive queries of one sequence
    times the GROUP query heads of one KV head (row r: query r // GROUP, head r % GROUP). The chunk's own
    K/V are already in the pool (written first), so cached context and the chunk are read alike through
    the block table; query i of a chunk of n sits at position seq_len - n + i (lower-right aligned)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seqs_ptr + tile)
    first_query = tl.load(tile_first_queries_ptr + tile)
    query_start = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_starts_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    query = first_query + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (query < query_len)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    tokens = (query_start + query).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    query_positions = context_len + query
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    # The tile's last query sees keys up to its own position; nothing past it is read.
    key_end = tl.minimum(seq_len, context_len + first_query + BLOCK_Q)
    # ... and the first query's window starts at key_lo: nothing before it is read.
    key_lo = tl.maximum(context_len + first_query - window + 1, 0)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for start in range((key_lo // TILE_N) * TILE_N, key_end, TILE_N):
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head, start, seq_len,
                                 query_positions, key_lo, window, scale, stride_cache_block, stride_cache_head,
                                 stride_cache_pos, HEAD_DIM, DIM_PAD, BLOCK_SIZE, TILE_N, True, IEEE)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])
