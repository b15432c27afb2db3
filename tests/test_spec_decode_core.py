"""Speculative decoding without a model: the config, the proposers, and the scheduler's rollback (pagellm/core)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.config import ArgumentValueError, EngineArgs
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerStats
from pagellm.metrics import PrometheusStatLogger
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.config import SpeculativeConfig
from pagellm.spec_decode.ngram import TokenBuffer, propose_ngram
from pagellm.spec_decode.speculator import (STALE_AFTER, STEP_COST_WEIGHT, Speculator, StepCosts, best_num_drafts,
                                             expected_tokens)
from pagellm.spec_decode.suffix import SuffixProposer, SuffixTrie

# ---- config --------------------------------------------------------------------------------------------


def test_config_takes_vllms_fields_and_defaults():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 4, 4)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    suffix = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8, "enforce_eager": True,
                                          "suffix_decoding_max_tree_depth": 16})
    assert (suffix.method, suffix.suffix_decoding_max_tree_depth) == ("suffix", 16)
    assert EngineArgs(speculative_config={"method": "suffix", "num_speculative_tokens": 4}).speculative_config


@pytest.mark.parametrize("config, words", [
    ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens=0", ">= 1"]),
    ({"method": "medusa", "num_speculative_tokens": 2}, ["method='medusa'", "ngram, suffix"]),
    ({"model": "/some/draft", "num_speculative_tokens": 2}, ["model='/some/draft'"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ["prompt_lookup_min=4", "prompt_lookup_max=2"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "3"}, ["prompt_lookup_max='3'"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     ["draft_tensor_parallel_size=2"]),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2},
     ["suffix_decoding_min_token_prob=2"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, ["unknown field(s) lookahead"]),
    ("ngram", ["must be a dict"]),
])
def test_bad_configs_are_refused_naming_the_field(config, words):
    with pytest.raises(ArgumentValueError) as info:
        EngineArgs(speculative_config=config)
    for word in words:
        assert word in str(info.value), str(info.value)


# ---- proposers -----------------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_latest_match():
    tokens = np.array([1, 2, 3, 4, 5, 9, 3, 4, 7, 8, 2, 3, 4], dtype=np.int64)
    # "2 3 4" (3 tokens) matched at the start beats the later, shorter "3 4".
    assert propose_ngram(tokens, 1, 3, 3) == [5, 9, 3]
    assert propose_ngram(tokens, 1, 2, 2) == [7, 8]  # up to 2 tokens: the latest "3 4"
    assert propose_ngram(tokens, 4, 5, 3) == []  # no match of 4
    assert propose_ngram(np.array([5, 6, 7]), 1, 3, 2) == []


def test_token_buffer_follows_a_growing_list():
    buffer, tokens = TokenBuffer(), list(range(10))
    assert buffer.sync(tokens).tolist() == tokens
    tokens += list(range(500))
    assert buffer.sync(tokens).tolist() == tokens


def test_suffix_trie_drafts_the_frequent_continuation_and_forgets_what_it_removes():
    trie = SuffixTrie(max_depth=8)
    trie.add([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4])
    draft = trie.speculate([9, 1, 2, 3], max_drafts=4, max_spec_factor=2.0, min_token_prob=0.1)
    assert draft.token_ids[0] == 4 and draft.match_length == 3
    assert trie.speculate([7, 7], 4, 1.0, 0.1).token_ids == []
    trie.remove([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4])
    assert trie.num_nodes == 0 and not trie.root.children


def test_suffix_proposer_uses_its_own_and_the_global_trie_with_bounded_memory():
    proposer = SuffixProposer(max_depth=16, max_cached_requests=2, max_spec_factor=2.0, min_token_prob=0.1)
    prompt = [10, 11, 12, 13, 14, 15, 20, 10, 11, 12]
    assert proposer.propose("a", prompt, 3) == [13, 14, 15]
    for name in ("a", "b", "c"):
        proposer.finish(name, [40, 41, 42, 43, 44, 45])
    assert len(proposer._cached_outputs) == 2  # FIFO eviction at max_cached_requests
    # A new request that starts like the cached outputs is drafted from the global trie.
    assert proposer.propose("d", [1, 40, 41, 42], 3) == [43, 44, 45]
    proposer.finish("d", [])
    for _ in range(2):
        proposer.global_trie.remove(proposer._cached_outputs.popleft())
    assert proposer.global_trie.num_nodes == 0


# ---- the scheduler: drafts, acceptance, rollback --------------------------------------------------------

VOCAB = 7
EOS = 0


def _target(tokens: list[int]) -> int:
    """The fake model's greedy next token: a fixed function of the context (sometimes EOS)."""
    return (tokens[-1] * 3 + tokens[-2] + len(tokens)) % VOCAB


