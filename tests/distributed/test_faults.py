"""Faults under tensor parallelism: a worker killed mid-generation, a forward that raises on rank 0. Each
fails the requests in flight with a clear error, turns /health to 503, and leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from pagellm import LLM
from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.entrypoints.openai.serving import ServerConfig
from pagellm.executor import ExecutorDeadError
from pagellm.sampling_params import SamplingParams
from tests.distributed.conftest import children_of, is_running, shared_memory_entries
from tests.server.utils import StepFault, wait_until

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def _engine(model_dir: str) -> AsyncLLMEngine:
    args = AsyncEngineArgs(model=model_dir, dtype="float32", tensor_parallel_size=2, max_model_len=512,
                           kv_cache_memory_bytes=16 << 20, distributed_timeout_seconds=30)
    return AsyncLLMEngine.from_engine_args(args)


async def _health(engine: AsyncLLMEngine, model_dir: str) -> httpx.Response:
    app = build_app(engine, ServerConfig(["tiny"], model_dir))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagellm.test") as client:
        return await client.get("/health")


async def _generate_until_failure(engine: AsyncLLMEngine, on_first_output) -> tuple[int, BaseException]:
    received = 0
    with pytest.raises(EngineDeadError) as failure:
        async for _ in engine.generate("Hello there", LONG, "r0"):
            received += 1
            if received == 1:
                on_first_output()
    return received, failure.value


def _assert_clean_shutdown(engine: AsyncLLMEngine, workers: list[int], shm_before: set[str]) -> None:
    engine.shutdown()
    wait_until(lambda: not any(is_running(pid) for pid in workers), 30, "the workers to exit")
    assert not set(children_of(os.getpid())) & set(workers)
    assert shared_memory_entries() <= shm_before, "the engine left shared memory behind"


def test_killed_worker_fails_requests_and_reports_unhealthy(tiny_4kv_dir):
    shm_before = shared_memory_entries()
    engine = _engine(tiny_4kv_dir)
    workers = [p.pid for p in engine.engine.core.executor.processes]
    assert len(workers) == 1 and is_running(workers[0])

    async def run():
        assert (await _health(engine, tiny_4kv_dir)).status_code == 200
        received, error = await _generate_until_failure(engine, lambda: os.kill(workers[0], signal.SIGKILL))
        assert 1 <= received < LONG.max_tokens
        assert "rank 1" in str(error) and "SIGKILL" in str(error)
        health = await _health(engine, tiny_4kv_dir)
        assert health.status_code == 503 and "SIGKILL" in health.text
        with pytest.raises(EngineDeadError):  # and nothing new is taken
            engine.add_request("r1", "Hello", SamplingParams(max_tokens=2))

    asyncio.run(run())
    _assert_clean_shutdown(engine, workers, shm_before)


def test_exception_in_rank0_forward_fails_requests_and_stops_workers(tiny_4kv_dir):
    shm_before = shared_memory_entries()
    engine = _engine(tiny_4kv_dir)
    workers = [p.pid for p in engine.engine.core.executor.processes]
    fault = StepFault(engine.engine.core.runner.model)

    async def run():
        def inject() -> None:
            fault.remaining = 1

        _, error = await _generate_until_failure(engine, inject)
        # The other rank waits in a collective that rank 0 never joins: the ranks are out of step for good.
        assert "injected fault" in str(error) and "rank 0" in str(error)
        assert (await _health(engine, tiny_4kv_dir)).status_code == 503

    asyncio.run(run())
    _assert_clean_shutdown(engine, workers, shm_before)


# Loaded by every new interpreter that has its directory on PYTHONPATH: here only the worker, started after the
# test sets the variable (this process is already running). Its third step raises as a failed allocation would.
WORKER_FAULT = """
from pagellm.worker import model_runner

_execute = model_runner.ModelRunner.execute
_calls = [0]


def execute(self, scheduler_output):
    _calls[0] += 1
    if _calls[0] == 3:
        raise MemoryError("injected: the worker ran out of memory in its forward")
    return _execute(self, scheduler_output)


model_runner.ModelRunner.execute = execute
"""


def test_exception_in_a_workers_forward_reaches_the_caller(tiny_4kv_dir, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(WORKER_FAULT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    shm_before = shared_memory_entries()
    llm = LLM(tiny_4kv_dir, dtype="float32", tensor_parallel_size=2, max_model_len=256,
              kv_cache_memory_bytes=16 << 20, distributed_timeout_seconds=30)
    workers = [p.pid for p in llm.llm_engine.core.executor.processes]
    with pytest.raises(ExecutorDeadError, match=r"rank 1 .*exited with status 1: MemoryError: injected"):
        llm.generate(["Hello there"], LONG, use_tqdm=False)
    with pytest.raises(ExecutorDeadError):  # and it stays failed
        llm.generate(["Hello"], LONG, use_tqdm=False)
    llm.llm_engine.shutdown()
    assert not any(is_running(pid) for pid in workers)
    assert shared_memory_entries() <= shm_before
