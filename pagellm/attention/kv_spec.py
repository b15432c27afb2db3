"""The KV cache's format: the one object that sizes the pool, lays it out, and tells the K/V writers and every
attention kernel (torch, C, Triton) how to read it.

`kv_cache_dtype` names it as vLLM does. "auto" keeps K/V in the model's dtype; "bfloat16" and "float16" keep them
in that dtype whatever the model's (a float32 model's K/V rounded to bfloat16 as they are written: half the bytes,
and the attention arithmetic stays the model's, on values widened from the cache). The 8-bit formats store one byte
per value and, beside each row of head_dim values (one token's keys or values of one KV head), that row's scale
in bfloat16:

    scale = bfloat16(max |x| / MAX)     codes = round(x / scale), saturated to +-MAX     x ~ code * scale

with MAX the format's largest value (448 for fp8 e4m3, 57344 for e5m2, 127 for int8) and round-to-nearest-even
into the format. The scale is computed when the row is written, from the row alone: K/V of unknown range never
overflow, the row's largest value is stored to within bfloat16's rounding of its scale, and a row's bytes depend
on nothing else, so chunked prefill, preemption and recomputation, prefix caching and forks write identical
bytes for identical K/V. (vLLM's "fp8" uses one scale per tensor, 1.0 unless a checkpoint gives one: values past
448 saturate and small ones fall into e4m3's subnormals. A bfloat16 scale, rather than a power of two, stores the
row's largest value as MAX times the scale, to within the scale's rounding, where a power of two would leave it
e4m3's full rounding error. README "KV cache dtype" has the measured density, speed and perplexity.)

Layout: a layer's K (or V) cache is one run of bytes per (block, KV head): the block_size rows of head_dim codes,
then their block_size bfloat16 scales,

    cache[block, head] = codes[block_size][head_dim] (1 byte each) | scales[block_size] (2 bytes each)

so a block stays one slice of the pool (block copies, prefaulting and the free list see blocks as before), the
codes keep the alignment of a float run, and a decode reads each run front to back. With "auto" a run is
[block_size][head_dim] values of the model's dtype, as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagellm.config import KV_CACHE_DTYPES

GiB = 1024**3

# The kernels' format codes (csrc/vec.h KV_*): how one cache element is read.
_UNQUANTIZED_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# name -> (stored type of the codes, their largest magnitude, kernel code)
_QUANTIZED = {
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0, 3),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0, 4),
    "int8": (torch.int8, 127.0, 5),
}
# Unquantized formats named for their dtype (vLLM's names), whatever the model's.
_NAMED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# vLLM's names for them; "fp8" is e4m3, as on NVIDIA GPUs.
_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "fp8_per_token_head": "fp8_e4m3",
            "int8_per_token_head": "int8"}
SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2


@dataclass(frozen=True)
class KVCacheFormat:
    """How one value of the cache is stored: `name` is its dtype ("bfloat16", ...) for an unquantized cache (the
    model's, or the one kv_cache_dtype names), or "fp8_e4m3", "fp8_e5m2", "int8" for a cache of codes with a
    bfloat16 scale per row."""

    name: str
    value_dtype: torch.dtype  # of the values, or of the codes
    code: int  # the kernels' KV_* code
    max_value: float = 0.0  # the codes' largest magnitude (quantized formats)

    @classmethod
    def resolve(cls, cache_dtype: str, model_dtype: torch.dtype) -> KVCacheFormat:
        """The format `kv_cache_dtype=cache_dtype` gives a model computing in `model_dtype`."""
        if cache_dtype == "auto" or cache_dtype in _NAMED_DTYPES:
            dtype = _NAMED_DTYPES.get(cache_dtype, model_dtype)
            return cls(str(dtype).removeprefix("torch."), dtype, _UNQUANTIZED_CODES.get(dtype, -1))
        if cache_dtype not in _ALIASES:
            raise ValueError(f"kv_cache_dtype={cache_dtype!r} is not supported; use one of "
                             f"{', '.join(KV_CACHE_DTYPES)}.")
        name = _ALIASES[cache_dtype]
        value_dtype, max_value, code = _QUANTIZED[name]
        return cls(name, value_dtype, code, max_value)

    @property
    def quantized(self) -> bool:
        return self.max_value > 0

    @property
    def storage_dtype(self) -> torch.dtype:
        """The pool tensor's dtype: bytes for a quantized cache (codes and scales share its runs)."""
        return torch.uint8 if self.quantized else self.value_dtype

    def run_bytes(self, block_size: int, head_dim: int) -> int:
        """Bytes of one (block, KV head) run."""
        if self.quantized:
            return block_size * (head_dim + SCALE_BYTES)
        return block_size * head_dim * self.value_dtype.itemsize

    def run_shape(self, block_size: int, head_dim: int) -> tuple[int, ...]:
        """The trailing dimensions of a layer's cache: [block_size, head_dim] values, or a run of bytes."""
        return (self.run_bytes(block_size, head_dim),) if self.quantized else (block_size, head_dim)

    # ---- the reference quantizer, which the C and Triton writers equal byte for byte ----------------

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x [..., head_dim] -> (codes [..., head_dim] uint8, scales [...] bfloat16)."""
        x = x.float()
        scale = (x.abs().amax(-1) / self.max_value).to(SCALE_DTYPE)
        divisor = scale.float()[..., None]
        # A row of zeros has scale 0: its codes are 0.
        y = torch.where(divisor > 0, x / divisor, 0.0).clamp(-self.max_value, self.max_value)
        codes = y.round().to(torch.int8) if self.value_dtype == torch.int8 else y.to(self.value_dtype)
        return codes.view(torch.uint8), scale

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """float32 values of codes [..., head_dim] (uint8) with scales [...] (bfloat16)."""
        return codes.view(self.value_dtype).float() * scales.float()[..., None]

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x as the cache gives it back, in float32."""
        return self.dequantize(*self.quantize(x))

    # ---- views of one layer's cache [num_blocks, kv_heads, run bytes] (quantized formats) -----------

    def split(self, cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [num_blocks, kv_heads, block_size, head_dim] uint8, scales [num_blocks, kv_heads, block_size]
        bfloat16): views of a layer's quantized cache."""
        blocks, heads, run = cache.shape
        block_size = run // (head_dim + SCALE_BYTES)
        codes = cache.as_strided((blocks, heads, block_size, head_dim), (*cache.stride()[:2], head_dim, 1),
                                 cache.storage_offset())
        scales = cache.view(SCALE_DTYPE)[:, :, block_size * head_dim // SCALE_BYTES:]
        return codes, scales

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """A layer's quantized cache [num_blocks, kv_heads, run bytes] holding values [num_blocks, kv_heads,
        block_size, head_dim], as the writers would have written them row by row."""
        blocks, heads, block_size, head_dim = values.shape
        cache = torch.empty(blocks, heads, self.run_bytes(block_size, head_dim), dtype=torch.uint8,
                            device=values.device)
        codes, scales = self.split(cache, head_dim)
        codes[...], scales[...] = self.quantize(values)
        return cache


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV pool of one rank: its layers, heads, head size, block size and format. Every reader of the cache
    (the pool's sizing and allocation, the K/V writers, the attention backends and kernels) takes the layout
    from here."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's: what K/V arrive in
    cache_dtype: str = "auto"
    # Multi-head latent attention (DeepSeek-V2/V3): one plane per layer whose single "head" row per token is the
    # normalised latent and the rotated rope key (head_dim = kv_lora_rank + qk_rope_head_dim); no V plane.
    latent: bool = False

    @property
    def planes(self) -> int:
        """Cache planes per layer: K and V, or the latent alone."""
        return 1 if self.latent else 2

    @functools.cached_property
    def format(self) -> KVCacheFormat:
        return KVCacheFormat.resolve(self.cache_dtype, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.planes * self.num_layers * self.num_kv_heads * self.format.run_bytes(self.block_size, self.head_dim)

    @property
    def tokens_per_gib(self) -> float:
        return GiB / self.bytes_per_block * self.block_size

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[num_layers, planes (K, V; or the latent), num_blocks, kv_heads, *run_shape]."""
        return (self.num_layers, self.planes, num_blocks, self.num_kv_heads,
                *self.format.run_shape(self.block_size, self.head_dim))

    def describe(self) -> str:
        """The format and its density, for the start-up log."""
        kind = f"{self.format.name} with a bfloat16 scale per token and head" if self.format.quantized \
            else self.format.name
        layout = f", MLA latent of {self.head_dim} values per token and layer" if self.latent else ""
        return (f"KV dtype {kind} (kv_cache_dtype={self.cache_dtype}){layout}, {self.tokens_per_gib:,.0f} tokens "
                f"per GiB")


def mla_latent_dim(config) -> int | None:
    """kv_lora_rank + qk_rope_head_dim of a multi-head latent attention model (DeepSeek-V2/V3), whose cache holds
    that one row per token and layer; None for a model with ordinary K/V heads."""
    rank = getattr(config, "kv_lora_rank", None)
    return rank + config.qk_rope_head_dim if rank else None


def kv_cache_spec_for(config, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                      cache_dtype: str) -> KVCacheSpec:
    """The pool of a model: its K/V heads of `head_dim`, or an MLA model's one latent row per token."""
    latent_dim = mla_latent_dim(config)
    if latent_dim is not None:
        return KVCacheSpec(config.num_hidden_layers, 1, latent_dim, block_size, dtype, cache_dtype, latent=True)
    return KVCacheSpec(config.num_hidden_layers, num_kv_heads, head_dim, block_size, dtype, cache_dtype)
