"""The torch attention backend: write the step's K/V into its blocks, attend decodes in one call, prefill
chunks one by one. It is the reference the other backends (backend.py) are tested against.

A step's tokens arrive flattened, decodes first (one query token each), then prefill chunks.

Decodes run on the native kernel where there is one (CPU, float32 or bfloat16: `native.py`), which reads each
sequence's blocks through its block table; otherwise they gather their blocks into a padded batch and
attend with a key-padding mask (the torch path, which also serves as the reference in tests).

With the native prefill kernel (CPU), all the step's prefill chunks attend in one call that reads their
keys and values from the cache through their block tables, so chunks with context gather nothing.

On the torch path, each prefill chunk attends on its own: a chunk that starts its sequence uses the step's
own keys and values with `is_causal=True`, with no gather and no padding; a chunk that continues a sequence
(chunked prefill, a prefix-cache hit, a resumed request) gathers its context and attends with a causal mask
aligned to the lower right, because its first query sits `num_computed` tokens into the sequence.

A quantized cache (kv_spec.py: fp8 or int8 codes with a scale per row) is written by quantizing each row; the
torch path attends the dequantized cache in float32 (a chunk that starts its sequence attends its own K/V as the
cache gives them back), which is the reference the kernels that read the codes directly are tested against. A
cache of another float dtype than the model's (kv_cache_dtype="bfloat16" under float32) is written rounded to it
and read back widened, and a chunk that starts its sequence attends its K/V rounded the same way.

A layer with a sliding window of W tokens (`models/sliding_window.py`) lets the query at position p see
keys in (p - W, p] only. Its decodes and chunks read only the blocks that window touches: block-table
entries before it may be holes (`core.block_pool.HOLE`, blocks already given back to the pool), so they are
never gathered. The windowed views are built the first time a layer with that window asks, once per step.

A layer with attention sinks (gpt-oss: one learned logit per query head, `sinks` [heads] float32) adds e^sink to
each query's softmax denominator, with no value: the torch path computes that softmax itself (SDPA has no
sink), the native and Triton kernels fold it into their running sums. Layers without sinks pass None and run
as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.attention.backend import AttentionShape, StepAttentionInputs
from pagellm.attention.kv_spec import KVCacheFormat
from pagellm.attention.native import DecodeKernel, PrefillChunks, PrefillKernel
from pagellm.cpu_features import cpu_has_native


@dataclass
class PrefillChunk:
    # Token range of this chunk within the prefill part of the step's tokens.
    start: int
    end: int
    # Set only for a chunk with context before it: the sequence's blocks up to its context length, and
    # the [chunk, context] mask (True = attend) that makes the chunk causal at its real positions, built
    # by the first layer that attends to the whole context (chunk_mask): a model whose every layer slides
    # never builds it.
    block_table: torch.Tensor | None = None
    context_len: int = 0
    mask: torch.Tensor | None = None
    # Per sliding window: (block table from the window's first block or None, keys, mask); see _chunk_window.
    windows: dict = field(default_factory=dict)


@dataclass
class DecodeMetadata:
    # Host arrays, read by the native kernel.
    block_tables: np.ndarray  # [num_decodes, max_blocks] int64
    context_lens: np.ndarray  # [num_decodes] int64
    # The torch path's padded batch; None when the native kernel runs.
    block_tables_tensor: torch.Tensor | None = None
    # [num_decodes, 1, 1, max_blocks * block_size], True = attend; built by the first layer that attends to
    # every key (decode_mask).
    mask: torch.Tensor | None = None
    # Per sliding window, the torch path's (block tables, mask) over the blocks the window touches.
    windows: dict = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    # Rows of the cache viewed as [num_blocks * kv_heads * block_size, head_dim] that receive each
    # token's K/V, token-major then head: [num_tokens * kv_heads] (see kv_write_index).
    kv_write_index: torch.Tensor
    num_decode_tokens: int
    decode: DecodeMetadata | None
    prefill_chunks: list[PrefillChunk]
    native_decode: DecodeKernel | None = None
    # The C copy of the step's K/V into the pool (native.KVWriter); None: index_copy_.
    native_write: Callable | None = None
    # With the native prefill kernel: the kernel and the step's chunks as it reads them (prefill_chunks,
    # the torch path's, is then empty).
    native_prefill: tuple[PrefillKernel, PrefillChunks] | None = None
    # The backend whose forward serves this metadata; None is the torch path below.
    backend: object | None = None
    # A quantized cache's format (kv_spec.py) and its block size; None: the cache holds K/V in their own dtype.
    kv_format: KVCacheFormat | None = None
    block_size: int = 0


def kv_write_index(block_ids: np.ndarray, offsets: np.ndarray, num_kv_heads: int, block_size: int) -> np.ndarray:
    """Cache rows for tokens at (block, offset in block): every head of a block is its own contiguous
    [block_size, head_dim] run, so head h of a token lands at row (block * kv_heads + h) * block_size + offset."""
    heads = np.arange(num_kv_heads)
    return ((block_ids[:, None] * num_kv_heads + heads[None, :]) * block_size + offsets[:, None]).reshape(-1)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
             kv_format: KVCacheFormat | None = None) -> None:
    head_dim = k.shape[-1]
    if kv_format is not None and kv_format.quantized:
        for x, cache in ((k, k_cache), (v, v_cache)):
            codes, scales = kv_format.split(cache, head_dim)
            blocks, heads, block_size, _ = codes.shape
            new_codes, new_scales = kv_format.quantize(x.reshape(-1, head_dim))
            runs, offsets = rows // block_size, rows % block_size
            codes.view(blocks * heads, block_size, head_dim)[runs, offsets] = new_codes
            scales.view(blocks * heads, block_size)[runs, offsets] = new_scales
        return
    k_cache.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(k_cache.dtype))
    v_cache.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, kv_format: KVCacheFormat | None = None,
              head_dim: int = 0) -> torch.Tensor:
    """[num_seqs, num_kv_heads, max_blocks * block_size, head_dim] keys or values of each sequence; from a
    quantized cache (of heads of `head_dim`), dequantized to float32."""
    if kv_format is not None and kv_format.quantized:
        codes, scales = kv_format.split(cache, head_dim)
        values = kv_format.dequantize(codes[block_tables], scales[block_tables])
    else:
        values = cache[block_tables]  # [num_seqs, max_blocks, kv_heads, block_size, head_dim]
    num_seqs, max_blocks, num_kv_heads, block_size, head_dim = values.shape
    return values.transpose(1, 2).reshape(num_seqs, num_kv_heads, max_blocks * block_size, head_dim)


def sdpa_attend(q, k, v, mask, scale, is_causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [B, H, Q, D]; k/v: [B, KVH, L, D]. enable_gqa maps query head h to kv head h // (H / KVH)
    # without materialising repeated K/V (measured ~3x faster on a decode batch, bit-identical).
    if sinks is not None:
        return sink_attend(q, k, v, mask, scale, is_causal, sinks)
    dtype = q.dtype
    if q.device.type == "cpu" and not cpu_has_native(dtype) or k.dtype != dtype:
        # Emulated half SDPA is several times slower than float32 SDPA on widened inputs (which
        # accumulates in float32 as the half kernel does). A dequantized cache is float32.
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.to(dtype)


def sink_attend(q, k, v, mask, scale, is_causal: bool, sinks: torch.Tensor) -> torch.Tensor:
    """sdpa_attend's attention with a sink per query head (`sinks` [H]) in each row's softmax denominator, as
    transformers' eager gpt-oss attention computes it: the scores with the sink logit appended, softmaxed, the
    sink's column dropped. float32 arithmetic; `mask` True = attend, is_causal aligned to the upper left."""
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v).to(dtype)


