"""Metrics under vLLM's names: the per-request timeline on a fake clock, the exporter's metric set against
vLLM 0.32's, and vLLM's published Grafana dashboards read against a real app's /metrics."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import time

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagellm.core.kv_cache_manager import KVCacheStats
from pagellm.core.kv_usage import KVUsage
from pagellm.core.scheduler import SchedulerStats
from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.engine.async_llm_engine import AsyncLLMEngine
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.entrypoints.openai.serving import ServerConfig
from pagellm.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    FinishedRequestStats,
    IterationStats,
    PrometheusStatLogger,
    RequestTimer,
    request_tokens_buckets,
)
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

DASHBOARDS = pathlib.Path(__file__).resolve().parents[1] / "data" / "vllm_dashboard_queries.json"
LABELS = {"model_name": "m", "engine": "0"}

# vLLM 0.32's PrometheusStatLogger with its default configuration, as far as pagellm can measure it:
# name -> (type, the labels beside model_name/engine).
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:num_requests_waiting_by_reason": ("gauge", ("reason",)),
    "vllm:engine_sleep_state": ("gauge", ("sleep_state",)),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:prompt_tokens_by_source": ("counter", ("source",)),
    "vllm:prompt_tokens_cached": ("counter", ()),
    "vllm:prompt_tokens_cached_by_source": ("counter", ("source",)),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:iteration_tokens_total": ("histogram", ()),
    "vllm:request_max_num_generation_tokens": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()),
    "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:request_num_preemptions": ("histogram", ()),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", ()),
}
PAGELLM_OWN = {"pagellm:kv_cache_waste_perc", "pagellm:kv_cache_shared_blocks", "pagellm:kv_cache_cow_copies"}


def _output(tokens: dict[int, list[int]], prompt_len: int = 10, cached: int = 0, preemptions: int = 0) -> RequestOutput:
    """A delta output: the new tokens of each sample (CompletionOutput.index -> token ids)."""
    completions = [CompletionOutput(index, "", ids) for index, ids in tokens.items()]
    return RequestOutput("r", None, list(range(prompt_len)), completions, False, num_cached_tokens=cached,
                         kv=KVUsage(preemptions=preemptions))


def _scheduler_stats(running: int = 0, waiting: int = 0) -> SchedulerStats:
    return SchedulerStats(running, waiting, 0, KVCacheStats(num_blocks=10, num_used_blocks=0, num_free_blocks=10,
                                                            block_size=16, num_stored_tokens=0))


def _families(logger: PrometheusStatLogger) -> dict:
    return {family.name: family for family in text_string_to_metric_families(generate_latest(logger.registry).decode())}


def _sample(families: dict, family: str, suffix: str = "", **labels: str) -> float:
    wanted = {**LABELS, **labels}
    for sample in families[family].samples:
        if sample.name == family + suffix and all(sample.labels.get(k) == v for k, v in wanted.items()):
            return sample.value
    raise AssertionError(f"no {family}{suffix} {wanted}")


def _buckets(families: dict, family: str) -> list[float]:
    return [float(s.labels["le"]) for s in families[family].samples if s.name.endswith("_bucket")]


# ---- the timeline of one request, on a fake clock ------------------------------------------------------


def test_a_request_timeline_splits_into_vllms_phases():
    stats = IterationStats()
    timer = RequestTimer(arrival_time=100.0, n=1, max_tokens=3)
    timer.on_queued(100.5)
    timer.on_scheduled(102.0)
    timer.on_output(_output({0: []}, cached=4), 102.5, stats)  # a prefill chunk: no token yet
    timer.on_output(_output({0: [5]}, cached=4), 103.0, stats)
    timer.on_scheduled(104.0)  # scheduled again after a preemption: the first time stays
    timer.on_output(_output({0: [6]}, cached=4, preemptions=1), 104.5, stats)
    timer.on_output(_output({0: [7]}, cached=4, preemptions=1), 105.0, stats)
    timer.on_finish("length", 105.5, stats)
    (finished,) = stats.finished_requests
    assert finished == FinishedRequestStats(
        "length", e2e_latency=5.5, num_prompt_tokens=10, num_generation_tokens=3, queued_time=1.5, prefill_time=1.0,
        decode_time=2.0, inference_time=3.0, mean_time_per_output_token=1.0, num_cached_tokens=4, num_preemptions=1,
        max_num_generation_tokens=3, n=1, max_tokens_param=3)
    assert stats.time_to_first_tokens == [3.0] and stats.inter_token_latencies == [1.5, 0.5]
    assert (stats.num_prompt_tokens, stats.num_cached_prompt_tokens, stats.num_computed_prompt_tokens) == (10, 4, 6)
    assert stats.num_generation_tokens == 3


def test_a_request_that_ends_while_waiting_spent_it_all_queued():
    stats = IterationStats()
    timer = RequestTimer(arrival_time=0.0)
    timer.on_queued(1.0)
    timer.on_finish("abort", 3.5, stats)
    (finished,) = stats.finished_requests
    assert (finished.e2e_latency, finished.queued_time) == (3.5, 2.5)
    assert (finished.prefill_time, finished.decode_time, finished.inference_time) == (0.0, 0.0, 0.0)
    assert (finished.num_prompt_tokens, finished.num_generation_tokens) == (0, 0)
    assert finished.mean_time_per_output_token == 0
    assert stats.time_to_first_tokens == []


def test_a_request_that_ends_before_its_first_token_ends_in_prefill():
    stats = IterationStats()
    timer = RequestTimer(arrival_time=0.0)
    timer.on_queued(0.5)
    timer.on_scheduled(1.0)
    timer.on_finish("error", 4.0, stats)
    (finished,) = stats.finished_requests
    assert (finished.queued_time, finished.prefill_time, finished.inference_time, finished.decode_time) == (
        0.5, 3.0, 3.0, 0.0)


def test_n_samples_are_one_request_timed_by_the_longest():
    stats = IterationStats()
    # Without max_tokens, what max_model_len leaves after the prompt is its max_tokens (as vLLM's server sets it).
    timer = RequestTimer(arrival_time=0.0, n=2, max_tokens=None, max_model_len=100)
    timer.on_queued(0.0)
    timer.on_scheduled(0.0)
    timer.on_output(_output({0: [1], 1: [2]}), 1.0, stats)
    timer.on_output(_output({0: [3], 1: [4]}), 2.0, stats)
    timer.on_output(_output({0: [5]}), 3.0, stats)  # sample 1 stopped
    timer.on_finish("stop", 3.0, stats)
    (finished,) = stats.finished_requests
    assert (finished.num_generation_tokens, finished.max_num_generation_tokens, finished.n) == (5, 3, 2)
    assert finished.max_tokens_param == 100 - 10
    assert (finished.decode_time, finished.mean_time_per_output_token) == (2.0, 1.0)
    assert stats.time_to_first_tokens == [1.0] and stats.inter_token_latencies == [1.0, 1.0]


# ---- the exporter --------------------------------------------------------------------------------------


def test_the_exporter_has_vllms_metric_set_names_types_labels_and_buckets():
    families = _families(PrometheusStatLogger("m", 512, cache_config={"block_size": "16", "num_gpu_blocks": "7"}))
    # (prometheus_client writes each counter's and histogram's creation time as a family of its own, as vLLM's.)
    ours = {name for name in families if name.startswith(("vllm:", "pagellm:")) and not name.endswith("_created")}
    assert ours == {*VLLM_METRICS, *PAGELLM_OWN, "vllm:cache_config_info", "vllm:admission_rejections"}
    for name, (kind, extra) in VLLM_METRICS.items():
        family = families[name]
        assert family.type == kind, name
        assert family.samples, f"{name} has no series before its first event"
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == {"model_name", "engine", *extra}, (name, sample.labels)
            assert (sample.labels["model_name"], sample.labels["engine"]) == ("m", "0")
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    assert _sample(families, "vllm:engine_sleep_state", sleep_state="awake") == 1
    assert _sample(families, "vllm:engine_sleep_state", sleep_state="discard_all") == 0
    # An info gauge labelled with the cache config and the engine only, as vLLM's.
    (info,) = families["vllm:cache_config_info"].samples
    assert (info.labels, info.value) == ({"block_size": "16", "num_gpu_blocks": "7", "engine": "0"}, 1)
    # vLLM's buckets: token counts 1-2-5 up to max_model_len, the latency families as vllm/v1/metrics/buckets.py.
    inf = float("inf")
    assert _buckets(families, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, inf]
    assert request_tokens_buckets(8192)[-2:] == [2000, 5000]
    assert _buckets(families, "vllm:time_to_first_token_seconds") == [*TTFT_BUCKETS, inf]
    assert _buckets(families, "vllm:request_time_per_output_token_seconds") == [*ITL_BUCKETS, inf]
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                 "request_inference_time"):
        assert _buckets(families, f"vllm:{name}_seconds") == [*REQUEST_LATENCY_BUCKETS, inf]
    assert _buckets(families, "vllm:iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                                                 8192, 16384, inf]
    assert _buckets(families, "vllm:request_params_n") == [1, 2, 5, 10, 20, inf]
    assert _buckets(families, "vllm:request_num_preemptions") == [1, 2, 3, 4, 5, 10, 20, inf]
    assert families["vllm:time_to_first_token_seconds"].documentation == "Histogram of time to first token in seconds."


def test_the_exporter_records_a_finished_request_in_every_per_request_histogram():
    logger = PrometheusStatLogger("m", 512)
    stats = IterationStats(stepped=True, num_prompt_tokens=10, num_cached_prompt_tokens=4, num_generation_tokens=1,
                           num_waiting_deferred=1, num_admission_rejections=2)
    stats.finished_requests.append(FinishedRequestStats(
        "stop", e2e_latency=5.5, num_prompt_tokens=10, num_generation_tokens=3, queued_time=1.5, prefill_time=1.0,
        decode_time=2.0, inference_time=3.0, mean_time_per_output_token=1.0, num_cached_tokens=4, num_preemptions=1,
        max_num_generation_tokens=3, n=2, max_tokens_param=16))
    logger.record(_scheduler_stats(running=1, waiting=3), stats)
    families = _families(logger)
    assert _sample(families, "vllm:num_requests_waiting") == 3
    assert _sample(families, "vllm:num_requests_waiting_by_reason", reason="capacity") == 2
    assert _sample(families, "vllm:num_requests_waiting_by_reason", reason="deferred") == 1
    logger.record(_scheduler_stats(), IterationStats())  # no step ran: no iteration-tokens observation
    families = _families(logger)
    assert _sample(families, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    expected_sums = {
        "vllm:e2e_request_latency_seconds": 5.5, "vllm:request_queue_time_seconds": 1.5,
        "vllm:request_prefill_time_seconds": 1.0, "vllm:request_decode_time_seconds": 2.0,
        "vllm:request_inference_time_seconds": 3.0, "vllm:request_time_per_output_token_seconds": 1.0,
        "vllm:request_prompt_tokens": 10, "vllm:request_generation_tokens": 3,
        "vllm:request_max_num_generation_tokens": 3, "vllm:request_params_n": 2, "vllm:request_params_max_tokens": 16,
        "vllm:request_num_preemptions": 1, "vllm:request_prefill_kv_computed_tokens": 6,
        # The prompt computed (10 - 4 cached) and the one token made.
        "vllm:iteration_tokens_total": 7,
    }
    for name, value in expected_sums.items():
        assert (_sample(families, name, "_count"), _sample(families, name, "_sum")) == (1, value), name
    assert _sample(families, "vllm:request_success", "_total", finished_reason="stop") == 1
    assert _sample(families, "vllm:request_success", "_total", finished_reason="length") == 0
    assert _sample(families, "vllm:prompt_tokens_by_source", "_total", source="local_compute") == 6
    assert _sample(families, "vllm:prompt_tokens_by_source", "_total", source="local_cache_hit") == 4
    assert _sample(families, "vllm:prompt_tokens_cached", "_total") == 4
    rejections = {s.labels["reason"]: s.value for s in families["vllm:admission_rejections"].samples
                  if s.name.endswith("_total")}
    assert rejections == {"max_num_queued_reqs": 2, "max_num_queued_tokens": 0}


# ---- vLLM's dashboards against a real app ----------------------------------------------------------------


def _dashboard_queries() -> dict[str, list[str]]:
    data = json.loads(DASHBOARDS.read_text())
    assert data["vllm_version"] == "0.32.0"
    return {path: dashboard["queries"] for path, dashboard in data["dashboards"].items()}


def _metric_names(query: str) -> set[str]:
    """The series a PromQL query reads: names with a colon (vLLM's are all `vllm:`), and the first argument of
    label_values(metric, label)."""
    return set(re.findall(r"\b[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+", query))


@pytest.fixture(scope="module")
def app_engine(tiny_llama_dir):
    # A pool of 12 blocks (192 tokens): a few requests of 80 tokens each preempt one another.
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=12, max_model_len=192))
    yield engine
    engine.shutdown()


def test_every_series_of_vllms_dashboards_is_in_metrics_after_one_request(app_engine, tiny_llama_dir):
    app = build_app(app_engine, ServerConfig(["tiny"], tiny_llama_dir))
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 5, "ignore_eos": True}

    async def run() -> tuple[httpx.Response, str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pagellm.test", timeout=120) as client:
            response = await client.post("/v1/completions", json=body)
            # The engine thread records an iteration's stats just after handing out its outputs.
            deadline = time.monotonic() + 60
            while True:
                text = (await client.get("/metrics")).text
                if 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1.0' in text:
                    return response, text
                assert time.monotonic() < deadline, f"the finished request never reached /metrics:\n{text[:3000]}"
                await asyncio.sleep(0.01)

    response, text = asyncio.run(run())
    assert response.status_code == 200, response.text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    missing, read = {}, set()
    for path, queries in _dashboard_queries().items():
        for query in queries:
            for name in _metric_names(query):
                read.add(name)
                if not any(labels.get("model_name") == "tiny" for labels in samples.get(name, [])):
                    missing.setdefault(path, set()).add(name)
    assert not missing, f"series vLLM's dashboards read that /metrics lacks: {missing}"
    assert len(read) == 25  # the distinct series of the three dashboards: the queries were read
    assert any("model_name" in labels for series in samples.values() for labels in series)  # label_values(model_name)
    # One request went through every phase, which add up as vLLM's do.
    value = {family.name + s.name.removeprefix(family.name): s.value
             for family in text_string_to_metric_families(text) for s in family.samples if "le" not in s.labels}
    for phase in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert value[f"vllm:request_{phase}_seconds_count"] == 1
    prefill, decode = value["vllm:request_prefill_time_seconds_sum"], value["vllm:request_decode_time_seconds_sum"]
    assert prefill > 0 and decode > 0
    assert value["vllm:request_inference_time_seconds_sum"] == pytest.approx(prefill + decode)
    assert (value["vllm:request_queue_time_seconds_sum"] + value["vllm:request_inference_time_seconds_sum"]
            <= value["vllm:e2e_request_latency_seconds_sum"])
    assert value["vllm:request_generation_tokens_sum"] == 5 and value["vllm:request_params_max_tokens_sum"] == 5
    assert value["vllm:iteration_tokens_total_count"] >= 5
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds", "python_info"):
        assert name in samples, name


def test_preempted_requests_count_their_preemptions_as_the_engine_does(app_engine):
    logger = PrometheusStatLogger("m", app_engine.max_model_len)
    app_engine.add_stat_logger(logger)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % 900 + 10 for j in range(20)]} for i in range(4)]

    async def run() -> list[RequestOutput]:
        async def one(i: int) -> RequestOutput:
            async for output in app_engine.generate(prompts[i], params, f"preempt-{i}"):
                last = output
            return last

        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        outputs = asyncio.run(run())
    finally:
        app_engine.stat_loggers.remove(logger)
    assert all(len(o.outputs[0].token_ids) == 60 for o in outputs)
    families = _families(logger)
    preemptions = _sample(families, "vllm:num_preemptions", "_total")
    assert preemptions > 0, "the pool was meant to be too small for all four at once"
    # Per request (as each reported it), and in the histogram, they add up to the engine's count.
    assert sum(o.kv.preemptions for o in outputs) == preemptions
    assert _sample(families, "vllm:request_num_preemptions", "_sum") == preemptions
    assert _sample(families, "vllm:request_num_preemptions", "_count") == 4
    assert _sample(families, "vllm:request_success", "_total", finished_reason="length") == 4
    # A preemption's wait counts in the phase it interrupted; the phases still add up.
    inference = _sample(families, "vllm:request_inference_time_seconds", "_sum")
    assert inference == pytest.approx(_sample(families, "vllm:request_prefill_time_seconds", "_sum")
                                      + _sample(families, "vllm:request_decode_time_seconds", "_sum"))
    assert _sample(families, "vllm:generation_tokens", "_total") == 4 * 60
    assert _sample(families, "vllm:prompt_tokens", "_total") == 4 * 20
