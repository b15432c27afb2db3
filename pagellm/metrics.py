"""Serving metrics: what one engine iteration did, per-request timing, and a Prometheus exporter.

The engine thread measures (it alone sees when requests are handed to the scheduler, first scheduled, and
when tokens are made, whatever the consumers do with them); stat loggers only record.

The exporter writes vLLM's metrics under vLLM's own names, types, help texts, buckets and labels
(`vllm:*`, labels `model_name` and `engine`; vLLM 0.32's `PrometheusStatLogger`, vllm/v1/metrics/loggers.py),
so that vLLM's Grafana dashboards and alerts read pagellm unchanged. What vLLM has no metric for (KV waste,
shared blocks, copy-on-write) is pagellm's own, under `pagellm:*`.

A user request counts once, whatever its n: vLLM runs n > 1 as n child requests and counts each of them
(request_success, e2e latency, ...); here the n samples share one prompt computation, one timeline and one
entry, with generation tokens summed over its samples and `vllm:request_max_num_generation_tokens` the
longest sample, as vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagellm.core.scheduler import SchedulerStats
from pagellm.structured_output.grammar import GrammarCacheStats

if TYPE_CHECKING:
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.outputs import RequestOutput

# The vLLM release whose metric set this follows (the set is the same in 0.33).
VLLM_METRICS_VERSION = "0.32.0"

# vLLM's default buckets (vllm/v1/metrics/buckets.py). The latency ones resolve both a CPU engine's seconds
# and a GPU's milliseconds.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# Label values vLLM creates up front, so that every series exists (at 0) before its first event.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, in its order
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
# The frontend queue limits; pagellm has the first (--max-num-queued-requests).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
QUEUE_FULL_REASON = "max_num_queued_reqs"


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class FinishedRequestStats:
    """One user request at its end. The phases are vLLM's: queued (handed to the scheduler -> first
    scheduled), prefill (first scheduled -> first token), decode (first token -> last token) and inference
    (first scheduled -> last token); time spent preempted counts in the phase it interrupted."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    mean_time_per_output_token: float = 0.0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # The longest of its samples (n > 1), and its n and max_tokens parameters.
    max_num_generation_tokens: int = 0
    n: int = 1
    max_tokens_param: int | None = None


