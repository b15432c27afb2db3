"""Faults at the HTTP level, in-process (httpx's ASGI transport), where the test controls the engine's steps:
a step that raises, a step that holds on until the queue is full, an engine that cannot go on."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.engine.async_llm_engine import AsyncLLMEngine
from pagellm.entrypoints.openai.api_server import admission_of, build_app, drain
from pagellm.entrypoints.openai.serving import ServerConfig
from tests.server.utils import StepFault, metric_value

# One running sequence and a waiting queue of two: the 429 is three requests away.
ENGINE_KWARGS = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=512, max_num_seqs=1,
                     max_num_queued_requests=2)
BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


def _engine(model_dir: str) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model_dir, **ENGINE_KWARGS))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def fault(engine) -> StepFault:
    return StepFault(engine.engine.core.runner.model)


def _client(engine: AsyncLLMEngine, model_dir: str) -> httpx.AsyncClient:
    return _app_client(build_app(engine, ServerConfig(["tiny"], model_dir)))


def _app_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagellm.test", timeout=60)


async def _until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.005)


def test_a_failing_step_answers_500_and_the_server_goes_on(engine, fault, tiny_llama_dir):
    async def run():
        async with _client(engine, tiny_llama_dir) as client:
            fault.remaining = 1
            failed = await client.post("/v1/completions", json=BODY)
            fault.remaining = 1
            streamed = await client.post("/v1/completions", json={**BODY, "stream": True})
            health = await client.get("/health")
            after = await client.post("/v1/completions", json=BODY)
            return failed, streamed, health, after

    failed, streamed, health, after = asyncio.run(run())
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["code"] == "engine_step_failed" and error["type"] == "server_error"
    assert "injected fault" in error["message"]
    # A stream has sent its headers before the step fails: the error travels in it, then [DONE].
    assert streamed.status_code == 200
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert '"engine_step_failed"' in events[-2] and events[-1] == "[DONE]"
    assert health.status_code == 200
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


def test_a_failing_step_fails_a_response_and_its_stream(engine, fault, tiny_llama_dir):
    body = {"model": "tiny", "input": "Hello", "max_output_tokens": 4}

    async def run():
        async with _client(engine, tiny_llama_dir) as client:
            fault.remaining = 1
            failed = await client.post("/v1/responses", json=body)
            fault.remaining = 1
            streamed = await client.post("/v1/responses", json={**body, "stream": True})
            return failed, streamed

    failed, streamed = asyncio.run(run())
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_step_failed"
    # The stream's headers are out: the response fails in it, as OpenAI's streams report a failed response.
    events = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines()
              if line.startswith("data: ")]
    assert [event["type"] for event in events] == ["response.created", "response.in_progress", "response.failed"]
    response = events[-1]["response"]
    assert response["status"] == "failed" and response["error"]["code"] == "engine_step_failed"
    assert "injected fault" in response["error"]["message"]


def test_a_full_waiting_queue_answers_429(engine, fault, tiny_llama_dir):
    async def run():
        async with _client(engine, tiny_llama_dir) as client:
            running = asyncio.create_task(client.post("/v1/completions", json={**BODY, "max_tokens": 400}))
            await _until(lambda: engine.get_stats().num_running == 1, "the first request to run")
            fault.gate.clear()  # the engine's next step holds until the queue has been tried
            try:
                await _until(fault.waiting.is_set, "the engine to hold in a step")
                waiting = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(2)]
                await _until(lambda: engine.num_waiting_requests == 2, "two waiting requests")
                refused = await client.post("/v1/completions", json=BODY)
            finally:
                fault.gate.set()
            done = await running, *await asyncio.gather(*waiting)
            # The engine records the refusal with the iteration it held in, which ended before these did.
            return refused, done, (await client.get("/metrics")).text

    refused, done, metrics = asyncio.run(run())
    assert refused.status_code == 429
    labels = {"model_name": "tiny", "reason": "max_num_queued_reqs"}
    assert metric_value(metrics, "vllm:admission_rejections_total", labels) == 1
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and "max_num_queued_requests=2" in error["message"]
    assert "--max-num-queued-requests" in error["message"]
    assert refused.headers["retry-after"] == "1"
    # Refusing one request harmed none of those already taken.
    assert [r.status_code for r in done] == [200, 200, 200]


def test_an_engine_that_cannot_go_on_answers_503(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    StepFault(engine.engine.core.runner.model).remaining = 100

    async def run():
        async with _client(engine, tiny_llama_dir) as client:
            statuses = [(await client.post("/v1/completions", json=BODY)).status_code
                        for _ in range(engine.max_consecutive_step_failures)]
            return statuses, await client.get("/health"), await client.post("/v1/completions", json=BODY)

    try:
        statuses, health, after = asyncio.run(run())
    finally:
        engine.shutdown()
    # Two failed steps fail their requests; the third in a row means the engine itself is broken.
    assert statuses == [500, 500, 503]
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    assert after.status_code == 503


class _HeldTokenizer:
    """The serving tokenizer, whose `encode` holds (on whatever thread calls it) until the test lets go."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_by_test = False

    def encode(self, *args, **kwargs):
        self.entered.set()
        # A bound, so that a tokenizer run on the event loop (which the test cannot release) ends the test.
        self.released_by_test = self.release.wait(timeout=10)
        return self.tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_health_answers_while_a_big_prompt_is_tokenized(engine, tiny_llama_dir, monkeypatch):
    app = build_app(engine, ServerConfig(["tiny"], tiny_llama_dir))
    held = _HeldTokenizer(app.state.serving.tokenizer)
    monkeypatch.setattr(app.state.serving, "tokenizer", held)

    async def run():
        async with _app_client(app) as client:
            big = asyncio.create_task(client.post("/v1/completions", json={**BODY, "prompt": "Hello " * 50}))
            await _until(held.entered.is_set, "the prompt to be tokenized")
            health = await asyncio.wait_for(client.get("/health"), timeout=30)
            held.release.set()
            return health, await big

    health, big = asyncio.run(run())
    assert health.status_code == 200
    assert held.released_by_test, "the tokenizer ran on the event loop: /health waited for it"
    assert big.status_code == 200, big.text


