"""Prefix caching in the core: content-addressed blocks, lazy LRU eviction, no leaks, never wrong K/V.

A fake runner records, for every physical block it writes, the whole token prefix the block's K/V
was computed from (K/V depends on every earlier token). A prefix-cache hit is correct exactly when
each hit block's recorded prefix equals the new request's tokens up to that block's end.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.core.block_pool import HOLE, BlockKey
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig
from pagellm.sampling_params import SamplingParams

PROPERTY = settings(derandomize=True, deadline=None, max_examples=80,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class ContentCheckingRunner:
    def __init__(self, scheduler: Scheduler, seed: int) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.kv.block_size
        self.rng = random.Random(seed)
        self.block_prefix: dict[int, tuple[int, ...]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.hits = 0

    def step(self) -> list:
        out = self.scheduler.schedule()
        for request_id in out.finished_request_ids:
            for table in (self.tokens, self.tables, self.computed):
                table.pop(request_id, None)
        for new in out.new_requests:
            self.tokens[new.request_id] = list(new.token_ids)
            self.tables[new.request_id] = list(new.block_ids)
            self.computed[new.request_id] = new.num_computed_tokens
            for index in range(new.num_computed_tokens // self.block_size):
                expected = tuple(new.token_ids[: (index + 1) * self.block_size])
                assert self.block_prefix[new.block_ids[index]] == expected, "a cache hit served wrong K/V"
                self.hits += 1
        for cached in out.cached_requests:
            self.tables[cached.request_id].extend(cached.new_block_ids)
        sampled = {}
        for request_id, n in out.num_scheduled_tokens.items():
            start = self.computed[request_id]
            tokens, table = self.tokens[request_id], self.tables[request_id]
            for position in range(start, start + n):
                block = table[position // self.block_size]
                self.block_prefix[block] = tuple(tokens[: position + 1])
            self.computed[request_id] = start + n
            if start + n == len(tokens):
                token = self.rng.randrange(3)  # a tiny vocabulary makes generated blocks repeat too
                tokens.append(token)
                sampled[request_id] = token
        return self.scheduler.update_from_output(out, ModelRunnerOutput(sampled))


def check_invariants(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    pool = kv.pool
    owners: dict[int, int] = {}
    for request in scheduler.running:
        for block_id in kv.block_ids(request.request_id):
            if block_id != HOLE:  # a block a sliding window moved past, already back in the pool
                owners[block_id] = owners.get(block_id, 0) + 1
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    for block in pool.blocks:
        assert block.ref_cnt == owners.get(block.block_id, 0), "ref count == number of tables holding the block"
        assert (block.ref_cnt == 0) == (block.block_id in set(free_ids)), "in use => never in the free queue"
    for key, block in pool.cached.items():
        assert block.key == key
    assert pool.num_used_blocks == len(owners)
    assert pool.num_shared_blocks == sum(1 for n in owners.values() if n > 1)


def run_workload(data, block_size: int, num_blocks: int, max_model_len: int, seed: int) -> ContentCheckingRunner:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_batched_tokens=data.draw(st.integers(8, 64)), max_num_seqs=4,
                             max_model_len=max_model_len, enable_chunked_prefill=True)
    scheduler = Scheduler(config, kv)
    runner = ContentCheckingRunner(scheduler, seed)
    prefixes = [[1 + (seed + i) % 5] * data.draw(st.integers(0, 3 * block_size)) for i in range(3)]
    num_requests = data.draw(st.integers(1, 12))
    arrivals = iter(range(num_requests))
    pending = num_requests
    for _ in range(2000):
        if pending and data.draw(st.booleans()):
            i = next(arrivals)
            prefix = prefixes[data.draw(st.integers(0, 2))]
            tail = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=block_size))
            prompt = (prefix + tail)[: max_model_len - 4]
            sp = SamplingParams(max_tokens=data.draw(st.integers(1, 12)))
            scheduler.add_request(Request(f"r{i}", prompt, sp, i, min(sp.max_tokens, max_model_len - len(prompt))))
            pending -= 1
        if scheduler.has_unfinished_requests():
            runner.step()
            check_invariants(scheduler)
        elif not pending:
            break
    assert not scheduler.has_unfinished_requests(), "every request finishes"
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_stored_tokens == 0
    return runner


@PROPERTY
@given(data=st.data())
def test_random_shared_prefix_workloads_never_leak_or_serve_wrong_kv(data):
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    max_model_len = 48
    num_blocks = data.draw(st.integers(-(-max_model_len // block_size), 64))
    run_workload(data, block_size, num_blocks, max_model_len, seed=data.draw(st.integers(0, 100)))


@PROPERTY
@given(data=st.data())
def test_colliding_hashes_still_serve_the_right_kv(data, monkeypatch_module):
    runner = run_workload(data, 2, 40, 32, seed=data.draw(st.integers(0, 100)))
    assert runner is not None


@pytest.fixture(scope="module")
def monkeypatch_module():
    # Every key hashes alike: the dict must fall back on comparing keys, never trust the hash.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockKey, "__hash__", lambda self: 0)
        assert hash(BlockKey(None, (1,))) == hash(BlockKey((3, 1), (2, 2))) == 0
        yield mp


def _request(i: int, prompt: list[int], max_tokens: int = 1) -> Request:
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), i, max_tokens)


def _run_alone(scheduler: Scheduler, runner: ContentCheckingRunner, request: Request) -> None:
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        runner.step()


def test_second_request_computes_only_what_the_cache_lacks():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(256, 8, 128), kv)
    runner = ContentCheckingRunner(scheduler, 0)
    prefix = list(range(100, 122))  # 22 tokens: 5 full blocks of 4
    _run_alone(scheduler, runner, _request(0, prefix + [1, 2]))
    second = _request(1, prefix + [7, 8, 9])
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert out.new_requests[0].num_computed_tokens == 20
    assert out.num_scheduled_tokens["r1"] == len(second.prompt_token_ids) - 20
    assert second.num_cached_tokens == 20
    stats = kv.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (24 + 25, 20)


def test_eviction_takes_least_recently_freed_blocks_first():
    block_size, num_blocks = 4, 12
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(64, 4, 48), kv)
    runner = ContentCheckingRunner(scheduler, 0)
    a = [10] * 16 + [1]  # 4 full blocks + 1 partial
    b = [20] * 16 + [1]
    _run_alone(scheduler, runner, _request(0, a))
    _run_alone(scheduler, runner, _request(1, b))
    assert kv.stats().num_cached_blocks == 8
    # 7 new blocks: the 2 never-used blocks, then a's 5 (a was freed before b), none of b's.
    _run_alone(scheduler, runner, _request(2, [30] * 25 + [5]))
    assert kv.find_cached_prefix(a).num_tokens == 0
    assert kv.find_cached_prefix(b).num_tokens == 16
    # Hitting b's blocks again takes them out of the middle of the free queue and back in use.
    scheduler.add_request(_request(3, b, max_tokens=3))
    runner.step()
    assert scheduler.requests["r3"].num_cached_tokens == 16
    check_invariants(scheduler)


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(32, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(64, 4, 48), kv)
    runner = ContentCheckingRunner(scheduler, 0)
    _run_alone(scheduler, runner, _request(0, [5] * 20))
    _run_alone(scheduler, runner, _request(1, [5] * 20))
    assert runner.hits == 0 and kv.stats().prefix_cache_hits == 0 and not kv.pool.cached


def test_preempted_request_resumes_from_its_own_cached_blocks():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(64, 4, 32), kv)
    runner = ContentCheckingRunner(scheduler, 0)
    for i in range(3):
        scheduler.add_request(_request(i, [40 + i] * 9, max_tokens=12))
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        runner.step()
        check_invariants(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_preemptions > 0
    assert runner.hits > 0, "recomputation after preemption reused cached blocks"
    assert kv.pool.num_used_blocks == 0


def test_a_reused_parent_block_orphans_the_children_keyed_on_it():
    """X published its second block chained on A's canonical first block (X computed a duplicate of
    it); once that block is evicted and reused for other tokens, X's second block must not match a
    prefix that now runs through the reused block, although its own tokens do."""
    kv = KVCacheManager(6, 2, enable_prefix_caching=True)
    a_tokens, x_tokens = [1, 1, 2, 2, 9], [1, 1, 3, 3, 9]
    assert kv.allocate_slots("A", 5) is not None and kv.allocate_slots("X", 5) is not None
    kv.publish_full_blocks("A", a_tokens, 4)
    kv.publish_full_blocks("X", x_tokens, 4)
    assert kv.find_cached_prefix(x_tokens).num_tokens == 4
    first_of_a = kv.block_ids("A")[0]
    kv.free("A")  # tail first: A's first block is the last of its three to be handed out again
    for filler in ("F1", "F2"):
        kv.allocate_slots(filler, 2)
    assert kv.allocate_slots("Y", 2) is not None and kv.block_ids("Y") == [first_of_a]
    y_tokens = [7, 7, 3, 3, 5]
    kv.publish_full_blocks("Y", y_tokens, 2)
    assert kv.find_cached_prefix(y_tokens).num_tokens == 2, "X's (3, 3) block was computed after (1, 1)"


def test_unchunked_prompt_that_needs_the_whole_budget_gets_a_step_of_its_own():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(16, 4, 48, enable_chunked_prefill=False), kv)
    runner = ContentCheckingRunner(scheduler, 0)
    scheduler.add_request(Request("dec", [7] * 3, SamplingParams(max_tokens=30), 0, 30))
    runner.step()
    runner.step()
    scheduler.add_request(Request("long", [8] * 16, SamplingParams(max_tokens=1), 1, 1))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"long": 16}, "the decode pauses for one step instead of starving the prompt"
    scheduler.update_from_output(out, ModelRunnerOutput({"long": 1}))
    assert "long" not in scheduler.requests
    assert scheduler.schedule().num_scheduled_tokens == {"dec": 1}
