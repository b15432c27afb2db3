"""Weights on transparent huge pages where the kernel offers them on request (THP "madvise" mode, the common
default): the CPU's hardware prefetchers stop at each 4 KiB page boundary and every page costs a TLB entry, so a
kernel streaming a layer's weights (an expert's rows, 4 KiB each at hidden 1024 in float32) restarts its prefetch
on every row. The advice goes on the parameters' memory after the model is built and before any weight is
written, so the first write faults in 2 MiB pages; memory already written is left as it is."""

from __future__ import annotations

import torch

from pagellm.worker.kv_prefault import libc_madvise

MADV_HUGEPAGE = 14
HUGE_PAGE_BYTES = 2 << 20


def advise_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Asks for huge pages on the whole 2 MiB-aligned pages inside each CPU tensor's memory; returns the bytes
    advised (0 where madvise is unavailable or refuses, e.g. THP disabled)."""
    madvise = libc_madvise()
    if madvise is None:
        return 0
    advised, seen = 0, set()
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() < HUGE_PAGE_BYTES:
            continue
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in seen:
            continue
        seen.add(address)
        start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = (address + storage.nbytes()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end > start and madvise(start, end - start, MADV_HUGEPAGE) == 0:
            advised += end - start
    return advised
