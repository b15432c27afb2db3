"""The native prefill-attention kernel (csrc/prefill_attention.c) on every instruction set this CPU runs,
against causal attention computed densely in float64 from the same paged cache, and through the torch
backend's step path against the torch path it replaces.

Chunks are ragged and some continue a sequence (cached context before them); with a sliding window, the
block-table entries wholly before the first key a chunk's queries see point at a block of NaNs, so a read
of one would show in the output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.attention import native
from pagellm.attention.kv_spec import KVCacheFormat
from pagellm.cpu_features import cpu_has_amx_bf16
from pagellm.ops import cpu_build

ISAS = cpu_build.runnable_isas()


def _kernel_paths() -> list[tuple[str, bool]]:
    """(isa, tiles) for every instruction set, and the widest once more on its vector loops where its bfloat16
    products would take AMX's tiles."""
    paths = [(isa, True) for isa in ISAS]
    widest = native.prefill_kernel(ISAS[0])
    if widest is not None and widest.amx:
        paths.append((ISAS[0], False))
    return paths


@pytest.fixture(params=_kernel_paths(), ids=lambda path: path[0] + ("" if path[1] else "-vector"))
def kernel(request):
    isa, tiles = request.param
    kernel = native.prefill_kernel(isa)
    if kernel is None:
        pytest.skip("no C compiler")
    assert kernel.isa == isa
    kernel.amx = kernel.amx and tiles
    return kernel


def _first_visible(position: int, window: int) -> int:
    return position - window + 1 if window and position >= window else 0


def _prefill_case(chunks, num_heads, num_kv_heads, head_dim, block_size, dtype, window, seed):
    """chunks: (num_computed, query_len) per chunk. Returns the kernel's inputs: q holds every chunk's
    queries back to back as a strided view (like the fused QKV projection's); the last block of the pool is
    NaN and slid-out table entries point at it."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    blocks = [-(-(computed + length) // block_size) for computed, length in chunks]
    num_blocks = sum(blocks) + 2
    cache_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    nan_block = num_blocks - 1
    k_cache[nan_block] = float("nan")
    v_cache[nan_block] = float("nan")
    order = rng.permutation(num_blocks - 1)
    tables = np.full((len(chunks), max(blocks) + 1), nan_block, dtype=np.int64)
    used = 0
    for c, ((computed, _), count) in enumerate(zip(chunks, blocks)):
        tables[c, :count] = order[used:used + count]
        used += count
    tokens = sum(length for _, length in chunks)
    fused = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q = fused[:, :num_heads]
    query_lens = np.array([length for _, length in chunks], dtype=np.int64)
    query_starts = np.cumsum(query_lens) - query_lens
    seq_lens = np.array([computed + length for computed, length in chunks], dtype=np.int64)
    expected = _dense_reference(q, k_cache, v_cache, tables, query_starts, query_lens, seq_lens, head_dim**-0.5,
                                window)
    if window:
        for c, (computed, _) in enumerate(chunks):
            tables[c, : _first_visible(computed, window) // block_size] = nan_block
    return (q, k_cache, v_cache, native.PrefillChunks.build(tables, query_starts, query_lens, seq_lens)), expected


def _dense_reference(q, k_cache, v_cache, tables, query_starts, query_lens, seq_lens, scale, window):
    """Float64 softmax attention of each chunk over its sequence's keys, gathered block by block."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for c, (start, length, seq_len) in enumerate(zip(query_starts, query_lens, seq_lens)):
        keys = k_cache[tables[c]].transpose(1, 2).flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)
        values = v_cache[tables[c]].transpose(1, 2).flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)
        positions = torch.arange(seq_len - length, seq_len)
        key_positions = torch.arange(seq_len)
        visible = key_positions[None, :] <= positions[:, None]
        if window:
            visible &= key_positions[None, :] > positions[:, None] - window
        # Slid-out keys of real blocks are finite; zero those the mask hides anyway so 0 * NaN cannot occur.
        scores = torch.einsum("qhd,khd->hqk", q[start:start + length].double(), keys) * scale
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:start + length] = torch.einsum("hqk,khd->qhd", weights, values)
    return out


def _assert_close(actual, expected, dtype):
    assert actual.dtype == dtype and not actual.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=2e-5)
    else:
        # The weights are rounded to bfloat16 before the value product (as torch's flash attention does) and
        # the output once more: a few bfloat16 steps of the output's scale.
        torch.testing.assert_close(actual.double(), expected.to(dtype).double(), rtol=2**-6, atol=2e-2)


CHUNKS = [(0, 1), (0, 37), (5, 20), (40, 1), (100, 70), (0, 130)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (4, 4, 128, 32), (8, 2, 64, 32), (8, 1, 96, 16), (4, 1, 32, 8)])
def test_prefill_kernel_matches_dense_attention(kernel, dtype, num_heads, num_kv_heads, head_dim, block_size):
    inputs, expected = _prefill_case(CHUNKS, num_heads, num_kv_heads, head_dim, block_size, dtype, 0,
                                     seed=head_dim + num_heads)
    _assert_close(kernel(*inputs, head_dim**-0.5), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 13, 48, 1000])
