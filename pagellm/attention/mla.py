"""Multi-head latent attention (DeepSeek-V2/V3) over the paged cache: the cache side.

An MLA layer caches, per token, one row of `kv_lora_rank + qk_rope_head_dim` values: the normalised latent c
(kv_a_layernorm of the first kv_lora_rank outputs of kv_a_proj_with_mqa) and the rotated rope key k_pe shared
by all heads. The pool holds that row as a single "head" of one plane per layer (kv_spec.KVCacheSpec with
latent=True): no V, no per-head keys. Under tensor parallelism every rank's pool holds the whole row (its heads
all read it).

Attention from that row, with W_UK [heads, qk_nope_head_dim, rank] and W_UV [heads, v_head_dim, rank] the two
halves of kv_b_proj:

- Prefill chunks expand their context's latents through kv_b_proj into per-head keys (k_nope, then k_pe) and
  values, and attend causally as an ordinary attention does (the layer does this: it holds kv_b_proj). A chunk
  with context before it (chunked prefill, a prefix-cache hit, a resumed request) reads that context's latents
  from the cache through its block table.
- Decodes absorb W_UK into the query (q_lat = q_nope W_UK, so q_nope . k_nope = q_lat . c) and attend over the
  cached rows directly: scores q_lat . c + q_pe . k_pe, output sum_j p_j c_j (the rows' first `rank` values),
  which the layer then maps through W_UV. Per decode this reads rank + rope values per cached token, once for
  all heads: multi-query attention with head size rank + rope and value size rank.

The latent decode runs on the C kernel (csrc/mla_decode.c, CPU), the Triton kernel (mla_triton.py, CUDA) or the
torch reference below; `MLABackend` picks one per device and builds a step's metadata on the torch backend's (its
write index, decode tables and prefill chunks). The C and Triton kernels read float32 and bfloat16 caches and the
quantized ones (fp8 e4m3, fp8 e5m2, int8: kv_spec.py) as they are stored, widening each row's codes in registers
and folding its scale into the row's score and softmax weight; the torch reference gathers and dequantizes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import BACKEND_ENV, AttentionShape, StepAttentionInputs, triton_available
from pagellm.attention.kv_spec import KVCacheFormat
from pagellm.attention.paged import (
    AttentionMetadata,
    DecodeMetadata,
    PrefillChunk,
    TorchAttentionBackend,
    chunk_mask,
    decode_mask,
    gather_kv,
    sdpa_attend,
    to_device,
)

# (q [num_decodes, heads, rank + rope], cache, decode metadata, scale, rank) -> [num_decodes, heads, rank]
LatentDecode = Callable[[torch.Tensor, torch.Tensor, DecodeMetadata, float, int], torch.Tensor]


@dataclass
class MLAMetadata:
    """One step's metadata for MLA layers: the torch backend's (built without native kernels) and the latent
    decode kernel the backend chose (None: the torch reference)."""

    step: AttentionMetadata
    latent_decode: LatentDecode | None = None


def write_latent(latent: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                 kv_format: KVCacheFormat | None = None) -> None:
    """latent [tokens, rank + rope] into a layer's latent cache [num_blocks, 1, block_size, rank + rope] (or
    its quantized runs) at cache rows `rows` (paged.kv_write_index with one KV head)."""
    width = latent.shape[-1]
    if kv_format is not None and kv_format.quantized:
        codes, scales = kv_format.split(cache, width)
        blocks, heads, block_size, _ = codes.shape
        new_codes, new_scales = kv_format.quantize(latent)
        runs, offsets = rows // block_size, rows % block_size
        codes.view(blocks * heads, block_size, width)[runs, offsets] = new_codes
        scales.view(blocks * heads, block_size)[runs, offsets] = new_scales
        return
    cache.view(-1, width).index_copy_(0, rows, latent.to(cache.dtype))


def read_latents(cache: torch.Tensor, block_table: torch.Tensor, count: int, width: int,
                 kv_format: KVCacheFormat | None = None) -> torch.Tensor:
    """The first `count` cached rows [count, rank + rope] of one sequence (dequantized to float32 from a
    quantized cache)."""
    return gather_kv(cache, block_table[None], kv_format, width)[0, 0, :count]


def torch_latent_decode(q: torch.Tensor, cache: torch.Tensor, decode: DecodeMetadata, scale: float, rank: int,
                        kv_format: KVCacheFormat | None = None, block_size: int = 0) -> torch.Tensor:
    """The reference latent decode: q [num_decodes, heads, rank + rope] -> [num_decodes, heads, rank], in
    float32 (two batched products over the gathered rows, which every head shares)."""
    width = q.shape[-1]
    block_size = block_size or cache.shape[2]
    latents = gather_kv(cache, decode.block_tables_tensor, kv_format, width)[:, 0].float()  # [decodes, keys, width]
    scores = torch.bmm(q.float(), latents.transpose(1, 2)) * scale  # [decodes, heads, keys]
    scores = scores.masked_fill(~decode_mask(decode, block_size)[:, 0], float("-inf"))
    return torch.bmm(scores.softmax(dim=-1), latents[..., :rank]).to(q.dtype)


def chunk_context(chunk: PrefillChunk, own: torch.Tensor, cache: torch.Tensor,
                  kv_format: KVCacheFormat | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(latent rows the chunk attends to, its causal mask or None when plain causal over its own rows): a chunk
    that starts its sequence attends to its own rows `own` (as the cache gives them back), one with context
    before it reads the whole context from the cache."""
    if chunk.block_table is None:
        if kv_format is not None and kv_format.quantized:
            return kv_format.round_trip(own), None
        return own.to(cache.dtype), None  # rounded where the cache has a dtype of its own
    latents = read_latents(cache, chunk.block_table, chunk.context_len, own.shape[-1], kv_format)
    return latents, chunk_mask(chunk, own.device)


