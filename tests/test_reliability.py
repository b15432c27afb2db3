"""Issue 13 on the engine side: every step makes progress, prompt scores survive preemption, and one
request's failure inside a step is that request's alone."""

from __future__ import annotations

import asyncio
import importlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm import LLM, SamplingParams
from pagellm.core.kv_cache_manager import cdiv
from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.engine.async_llm_engine import AsyncLLMEngine, EngineStepError
from tests.core.test_prefix_cache import check_invariants as check_ref_counts
from tests.helpers import PROMPTS


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _assert_pool_empty(llm: LLM) -> None:
    stats = llm.llm_engine.get_stats()
    assert (stats.kv_cache.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)


# ---- item 3: no step schedules nothing -------------------------------------------------------------


def test_whole_budget_prompt_beside_two_decodes_at_max_num_seqs(tiny_llama_dir):
    # The repro: two 5-token prompts decoding at max_num_seqs=2, then a 63-token prompt that fits
    # only a whole step's budget. The step used to schedule nothing and fail every request.
    llm = LLM(tiny_llama_dir, dtype="float32", enable_chunked_prefill=False, max_num_seqs=2,
              max_num_batched_tokens=64, max_model_len=64, kv_cache_memory_bytes=8 << 20)
    engine = llm.llm_engine
    short = [{"prompt_token_ids": list(range(100 + 10 * i, 105 + 10 * i))} for i in range(2)]
    long = {"prompt_token_ids": list(range(300, 363))}
    engine.add_request("a", short[0], _greedy(8))
    engine.add_request("b", short[1], _greedy(12))
    finished = {}
    for _ in range(2):
        engine.step()
    engine.add_request("long", long, _greedy(1))
    for _ in range(40):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert sorted(finished) == ["a", "b", "long"]
    alone = [llm.generate([p], _greedy(n), use_tqdm=False)[0].outputs[0].token_ids
             for p, n in ((short[0], 8), (short[1], 12), (long, 1))]
    assert [finished["a"], finished["b"], finished["long"]] == alone
    _assert_pool_empty(llm)


# ---- item 4: prompt logprobs after preemption --------------------------------------------------------


