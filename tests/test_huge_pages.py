"""Weights are advised onto transparent huge pages before they are written (pagellm/worker/huge_pages.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagellm.worker import huge_pages
from pagellm.worker.huge_pages import (
    HUGE_PAGE_BYTES,
    NUMPY_HUGE_PAGE_MIN_BYTES,
    WeightArena,
    advise_huge_pages,
    to_weight_memory,
    weight_arena,
    weight_zeros,
)

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`, from /proc/self/smaps."""
    inside, flags = False, []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            flags = line.split()[1:]
    return flags


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_large_weight_is_advised_and_a_small_one_is_not():
    large = torch.empty(4 * HUGE_PAGE_BYTES // 4)  # 8 MiB of float32: at least one whole aligned 2 MiB page
    small = torch.empty(1024)
    advised = advise_huge_pages([large, small, large])  # a tensor twice counts once
    assert HUGE_PAGE_BYTES <= advised <= large.untyped_storage().nbytes()
    assert advised % HUGE_PAGE_BYTES == 0
    aligned = -(-large.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    assert "hg" in _vma_flags(aligned)  # VM_HUGEPAGE: the kernel may back it with 2 MiB pages
    large.fill_(1.0)
    assert float(large.sum()) == large.numel()


def test_small_and_empty_tensors_are_left_alone():
    assert advise_huge_pages([torch.empty(16), torch.empty(0)]) == 0


def test_the_weight_arena_hands_out_zeroed_aligned_pieces_of_shared_chunks():
    arena = WeightArena(chunk_bytes=1 << 20)
    pieces = [arena.zeros(size) for size in (100, 64, 4000, 1)]
    assert all(piece.dtype == np.uint8 and not piece.any() for piece in pieces)
    assert [piece.nbytes for piece in pieces] == [100, 64, 4000, 1]
    assert all(piece.ctypes.data % 64 == 0 for piece in pieces)
    base = pieces[0].base
    assert all(piece.base is base for piece in pieces)  # one chunk
    for piece in pieces:
        piece[:] = 7
    assert all((piece == 7).all() for piece in pieces)  # no two pieces overlap
    bigger = arena.zeros((1 << 20) - 64)  # does not fit the rest of the chunk: a new one
    assert bigger.base is not base and not bigger.any()
    own = arena.zeros(NUMPY_HUGE_PAGE_MIN_BYTES)  # numpy's own huge pages: no chunk
    assert own.base is None and own.nbytes == NUMPY_HUGE_PAGE_MIN_BYTES
    beyond = arena.zeros((1 << 20) + 1)  # more than a chunk holds
    assert beyond.base is None and beyond.nbytes == (1 << 20) + 1


def test_weight_zeros_uses_the_arena_of_its_block_only():
    outside = weight_zeros(128)
    assert outside.base is None
    with weight_arena():
        first, second = weight_zeros(128), weight_zeros(128)
    assert first.base is second.base is not None
    assert weight_zeros(128).base is None


def test_to_weight_memory_copies_a_layout_into_the_arena():
    source = torch.arange(4 * 6 * 8, dtype=torch.int32).view(4, 6, 8).permute(1, 0, 2)  # a view, not contiguous
    with weight_arena() as arena:
        copy = to_weight_memory(source)
        scales = to_weight_memory(torch.rand(3, 5))
    assert torch.equal(copy, source) and copy.is_contiguous() and copy.dtype == torch.int32
    assert copy.data_ptr() % 64 == 0 and copy.data_ptr() != source.data_ptr()
    chunk = arena._chunk.ctypes.data
    assert chunk <= copy.data_ptr() < scales.data_ptr() < chunk + arena.chunk_bytes  # one chunk, one after the other
    outside = to_weight_memory(source)  # no load's arena: torch's allocator, as a contiguous copy
    assert torch.equal(outside, source) and outside.is_contiguous()
    assert not chunk <= outside.data_ptr() < chunk + arena.chunk_bytes


def test_freed_checkpoint_memory_is_trimmed_every_32_mib_inside_a_load_only(monkeypatch):
    trims = []
    monkeypatch.setattr(huge_pages, "return_free_heap", lambda: trims.append(1))
    huge_pages.note_freed(huge_pages.TRIM_EVERY_BYTES)
    assert trims == []  # no load's arena: nothing of it is in the arena
    with weight_arena():
        for _ in range(7):
            huge_pages.note_freed(huge_pages.TRIM_EVERY_BYTES // 2)
    assert len(trims) == 3  # after the 2nd, 4th and 6th


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_gguf_models_small_layers_lie_on_huge_page_chunks():
    """Each linear layer of the default model (SmolLM2 GGUF) is well under numpy's huge-page size; they are packed
    into the load's arena, whose chunks are advised for huge pages before they are written."""
    from pagellm import LLM

    llm = LLM(kv_cache_memory_bytes=4 << 20, max_model_len=64, max_num_seqs=2)
    model = llm.llm_engine.core.runner.model
    weights = [module.weight for module in model.modules() if getattr(module, "quantized_parts", None)]
    small = [w for w in weights if w.untyped_storage().nbytes() < NUMPY_HUGE_PAGE_MIN_BYTES]
    assert len(small) >= 60  # o_proj and down_proj of 30 layers at least
    assert all("hg" in _vma_flags(w.data_ptr()) for w in small)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_an_awq_models_kernel_layouts_lie_on_huge_page_chunks(tmp_path, tiny_llama_dir):
    """The group-quantized kernels' packed weights and scales are built in the load's arena (the one-row product
    streams them from memory), not on torch's 4 KiB pages."""
    from pagellm import LLM
    from pagellm.ops.wna16 import CpuGroupQuant
    from tests.quant_checkpoints import QuantSpec, write_quantized

    write_quantized(tiny_llama_dir, tmp_path / "awq", tmp_path / "dequantized", QuantSpec("awq", group_size=32))
    llm = LLM(str(tmp_path / "awq"), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=64,
              max_num_seqs=2)
    kernels = [module.group_quant_kernel for module in llm.llm_engine.core.runner.model.modules()
               if hasattr(module, "group_quant_kernel")]
    if not kernels or not isinstance(kernels[0], CpuGroupQuant):
        pytest.skip("the C kernels cannot be built here")
    layouts = [layout for kernel in kernels for _, layout in kernel.layouts]
    assert len(layouts) >= 12  # q/k/v, o, gate/up and down of 3 layers at least
    assert all("hg" in _vma_flags(tensor.data_ptr()) for layout in layouts for tensor in (layout.packed, layout.gparams))



@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_compressed_tensors_int8_models_packed_weights_lie_on_huge_page_chunks(tmp_path, tiny_llama_dir):
    from pagellm import LLM
    from tests.w8a8_checkpoints import write_quantized as write_w8a8

    quantized, _ = write_w8a8(tiny_llama_dir, tmp_path, "int8-channel-dynamic")
    llm = LLM(quantized, dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=64, max_num_seqs=2)
    packed = [module.int8_linear.packed.packed for module in llm.llm_engine.core.runner.model.modules()
              if getattr(getattr(module, "int8_linear", None), "packed", None) is not None]
    if not packed:
        pytest.skip("the C kernels cannot be built here")
    assert len(packed) >= 12
    assert all("hg" in _vma_flags(tensor.data_ptr()) for tensor in packed)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_online_quantized_packed_weights_lie_on_huge_page_chunks(tiny_llama_dir, quantization):
    """Online quantization packs each layer as the checkpoint loads, inside the load's arena too: one-stream decode
    streams those layouts as it streams a checkpoint's."""
    from pagellm import LLM
    from pagellm.ops.w8a8_kernels import NativeFp8Linear, NativeInt8Linear

    llm = LLM(tiny_llama_dir, dtype="float32", quantization=quantization, kv_cache_memory_bytes=4 << 20,
              max_model_len=64, max_num_seqs=2)
    kernels = [module.online_kernel for module in llm.llm_engine.core.runner.model.modules()
               if getattr(module, "online_kernel", None) is not None]
    packed = [kernel.packed.packed for kernel in kernels if isinstance(kernel, (NativeInt8Linear, NativeFp8Linear))]
    if not packed:
        pytest.skip("the C kernels cannot be built here")
    assert len(packed) >= 12
    assert all("hg" in _vma_flags(tensor.data_ptr()) for tensor in packed)
