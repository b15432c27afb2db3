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

Quantized caches (kv_spec.py: fp8 e4m3 / e5m2 or int8 codes, a bfloat16 scale per row after each run's codes):
with QUANT set to the format's code, the cache pointers are the layer's bytes, the scale pointers the same bytes
as int16, and the strides are in bytes (codes) and in int16 (scales). The writer quantizes each row as
kv_spec.py's reference does, byte for byte, and the attention kernels dequantize codes in registers (bit
manipulation: no float8 types, so the same code runs under the interpreter and on any GPU) and cast them to the
queries' dtype for the products.

Sliding windows: the attention kernels take `window` (in tokens; a value past any sequence length, such as
NO_WINDOW, means full attention). The query at position p sees keys in (p - window, p]; key tiles wholly
before the lowest window start are skipped and positions before it are never loaded, so block-table
entries there may be holes (blocks given back to the pool).

Attention sinks (gpt-oss): with SINKS set, `sinks_ptr` holds one float32 logit per query head, which joins that
head's softmax denominator after the last key tile (`_add_sink`; with split-K decode, once, in the reduce). With
SINKS unset (a constexpr) no sink code is compiled and the pointer is never read.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The window argument meaning full attention: wider than any sequence.
NO_WINDOW = 1 << 30
# kv_spec.py's KVCacheFormat.code of the quantized formats (0: unquantized).
UNQUANTIZED, FP8_E4M3, FP8_E5M2, INT8 = 0, 3, 4, 5