def _decode_attention(q, k_cache, v_cache, decode: DecodeMetadata, kernel: DecodeKernel | None, scale,
                      sliding_window: int | None = None, kv_format: KVCacheFormat | None = None,
                      block_size: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    if kernel is not None:
        return kernel(q, k_cache, v_cache, decode.block_tables, decode.context_lens, scale, sliding_window or 0,
                      kv_format, sinks)
    block_size = block_size or k_cache.shape[2]
    if sliding_window is None:
        tables, mask = decode.block_tables_tensor, decode_mask(decode, block_size)
    else:
        tables, mask = _decode_window(decode, sliding_window, block_size)
    k = gather_kv(k_cache, tables, kv_format, q.shape[-1])
    v = gather_kv(v_cache, tables, kv_format, q.shape[-1])
    return sdpa_attend(q.unsqueeze(2), k, v, mask, scale, sinks=sinks).squeeze(2)


def decode_mask(decode: DecodeMetadata, block_size: int) -> torch.Tensor:
    """Which keys of the padded batch each decode attends: those before its context length."""
    if decode.mask is None:
        keys = np.arange(decode.block_tables.shape[1] * block_size)
        visible = keys[None, :] < decode.context_lens[:, None]
        decode.mask = to_device(visible, decode.block_tables_tensor.device)[:, None, None, :]
    return decode.mask


def _decode_window(decode: DecodeMetadata, window: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode's blocks from the first its window touches, padded to the widest, and the key mask."""
    view = decode.windows.get(window)
    if view is None:
        lens = decode.context_lens
        first_key = np.maximum(lens - window, 0)
        first_block = first_key // block_size
        num_blocks = -(-lens // block_size)
        width = int((num_blocks - first_block).max())
        # Columns past a sequence's last block repeat its last one: masked, never a hole.
        columns = np.minimum(first_block[:, None] + np.arange(width), (num_blocks - 1)[:, None])
        device = decode.block_tables_tensor.device
        tables = torch.gather(decode.block_tables_tensor, 1, to_device(columns, device))
        keys = first_block[:, None] * block_size + np.arange(width * block_size)
        visible = (keys >= first_key[:, None]) & (keys < lens[:, None])
        view = decode.windows[window] = (tables, to_device(visible, device)[:, None, None, :])
    return view


def _chunk_attention(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale,
                     sliding_window: int | None = None, kv_format: KVCacheFormat | None = None,
                     block_size: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [chunk, H, D]; k, v: the chunk's own [chunk, KVH, D] (as the cache gives them back, when it is
    quantized). Returns [chunk, H, D]."""
    num_queries = chunk.end - chunk.start
    seq_len = chunk.context_len or num_queries
    head_dim = q.shape[-1]
    if sliding_window is not None and seq_len > sliding_window:
        table, num_keys, mask = _chunk_window(chunk, sliding_window, block_size or k_cache.shape[2], q.device)
        if table is None:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        else:
            k = gather_kv(k_cache, table[None], kv_format, head_dim)[0, :, :num_keys]
            v = gather_kv(v_cache, table[None], kv_format, head_dim)[0, :, :num_keys]
        out = sdpa_attend(q.transpose(0, 1)[None], k[None], v[None], mask, scale, sinks=sinks)
        return out[0].transpose(0, 1)
    mask = None
    if chunk.block_table is not None:
        k = gather_kv(k_cache, chunk.block_table[None], kv_format, head_dim)[0, :, : chunk.context_len]
        v = gather_kv(v_cache, chunk.block_table[None], kv_format, head_dim)[0, :, : chunk.context_len]
        mask = chunk_mask(chunk, q.device)
    else:
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    out = sdpa_attend(q.transpose(0, 1)[None], k[None], v[None], mask, scale, is_causal=mask is None, sinks=sinks)
    return out[0].transpose(0, 1)


def chunk_mask(chunk: PrefillChunk, device) -> torch.Tensor:
    """The [chunk, context] causal mask of a chunk with context before it: query i sits at position
    num_computed + i and sees keys up to and including it. Built once per step, by the first layer that
    needs it."""
    if chunk.mask is None:
        num_queries = chunk.end - chunk.start
        queries = chunk.context_len - num_queries + torch.arange(num_queries, device=device)
        chunk.mask = torch.arange(chunk.context_len, device=device)[None, :] <= queries[:, None]
    return chunk.mask


def _chunk_window(chunk: PrefillChunk, window: int, block_size: int, device) -> tuple:
    """(block table from the first block the chunk's window touches, or None when the chunk starts its
    sequence and attends to its own keys; how many keys from that block's start; the [chunk, keys] mask
    that is causal and windowed)."""
    view = chunk.windows.get(window)
    if view is None:
        num_queries = chunk.end - chunk.start
        num_computed = chunk.context_len - num_queries if chunk.block_table is not None else 0
        queries = num_computed + torch.arange(num_queries, device=device)
        table, first_key = None, 0
        if chunk.block_table is not None:
            first_block = max(0, num_computed - window + 1) // block_size
            table, first_key = chunk.block_table[first_block:], first_block * block_size
        keys = torch.arange(first_key, num_computed + num_queries, device=device)
        mask = (keys[None, :] <= queries[:, None]) & (keys[None, :] > queries[:, None] - window)
        view = chunk.windows[window] = (table, len(keys), mask)
    return view


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] for this step's tokens. Returns [T, H, D].

    With `sliding_window`, the query at position p attends to keys in (p - sliding_window, p] only; with
    `sinks` ([H] float32), head h's softmax denominator also holds e^sinks[h].
    Dispatches to the backend that built `meta`; metadata without one runs the torch path.
    """
    if meta.backend is not None:
        return meta.backend.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, sinks)
    return torch_paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, sinks)


def torch_paged_attention(q, k, v, k_cache, v_cache, meta, scale: float,
                          sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    kv_format = meta.kv_format
    (meta.native_write or write_kv)(k, v, k_cache, v_cache, meta.kv_write_index, kv_format)
    num_decodes = meta.num_decode_tokens
    block_size = meta.block_size
    parts = []
    if num_decodes:
        parts.append(_decode_attention(q[:num_decodes], k_cache, v_cache, meta.decode, meta.native_decode, scale,
                                       sliding_window, kv_format, block_size, sinks))
    if meta.native_prefill is not None:
        # Every chunk, however short, goes to the kernel: measured per chunk length against flash SDPA
        # (benchmarks/cpu_attention.py), it costs about what SDPA does at a single token (and one call serves
        # all the step's chunks) and is several times faster on long chunks, so no length threshold sends
        # chunks back to the torch path.
        kernel, chunks = meta.native_prefill
        parts.append(kernel(q[num_decodes:], k_cache, v_cache, chunks, scale, sliding_window or 0, kv_format, sinks))
    if meta.prefill_chunks and kv_format is not None:
        k, v = kv_format.round_trip(k), kv_format.round_trip(v)
    elif meta.prefill_chunks and k_cache.dtype != k.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # as the cache gives them back; SDPA widens them
    for chunk in meta.prefill_chunks:
        start, end = num_decodes + chunk.start, num_decodes + chunk.end
        parts.append(_chunk_attention(q[start:end], k[start:end], v[start:end], k_cache, v_cache, chunk, scale,
                                      sliding_window, kv_format, block_size, sinks))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


class TorchAttentionBackend:
    """Torch ops (and the native CPU decode and prefill kernels when given them) behind the backend interface."""

    name = "torch"
    supports_cuda_graphs = False

    def __init__(self, shape: AttentionShape, device: torch.device, native_decode: DecodeKernel | None,
                 native_write: Callable | None = None, native_prefill: PrefillKernel | None = None) -> None:
        self.shape = shape
        self.device = device
        self.native_decode = native_decode
        self.native_write = native_write
        self.native_prefill = native_prefill
        # Only a quantized format changes what the torch path does; an unquantized cache has the model's dtype.
        self.kv_format = shape.quantized_cache
        if native_decode is not None or native_prefill is not None:
            self.name = "cpu-native"

    def build_metadata(self, step: StepAttentionInputs) -> AttentionMetadata:
        block_size = self.shape.block_size
        slots = step.slot_mapping
        write_index = kv_write_index(slots // block_size, slots % block_size, self.shape.num_kv_heads, block_size)
        num_decodes = step.num_decodes
        query_lens, seq_lens = step.query_lens[num_decodes:], step.seq_lens[num_decodes:]
        block_tables = step.block_tables[num_decodes:]
        native_prefill, prefill_chunks = None, []
        if self.native_prefill is not None and len(query_lens):
            # The kernel reads the chunks from these arrays; the torch path's per-chunk tensors are not built.
            chunks = PrefillChunks.build(block_tables, np.cumsum(query_lens) - query_lens, query_lens, seq_lens)
            native_prefill = (self.native_prefill, chunks)
        else:
            prefill_chunks = self._prefill_chunks(query_lens, seq_lens, block_tables)
        return AttentionMetadata(
            kv_write_index=self._to_device(write_index),
            num_decode_tokens=num_decodes,
            decode=self._decode_metadata(step.block_tables[:num_decodes], step.seq_lens[:num_decodes])
            if num_decodes else None,
            prefill_chunks=prefill_chunks,
            native_decode=self.native_decode,
            native_write=self.native_write,
            native_prefill=native_prefill,
            kv_format=self.kv_format,
            block_size=block_size,
        )

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        (meta.native_write or write_kv)(k, v, k_cache, v_cache, meta.kv_write_index, meta.kv_format)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return torch_paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, sinks)

    def _decode_metadata(self, block_tables: np.ndarray, context_lens: np.ndarray) -> DecodeMetadata:
        max_blocks = -(-int(context_lens.max()) // self.shape.block_size)
        decode = DecodeMetadata(np.ascontiguousarray(block_tables[:, :max_blocks]), context_lens)
        if self.native_decode is None:
            decode.block_tables_tensor = self._to_device(decode.block_tables)
        return decode

    def _prefill_chunks(self, query_lens, seq_lens, block_tables) -> list[PrefillChunk]:
        ends = np.cumsum(query_lens)
        chunks = []
        for start, end, seq_len, table in zip((ends - query_lens).tolist(), ends.tolist(), seq_lens.tolist(),
                                              block_tables):
            chunk = PrefillChunk(start, end)
            num_computed = seq_len - (end - start)
            if num_computed:
                num_blocks = -(-seq_len // self.shape.block_size)
                chunk.block_table = self._to_device(table[:num_blocks])
                chunk.context_len = seq_len
            chunks.append(chunk)
        return chunks

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`. On CUDA through pinned memory, so the copy is asynchronous: a copy from
    pageable memory would wait for the stream's earlier work."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
