"""Each row's largest logits, ranked as a stable descending sort of the whole row ranks them (by value, then the
lower token id first): the candidates of the sampler's top-k/top-p filters. On the CPU library's kernel
(csrc/largest.c) where it takes the row, else torch.topk and two sorts, the reference the kernel is tested against."""

from __future__ import annotations

import ctypes
import functools

import torch

from pagellm.ops.cpu_build import native_library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _kernel(isa: str | None):
    library = native_library(isa)
    if library is None:
        return None
    function = library.largest_per_row
    function.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR]
    function.restype = _I64
    return function


def largest_per_row(logits: torch.Tensor, count: int, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids), each [rows, count]: every row's `count` largest logits of `logits` [rows, vocab]."""
    kernel = _kernel(isa) if logits.device.type == "cpu" and logits.dtype is torch.float32 else None
    if kernel is not None and logits.is_contiguous():
        rows, vocab = logits.shape
        values = torch.empty(rows, count, dtype=torch.float32)
        ids = torch.empty(rows, count, dtype=torch.int64)
        if kernel(logits.data_ptr(), rows, vocab, count, ids.data_ptr(), values.data_ptr()) == 0:
            return values, ids
    return largest_by_sorting(logits, count)


def largest_by_sorting(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(logits, count, dim=-1)
    ids, by_id = torch.sort(ids, dim=-1)
    values, by_value = torch.sort(values.gather(-1, by_id), dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, by_value)