@triton.jit
def _quantize(x, MAX: tl.constexpr, QUANT: tl.constexpr):
    """Rows x [R, D] float32 (zeros past the row) -> (codes [R, D] uint8, scales [R] as bfloat16 bits in int32):
    kv_spec.py's KVCacheFormat.quantize in integer arithmetic, which rounds as torch does."""
    amax = tl.max(tl.abs(x), axis=1)
    # float32 -> bfloat16 to nearest even (the interpreter has no bfloat16)
    bits = tl.math.div_rn(amax, tl.full(amax.shape, MAX, tl.float32)).to(tl.int32, bitcast=True)
    scale_bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    scale = (scale_bits << 16).to(tl.float32, bitcast=True)
    divisor = tl.where(scale > 0, scale, 1.0)[:, None] + tl.zeros_like(x)
    y = tl.where(scale[:, None] > 0, tl.math.div_rn(x, divisor), 0.0)
    y = tl.minimum(tl.maximum(y, -MAX), MAX)
    if QUANT == 5:  # int8: adding 1.5 * 2^23 rounds to nearest even into the low mantissa bits
        codes = ((y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000) & 0xFF
    else:
        y_bits = y.to(tl.int32, bitcast=True)
        sign = (y_bits >> 24) & 0x80
        a = y_bits & 0x7FFFFFFF
        if QUANT == 3:  # e4m3: drop 20 mantissa bits to nearest even, exponent bias 127 -> 7; below 2^-6 subnormal
            normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
            subnormal = (a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
            codes = sign | tl.where(a < 0x3C800000, subnormal, normal)
        else:  # e5m2: drop 21 bits, bias 127 -> 15; below 2^-14 subnormal
            normal = ((a + 0xFFFFF + ((a >> 21) & 1)) >> 21) - (112 << 2)
            subnormal = (a.to(tl.float32, bitcast=True) * 65536.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
            codes = sign | tl.where(a < 0x38800000, subnormal, normal)
    return codes.to(tl.uint8), scale_bits


@triton.jit
def _dequantize(codes, scale_bits, QUANT: tl.constexpr):
    """codes [N, D] uint8 and their rows' scales [N] (bfloat16 bits in int16) -> float32 code * scale."""
    x = codes.to(tl.int32)
    if QUANT == 5:
        value = (x - ((x & 0x80) << 1)).to(tl.float32)
    else:
        magnitude = x & 0x7F
        if QUANT == 3:  # e4m3: exponent bias 7 (float's 127), subnormals m * 2^-9
            normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
            value = tl.where(magnitude < 8, magnitude.to(tl.float32) * 0.001953125, normal)
        else:  # e5m2: exponent bias 15, subnormals m * 2^-16
            normal = ((magnitude << 21) + (112 << 23)).to(tl.float32, bitcast=True)
            value = tl.where(magnitude < 4, magnitude.to(tl.float32) * 0.0000152587890625, normal)
        value = tl.where((x & 0x80) != 0, -value, value)
    scale = ((scale_bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return value * scale[:, None]


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_cache_block, stride_cache_head, stride_cache_pos, stride_scale_block, stride_scale_head, scale_offset,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr = 0, MAX: tl.constexpr = 0.0,
):
    """One program per token: every KV head of the token goes to slot // BLOCK_SIZE, slot % BLOCK_SIZE
    (quantized, with QUANT: codes there and each head's scale beside its run's codes).
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
        if QUANT == 0:
            tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
        else:
            scale_dest = block * stride_scale_block + heads * stride_scale_head + scale_offset + offset
            k_codes, k_scales = _quantize(k.to(tl.float32), MAX, QUANT)
            v_codes, v_scales = _quantize(v.to(tl.float32), MAX, QUANT)
            tl.store(k_cache_ptr + dest, k_codes, mask=mask)
            tl.store(v_cache_ptr + dest, v_codes, mask=mask)
            tl.store(k_scale_ptr + scale_dest, k_scales.to(tl.int16), mask=heads < NUM_KV_HEADS)
            tl.store(v_scale_ptr + scale_dest, v_scales.to(tl.int16), mask=heads < NUM_KV_HEADS)


@triton.jit
def _load_kv(cache_ptr, scale_ptr, rows, scale_rows, dims, kv_mask, in_seq, dtype, QUANT: tl.constexpr):
    """A tile of keys or values [TILE_N, DIM_PAD] in `dtype`: loaded (and converted, where the cache has a dtype
    of its own), or dequantized from codes and scales."""
    if QUANT == 0:
        return tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(dtype)
    codes = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0)
    scales = tl.load(scale_ptr + scale_rows, mask=in_seq, other=0)
    return _dequantize(codes, scales, QUANT).to(dtype)


@triton.jit
def _attend_tile(
    q, m, l, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row_ptr, kv_head, start, seq_len,
    query_positions, key_lo, window, scale, stride_cache_block, stride_cache_head, stride_cache_pos,
    stride_scale_block, stride_scale_head, scale_offset,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr,
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
    scale_rows = blocks * stride_scale_block + kv_head * stride_scale_head + scale_offset + positions % BLOCK_SIZE
    dims = tl.arange(0, DIM_PAD)
    kv_mask = in_seq[:, None] & (dims[None, :] < HEAD_DIM)
    k = _load_kv(k_cache_ptr, k_scale_ptr, rows, scale_rows, dims, kv_mask, in_seq, q.dtype, QUANT)
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
    v = _load_kv(v_cache_ptr, v_scale_ptr, rows, scale_rows, dims, kv_mask, in_seq, q.dtype, QUANT)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    l = l * alpha + tl.sum(p, axis=1)
    return m_new, l, acc


@triton.jit
def _add_sink(m, l, acc, sinks_ptr, heads, row_mask):
    """The online softmax's running (max m, sum l, unnormalised acc) with each row's head's sink logit joined:
    the maximum takes it in, the sum gains e^(sink - max), and what was summed shrinks with a raised maximum."""
    sink = tl.load(sinks_ptr + heads, mask=row_mask, other=float("-inf")).to(tl.float32)
    m_new = tl.maximum(m, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    return m_new, l * alpha + tl.exp(sink - m_safe), acc * alpha[:, None]


@triton.jit
def paged_decode_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, scale, window,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table,
    stride_cache_block, stride_cache_head, stride_cache_pos, stride_scale_block, stride_scale_head, scale_offset,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    QUANT: tl.constexpr = 0, sinks_ptr=None, SINKS: tl.constexpr = False,
):
    """grid (num_seqs, num_kv_heads, NUM_SPLITS). Split s of a sequence attends to its s-th share of the
    key tiles; with one split the program writes the output, else normalised partials plus (max, sum)
    per head for reduce_splits_kernel (which then adds the sinks). A sequence of length 0 (CUDA-graph
    padding) gets zeros."""
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
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row,
                                 kv_head, tile * TILE_N, seq_len, query_positions, key_lo, window, scale,
                                 stride_cache_block, stride_cache_head, stride_cache_pos, stride_scale_block,
                                 stride_scale_head, scale_offset, HEAD_DIM, DIM_PAD, BLOCK_SIZE, TILE_N, False, IEEE,
                                 QUANT)
    if SINKS and NUM_SPLITS == 1:
        m, l, acc = _add_sink(m, l, acc, sinks_ptr, heads, row_mask)
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
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, sinks_ptr=None,
    SINKS: tl.constexpr = False,
):
    """grid (num_seqs, num_heads): weight each split's normalised output by its share of the softmax sum (with
    SINKS, a sum that also holds e^sink of the head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, NUM_SPLITS)
    stat_index = (seq * num_heads + head) * NUM_SPLITS + splits
    maxes = tl.load(partial_max_ptr + stat_index)
    sums = tl.load(partial_sum_ptr + stat_index)
    overall = tl.max(maxes, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        overall = tl.maximum(overall, sink)
    overall = tl.where(overall == float("-inf"), 0.0, overall)
    weights = sums * tl.exp(maxes - overall)
    total = tl.sum(weights, axis=0)
    if SINKS:
        total += tl.exp(sink - overall)
    dims = tl.arange(0, DIM_PAD)
    partial = tl.load(partial_out_ptr + stat_index[:, None] * DIM_PAD + dims[None, :])
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_token + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
    query_starts_ptr, tile_seqs_ptr, tile_first_queries_ptr, scale, window,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table,
    stride_cache_block, stride_cache_head, stride_cache_pos, stride_scale_block, stride_scale_head, scale_offset,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, IEEE: tl.constexpr,
    QUANT: tl.constexpr = 0, sinks_ptr=None, SINKS: tl.constexpr = False,
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
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row,
                                 kv_head, start, seq_len, query_positions, key_lo, window, scale, stride_cache_block,
                                 stride_cache_head, stride_cache_pos, stride_scale_block, stride_scale_head,
                                 scale_offset, HEAD_DIM, DIM_PAD, BLOCK_SIZE, TILE_N, True, IEEE, QUANT)
    if SINKS:
        m, l, acc = _add_sink(m, l, acc, sinks_ptr, heads, row_mask)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])
