"""`pagellm serve` flags (named as `vllm serve` names them) and the Prometheus exporter, without a server."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from prometheus_client import generate_latest

from pagellm.config import DEFAULT_MODEL
from pagellm.core.kv_cache_manager import KVCacheStats
from pagellm.core.scheduler import SchedulerStats
from pagellm.entrypoints.cli import build_parser, engine_args_from, parse_size
from pagellm.metrics import IterationStats, PrometheusStatLogger, RequestTimer
from pagellm.outputs import CompletionOutput, RequestOutput
from tests.server.utils import REPO_ROOT, metric_value

VLLM_FLAGS = ["--host", "--port", "--gpu-memory-utilization", "--max-num-batched-tokens", "--max-num-seqs",
              "--block-size", "--max-model-len", "--kv-cache-memory-bytes", "--dtype", "--seed",
              "--served-model-name", "--api-key", "--max-num-queued-requests"]


def test_serve_flags_reach_the_engine_args():
    args = build_parser().parse_args([
        "serve", "/models/x", "--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "1024",
        "--max-num-seqs", "8", "--block-size", "32", "--max-model-len", "300", "--kv-cache-memory-bytes", "64MiB",
        "--dtype", "float32", "--seed", "7", "--max-num-queued-requests", "5", "--served-model-name", "a", "b",
        "--api-key", "k", "--port", "9000", "--max-request-body-bytes", "4MiB", "--shutdown-timeout", "2.5",
    ])
    engine_args = engine_args_from(args)
    assert (engine_args.model, engine_args.gpu_memory_utilization, engine_args.max_num_batched_tokens) == ("/models/x", 0.5, 1024)
    assert (engine_args.max_num_seqs, engine_args.block_size, engine_args.max_model_len) == (8, 32, 300)
    assert (engine_args.kv_cache_memory_bytes, engine_args.dtype, engine_args.seed) == (64 << 20, "float32", 7)
    assert engine_args.max_num_queued_requests == 5
    assert engine_args.enable_prefix_caching and engine_args.enable_chunked_prefill
    off = engine_args_from(build_parser().parse_args(["serve", "--no-enable-prefix-caching",
                                                      "--no-enable-chunked-prefill"]))
    assert not off.enable_prefix_caching and not off.enable_chunked_prefill
    assert (args.served_model_name, args.api_key, args.port, args.host) == (["a", "b"], ["k"], 9000, "127.0.0.1")
    assert (args.max_request_body_bytes, args.shutdown_timeout) == (4 << 20, 2.5)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.max_request_body_bytes, defaults.shutdown_timeout) == (None, 10.0)


def test_serve_defaults_to_the_embedded_model_on_loopback():
    args = build_parser().parse_args(["serve"])
    assert args.model is None and engine_args_from(args).model is None
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_help_names_every_vllm_flag():
    result = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert DEFAULT_MODEL in result.stdout
    assert "OMP_WAIT_POLICY" in result.stdout  # how the OpenMP threads wait, and how to choose otherwise
    for flag in VLLM_FLAGS:
        assert flag in result.stdout


def test_a_bad_flag_value_fails_at_once_and_names_it():
    result = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--block-size", "3"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "block_size=3" in result.stderr


# As vLLM reads them: a bare lower-case k/m/g/t is a power of 1000, upper-case K/M/G/T one of 1024.
@pytest.mark.parametrize(("text", "expected"), [("268435456", 268435456), ("256MiB", 256 << 20), ("2G", 2 << 30),
                                                ("2g", 2_000_000_000), ("2GB", 2_000_000_000), ("1.5GiB", 3 << 29),
                                                ("64k", 64_000), ("4K", 4096)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_refuses_what_is_not_a_size():
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size("lots")


def _stats(used: int, preemptions: int = 0, queries: int = 0, hits: int = 0) -> SchedulerStats:
    return SchedulerStats(1, 2, preemptions, KVCacheStats(num_blocks=10, num_used_blocks=used, num_free_blocks=10 - used,
                                                          block_size=16, num_stored_tokens=used * 12,
                                                          prefix_cache_queries=queries, prefix_cache_hits=hits,
                                                          num_shared_blocks=1, num_cow_copies=2))


def test_prometheus_logger_records_into_its_own_registry():
    # Two exporters in one process, as two servers in one test run: no collision on a global registry.
    first, second = PrometheusStatLogger("m", 512), PrometheusStatLogger("m", 512)
    iteration = IterationStats()
    timer = RequestTimer(arrival_time=0.0)
    timer.on_output(_delta([7], prompt_len=5), now=0.5, stats=iteration)
    timer.on_output(_delta([8], prompt_len=5), now=0.7, stats=iteration)
    timer.on_finish("length", now=0.7, stats=iteration)
    first.record(_stats(used=4, preemptions=3), iteration)
    second.record(_stats(used=0), IterationStats())
    text = generate_latest(first.registry).decode()
    labels = {"model_name": "m", "engine": "0"}
    assert metric_value(text, "vllm:kv_cache_usage_perc", labels) == 0.4
    assert metric_value(text, "pagellm:kv_cache_waste_perc", labels) == pytest.approx(0.25)
    assert metric_value(text, "vllm:num_requests_running", labels) == 1
    assert metric_value(text, "vllm:num_requests_waiting", labels) == 2
    assert metric_value(text, "vllm:num_preemptions_total", labels) == 3
    assert metric_value(text, "vllm:prompt_tokens_total", labels) == 5
    assert metric_value(text, "vllm:generation_tokens_total", labels) == 2
    assert metric_value(text, "vllm:time_to_first_token_seconds_sum", labels) == 0.5
    assert metric_value(text, "vllm:inter_token_latency_seconds_sum", labels) == pytest.approx(0.2)
    assert metric_value(text, "vllm:e2e_request_latency_seconds_sum", labels) == 0.7
    assert metric_value(text, "vllm:request_success_total", {**labels, "finished_reason": "length"}) == 1
    assert metric_value(generate_latest(second.registry).decode(), "vllm:kv_cache_usage_perc", labels) == 0
    # The scheduler's counts are cumulative; the counters add only the increase.
    first.record(_stats(used=4, preemptions=5, queries=100, hits=64), IterationStats())
    text = generate_latest(first.registry).decode()
    assert metric_value(text, "vllm:num_preemptions_total", labels) == 5
    assert metric_value(text, "vllm:prefix_cache_queries_total", labels) == 100
    assert metric_value(text, "vllm:prefix_cache_hits_total", labels) == 64
    assert metric_value(text, "pagellm:kv_cache_shared_blocks", labels) == 1
    assert metric_value(text, "pagellm:kv_cache_cow_copies_total", labels) == 2


def _delta(token_ids: list[int], prompt_len: int) -> RequestOutput:
    return RequestOutput("r", None, list(range(prompt_len)), [CompletionOutput(0, "", token_ids)], False)