def test_prompt_logprobs_are_reported_once_after_preemption(tiny_llama_dir):
    # 12 blocks of 16 tokens: the batch does not fit, and the newest request (the one scoring its prompt)
    # is preempted and recomputed; its prompt scores are reported once, with the first computation's values.
    llm = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=12, max_model_len=192)
    scored_prompt = {"prompt_token_ids": list(range(500, 520))}
    scoring = _greedy(24, prompt_logprobs=3, logprobs=1)
    prompts = [*PROMPTS, scored_prompt]
    params = [_greedy(24)] * len(PROMPTS) + [scoring]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    preempted = outputs[-1]
    alone = llm.generate([scored_prompt], scoring, use_tqdm=False)[0]
    assert len(preempted.prompt_logprobs) == len(alone.prompt_logprobs) == 20
    assert preempted.prompt_logprobs[0] is None
    for got, want in zip(preempted.prompt_logprobs[1:], alone.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        for token_id, logprob in got.items():
            assert logprob.logprob == pytest.approx(want[token_id].logprob, abs=1e-5)
            assert logprob.rank == want[token_id].rank
    assert preempted.outputs[0].token_ids == alone.outputs[0].token_ids
    _assert_pool_empty(llm)


# ---- item 1: one request's fault inside a step is its own ----------------------------------------


def _request_of_update(processor, state, core_output) -> str:
    return state.request_id


def _request_of_advance(processor, params, sequence, core_output) -> str:
    return core_output.group_id or core_output.request_id


def _request_of_check_stop(request) -> str:
    return request.group_id


# Where a fault is injected: the output processor's documented per-request hook, its detokenize and
# stop-string step, and the core's per-request stop check.
FAULT_SITES = {
    "output_processor_hook": ("pagellm.engine.output_processor.OutputProcessor", "update_request", _request_of_update),
    "detokenize": ("pagellm.engine.output_processor.OutputProcessor", "_advance", _request_of_advance),
    "core_stop_check": ("pagellm.core.request.Request", "check_stop", _request_of_check_stop),
}


def _inject_fault(monkeypatch, site: str, bad_request_id: str, after_calls: int = 2) -> None:
    """Makes `site` raise for one request, from its (after_calls + 1)-th call on."""
    module_name, class_name = FAULT_SITES[site][0].rsplit(".", 1)
    owner = getattr(importlib.import_module(module_name), class_name)
    method, request_of = FAULT_SITES[site][1], FAULT_SITES[site][2]
    original = getattr(owner, method)
    calls = {"count": 0}

    def faulty(*args, **kwargs):
        if request_of(*args) == bad_request_id:
            calls["count"] += 1
            if calls["count"] > after_calls:
                raise RuntimeError(f"injected fault in {method}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, method, faulty)


NEIGHBOURS = {
    "plain": (PROMPTS[1], _greedy(16)),
    "stop-string": (PROMPTS[2], _greedy(16, stop=["zzzz"])),
    "logprobs": (PROMPTS[3], _greedy(16, logprobs=2)),
    "n2": (PROMPTS[4], _greedy(16, n=2)),
}
BAD = (PROMPTS[6], _greedy(16, logprobs=1))


@pytest.fixture(scope="module")
def fault_llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256)


@pytest.fixture(scope="module")
def neighbours_alone(fault_llm):
    return {name: [c.token_ids for c in fault_llm.generate([prompt], params, use_tqdm=False)[0].outputs]
            for name, (prompt, params) in NEIGHBOURS.items()}


@pytest.mark.parametrize("site", sorted(FAULT_SITES))
def test_a_fault_in_one_request_fails_it_alone_offline(fault_llm, neighbours_alone, monkeypatch, site):
    engine = fault_llm.llm_engine
    _inject_fault(monkeypatch, site, "bad")
    engine.add_request("bad", *BAD)
    for name, (prompt, params) in NEIGHBOURS.items():
        engine.add_request(name, prompt, params)
    finished = {}
    for _ in range(100):
        for output in engine.step():
            assert output.request_id not in finished
            if output.finished:
                finished[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    bad = finished.pop("bad")
    assert bad.error is not None and "injected fault" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    # The fault struck at the bad request's third call, while every neighbour was still running.
    assert all(not output.error for output in finished.values())
    assert {name: [c.token_ids for c in output.outputs] for name, output in finished.items()} == neighbours_alone
    assert all(c.finish_reason == "length" for output in finished.values() for c in output.outputs)
    _assert_pool_empty(fault_llm)
    monkeypatch.undo()
    # The engine goes on serving, and the failed request's id may be used again.
    again = fault_llm.generate([NEIGHBOURS["plain"][0]], NEIGHBOURS["plain"][1], use_tqdm=False)[0]
    assert [again.outputs[0].token_ids] == neighbours_alone["plain"]


@pytest.mark.parametrize("site", ["output_processor_hook", "core_stop_check"])
def test_a_fault_in_one_request_fails_only_its_async_stream(tiny_llama_dir, neighbours_alone, monkeypatch, site):
    engine = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256))
    _inject_fault(monkeypatch, site, "bad")

    async def final(request_id, prompt, params):
        last = None
        async for output in engine.generate(prompt, params, request_id):
            last = output
        return last

    async def run_all():
        # n > 1 is the server's fan-out in the async engine: each sample its own request.
        jobs = {"bad": final("bad", *BAD)}
        for name, (prompt, params) in NEIGHBOURS.items():
            if params.n == 1:
                jobs[name] = final(name, prompt, params)
        results = await asyncio.gather(*jobs.values(), return_exceptions=True)
        assert engine.dead_error is None
        return dict(zip(jobs, results))

    try:
        results = asyncio.run(run_all())
    finally:
        engine.shutdown()
    bad = results.pop("bad")
    assert isinstance(bad, EngineStepError) and "injected fault" in str(bad)
    assert {name: [output.outputs[0].token_ids] for name, output in results.items()} == {
        name: neighbours_alone[name] for name in results}
    assert len(results) == 3
    stats = engine.get_stats()
    assert (stats.kv_cache.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)


