"""Faulting in the CPU KV pool's pages before requests need them.

The CPU pool is an anonymous mapping whose pages the kernel supplies on first write (kv_cache._zeroed_cpu), so
start-up costs nothing, but the first request to write into a block pays for its pages. On bare metal that is
the kernel clearing them; in a virtual machine whose host backs guest memory lazily it is also the host's fault,
and can cost more than the step's compute (`benchmarks/throughput.py` reports what the run paid). vLLM zeroes its
whole pool at start-up instead; pagellm faults in the blocks the block pool hands out first for a bounded time
at start-up (`kv_prefault_seconds`), and the rest while the engine is idle.

MADV_POPULATE_WRITE (Linux 5.14) faults pages in writable without changing a byte, so blocks already in use are
safe to pass over. Where the kernel lacks it nothing is faulted in ahead: first use pays, as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Faulted in per call between clock checks: an idle engine that gets a request waits at most one chunk.
CHUNK_BYTES = 8 << 20


def libc_madvise():
    """libc's madvise(address, length, advice) via ctypes, or None where it cannot be loaded."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


class KVPoolPrefaulter:
    """Faults in a CPU pool [num_layers, planes, num_blocks, ...] block by block, in block-id order, which is the
    order the block pool first hands blocks out in."""

    def __init__(self, pool: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> None:
        if pool.device.type != "cpu" or not pool.is_contiguous():
            raise ValueError(f"the prefaulter needs a contiguous CPU pool, not a {pool.device} tensor "
                             f"(contiguous={pool.is_contiguous()})")
        self.num_blocks = pool.shape[2]
        self._block_bytes = pool[0, 0, 0].numel() * pool.element_size() if self.num_blocks else 0
        # Per layer, its K and V planes (one latent plane for MLA).
        self._slab_starts = [pool[layer, plane].data_ptr() for layer in range(pool.shape[0])
                             for plane in range(pool.shape[1])]
        bytes_per_block = max(1, self._block_bytes * len(self._slab_starts))
        self._blocks_per_chunk = max(1, chunk_bytes // bytes_per_block)
        self.next_block = 0
        self._madvise = libc_madvise()
        if self._madvise is None:
            self.next_block = self.num_blocks
        # The pool tensor's storage must outlive the addresses taken above.
        self._pool = pool

    @property
    def done(self) -> bool:
        return self.next_block >= self.num_blocks

    @property
    def faulted_bytes(self) -> int:
        return self.next_block * self._block_bytes * len(self._slab_starts)

    def advance(self, seconds: float) -> bool:
        """Fault in blocks from the first not yet done, a chunk at a time, until `seconds` have passed (at least
        one chunk when seconds > 0). Returns True while blocks remain."""
        deadline = time.perf_counter() + seconds
        while seconds > 0 and not self.done:
            self._fault_in(self.next_block, min(self.num_blocks, self.next_block + self._blocks_per_chunk))
            if time.perf_counter() >= deadline:
                break
        return not self.done

    def _fault_in(self, first: int, end: int) -> None:
        for start in self._slab_starts:
            low = (start + first * self._block_bytes) // PAGE_BYTES * PAGE_BYTES
            high = start + end * self._block_bytes
            if self._madvise(low, high - low, MADV_POPULATE_WRITE) != 0:
                code = ctypes.get_errno()
                # EINVAL: a kernel before 5.14. Anything else (ENOMEM, EFAULT) also ends faulting ahead: first use
                # will fault these pages in, or report the shortage, as it would have without this.
                logger.info("KV pool pages are faulted in on first use (madvise MADV_POPULATE_WRITE: %s)",
                            errno.errorcode.get(code, code))
                self.next_block = self.num_blocks
                return
        self.next_block = end
