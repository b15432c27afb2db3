"""Sizing and allocating the KV pool: one tensor, allocated once, zeroed, never grown."""

from __future__ import annotations

import logging
import os
import resource
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.kv_spec import KVCacheSpec
from pagellm.config import CPU_DEFAULT_KV_CACHE_BYTES

logger = logging.getLogger(__name__)
GiB = 1024**3


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    """One pool tensor [num_layers, 2 (K, V), num_blocks, kv_heads, block_size, head_dim] (or, for a quantized
    format, [..., kv_heads, run bytes]: see kv_spec.py).

    Head before position: a block's keys for one head are one contiguous run, which is what decode
    attention streams through per (sequence, kv head).

    Zeroed because masked-out slots still enter the attention product with weight 0, and stale
    NaN/inf bytes times 0 would be NaN.
    """
    shape, dtype = spec.pool_shape(num_blocks), spec.format.storage_dtype
    pool = _zeroed_cpu(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
    return pool


def layer_views(pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (K, V) views [num_blocks, kv_heads, block_size, head_dim] of the pool."""
    return [(pool[i, 0], pool[i, 1]) for i in range(pool.shape[0])]


def _zeroed_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the kernel supplies already zeroed, on first touch.

    A large calloc is an anonymous mmap: no memset at start-up (torch.zeros spends seconds faulting
    in and clearing gigabytes), and numpy asks for transparent huge pages on big arrays.
    """
    element = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)), dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[element])
    return torch.from_numpy(raw).view(dtype).view(shape)


# ---- how much memory there is --------------------------------------------------------------------


def cpu_available_bytes() -> int:
    """Memory this process could still take: MemAvailable, bounded by a cgroup limit if one is set."""
    available = _meminfo_kib("MemAvailable") * 1024
    for path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = open(path).read().strip()
            usage = int(open(usage_path).read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            available = min(available, int(limit) - usage)
    return available


def _meminfo_kib(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not found in /proc/meminfo")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


@contextmanager
def measure_peak(device: torch.device):
    """Yields a dict whose 'peak' is filled with the extra memory the block's work held at its peak."""
    result = {"peak": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = max(0, torch.cuda.max_memory_allocated(device) - before)
        return
    # The kernel keeps a process's peak RSS (VmHWM); writing 5 to clear_refs resets it to the current RSS.
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
        resettable = True
    except OSError:
        resettable = False
    before = _status_bytes("VmRSS")
    max_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    yield result
    if resettable:
        result["peak"] = max(0, _status_bytes("VmHWM") - before)
    else:
        result["peak"] = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - max(before, max_before))


@dataclass(frozen=True)
class MemoryBudget:
    total: int  # the memory the engine measures gpu_memory_utilization against
    weights: int
    activation_peak: int
    kv_cache: int
    reason: str


def kv_cache_budget(
    device: torch.device,
    gpu_memory_utilization: float,
    total_at_start: int,
    weights: int,
    activation_peak: int,
    kv_cache_memory_bytes: int | None,
) -> MemoryBudget:
    if kv_cache_memory_bytes is not None:
        return MemoryBudget(total_at_start, weights, activation_peak, kv_cache_memory_bytes, "kv_cache_memory_bytes")
    kv = int(gpu_memory_utilization * total_at_start) - weights - activation_peak
    reason = f"gpu_memory_utilization={gpu_memory_utilization}"
    if device.type == "cpu" and kv > CPU_DEFAULT_KV_CACHE_BYTES:
        kv = CPU_DEFAULT_KV_CACHE_BYTES
        reason += f", capped at the CPU default of {CPU_DEFAULT_KV_CACHE_BYTES / GiB:.0f} GiB"
    return MemoryBudget(total_at_start, weights, activation_peak, max(kv, 0), reason)


def device_memory_at_start(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of the device before the engine loads anything."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    available = cpu_available_bytes()
    return available, available
