"""The Triton attention backend: launches triton_kernels.py's kernels from one metadata per step.

Per step, `build_metadata` moves the step's slot mapping, block tables, sequence lengths and the
prefill query-tile list to the device once; every layer then launches: the K/V write, one decode
kernel over all decodes (plus a reduce when split), and one prefill kernel over every prefill chunk
of the step (no gather, no per-sequence loop).

A quantized cache (kv_spec.py) is handed to the kernels as the layer's bytes for the codes and the same bytes
as int16 for the scales (`_cache_args`); the kernels quantize as they write and dequantize as they read.

A decode-only step can also be described by static buffers (`StaticDecodeBuffers`), whose metadata a
CUDA graph replays: its split count is fixed at capture from max_model_len, and padding rows (length 0,
slot -1) write nothing and read nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

from pagellm.attention import triton_kernels as kernels
from pagellm.attention.backend import AttentionShape, StepAttentionInputs
from pagellm.attention.paged import to_device

# Query rows (queries x group heads) per prefill program, and keys per inner-loop tile.
PREFILL_BLOCK_M = 64
PREFILL_TILE_N = 32
# Measured on an H200 (benchmarks/gpu_check.sh; README): 64-key tiles with 4 warps read K/V fastest of
# tiles 32/64 x warps 4/8.
DECODE_TILE_N = 64
DECODE_NUM_WARPS = 4
# Splits are added until the decode grid has this many programs per multiprocessor...
DECODE_PROGRAMS_PER_SM = 4
# ...while each split keeps at least this many keys.
DECODE_MIN_KEYS_PER_SPLIT = 512
DECODE_MAX_SPLITS = 16


@dataclass
class TritonMetadata:
    backend: TritonAttentionBackend
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    num_prefill_tokens: int
    # Decodes: [num_decodes, max_blocks] int32 and [num_decodes] int32.
    decode_block_tables: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    num_splits: int
    # Prefills: per sequence, and per query tile (the prefill grid's first axis).
    prefill_block_tables: torch.Tensor | None
    prefill_seq_lens: torch.Tensor | None
    prefill_query_starts: torch.Tensor | None  # [num_prefills + 1] int32, relative to the first prefill token
    tile_seqs: torch.Tensor | None
    tile_first_queries: torch.Tensor | None
    num_tiles: int


@dataclass
class StaticDecodeBuffers:
    """Device buffers a captured decode step reads; refilled (not reallocated) before each replay."""

    slot_mapping: torch.Tensor  # [max_batch] int64
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    seq_lens: torch.Tensor  # [max_batch] int32

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> StaticDecodeBuffers:
        return cls(torch.full((max_batch,), -1, dtype=torch.int64, device=device),
                   torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device),
                   torch.zeros((max_batch,), dtype=torch.int32, device=device))

    def fill(self, step: StepAttentionInputs, batch: int) -> None:
        """Copy a decode-only step in; rows past its sequences up to `batch` become padding."""
        num = step.num_decodes
        slots = np.full(batch, -1, dtype=np.int64)
        slots[:num] = step.slot_mapping
        lens = np.zeros(batch, dtype=np.int32)
        lens[:num] = step.seq_lens
        width = step.block_tables.shape[1]
        tables = np.zeros((batch, width), dtype=np.int32)
        tables[:num] = step.block_tables
        device = self.slot_mapping.device
        self.slot_mapping[:batch].copy_(to_device(slots, device), non_blocking=True)
        self.seq_lens[:batch].copy_(to_device(lens, device), non_blocking=True)
        self.block_tables[:batch, :width].copy_(to_device(tables, device), non_blocking=True)


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, shape: AttentionShape, device: torch.device) -> None:
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(f"num_heads={shape.num_heads} is not a multiple of num_kv_heads={shape.num_kv_heads}")
        self.shape = shape
        self.device = device
        self.group_pad = max(16, triton.next_power_of_2(shape.group))
        self.dim_pad = max(16, triton.next_power_of_2(shape.head_dim))
        self.block_q = max(1, PREFILL_BLOCK_M // shape.group)
        self.prefill_block_m = max(PREFILL_BLOCK_M, triton.next_power_of_2(shape.group))
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8

    # ---- metadata ---------------------------------------------------------------------------------

    def build_metadata(self, step: StepAttentionInputs) -> TritonMetadata:
        nd = step.num_decodes
        dev = self.device
        decode_tables = decode_lens = None
        num_splits = 1
        if nd:
            decode_tables = to_device(self._table_width(step.block_tables[:nd], step.seq_lens[:nd]), dev)
            decode_lens = to_device(step.seq_lens[:nd].astype(np.int32), dev)
            num_splits = self.decode_splits(nd, int(step.seq_lens[:nd].max()))
        prefill_tables = prefill_lens = query_starts = tile_seqs = tile_first = None
        num_tiles = 0
        query_lens = step.query_lens[nd:]
        if len(query_lens):
            seq_lens = step.seq_lens[nd:]
            prefill_tables = to_device(self._table_width(step.block_tables[nd:], seq_lens), dev)
            prefill_lens = to_device(seq_lens.astype(np.int32), dev)
            query_starts = to_device(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32), dev)
            tiles_per_seq = -(-query_lens // self.block_q)
            seqs = np.repeat(np.arange(len(query_lens), dtype=np.int32), tiles_per_seq)
            tile_starts = np.cumsum(tiles_per_seq) - tiles_per_seq
            first = (np.arange(len(seqs)) - np.repeat(tile_starts, tiles_per_seq)) * self.block_q
            tile_seqs, tile_first = to_device(seqs, dev), to_device(first.astype(np.int32), dev)
            num_tiles = len(seqs)
        return TritonMetadata(self, to_device(step.slot_mapping.astype(np.int64), dev), nd,
                              int(query_lens.sum()), decode_tables, decode_lens, num_splits, prefill_tables,
                              prefill_lens, query_starts, tile_seqs, tile_first, num_tiles)

    def static_decode_metadata(self, buffers: StaticDecodeBuffers, batch: int, max_model_len: int) -> TritonMetadata:
        """Metadata over the first `batch` rows of static buffers, for capture and replay in a CUDA graph."""
        return TritonMetadata(self, buffers.slot_mapping[:batch], batch, 0, buffers.block_tables[:batch],
                              buffers.seq_lens[:batch], self.decode_splits(batch, max_model_len),
                              None, None, None, None, None, 0)

    def decode_splits(self, num_decodes: int, max_seq_len: int) -> int:
        """Split-K for decode: enough programs to fill the GPU, each split still long enough to pay."""
        programs = num_decodes * self.shape.num_kv_heads
        wanted = -(-DECODE_PROGRAMS_PER_SM * self.num_sms // programs)
        by_length = max(1, max_seq_len // DECODE_MIN_KEYS_PER_SPLIT)
        splits = max(1, min(wanted, by_length, DECODE_MAX_SPLITS))
        return 1 << (splits.bit_length() - 1)  # a power of two: the reduce kernel's tl.arange needs one

    def _table_width(self, tables: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        width = max(1, -(-int(seq_lens.max()) // self.shape.block_size))
        return np.ascontiguousarray(tables[:, :width]).astype(np.int32)

    # ---- kernels ----------------------------------------------------------------------------------

    def _cache_args(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[list, dict]:
        """The kernels' cache arguments: (k, v, k scales, v scales, strides of a block, a head and a position, of
        a block's and a head's scales, where a run's scales start) and the QUANT constant."""
        _check_cache(k_cache, v_cache)
        kv_format = self.shape.quantized_cache
        if kv_format is None:
            strides = [k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)]
            return [k_cache, v_cache, k_cache, v_cache, *strides, 0, 0, 0], {}
        # Scales as int16: a (block, head) run's byte strides halve, and its scales follow its codes.
        scale_offset = self.shape.block_size * self.shape.head_dim // 2
        args = [k_cache, v_cache, k_cache.view(torch.int16), v_cache.view(torch.int16), k_cache.stride(0),
                k_cache.stride(1), self.shape.head_dim, k_cache.stride(0) // 2, k_cache.stride(1) // 2, scale_offset]
        return args, {"QUANT": kv_format.code}

    def write_kv(self, k, v, k_cache, v_cache, meta: TritonMetadata) -> None:
        num_tokens = meta.slot_mapping.shape[0]
        if num_tokens == 0:
            return
        shape = self.shape
        cache_args, quant = self._cache_args(k_cache, v_cache)
        if quant:
            quant["MAX"] = shape.kv_format.max_value
        k_cache, v_cache, k_scales, v_scales, *strides = cache_args
        kernels.write_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, k_scales, v_scales, meta.slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), *strides,
            NUM_KV_HEADS=shape.num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(shape.num_kv_heads),
            HEAD_DIM=shape.head_dim, DIM_PAD=self.dim_pad, BLOCK_SIZE=shape.block_size, **quant,
        )

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonMetadata, scale: float,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (strided views are fine, the last dim contiguous); sinks: None, or
        [H] float32 logits each head's softmax denominator also holds."""
        for t in (q, k, v):
            if t.stride(-1) != 1:
                raise ValueError("attention inputs need a contiguous last dimension")
        self.write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decode_tokens
        window = sliding_window or kernels.NO_WINDOW
        sink_args = self._sink_args(sinks, q.device)
        if nd:
            self.decode(out[:nd], q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                        meta.num_splits, scale, window, sink_args)
        if meta.num_tiles:
            self.prefill(out[nd:], q[nd:], k_cache, v_cache, meta, scale, window, sink_args)
        return out

    def _sink_args(self, sinks: torch.Tensor | None, device: torch.device) -> dict:
        """The kernels' sink arguments: none (SINKS off, nothing compiled for it), or the float32 logits."""
        if sinks is None:
            return {}
        if sinks.shape != (self.shape.num_heads,) or sinks.device != device:
            raise ValueError(f"sinks is {sinks.device} {tuple(sinks.shape)}; the kernels take one logit per query "
                             f"head, [{self.shape.num_heads}] on {device}")
        return {"sinks_ptr": sinks.to(torch.float32).contiguous(), "SINKS": True}

    def decode(self, out, q, k_cache, v_cache, block_tables, seq_lens, num_splits: int, scale: float,
               window: int = kernels.NO_WINDOW, sink_args: dict | None = None) -> None:
        shape = self.shape
        num_seqs = q.shape[0]
        ieee = q.dtype == torch.float32
        common = dict(HEAD_DIM=shape.head_dim, DIM_PAD=self.dim_pad)
        if num_splits == 1:
            partial_out = partial_max = partial_sum = out  # unused by the kernel
        else:
            partial_out = torch.empty((num_seqs, shape.num_heads, num_splits, self.dim_pad), dtype=torch.float32,
                                      device=q.device)
            partial_max = torch.empty((num_seqs, shape.num_heads, num_splits), dtype=torch.float32, device=q.device)
            partial_sum = torch.empty_like(partial_max)
        cache_args, quant = self._cache_args(k_cache, v_cache)
        caches, strides = cache_args[:4], cache_args[4:]
        kernels.paged_decode_kernel[(num_seqs, shape.num_kv_heads, num_splits)](
            out, partial_out, partial_max, partial_sum, q, *caches, block_tables, seq_lens, scale, window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), *strides,
            GROUP=shape.group, GROUP_PAD=self.group_pad, BLOCK_SIZE=shape.block_size, TILE_N=DECODE_TILE_N,
            NUM_SPLITS=num_splits, IEEE=ieee, num_warps=DECODE_NUM_WARPS, **common, **quant, **(sink_args or {}),
        )
        if num_splits > 1:
            kernels.reduce_splits_kernel[(num_seqs, shape.num_heads)](
                out, partial_out, partial_max, partial_sum, out.stride(0), out.stride(1),
                NUM_SPLITS=num_splits, **common, **(sink_args or {}),
            )

    def prefill(self, out, q, k_cache, v_cache, meta: TritonMetadata, scale: float,
                window: int = kernels.NO_WINDOW, sink_args: dict | None = None) -> None:
        shape = self.shape
        cache_args, quant = self._cache_args(k_cache, v_cache)
        caches, strides = cache_args[:4], cache_args[4:]
        kernels.paged_prefill_kernel[(meta.num_tiles, shape.num_kv_heads)](
            out, q, *caches, meta.prefill_block_tables, meta.prefill_seq_lens, meta.prefill_query_starts,
            meta.tile_seqs, meta.tile_first_queries, scale, window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.prefill_block_tables.stride(0), *strides,
            GROUP=shape.group, BLOCK_Q=self.block_q, BLOCK_M=self.prefill_block_m, HEAD_DIM=shape.head_dim,
            DIM_PAD=self.dim_pad, BLOCK_SIZE=shape.block_size, TILE_N=PREFILL_TILE_N, IEEE=q.dtype == torch.float32,
            **quant, **(sink_args or {}),
        )


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"K and V caches need one layout with contiguous rows, got strides {k_cache.stride()} "
                         f"and {v_cache.stride()}")
