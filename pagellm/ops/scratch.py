"""Per-thread scratch tensors of the CPU kernels' Python wrappers, kept between calls (a fresh tensor would fault
its pages in on every call) and shared by every layer the thread runs: layers run one after another, so one buffer
of each kind serves them all, where one per layer kept a copy per layer (the int8 W8A8 activations' buffers for a
2,048-row prefill chunk, one set per linear layer: 186 MiB for SmolLM2)."""

from __future__ import annotations

import threading

import torch

_per_thread = threading.local()


def thread_scratch(owner: str, name: str, elements: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of at least `elements` of `dtype`, this thread's for (owner, name): grown, never shrunk. Its
    contents last until the next call for the same key, so a caller uses it within one kernel call."""
    buffers = _per_thread.__dict__.setdefault("buffers", {})
    key = (owner, name, dtype)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < elements:
        buffer = buffers[key] = torch.empty(max(elements, 1), dtype=dtype)
    return buffer
