"""Automatic prefix caching and chunked prefill on the tiny model, against transformers."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.block_pool import BlockKey
from tests.helpers import PROMPTS, hf_greedy

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SYSTEM = ("You are a careful assistant. Answer briefly and cite the rule you apply. " * 8).strip()
QUESTIONS = ["What is 2+2?", "Name a prime.", "Spell cat.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    return [default_tokenizer.encode(f"{SYSTEM}\nQ: {q}\nA:") for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(prompts, hf_tiny, default_tokenizer):
    return [hf_greedy(hf_tiny, default_tokenizer, ids, MAX_TOKENS, ignore_eos=True) for ids in prompts]


@pytest.fixture(scope="module")
def batch_expected(hf_tiny, default_tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """PROMPTS' ids and transformers' continuations, once for both parametrizations of the chunking test."""
    batch = [default_tokenizer.encode(p) for p in PROMPTS]
    return batch, [hf_greedy(hf_tiny, default_tokenizer, ids, MAX_TOKENS, ignore_eos=True) for ids in batch]


def _generate(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def _engine(tiny_llama_dir, **kwargs) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, **kwargs)


def test_caching_on_and_off_give_hf_outputs(tiny_llama_dir, prompts, expected):
    cold = _engine(tiny_llama_dir, enable_prefix_caching=False)
    warm = _engine(tiny_llama_dir)
    assert [o.outputs[0].token_ids for o in _generate(cold, prompts)] == expected
    first = _generate(warm, prompts[:1])
    rest = _generate(warm, prompts)  # the shared system prompt now comes from the cache
    assert first[0].outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in rest] == expected
    assert all(o.num_cached_tokens > 0 for o in rest)
    assert cold.llm_engine.get_stats().kv_cache.prefix_cache_hits == 0


def test_second_request_computes_only_the_remainder(tiny_llama_dir, default_tokenizer):
    llm = _engine(tiny_llama_dir)
    engine = llm.llm_engine
    prefix = default_tokenizer.encode(SYSTEM)[:100]
    assert len(prefix) == 100
    scheduled: list[dict[str, int]] = []
    schedule = engine.core.scheduler.schedule

    def recording_schedule():
        output = schedule()
        scheduled.append(dict(output.num_scheduled_tokens))
        return output

    engine.core.scheduler.schedule = recording_schedule
    first = llm.generate({"prompt_token_ids": prefix + [42, 43]}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prefix + [44, 45, 46]}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96  # 6 full blocks of 16 of the 100 shared tokens
    computed = sum(step.get(second.request_id, 0) for step in scheduled)
    assert computed == (103 - 96) + (MAX_TOKENS - 1)  # the rest of the prompt, then one token per decode
    stats = engine.get_stats().kv_cache
    assert stats.prefix_cache_queries == 102 + 103 and stats.prefix_cache_hits == 96


def test_forced_hash_collisions_keep_outputs_exact(tiny_llama_dir, prompts, expected, monkeypatch):
    monkeypatch.setattr(BlockKey, "__hash__", lambda self: 7)
    llm = _engine(tiny_llama_dir)
    _generate(llm, prompts[:1])
    outputs = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.num_cached_tokens > 0 for o in outputs)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_chunked_prefill_at_32_tokens_equals_unchunked(tiny_llama_dir, enable_prefix_caching, batch_expected):
    batch, reference = batch_expected
    chunked = _engine(tiny_llama_dir, max_num_batched_tokens=32, enable_prefix_caching=enable_prefix_caching)
    whole = _engine(tiny_llama_dir, enable_chunked_prefill=False, enable_prefix_caching=enable_prefix_caching)
    assert [o.outputs[0].token_ids for o in _generate(chunked, batch)] == reference
    assert [o.outputs[0].token_ids for o in _generate(whole, batch)] == reference


def test_long_prompt_beyond_the_budget_is_accepted_with_chunking(tiny_llama_dir, default_tokenizer, hf_tiny):
    ids = default_tokenizer.encode(PROMPTS[8] * 2)[:200]
    llm = _engine(tiny_llama_dir, max_num_batched_tokens=16)
    out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_tiny, default_tokenizer, ids, MAX_TOKENS, ignore_eos=True)
