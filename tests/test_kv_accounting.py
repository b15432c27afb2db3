"""Per-request KV accounting (RequestOutput.kv) against hand-computed cases (issue 14 item 1).

Block size 16 throughout; a 40-token prompt fills blocks 0-1 and 8 slots of block 2.
"""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.block_map import CACHED, FREE, NO_OWNER, USED, take_block_map
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_usage import KVUsage
from pagellm.core.request import Request
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.sampling_params import BeamSearchParams

PROMPT_40 = {"prompt_token_ids": list(range(1000, 1040))}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256)


def _fresh(tiny_llama_dir, **kwargs) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", **{"max_model_len": 256, **kwargs})


def test_n4_on_a_40_token_prompt_shares_three_blocks_and_copies_one_for_three_samples(tiny_llama_dir):
    llm = _fresh(tiny_llama_dir, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)
    (output,) = llm.generate([PROMPT_40], params, use_tqdm=False)
    # At the first sample all four sequences share blocks 0-2. Writing token 41 into the half-full
    # block 2, three of them copy it. Each ends with 59 computed tokens: 2 shared + 4 x 2 own blocks,
    # and when each took its block 3 (for token 49) every sequence had 15 unfilled slots.
    assert output.kv == KVUsage(peak_blocks=10, shared_blocks=3, cow_copies=3, cached_tokens=0, preemptions=0,
                                peak_waste_slots=4 * 15)


def test_a_prefix_cache_hit_reports_its_tokens_and_shared_blocks(llm):
    prompt = {"prompt_token_ids": list(range(2000, 2040))}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (first,) = llm.generate([prompt], params, use_tqdm=False)
    (second,) = llm.generate([prompt], params, use_tqdm=False)
    # 43 computed tokens: 3 blocks; block 2 holds 8 tokens at admission, the most unfilled slots.
    assert first.kv == KVUsage(peak_blocks=3, shared_blocks=0, cached_tokens=0, peak_waste_slots=8)
    # The second finds blocks 0-1 (32 tokens) in the cache; the last prompt token is always computed.
    assert second.kv == KVUsage(peak_blocks=3, shared_blocks=2, cached_tokens=32, peak_waste_slots=8)
    assert second.num_cached_tokens == 32


def test_a_preempted_request_counts_its_preemption(tiny_llama_dir):
    # Four blocks for two requests that each grow to four: the newer one is preempted when the older
    # needs its third block, waits until the older one finishes, and is recomputed.
    llm = _fresh(tiny_llama_dir, num_gpu_blocks_override=4, max_model_len=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3000, 3020))}, {"prompt_token_ids": list(range(4000, 4020))}]
    older, newer = llm.generate(prompts, params, use_tqdm=False)
    # 49 computed tokens: 4 blocks. Waste peaks at 15 slots when 33 and 49 tokens need a new block.
    assert older.kv == KVUsage(peak_blocks=4, preemptions=0, peak_waste_slots=15)
    assert newer.kv == KVUsage(peak_blocks=4, preemptions=1, peak_waste_slots=15)
    assert older.outputs[0].token_ids == llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids


def test_beam_search_reports_the_blocks_of_all_its_beams(llm):
    (result,) = llm.beam_search([{"prompt_token_ids": list(range(5000, 5040))}],
                                BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True))
    # The first step forks the prompt's beam: both share blocks 0-2; the first to write token 41
    # copies block 2 (the other then holds it alone): 4 blocks. Waste peaks as the copy takes token 41
    # while the original still holds 8: 16 - 9 + 16 - 8 = 15 unfilled slots (14 once both wrote).
    assert result.kv == KVUsage(peak_blocks=4, shared_blocks=3, cow_copies=1, peak_waste_slots=15)


def test_every_streamed_output_carries_the_running_figures(llm):
    params = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("stream", {"prompt_token_ids": list(range(6000, 6030))}, params)
    peaks = []
    while engine.has_unfinished_requests():
        peaks += [output.kv.peak_blocks for output in engine.step()]
    # 30 prompt tokens: 2 blocks, a third for token 33; 47 computed tokens need no fourth.
    assert peaks[0] == 2 and peaks[-1] == 3 and peaks == sorted(peaks)


def test_the_account_follows_forks_copies_and_frees_in_the_manager():
    kv = KVCacheManager(16, 4)
    kv.allocate_slots("p", 6)
    account = kv.account_of("p")
    kv.fork("p", "c")
    assert kv.account_of("c") is account and (account.num_blocks, account.waste) == (2, 2)
    kv.allocate_slots("c", 7)
    assert (account.num_blocks, account.cow_copies, account.waste) == (3, 1, 3)
    kv.free("c")
    assert (account.num_blocks, account.waste) == (2, 2)
    kv.free("p")
    assert account.num_blocks == 0 and account.waste == 0
    assert account.snapshot() == KVUsage(peak_blocks=3, shared_blocks=2, cow_copies=1, peak_waste_slots=3)


def test_the_block_map_shows_states_and_owners_from_the_pools_arrays():
    scheduler = Scheduler(SchedulerConfig(64, 4, 64), KVCacheManager(6, 4, enable_prefix_caching=True))
    request = Request("a", list(range(6)), SamplingParams(max_tokens=1), 0, 1)
    scheduler.add_request(request)
    scheduler.kv.allocate_slots("a", 6, account=request.kv_account)  # blocks 0 (full) and 1 (2 of 4)
    scheduler.kv.publish_full_blocks("a", request.all_token_ids, 6)
    scheduler.fork_request("a", "a#1")  # a waiting parent: the child waits too, with no blocks of its own
    scheduler.kv.fork("a", "a#1")
    scheduler.kv.allocate_slots("a#1", 7)  # copies block 1 into block 2
    picture = take_block_map(scheduler)
    assert picture.states.tolist() == [USED + 1, USED, USED, FREE, FREE, FREE]
    serial = request.kv_account.serial
    assert picture.owners.tolist() == [serial, serial, serial, NO_OWNER, NO_OWNER, NO_OWNER]
    assert picture.owner_ids == {serial: "a"}
    scheduler.kv.free("a")
    scheduler.kv.free("a#1")
    picture = take_block_map(scheduler)
    assert picture.states.tolist() == [CACHED, FREE, FREE, FREE, FREE, FREE] and picture.owner_ids == {}
