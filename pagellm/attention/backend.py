"""The attention-backend seam: what the model runner hands every backend, and how one is chosen.

A step's attention inputs are host (numpy) arrays, built once per step by the runner
(`StepAttentionInputs`). A backend turns them into its own metadata once per step (`build_metadata`),
and every layer calls `forward(q, k, v, k_cache, v_cache, metadata, scale, sliding_window, sinks)`, which writes
the step's K/V into the pool by slot mapping and attends. The metadata carries its backend, so the model calls
one function (`paged.paged_attention`) whatever backend built it.

Backends:
- `TorchAttentionBackend` (paged.py): torch ops; the reference every other backend is tested against.
  With a native `DecodeKernel` it is the CPU fast path (decodes through the C kernel).
- `TritonAttentionBackend` (triton_backend.py): paged decode (split-K, GQA) and paged prefill kernels.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pagellm.attention.kv_spec import KVCacheFormat
from pagellm.cpu_features import cpu_has_amx_bf16

if TYPE_CHECKING:
    from pagellm.attention.native import PrefillKernel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    # The KV cache's format, from the pool's KVCacheSpec (kv_spec.py); None: the model's dtype, unquantized.
    kv_format: KVCacheFormat | None = None
    # > 0: multi-head latent attention, whose one cache "head" per token is kv_lora_rank latent values then the
    # rope key (head_dim = kv_lora_rank + qk_rope_head_dim); attention/mla.py serves it.
    kv_lora_rank: int = 0

    @property
    def quantized_cache(self) -> KVCacheFormat | None:
        """The cache's format where it is quantized, else None."""
        return self.kv_format if self.kv_format is not None and self.kv_format.quantized else None

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass
class StepAttentionInputs:
    """One step's attention inputs on the host. Sequences are ordered decodes first (one query each),
    then prefill chunks; tokens are flattened in that order."""

    num_decodes: int
    query_lens: np.ndarray  # [num_seqs] int64
    seq_lens: np.ndarray  # [num_seqs] int64: tokens in the cache once this step's are written
    block_tables: np.ndarray  # [num_seqs, max_blocks] int64, covering seq_lens
    slot_mapping: np.ndarray  # [num_tokens] int64: block * block_size + offset of each token

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)


class AttentionBackend(Protocol):
    name: str
    # Whether a decode-only step's metadata can live in static buffers and be replayed in a CUDA graph.
    supports_cuda_graphs: bool

    def build_metadata(self, step: StepAttentionInputs): ...

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata, scale: float, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """With `sliding_window`, the query at position p attends to keys in (p - sliding_window, p]; block-table
        entries wholly before that may be holes and are never read. With `sinks` ([num_heads] float32, gpt-oss's
        attention sinks), head h's softmax denominator also holds e^sinks[h], which carries no value."""


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Overrides the choice: "torch" (the reference, on any device), "triton" (also on CPU under TRITON_INTERPRET=1,
# for tests), or "native" (CPU). For tests and benchmarks; unset, the device decides.
BACKEND_ENV = "PAGELLM_ATTENTION_BACKEND"


def sdpa_prefill_is_faster(dtype: torch.dtype, cache_format: KVCacheFormat, prefill: PrefillKernel) -> bool:
    """Whether torch's SDPA (the torch path's prefill attention) beats the native prefill kernel here: for
    bfloat16 on CPUs with AMX tiles where the kernel cannot take them (a build without them, or an OS that does
    not grant them), since oneDNN's attention runs on the tiles and the kernel's VDPBF16PS loops measured several
    times slower. On the tiles the kernel keeps up with SDPA and reads a chunk's cached context in place (README,
    "On a CPU with AMX", for the figures). Quantized caches stay native: the torch path would dequantize them per
    step."""
    return dtype is torch.bfloat16 and not cache_format.quantized and cpu_has_amx_bf16() and not prefill.amx


def select_backend(device: torch.device, dtype: torch.dtype, shape: AttentionShape) -> AttentionBackend:
    """Triton on CUDA (torch if triton is missing); on CPU torch ops with the native decode and prefill
    kernels where they serve the dtype, the cache's format and the head size, and the native K/V write.
    `dtype` is the model's (the queries')."""
    from pagellm.attention.paged import TorchAttentionBackend

    forced = os.environ.get(BACKEND_ENV, "")
    if forced not in ("", "torch", "triton", "native"):
        raise ValueError(f"{BACKEND_ENV}={forced!r} is not a backend; use torch, triton or native (or unset it)")
    if shape.kv_lora_rank:
        from pagellm.attention.mla import select_mla_backend

        return select_mla_backend(device, dtype, shape)
    if forced == "torch":
        return TorchAttentionBackend(shape, device, None)
    if forced == "native" and device.type != "cpu":
        raise ValueError(f"{BACKEND_ENV}=native runs on the CPU only; this engine runs on {device}")
    if forced == "triton" or (device.type == "cuda" and not forced):
        if triton_available():
            from pagellm.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend(shape, device)
        logger.warning("triton is not importable: CUDA attention runs on the torch reference path (slow)")
        return TorchAttentionBackend(shape, device, None)
    from pagellm.attention.native import (
        DecodeKernel,
        KVWriter,
        PrefillKernel,
        decode_kernel,
        kernels_read,
        kv_writer,
        prefill_kernel,
    )

    native = prefill = None
    cache_format = shape.kv_format or KVCacheFormat.resolve("auto", dtype)
    if dtype in DecodeKernel.CACHE_DTYPES and kernels_read(cache_format) and DecodeKernel.supports(shape.head_dim):
        native = decode_kernel()
    if dtype in PrefillKernel.DTYPES and kernels_read(cache_format) and PrefillKernel.supports(shape.head_dim):
        prefill = prefill_kernel()
        if prefill is not None and sdpa_prefill_is_faster(dtype, cache_format, prefill):
            prefill = None
    writer = kv_writer() if KVWriter.writes(cache_format, dtype) else None
    return TorchAttentionBackend(shape, device, native, writer, prefill)
