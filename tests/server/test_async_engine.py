"""AsyncLLMEngine on its own (no HTTP): concurrency, output kinds, abort, cancellation, faults, the queue bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagellm import SamplingParams
from pagellm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from pagellm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, EngineStepError, QueueFullError
from pagellm.sampling_params import RequestOutputKind
from tests.helpers import PROMPTS
from tests.server.utils import StepFault

ENGINE_KWARGS = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=512, max_num_seqs=4)


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama_dir, **ENGINE_KWARGS))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def fault(engine) -> StepFault:
    return StepFault(engine.engine.core.runner.model)


async def _final(engine: AsyncLLMEngine, prompt, params: SamplingParams, request_id: str):
    final = None
    async for output in engine.generate(prompt, params, request_id):
        final = output
    return final


async def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.005)


def _idle(engine: AsyncLLMEngine) -> bool:
    stats = engine.get_stats()
    return stats.kv_cache.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_async_engine_args_are_the_engine_args_plus_the_queue_bound():
    assert issubclass(AsyncEngineArgs, EngineArgs)
    assert EngineArgs.field_names() < AsyncEngineArgs.field_names()
    with pytest.raises(ValueError, match="max_num_queued_requests=0 is out of range"):
        AsyncEngineArgs(max_num_queued_requests=0)


def test_concurrent_requests_match_one_at_a_time(engine):
    prompts = PROMPTS[:6]  # more than max_num_seqs: some wait, then join the running batch

    async def run():
        alone = [await _final(engine, p, _greedy(12), f"alone-{i}") for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(_final(engine, p, _greedy(12), f"together-{i}") for i, p in enumerate(prompts)))
        return alone, together

    alone, together = asyncio.run(run())
    for a, b in zip(alone, together):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 12
        assert a.outputs[0].text == b.outputs[0].text and b.finished and b.outputs[0].finish_reason == "length"
    assert _idle(engine)


def test_output_kinds(engine):
    async def collect(kind: RequestOutputKind, request_id: str):
        return [o async for o in engine.generate(PROMPTS[6], _greedy(10, output_kind=kind), request_id)]

    async def run():
        return (await collect(RequestOutputKind.CUMULATIVE, "cumulative"), await collect(RequestOutputKind.DELTA, "delta"),
                await collect(RequestOutputKind.FINAL_ONLY, "final"))

    cumulative, delta, final = asyncio.run(run())
    full = cumulative[-1].outputs[0]
    assert len(full.token_ids) == 10
    for earlier, later in zip(cumulative, cumulative[1:]):
        assert later.outputs[0].text.startswith(earlier.outputs[0].text)
    assert "".join(o.outputs[0].text for o in delta) == full.text
    assert sum((o.outputs[0].token_ids for o in delta), []) == full.token_ids
    assert len(final) == 1 and final[0].outputs[0].text == full.text and final[0].finished


def test_abort_ends_the_stream_and_frees_its_blocks(engine):
    async def run():
        outputs = []
        async for output in engine.generate(PROMPTS[5], _greedy(400), "to-abort"):
            outputs.append(output)
            if len(outputs) == 1:
                await engine.abort("to-abort")
        return outputs

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 400
    assert _idle(engine)  # the abort output comes after the engine freed the blocks


@pytest.mark.parametrize("how", ["cancel", "break"])
def test_a_consumer_that_goes_away_aborts_its_request(engine, how):
    async def consume(request_id: str):
        async for _ in engine.generate(PROMPTS[5], _greedy(400), request_id):
            if how == "break":
                break

    async def run():
        task = asyncio.create_task(consume(f"leaves-by-{how}"))
        if how == "cancel":
            await _wait_for(lambda: engine.get_stats().num_running == 1, "the request to run")
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await _wait_for(lambda: _idle(engine), "the request's blocks to be freed")

    asyncio.run(run())


def test_a_slow_consumer_does_not_stall_others_and_catches_up_in_one_read(engine):
    async def run():
        slow = engine.generate(PROMPTS[0], _greedy(40), "slow")
        first = await slow.__anext__()
        fast = await _final(engine, PROMPTS[1], _greedy(40), "fast")  # `slow` is not read meanwhile
        caught_up = await slow.__anext__()
        await slow.aclose()
        return first, fast, caught_up

    first, fast, caught_up = asyncio.run(run())
    assert len(first.outputs[0].token_ids) == 1
    assert fast.finished and len(fast.outputs[0].token_ids) == 40
    # Everything the slow consumer missed comes merged into one cumulative output.
    assert caught_up.finished and len(caught_up.outputs[0].token_ids) == 40


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine, fault):
    async def run():
        expected = await _final(engine, PROMPTS[4], _greedy(8), "expected")
        running = [asyncio.create_task(_final(engine, PROMPTS[i], _greedy(300), f"in-step-{i}")) for i in range(4)]
        await _wait_for(lambda: engine.get_stats().num_running == 4, "four running requests")
        waiting = asyncio.create_task(_final(engine, PROMPTS[4], _greedy(8), "waiting"))
        await _wait_for(lambda: engine.get_stats().num_waiting == 1, "one waiting request")
        fault.remaining = 1
        results = await asyncio.gather(*running, return_exceptions=True)
        return expected, results, await waiting

    expected, results, waiting = asyncio.run(run())
    assert all(isinstance(r, EngineStepError) for r in results), results
    assert "injected fault" in str(results[0].__cause__)
    # The waiting request was not in the failed step: it runs afterwards, unharmed.
    assert waiting.outputs[0].token_ids == expected.outputs[0].token_ids
    assert engine.dead_error is None and _idle(engine)


def test_bad_input_fails_only_its_own_request(engine):
    async def run():
        with pytest.raises(ValueError, match="the prompt is empty"):
            await _final(engine, "", _greedy(4), "empty")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _final(engine, {"prompt_token_ids": [10**9]}, _greedy(4), "bad-ids")
        return await _final(engine, PROMPTS[0], _greedy(4), "good")

    assert len(asyncio.run(run()).outputs[0].token_ids) == 4


def test_request_ids_must_be_unique_while_in_flight(engine):
    async def run():
        first = engine.generate(PROMPTS[0], _greedy(50), "same-id")
        await first.__anext__()
        with pytest.raises(ValueError, match="request_id='same-id' is already in use"):
            await _final(engine, PROMPTS[0], _greedy(4), "same-id")
        await first.aclose()
        await _wait_for(lambda: _idle(engine), "the first request to be aborted")
        return await _final(engine, PROMPTS[0], _greedy(4), "same-id")  # free again

    assert asyncio.run(run()).finished


def test_the_waiting_queue_is_bounded(engine):
    async def run():
        running = [engine.generate(PROMPTS[i], _greedy(400), f"runs-{i}") for i in range(4)]
        for stream in running:
            await stream.__anext__()
        engine.max_num_queued_requests = 2
        try:
            queued = [engine.add_request(f"queued-{i}", PROMPTS[0], _greedy(4)) for i in range(2)]
            with pytest.raises(QueueFullError, match="max_num_queued_requests=2"):
                engine.add_request("refused", PROMPTS[0], _greedy(4))
        finally:
            engine.max_num_queued_requests = 1024
        for stream in running:
            await stream.aclose()
        return [await _last(engine, stream) for stream in queued]

    async def _last(engine, stream):
        return [o async for o in engine.outputs(stream)][-1]

    finished = asyncio.run(run())
    assert all(len(o.outputs[0].token_ids) == 4 for o in finished)


def test_repeated_step_failures_kill_the_engine(tiny_llama_dir):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama_dir, **ENGINE_KWARGS))
    assert not engine.is_running  # built outside any event loop; the thread starts on first use
    StepFault(engine.engine.core.runner.model).remaining = 100

    async def run():
        errors = []
        for i in range(engine.max_consecutive_step_failures):
            try:
                await _final(engine, PROMPTS[0], _greedy(4), f"doomed-{i}")
            except Exception as exc:
                errors.append(exc)
        with pytest.raises(EngineDeadError):
            await _final(engine, PROMPTS[0], _greedy(4), "after-death")
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        return errors

    try:
        errors = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [type(e) for e in errors] == [EngineStepError, EngineStepError, EngineDeadError]
