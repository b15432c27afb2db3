"""The CPU kernels' scratch tensors: one per thread and kind, shared by every layer (one per layer kept a copy per
layer: 186 MiB of int8 activation buffers for SmolLM2 after one 2,048-row prefill)."""

import pathlib
import threading

import pytest
import torch

from pagellm.ops.scratch import thread_scratch


def test_a_kind_is_one_tensor_per_thread_grown_never_shrunk():
    first = thread_scratch("test", "buffer", 100, torch.int8)
    assert first.numel() >= 100 and first.dtype == torch.int8
    assert thread_scratch("test", "buffer", 50, torch.int8) is first
    grown = thread_scratch("test", "buffer", 1000, torch.int8)
    assert grown.numel() >= 1000 and thread_scratch("test", "buffer", 10, torch.int8) is grown
    assert thread_scratch("test", "buffer", 10, torch.float32) is not grown
    assert thread_scratch("test", "other", 10, torch.int8) is not grown
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(thread_scratch("test", "buffer", 10, torch.int8)))
    thread.start()
    thread.join()
    assert elsewhere[0] is not grown


def test_kernel_wrappers_of_different_layers_share_their_buffers():
    from pagellm.ops.w8a8_kernels import w8a8_kernels

    first, second = w8a8_kernels(), w8a8_kernels()
    if first is None:
        pytest.skip("no C compiler or native kernels switched off")
    assert first is not second
    assert first._buffer("xq", 4096, torch.int8) is second._buffer("xq", 4096, torch.int8)


@pytest.mark.skipif(not pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="no transparent huge pages here")
def test_a_large_buffer_lies_on_huge_pages():
    """The dequantized tiles the kernels write and a GEMM streams ran slower on torch's 4 KiB pages. (Where a
    small buffer lands is torch's allocator's business: its heap may reuse memory another mapping advised.)"""
    from tests.test_huge_pages import _vma_flags

    large = thread_scratch("test", "tile", (4 << 20) // 4, torch.float32)
    large.fill_(1.0)
    assert large.numel() == (4 << 20) // 4 and large.is_contiguous() and large.sum() == large.numel()
    assert "hg" in _vma_flags(large.data_ptr())
    small = thread_scratch("test", "small", 1000, torch.bfloat16)
    assert small.dtype == torch.bfloat16 and small.numel() == 1000
