"""csrc/largest.c: each row's largest logits, equal to the first entries of a stable descending sort of the whole
row, on every instruction set this CPU runs; rows it refuses come back from torch."""

from __future__ import annotations

import pytest
import torch

from pagellm.ops import cpu_build
from pagellm.ops.largest import _kernel, largest_by_sorting, largest_per_row
from tests.helpers import built_or_skip


@pytest.fixture(params=cpu_build.runnable_isas())
def kernel(request):
    function = built_or_skip(_kernel(request.param), "_kernel(request.param)")
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
        x[:, [vocab // 2, vocab - 1]] = float("inf")
    return x


def _whole_row_sort(x: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[:, :count], ids[:, :count]


SIZES = [(vocab, count) for vocab in (262144, 49152, 1003, 96, 7) for count in (1, 7, 256, 4096) if count <= vocab]


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


def test_rows_with_a_nan_are_refused_and_ranked_by_torch(kernel):
    isa, function = kernel
    x = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0))
    x[1, 17] = float("nan")
    for count, reason in ((8, 1), (0, 4), (4097, 4)):
        values, ids = torch.empty(2, max(count, 1)), torch.empty(2, max(count, 1), dtype=torch.int64)
        assert function(x.data_ptr(), 2, 4096, count, ids.data_ptr(), values.data_ptr()) == reason
    values, ids = largest_per_row(x, 8, isa)
    expected_values, expected_ids = largest_by_sorting(x, 8)
    assert torch.equal(ids, expected_ids)
    assert torch.allclose(values, expected_values, rtol=0, atol=0, equal_nan=True)


def test_fewer_finite_logits_than_asked_for_come_first_then_the_minus_infinities_by_id(kernel):
    isa, _ = kernel
    x = torch.full((2, 20000), float("-inf"))
    x[0, [5, 19999, 700]] = torch.tensor([1.0, 3.0, 1.0])
    x[1, 12345] = -2.0
    values, ids = largest_per_row(x, 6, isa)
    assert ids.tolist() == [[19999, 5, 700, 0, 1, 2], [12345, 0, 1, 2, 3, 4]]
    assert values[0, :3].tolist() == [3.0, 1.0, 1.0] and values[1, 0] == -2.0
    assert torch.isneginf(values[0, 3:]).all() and torch.isneginf(values[1, 1:]).all()


def test_narrower_floats_rank_as_float32_and_keep_their_dtype():
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)).bfloat16()  # ties are common in bfloat16
    values, ids = largest_per_row(x, 40)
    expected_values, expected_ids = _whole_row_sort(x.float(), 40)
    assert values.dtype == torch.bfloat16
    assert torch.equal(ids, expected_ids) and torch.equal(values.float(), expected_values)


def test_strided_rows_are_ranked_too():
    strided = torch.randn(300, 4, generator=torch.Generator().manual_seed(2)).t()
    assert torch.equal(largest_per_row(strided, 5)[1], _whole_row_sort(strided, 5)[1])
