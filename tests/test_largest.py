"""csrc/largest.c: each row's largest logits, equal to the first entries of a stable descending sort of the whole
row, on every instruction set this CPU runs; rows it refuses come back from torch."""

from __future__ import annotations

import pytest
import torch

from pagellm.ops import cpu_build
from pagellm.ops.largest import _kernel, largest_by_sorting, largest_per_row


@pytest.fixture(params=cpu_build.runnable_isas())
def kernel(request):
    function = _kernel(request.param)
    if function is None:
        pytest.skip("no C compiler")
    return request.param, function


def _rows(kind: str, rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    if kind == "ties":  # few distinct values: ties at every rank, the boundary's included
        return torch.randint(-4, 4, (rows, vocab), generator=generator).float()
    x = torch.randn(rows, vocab, generator=generator) * 3
    if kind == "masked":  # most of each row -inf, as banned or disallowed tokens leave it
        x[torch.rand(rows, vocab, generator=generator) < 0.9] = float("-inf")
    elif kind == "signed zeros":  # -0 and +0 are one value to a sort: ranked by token id
        x = torch.where(torch.rand(rows, vocab, generator=generator) < 0.5, -0.0, 0.0)
        x[:, vocab // 3] = 1.0
    elif kind == "infinities":
        x[:, 5] = float("inf")
        x[:, 9] = float("inf")
    return x


def _whole_row_sort(x: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[:, :count], ids[:, :count]


# Rows of at least 16 logits (the widest vector, the smallest block) per asked-for logit: the kernel takes them on
# every instruction set.
SIZES = [(vocab, count) for vocab in (262144, 49152, 1003, 96) for count in (1, 7, 256, 4096) if 16 * count <= vocab]


@pytest.mark.parametrize("vocab,count", SIZES)
@pytest.mark.parametrize("kind", ["normal", "ties", "masked", "signed zeros", "infinities"])
def test_the_kernel_ranks_as_a_stable_sort_of_the_whole_row(kernel, vocab, count, kind):
    isa, function = kernel
    generator = torch.Generator().manual_seed(vocab * 31 + count)
    x = _rows(kind, 3, vocab, generator)
    values = torch.empty(3, count)
    ids = torch.empty(3, count, dtype=torch.int64)
    assert function(x.data_ptr(), 3, vocab, count, ids.data_ptr(), values.data_ptr()) == 0
    expected_values, expected_ids = _whole_row_sort(x, count)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(values, expected_values)
    assert torch.equal(torch.signbit(values), torch.signbit(expected_values))  # the row's own values, -0 kept


def test_refused_rows_are_ranked_by_torch(kernel):
    isa, function = kernel
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4096, generator=generator)
    x[1, 17] = float("nan")
    masked = torch.full((2, 4096), float("-inf"))
    masked[:, :3] = 1.0  # three finite logits: fewer than the blocks asked for
    for rows, count, reason in ((x, 8, 1), (masked, 8, 2), (x, 4096, 4), (x, 0, 4)):
        out = torch.empty(2, max(count, 1)), torch.empty(2, max(count, 1), dtype=torch.int64)
        assert function(rows.data_ptr(), 2, 4096, count, out[1].data_ptr(), out[0].data_ptr()) == reason
    for rows, count in ((x, 8), (masked, 8), (x, 4096)):
        values, ids = largest_per_row(rows, count, isa)
        expected_values, expected_ids = largest_by_sorting(rows, count)
        assert torch.equal(ids, expected_ids)
        assert torch.allclose(values, expected_values, rtol=0, atol=0, equal_nan=True)


def test_other_inputs_take_torch():
    x = torch.randn(4, 300, dtype=torch.float64)
    values, ids = largest_per_row(x, 5)
    assert values.dtype == torch.float64
    assert torch.equal(ids, largest_by_sorting(x, 5)[1])
    strided = torch.randn(300, 4).t()
    assert torch.equal(largest_per_row(strided, 5)[1], largest_by_sorting(strided, 5)[1])