def expanded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """q [queries, heads, qk], k [keys, heads, qk], v [keys, heads, v] -> [queries, heads, v]; causal when mask
    is None (queries and keys then are the same tokens)."""
    out = sdpa_attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale,
                  is_causal=mask is None)
    return out[0].transpose(0, 1)


class MLABackend:
    """Builds MLA layers' step metadata and chooses their latent decode: the C kernel on CPU, Triton on CUDA
    (or where PAGELLM_ATTENTION_BACKEND forces it), else the torch reference."""

    supports_cuda_graphs = False

    def __init__(self, shape: AttentionShape, device: torch.device, latent_decode: LatentDecode | None,
                 name: str) -> None:
        self.shape = shape
        self.device = device
        self.latent_decode = latent_decode
        self.name = name
        self._torch = TorchAttentionBackend(shape, device, None)
        self.kv_format = self._torch.kv_format

    def build_metadata(self, step: StepAttentionInputs) -> MLAMetadata:
        meta = self._torch.build_metadata(step)
        latent_decode = self.latent_decode
        if self.name == "mla-triton" and meta.decode is not None:
            # The decode lengths on the device once per step, not once per layer.
            latent_decode = functools.partial(latent_decode,
                                              seq_lens=to_device(meta.decode.context_lens, self.device))
        return MLAMetadata(meta, latent_decode)


def select_mla_backend(device: torch.device, dtype: torch.dtype, shape: AttentionShape) -> MLABackend:
    """The MLA backend for `shape` (kv_lora_rank > 0); `dtype` is the model's. The kernels read a quantized
    cache's codes and scales directly: they get its format bound to their calls."""
    forced = os.environ.get(BACKEND_ENV, "")
    cache_format = shape.kv_format or KVCacheFormat.resolve("auto", dtype)
    quantized = cache_format if cache_format.quantized else None
    if forced == "torch":
        return MLABackend(shape, device, None, "mla-torch")
    if forced == "triton" or (device.type == "cuda" and not forced):
        if triton_available():
            from pagellm.attention.mla_triton import triton_latent_decode

            return MLABackend(shape, device, functools.partial(triton_latent_decode, kv_format=quantized),
                              "mla-triton")
        return MLABackend(shape, device, None, "mla-torch")
    kernel = mla_decode_kernel() if device.type == "cpu" else None
    if kernel is not None and MLADecodeKernel.reads(dtype, cache_format):
        return MLABackend(shape, device, functools.partial(kernel, kv_format=quantized), "mla-cpu-native")
    return MLABackend(shape, device, None, "mla-torch")


