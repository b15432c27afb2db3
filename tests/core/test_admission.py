"""Issue 27 item 1 in the core: every sequence of a user request (n, best_of, beam width) counts against
max_num_seqs and the pool; priority scheduling orders and preempts by priority; cache_salt keeps tenants'
prefix-cache blocks apart."""

from __future__ import annotations

import pytest

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.sampling_params import SamplingParams
from tests.core.test_progress import KVContentRunner


def _scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
               prefix_caching: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len=64), kv)


def _request(request_id: str, prompt_len: int, arrival: int, max_tokens: int = 8, n: int = 1, priority: int = 0,
             cache_salt: str | None = None, first_token: int = 1) -> Request:
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0 if n > 1 else 0.0, ignore_eos=True)
    prompt = [first_token + i for i in range(prompt_len)]
    return Request(request_id, prompt, params, arrival, max_tokens, num_pending_forks=n - 1, priority=priority,
                   cache_salt=cache_salt)


def test_a_request_of_more_sequences_than_max_num_seqs_is_refused_with_the_numbers():
    sched = _scheduler(max_num_seqs=8)
    with pytest.raises(ValueError, match=r"runs 9 sequences at once .* more than max_num_seqs=8"):
        sched.add_request(_request("big", 4, 0, n=9))
    beam = Request("beam", [1, 2, 3], SamplingParams(max_tokens=4), 1, 4, reserved_seats=9)
    with pytest.raises(ValueError, match="max_num_seqs=8"):
        sched.add_request(beam)
    assert not sched.requests and not sched.waiting


def test_a_request_whose_sequences_cannot_share_the_pool_is_refused_with_the_numbers():
    # 10 prompt tokens + the first sample = 3 blocks of 4, then 7 more sequences a block each: 10 > 9.
    sched = _scheduler(num_blocks=9, block_size=4, max_num_seqs=8)
    with pytest.raises(ValueError, match=r"8 sequences need at least 10 KV blocks .* the pool's 9"):
        sched.add_request(_request("big", 10, 0, n=8))
    sched.add_request(_request("fits", 10, 1, n=7))


def test_forks_never_run_past_max_num_seqs_and_a_later_request_waits_for_seats():
    sched = _scheduler(max_num_seqs=4)
    runner = KVContentRunner(sched)
    sched.add_request(_request("a", 4, 0, n=3, max_tokens=6))
    sched.add_request(_request("b", 4, 1, n=2, max_tokens=6))
    sched.add_request(_request("c", 4, 2, max_tokens=6))
    admitted_at: dict[str, int] = {}
    step = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert len(sched.running) <= 4
        for new in out.new_requests:
            admitted_at.setdefault(new.request_id, step)
        outputs = sched.update_from_output(out, runner.execute(out))
        assert all(o.finish_reason != "error" for o in outputs), outputs
        step += 1
        assert step < 100
    # a's three samples hold three seats; b needs two more, so it waits for a; c (one seat) waits behind b.
    assert admitted_at["a"] == 0 and admitted_at["b"] > 0 and admitted_at["c"] >= admitted_at["b"]
    assert sched.kv.pool.num_used_blocks == 0


def test_a_forking_request_is_admitted_only_with_blocks_for_its_forks():
    # 8 blocks of 4: "long" holds 5 (17 tokens + room); "fork" needs 1 block for its prompt + 3 for its forks.
    sched = _scheduler(num_blocks=8, block_size=4, max_num_seqs=8)
    runner = KVContentRunner(sched)
    sched.add_request(_request("long", 17, 0, max_tokens=2))
    sched.add_request(_request("fork", 3, 1, n=4, max_tokens=2))
    out = sched.schedule()
    assert [r.request_id for r in out.new_requests] == ["long"]
    sched.update_from_output(out, runner.execute(out))
    preemptions = sched.num_preemptions
    while sched.has_unfinished_requests():
        out = sched.schedule()
        outputs = sched.update_from_output(out, runner.execute(out))
        assert all(o.finish_reason != "error" for o in outputs), outputs
    # It waited for "long" to finish instead of being admitted and preempting it (or its own forks).
    assert sched.num_preemptions == preemptions == 0


def test_priority_orders_the_queue_and_preempts_the_lowest_priority_first():
    sched = _scheduler(num_blocks=6, block_size=4, max_num_seqs=8, budget=64)
    runner = KVContentRunner(sched)
    sched.add_request(_request("low", 4, 0, priority=5, max_tokens=8))
    sched.add_request(_request("high", 4, 1, priority=-1, max_tokens=8))
    sched.add_request(_request("mid", 4, 2, priority=0, max_tokens=8))
    assert [r.request_id for r in sched.waiting] == ["high", "mid", "low"]
    out = sched.schedule()
    assert [r.request_id for r in out.new_requests] == ["high", "mid", "low"]
    sched.update_from_output(out, runner.execute(out))
    # 6 blocks for three sequences growing to 12 tokens (3 blocks each): someone must be preempted, and it
    # is the lowest priority, however early it arrived.
    while sched.num_preemptions == 0:
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert sched.requests["low"].status == RequestStatus.PREEMPTED
    assert all(sched.requests[r].num_preemptions == 0 for r in ("high", "mid"))


def test_a_cache_salt_keeps_prefix_cache_blocks_apart():
    sched = _scheduler(block_size=4, prefix_caching=True)
    runner = KVContentRunner(sched)
    sched.add_request(_request("tenant-a", 13, 0, cache_salt="salt-a", max_tokens=1))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    prompt = list(range(1, 14))
    assert sched.kv.find_cached_prefix(prompt, "salt-a").num_tokens == 12
    assert sched.kv.find_cached_prefix(prompt, "salt-b").num_tokens == 0
    assert sched.kv.find_cached_prefix(prompt).num_tokens == 0
    sched.add_request(_request("tenant-b", 13, 1, cache_salt="salt-b", max_tokens=1))
    sched.add_request(_request("tenant-a-again", 13, 2, cache_salt="salt-a", max_tokens=1))
    out = sched.schedule()
    computed = {new.request_id: new.num_computed_tokens for new in out.new_requests}
    assert computed == {"tenant-b": 0, "tenant-a-again": 12}
