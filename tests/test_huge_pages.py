"""Weights are advised onto transparent huge pages before they are written (pagellm/worker/huge_pages.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm.worker.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages

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