# ---- the C kernel (csrc/mla_decode.c) -------------------------------------------------------------


class MLADecodeKernel:
    """mla_decode_attention: the latent decode from the paged cache, float32 or bfloat16 queries; float32,
    bfloat16 or quantized (fp8 e4m3, fp8 e5m2, int8) caches; float32 arithmetic, one pass over each sequence's
    rows shared by all heads."""

    DTYPES = (torch.float32, torch.bfloat16)
    _I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int

    @classmethod
    def reads(cls, dtype: torch.dtype, cache_format: KVCacheFormat) -> bool:
        """Whether the kernel serves queries of `dtype` over a cache of `cache_format`."""
        return dtype in cls.DTYPES and (cache_format.quantized or cache_format.value_dtype in cls.DTYPES)

    def __init__(self, library: ctypes.CDLL) -> None:
        from pagellm.ops.cpu_build import library_isa

        self.isa = library_isa(library)
        self._function = library.mla_decode_attention
        self._function.restype = self._INT
        self._function.argtypes = [self._PTR, self._PTR, self._INT, self._INT, self._PTR, self._I64, self._PTR,
                                   self._PTR, self._I64, self._I64, self._I64, self._I64, self._I64, self._F32]

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, decode: DecodeMetadata, scale: float,
                 rank: int, kv_format: KVCacheFormat | None = None) -> torch.Tensor:
        """q [num_decodes, heads, width]; cache [num_blocks, 1, block_size, width] float32 or bfloat16, or the
        [num_blocks, 1, run bytes] of a quantized `kv_format` -> [num_decodes, heads, rank] in q's dtype."""
        from pagellm.attention.native import _cache_geometry

        if q.dtype not in self.DTYPES:
            raise TypeError(f"the MLA decode kernel reads float32 or bfloat16 queries, not {q.dtype}")
        q = q.contiguous()
        num_seqs, num_heads, width = q.shape
        format_code, cache_heads, block_size = _cache_geometry(cache, width, kv_format)
        if cache_heads != 1 or not cache.is_contiguous():
            raise TypeError(f"an MLA cache holds one contiguous latent row per token ([blocks, 1, ...]), not "
                            f"{tuple(cache.shape)}")
        if not 0 < rank <= width:
            raise ValueError(f"rank={rank} must lie in (0, {width}] (the latent leads each cached row)")
        tables = np.ascontiguousarray(decode.block_tables, dtype=np.int64)
        lens = np.ascontiguousarray(decode.context_lens, dtype=np.int64)
        out = torch.empty(num_seqs, num_heads, rank, dtype=q.dtype)
        failed = self._function(q.data_ptr(), cache.data_ptr(), int(q.dtype == torch.bfloat16), format_code,
                                tables.ctypes.data, tables.shape[1], lens.ctypes.data, out.data_ptr(), num_seqs,
                                num_heads, width, rank, block_size, scale)
        if failed == 2:
            raise TypeError(f"the MLA decode kernel does not read cache format code {format_code}")
        if failed:
            raise MemoryError("the MLA decode kernel could not allocate its score buffer")
        return out


_CSRC = pathlib.Path(__file__).with_name("csrc")


def mla_library(isa: str | None = None) -> ctypes.CDLL | None:
    """The MLA kernels built for `isa` (default: this CPU's best), or None where the native kernels are off
    (PAGELLM_NATIVE_KERNELS=0) or cannot be built: cpu_build.native_library's rules, asked on every call."""
    from pagellm.ops import cpu_build

    if cpu_build.native_library(isa) is None:
        return None
    return _mla_library(isa or cpu_build.best_isa())


@functools.cache
def _mla_library(isa: str) -> ctypes.CDLL:
    from pagellm.ops import cpu_build

    headers = [*cpu_build.VEC_HEADERS, cpu_build.KV_FORMAT_HEADER]
    path = cpu_build.build_library(f"pagellm_mla_{isa}", [_CSRC / "mla_decode.c"], headers,
                                   cpu_build.compiler_flags(isa))
    return ctypes.CDLL(str(path))


def mla_decode_kernel(isa: str | None = None) -> MLADecodeKernel | None:
    library = mla_library(isa)
    return MLADecodeKernel(library) if library is not None else None
