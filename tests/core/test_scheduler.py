"""Scheduler: token budget, admission order, chunked prefill, preemption by recomputation, finishing.

The model is faked: a runner that keeps its own copy of every request from the scheduler outputs
(as a real model runner must) and samples a token whenever the scheduled tokens reach the end of a
sequence. The runner's copy is checked against the scheduler's after every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagellm.core.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import (
    EngineCoreOutput,
    ModelRunnerOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pagellm.sampling_params import SamplingParams

# tests/conftest.py loads the shared "ci" profile; these settings are applied per test (never
# loaded globally, which would override the profile for every other module) so that the
# property tests here stay derandomized and deadline-free whichever profile is active.
PROPERTY = settings(
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

ABORTED = RequestStatus.FINISHED_ABORTED


# ---- helpers ----------------------------------------------------------------------------------


def make_request(
    rid: str,
    prompt_len: int,
    arrival: int,
    max_tokens: int = 4,
    *,
    max_model_len: int | None = None,
    stop_token_ids: tuple[int, ...] = (),
    eos: int | None = None,
    min_tokens: int = 0,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=list(stop_token_ids))
    max_out = max_tokens if max_model_len is None else min(max_tokens, max_model_len - prompt_len)
    stops = set(stop_token_ids) | ({eos} if eos is not None else set())
    # Prompt tokens are >= 1000 so that they never collide with the sampled (small) ids.
    prompt = [1000 + arrival * 100 + i for i in range(prompt_len)]
    return Request(rid, prompt, sp, arrival, max_out, frozenset(stops))


def make_scheduler(
    *, num_blocks: int, block_size: int, budget: int, max_num_seqs: int = 8, max_model_len: int = 64, chunked: bool = True
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


@dataclass
class _RunnerRequest:
    tokens: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed: int = 0


@dataclass
class FakeRunner:
    """Rebuilds each request from the scheduler outputs only, like a real model runner."""

    scheduler: Scheduler
    seed: int = 0
    vocab: int = 20
    token_fn: Callable[[str, _RunnerRequest], int] | None = None
    state: dict[str, _RunnerRequest] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        kv = self.scheduler.kv
        for rid in out.finished_request_ids:
            self.state.pop(rid, None)
        for new in out.new_requests:
            assert new.request_id not in self.state, f"{new.request_id} sent as new twice"
            self.state[new.request_id] = _RunnerRequest(list(new.token_ids), new.num_prompt_tokens, list(new.block_ids))
        for cached in out.cached_requests:
            assert cached.request_id in self.state, f"{cached.request_id} scheduled but unknown to the runner"
            self.state[cached.request_id].block_ids.extend(cached.new_block_ids)
        ids = [n.request_id for n in out.new_requests] + [c.request_id for c in out.cached_requests]
        assert len(ids) == len(set(ids))
        assert set(ids) == set(out.num_scheduled_tokens)
        sampled: dict[str, int] = {}
        for rid, n in out.num_scheduled_tokens.items():
            s = self.state[rid]
            assert n > 0, (rid, n)
            assert s.num_computed + n <= len(s.tokens), (rid, s.num_computed, n, len(s.tokens))
            # The runner's block table is the scheduler's, and covers exactly the tokens computed so far.
            assert s.block_ids == kv.block_ids(rid), rid
            assert len(s.block_ids) == cdiv(s.num_computed + n, kv.block_size), rid
            s.num_computed += n
            if s.num_computed == len(s.tokens):
                token = self.token_fn(rid, s) if self.token_fn else self.rng.randrange(self.vocab)
                s.tokens.append(token)
                sampled[rid] = token
        return ModelRunnerOutput(sampled_token_ids=sampled)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    return out, sched.update_from_output(out, runner.execute(out))


def check_invariants(sched: Scheduler) -> None:
    """Block accounting and queue structure; valid between steps."""
    kv, pool = sched.kv, sched.kv.pool
    live = list(sched.requests.values())
    assert {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting} == set(sched.requests)
    assert len(sched.running) + len(sched.waiting) == len(sched.requests)
    assert len(sched.running) <= sched.config.max_num_seqs
    tables: list[int] = []
    for r in live:
        assert not r.is_finished
        ids = kv.block_ids(r.request_id)
        tables.extend(ids)
        if r.status == RequestStatus.RUNNING:
            assert len(ids) == cdiv(r.num_computed_tokens, kv.block_size), r.request_id
            assert r.num_computed_tokens < r.num_tokens, r.request_id
        else:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r.status
            assert ids == [] and r.num_computed_tokens == 0, r.request_id
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    # No leak, no sharing.
    assert len(tables) == len(set(tables)), "a block is in two tables"
    assert pool.num_used_blocks == len(tables), "leaked blocks"
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks, "free queue has duplicates"
    assert set(free_ids).isdisjoint(tables)
    for block in pool.blocks:
        assert block.ref_cnt in (0, 1), block
        assert (block.ref_cnt == 0) == (block.block_id in set(free_ids)), block
    assert kv.stats().num_stored_tokens == sum(r.num_computed_tokens for r in sched.running)
    # Arrival order: running sorted, waiting sorted, every waiting request newer than every running one.
    run_idx = [r.arrival_index for r in sched.running]
    wait_idx = [r.arrival_index for r in sched.waiting]
    assert run_idx == sorted(run_idx)
    assert wait_idx == sorted(wait_idx)
    if run_idx and wait_idx:
        assert run_idx[-1] < wait_idx[0]


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        out, _ = step(sched, runner)
        check_invariants(sched)
        outs.append(out)
    raise AssertionError(f"not finished after {max_steps} steps: {list(sched.requests)}")


# ---- token budget, max_num_seqs, ordering ----------------------------------------------------


def test_token_budget_with_chunking():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=10)
    reqs = [make_request(f"r{i}", 6, i, max_tokens=3) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"r0": 6, "r1": 4}
    assert out.total_num_scheduled_tokens == 10
    # r0 finished its prompt and sampled; r1 got a partial chunk and did not.
    assert reqs[0].num_output_tokens == 1 and reqs[1].num_output_tokens == 0
    out, _ = step(sched, runner)
    # Running first (r0 decode, r1 rest of prompt), then the budget left admits r2 in part.
    assert list(out.num_scheduled_tokens.items()) == [("r0", 1), ("r1", 2), ("r2", 6)]
    assert out.total_num_scheduled_tokens <= 10
    for out in run_to_completion(sched, runner, 50):
        assert out.total_num_scheduled_tokens <= 10
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3 for r in reqs)


def test_max_num_seqs():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=100, max_num_seqs=2)
    reqs = [make_request(f"r{i}", 3, i, max_tokens=2) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert [r.request_id for r in sched.running] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3", "r4"]
    outs = run_to_completion(sched, runner, 50)
    assert all(len(o.num_scheduled_tokens) <= 2 for o in outs)
    assert all(r.num_output_tokens == 2 for r in reqs)


def test_running_before_waiting_and_waiting_in_arrival_order():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=8, max_num_seqs=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 5, 0, max_tokens=10))
    sched.add_request(make_request("b", 2, 1, max_tokens=10))
    step(sched, runner)  # a: 5, b: 2
    for i, rid in enumerate(["c", "d", "e"]):
        sched.add_request(make_request(rid, 3, 2 + i, max_tokens=10))
    out, _ = step(sched, runner)
    # Decodes of the running requests first, then the waiting ones in arrival order, until the budget is spent.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 3), ("d", 3)]
    assert [c.request_id for c in out.cached_requests] == ["a", "b"]
    assert [n.request_id for n in out.new_requests] == ["c", "d"]
    assert [r.request_id for r in sched.waiting] == ["e"]


def test_later_smaller_request_does_not_jump_the_queue():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=4, max_num_seqs=8, chunked=False)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 1, 0, max_tokens=3))
    step(sched, runner)
    sched.add_request(make_request("big", 4, 1, max_tokens=1))
    sched.add_request(make_request("small", 1, 2, max_tokens=1))
    out, _ = step(sched, runner)
    # big does not fit beside a's decode and may not chunk: it gets a step of its own (a pauses once)
    # rather than waiting for a to finish; small, which would fit beside a, does not jump ahead of it.
    assert out.num_scheduled_tokens == {"big": 4}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "small": 1}


def test_new_request_data_contents():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=100)
    req = make_request("r", 6, 0, max_tokens=3)
    sched.add_request(req)
    out = sched.schedule()
    (new,) = out.new_requests
    assert new.request_id == "r"
    assert new.token_ids == req.prompt_token_ids
    assert new.num_prompt_tokens == 6
    assert new.block_ids == sched.kv.block_ids("r") and len(new.block_ids) == 2
    assert new.sampling_params is req.sampling_params
    assert out.cached_requests == []
    assert out.finished_request_ids == set()


def test_duplicate_request_id_rejected():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=8)
    sched.add_request(make_request("x", 2, 0))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_request("x", 2, 1))
    assert len(sched.waiting) == 1


def test_empty_scheduler_step():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=8)
    out = sched.schedule()
    assert out.is_empty and out.total_num_scheduled_tokens == 0
    assert sched.update_from_output(out, ModelRunnerOutput()) == []
    assert not sched.has_unfinished_requests()


# ---- chunked prefill ------------------------------------------------------------------------


def test_long_prompt_is_chunked_when_enabled():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=8, chunked=True)
    req = make_request("r", 20, 0, max_tokens=2)
    sched.add_request(req)
    runner = FakeRunner(sched)
    chunks = []
    for _ in range(3):
        out, outputs = step(sched, runner)
        chunks.append(out.num_scheduled_tokens["r"])
        # Blocks are taken only for the tokens in the chunks so far.
        assert len(sched.kv.block_ids("r")) == cdiv(sum(chunks), 4)
        if sum(chunks) < 20:
            assert outputs == [] and req.num_output_tokens == 0
    assert chunks == [8, 8, 4]
    assert req.num_computed_tokens == 20 and req.num_output_tokens == 1
    run_to_completion(sched, runner, 10)
    assert req.num_output_tokens == 2


def test_long_prompt_waits_when_chunking_disabled():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=8, chunked=False)
    sched.add_request(make_request("long", 9, 0))
    runner = FakeRunner(sched)
    for _ in range(3):
        out, _ = step(sched, runner)
        assert out.is_empty
    assert sched.requests["long"].status == RequestStatus.WAITING
    assert not sched.kv.has_blocks("long")
    assert sched.kv.pool.num_used_blocks == 0


def test_prompt_equal_to_budget_runs_whole_when_chunking_disabled():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=8, chunked=False)
    sched.add_request(make_request("a", 2, 0, max_tokens=5))
    sched.add_request(make_request("b", 8, 1, max_tokens=2))
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    # b does not fit beside a's prompt and is not chunked: the next step is b's alone (a's decode
    # pauses once) instead of b waiting for a to finish.
    assert out.num_scheduled_tokens == {"a": 2}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"b": 8}
    outs = [out] + run_to_completion(sched, runner, 30)
    b_chunks = [o.num_scheduled_tokens["b"] for o in outs if "b" in o.num_scheduled_tokens]
    assert b_chunks[0] == 8  # whole prompt in one step
    assert all(o.total_num_scheduled_tokens <= 8 for o in outs)


def test_whole_budget_prompt_without_a_free_seat_lets_the_decodes_run():
    # Issue 13 item 3: two decodes hold both seats (max_num_seqs=2) and the waiting prompt fits only a
    # whole step's budget. It cannot be admitted until a seat frees, so pausing the decodes for it would
    # schedule nothing; the decodes must run until one of them finishes.
    sched = make_scheduler(num_blocks=64, block_size=16, budget=64, max_num_seqs=2, max_model_len=64, chunked=False)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 5, 0, max_tokens=3, max_model_len=64))
    sched.add_request(make_request("b", 5, 1, max_tokens=6, max_model_len=64))
    step(sched, runner)
    sched.add_request(make_request("long", 63, 2, max_tokens=1, max_model_len=64))
    scheduled = []
    for out in run_to_completion(sched, runner, 20):
        assert not out.is_empty, "a step scheduled nothing while requests could run"
        scheduled.append(out.num_scheduled_tokens)
    assert scheduled[0] == {"a": 1, "b": 1}
    # a finishes with its 3rd token, which frees a seat and leaves room for the prompt beside b's decode.
    assert scheduled[2] == {"b": 1, "long": 63}


# ---- preemption -----------------------------------------------------------------------------


def test_preemption_victim_is_newest_and_everything_finishes():
    # 4 blocks of 2 slots; each request grows to 6 slots (3 blocks), so only one fits at the end.
    sched = make_scheduler(num_blocks=4, block_size=2, budget=64, max_num_seqs=8)
    reqs = [make_request(f"r{i}", 1, i, max_tokens=6) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    preempted_order: list[str] = []
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        running_before = list(sched.running)
        before = {r.request_id: r.num_preemptions for r in reqs}
        used_before = {r.request_id: len(sched.kv.block_ids(r.request_id)) for r in reqs}
        out, _ = step(sched, runner)
        check_invariants(sched)
        victims = [r for r in reqs if r.num_preemptions > before[r.request_id]]
        for v in victims:
            preempted_order.append(v.request_id)
            assert used_before[v.request_id] > 0
            assert v.request_id in out.finished_request_ids
            assert v.request_id not in out.num_scheduled_tokens
            assert not sched.kv.has_blocks(v.request_id)
            assert v.num_computed_tokens == 0
            assert v.status == RequestStatus.PREEMPTED
        if victims:
            # The victims are the newest running requests, and nothing new was admitted.
            assert victims == running_before[len(running_before) - len(victims):]
            assert out.new_requests == []
            assert sched.waiting[0] is victims[0]
    assert not sched.has_unfinished_requests()
    assert preempted_order, "the pool was meant to be too small"
    assert "r0" not in preempted_order  # the oldest always makes progress
    assert sched.num_preemptions == len(preempted_order) == sum(r.num_preemptions for r in reqs)
    assert sched.get_stats().num_preemptions == sched.num_preemptions
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 6 for r in reqs)
    assert sched.kv.pool.num_free_blocks == 4


def test_preempted_request_is_recomputed_with_its_outputs():
    sched = make_scheduler(num_blocks=4, block_size=2, budget=64)
    a = make_request("a", 3, 0, max_tokens=4)
    b = make_request("b", 3, 1, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    step(sched, runner)  # both prefill: 2 blocks each, 4 tokens each
    step(sched, runner)  # both compute token 4: still 2 blocks each
    assert sched.kv.pool.num_free_blocks == 0
    b_tokens = list(b.all_token_ids)
    out, _ = step(sched, runner)  # a needs a 3rd block: b is preempted
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert "b" in out.finished_request_ids and "b" not in runner.state
    assert out.num_scheduled_tokens == {"a": 1}
    assert sched.num_preemptions == 1
    assert b.all_token_ids == b_tokens  # outputs survive preemption
    stats = sched.get_stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    # Later b comes back as a new request carrying prompt + outputs, recomputed from 0.
    readmit = None
    for _ in range(20):
        out, _ = step(sched, runner)
        check_invariants(sched)
        if any(n.request_id == "b" for n in out.new_requests):
            readmit = next(n for n in out.new_requests if n.request_id == "b")
            break
    assert readmit is not None
    assert readmit.token_ids == b_tokens and readmit.num_prompt_tokens == 3
    assert out.num_scheduled_tokens["b"] == len(b_tokens)
    run_to_completion(sched, runner, 20)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4


def test_preempted_request_chunks_even_when_chunking_disabled():
    # After preemption a request can be longer than the budget; it must still be able to run.
    sched = make_scheduler(num_blocks=5, block_size=2, budget=4, chunked=False, max_model_len=10)
    a = make_request("a", 2, 0, max_tokens=6, max_model_len=10)
    b = make_request("b", 2, 1, max_tokens=6, max_model_len=10)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    outs = run_to_completion(sched, runner, 60)
    assert b.num_preemptions >= 1
    b_chunks = [o.num_scheduled_tokens["b"] for o in outs if "b" in o.num_scheduled_tokens]
    # b came back with more tokens than the budget and was recomputed in chunks.
    assert 4 in b_chunks[1:] and max(b_chunks) <= 4
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6


def test_self_preemption_when_only_newer_requests_are_already_scheduled():
    # The running request at the end of the list preempts itself when nothing newer is left.
    sched = make_scheduler(num_blocks=3, block_size=1, budget=64)
    a = make_request("a", 1, 0, max_tokens=3)
    b = make_request("b", 1, 1, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    step(sched, runner)  # 1 block each
    out, _ = step(sched, runner)  # a takes the last block; b needs one -> b preempts itself
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and "b" in out.finished_request_ids
    run_to_completion(sched, runner, 30)
    assert a.num_output_tokens == 3 and b.num_output_tokens == 3


# ---- finishing ------------------------------------------------------------------------------


def test_abort_running_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64)
    a = make_request("a", 6, 0, max_tokens=10)
    b = make_request("b", 3, 1, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    step(sched, runner)
    assert sched.kv.pool.num_used_blocks == 3
    sched.finish_requests(["a"], ABORTED)
    assert a.status == ABORTED and a.status.finish_reason == "abort"
    assert not sched.kv.has_blocks("a")
    assert sched.kv.pool.num_used_blocks == 1
    assert "a" not in sched.requests and a not in sched.running
    check_invariants(sched)
    out, _ = step(sched, runner)
    assert "a" in out.finished_request_ids and "a" not in out.num_scheduled_tokens
    # Aborting again, or an unknown id, is a no-op.
    sched.finish_requests(["a", "nope"], ABORTED)
    check_invariants(sched)


def test_abort_waiting():
    sched = make_scheduler(num_blocks=4, block_size=2, budget=64, max_num_seqs=1)
    a = make_request("a", 2, 0, max_tokens=3)
    b = make_request("b", 2, 1, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    step(sched, runner)
    assert b.status == RequestStatus.WAITING
    sched.finish_requests(["b"], ABORTED)
    assert b.status == ABORTED and not sched.waiting
    out, _ = step(sched, runner)
    assert "b" in out.finished_request_ids
    run_to_completion(sched, runner, 10)
    assert sched.kv.pool.num_free_blocks == 4


def test_abort_between_schedule_and_update():
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64)
    a = make_request("a", 3, 0, max_tokens=5)
    sched.add_request(a)
    runner = FakeRunner(sched)
    out = sched.schedule()
    runner_out = runner.execute(out)
    sched.finish_requests(["a"], ABORTED)
    assert sched.update_from_output(out, runner_out) == []
    assert a.num_output_tokens == 0 and a.status == ABORTED
    assert sched.kv.pool.num_free_blocks == 8
    assert "a" in sched.schedule().finished_request_ids


def test_finished_request_ids_are_reported_once():
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64)
    sched.add_request(make_request("a", 2, 0, max_tokens=1))
    runner = FakeRunner(sched)
    _, outputs = step(sched, runner)
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [("a", True, "length")]
    assert not sched.has_unfinished_requests() and sched.kv.pool.num_free_blocks == 8
    assert sched.schedule().finished_request_ids == {"a"}
    assert sched.schedule().finished_request_ids == set()


def _scripted(tokens: dict[str, list[int]]) -> Callable[[str, _RunnerRequest], int]:
    def fn(rid: str, s: _RunnerRequest) -> int:
        return tokens[rid][len(s.tokens) - s.num_prompt_tokens]

    return fn


def test_stop_token_eos_min_tokens_and_length_in_scheduler():
    sched = make_scheduler(num_blocks=32, block_size=4, budget=64)
    eos = 2
    reqs = {
        # stop_token_ids hit: stop_reason is the token.
        "stop": make_request("stop", 3, 0, max_tokens=10, stop_token_ids=(7,), eos=eos),
        # EOS hit: stop_reason None.
        "eos": make_request("eos", 3, 1, max_tokens=10, eos=eos),
        # EOS before min_tokens is ignored; the one after stops.
        "min": make_request("min", 3, 2, max_tokens=10, eos=eos, min_tokens=3),
        # Never stops: length.
        "len": make_request("len", 3, 3, max_tokens=4, eos=eos),
    }
    script = {
        "stop": [5, 7, 5, 5],
        "eos": [5, 5, eos, 5],
        "min": [eos, 5, eos, eos, 5],
        "len": [5, 5, 5, 5, 5],
    }
    for r in reqs.values():
        sched.add_request(r)
    runner = FakeRunner(sched, token_fn=_scripted(script))
    collected: dict[str, list[EngineCoreOutput]] = {k: [] for k in reqs}
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        _, outputs = step(sched, runner)
        for o in outputs:
            collected[o.request_id].append(o)
    assert not sched.has_unfinished_requests()
    assert reqs["stop"].output_token_ids == [5, 7]
    assert reqs["stop"].status == RequestStatus.FINISHED_STOPPED and reqs["stop"].stop_reason == 7
    assert reqs["eos"].output_token_ids == [5, 5, eos]
    assert reqs["eos"].status == RequestStatus.FINISHED_STOPPED and reqs["eos"].stop_reason is None
    assert reqs["min"].output_token_ids == [eos, 5, eos]
    assert reqs["min"].status == RequestStatus.FINISHED_STOPPED
    assert reqs["len"].output_token_ids == [5, 5, 5, 5]
    assert reqs["len"].status == RequestStatus.FINISHED_LENGTH and reqs["len"].stop_reason is None
    for rid, outs in collected.items():
        assert [t for o in outs for t in o.new_token_ids] == reqs[rid].output_token_ids
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == reqs[rid].status.finish_reason
    assert collected["stop"][-1].stop_reason == 7
    assert collected["len"][-1].finish_reason == "length"


# ---- Request.check_stop directly ------------------------------------------------------------


def _req(max_out: int, stops=(), sp_stops=(), min_tokens: int = 0) -> Request:
    sp = SamplingParams(max_tokens=max(max_out, min_tokens, 1), min_tokens=min_tokens, stop_token_ids=list(sp_stops))
    return Request("r", [100, 101], sp, 0, max_out, frozenset(stops) | frozenset(sp_stops))


def test_check_stop_length():
    r = _req(2)
    r.append_token(1)
    assert r.check_stop() is None
    r.append_token(1)
    assert r.check_stop() == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [1, 1] and r.num_output_tokens == 2 and r.num_prompt_tokens == 2


def test_check_stop_token_and_reason():
    r = _req(10, stops=(2,), sp_stops=(9,))
    r.append_token(9)
    assert r.check_stop() == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9
    r = _req(10, stops=(2,), sp_stops=(9,))
    r.append_token(2)
    assert r.check_stop() == RequestStatus.FINISHED_STOPPED and r.stop_reason is None


def test_check_stop_min_tokens():
    r = _req(10, stops=(2,), min_tokens=2)
    r.append_token(2)
    assert r.check_stop() is None
    r.append_token(2)
    assert r.check_stop() == RequestStatus.FINISHED_STOPPED


def test_check_stop_prefers_stop_over_length_on_last_token():
    r = _req(1, stops=(2,))
    r.append_token(2)
    assert r.check_stop() == RequestStatus.FINISHED_STOPPED


def test_prompt_tokens_are_not_stop_tokens():
    r = Request("r", [2, 2], SamplingParams(max_tokens=3), 0, 3, frozenset({2}))
    r.append_token(5)
    assert r.check_stop() is None


def test_status_properties():
    assert not RequestStatus.WAITING.is_finished
    assert not RequestStatus.RUNNING.is_finished
    assert not RequestStatus.PREEMPTED.is_finished
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.RUNNING.finish_reason is None
    assert all(s.is_finished for s in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, ABORTED))


# ---- property test: random workloads --------------------------------------------------------


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(2, 48))
    chunked = draw(st.booleans())
    # Without chunking a prompt must fit one step's budget (vLLM requires budget >= max_model_len then).
    budget = draw(st.integers(max_model_len if not chunked else 1, 64))
    # The pool always holds one request at max_model_len; sometimes only just.
    min_blocks = cdiv(max_model_len, block_size)
    num_blocks = draw(st.integers(min_blocks, min_blocks + draw(st.sampled_from([0, 1, 3, 8, 32]))))
    max_num_seqs = draw(st.integers(1, 8))
    n = draw(st.integers(1, 10))
    requests = []
    for i in range(n):
        prompt_len = draw(st.integers(1, max_model_len - 1))
        max_tokens = draw(st.integers(1, 2 * max_model_len))
        min_tokens = draw(st.integers(0, min(max_tokens, 4)))
        has_stop = draw(st.booleans())
        arrive_step = draw(st.integers(0, 6))
        requests.append((prompt_len, max_tokens, min_tokens, has_stop, arrive_step))
    # (step, pick, mid_step) -- abort the live request at index pick % live, before or inside a step.
    aborts = draw(st.lists(st.tuples(st.integers(0, 25), st.integers(0, 100), st.booleans()), max_size=4))
    seed = draw(st.integers(0, 2**16))
    return block_size, max_model_len, chunked, budget, num_blocks, max_num_seqs, requests, aborts, seed


@given(workloads())
@settings(PROPERTY, max_examples=250)
def test_random_workloads_finish_without_leaks(workload):
    block_size, max_model_len, chunked, budget, num_blocks, max_num_seqs, specs, aborts, seed = workload
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        chunked=chunked,
    )
    runner = FakeRunner(sched, seed=seed, vocab=40)
    eos = 0
    all_reqs: dict[str, Request] = {}
    pending = sorted((spec[4], i, spec) for i, spec in enumerate(specs))  # arrival order
    collected: dict[str, list[EngineCoreOutput]] = {}
    aborted: set[str] = set()
    reported_finished: set[str] = set()
    expect_reported: set[str] = set()  # finished/aborted since the last schedule()
    arrival = 0
    # Liveness: the oldest live request is never preempted (the pool holds it alone) and computes at
    # least one token every step, so the steps are bounded by the total work.
    bound = sum(p + m for p, m, *_ in specs) + len(specs) + 10 + max(s[4] for s in specs)
    step_no = 0
    while pending or sched.has_unfinished_requests():
        assert step_no <= bound, f"not finished after {bound} steps: {list(sched.requests)}"
        while pending and pending[0][0] <= step_no:
            _, i, (prompt_len, max_tokens, min_tokens, has_stop, _) = pending.pop(0)
            rid = f"req{i}"
            req = make_request(
                rid,
                prompt_len,
                arrival,
                max_tokens,
                max_model_len=max_model_len,
                stop_token_ids=(5,) if has_stop else (),
                eos=eos,
                min_tokens=min_tokens,
            )
            arrival += 1
            sched.add_request(req)
            all_reqs[rid] = req
            collected[rid] = []

        def abort_now(mid: bool) -> None:
            for when, pick, mid_step in aborts:
                if when == step_no and mid_step == mid and sched.requests:
                    live = sorted(sched.requests)
                    rid = live[pick % len(live)]
                    sched.finish_requests([rid], ABORTED)
                    aborted.add(rid)
                    expect_reported.add(rid)
                    assert not sched.kv.has_blocks(rid)

        abort_now(mid=False)
        check_invariants(sched)
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        preemptions_before = {rid: r.num_preemptions for rid, r in sched.requests.items()}

        out = sched.schedule()

        # Budget, seats.
        assert out.total_num_scheduled_tokens <= budget
        assert len(sched.running) <= max_num_seqs
        preempted = [r for r in running_before if r.num_preemptions > preemptions_before[r.request_id]]
        assert sched.num_preemptions == sum(r.num_preemptions for r in all_reqs.values())
        # Running before waiting: cached requests are a prefix of the old running list, victims a suffix.
        cached_ids = [c.request_id for c in out.cached_requests]
        assert cached_ids == [r.request_id for r in running_before[: len(cached_ids)]]
        if preempted:
            assert preempted == running_before[len(running_before) - len(preempted):]
            assert set(cached_ids).isdisjoint(r.request_id for r in preempted)
            assert out.new_requests == []
            for v in preempted:
                assert v.status == RequestStatus.PREEMPTED and v.num_computed_tokens == 0
                assert not sched.kv.has_blocks(v.request_id)
        # Waiting admitted in arrival order, and only once every running request got its share.
        new_ids = [n.request_id for n in out.new_requests]
        assert new_ids == [r.request_id for r in waiting_before[: len(new_ids)]]
        if new_ids:
            assert len(cached_ids) == len(running_before)
        assert list(out.num_scheduled_tokens) == cached_ids + new_ids
        if not chunked:
            for n in out.new_requests:
                r = all_reqs[n.request_id]
                if r.num_preemptions == 0:
                    assert out.num_scheduled_tokens[n.request_id] == r.num_prompt_tokens
        # Everything the runner must forget, exactly.
        assert out.finished_request_ids == expect_reported | {r.request_id for r in preempted}
        assert reported_finished.isdisjoint(out.finished_request_ids - {r.request_id for r in preempted})
        reported_finished |= out.finished_request_ids - {r.request_id for r in preempted}
        expect_reported = set()
        # Work-conserving enough: with requests live and budget left, something runs.
        if sched.requests and not preempted:
            assert not out.is_empty

        runner_out = runner.execute(out)
        abort_now(mid=True)
        outputs = sched.update_from_output(out, runner_out)
        for o in outputs:
            collected[o.request_id].append(o)
            if o.finished:
                expect_reported.add(o.request_id)
        check_invariants(sched)
        for rid, s in runner.state.items():
            r = sched.requests.get(rid)
            if r is not None and r.status == RequestStatus.RUNNING:
                assert s.tokens == r.all_token_ids and s.num_computed == r.num_computed_tokens
        step_no += 1

    # Coverage of the interesting paths, shown by --hypothesis-show-statistics.
    event(f"chunked_prefill={chunked}")
    event(f"preempted={sched.num_preemptions > 0}")
    event(f"aborted={bool(aborted)}")
    event(f"stopped_by_token={any(r.status == RequestStatus.FINISHED_STOPPED for r in all_reqs.values())}")

    # All done: every block free, every request in a final state with the right outputs.
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and pool.num_used_blocks == 0
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sorted(pool.free_queue.block_ids()) == list(range(num_blocks))
    assert sched.kv.stats().num_stored_tokens == 0
    assert not sched.running and not sched.waiting and not sched.requests
    for rid, r in all_reqs.items():
        assert r.is_finished
        outs = collected[rid]
        assert [t for o in outs for t in o.new_token_ids] == r.output_token_ids
        assert all(not o.finished for o in outs[:-1])
        assert r.num_output_tokens <= r.max_output_tokens
        if rid in aborted:
            assert r.status == ABORTED
            assert not outs or not outs[-1].finished
            continue
        assert outs and outs[-1].finished and outs[-1].finish_reason == r.status.finish_reason
        stops = r.stop_token_ids
        tokens = r.output_token_ids
        # No stop token at an eligible position before the last.
        assert not any(t in stops and k + 1 >= r.sampling_params.min_tokens for k, t in enumerate(tokens[:-1]))
        if r.status == RequestStatus.FINISHED_STOPPED:
            assert tokens[-1] in stops and len(tokens) >= r.sampling_params.min_tokens
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert len(tokens) == r.max_output_tokens
            assert r.num_tokens <= max_model_len
