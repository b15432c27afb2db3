"""The latent decode kernels of multi-head latent attention (attention/mla.py): the C kernel on every
instruction set this CPU runs, the Triton kernel under TRITON_INTERPRET=1 and the torch reference, each with
W_UK absorbed into the query and W_UV applied to its output, against a float64 reference of the expanded
attention (per head keys [c W_UK^T | k_pe] and values c W_UV^T) over the same paged rows: for quantized caches
(fp8 e4m3, fp8 e5m2, int8 codes with a bfloat16 scale per row), the rows as the format gives them back.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagellm.attention.kv_spec import KVCacheFormat  # noqa: E402
from pagellm.attention.mla import mla_decode_kernel, torch_latent_decode, write_latent  # noqa: E402
from pagellm.attention.paged import DecodeMetadata, kv_write_index  # noqa: E402
from pagellm.ops.cpu_build import runnable_isas  # noqa: E402
from tests.helpers import built_or_skip

NOPE, V = 24, 20


def _case(seed: int, heads: int, rank: int, rope: int, lens: list[int], block_size: int, cache_dtype: torch.dtype,
          kv_format: KVCacheFormat | None = None):
    """Random latents written into a shuffled paged cache (of cache_dtype, or quantized to `kv_format` from
    float32), per-head queries and the absorbed weights."""
    generator = torch.Generator().manual_seed(seed)
    width = rank + rope
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).numpy()
    tables = np.zeros((len(lens), max(blocks_per_seq)), dtype=np.int64)
    if kv_format is not None:
        cache = torch.zeros(num_blocks, 1, kv_format.run_bytes(block_size, width), dtype=torch.uint8)
    else:
        cache = torch.zeros(num_blocks, 1, block_size, width, dtype=cache_dtype)
    rows, used = [], 0
    for i, n in enumerate(lens):
        tables[i, : blocks_per_seq[i]] = order[used: used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        latent = torch.randn(n, width, generator=generator, dtype=torch.float64)
        positions = np.arange(n)
        index = torch.from_numpy(kv_write_index(tables[i][positions // block_size], positions % block_size, 1,
                                                block_size))
        write_latent(latent.to(cache_dtype), cache, index, kv_format)
        # what the cache holds
        held = kv_format.round_trip(latent.to(cache_dtype)) if kv_format is not None else latent.to(cache_dtype)
        rows.append(held.double())
    w_uk = torch.randn(heads, NOPE, rank, generator=generator, dtype=torch.float64) / rank**0.5
    w_uv = torch.randn(heads, V, rank, generator=generator, dtype=torch.float64) / rank**0.5
    q_nope = torch.randn(len(lens), heads, NOPE, generator=generator, dtype=torch.float64)
    q_pe = torch.randn(len(lens), heads, rope, generator=generator, dtype=torch.float64)
    decode = DecodeMetadata(tables, np.array(lens, dtype=np.int64), torch.from_numpy(tables))
    return cache, rows, w_uk, w_uv, q_nope, q_pe, decode


def _expanded_reference(rows, w_uk, w_uv, q_nope, q_pe, rank: int, scale: float) -> torch.Tensor:
    """[num_seqs, heads, V] in float64: ordinary attention over per-head keys and values expanded from the rows."""
    outs = []
    for i, latent in enumerate(rows):
        c, k_pe = latent[:, :rank], latent[:, rank:]
        k = torch.cat((torch.einsum("jr,hdr->hjd", c, w_uk), k_pe.expand(w_uk.shape[0], *k_pe.shape)), dim=-1)
        v = torch.einsum("jr,hvr->hjv", c, w_uv)
        q = torch.cat((q_nope[i], q_pe[i]), dim=-1)  # [heads, NOPE + rope]
        p = torch.softmax(scale * torch.einsum("hd,hjd->hj", q, k), dim=-1)
        outs.append(torch.einsum("hj,hjv->hv", p, v))
    return torch.stack(outs)


def _absorbed(decode_fn, q_nope, q_pe, w_uk, w_uv, dtype) -> torch.Tensor:
    q = torch.cat((torch.einsum("nhd,hdr->nhr", q_nope, w_uk), q_pe), dim=-1).to(dtype)
    out_latent = decode_fn(q)
    assert out_latent.dtype == dtype
    return torch.einsum("nhr,hvr->nhv", out_latent.double(), w_uv)


# (heads, rank, rope, lens, block size): two head tiles and vector tails (width 46, rank 36), single-token and
# block-boundary contexts.
SHAPES = [
    (4, 64, 16, [1, 13, 40], 8),
    (20, 36, 10, [16, 1, 33, 7], 16),
]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("shape", SHAPES)
def test_c_kernel_matches_expanded_attention(isa, q_dtype, cache_dtype, shape):
    kernel = built_or_skip(mla_decode_kernel(isa), "mla_decode_kernel(isa)")
    assert kernel.isa == isa
    heads, rank, rope, lens, block_size = shape
    cache, rows, w_uk, w_uv, q_nope, q_pe, decode = _case(0, heads, rank, rope, lens, block_size, cache_dtype)
    scale = (NOPE + rope) ** -0.5
    ours = _absorbed(lambda q: kernel(q, cache, decode, scale, rank), q_nope, q_pe, w_uk, w_uv, q_dtype)
    reference = _expanded_reference(rows, w_uk, w_uv, q_nope, q_pe, rank, scale)
    torch.testing.assert_close(ours, reference, atol=TOLERANCE[q_dtype], rtol=TOLERANCE[q_dtype])


@pytest.mark.parametrize("shape", SHAPES)
def test_torch_reference_matches_expanded_attention(shape):
    heads, rank, rope, lens, block_size = shape
    cache, rows, w_uk, w_uv, q_nope, q_pe, decode = _case(1, heads, rank, rope, lens, block_size, torch.float32)
    scale = (NOPE + rope) ** -0.5
    ours = _absorbed(lambda q: torch_latent_decode(q, cache, decode, scale, rank), q_nope, q_pe, w_uk, w_uv,
                     torch.float32)
    reference = _expanded_reference(rows, w_uk, w_uv, q_nope, q_pe, rank, scale)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=2e-5)


# bfloat16 queries are for the GPU only: the interpreter mishandles bfloat16 products (tests/test_triton_kernels.py);
# a bfloat16 cache read into float32 queries runs under it.
@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                  (torch.float32, torch.bfloat16)])
def test_triton_kernel_matches_expanded_attention(q_dtype, cache_dtype):
    pytest.importorskip("triton")
    from pagellm.attention.mla_triton import triton_latent_decode

    heads, rank, rope, lens, block_size = SHAPES[1]
    cache, rows, w_uk, w_uv, q_nope, q_pe, decode = _case(2, heads, rank, rope, lens, block_size, cache_dtype)
    scale = (NOPE + rope) ** -0.5
    ours = _absorbed(lambda q: triton_latent_decode(q, cache, decode, scale, rank), q_nope, q_pe, w_uk, w_uv,
                     q_dtype)
    reference = _expanded_reference(rows, w_uk, w_uv, q_nope, q_pe, rank, scale)
    tolerance = max(TOLERANCE[q_dtype], TOLERANCE[cache_dtype] if cache_dtype != torch.bfloat16 else 2e-5)
    torch.testing.assert_close(ours, reference, atol=tolerance, rtol=tolerance)


def test_quantized_latent_cache_reads_back_its_round_trip():
    """An fp8 latent cache (codes and a bfloat16 scale per row): the torch decode over it equals the decode over
    an unquantized cache holding the rows as the format gives them back."""
    from pagellm.attention.kv_spec import KVCacheFormat

    kv_format = KVCacheFormat.resolve("fp8", torch.float32)
    heads, rank, rope, lens, block_size = SHAPES[0]
    width = rank + rope
    cache, rows, *_ , decode = _case(3, heads, rank, rope, lens, block_size, torch.float32)
    quantized = torch.zeros(cache.shape[0], 1, kv_format.run_bytes(block_size, width), dtype=torch.uint8)
    for i, latent in enumerate(rows):
        positions = np.arange(len(latent))
        index = torch.from_numpy(kv_write_index(decode.block_tables[i][positions // block_size],
                                                positions % block_size, 1, block_size))
        write_latent(latent.float(), quantized, index, kv_format)
        write_latent(kv_format.round_trip(latent.float()), cache, index)
    q = torch.randn(len(lens), heads, width, generator=torch.Generator().manual_seed(4))
    ours = torch_latent_decode(q, quantized, decode, 0.2, rank, kv_format, block_size)
    torch.testing.assert_close(ours, torch_latent_decode(q, cache, decode, 0.2, rank), atol=1e-6, rtol=1e-6)


# kv_cache_dtype names of the three quantized formats (fp8_e4m3, fp8_e5m2, int8).
QUANTIZED_FORMATS = ["fp8", "fp8_e5m2", "int8_per_token_head"]


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("format_name", QUANTIZED_FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_c_kernel_reads_quantized_latents(isa, q_dtype, format_name, shape):
    """The C kernel over the codes and scales as stored equals the float64 expanded attention over the
    dequantized rows (to float32 rounding: the dequantization is exact)."""
    kernel = built_or_skip(mla_decode_kernel(isa), "mla_decode_kernel(isa)")
    kv_format = KVCacheFormat.resolve(format_name, torch.float32)
    heads, rank, rope, lens, block_size = shape
    cache, rows, w_uk, w_uv, q_nope, q_pe, decode = _case(5, heads, rank, rope, lens, block_size, torch.float32,
                                                          kv_format)
    scale = (NOPE + rope) ** -0.5
    ours = _absorbed(lambda q: kernel(q, cache, decode, scale, rank, kv_format), q_nope, q_pe, w_uk, w_uv,
                     q_dtype)
    reference = _expanded_reference(rows, w_uk, w_uv, q_nope, q_pe, rank, scale)
    torch.testing.assert_close(ours, reference, atol=TOLERANCE[q_dtype], rtol=TOLERANCE[q_dtype])


def test_c_kernel_refuses_a_quantized_cache_without_its_format():
    kernel = built_or_skip(mla_decode_kernel(), "mla_decode_kernel()")
    kv_format = KVCacheFormat.resolve("int8_per_token_head", torch.float32)
    heads, rank, rope, lens, block_size = SHAPES[0]
    cache, *_, decode = _case(6, heads, rank, rope, lens, block_size, torch.float32, kv_format)
    with pytest.raises(TypeError, match="float32 or bfloat16 caches"):
        kernel(torch.zeros(len(lens), heads, rank + rope), cache, decode, 0.1, rank)


@pytest.mark.parametrize("format_name", QUANTIZED_FORMATS)
def test_triton_kernel_reads_quantized_latents(format_name):
    pytest.importorskip("triton")
    from pagellm.attention.mla_triton import triton_latent_decode

    kv_format = KVCacheFormat.resolve(format_name, torch.float32)
    heads, rank, rope, lens, block_size = 4, 36, 10, [1, 13, 20], 8  # small: the interpreter is slow
    cache, rows, w_uk, w_uv, q_nope, q_pe, decode = _case(7, heads, rank, rope, lens, block_size, torch.float32,
                                                          kv_format)
    scale = (NOPE + rope) ** -0.5
    ours = _absorbed(lambda q: triton_latent_decode(q, cache, decode, scale, rank, kv_format=kv_format), q_nope,
                     q_pe, w_uk, w_uv, torch.float32)
    reference = _expanded_reference(rows, w_uk, w_uv, q_nope, q_pe, rank, scale)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=2e-5)