def test_prefill_kernel_sliding_window_never_reads_slid_out_blocks(kernel, dtype, window):
    inputs, expected = _prefill_case([(0, 90), (60, 30), (97, 1), (33, 64)], 6, 2, 64, 16, dtype, window, seed=window)
    _assert_close(kernel(*inputs, 0.125, sliding_window=window), expected, dtype)


def test_prefill_kernel_checks_its_inputs(kernel):
    inputs, _ = _prefill_case([(3, 5)], 4, 2, 64, 16, torch.float32, 0, seed=0)
    q, k_cache, v_cache, chunks = inputs
    tables, starts, lens, seq_lens = chunks.block_tables, chunks.query_starts, chunks.query_lens, chunks.seq_lens
    assert native.PrefillKernel.supports(64) and not native.PrefillKernel.supports(48)
    with pytest.raises(TypeError, match="caches of their dtype"):
        kernel(q.bfloat16(), *inputs[1:], 0.1)
    with pytest.raises(ValueError, match="sliding_window=-2"):
        kernel(*inputs, 0.1, sliding_window=-2)
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        native.PrefillChunks.build(tables, starts, lens, lens - 1)
    with pytest.raises(ValueError, match="one row per chunk"):
        native.PrefillChunks.build(tables[0], starts, lens, seq_lens)
    with pytest.raises(ValueError, match="blocks of 16"):
        kernel(q, k_cache, v_cache, native.PrefillChunks.build(tables[:, :1], starts, lens, seq_lens + 20), 0.1)
    with pytest.raises(ValueError, match="of q's 5"):
        kernel(q, k_cache, v_cache, native.PrefillChunks.build(tables, starts + 1, lens, seq_lens), 0.1)


# ---- through the torch backend's step --------------------------------------------------------------


def test_cpu_backend_takes_the_prefill_kernel_where_it_applies(monkeypatch):
    from pagellm.attention import backend
    from pagellm.attention.backend import BACKEND_ENV, AttentionShape, select_backend

    cpu = torch.device("cpu")
    shape = AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert isinstance(select_backend(cpu, torch.float32, shape).native_prefill, native.PrefillKernel)
    # bfloat16 takes torch's SDPA where the CPU has AMX tiles and the kernel cannot use them (SDPA measured
    # faster than its vector loops there), the kernel elsewhere
    sdpa = cpu_has_amx_bf16() and not native.prefill_kernel().amx
    bf16 = select_backend(cpu, torch.bfloat16, shape).native_prefill
    assert (bf16 is None) if sdpa else isinstance(bf16, native.PrefillKernel)
    monkeypatch.setattr(backend, "cpu_has_amx_bf16", lambda: True)
    kernel_on = native.prefill_kernel

    def without_tiles(isa=None):
        kernel = kernel_on(isa)
        kernel.amx = False
        return kernel

    monkeypatch.setattr(native, "prefill_kernel", without_tiles)
    assert select_backend(cpu, torch.bfloat16, shape).native_prefill is None
    monkeypatch.setattr(native, "prefill_kernel", kernel_on)
    fp8 = AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                         kv_format=KVCacheFormat.resolve("fp8", torch.bfloat16))
    assert isinstance(select_backend(cpu, torch.bfloat16, fp8).native_prefill, native.PrefillKernel)
    monkeypatch.setattr(backend, "cpu_has_amx_bf16", lambda: False)
    assert isinstance(select_backend(cpu, torch.bfloat16, shape).native_prefill, native.PrefillKernel)
    assert select_backend(cpu, torch.float16, shape).native_prefill is None
    odd_heads = AttentionShape(num_heads=9, num_kv_heads=3, head_dim=48, block_size=16)
    assert select_backend(cpu, torch.float32, odd_heads).native_prefill is None
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_backend(cpu, torch.float32, shape).native_prefill is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
def test_backend_step_with_prefill_kernel_matches_torch_path(dtype, window):
    """A mixed step (decodes, a chunk with context, a fresh prompt) through TorchAttentionBackend with the
    native kernels against the same step on the torch path."""
    from pagellm.attention.backend import AttentionShape
    from pagellm.attention.paged import TorchAttentionBackend
    from tests.attention_cases import make_step

    prefill = native.prefill_kernel()
    if prefill is None:
        pytest.skip("no C compiler")
    shape = AttentionShape(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
    step, q, k, v, k_cache, v_cache = make_step(shape, computed=[30, 7, 50, 0], scheduled=[1, 1, 45, 70],
                                                num_blocks=24, seed=3)
    q, k, v, k_cache, v_cache = (t.to(dtype) for t in (q, k, v, k_cache, v_cache))
    outs = []
    for backend in (TorchAttentionBackend(shape, torch.device("cpu"), None),
                    TorchAttentionBackend(shape, torch.device("cpu"), native.decode_kernel(), native_prefill=prefill)):
        meta = backend.build_metadata(step)
        caches = k_cache.clone(), v_cache.clone()
        outs.append(backend.forward(q, k, v, *caches, meta, 0.125, window))
    assert (meta.native_prefill is not None) and outs[1].dtype == dtype
    _assert_close(outs[1], outs[0].double(), dtype)
