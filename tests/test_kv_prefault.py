"""Faulting in the CPU KV pool ahead of use: which pages, in what order, without changing a byte."""

import ctypes
import math
import mmap
import threading

import numpy as np
import pytest
import torch

from pagellm.worker.kv_prefault import PAGE_BYTES, KVPoolPrefaulter

MAPPINGS: list[mmap.mmap] = []
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident(address: int, length: int) -> np.ndarray:
    """Per page of [address, address + length): whether it is in memory (mincore)."""
    start = address // PAGE_BYTES * PAGE_BYTES
    pages = -(-(address + length - start) // PAGE_BYTES)
    vec = np.zeros(pages, dtype=np.uint8)
    assert LIBC.mincore(start, address + length - start, vec.ctypes.data) == 0, ctypes.get_errno()
    return (vec & 1).astype(bool)


def block_resident(pool: torch.Tensor, layer: int, kv: int, block: int) -> bool:
    view = pool[layer, kv, block]
    return bool(resident(view.data_ptr(), view.numel() * view.element_size()).all())


def fresh_pool(num_blocks: int = 2048) -> torch.Tensor:
    """2 layers, 2 kv heads, 16 positions, 64 dims, fp32: 8 KiB per (layer, K/V) block, 32 KiB per block id, in
    a mapping of its own, so that no page is resident before the test touches it (a calloc may come from the
    heap in a long-lived process, cleared and so resident)."""
    shape = (2, 2, num_blocks, 2, 16, 64)
    mapping = mmap.mmap(-1, int(np.prod(shape)) * 4)
    pool = torch.frombuffer(mapping, dtype=torch.float32).view(shape)
    MAPPINGS.append(mapping)  # kept open for as long as the pool is used
    return pool


def test_fresh_pool_is_not_resident_until_prefaulted():
    pool = fresh_pool()
    assert not any(block_resident(pool, layer, kv, b) for layer in range(2) for kv in range(2) for b in (0, 1000, 2047))
    prefaulter = KVPoolPrefaulter(pool)
    assert not prefaulter.advance(math.inf)
    assert prefaulter.done and prefaulter.next_block == 2048
    assert all(block_resident(pool, layer, kv, b) for layer in range(2) for kv in range(2) for b in range(2048))


def test_blocks_are_faulted_in_from_block_zero_one_chunk_at_a_time():
    pool = fresh_pool()  # 16 MiB per (layer, K/V) slab: its middle is far from any huge page touched
    prefaulter = KVPoolPrefaulter(pool, chunk_bytes=64 * 32 * 1024)  # 64 block ids per chunk
    assert prefaulter.advance(0) and prefaulter.next_block == 0  # no time: nothing done
    assert prefaulter.advance(1e-9)  # some time: at least one chunk
    done = prefaulter.next_block
    assert done % 64 == 0 and 64 <= done < 1000
    for layer in range(2):
        for kv in range(2):
            assert all(block_resident(pool, layer, kv, b) for b in range(done))
            assert not block_resident(pool, layer, kv, 1000)
    assert prefaulter.faulted_bytes == done * 4 * 8 * 1024


def test_prefaulting_leaves_every_byte_and_concurrent_writes_alone():
    pool = fresh_pool()
    gen = torch.Generator().manual_seed(0)
    pool[:, :, :1000] = torch.randn(pool[:, :, :1000].shape, generator=gen)
    before = pool.clone()
    writes = torch.randn(pool[:, :, 1000:].shape, generator=gen)
    prefaulter = KVPoolPrefaulter(pool, chunk_bytes=16 * 32 * 1024)
    # Blocks handed out while the rest is faulted in are written by the engine at the same time.
    writer = threading.Thread(target=lambda: pool[:, :, 1000:].copy_(writes))
    writer.start()
    prefaulter.advance(math.inf)
    writer.join()
    assert torch.equal(pool[:, :, :1000], before[:, :, :1000])
    assert torch.equal(pool[:, :, 1000:], writes)


def test_only_contiguous_cpu_pools():
    pool = fresh_pool(8)
    with pytest.raises(ValueError, match="contiguous CPU pool"):
        KVPoolPrefaulter(pool.transpose(0, 1))


def test_engine_faults_in_at_start_up_and_when_idle(tiny_llama_dir):
    from pagellm import LLM, EngineArgs

    with pytest.raises(ValueError, match="kv_prefault_seconds=-1"):
        EngineArgs(kv_prefault_seconds=-1)
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20, kv_prefault_seconds=0)
    prefaulter = llm.llm_engine.core.executor.driver.kv_prefaulter
    assert prefaulter.next_block == 0
    assert llm.llm_engine.prefault_kv_cache(math.inf) is False
    assert prefaulter.done
    everything = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20, kv_prefault_seconds=math.inf)
    assert everything.llm_engine.core.executor.driver.kv_prefaulter.done
