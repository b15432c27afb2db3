"""Serving metrics: what one engine iteration did, per-request timing, and a Prometheus exporter.

The engine thread measures (it alone sees when tokens are made, whatever the consumers do with them);
stat loggers only record. Names follow vLLM's (`vllm:x` -> `pagellm:x`) so existing dashboards carry over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagellm.core.scheduler import SchedulerStats
from pagellm.structured_output.grammar import GrammarCacheStats

# vLLM's buckets: they resolve both a CPU engine's seconds and a GPU's milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one pass of the engine loop produced."""

    # Prompt tokens of requests whose prefill completed (their first token came out) in this iteration.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class RequestTimer:
    """One request's timeline, kept by the engine thread."""

    arrival_time: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    last_token_time: float | None = None

    def on_tokens(self, num_tokens: int, num_prompt_tokens: int, now: float, stats: IterationStats) -> None:
        if num_tokens == 0:
            return
        if self.last_token_time is None:
            self.num_prompt_tokens = num_prompt_tokens
            stats.num_prompt_tokens += num_prompt_tokens
            stats.time_to_first_tokens.append(now - self.arrival_time)
        else:
            stats.inter_token_latencies.append(now - self.last_token_time)
        self.num_generation_tokens += num_tokens
        stats.num_generation_tokens += num_tokens
        self.last_token_time = now

    def on_finish(self, finish_reason: str, now: float, stats: IterationStats) -> None:
        stats.finished_requests.append(
            FinishedRequestStats(finish_reason, now - self.arrival_time, self.num_prompt_tokens,
                                 self.num_generation_tokens)
        )


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...


class PrometheusStatLogger:
    """Exports engine metrics into `registry`: one registry per server, so that several servers (or engines)
    in one process never collide on the global default registry."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        labels = ["model_name"]
        common = dict(labelnames=labels, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, **common).labels(model_name)

        self.num_requests_running = gauge("pagellm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("pagellm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("pagellm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.kv_cache_waste = gauge(
            "pagellm:kv_cache_waste_perc", "Fraction of the slots in allocated KV blocks that hold no token (0-1)."
        )
        self.num_preemptions = Counter("pagellm:num_preemptions", "Requests preempted (and later recomputed).",
                                       **common).labels(model_name)
        self.prompt_tokens = Counter("pagellm:prompt_tokens", "Prompt tokens prefilled.", **common).labels(model_name)
        self.generation_tokens = Counter("pagellm:generation_tokens", "Tokens generated.",
                                         **common).labels(model_name)
        self.request_success = Counter("pagellm:request_success", "Requests finished, by finish reason.",
                                       labelnames=labels + ["finished_reason"], registry=self.registry)
        self.model_name = model_name
        for reason in FINISH_REASONS:  # present (at 0) before the first request of each kind finishes
            self.request_success.labels(model_name, reason)
        self.time_to_first_token = Histogram("pagellm:time_to_first_token_seconds", "Time to first token.",
                                             buckets=TTFT_BUCKETS, **common).labels(model_name)
        self.inter_token_latency = Histogram("pagellm:inter_token_latency_seconds", "Time between output tokens.",
                                             buckets=ITL_BUCKETS, **common).labels(model_name)
        self.e2e_latency = Histogram("pagellm:e2e_request_latency_seconds", "Arrival to finish of a request.",
                                     buckets=E2E_BUCKETS, **common).labels(model_name)
        self.prefix_cache_queries = Counter("pagellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                            **common).labels(model_name)
        self.prefix_cache_hits = Counter("pagellm:prefix_cache_hits", "Prompt tokens the prefix cache held.",
                                         **common).labels(model_name)
        self.kv_cache_shared_blocks = gauge(
            "pagellm:kv_cache_shared_blocks", "KV blocks in use by more than one sequence (n > 1, beam search)."
        )
        self.cow_copies = Counter("pagellm:kv_cache_cow_copies", "Shared blocks copied on write.",
                                  **common).labels(model_name)
        self._seen_preemptions = 0
        self._seen = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_cow_copies": 0}

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.num_requests_running.set(scheduler_stats.num_running)
        self.num_requests_waiting.set(scheduler_stats.num_waiting)
        self.kv_cache_usage.set(scheduler_stats.kv_cache.usage)
        self.kv_cache_waste.set(scheduler_stats.kv_cache.waste)
        # The scheduler counts preemptions since start; the counter takes the increase.
        self.num_preemptions.inc(max(0, scheduler_stats.num_preemptions - self._seen_preemptions))
        self._seen_preemptions = max(self._seen_preemptions, scheduler_stats.num_preemptions)
        kv = scheduler_stats.kv_cache
        self.kv_cache_shared_blocks.set(kv.num_shared_blocks)
        for name, counter in (("prefix_cache_queries", self.prefix_cache_queries),
                              ("prefix_cache_hits", self.prefix_cache_hits), ("num_cow_copies", self.cow_copies)):
            total = getattr(kv, name)
            counter.inc(max(0, total - self._seen[name]))
            self._seen[name] = max(self._seen[name], total)
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for seconds in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(seconds)
        for seconds in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(seconds)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(self.model_name, finished.finish_reason).inc()
            self.e2e_latency.observe(finished.e2e_latency)


class StructuredOutputCacheCollector:
    """The compiled-grammar cache's size and traffic (GrammarCompiler.stats), read at each scrape: the cache
    changes on requests that never reach an engine step (a 400), so it is not recorded per iteration."""

    def __init__(self, model_name: str, cache_stats: Callable[[], GrammarCacheStats]) -> None:
        self.model_name = model_name
        self.cache_stats = cache_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.cache_stats()
        for name, doc, value in (
            ("entries", "Compiled structured-output grammars in the cache.", stats.entries),
            ("bytes", "Bytes of the compiled structured-output grammars in the cache.", stats.bytes),
        ):
            gauge = GaugeMetricFamily(f"pagellm:structured_output_cache_{name}", doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        for name, doc, value in (
            ("hits", "Structured-output grammars found in the cache (not parsed again).", stats.hits),
            ("misses", "Structured-output grammars not in the cache, parsed and compiled.", stats.misses),
            ("evictions", "Compiled grammars evicted from the cache (least recently used first).", stats.evictions),
        ):
            counter = CounterMetricFamily(f"pagellm:structured_output_cache_{name}", doc, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter
