"""kv_cache_dtype: the KV cache formats (attention/kv_spec.py), from the bytes up to the engine.

- The writers: the C writer (every instruction set this CPU runs), the Triton writer (under TRITON_INTERPRET=1) and
  kv_spec.py's torch reference quantize byte for byte alike, on rows chosen to reach every rounding case (ties,
  subnormals, saturation, signed zeros, zero rows, scales that are themselves bfloat16 subnormals).
- Exact round trips: a row of representable values whose largest magnitude is the format's maximum (times a
  power of two) has an exact bfloat16 scale, so it comes back bit for bit; every code reads back exactly through
  each kernel (a decode or prefill over one key returns that key's value row).
- The kernels (C decode and prefill per ISA, Triton decode and prefill) equal float64 attention over the
  dequantized cache, and the C and Triton step paths equal the torch path on the same quantized pool.
- The pool's density; the engine end to end (prefix caching, preemption, n > 1) against transformers with keys and
  values rounded as the cache stores them; what it logs; the refusal of formats it does not have.
- "bfloat16" / "float16" under a float32 model (a cache of another float dtype than the model's): the torch path
  attends the rounded K/V, the C and Triton step paths equal it, and the engine equals transformers with K/V
  rounded to bfloat16.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # Read when triton.jit decorates a kernel, so before pagellm's Triton kernels are imported (conftest sets it too).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagellm.attention import native  # noqa: E402
from pagellm.attention.backend import AttentionShape, StepAttentionInputs  # noqa: E402
from pagellm.attention.kv_spec import KVCacheFormat, KVCacheSpec  # noqa: E402
from pagellm.attention.paged import TorchAttentionBackend, kv_write_index, paged_attention, write_kv  # noqa: E402
from pagellm.config import KV_CACHE_DTYPES  # noqa: E402
from pagellm.ops import cpu_build  # noqa: E402
from tests.helpers import built_or_skip

ISAS = cpu_build.runnable_isas()
# vLLM's names; the aliases resolve to the same stored format.
NAMES = ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8", "fp8_per_token_head"]
FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head"]
STORED_AS = {"fp8": "fp8_e4m3", "fp8_per_token_head": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
             "int8_per_token_head": "int8"}

needs_triton = pytest.mark.skipif(
    torch.cuda.is_available() or not os.environ.get("TRITON_INTERPRET"),
    reason="the interpreter tests are for machines without CUDA (tests/gpu run the kernels on the GPU)")


def _format(name: str) -> KVCacheFormat:
    return KVCacheFormat.resolve(name, torch.float32)


def _triton_backend(shape: AttentionShape):
    pytest.importorskip("triton", reason="triton is not installed")
    from pagellm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(shape, torch.device("cpu"))


def _c(kind, isa):
    kernel = built_or_skip(kind(isa), "kind(isa)")
    return kernel


# ---- values ------------------------------------------------------------------------------------------------


def representable(kv_format: KVCacheFormat) -> torch.Tensor:
    """Every finite value of the format's codes (each signed zero once), ascending by code."""
    if kv_format.value_dtype == torch.int8:
        return torch.arange(-127, 128, dtype=torch.float32)  # the writers never make -128: they saturate at 127
    values = torch.arange(256, dtype=torch.uint8).view(kv_format.value_dtype).float()
    return values[values.isfinite()]