# ---- item 3 on the tiny model: random configurations, progress, no leak, equal to the run alone -------

ENGINE_MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def alone_reference(tiny_llama_dir):
    """Greedy tokens of one request run alone on a roomy engine, memoized."""
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=ENGINE_MAX_MODEL_LEN)
    memo: dict[tuple, list[int]] = {}

    def reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        key = (prompt, max_tokens)
        if key not in memo:
            output = llm.generate([{"prompt_token_ids": list(prompt)}], _greedy(max_tokens), use_tqdm=False)[0]
            memo[key] = output.outputs[0].token_ids
        return memo[key]

    return reference


@st.composite
def engine_workloads(draw):
    block_size = draw(st.sampled_from([4, 16]))
    chunked = draw(st.booleans())
    prompts = []
    for _ in range(draw(st.integers(2, 4))):
        # Two shared beginnings, so that prefix caching has hits.
        start = draw(st.sampled_from([list(range(400, 420)), list(range(600, 608)), []]))
        tail = draw(st.lists(st.integers(1000, 5000), min_size=1, max_size=20))
        prompts.append((tuple((start + tail)[:40]), draw(st.integers(1, 12)), draw(st.sampled_from([1, 1, 2])),
                        draw(st.integers(0, 4))))
    longest = max(len(p) for p, *_ in prompts)
    # Without chunking, often a budget that the longest prompt fills whole (issue 13 item 3's case).
    budget = draw(st.integers(8, 64)) if chunked else draw(st.sampled_from([longest, longest, 64]))
    # A request of n sequences runs them all at once, so max_num_seqs is at least the largest n (a larger n
    # is refused at add_request, tested in test_admission).
    widest = max(n for _, _, n, _ in prompts)
    min_blocks = cdiv(ENGINE_MAX_MODEL_LEN, block_size)
    num_blocks = min_blocks + draw(st.sampled_from([0, 1, 4]))
    aborts = draw(st.lists(st.tuples(st.integers(0, 10), st.integers(0, 9)), max_size=1))
    return dict(block_size=block_size, enable_chunked_prefill=chunked, max_num_batched_tokens=budget,
                num_gpu_blocks_override=num_blocks, max_num_seqs=draw(st.integers(widest, 4)),
                enable_prefix_caching=draw(st.booleans())), prompts, aborts


@given(workload=engine_workloads())
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_random_engine_configurations_progress_and_equal_the_run_alone(tiny_llama_dir, alone_reference, workload):
    engine_kwargs, prompts, aborts = workload
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=ENGINE_MAX_MODEL_LEN, **engine_kwargs)
    engine, scheduler = llm.llm_engine, llm.llm_engine.core.scheduler
    pending = sorted(range(len(prompts)), key=lambda i: prompts[i][3], reverse=True)
    finished, aborted = {}, set()
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and prompts[pending[-1]][3] <= step:
            index = pending.pop()
            prompt, max_tokens, n, _ = prompts[index]
            engine.add_request(f"r{index}", {"prompt_token_ids": list(prompt)}, _greedy(max_tokens, n=n))
        for when, pick in aborts:
            if when == step and scheduler.groups:
                victim = sorted(scheduler.groups)[pick % len(scheduler.groups)]
                engine.abort_request(victim)
                aborted.add(victim)
        if engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            assert engine.core.last_scheduled_request_ids, f"step {step} scheduled nothing"
            check_ref_counts(scheduler)
        step += 1
        assert step < 400, "no progress"
    _assert_pool_empty(llm)
    for index, (prompt, max_tokens, n, _) in enumerate(prompts):
        if f"r{index}" in aborted:
            continue
        output = finished[f"r{index}"]
        assert [c.token_ids for c in output.outputs] == [alone_reference(prompt, max_tokens)] * n, engine_kwargs


# ---- issue 27 item 1: every sequence counts against max_num_seqs, the queue bound and the pool -----------


class _MaxRunning:
    """A stat logger that keeps the most sequences that ever ran at once."""

    def __init__(self) -> None:
        self.most = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.most = max(self.most, scheduler_stats.num_running)


