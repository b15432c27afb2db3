"""Speculative decoding with a draft model (method "draft_model") on tiny random llamas (fp32): outputs equal
those without speculation whatever the draft proposes; a draft identical to the target has every draft accepted,
which holds only if the draft's paged cache follows the target's through prompts, chunks, prefix-cache hits,
rejections and preemption; refusals name the values."""

from __future__ import annotations

import json

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import ArgumentValueError, EngineArgs
from pagellm.spec_decode.config import SpeculativeConfig
from tests.conftest import _save_tiny
from tests.helpers import PROMPTS

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A shared opening of the prompts below, longer than a block: the second request of each pair hits the prefix cache.
SHARED = "Paged attention stores the KV cache in fixed-size blocks, like an operating system's pages. "
CACHED_PROMPTS = [SHARED + "First,", SHARED + "Second,", SHARED + "Third,"]


def _config(draft: str, k: int = 3) -> dict:
    # disable_by_batch_size above the batch: every request speculates.
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "disable_by_batch_size": 64}


def _outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _stats(llm: LLM):
    return llm.llm_engine.core.scheduler.get_stats().spec_decoding


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory, default_tokenizer) -> str:
    """A smaller random llama with the target's tokenizer: 2 layers, other widths of MLP and KV heads."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-draft"), default_tokenizer, num_hidden_layers=2,
                      intermediate_size=128, num_key_value_heads=4)


@pytest.fixture(scope="module")
def plain_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def plain_outputs(plain_llm):
    return _outputs(plain_llm, PROMPTS, GREEDY), _outputs(plain_llm, CACHED_PROMPTS, GREEDY)


ENGINES = {
    "batched": dict(kv_cache_memory_bytes=32 << 20),
    "chunked": dict(max_num_batched_tokens=32, kv_cache_memory_bytes=32 << 20),
    "prefix-cached": dict(kv_cache_memory_bytes=32 << 20, enable_prefix_caching=True),
    "preempted": dict(num_gpu_blocks_override=12, max_model_len=192),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_draft_equal_to_the_target_has_every_draft_accepted(tiny_llama_dir, plain_outputs, engine):
    """The draft proposes the target's own greedy tokens only where its cache holds the right K/V at every
    position: a draft token read from a stale or missing slot would be rejected sooner or later."""
    llm = LLM(tiny_llama_dir, dtype="float32", speculative_config=_config(tiny_llama_dir), **ENGINES[engine])
    expected, expected_cached = plain_outputs
    if engine == "prefix-cached":
        # One request first: the others reuse its blocks, the draft's K/V in them included.
        assert _outputs(llm, CACHED_PROMPTS[:1], GREEDY) == expected_cached[:1]
        assert _outputs(llm, CACHED_PROMPTS, GREEDY) == expected_cached
        assert llm.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0
    else:
        assert _outputs(llm, PROMPTS, GREEDY) == expected
    stats = _stats(llm)
    assert stats.num_draft_tokens > MAX_TOKENS
    assert stats.num_accepted_tokens == stats.num_draft_tokens, stats
    if engine == "preempted":
        assert llm.llm_engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("engine", ["batched", "chunked", "preempted"])
def test_greedy_output_is_unchanged_by_a_different_draft(tiny_llama_dir, other_draft_dir, plain_outputs, engine):
    llm = LLM(tiny_llama_dir, dtype="float32", speculative_config=_config(other_draft_dir, k=4), **ENGINES[engine])
    assert _outputs(llm, PROMPTS, GREEDY) == plain_outputs[0]
    assert _stats(llm).num_drafts > 0


def test_seeded_sampling_is_the_same_with_a_draft_model(tiny_llama_dir, other_draft_dir, plain_llm):
    """A seeded request draws the same noise at each output index with drafts or without."""
    sampled = dict(temperature=0.9, top_p=0.9, top_k=50, presence_penalty=0.3, max_tokens=MAX_TOKENS,
                   ignore_eos=True)
    params = [SamplingParams(seed=index, **sampled) for index in range(len(PROMPTS))]
    expected = _outputs(plain_llm, PROMPTS, params)
    for draft in (tiny_llama_dir, other_draft_dir):
        llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20,
                  speculative_config=_config(draft))
        assert _outputs(llm, PROMPTS, params) == expected
        assert _outputs(llm, PROMPTS, params) == expected
        if draft == tiny_llama_dir:
            assert _stats(llm).num_accepted_tokens > 0


def test_the_pool_sizes_blocks_for_target_and_draft_layers(tiny_llama_dir, other_draft_dir):
    budget = 32 << 20
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=budget,
              speculative_config=_config(other_draft_dir))
    worker = llm.llm_engine.core.executor.driver
    target, draft = worker.pool_spec.target, worker.pool_spec.draft
    assert (target.num_layers, draft.num_layers, draft.num_kv_heads) == (3, 2, 4)
    assert worker.num_blocks == budget // (target.bytes_per_block + draft.bytes_per_block)
    draft_pool = worker.runner.drafter.kv_pool
    assert tuple(draft_pool.shape) == draft.pool_shape(worker.num_blocks)
    assert "with the draft model's layers" in worker.pool_spec.describe()


def test_only_a_model_means_a_draft_model_as_in_vllm(tiny_llama_dir):
    assert SpeculativeConfig.from_dict({"model": tiny_llama_dir, "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"


@pytest.mark.parametrize("config, words", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, ["model=None", "draft's checkpoint"]),
    ({"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 2},
     ["model='/no/such/draft'", "does not exist"]),
    ({"model": "./missing-draft.gguf", "num_speculative_tokens": 2}, ["model='./missing-draft.gguf'"]),
    ({"method": "draft_model", "model": "/tmp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     ["draft_tensor_parallel_size=2"]),
    ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 2}, ["EAGLE"]),
    ({"method": "ngram", "model": "/tmp", "num_speculative_tokens": 2}, ["model='/tmp'", "uses no model"]),
    ({"method": "mtp", "num_speculative_tokens": 1}, ["method='mtp'"]),
])
def test_bad_draft_configs_are_refused_naming_the_field(config, words):
    with pytest.raises(ArgumentValueError) as info:
        EngineArgs(speculative_config=config)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_a_draft_of_another_vocabulary_is_refused_naming_both_sizes(tiny_llama_dir, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512).save_pretrained(tmp_path)
    vocab = json.loads((tmp_path / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError) as info:
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20,
            speculative_config=_config(str(tmp_path)))
    message = str(info.value)
    assert f"vocab_size={vocab}" in message and "vocab_size=49152" in message, message


def test_a_draft_with_a_shorter_context_is_refused(tiny_llama_dir, tmp_path, default_tokenizer):
    draft = _save_tiny(tmp_path, default_tokenizer, num_hidden_layers=1, max_position_embeddings=128)
    with pytest.raises(ValueError, match="max_position_embeddings=128.*max_model_len=512"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, speculative_config=_config(draft))
