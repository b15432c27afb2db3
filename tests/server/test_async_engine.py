"""AsyncLLMEngine on its own (no HTTP): concurrency, output kinds, abort, cancellation, faults, the queue bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagellm import LLM, SamplingParams
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
        slow = engine.generate(PROMPTS[0], _greedy(400), "slow")
        first = await slow.__anext__()
        fast = await _final(engine, PROMPTS[1], _greedy(40), "fast")  # `slow` is not read meanwhile
        caught_up = await slow.__anext__()
        await slow.aclose()
        return first, fast, caught_up

    first, fast, caught_up = asyncio.run(run())
    # The first read may already hold more than one token (the engine thread does not wait for the reader).
    assert not first.finished and len(first.outputs[0].token_ids) >= 1
    assert fast.finished and len(fast.outputs[0].token_ids) == 40
    # Everything the slow consumer missed comes merged into one cumulative output: it ran beside `fast` through
    # fast's 40 steps, so one read brings at least 40 more tokens.
    assert len(caught_up.outputs[0].token_ids) >= len(first.outputs[0].token_ids) + 40


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


class _PeakBlocks:
    """A stat logger that remembers the most KV blocks in use after any iteration."""

    def __init__(self) -> None:
        self.peak = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.peak = max(self.peak, scheduler_stats.kv_cache.num_used_blocks)


def test_n_samples_share_the_prompt_blocks_and_equal_the_offline_samples(engine, tiny_llama_dir):
    block_size = engine.get_stats().kv_cache.block_size
    prompt = {"prompt_token_ids": [(7 * i) % 900 + 10 for i in range(10 * block_size)]}  # 10 full blocks
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    peak = _PeakBlocks()
    engine.add_stat_logger(peak)

    async def run():
        return await _final(engine, prompt, params, "n3")

    try:
        output = asyncio.run(run())
    finally:
        engine.stat_loggers.remove(peak)
    assert [c.index for c in output.outputs] == [0, 1, 2] and output.finished
    assert all(len(c.token_ids) == 6 for c in output.outputs)
    # The prompt's 10 blocks are held once; each sample adds one block for its own tokens (three fanned-out
    # requests would hold 33).
    assert peak.peak <= 10 + 3, peak.peak
    assert _idle(engine)

    offline = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=512)
    (expected,) = offline.generate([prompt], params, use_tqdm=False)
    assert [c.token_ids for c in output.outputs] == [c.token_ids for c in expected.outputs]
    assert [c.text for c in output.outputs] == [c.text for c in expected.outputs]


def test_best_of_returns_the_n_best_and_a_failed_step_frees_every_sample(engine, fault):
    async def run():
        best = await _final(engine, PROMPTS[2], SamplingParams(n=1, best_of=3, temperature=1.0, seed=3, max_tokens=5),
                            "best-of")
        doomed = asyncio.create_task(_final(engine, PROMPTS[3], SamplingParams(n=3, seed=1, max_tokens=300,
                                                                                ignore_eos=True), "doomed-n3"))
        await _wait_for(lambda: engine.get_stats().num_running == 3, "three samples running")
        fault.remaining = 1
        failure = (await asyncio.gather(doomed, return_exceptions=True))[0]
        after = await _final(engine, PROMPTS[0], _greedy(4), "after-n3")
        return best, failure, after

    best, failure, after = asyncio.run(run())
    assert len(best.outputs) == 1 and len(best.outputs[0].token_ids) == 5
    # The step ran only forks of "doomed-n3" besides the request itself: all of them are its failure.
    assert isinstance(failure, EngineStepError), failure
    assert len(after.outputs[0].token_ids) == 4
    assert _idle(engine) and engine.dead_error is None


def _hand_out_together(engine: AsyncLLMEngine, fault: StepFault, names: list[str]):
    """Runs a request, holds the engine inside a step, queues its abort and one add per name, lets go:
    the engine thread takes all of them in one batch. The adds' results (or errors) by name."""

    async def run():
        holder = asyncio.create_task(_final(engine, PROMPTS[0], _greedy(300), "holder"))
        await _wait_for(lambda: engine.get_stats().num_running == 1, "one running request")
        fault.gate.clear()
        await _wait_for(fault.waiting.is_set, "the engine to hold inside a step")
        engine.abort_request("holder")
        tasks = [asyncio.create_task(_final(engine, PROMPTS[i], _greedy(5), name)) for i, name in enumerate(names)]
        await _wait_for(lambda: len(engine._ops) == 1 + len(names), "the abort and the adds to be queued")
        fault.gate.set()
        # Before the fix, the adds after a failing op were dropped: their callers waited here forever.
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)
        return dict(zip(names, results)), (await asyncio.gather(holder, return_exceptions=True))[0]

    try:
        return asyncio.run(run())
    finally:
        fault.gate.set()