def test_best_of_is_bounded_and_does_not_lock_out_its_neighbours(tiny_llama_dir):
    args = AsyncEngineArgs(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=24, max_model_len=128,
                           max_num_seqs=8, max_num_queued_requests=4)
    watcher = _MaxRunning()
    engine = AsyncLLMEngine.from_engine_args(args, stat_loggers=[watcher])
    prompt = {"prompt_token_ids": list(range(100, 105))}
    neighbours = [{"prompt_token_ids": list(range(200 + 10 * i, 206 + 10 * i))} for i in range(4)]

    async def final(request_id, prompt, params):
        last = None
        async for output in engine.generate(prompt, params, request_id):
            last = output
        return last

    async def run():
        # More sequences than max_num_seqs can never run at once: refused with the numbers, nothing queued.
        with pytest.raises(ValueError, match=r"runs 9 sequences at once .* max_num_seqs=8"):
            await final("too-many", prompt, SamplingParams(n=1, best_of=9, max_tokens=4))
        # 8 sequences that fit the seats and, at 3 blocks each, just the 24-block pool: the neighbours that
        # arrive behind them wait their turn (none is refused: 4 sequences queue at most) and finish.
        sampled = asyncio.create_task(final("best-of", prompt, SamplingParams(n=2, best_of=8, max_tokens=40,
                                                                              temperature=1.0, seed=1)))
        await asyncio.sleep(0)
        others = [asyncio.create_task(final(f"n{i}", p, _greedy(12))) for i, p in enumerate(neighbours)]
        results = await asyncio.gather(sampled, *others)
        return results

    try:
        best, *greedy = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [c.index for c in best.outputs] == [0, 1] and all(len(c.token_ids) == 40 for c in best.outputs)
    assert watcher.most <= 8
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)
    alone = llm.generate(neighbours, _greedy(12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in alone]


def test_a_request_whose_sequences_cannot_share_the_pool_is_refused(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=10, max_model_len=128, max_num_seqs=16)
    prompt = {"prompt_token_ids": list(range(100, 180))}  # 80 tokens + 1: 6 blocks, then 1 per extra sequence
    with pytest.raises(ValueError, match=r"6 sequences need at least 11 KV blocks .* the pool's 10"):
        llm.generate([prompt], SamplingParams(n=6, max_tokens=4), use_tqdm=False)
    outputs = llm.generate([prompt], SamplingParams(n=5, max_tokens=4, temperature=1.0, seed=0), use_tqdm=False)
    assert len(outputs[0].outputs) == 5
    _assert_pool_empty(llm)


def test_priority_needs_the_priority_policy_and_orders_the_queue(tiny_llama_dir):
    fcfs = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match="priority=1 needs the priority scheduling policy"):
        fcfs.generate(["a"], _greedy(2), use_tqdm=False, priority=[1])
    del fcfs
    # One seat: the requests run one at a time, in priority order whatever their order of arrival.
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_seqs=1,
              scheduling_policy="priority")
    engine = llm.llm_engine
    for request_id, priority in (("late", 3), ("first", -2), ("second", 0)):
        engine.add_request(request_id, {"prompt_token_ids": [5, 6, 7]}, _greedy(2), priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["first", "second", "late"]


def test_a_cache_salt_isolates_prefix_cache_reuse(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20)
    tokens = list(range(300, 364))
    salted = {"prompt_token_ids": tokens, "cache_salt": "tenant-a"}
    first = llm.generate([salted], _greedy(4), use_tqdm=False)[0]
    other = llm.generate([{"prompt_token_ids": tokens, "cache_salt": "tenant-b"}], _greedy(4), use_tqdm=False)[0]
    again = llm.generate([salted], _greedy(4), use_tqdm=False)[0]
    unsalted = llm.generate([{"prompt_token_ids": tokens}], _greedy(4), use_tqdm=False)[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, again.num_cached_tokens,
            unsalted.num_cached_tokens) == (0, 0, 48, 0)
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == again.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt=.* must be a non-empty str"):
        llm.generate([{"prompt_token_ids": tokens, "cache_salt": ""}], _greedy(4), use_tqdm=False)