class _OracleSpeculator(Speculator):
    """Drafts the target's own continuation, each token wrong with probability `error` (seeded)."""

    def __init__(self, k: int, error: float, seed: int, by_batch: int = 64) -> None:
        super().__init__(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k,
                                                      "disable_by_batch_size": by_batch}))
        self.rng, self.error = random.Random(seed), error

    def drafts_for(self, request, budget, max_model_len, num_rows=1):
        limit = min(self.config.num_speculative_tokens, budget, max_model_len - request.num_tokens,
                    request.max_output_tokens - request.num_output_tokens - 1)
        sequence, drafts = list(request.all_token_ids), []
        for _ in range(max(0, limit)):
            token = _target(sequence)
            if self.rng.random() < self.error:
                token = (token + 1) % VOCAB
            drafts.append(token)
            sequence.append(token)
        return drafts


def _fake_step(scheduler: Scheduler) -> None:
    out = scheduler.schedule()
    result = ModelRunnerOutput()
    for request_id, num_scheduled in out.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        drafts = out.spec_token_ids.get(request_id, [])
        if request.num_computed_tokens + num_scheduled - len(drafts) < request.num_tokens:
            continue  # a prefill chunk
        sequence, taken = list(request.all_token_ids), []
        for position in range(len(drafts) + 1):
            token = _target(sequence)
            taken.append(token)
            sequence.append(token)
            if position == len(drafts) or drafts[position] != token:
                break
        result.sampled_token_ids[request_id] = taken[0]
        if len(taken) > 1:
            result.spec_token_ids[request_id] = taken[1:]
    scheduler.update_from_output(out, result)


def _cached_chains(kv: KVCacheManager) -> set[tuple[int, ...]]:
    """The prefix cache as the token sequences its blocks' chains spell (block ids do not matter)."""
    by_identity = {block.identity: block for block in kv.pool.cached.values()}
    chains = set()
    for block in kv.pool.cached.values():
        tokens, current = [], block
        while current is not None:
            tokens[:0] = current.key.token_ids
            current = by_identity.get(current.key.parent) if current.key.parent else None
        chains.add(tuple(tokens))
    return chains


def _run(prompts, max_tokens, speculator, num_blocks=256, budget=64, block_size=4):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(budget, 8, 128), kv, speculator=speculator)
    requests = []
    for index, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
        request = Request(str(index), prompt, SamplingParams(temperature=0, max_tokens=limit), index, limit,
                          frozenset({EOS}))
        scheduler.add_request(request)
        requests.append(request)
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        _fake_step(scheduler)
    assert not scheduler.has_unfinished_requests()
    return [r.output_token_ids for r in requests], kv, scheduler


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    prompts=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=2, max_size=20), min_size=1, max_size=5),
    max_tokens=st.lists(st.integers(1, 30), min_size=5, max_size=5),
    k=st.integers(1, 6),
    error=st.sampled_from([0.0, 0.2, 0.6, 1.0]),
    seed=st.integers(0, 1000),
    budget=st.sampled_from([5, 16, 64]),
)
def test_rollback_leaves_blocks_and_prefix_cache_as_without_speculation(prompts, max_tokens, k, error, seed, budget):
    max_tokens = max_tokens[: len(prompts)]
    plain, plain_kv, _ = _run(prompts, max_tokens, None, budget=budget)
    spec, spec_kv, scheduler = _run(prompts, max_tokens, _OracleSpeculator(k, error, seed), budget=budget)
    assert spec == plain
    assert _cached_chains(spec_kv) == _cached_chains(plain_kv)
    assert spec_kv.pool.num_free_blocks == plain_kv.pool.num_free_blocks == spec_kv.pool.num_blocks
    assert spec_kv.pool.num_stored_tokens == plain_kv.pool.num_stored_tokens == 0
    stats = scheduler.get_stats().spec_decoding
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens


