"""Per-thread scratch tensors of the CPU kernels' Python wrappers, kept between calls (a fresh tensor would fault
its pages in on every call) and shared by every layer the thread runs: layers run one after another, so one buffer
of each kind serves them all, where one per layer kept a copy per layer (the int8 W8A8 activations' buffers for a
2,048-row prefill chunk, one set per linear layer: 186 MiB for SmolLM2). Buffers of HUGE_PAGE_MIN_BYTES or more
are mapped on transparent huge pages: the dequantized weight tiles the kernels write and a GEMM then streams ran
slower on torch's 4 KiB pages (README, "AWQ, GPTQ and fp8 on AMX's tiles")."""

from __future__ import annotations

import threading

import torch

from pagellm.worker.huge_pages import HUGE_PAGE_BYTES, huge_page_buffer

_per_thread = threading.local()
HUGE_PAGE_MIN_BYTES = HUGE_PAGE_BYTES


def thread_scratch(owner: str, name: str, elements: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of at least `elements` of `dtype`, this thread's for (owner, name): grown, never shrunk. Its
    contents last until the next call for the same key, so a caller uses it within one kernel call."""
    buffers = _per_thread.__dict__.setdefault("buffers", {})
    key = (owner, name, dtype)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < elements:
        buffer = buffers[key] = _allocate(max(elements, 1), dtype)
    return buffer


def _allocate(elements: int, dtype: torch.dtype) -> torch.Tensor:
    nbytes = elements * dtype.itemsize
    if nbytes < HUGE_PAGE_MIN_BYTES:
        return torch.empty(elements, dtype=dtype)
    rounded = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    return torch.from_numpy(huge_page_buffer(rounded)).view(dtype)[:elements]
