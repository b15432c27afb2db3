"""The attention path and the native CPU kernels against plain torch references.

Paged attention: every case builds a pool with sequences scattered over shuffled blocks, writes their keys and values
through `paged_attention`, and checks each output row against plain softmax attention over that
sequence's contiguous history, for the native decode kernel and for the torch path.
The fused ops, dtypes and each instruction set's build: tests/test_kernels_isa.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.attention import native
from pagellm.attention.paged import AttentionMetadata, DecodeMetadata, PrefillChunk, kv_write_index, paged_attention
from pagellm.ops import cpu_build


def _dense_reference(q, keys, values, first_position, scale):
    """q: [n, H, D] at positions first_position..; keys/values: [L, KVH, D], the whole sequence so far."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    positions = first_position + torch.arange(q.shape[0])
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, None, :] > positions[None, :, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).float()


class _Pool:
    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, seed):
        self.block_size = block_size
        self.k = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim)
        self.v = torch.zeros_like(self.k)
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))

    def table_for(self, length):
        return np.array([self.free.pop() for _ in range(-(-length // self.block_size))], dtype=np.int64)

    def rows(self, table, positions):
        return kv_write_index(table[positions // self.block_size], positions % self.block_size,
                              self.k.shape[1], self.block_size)


def _run_step(pool, histories, computed, scheduled, kernel, scale, num_heads, seed):
    """One step: sequence i has computed[i] tokens cached and schedules scheduled[i] more (1 = decode)."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = pool.k.shape[1], pool.k.shape[3]
    tables = [pool.table_for(c + n) for c, n in zip(computed, scheduled)]
    # The cached part is already in the pool, as earlier steps would have left it.
    for table, history, c in zip(tables, histories, computed):
        positions = np.arange(c)
        blocks, offsets = table[positions // pool.block_size], positions % pool.block_size
        pool.k[blocks, :, offsets] = history[0][:c]
        pool.v[blocks, :, offsets] = history[1][:c]
    order = sorted(range(len(scheduled)), key=lambda i: scheduled[i] > 1)
    q = [torch.randn(scheduled[i], num_heads, head_dim, generator=gen) for i in order]
    k = [histories[i][0][computed[i] : computed[i] + scheduled[i]] for i in order]
    v = [histories[i][1][computed[i] : computed[i] + scheduled[i]] for i in order]
    write_rows = np.concatenate([pool.rows(tables[i], computed[i] + np.arange(scheduled[i])) for i in order])
    decodes = [i for i in order if scheduled[i] == 1]
    max_blocks = max((len(tables[i]) for i in decodes), default=0)
    decode = None
    if decodes:
        block_tables = np.stack([np.pad(tables[i], (0, max_blocks - len(tables[i]))) for i in decodes])
        context_lens = np.array([computed[i] + 1 for i in decodes], dtype=np.int64)
        decode = DecodeMetadata(block_tables, context_lens)
        if kernel is None:
            decode.block_tables_tensor = torch.from_numpy(block_tables)
            keys = np.arange(max_blocks * pool.block_size)
            decode.mask = torch.from_numpy(keys[None, :] < context_lens[:, None])[:, None, None, :]
    chunks, offset = [], 0
    for i in order[len(decodes) :]:
        chunk = PrefillChunk(offset, offset + scheduled[i])
        if computed[i]:
            context = computed[i] + scheduled[i]
            chunk.block_table = torch.from_numpy(tables[i])
            chunk.context_len = context
            chunk.mask = torch.from_numpy(np.arange(context)[None, :] <= computed[i] + np.arange(scheduled[i])[:, None])
        chunks.append(chunk)
        offset += scheduled[i]
    meta = AttentionMetadata(torch.from_numpy(write_rows), len(decodes), decode, chunks, kernel)
    out = paged_attention(torch.cat(q), torch.cat(k), torch.cat(v), pool.k, pool.v, meta, scale)
    expected = torch.cat([
        _dense_reference(qi, histories[i][0][: computed[i] + scheduled[i]],
                         histories[i][1][: computed[i] + scheduled[i]], computed[i], scale)
        for qi, i in zip(q, order)
    ])
    return out, expected


def _histories(lengths, num_kv_heads, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    def draw(n):
        return torch.randn(n, num_kv_heads, head_dim, generator=gen)

    return [(draw(n), draw(n)) for n in lengths]


def _kernels():
    kernel = native.decode_kernel()
    return [pytest.param(None, id="torch"),
            pytest.param(kernel, id="native", marks=pytest.mark.skipif(kernel is None, reason="no C compiler"))]


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_mixed_step_matches_dense_attention(kernel, block_size, num_heads, num_kv_heads):
    head_dim = 32
    # Decodes at contexts 1..70, a fresh prompt, a continued chunk and a one-token continuation.
    computed = [0, 5, 31, 69, 0, 40, 17]
    scheduled = [1, 1, 1, 1, 23, 9, 1]
    histories = _histories([c + n for c, n in zip(computed, scheduled)], num_kv_heads, head_dim, seed=block_size)
    pool = _Pool(400, block_size, num_kv_heads, head_dim, seed=num_heads)
    out, expected = _run_step(pool, histories, computed, scheduled, kernel, head_dim**-0.5, num_heads, seed=7)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(native.decode_kernel() is None, reason="no C compiler")
def test_native_kernel_equals_torch_path_on_long_contexts():
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    computed = [1000, 3, 511, 257]
    scheduled = [1] * 4
    results = []
    for kernel in (None, native.decode_kernel()):
        histories = _histories([c + 1 for c in computed], num_kv_heads, head_dim, seed=3)
        pool = _Pool(300, block_size, num_kv_heads, head_dim, seed=4)
        results.append(_run_step(pool, histories, computed, scheduled, kernel, 0.125, num_heads, seed=5)[0])
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


def test_native_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    cpu_build.native_library.cache_clear()
    try:
        assert native.decode_kernel() is None
    finally:
        monkeypatch.delenv("PAGELLM_NATIVE_KERNELS")
        cpu_build.native_library.cache_clear()


def test_missing_compiler_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_build.native_library.cache_clear()
    try:
        assert native.decode_kernel() is None
        assert "using torch ops" in caplog.text
    finally:
        cpu_build.native_library.cache_clear()


# ---- linear layers (the fused ops and each instruction set: tests/test_kernels_isa.py) ----------------


def test_half_linear_upcast_matches_a_half_gemm_with_float32_accumulation():
    from pagellm.ops.dense_linear import Upcast, UpcastScratch

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
    out = Upcast(weight, UpcastScratch())(x, bias)
    assert out.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=2e-2, atol=2e-2)
