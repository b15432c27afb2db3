"""throughput.py: useful-token accounting of static batches, and a whole run on the tiny model."""

from __future__ import annotations

import json

import pytest

from benchmarks import throughput
from benchmarks.throughput import static_batch_tokens, static_batches
from benchmarks.workload import BenchRequest, WorkloadSpec, generate_workload, load_tokenizer, sampleable_token_ids


def request(prompt_len: int, output_len: int) -> BenchRequest:
    return BenchRequest(list(range(prompt_len)), output_len)


def test_static_batches_keep_submission_order():
    requests = [request(n, 1) for n in range(1, 6)]
    batches = static_batches(requests, 2)
    assert [[r.prompt_len for r in batch] for batch in batches] == [[1, 2], [3, 4], [5]]
    with pytest.raises(ValueError):
        static_batches(requests, 0)


def test_static_batches_count_only_each_requests_own_tokens():
    # Batch 1: prompts 3 and 5 padded to 5, outputs 2 and 4 both run for 4. Batch 2: one request, no padding.
    batches = [[request(3, 2), request(5, 4)], [request(7, 1)]]
    tokens = static_batch_tokens(batches)
    assert (tokens.useful_prompt_tokens, tokens.useful_output_tokens) == (15, 7)
    assert (tokens.computed_prompt_tokens, tokens.computed_output_tokens) == (17, 9)
    assert tokens.padding_fraction == pytest.approx(1 - 22 / 26)


def test_pagellm_and_hf_on_the_tiny_model(tiny_llama_dir, capsys):
    argv = ["--model", tiny_llama_dir, "--dtype", "float32", "--num-prompts", "5", "--input-len", "12",
            "--output-len", "6", "--range-ratio", "1/2", "--seed", "2", "--compare", "hf", "--batch-size", "2"]
    results = throughput.main(argv)
    out = capsys.readouterr().out
    tokenizer = load_tokenizer(tiny_llama_dir)
    workload = generate_workload(WorkloadSpec.from_args(throughput.parse_args(argv)), sampleable_token_ids(tokenizer))

    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [line["engine"] for line in lines] == ["pagellm", "transformers (static batches of 2)"]
    for line, result in zip(lines, results):
        assert line["num_requests"] == 5 and line["dtype"] == "float32"
        assert line["num_prompt_tokens"] == workload.num_prompt_tokens == result.num_prompt_tokens
        assert line["num_output_tokens"] == workload.num_output_tokens == result.num_output_tokens
        assert line["output_tokens_per_s"] > 0 and line["total_tokens_per_s"] > line["output_tokens_per_s"]
    assert lines[0]["startup_core_s"] > 0 and lines[0]["startup_ready_s"] >= lines[0]["startup_core_s"]
    assert "pagellm start-up:" in out and "% padding" in out and "load average" in out
    assert all(line["cpus"] >= 1 and line["loadavg_start"] >= 0 for line in lines)
    # Figures from different CPUs must never be mixed up: the model and each speed flag, present or not.
    from pagellm.cpu_features import SPEED_FLAGS, cpu_description, cpu_flags

    assert all(line["cpu"] == cpu_description() for line in lines)
    assert all(line["cpu_flags"] == {flag: flag in cpu_flags() for flag in SPEED_FLAGS} for line in lines)
    assert f"CPU: {cpu_description()}" in out