@dataclass
class IterationStats:
    """What one pass of the engine loop produced."""

    # Whether the pass ran a step that scheduled tokens (vllm:iteration_tokens_total observes only those).
    stepped: bool = False
    # Prompt tokens of requests whose prefill completed (their first token came out) in this iteration,
    # and how many of those came from the prefix cache.
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Waiting requests that cannot be scheduled until their structured-output grammar compiles (vLLM's
    # "deferred" waiting reason); and requests refused by the queue limit since the last iteration.
    num_waiting_deferred: int = 0
    num_admission_rejections: int = 0

    @property
    def num_computed_prompt_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_prompt_tokens


@dataclass
class RequestTimer:
    """One user request's timeline, kept by the engine thread (times from one monotonic clock)."""

    arrival_time: float
    n: int = 1
    max_tokens: int | None = None
    # Without max_tokens a request may produce what max_model_len leaves after its prompt: vLLM's server
    # records that as its max_tokens.
    max_model_len: int | None = None
    queued_time: float | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    # Tokens of each sample (CompletionOutput.index -> count).
    sample_tokens: dict[int, int] = field(default_factory=dict)

    def on_queued(self, now: float) -> None:
        """Handed to the scheduler (vLLM's QUEUED event)."""
        self.queued_time = now

    def on_scheduled(self, now: float) -> None:
        """In a step's batch; only the first time counts (vLLM's first SCHEDULED event; later ones follow
        preemptions)."""
        if self.scheduled_time is None:
            self.scheduled_time = now

    def on_output(self, output: RequestOutput, now: float, stats: IterationStats) -> None:
        """One delta output of the request (its new tokens per sample)."""
        self.num_prompt_tokens = len(output.prompt_token_ids)
        self.num_cached_tokens = min(output.num_cached_tokens, self.num_prompt_tokens)
        if output.kv is not None:
            self.num_preemptions = output.kv.preemptions
        num_tokens = 0
        for completion in output.outputs:
            if completion.token_ids:
                self.sample_tokens[completion.index] = self.sample_tokens.get(completion.index, 0) + len(
                    completion.token_ids)
                num_tokens += len(completion.token_ids)
        if num_tokens == 0:
            return
        if self.first_token_time is None:
            stats.num_prompt_tokens += self.num_prompt_tokens
            stats.num_cached_prompt_tokens += self.num_cached_tokens
            stats.time_to_first_tokens.append(now - self.arrival_time)
            self.first_token_time = now
        else:
            stats.inter_token_latencies.append(now - self.last_token_time)
        self.num_generation_tokens += num_tokens
        stats.num_generation_tokens += num_tokens
        self.last_token_time = now

    def on_finish(self, finish_reason: str, now: float, stats: IterationStats) -> None:
        stats.finished_requests.append(self.finished(finish_reason, now))

    def finished(self, finish_reason: str, now: float) -> FinishedRequestStats:
        """The request's stats as it ends at `now`. A phase it never reached is 0; one it was in when it
        ended (an abort or error) lasts until `now`."""
        queued = self.arrival_time if self.queued_time is None else self.queued_time
        scheduled = self.scheduled_time
        queued_time = (now if scheduled is None else scheduled) - queued
        prefill_time = decode_time = inference_time = 0.0
        if scheduled is not None and self.first_token_time is None:
            prefill_time = inference_time = now - scheduled
        elif scheduled is not None:
            prefill_time = self.first_token_time - scheduled
            decode_time = self.last_token_time - self.first_token_time
            inference_time = self.last_token_time - scheduled
        longest = max(self.sample_tokens.values(), default=0)
        # The first token is the prefill's; the others came over the decode time (per sample, as they run
        # side by side).
        per_token = decode_time / (longest - 1) if longest > 1 else 0.0
        max_tokens = self.max_tokens
        if max_tokens is None and self.max_model_len is not None and self.num_prompt_tokens:
            max_tokens = self.max_model_len - self.num_prompt_tokens
        return FinishedRequestStats(
            finish_reason, now - self.arrival_time, self.num_prompt_tokens, self.num_generation_tokens,
            queued_time, prefill_time, decode_time, inference_time, per_token, self.num_cached_tokens,
            self.num_preemptions, longest, self.n, max_tokens,
        )


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...


def server_registry() -> CollectorRegistry:
    """A registry for one server, with what prometheus_client's global registry (vLLM's) also exports:
    process_* (CPU, memory, file descriptors), python_info and python_gc_*."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def cache_config_info(engine: LLMEngine) -> dict[str, str]:
    """vllm:cache_config_info's labels: the fields of vLLM's CacheConfig that pagellm has, as vLLM writes
    them (str of the value)."""
    from pagellm.models.sliding_window import model_sliding_window

    args = engine.args
    startup = engine.core.startup
    info = {
        "block_size": args.block_size,
        "cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
        "enable_prefix_caching": args.enable_prefix_caching,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "is_attention_free": False,
        "kv_cache_max_concurrency": startup.max_concurrency,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "kv_cache_size_tokens": startup.num_tokens,
        "num_cpu_blocks": None,
        "num_gpu_blocks": startup.num_blocks,
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "sliding_window": model_sliding_window(engine.core.model_info.hf_config),
    }
    return {key: str(value) for key, value in info.items()}


class PrometheusStatLogger:
    """Exports engine metrics into `registry`: one registry per server, so that several servers (or engines)
    in one process never collide on the global default registry."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None,
                 cache_config: dict[str, str] | None = None, engine_index: int = 0) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.model_name = model_name
        self._labels = [model_name, str(engine_index)]
        self._seen = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_cow_copies": 0}
        self._add_vllm_gauges(cache_config)
        self._add_vllm_counters()
        self._add_vllm_histograms(max_model_len)
        self._add_pagellm_metrics()
        # Made at the first record from an engine that speculates (vLLM exports them only then too).
        self._spec_decode_counters_added = False

    # ---- vLLM's metrics ----------------------------------------------------------------------------

    def _gauge(self, name: str, doc: str, extra_label: str | None = None):
        return self._metric(Gauge, name, doc, extra_label)

    def _counter(self, name: str, doc: str, extra_label: str | None = None):
        return self._metric(Counter, name, doc, extra_label)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(name, doc, ["model_name", "engine"], registry=self.registry,
                         buckets=buckets).labels(*self._labels)

    def _metric(self, kind, name: str, doc: str, extra_label: str | None):
        """The (model, engine) child; or, with an extra label, the metric itself (children made as needed)."""
        labels = ["model_name", "engine"] + ([extra_label] if extra_label else [])
        metric = kind(name, doc, labels, registry=self.registry)
        return metric if extra_label else metric.labels(*self._labels)

    def _add_vllm_gauges(self, cache_config: dict[str, str] | None) -> None:
        self.num_requests_running = self._gauge("vllm:num_requests_running",
                                                "Number of requests in model execution batches.")
        self.num_requests_waiting = self._gauge("vllm:num_requests_waiting",
                                                "Number of requests waiting to be processed.")
        self.num_requests_waiting_by_reason = self._gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
            "Sum of all reasons equals vllm:num_requests_waiting.", "reason")
        self.engine_sleep_state = self._gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.", "sleep_state")
        for state in SLEEP_STATES:  # pagellm's engine never sleeps
            self.engine_sleep_state.labels(*self._labels, state).set(1 if state == "awake" else 0)
        self.kv_cache_usage = self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        if cache_config is not None:
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                         [*cache_config, "engine"], registry=self.registry)
            info.labels(**cache_config, engine=self._labels[1]).set(1)

    def _add_vllm_counters(self) -> None:
        self.prefix_cache_queries = self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source = self._counter("vllm:prompt_tokens_by_source",
                                                     "Number of prompt tokens by source.", "source")
        self.prompt_tokens_cached = self._counter("vllm:prompt_tokens_cached",
                                                  "Number of cached prompt tokens (local + external).")
        self.prompt_tokens_cached_by_source = self._counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to "
            "DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
            "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.", "source")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = self._counter("vllm:request_success", "Count of successfully processed requests.",
                                             "finished_reason")
        admission = Counter("vllm:admission_rejections",
                            "Number of admission attempts rejected by a queue limit, by reason.",
                            ["model_name", "reason"], registry=self.registry)
        self.admission_rejections = {reason: admission.labels(self.model_name, reason) for reason in ADMISSION_REASONS}
        for counter, values in ((self.prompt_tokens_by_source, PROMPT_TOKEN_SOURCES),
                                (self.prompt_tokens_cached_by_source, CACHE_HIT_SOURCES),
                                (self.request_success, FINISH_REASONS)):
            for value in values:
                counter.labels(*self._labels, value)
        for reason in WAITING_REASONS:
            self.num_requests_waiting_by_reason.labels(*self._labels, reason)

    def _add_vllm_histograms(self, max_model_len: int) -> None:
        tokens = request_tokens_buckets(max_model_len)
        h = self._histogram
        self.request_prompt_tokens = h("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = h("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.iteration_tokens = h("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  ITERATION_TOKENS_BUCKETS)
        self.request_max_num_generation_tokens = h(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            tokens)
        self.request_params_n = h("vllm:request_params_n", "Histogram of the n request parameter.",
                                  REQUEST_PARAMS_N_BUCKETS)
        self.request_params_max_tokens = h("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        self.time_to_first_token = h("vllm:time_to_first_token_seconds",
                                     "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = h("vllm:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.request_time_per_output_token = h("vllm:request_time_per_output_token_seconds",
                                               "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e_latency = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = h("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = h("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = h("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = h("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_num_preemptions = h("vllm:request_num_preemptions",
                                         "Histogram of the number of times a request was preempted.",
                                         REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.request_prefill_kv_computed_tokens = h(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tokens)

    def _add_spec_decode_counters(self) -> None:
        self.spec_decode_num_drafts = self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = self._counter("vllm:spec_decode_num_draft_tokens",
                                                          "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = self._counter("vllm:spec_decode_num_accepted_tokens",
                                                             "Number of accepted tokens.")
        self.spec_decode_num_accepted_tokens_per_pos = self._counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", "position")
        self._seen.update(spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0, spec_decode_num_accepted_tokens=0)

    def _record_spec_decoding(self, stats) -> None:
        """stats: the scheduler's SpecDecodingStats (counted since start-up), or None without speculation."""
        if stats is None:
            return
        if not self._spec_decode_counters_added:
            self._add_spec_decode_counters()
            self._spec_decode_counters_added = True
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            key = f"spec_decode_{name}"
            getattr(self, key).inc(self._increase(key, getattr(stats, name)))
        for position, total in enumerate(stats.num_accepted_tokens_per_pos):
            key = f"spec_decode_accepted_pos_{position}"
            self._seen.setdefault(key, 0)
            self.spec_decode_num_accepted_tokens_per_pos.labels(*self._labels, str(position)).inc(
                self._increase(key, total))

    # ---- pagellm's own ---------------------------------------------------------------------------

    def _add_pagellm_metrics(self) -> None:
        self.kv_cache_waste = self._gauge(
            "pagellm:kv_cache_waste_perc", "Fraction of the slots in allocated KV blocks that hold no token (0-1).")
        self.kv_cache_shared_blocks = self._gauge(
            "pagellm:kv_cache_shared_blocks", "KV blocks in use by more than one sequence (n > 1, beam search).")
        self.cow_copies = self._counter("pagellm:kv_cache_cow_copies", "Shared blocks copied on write.")

    # ---- recording -------------------------------------------------------------------------------

    def _increase(self, name: str, total: int) -> int:
        """The scheduler counts since start; a counter takes the increase since the last record."""
        increase = max(0, total - self._seen[name])
        self._seen[name] = max(self._seen[name], total)
        return increase

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._record_scheduler(scheduler_stats, iteration_stats.num_waiting_deferred)
        self._record_iteration(iteration_stats)
        for finished in iteration_stats.finished_requests:
            self._record_finished(finished)

    def _record_scheduler(self, stats: SchedulerStats, num_deferred: int) -> None:
        kv = stats.kv_cache
        labels = self._labels
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        deferred = min(num_deferred, stats.num_waiting)
        self.num_requests_waiting_by_reason.labels(*labels, "capacity").set(stats.num_waiting - deferred)
        self.num_requests_waiting_by_reason.labels(*labels, "deferred").set(deferred)
        self.kv_cache_usage.set(kv.usage)
        self.num_preemptions.inc(self._increase("num_preemptions", stats.num_preemptions))
        self.prefix_cache_queries.inc(self._increase("prefix_cache_queries", kv.prefix_cache_queries))
        hits = self._increase("prefix_cache_hits", kv.prefix_cache_hits)
        self.prefix_cache_hits.inc(hits)
        self.prompt_tokens_cached_by_source.labels(*labels, "device").inc(hits)
        self.kv_cache_waste.set(kv.waste)
        self.kv_cache_shared_blocks.set(kv.num_shared_blocks)
        self.cow_copies.inc(self._increase("num_cow_copies", kv.num_cow_copies))
        self._record_spec_decoding(stats.spec_decoding)

    def _record_iteration(self, stats: IterationStats) -> None:
        labels = self._labels
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.prompt_tokens_by_source.labels(*labels, "local_compute").inc(stats.num_computed_prompt_tokens)
        self.prompt_tokens_by_source.labels(*labels, "local_cache_hit").inc(stats.num_cached_prompt_tokens)
        self.prompt_tokens_cached.inc(stats.num_cached_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.stepped:
            # vLLM's count: the computed prompts of the requests whose first token came out, and the new tokens.
            self.iteration_tokens.observe(stats.num_computed_prompt_tokens + stats.num_generation_tokens)
        if stats.num_admission_rejections:
            self.admission_rejections[QUEUE_FULL_REASON].inc(stats.num_admission_rejections)
        for seconds in stats.time_to_first_tokens:
            self.time_to_first_token.observe(seconds)
        for seconds in stats.inter_token_latencies:
            self.inter_token_latency.observe(seconds)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        self.request_success.labels(*self._labels, finished.finish_reason).inc()
        self.e2e_latency.observe(finished.e2e_latency)
        self.request_queue_time.observe(finished.queued_time)
        self.request_prefill_time.observe(finished.prefill_time)
        self.request_inference_time.observe(finished.inference_time)
        self.request_decode_time.observe(finished.decode_time)
        self.request_num_preemptions.observe(finished.num_preemptions)
        self.request_prefill_kv_computed_tokens.observe(finished.num_prompt_tokens - finished.num_cached_tokens)
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_generation_tokens)
        self.request_time_per_output_token.observe(finished.mean_time_per_output_token)
        self.request_max_num_generation_tokens.observe(finished.max_num_generation_tokens)
        self.request_params_n.observe(finished.n)
        if finished.max_tokens_param:
            self.request_params_max_tokens.observe(finished.max_tokens_param)


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