@pytest.mark.parametrize("prompt", [[1, 2, 3, 4, 5, 6, 1, 2], [3, 3, 4, 5, 1], [2] * 9])
def test_rollback_mid_run_equals_the_run_without_speculation_step_for_step(prompt):
    """After every step, the request's blocks, slots and the prefix cache equal those of a plain run stepped to the
    same number of tokens."""
    plain_kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    spec_kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    plain = Scheduler(SchedulerConfig(64, 8, 128), plain_kv)
    spec = Scheduler(SchedulerConfig(64, 8, 128), spec_kv,
                     speculator=_OracleSpeculator(5, 0.3, seed=len(prompt)))
    for scheduler in (plain, spec):
        scheduler.add_request(Request("r", prompt, SamplingParams(temperature=0, max_tokens=40), 0, 40))
    twin, request = plain.requests["r"], spec.requests["r"]
    while spec.has_unfinished_requests():
        _fake_step(spec)
        while twin.num_tokens < request.num_tokens:
            _fake_step(plain)
        assert twin.all_token_ids == request.all_token_ids
        assert twin.num_computed_tokens == request.num_computed_tokens
        assert plain_kv.block_ids("r") == spec_kv.block_ids("r")
        assert _cached_chains(spec_kv) == _cached_chains(plain_kv)
        assert spec_kv.pool.free_queue.block_ids() == plain_kv.pool.free_queue.block_ids()
        assert spec_kv.pool.num_stored_tokens == plain_kv.pool.num_stored_tokens


def test_a_lora_request_publishes_its_verified_blocks_under_its_adapter():
    """A first block completed by accepted drafts carries the adapter in its key (later blocks chain on to it), as
    one of a plain step does: under the base model's key a base request with the same tokens would reuse K/V the
    adapter computed. The prompt is shorter than a block, so the first block fills during speculation."""
    from pagellm.lora.request import LoRARequest
    from pagellm.lora.slot_table import LoRASlotTable

    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(64, 8, 128), kv, speculator=_OracleSpeculator(5, 0.0, seed=1),
                          lora_slots=LoRASlotTable(1))
    request = Request("r", [1, 2], SamplingParams(temperature=0, max_tokens=20), 0, 20)
    request.lora_request = LoRARequest("adapter", 7, "/unused")
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        _fake_step(scheduler)
    assert scheduler.get_stats().spec_decoding.num_accepted_tokens > 0
    first_blocks = [block.key for block in kv.pool.cached.values() if block.key.parent is None]
    assert [key.extra for key in first_blocks] == [("lora", 7)]


def test_drafts_stop_above_disable_by_batch_size_and_never_preempt():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(64, 8, 128), kv, speculator=_OracleSpeculator(4, 0.0, 0, by_batch=1))
    for index in range(2):
        scheduler.add_request(Request(str(index), [1, 2, 3], SamplingParams(temperature=0, max_tokens=9), index, 9))
    _fake_step(scheduler)
    assert not scheduler.schedule().spec_token_ids  # two running, more than disable_by_batch_size=1
    # A tight pool: drafts are not given where their slots would need a preemption.
    tight = KVCacheManager(6, 4)  # the 23 tokens of the request fit, its last drafts do not
    scheduler = Scheduler(SchedulerConfig(64, 8, 128), tight, speculator=_OracleSpeculator(4, 0.0, 0))
    request = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20), 0, 20)
    scheduler.add_request(request)
    for _ in range(40):
        if scheduler.has_unfinished_requests():
            _fake_step(scheduler)
    assert not scheduler.has_unfinished_requests() and request.num_output_tokens == 20
    assert scheduler.num_preemptions == 0 and scheduler.speculator.stats.num_drafts > 0


def test_prometheus_exports_the_spec_decode_counters():
    from prometheus_client import generate_latest

    scheduler = _run([[1, 2, 4]], [12], _OracleSpeculator(3, 0.3, 1))[2]
    logger = PrometheusStatLogger("m", 128)
    stats: SchedulerStats = scheduler.get_stats()
    logger._record_scheduler(stats, 0)
    text = generate_latest(logger.registry).decode()
    spec = stats.spec_decoding
    assert spec.num_drafts > 0
    for name, value in (("num_drafts", spec.num_drafts), ("num_draft_tokens", spec.num_draft_tokens),
                        ("num_accepted_tokens", spec.num_accepted_tokens)):
        assert f'vllm:spec_decode_{name}_total{{engine="0",model_name="m"}} {float(value)}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"}' in text


# ---- what a draft costs: sizing drafts by measured step times ------------------------------------------