def _events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]


def test_draining_refuses_new_requests_and_lets_running_ones_finish(engine, tiny_llama_dir):
    app = build_app(engine, ServerConfig(["tiny"], tiny_llama_dir))
    admission = admission_of(app)

    async def run():
        async with _app_client(app) as client:
            running = asyncio.create_task(client.post("/v1/completions", json={**BODY, "max_tokens": 40,
                                                                               "stream": True}))
            await _until(lambda: engine.get_stats().num_running == 1, "the stream to run")
            draining = asyncio.create_task(drain(admission, engine, timeout=60))
            await _until(lambda: admission.draining, "the server to drain")
            refused, health = await client.post("/v1/completions", json=BODY), await client.get("/health")
            ping = await client.get("/ping")
            await draining
            return refused, health, ping, await running

    refused, health, ping, running = asyncio.run(run())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert health.status_code == 503 and ping.status_code == 503
    events = _events(running)
    assert events[-1] == "[DONE]" and '"finish_reason": "length"' in events[-2], events[-3:]


def test_draining_past_the_timeout_ends_streams_with_an_error_event(engine, tiny_llama_dir):
    app = build_app(engine, ServerConfig(["tiny"], tiny_llama_dir))
    admission = admission_of(app)

    async def run():
        async with _app_client(app) as client:
            body = {**BODY, "max_tokens": 400}
            running = [asyncio.create_task(client.post("/v1/completions", json={**body, "stream": True})),
                       asyncio.create_task(client.post("/v1/completions", json=body))]
            await _until(lambda: engine.num_requests_in_flight == 2 and engine.get_stats().num_running == 1,
                         "one request to run and one to wait")
            await drain(admission, engine, timeout=0)
            return await asyncio.gather(*running)

    streamed, plain = asyncio.run(run())
    events = _events(streamed)
    assert events[-1] == "[DONE]" and '"server_shutting_down"' in events[-2], events[-3:]
    assert "--shutdown-timeout=0" in events[-2]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutting_down"
    assert _idle(engine)


def _idle(engine: AsyncLLMEngine) -> bool:
    stats = engine.get_stats()
    return stats.kv_cache.num_used_blocks == 0 and stats.num_running == 0


def test_the_bound_on_queued_requests_ignores_requests_that_will_run_and_429_says_when_to_retry(tiny_llama_dir):
    """40 concurrent requests, max_num_queued_requests=8, 64 slots: none waits for a slot, none is refused."""
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama_dir, **{
        **ENGINE_KWARGS, "max_num_seqs": 64, "max_num_queued_requests": 8}))

    async def run():
        async with _client(engine, tiny_llama_dir) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=BODY) for _ in range(40)))

    try:
        responses = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [r.status_code for r in responses] == [200] * 40
