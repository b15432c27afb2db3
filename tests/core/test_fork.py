"""Forked block tables: reference counts, copy-on-write exactly at the first write into a shared block."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig
from pagellm.sampling_params import SamplingParams
from tests.core.test_prefix_cache import check_invariants

PROPERTY = settings(derandomize=True, deadline=None, max_examples=80,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_fork_shares_every_block_and_the_first_write_copies_the_partial_one():
    kv = KVCacheManager(16, 4)
    kv.allocate_slots("p", 6)  # blocks: one full, one holding 2 of 4 slots
    full, partial = kv.block_ids("p")
    kv.fork("p", "c")
    assert kv.block_ids("c") == [full, partial]
    assert [kv.pool.blocks[b].ref_cnt for b in (full, partial)] == [2, 2]
    assert kv.stats().num_shared_blocks == 2

    assert kv.allocate_slots("c", 7) == []  # 7th token goes into the shared partial block: copy first
    (copy,) = kv.take_block_copies()
    assert copy[0] == partial and kv.block_ids("c") == [full, copy[1]]
    assert kv.take_replaced_blocks("c") == [(1, copy[1])]
    assert kv.pool.blocks[partial].ref_cnt == 1 and kv.stats().num_cow_copies == 1

    assert kv.allocate_slots("p", 7) == []  # the parent is now the only holder: it writes in place
    assert kv.take_block_copies() == [] and kv.block_ids("p") == [full, partial]
    kv.free("p")
    kv.free("c")
    assert kv.pool.num_free_blocks == 16


def test_no_copy_when_the_shared_blocks_are_all_full():
    kv = KVCacheManager(8, 4)
    kv.allocate_slots("p", 8)
    kv.fork("p", "c")
    assert len(kv.allocate_slots("c", 9)) == 1  # a fresh block for the 9th token, nothing to copy
    assert kv.take_block_copies() == []


def test_copy_on_write_counts_against_the_free_blocks():
    kv = KVCacheManager(2, 4)
    kv.allocate_slots("p", 6)
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 7) is None  # the copy needs a free block and there is none
    assert kv.take_block_copies() == [] and kv.block_ids("c") == kv.block_ids("p")


def _request(i: int, prompt_len: int, n: int, max_tokens: int) -> Request:
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0)
    return Request(f"r{i}", [100 + i] * prompt_len, params, i, max_tokens, num_pending_forks=n - 1)


class ForkingRunner:
    """Fakes the model: k samples at a sequence's first token when it asks for k, else one."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.samples_at_first: dict[str, int] = {}
        self.counter = 0

    def step(self):
        out = self.scheduler.schedule()
        for new in out.new_requests:
            self.samples_at_first[new.request_id] = new.num_samples_at_first
        result = ModelRunnerOutput()
        for request_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            if request.num_computed_tokens + n < request.num_tokens:
                continue
            self.counter += 1
            result.sampled_token_ids[request_id] = self.counter % 7
            extra = self.samples_at_first.get(request_id, 1) if request.num_output_tokens == 0 else 1
            if extra > 1:
                result.forked_token_ids[request_id] = [(self.counter + j) % 7 for j in range(1, extra)]
        return out, self.scheduler.update_from_output(out, result)


@PROPERTY
@given(data=st.data())
def test_random_forking_workloads_keep_ref_counts_exact(data):
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    max_model_len = 40
    kv = KVCacheManager(data.draw(st.integers(max_model_len // block_size * 2, 80)), block_size,
                        enable_prefix_caching=data.draw(st.booleans()))
    scheduler = Scheduler(SchedulerConfig(data.draw(st.integers(8, 64)), 8, max_model_len), kv)
    runner = ForkingRunner(scheduler)
    expected: dict[str, int] = {}
    for i in range(data.draw(st.integers(1, 6))):
        n = data.draw(st.integers(1, 4))
        max_tokens = data.draw(st.integers(1, 8))
        scheduler.add_request(_request(i, data.draw(st.integers(1, 20)), n, max_tokens))
        expected[f"r{i}"] = n
    produced: dict[str, set[int]] = {}
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        if data.draw(st.integers(0, 9)) == 0 and scheduler.running:
            victim = data.draw(st.sampled_from(sorted(r.request_id for r in scheduler.running)))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = runner.step()
        for output in outputs:
            produced.setdefault(output.group_id, set()).add(output.sample_index)
        check_invariants(scheduler)
        for request in scheduler.running:
            assert request.num_computed_tokens <= request.num_tokens
    assert not scheduler.has_unfinished_requests(), "every sequence finishes"
    assert kv.pool.num_used_blocks == 0 and kv.stats().num_shared_blocks == 0
    for group, indices in produced.items():
        assert indices <= set(range(expected[group]))


def test_group_abort_ends_every_sequence_and_frees_shared_blocks():
    kv = KVCacheManager(32, 4)
    scheduler = Scheduler(SchedulerConfig(64, 8, 64), kv)
    runner = ForkingRunner(scheduler)
    scheduler.add_request(_request(0, 6, 4, 10))
    runner.step()
    assert len(scheduler.groups["r0"]) == 4 and kv.stats().num_shared_blocks == 2
    scheduler.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED, whole_groups=True)
    assert not scheduler.requests and kv.pool.num_used_blocks == 0
