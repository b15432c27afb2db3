"""Blocks a sliding window has moved past go back to the pool while the sequence runs.

A fake runner keeps its own block tables from what the scheduler tells it (new tables, new blocks, copy-on-write
and hole replacements), records for every physical block the token prefix its K/V was computed from, and checks
every key a windowed layer reads: its block is no hole and holds this sequence's K/V for that position. So a
block released too early, reused while still read, or a prefix hit with a hole in its window, fails the test.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.core.block_pool import HOLE
from pagellm.core.kv_cache_manager import KVCacheManager, cdiv, max_blocks_per_sequence
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig
from pagellm.sampling_params import SamplingParams
from tests.core.test_prefix_cache import check_invariants

PROPERTY = settings(derandomize=True, deadline=None, max_examples=60,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class WindowCheckingRunner:
    def __init__(self, scheduler: Scheduler, window: int, seed: int) -> None:
        self.scheduler = scheduler
        self.window = window
        self.block_size = scheduler.kv.block_size
        self.rng = random.Random(seed)
        self.block_prefix: dict[int, tuple[int, ...]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.samples_at_first: dict[str, int] = {}
        self.hits = 0

    def _check_read(self, request_id: str, position: int) -> None:
        block = self.tables[request_id][position // self.block_size]
        assert block != HOLE, f"{request_id} reads key {position} from a hole"
        record = self.block_prefix.get(block, ())
        assert record[: position + 1] == tuple(self.tokens[request_id][: position + 1]) and len(record) > position, (
            f"{request_id} reads key {position} from block {block}, which holds other K/V")

    def step(self):
        out = self.scheduler.schedule()
        for request_id in out.finished_request_ids:
            for table in (self.tokens, self.tables, self.computed):
                table.pop(request_id, None)
        for source, destination in out.block_copies:
            self.block_prefix[destination] = self.block_prefix[source]
        for new in out.new_requests:
            self.tokens[new.request_id] = list(new.token_ids)
            self.tables[new.request_id] = list(new.block_ids)
            self.computed[new.request_id] = new.num_computed_tokens
            self.samples_at_first[new.request_id] = new.num_samples_at_first
            self.hits += new.num_computed_tokens
        for cached in out.cached_requests:
            table = self.tables[cached.request_id]
            for index, block_id in cached.replaced_blocks:
                table[index] = block_id
            table.extend(cached.new_block_ids)
            self.tokens[cached.request_id].extend(cached.new_token_ids)
        # Every layer writes the step's K/V before it attends.
        for request_id, n in out.num_scheduled_tokens.items():
            start, tokens, table = self.computed[request_id], self.tokens[request_id], self.tables[request_id]
            for position in range(start, start + n):
                block = table[position // self.block_size]
                assert block != HOLE, "a token is written into a hole"
                self.block_prefix[block] = tuple(tokens[: position + 1])
        result = ModelRunnerOutput()
        for request_id, n in out.num_scheduled_tokens.items():
            start = self.computed[request_id]
            for position in range(max(0, start - self.window + 1), start + n):
                self._check_read(request_id, position)
            self.computed[request_id] = start + n
            if start + n == len(self.tokens[request_id]):
                request = self.scheduler.requests[request_id]
                # A tiny vocabulary makes generated blocks repeat, so prefix hits happen mid-sequence too.
                token = result.sampled_token_ids[request_id] = self.rng.randrange(3)
                self.tokens[request_id].append(token)
                extra = self.samples_at_first.get(request_id, 1) if request.num_output_tokens == 0 else 1
                if extra > 1:
                    result.forked_token_ids[request_id] = [self.rng.randrange(3) for _ in range(extra - 1)]
        return out, self.scheduler.update_from_output(out, result)


def _check_holes(scheduler: Scheduler, window: int) -> None:
    """Holes are a prefix of each table and end where the window of the sequence's next token begins."""
    kv = scheduler.kv
    for request in scheduler.running:
        ids = kv.block_ids(request.request_id)
        holes = sum(1 for block_id in ids if block_id == HOLE)
        assert all(block_id == HOLE for block_id in ids[:holes])
        assert holes == len(ids) - kv.num_held_blocks(request.request_id)
        first_needed = max(0, request.num_computed_tokens - window + 1) // kv.block_size
        assert holes <= first_needed


