"""Each row's largest logits, ranked as a stable descending sort of the whole row ranks them (by value, then the
lower token id first): the candidates of the sampler's top-k/top-p filters and the top log-probabilities. On the
CPU library's kernel (csrc/largest.c), else torch.topk and two sorts."""

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
    """(values, ids), each [rows, count]: the first `count` entries of a stable descending sort of each row of
    `logits` [rows, vocab] (ties by lower id). Rows holding a NaN, and tensors off the CPU, are ranked by
    largest_by_sorting instead."""
    kernel = _kernel(isa) if logits.device.type == "cpu" and logits.dtype.is_floating_point else None
    if kernel is not None:
        # float32 holds every narrower float exactly: the same order and the same ties.
        rows_f32 = logits.to(torch.float32).contiguous()
        rows, vocab = logits.shape
        values = torch.empty(rows, count, dtype=torch.float32)
        ids = torch.empty(rows, count, dtype=torch.int64)
        if kernel(rows_f32.data_ptr(), rows, vocab, count, ids.data_ptr(), values.data_ptr()) == 0:
            return (values if logits.dtype is torch.float32 else logits.gather(-1, ids)), ids
    return largest_by_sorting(logits, count)


def largest_by_sorting(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk's `count` largest, ranked by value then id: largest_per_row's result except where logits tie at
    the last place, which torch.topk keeps in no set order."""
    values, ids = torch.topk(logits, count, dim=-1)
    ids, by_id = torch.sort(ids, dim=-1)
    values, by_value = torch.sort(values.gather(-1, by_id), dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, by_value)
