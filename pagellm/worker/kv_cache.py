"""Sizing and allocating the KV pool: one tensor, allocated once, zeroed, never grown."""

from __future__ import annotations

import ctypes
import logging
import os
import resource
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagellm.attention.kv_spec import KVCacheSpec

logger = logging.getLogger(__name__)
GiB = 1024**3


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    """One pool tensor [num_layers, 2 (K, V) or 1 (an MLA latent), num_blocks, kv_heads, block_size, head_dim] (or, for a quantized
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
    """Per layer, the (K, V) views [num_blocks, kv_heads, block_size, head_dim] of the pool; an MLA pool's one
    latent plane is both (the MLA layer reads the first)."""
    return [(pool[i, 0], pool[i, -1]) for i in range(pool.shape[0])]


def _zeroed_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the kernel supplies already zeroed, on first touch.

    A large calloc is an anonymous mmap: no memset at start-up (torch.zeros spends seconds faulting
    in and clearing gigabytes), and numpy asks for transparent huge pages on big arrays.
    """
    element = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)), dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[element])
    return torch.from_numpy(raw).view(dtype).view(shape)


# ---- how much memory there is --------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # what gpu_memory_utilization is a fraction of
    free: int  # what the process may still take
    described: str  # where the figures come from, for messages

    def shared_by(self, ranks: int) -> DeviceMemory:
        if ranks == 1:
            return self
        return DeviceMemory(self.total // ranks, self.free // ranks,
                            f"{self.described}, shared by {ranks} ranks on this host")


def cpu_available_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> tuple[int, str]:
    """(bytes, how they were found) this process could still take: MemAvailable, bounded by the memory limit
    of its cgroup and of every cgroup above it (v2 memory.max, or v1 memory.limit_in_bytes), less what each
    already holds other than reclaimable page cache."""
    available = _meminfo_kib(proc / "meminfo", "MemAvailable") * 1024
    described = f"MemAvailable {available / GiB:.2f} GiB"
    for where, limit, usage in _cgroup_limits(proc / "self" / "cgroup", cgroup_root):
        if limit - usage < available:
            available = max(limit - usage, 0)
            described = f"cgroup limit {limit / GiB:.2f} GiB - {usage / GiB:.2f} GiB in use ({where})"
    return available, described


# cgroup v2 and v1 names of: the limit, the usage, and the page cache in memory.stat that reclaim can drop.
_CGROUP_FILES = {
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def _cgroup_limits(self_cgroup: Path, cgroup_root: Path):
    """(directory, limit, usage) of every limited memory cgroup from this process's up to the mount's root."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            version, base = "v2", cgroup_root
        elif "memory" in controllers.split(","):
            version, base = "v1", cgroup_root / "memory"
        else:
            continue
        limit_file, usage_file, cache_key = _CGROUP_FILES[version]
        # Inside a container the mount's root may be the process's own cgroup: levels that are not there
        # are skipped, the root is always looked at.
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):
            directory = base.joinpath(*parts[:depth])
            limit = _read_limit(directory / limit_file)
            if limit is None:
                continue
            try:
                usage = int((directory / usage_file).read_text())
            except (OSError, ValueError):
                continue
            yield directory, limit, max(usage - _stat_value(directory / "memory.stat", cache_key), 0)


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    # v2 writes "max" for no limit, v1 a number near 2**63.
    return int(text) if text.isdigit() and int(text) < 1 << 60 else None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _meminfo_kib(path: Path, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not found in {path}")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def return_free_heap() -> None:
    """Hand back to the system the C heap that start-up freed (loading's conversions, the tokenizer's build, the
    profiling steps): glibc keeps freed memory below its mmap threshold in the process, where it counts in the RSS
    of a server that will not reuse most of it. Measured on Gemma 3 270M's GGUF, ~50-90 MiB. Done before the KV
    pool is allocated too, so that the pool never sits beside the profile's freed buffers (the process's peak)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to trim this way
    libc.malloc_trim(0)


_peak_before_resets = 0


def process_peak_rss() -> int:
    """The process's peak RSS in bytes since it started: VmHWM, which measure_peak resets, or the peak before the
    last reset where that was higher."""
    return max(_status_bytes("VmHWM"), _peak_before_resets)


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
    # The kernel keeps a process's peak RSS (VmHWM); writing 5 to clear_refs resets it to the current RSS. The
    # peak until then is kept for process_peak_rss.
    global _peak_before_resets
    _peak_before_resets = max(_peak_before_resets, _status_bytes("VmHWM"))
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
        resettable = True
    except OSError:
        resettable = False
    # Heap that earlier work freed would serve the block's allocations without any growth of the RSS.
    return_free_heap()
    before = _status_bytes("VmRSS")
    max_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    yield result
    if resettable:
        result["peak"] = max(0, _status_bytes("VmHWM") - before)
    else:
        result["peak"] = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - max(before, max_before))


def device_memory_at_start(device: torch.device) -> DeviceMemory:
    """The device's memory before the engine loads anything."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total, free, f"torch.cuda.mem_get_info: {free / GiB:.2f} GiB free")
    available, described = cpu_available_memory()
    return DeviceMemory(available, available, described)