def test_an_op_that_fails_part_way_fails_only_its_own_caller(engine, fault, monkeypatch):
    real_add, real_abort = engine.engine.output_processor.add_request, engine.engine.abort_request
    faults = {"abort": 1}

    def add_or_fail(request_id, *args):
        if request_id == "poisoned":  # after the core took the request: it must be taken out again
            raise RuntimeError("injected fault while adding a request")
        return real_add(request_id, *args)

    def abort_or_fail(request_ids):
        if faults["abort"] and "holder" in request_ids:
            faults["abort"] -= 1
            raise RuntimeError("injected fault while aborting a request")
        return real_abort(request_ids)

    monkeypatch.setattr(engine.engine.output_processor, "add_request", add_or_fail)
    monkeypatch.setattr(engine.engine, "abort_request", abort_or_fail)
    results, holder = _hand_out_together(engine, fault, ["before", "poisoned", "after-1", "after-2"])
    assert "injected fault while aborting" in str(holder)
    assert "injected fault while adding" in str(results.pop("poisoned"))
    assert all(len(r.outputs[0].token_ids) == 5 for r in results.values()), results
    assert _idle(engine) and engine.dead_error is None


def test_an_engine_that_dies_part_way_through_the_adds_fails_every_caller(tiny_llama_dir):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama_dir, **ENGINE_KWARGS))
    fault = StepFault(engine.engine.core.runner.model)

    def abort_fails(request_ids):
        raise RuntimeError("injected fault: the pool cannot free blocks")

    engine.engine.abort_request = abort_fails
    try:
        results, holder = _hand_out_together(engine, fault, ["a", "b"])
    finally:
        engine.shutdown()
    assert isinstance(holder, EngineDeadError)
    assert all(isinstance(r, EngineDeadError) for r in results.values()), results


def test_a_lone_surrogate_in_a_prompt_is_a_value_error(engine):
    with pytest.raises(ValueError, match=r"prompt contains a lone surrogate \(U\+D800\)"):
        engine.engine.process_prompt("\ud800abc")

    async def run():
        return await _final(engine, "\ud800abc", _greedy(4), "surrogate")

    with pytest.raises(ValueError, match="lone surrogate"):
        asyncio.run(run())


def test_the_queue_bound_counts_only_requests_waiting_for_a_slot(tiny_llama_dir):
    """40 requests at once, 64 slots, at most 8 queued: none is waiting for a slot, none is refused."""
    args = AsyncEngineArgs(model=tiny_llama_dir, **{**ENGINE_KWARGS, "max_num_seqs": 64}, max_num_queued_requests=8)
    engine = AsyncLLMEngine.from_engine_args(args)

    async def run():
        results = await asyncio.gather(*(_final(engine, PROMPTS[i % 8], _greedy(3), f"burst-{i}") for i in range(40)))
        assert engine.num_waiting_requests == 0
        # Past the slots, the bound holds: 64 long requests fill them, 8 more wait, the next is refused.
        streams = [engine.add_request(f"fill-{i}", PROMPTS[0], _greedy(400)) for i in range(64 + 8)]
        with pytest.raises(QueueFullError, match="8 sequences are already waiting"):
            engine.add_request("refused", PROMPTS[0], _greedy(4))
        for stream in streams:
            engine.abort_request(stream.request_id)
        return results

    try:
        results = asyncio.run(run())
    finally:
        engine.shutdown()
    assert all(len(r.outputs[0].token_ids) == 3 for r in results)


def test_idle_engine_faults_in_its_kv_pool_and_keeps_serving(tiny_llama_dir):
    engine = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(model=tiny_llama_dir, **{**ENGINE_KWARGS, "kv_prefault_seconds": 0}))
    prefaulter = engine.engine.core.executor.driver.kv_prefaulter
    assert prefaulter.next_block == 0  # nothing at start-up

    async def run():
        first = await _final(engine, PROMPTS[0], _greedy(8), "before")
        await _wait_for(lambda: prefaulter.done, "the idle engine to fault in its KV pool")
        return first, await _final(engine, PROMPTS[0], _greedy(8), "after")

    try:
        first, after = asyncio.run(run())
    finally:
        engine.shutdown()
    assert first.outputs[0].token_ids == after.outputs[0].token_ids and len(after.outputs[0].token_ids) == 8