def test_a_long_prompt_holds_about_one_window_of_blocks():
    window, block_size, prompt_len = 16, 4, 200
    kv = KVCacheManager(64, block_size, sliding_window=window)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256), kv)
    scheduler.add_request(Request("long", [7] * prompt_len, SamplingParams(max_tokens=8), 0, 8))
    runner = WindowCheckingRunner(scheduler, window, seed=0)
    peak, held_after_steps = 0, []
    while scheduler.has_unfinished_requests():
        out, _ = runner.step()
        peak = max(peak, kv.pool.num_used_blocks)
        if "long" in scheduler.requests:
            held_after_steps.append(kv.num_held_blocks("long"))
            _check_holes(scheduler, window)
    # Prefill chunks of 32 tokens plus the 15 keys before them; without freeing it would be all 52 blocks.
    assert peak <= max_blocks_per_sequence(256, block_size, window, 32) == cdiv(15 + 32, block_size) + 1
    # While decoding, each sequence holds about ceil(window / block_size) + 1 blocks.
    assert held_after_steps[-1] <= cdiv(window, block_size) + 1
    assert kv.pool.num_used_blocks == 0 and kv.stats().num_stored_tokens == 0


def test_released_entries_reach_the_runner_as_holes_and_shared_blocks_keep_their_other_owner():
    kv = KVCacheManager(32, 4, sliding_window=6)
    kv.allocate_slots("p", 16)
    kv.fork("p", "c")
    assert kv.release_slid_out_blocks("c", 16) == 2  # the next token (position 16) reads keys 11..16
    assert kv.block_ids("c")[:2] == [HOLE, HOLE] and HOLE not in kv.block_ids("p")
    assert kv.take_replaced_blocks("c") == [(0, HOLE), (1, HOLE)]
    assert [kv.pool.blocks[b].ref_cnt for b in kv.block_ids("p")] == [1, 1, 2, 2]
    assert kv.release_slid_out_blocks("c", 16) == 0
    kv.free("c")
    kv.free("p")
    assert kv.pool.num_free_blocks == 32


def test_a_model_with_a_global_layer_releases_nothing():
    kv = KVCacheManager(32, 4)
    kv.allocate_slots("a", 40)
    assert kv.release_slid_out_blocks("a", 40) == 0 and HOLE not in kv.block_ids("a")


@PROPERTY
@given(data=st.data())
def test_random_windowed_workloads_never_leak_double_free_or_read_a_released_block(data):
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    window = data.draw(st.integers(1, 12))
    budget = data.draw(st.integers(4, 24))
    max_model_len = 48
    per_sequence = max_blocks_per_sequence(max_model_len, block_size, window, budget) + 1
    kv = KVCacheManager(data.draw(st.integers(per_sequence, 3 * per_sequence)), block_size,
                        enable_prefix_caching=data.draw(st.booleans()), sliding_window=window)
    scheduler = Scheduler(SchedulerConfig(budget, 6, max_model_len), kv)
    runner = WindowCheckingRunner(scheduler, window, seed=data.draw(st.integers(0, 100)))
    prefixes = [[1 + i] * data.draw(st.integers(0, 20)) for i in range(2)]
    num_requests = data.draw(st.integers(1, 8))
    for i in range(num_requests):
        n = data.draw(st.integers(1, 3))
        prompt = (prefixes[data.draw(st.integers(0, 1))] + data.draw(st.lists(st.integers(0, 2), min_size=1,
                                                                               max_size=20)))[:max_model_len - 12]
        max_tokens = data.draw(st.integers(1, 12))
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0)
        scheduler.add_request(Request(f"r{i}", prompt, params, i, max_tokens, num_pending_forks=n - 1))
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        if data.draw(st.integers(0, 15)) == 0 and scheduler.running:
            victim = data.draw(st.sampled_from(sorted(r.request_id for r in scheduler.running)))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        runner.step()
        check_invariants(scheduler)
        _check_holes(scheduler, window)
    assert not scheduler.has_unfinished_requests(), "every sequence finishes"
    assert kv.pool.num_used_blocks == 0 and kv.stats().num_shared_blocks == 0 and kv.pool.num_stored_tokens == 0
