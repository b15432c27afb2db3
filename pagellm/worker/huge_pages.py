"""Weights on transparent huge pages where the kernel offers them on request (THP "madvise" mode, the common
default): the CPU's hardware prefetchers stop at each 4 KiB page boundary and every page costs a TLB entry, so a
kernel streaming a layer's weights (an expert's rows, 4 KiB each at hidden 1024 in float32) restarts its prefetch
on every row. The advice goes on the parameters' memory after the model is built and before any weight is
written, so the first write faults in 2 MiB pages; memory already written is left as it is."""

from __future__ import annotations

import contextlib
import contextvars
import mmap
from collections.abc import Iterator

import numpy as np
import torch

from pagellm.worker.kv_cache import return_free_heap
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


# numpy asks for huge pages (madvise) on allocations from this size on; smaller ones come from the C heap.
NUMPY_HUGE_PAGE_MIN_BYTES = 4 << 20


class WeightArena:
    """Zeroed byte buffers carved from large chunks advised for transparent huge pages before they are written:
    a model's many weight tensors below numpy's threshold (a small model's layers are 0.2-3 MiB each) would
    otherwise come from the C heap on 4 KiB pages. Pieces are never freed one by one: a chunk lives while any
    piece of it does, so an arena serves one model's load."""

    def __init__(self, chunk_bytes: int = 32 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: np.ndarray | None = None
        self._used = 0
        self._freed_bytes = 0  # checkpoint tensors freed into the C heap since its last trim

    def zeros(self, nbytes: int) -> np.ndarray:
        """A zeroed uint8 array of nbytes, 64-byte aligned (one of numpy's huge-page size, or larger than a chunk,
        gets its own memory)."""
        if nbytes >= NUMPY_HUGE_PAGE_MIN_BYTES or nbytes > self.chunk_bytes:
            return np.zeros(nbytes, dtype=np.uint8)
        if self._chunk is None or self._used + nbytes > self._chunk.nbytes:
            self._new_chunk()
        piece = self._chunk[self._used : self._used + nbytes]
        self._used += -(-nbytes // 64) * 64
        return piece

    def _new_chunk(self) -> None:
        # (numpy's zeros of this size may come from the C heap, whose calloc clears, and so keeps resident, the
        # whole chunk.)
        self._chunk, self._used = huge_page_buffer(self.chunk_bytes), 0


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array of nbytes in a private anonymous mapping of its own, advised for transparent huge pages
    before any page is written (zero pages until then; 4 KiB pages where THP is disabled)."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP disabled, or a kernel without it
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, dtype=np.uint8)


_ARENA: contextvars.ContextVar[WeightArena | None] = contextvars.ContextVar("weight_arena", default=None)


@contextlib.contextmanager
def weight_arena() -> Iterator[WeightArena]:
    """Weight buffers made by `weight_zeros` inside this block share one arena."""
    token = _ARENA.set(WeightArena())
    try:
        yield _ARENA.get()
    finally:
        _ARENA.reset(token)


def weight_zeros(nbytes: int) -> np.ndarray:
    """A zeroed uint8 buffer for weights: from the current arena (huge pages) inside `weight_arena()`, else numpy's."""
    arena = _ARENA.get()
    return arena.zeros(nbytes) if arena is not None else np.zeros(nbytes, dtype=np.uint8)


def to_weight_memory(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` contiguous, copied into the load's arena inside `weight_arena()`: for a layout built by torch (whose
    allocator gives a small layer 4 KiB pages) that a kernel streams once per step. Outside a load's arena it stays
    with torch's allocator. Online quantization packs inside the arena as the checkpoint loads (README, "Quantized
    weights", has what that costs the load's peak and gains a decode step)."""
    if _ARENA.get() is None:
        return tensor.contiguous()
    buffer = torch.from_numpy(weight_zeros(tensor.numel() * tensor.element_size()))
    return buffer.view(tensor.dtype).view(tensor.shape).copy_(tensor)


# Checkpoint bytes a load frees between two trims of the C heap (note_freed).
TRIM_EVERY_BYTES = 32 << 20


def note_freed(nbytes: int) -> None:
    """A layer freed `nbytes` of checkpoint tensors after copying what it keeps into weight memory. Inside
    `weight_arena()` those copies no longer reuse the freed C heap, which would stay resident until loading ends
    (GPTQ 8-bit SmolLM2: a load peak 134 MiB higher), so the heap is handed back after every TRIM_EVERY_BYTES
    (a trim after every layer made loading 1.2 s slower)."""
    arena = _ARENA.get()
    if arena is None:
        return
    arena._freed_bytes += nbytes
    if arena._freed_bytes >= TRIM_EVERY_BYTES:
        return_free_heap()
        arena._freed_bytes = 0