def rows_after(first: float, values: torch.Tensor, head_dim: int) -> torch.Tensor:
    """values in rows of head_dim - 1 (the last row filled from the start again), each row led by first and -first
    alternately: a row whose largest magnitude is first."""
    per_row = head_dim - 1
    count = -(-len(values) // per_row) * per_row
    rows = values.repeat(-(-count // len(values)))[:count].view(-1, per_row)
    lead = torch.full((len(rows), 1), first)
    lead[1::2] *= -1
    return torch.cat([lead, rows], dim=1)


def exact_rows(kv_format: KVCacheFormat, head_dim: int, power: int) -> torch.Tensor:
    """Every representable value times 2^power, in rows led by +-max times 2^power: each row's scale is exactly
    2^power and every value a code times it."""
    return rows_after(kv_format.max_value * 2.0**power, representable(kv_format) * 2.0**power, head_dim)


def hard_rows(kv_format: KVCacheFormat, head_dim: int, seed: int) -> torch.Tensor:
    """Rows that reach every branch of the writers' rounding: exact values at three power-of-two scales, ties
    between neighbouring codes (round half to even), values in the subnormal range, rows of zeros and of signed
    zeros, a row whose scale is a bfloat16 subnormal, rows of ordinary and of wide-ranging values."""
    gen = torch.Generator().manual_seed(seed)
    values = representable(kv_format)
    positive = values[values > 0].sort().values
    ties = (positive[:-1] + positive[1:]) / 2
    ties = ties * torch.where(torch.rand(len(ties), generator=gen) < 0.5, -1.0, 1.0)
    tie_rows = rows_after(kv_format.max_value, ties, head_dim)
    smallest = positive[0].item()
    subnormal_row = torch.linspace(-8 * smallest, 8 * smallest, head_dim)
    subnormal_row[0] = kv_format.max_value  # scale 1: these stay below the format's smallest normal
    signed_zeros = torch.zeros(head_dim)
    signed_zeros[::2] = -0.0
    signed_zeros[1] = -3.0
    tiny_scale = torch.randn(1, head_dim, generator=gen) * 1e-36  # amax / MAX is a bfloat16 subnormal
    rows = [
        *(exact_rows(kv_format, head_dim, power) for power in (0, -12, 9)),
        tie_rows, subnormal_row[None], torch.zeros(1, head_dim), -torch.zeros(1, head_dim), signed_zeros[None],
        tiny_scale, torch.randn(8, head_dim, generator=gen),
        torch.randn(4, head_dim, generator=gen) * torch.logspace(-6, 3, head_dim),
        torch.randn(2, head_dim, generator=gen) * 1e4,
    ]
    return torch.cat(rows)


def test_names_resolve_to_vllms_formats():
    assert set(KV_CACHE_DTYPES) == {"auto", "bfloat16", "float16", *STORED_AS}
    for name, stored in STORED_AS.items():
        assert _format(name).name == stored and _format(name).quantized
    assert _format("fp8") == _format("fp8_per_token_head") == _format("fp8_e4m3")
    assert _format("fp8").value_dtype == torch.float8_e4m3fn and _format("fp8_e5m2").value_dtype == torch.float8_e5m2
    assert not KVCacheFormat.resolve("auto", torch.bfloat16).quantized
    assert KVCacheFormat.resolve("auto", torch.bfloat16).storage_dtype == torch.bfloat16


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("power", [0, -12, 9])
def test_representable_rows_round_trip_exactly(name, power):
    """Rows of codes times an exact power-of-two scale come back bit for bit: every subnormal, the maximum, both
    signs and (fp8) both zeros."""
    kv_format = _format(name)
    rows = exact_rows(kv_format, 64, power)
    codes, scales = kv_format.quantize(rows)
    assert torch.equal(scales.float(), torch.full((len(rows),), 2.0**power))
    back = kv_format.dequantize(codes, scales)
    if kv_format.value_dtype == torch.int8:
        assert torch.equal(back, rows)
    else:
        assert torch.equal(back.view(torch.int32), rows.view(torch.int32))  # -0.0 included
    assert len(torch.unique(codes)) == len(representable(kv_format)), "every code appears"


@pytest.mark.parametrize("name", FORMATS)
def test_reference_rounds_to_nearest_even_and_saturates(name):
    kv_format = _format(name)
    values = representable(kv_format)
    positive = values[values > 0].sort().values
    # Midpoints round to the neighbour with the even code (the even mantissa, or the even integer).
    lower, upper = positive[:-1], positive[1:]
    midpoints = (lower + upper) / 2
    row = torch.cat([torch.tensor([kv_format.max_value]), midpoints])
    codes, scales = kv_format.quantize(row[None])
    assert scales.item() == 1.0
    back = kv_format.dequantize(codes, scales)[0, 1:]
    assert ((back == lower) | (back == upper)).all()
    # Of two neighbouring codes one is even (an fp8 code's last bit is its mantissa's; int8 codes are integers).
    assert (codes[0, 1:] % 2 == 0).all()
    # Past the scale's reach nothing overflows: the row's largest magnitude sets the scale.
    row = torch.tensor([[3e38, -1.0, 7.0, 0.0]])
    assert torch.isfinite(kv_format.round_trip(row)).all()


# ---- writers -----------------------------------------------------------------------------------------------


def _write_case(kv_format: KVCacheFormat, dtype: torch.dtype, seed: int, num_kv_heads=3, head_dim=64, block_size=16):
    """k, v [tokens, kv_heads, head_dim] of hard rows (k) and the same rows shuffled (v), as strided views of one
    fused projection; the slots they go to, shuffled over a pool with room to spare."""
    rows = hard_rows(kv_format, head_dim, seed).to(dtype)
    rows = rows[rows.isfinite().all(-1)]  # float16 overflows on some (K/V are finite: the writers assume it)
    rows = torch.cat([rows, rows[: -len(rows) % num_kv_heads or None]])[: -(-len(rows) // num_kv_heads) * num_kv_heads]
    tokens = len(rows) // num_kv_heads
    shuffled = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))]
    fused = torch.cat([rows.view(tokens, -1), shuffled.view(tokens, -1)], dim=1)
    k, v = (part.view(tokens, num_kv_heads, head_dim) for part in fused.split(num_kv_heads * head_dim, dim=1))
    num_blocks = -(-tokens // block_size) + 3
    slots = np.random.default_rng(seed).permutation(num_blocks * block_size)[:tokens]
    return k, v, slots, num_blocks, block_size


def _empty_caches(kv_format, num_blocks, num_kv_heads, block_size, head_dim):
    """A K and a V cache of bytes that no writer makes (0xA5): untouched bytes stay visible."""
    run = kv_format.run_bytes(block_size, head_dim)
    return [torch.full((num_blocks, num_kv_heads, run), 0xA5, dtype=torch.uint8) for _ in range(2)]


def _reference_caches(kv_format, k, v, slots, num_blocks, block_size):
    """The torch path's write (kv_spec.py's quantize), and a check that it put quantize's bytes where they go."""
    _, num_kv_heads, head_dim = k.shape
    caches = _empty_caches(kv_format, num_blocks, num_kv_heads, block_size, head_dim)
    rows = torch.from_numpy(kv_write_index(slots // block_size, slots % block_size, num_kv_heads, block_size))
    write_kv(k, v, *caches, rows, kv_format)
    for x, cache in zip((k, v), caches):
        codes, scales = kv_format.split(cache, head_dim)
        expected_codes, expected_scales = kv_format.quantize(x)
        blocks, offsets = slots // block_size, slots % block_size
        assert torch.equal(codes[blocks, :, offsets], expected_codes)
        assert torch.equal(scales[blocks, :, offsets].view(torch.int16), expected_scales.view(torch.int16))
    return caches, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_c_writer_equals_the_reference_byte_for_byte(name, dtype):
    kv_format = _format(name)
    k, v, slots, num_blocks, block_size = _write_case(kv_format, dtype, seed=len(name))
    expected, rows = _reference_caches(kv_format, k, v, slots, num_blocks, block_size)
    for isa in ISAS:
        writer = _c(native.kv_writer, isa)
        assert native.KVWriter.writes(kv_format, dtype)
        caches = _empty_caches(kv_format, num_blocks, k.shape[1], block_size, k.shape[2])
        writer(k, v, *caches, rows, kv_format)
        for got, want, which in zip(caches, expected, "KV"):
            differ = (got != want).nonzero()
            assert not len(differ), f"{isa} {which}: {len(differ)} bytes differ, first at {differ[0].tolist()}"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_triton_writer_equals_the_reference_byte_for_byte(name, dtype):
    # float16, not bfloat16: the interpreter mishandles bfloat16 (tests/gpu cover it on the device).
    kv_format = _format(name)
    k, v, slots, num_blocks, block_size = _write_case(kv_format, dtype, seed=len(name))
    expected, _ = _reference_caches(kv_format, k, v, slots, num_blocks, block_size)
    shape = AttentionShape(k.shape[1], k.shape[1], k.shape[2], block_size, kv_format)
    backend = _triton_backend(shape)
    tokens = len(slots)
    step = StepAttentionInputs(tokens, np.ones(tokens, np.int64), np.ones(tokens, np.int64),
                               (slots // block_size)[:, None], slots)
    caches = _empty_caches(kv_format, num_blocks, k.shape[1], block_size, k.shape[2])
    backend.write_kv(k, v, *caches, backend.build_metadata(step))
    for got, want, which in zip(caches, expected, "KV"):
        differ = (got != want).nonzero()
        assert not len(differ), f"{which}: {len(differ)} bytes differ, first at {differ[0].tolist()}"


# ---- every code through every kernel -----------------------------------------------------------------------


def _one_key_per_sequence(kv_format: KVCacheFormat, head_dim: int, block_size: int):
    """Sequences of one token whose value rows hold every code (scales 1, 2^-12, 2^9) in shuffled blocks: attention
    over a single key returns its value row, so each kernel must give back exactly the dequantized rows."""
    values = torch.cat([exact_rows(kv_format, head_dim, power) for power in (0, -12, 9)])
    seqs = len(values)
    order = np.random.default_rng(seqs).permutation(seqs)
    cache = torch.zeros(seqs, 1, block_size, head_dim)
    cache[order, 0, 0] = values
    v_cache = kv_format.pack(cache)
    k_cache = kv_format.pack(torch.randn(seqs, 1, block_size, head_dim, generator=torch.Generator().manual_seed(1)))
    q = torch.randn(seqs, 1, head_dim, generator=torch.Generator().manual_seed(2))
    return q, k_cache, v_cache, order[:, None].astype(np.int64), values


@pytest.mark.parametrize("name", FORMATS)
def test_every_code_reads_back_exactly_in_the_c_kernels(name):
    kv_format, head_dim, block_size = _format(name), 64, 16
    q, k_cache, v_cache, tables, values = _one_key_per_sequence(kv_format, head_dim, block_size)
    ones = np.ones(len(q), dtype=np.int64)
    for isa in ISAS:
        # Signed zeros aside (the kernels sum weight * value into a +0.0 accumulator), the values come back exactly.
        out = _c(native.decode_kernel, isa)(q, k_cache, v_cache, tables, ones, 0.125, 0, kv_format)
        assert torch.equal(out[:, 0], values), isa
        chunks = native.PrefillChunks.build(tables, np.arange(len(q)), ones, ones)
        out = _c(native.prefill_kernel, isa)(q, k_cache, v_cache, chunks, 0.125, 0, kv_format)
        assert torch.equal(out[:, 0], values), isa


@needs_triton
@pytest.mark.parametrize("name", FORMATS)
def test_every_code_reads_back_exactly_in_the_triton_kernels(name):
    kv_format, head_dim, block_size = _format(name), 64, 16
    q, k_cache, v_cache, tables, values = _one_key_per_sequence(kv_format, head_dim, block_size)
    backend = _triton_backend(AttentionShape(1, 1, head_dim, block_size, kv_format))
    out = torch.full_like(q, float("nan"))
    backend.decode(out, q, k_cache, v_cache, torch.from_numpy(tables).int(), torch.ones(len(q), dtype=torch.int32),
                   1, 0.125)
    assert torch.equal(out[:, 0], values)


# ---- the kernels against float64 attention over the dequantized cache --------------------------------------


def _dequantized(kv_format: KVCacheFormat, cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    return kv_format.dequantize(*kv_format.split(cache, head_dim))


def _reference(q, keys, values, scale, causal_offset=None, window=0):
    """Softmax attention in float64: q [Q, H, D], keys/values [L, KVH, D]; query i sits at position
    causal_offset + i (None: sees every key)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,lhd->hql", q.double(), keys) * scale
    if causal_offset is not None:
        positions = causal_offset + torch.arange(len(q))[:, None]
        keys_at = torch.arange(len(keys))[None, :]
        visible = keys_at <= positions
        if window:
            visible &= keys_at > positions - window
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), values)


def _sequence(cache_values: torch.Tensor, table: np.ndarray, length: int) -> torch.Tensor:
    """[length, kv_heads, head_dim] of a sequence's blocks."""
    return cache_values[torch.from_numpy(table)].transpose(1, 2).flatten(0, 1)[:length]


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The kernels multiply the same dequantized values (a code times a bfloat16 scale is exact in float32) and
    differ from float64 by float32 sums in another order and their exp: the float32 kernel tests' tolerance. A
    bfloat16 output is the float32 result rounded once: within one bfloat16 step (2^-7 relative) of float64's."""
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-5)
    else:
        torch.testing.assert_close(out, expected.float(), rtol=1e-4, atol=2e-5)


def _paged_pool(kv_format, num_blocks, num_kv_heads, block_size, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    # Keys with a few large channels, as real keys have, so per-row scales matter.
    keys = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    keys[..., ::16] *= 8
    k_cache = kv_format.pack(keys)
    v_cache = kv_format.pack(torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen))
    return k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 2, 32, 8), (8, 1, 128, 32)])
@pytest.mark.parametrize("name", FORMATS)
def test_c_decode_equals_attention_over_the_dequantized_cache(name, num_heads, num_kv_heads, head_dim, block_size,
                                                              dtype):
    kv_format = _format(name)
    context_lens = np.array([1, 7, block_size, 77, 130], dtype=np.int64)
    blocks = -(-context_lens // block_size)
    num_blocks = int(blocks.sum()) + 2
    k_cache, v_cache = _paged_pool(kv_format, num_blocks, num_kv_heads, block_size, head_dim, seed=head_dim)
    order = np.random.default_rng(0).permutation(num_blocks)
    tables = np.zeros((len(context_lens), blocks.max() + 1), dtype=np.int64)
    for seq, first in enumerate(np.cumsum(blocks) - blocks):
        tables[seq, : blocks[seq]] = order[first : first + blocks[seq]]
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    keys, values = _dequantized(kv_format, k_cache, head_dim), _dequantized(kv_format, v_cache, head_dim)
    scale = head_dim**-0.5
    expected = torch.stack([
        _reference(q[seq, None], _sequence(keys, tables[seq], length), _sequence(values, tables[seq], length), scale)[0]
        for seq, length in enumerate(context_lens)])
    for isa in ISAS:
        out = _c(native.decode_kernel, isa)(q, k_cache, v_cache, tables, context_lens, scale, 0, kv_format)
        assert out.dtype == dtype
        _close(out, expected)
        windowed = _c(native.decode_kernel, isa)(q, k_cache, v_cache, tables, context_lens, scale, 13, kv_format)
        for seq, length in enumerate(context_lens):
            first = max(0, length - 13)
            want = _reference(q[seq, None], _sequence(keys, tables[seq], length)[first:],
                              _sequence(values, tables[seq], length)[first:], scale)
            _close(windowed[seq, None], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("name", FORMATS)
def test_c_prefill_equals_attention_over_the_dequantized_cache(name, window, dtype):
    """Ragged chunks, some continuing a sequence (context cached before them), with and without a window."""
    kv_format = _format(name)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    chunks = [(0, 1), (0, 37), (50, 20), (5, 1), (16, 33)]  # (cached tokens, queries)
    seq_lens = np.array([computed + length for computed, length in chunks], dtype=np.int64)
    blocks = -(-seq_lens // block_size)
    num_blocks = int(blocks.sum()) + 1
    k_cache, v_cache = _paged_pool(kv_format, num_blocks, num_kv_heads, block_size, head_dim, seed=window)
    order = np.random.default_rng(1).permutation(num_blocks)
    tables = np.zeros((len(chunks), blocks.max()), dtype=np.int64)
    for c, first in enumerate(np.cumsum(blocks) - blocks):
        tables[c, : blocks[c]] = order[first : first + blocks[c]]
    query_lens = np.array([length for _, length in chunks], dtype=np.int64)
    query_starts = np.cumsum(query_lens) - query_lens
    q = torch.randn(int(query_lens.sum()), num_heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    keys, values = _dequantized(kv_format, k_cache, head_dim), _dequantized(kv_format, v_cache, head_dim)
    scale = head_dim**-0.5
    expected = torch.cat([
        _reference(q[start : start + length], _sequence(keys, tables[c], seq_lens[c]),
                   _sequence(values, tables[c], seq_lens[c]), scale, seq_lens[c] - length, window)
        for c, (start, length) in enumerate(zip(query_starts, query_lens))])
    prefill = native.PrefillChunks.build(tables, query_starts, query_lens, seq_lens)
    for isa in ISAS:
        out = _c(native.prefill_kernel, isa)(q, k_cache, v_cache, prefill, scale, window, kv_format)
        assert out.dtype == dtype
        _close(out, expected)


# ---- the step paths: C and Triton backends against the torch path on one quantized pool --------------------


def _step_case(kv_format: KVCacheFormat, shape: AttentionShape, seed: int, long_context: int = 150):
    from tests.attention_cases import make_step

    # Decodes with ragged contexts (one over several key tiles), a fresh prefill and two continued chunks.
    step, q, k, v, k_cache, v_cache = make_step(shape, [0, 37, long_context, 0, 45, 16], [1, 1, 1, 23, 30, 9],
                                                num_blocks=48, seed=seed)
    return step, q, k, v, kv_format.pack(k_cache), kv_format.pack(v_cache)


def _run_step(backend, step, q, k, v, k_cache, v_cache):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = paged_attention(q, k, v, k_cache, v_cache, backend.build_metadata(step), backend.shape.head_dim**-0.5)
    return out, k_cache, v_cache


@pytest.mark.parametrize("name", [*FORMATS, "bfloat16"])
def test_c_step_path_equals_the_torch_path(name):
    """The native writer, decode and prefill through the backend the engine uses, against the torch path: the
    pools are equal byte for byte, the outputs to float32 rounding. "bfloat16" under float32 queries: the C writer
    rounds as torch's .to does, and prefill attends float32 tiles widened from the cache, not the bfloat16 model's
    arithmetic."""
    kv_format = _format(name)
    shape = AttentionShape(6, 2, 64, 16, kv_format)
    case = (_step_case(kv_format, shape, seed=11) if kv_format.quantized
            else _half_step_case(kv_format.value_dtype, shape, seed=11))
    reference = _run_step(TorchAttentionBackend(shape, torch.device("cpu"), None), *case)
    for isa in ISAS:
        backend = TorchAttentionBackend(shape, torch.device("cpu"), _c(native.decode_kernel, isa),
                                        _c(native.kv_writer, isa), _c(native.prefill_kernel, isa))
        out, k_cache, v_cache = _run_step(backend, *case)
        assert torch.equal(k_cache, reference[1]) and torch.equal(v_cache, reference[2])
        torch.testing.assert_close(out, reference[0], rtol=1e-4, atol=2e-5)


@needs_triton
@pytest.mark.parametrize("name,dtype", [(name, torch.float32) for name in FORMATS] + [("fp8", torch.float16)])
def test_triton_step_path_equals_the_torch_path(name, dtype):
    """The Triton writer, split-K decode and paged prefill on one quantized pool against the torch path. float32:
    the dequantized values are exact and the dots IEEE, so the float32 backends' tolerance (relative norm 2e-5).
    float16: the kernels cast the dequantized values and the probabilities to the queries' float16 for the
    products (11-bit significands), which bounds the error near the float16 backends' 2e-3."""
    kv_format = _format(name)
    shape = AttentionShape(4, 2, 32, 16, kv_format)
    # 100 tokens: two of the decode kernel's 64-key tiles (the interpreter's time grows with the tiles)
    step, q, k, v, k_cache, v_cache = _step_case(kv_format, shape, seed=12, long_context=100)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    reference = _run_step(TorchAttentionBackend(shape, torch.device("cpu"), None), step, q, k, v, k_cache, v_cache)
    triton_backend = _triton_backend(shape)
    assert triton_backend.build_metadata(step).num_splits >= 1
    out, k_written, v_written = _run_step(triton_backend, step, q, k, v, k_cache, v_cache)
    assert torch.equal(k_written, reference[1]) and torch.equal(v_written, reference[2])
    error = (out.float() - reference[0].float()).norm() / reference[0].float().norm()
    assert error < (2e-5 if dtype == torch.float32 else 2e-3), f"relative error {error:.2e}"


# ---- a float cache of another dtype than the model's ------------------------------------------------------


def test_half_names_resolve_to_unquantized_formats_of_their_dtype():
    """vLLM's "bfloat16" and "float16": the cache in that dtype whatever the model's (the same as "auto" for a model
    of that dtype), half a float32 model's bytes per token."""
    for name, dtype, code in (("bfloat16", torch.bfloat16, 1), ("float16", torch.float16, 2)):
        kv_format = KVCacheFormat.resolve(name, torch.float32)
        assert kv_format == KVCacheFormat(name, dtype, code) and not kv_format.quantized
        assert kv_format.storage_dtype == dtype and KVCacheFormat.resolve(name, dtype) == KVCacheFormat.resolve(
            "auto", dtype)
        spec = KVCacheSpec(30, 3, 64, 16, torch.float32, name)
        assert spec.tokens_per_gib == 2 * KVCacheSpec(30, 3, 64, 16, torch.float32).tokens_per_gib
        assert spec.pool_shape(5) == (30, 2, 5, 3, 16, 64)
    assert native.kernels_read(KVCacheFormat.resolve("bfloat16", torch.float32))
    assert not native.kernels_read(KVCacheFormat.resolve("float16", torch.float32))


def _half_step_case(dtype: torch.dtype, shape: AttentionShape, seed: int, long_context: int = 150):
    from tests.attention_cases import make_step

    step, q, k, v, k_cache, v_cache = make_step(shape, [0, 37, long_context, 0, 45, 16], [1, 1, 1, 23, 30, 9],
                                                num_blocks=48, seed=seed)
    return step, q, k, v, k_cache.to(dtype), v_cache.to(dtype)


def test_torch_path_on_a_bfloat16_cache_attends_the_rounded_keys_and_values():
    """float32 queries over a bfloat16 cache: the torch path writes the step's K/V rounded, and attends what the
    cache gives back (a chunk that starts its sequence too): the same outputs as a float32 cache holding the rounded
    values with the step's K/V rounded beforehand."""
    shape = AttentionShape(6, 2, 64, 16, KVCacheFormat.resolve("bfloat16", torch.float32))
    step, q, k, v, k_cache, v_cache = _half_step_case(torch.bfloat16, shape, seed=13)
    out, k_written, v_written = _run_step(TorchAttentionBackend(shape, torch.device("cpu"), None), step, q, k, v,
                                          k_cache, v_cache)
    float_shape = AttentionShape(6, 2, 64, 16)
    rounded = [x.to(torch.bfloat16).float() for x in (k, v)]
    expected, k_float, _ = _run_step(TorchAttentionBackend(float_shape, torch.device("cpu"), None), step, q,
                                     *rounded, k_cache.float(), v_cache.float())
    assert k_written.dtype == torch.bfloat16 and torch.equal(k_written.float(), k_float)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@needs_triton
def test_triton_step_path_equals_the_torch_path_on_a_float16_cache():
    """The Triton writer and kernels with float32 queries over a float16 cache (the interpreter has no bfloat16):
    the pool written alike, the outputs within the float32 backends' tolerance."""
    shape = AttentionShape(4, 2, 32, 16, KVCacheFormat.resolve("float16", torch.float32))
    case = _half_step_case(torch.float16, shape, seed=12, long_context=100)
    reference = _run_step(TorchAttentionBackend(shape, torch.device("cpu"), None), *case)
    out, k_written, v_written = _run_step(_triton_backend(shape), *case)
    assert torch.equal(k_written, reference[1]) and torch.equal(v_written, reference[2])
    error = (out - reference[0]).norm() / reference[0].norm()
    assert error < 2e-5, f"relative error {error:.2e}"


# ---- the pool ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_the_pool_holds_about_twice_the_tokens_of_bfloat16(name):
    """One byte per value and a 2-byte scale per head_dim values: (2 * head_dim) / (head_dim + 2) the tokens per GiB
    of bfloat16, 1.94x at the default model's head size of 64 (the issue's target: >= 1.9x)."""
    for head_dim, layers, kv_heads in ((64, 30, 3), (128, 32, 8)):
        base = KVCacheSpec(layers, kv_heads, head_dim, 16, torch.bfloat16)
        spec = KVCacheSpec(layers, kv_heads, head_dim, 16, torch.bfloat16, name)
        assert spec.bytes_per_block == 2 * layers * kv_heads * 16 * (head_dim + 2)
        assert spec.tokens_per_gib / base.tokens_per_gib == pytest.approx(2 * head_dim / (head_dim + 2))
        assert spec.tokens_per_gib / base.tokens_per_gib >= 1.9
        assert KVCacheSpec(layers, kv_heads, head_dim, 16, torch.float32, name).bytes_per_block == spec.bytes_per_block
        shape = spec.pool_shape(5)
        assert shape == (layers, 2, 5, kv_heads, 16 * (head_dim + 2)) and spec.format.storage_dtype == torch.uint8
        assert np.prod(shape) == 5 * spec.bytes_per_block


# ---- the engine -------------------------------------------------------------------------------------------


PROMPT_PREFIX = ("You are a careful assistant. This shared system prompt is long enough to fill two whole blocks of "
                 "sixteen tokens, so that the requests after the first find those blocks cached. ")
ENGINE_PROMPTS = [PROMPT_PREFIX + tail for tail in ("the quick brown fox", "one two three four", "Paris is")]
MAX_TOKENS = 16


def hf_greedy_through_quantized_cache(model, prompt_ids: list[int], kv_format: KVCacheFormat, k: int):
    """transformers' greedy continuation with every new token's keys and values passed through the format's round
    trip as they enter its cache, and the top-k {token: logprob} of each step: attention over what the cache gives
    back, computed by another implementation."""
    from transformers import DynamicCache

    update = DynamicCache.update

    def quantized_update(cache, keys, values, layer_idx, *args, **kwargs):
        return update(cache, kv_format.round_trip(keys), kv_format.round_trip(values), layer_idx, *args, **kwargs)

    tokens, tops = [], []
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(DynamicCache, "update", quantized_update)
        cache, ids = DynamicCache(), torch.tensor([prompt_ids])
        for _ in range(MAX_TOKENS):
            logprobs = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].log_softmax(-1)
            values, indices = logprobs.topk(k)
            tops.append(dict(zip(indices.tolist(), values.tolist())))
            tokens.append(indices[0].item())
            ids = indices[:1][None]
    return tokens, tops


def test_fp8_engine_with_prefix_caching_preemption_and_forks_attends_the_quantized_cache(tiny_llama_dir, hf_tiny):
    """kv_cache_dtype="fp8" on the tiny model, in a pool too small for the batch (preemption and recomputation),
    with prefix caching (the prompts' first two blocks come from an earlier request) and n=2 (two sequences forked
    from one prompt, copy-on-write of its partly filled block): greedy tokens and logprobs equal transformers' with
    keys and values rounded as the cache stores them (vLLM's check_logprobs_close: exact up to a near-tie).

    The comparison is with that reference rather than with kv_cache_dtype="auto" because the tiny random model is
    far more sensitive than a trained one: its logits are flat (chosen tokens near -2 nats) and its blocks outweigh
    the residual stream, so e4m3's 2.4% RMS rounding of K/V moves its chosen-token logprobs by up to ~1 nat and
    reorders its top 5 (measured), where the default model loses ~1% perplexity (README "KV cache dtype"). The
    remaining differences are float32 rounding of K/V computed in other batch shapes (a code may round the other
    way): measured at 8e-5 nats; 1e-3 leaves room for other instruction sets while a block misread, lost or shared
    wrongly moves logprobs by tenths."""
    kv_format = _format("fp8")
    _check_engine_against_rounded_reference(tiny_llama_dir, hf_tiny, "fp8", kv_format, torch.uint8)


def test_float32_engine_on_a_bfloat16_cache_attends_the_rounded_keys_and_values(tiny_llama_dir, hf_tiny):
    """kv_cache_dtype="bfloat16" under a float32 model (vLLM's name; half the cache's bytes), in the fp8 test's
    batch (preemption, prefix caching, n=2), on the native writer, decode and prefill kernels: greedy tokens and
    logprobs equal transformers' with keys and values rounded to bfloat16 as they enter its cache."""
    _check_engine_against_rounded_reference(tiny_llama_dir, hf_tiny, "bfloat16", _RoundedTo(torch.bfloat16),
                                            torch.bfloat16)


class _RoundedTo:
    """A float cache of another dtype than the model's, as hf_greedy_through_quantized_cache applies it."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).to(x.dtype)


def _check_engine_against_rounded_reference(tiny_llama_dir, hf_tiny, cache_dtype: str, rounding,
                                            pool_dtype: torch.dtype) -> None:
    from pagellm import LLM, SamplingParams
    from tests.helpers import check_logprobs_close

    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_dtype=cache_dtype, num_gpu_blocks_override=10,
              max_model_len=96, enable_prefix_caching=True)
    runner = llm.llm_engine.core.runner
    assert runner.kv_pool.dtype == pool_dtype and runner.native_decode is not None
    llm.generate([PROMPT_PREFIX], SamplingParams(max_tokens=1), use_tqdm=False)  # caches the prefix's blocks
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, n=2)
    outputs = llm.generate(ENGINE_PROMPTS, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small for the batch"
    assert stats.kv_cache.num_used_blocks == 0
    assert min(o.num_cached_tokens for o in outputs) >= 32, "the shared prefix was meant to come from the cache"
    agreeing = drift = 0
    for output in outputs:
        expected_tokens, expected_tops = hf_greedy_through_quantized_cache(hf_tiny, output.prompt_token_ids,
                                                                           rounding, 5)
        assert len(output.outputs) == 2
        for sample in output.outputs:
            tops = [{token: lp.logprob for token, lp in position.items()} for position in sample.logprobs]
            same = check_logprobs_close((list(sample.token_ids), tops), (expected_tokens, expected_tops))
            agreeing += same
            for position in range(same):
                token = expected_tokens[position]
                drift = max(drift, abs(tops[position][token] - expected_tops[position][token]))
    assert agreeing >= 0.9 * 2 * len(ENGINE_PROMPTS) * MAX_TOKENS
    assert drift < 1e-3, f"a chosen token's logprob differs from the reference's by {drift:.2e}"


def test_engine_sizes_its_pool_from_the_format_and_logs_it(tiny_llama_dir, caplog):
    """A bfloat16 model with an int8 cache: the pool is uint8 runs sized by KVCacheSpec, twice the blocks a
    bfloat16 cache gets from the same memory (less the scales); the start-up log and the cache_config_info metric
    name the format."""
    from pagellm import LLM, SamplingParams
    from pagellm.metrics import cache_config_info

    name, memory = "int8_per_token_head", 8 << 20
    logger = logging.getLogger("pagellm")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="pagellm"):
            llm = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_dtype=name, kv_cache_memory_bytes=memory,
                      max_model_len=256)
    finally:
        logger.removeHandler(caplog.handler)
    assert f"KV dtype int8 with a bfloat16 scale per token and head (kv_cache_dtype={name})" in caplog.text
    assert cache_config_info(llm.llm_engine)["cache_dtype"] == name
    config = llm.llm_engine.core.model_info.hf_config
    layers, kv_heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, 32  # the tiny model's
    spec = KVCacheSpec(layers, kv_heads, head_dim, 16, torch.bfloat16, name)
    bf16 = KVCacheSpec(layers, kv_heads, head_dim, 16, torch.bfloat16)
    num_blocks = llm.llm_engine.core.startup.num_blocks
    assert num_blocks == memory // spec.bytes_per_block
    assert num_blocks / (memory // bf16.bytes_per_block) == pytest.approx(2 * head_dim / (head_dim + 2), rel=0.01)
    pool = llm.llm_engine.core.runner.kv_pool
    assert pool.dtype == torch.uint8 and tuple(pool.shape) == spec.pool_shape(num_blocks)
    out = llm.generate(ENGINE_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_unknown_kv_cache_dtypes_are_refused_naming_the_value_and_the_choices(tiny_llama_dir):
    from pagellm import LLM
    from pagellm.config import ArgumentValueError, EngineArgs

    for bad in ("fp4", "int8", "bf16"):
        with pytest.raises(ArgumentValueError) as refused:
            EngineArgs(model=tiny_llama_dir, kv_cache_dtype=bad)
        message = str(refused.value)
        assert f"kv_cache_dtype={bad!r}" in message and all(name in message for name in KV_CACHE_DTYPES)
    with pytest.raises(ArgumentValueError, match="kv_cache_dtype='fp4'"):
        LLM(tiny_llama_dir, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4' is not supported; use one of auto, bfloat16, "):
        KVCacheSpec(2, 1, 32, 16, torch.float32, "fp4").format