def test_step_costs_interpolate_between_measured_sizes_and_stay_flat_beyond():
    costs = StepCosts()
    assert costs.relative(6, 1) == 1.0  # nothing measured: no cost assumed
    costs.observe(1, 0.010)
    assert costs.relative(6, 1) == 1.0  # only the plain step: a larger one is tried before it is priced
    costs.observe(6, 0.035)
    assert costs.relative(6, 1) == pytest.approx(3.5)
    assert costs.relative(3, 1) == pytest.approx(1.0 + 2 * 0.5)  # 10 ms + 2/5 of the 25 ms between them
    assert costs.relative(9, 1) == pytest.approx(3.5)
    costs.observe(6, 0.015)  # a moving average: the newer measurement counts for STEP_COST_WEIGHT
    assert costs.relative(6, 1) == pytest.approx((0.035 + STEP_COST_WEIGHT * (0.015 - 0.035)) / 0.010)
    for _ in range(STALE_AFTER):
        costs.observe(1, 0.010)
    assert costs.relative(6, 1) == 1.0  # not measured for STALE_AFTER decode steps: to be tried again


def _costs(per_extra_row: float) -> StepCosts:
    costs = StepCosts()
    for tokens in (1, 9):
        costs.observe(tokens, 1.0 + per_extra_row * (tokens - 1))
    return costs


@pytest.mark.parametrize("acceptance, per_extra_row, expected", [
    (0.3, 0.02, 3),  # a float model: extra rows nearly free, even poor drafts pay (up to 3: 1.34 tokens per step)
    (0.9, 0.02, 5),
    (0.1, 0.36, 0),  # int8 products, rarely accepted drafts: none pays
    (0.6, 0.36, 1),  # int8 products, good drafts: one, since the next ones cost more than they yield
    (0.95, 0.36, 5),
])
def test_drafts_are_sized_by_the_tokens_per_second_they_buy(acceptance, per_extra_row, expected):
    assert best_num_drafts(acceptance, 5, 1, _costs(per_extra_row)) == expected
    assert expected_tokens(acceptance, 2) == pytest.approx(1 + acceptance + acceptance ** 2)


def test_a_request_whose_drafts_do_not_pay_pauses_doubling_and_probes_again():
    speculator = Speculator(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                                         "prompt_lookup_min": 1}))
    speculator.costs = _costs(0.36)
    # A prompt that repeats: ngram always finds a continuation to draft.
    request = Request("r", [5, 6] * 20, SamplingParams(temperature=0, max_tokens=500), 0, 500)
    drafted_steps = []
    for step in range(400):
        drafts = speculator.drafts_for(request, budget=64, max_model_len=1024)
        if drafts:
            drafted_steps.append(step)
            speculator.record("r", len(drafts), 0)  # every draft rejected
    # The prior (a half) buys one draft; after it, a step that finds no k paying, a pause of 1, 2, 4 ... 64
    # steps, and one probe.
    gaps = np.diff(drafted_steps)
    assert list(gaps) == [2 + pause for pause in (1, 2, 4, 8, 16, 32, 64, 64, 64, 64)], drafted_steps
    assert all(later >= earlier for earlier, later in zip(gaps, gaps[1:])), drafted_steps
    # Drafts that are accepted again (the text turned to copying) keep it drafting.
    speculator.record("r", 1, 1)
    steps_with_drafts = 0
    for _ in range(100):
        drafts = speculator.drafts_for(request, budget=64, max_model_len=1024)
        if drafts:
            steps_with_drafts += 1
            speculator.record("r", len(drafts), len(drafts))
    assert steps_with_drafts > 90


@pytest.mark.step_timings
def test_the_scheduler_prices_drafts_by_decode_only_steps():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(64, 8, 128), kv, speculator=_OracleSpeculator(3, 0.0, 0))
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=9), 0, 9))
    prefill = scheduler.schedule()
    scheduler.record_step_time(prefill, 0.5)
    assert scheduler.speculator.costs.seconds == {}  # a prefill says nothing of a decode step's cost
    scheduler.update_from_output(prefill, ModelRunnerOutput(sampled_token_ids={"a": 4}))
    decode = scheduler.schedule()
    assert decode.spec_token_ids["a"]
    scheduler.record_step_time(decode, 0.02)
    assert scheduler.speculator.costs.seconds == {1 + len(decode.spec_token_ids["a"]): 0.02}
