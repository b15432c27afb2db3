"""The workload generator and the shared metric arithmetic."""

from __future__ import annotations

import argparse
from fractions import Fraction

import numpy as np
import pytest

from benchmarks.workload import (
    Distribution,
    ThroughputResult,
    WorkloadSpec,
    format_table,
    generate_workload,
    length_range,
    parse_ratio,
    percentile,
    sampleable_token_ids,
)

VOCAB = np.arange(100, 200)


def test_defaults_give_the_reference_ranges():
    spec = WorkloadSpec()
    assert (spec.prompt_range.low, spec.prompt_range.high) == (64, 512)
    assert (spec.output_range.low, spec.output_range.high) == (32, 256)


def test_ratio_bounds_are_exact_where_floats_would_widen_them():
    # 288 * (1 + 7/9) is 512 exactly; a float ratio can push the ceiling to 513.
    assert length_range(288, Fraction(7, 9)) == length_range(288, parse_ratio("7/9"))
    assert length_range(288, Fraction(7, 9)).high == 512
    assert length_range(144, parse_ratio("0.5")) == length_range(144, Fraction(1, 2))
    assert (length_range(144, Fraction(1, 2)).low, length_range(144, Fraction(1, 2)).high) == (72, 216)


def test_lengths_never_drop_below_one():
    assert length_range(1, Fraction(9, 10)).low == 1
    assert length_range(2, Fraction(0)).low == length_range(2, Fraction(0)).high == 2


@pytest.mark.parametrize("text", ["1", "1.5", "-0.1", "abc", "1/0"])
def test_bad_ratios_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_ratio(text)


def test_lengths_in_range_and_totals_exact():
    spec = WorkloadSpec(num_prompts=200, input_len=40, output_len=20, range_ratio=Fraction(1, 2), seed=3)
    workload = generate_workload(spec, VOCAB)
    assert len(workload.requests) == 200
    assert all(r.prompt_len in spec.prompt_range for r in workload.requests)
    assert all(r.output_len in spec.output_range for r in workload.requests)
    assert workload.num_prompt_tokens == sum(len(r.prompt_token_ids) for r in workload.requests)
    assert workload.num_output_tokens == sum(r.output_len for r in workload.requests)
    # Uniform over the whole range: both ends are drawn.
    assert {r.prompt_len for r in workload.requests} >= {spec.prompt_range.low, spec.prompt_range.high}
    assert all(100 <= t < 200 for r in workload.requests for t in r.prompt_token_ids)


def test_same_seed_same_workload_other_seed_other_workload():
    spec = WorkloadSpec(num_prompts=10, input_len=30, output_len=10, seed=7)
    first, again = generate_workload(spec, VOCAB), generate_workload(spec, VOCAB)
    assert first.requests == again.requests
    other = generate_workload(WorkloadSpec(num_prompts=10, input_len=30, output_len=10, seed=8), VOCAB)
    assert other.requests != first.requests


def test_default_seed_totals_are_pinned():
    # A change here changes every published figure: it must be deliberate.
    workload = generate_workload(WorkloadSpec(), VOCAB)
    assert (workload.num_prompt_tokens, workload.num_output_tokens) == (18715, 9388)


def test_zero_ratio_gives_fixed_lengths():
    workload = generate_workload(WorkloadSpec(num_prompts=5, input_len=12, output_len=4, range_ratio=Fraction(0)), VOCAB)
    assert {(r.prompt_len, r.output_len) for r in workload.requests} == {(12, 4)}


def test_prompts_use_no_special_or_added_tokens(default_tokenizer):
    ids = sampleable_token_ids(default_tokenizer)
    special = set(default_tokenizer.all_special_ids) | set(default_tokenizer.get_added_vocab().values())
    assert special and not special & set(ids.tolist())
    assert len(ids) == len(default_tokenizer) - len(special)


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 100):
        values = rng.exponential(size=size).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)


def test_distribution_of_nothing_is_empty_not_zero():
    empty = Distribution.of([])
    assert (empty.mean, empty.median, empty.p99, empty.count) == (None, None, None, 0)
    dist = Distribution.of([1.0, 2.0, 6.0]).scaled(1000)
    assert (dist.mean, dist.median, dist.count) == (3000.0, 2000.0, 3)


def test_throughput_rates():
    result = ThroughputResult("x", "float32", num_requests=4, num_prompt_tokens=300, num_output_tokens=100, seconds=2.0)
    assert (result.requests_per_s, result.output_tokens_per_s, result.total_tokens_per_s) == (2.0, 50.0, 200.0)
    assert result.as_json()["total_tokens_per_s"] == 200.0


def test_table_aligns_columns():
    lines = format_table(["name", "value"], [["a", 1234], ["bb", 0.5]]).splitlines()
    assert lines[0].split() == ["name", "value"]
    assert lines[2].endswith("1,234") and lines[3].endswith("0.500")
    assert len({len(line) for line in lines[1:]}) == 1
