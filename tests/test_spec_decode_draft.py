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
from pagellm.spec_decode.draft_model import _Segment, _split
from pagellm.spec_decode.speculator import DRAFT_PLACEHOLDER, Speculator
from tests.conftest import _save_tiny
from tests.helpers import PROMPTS

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A shared opening of the prompts below, longer than a block: the second request of each pair hits the prefix cache.
SHARED = "Paged attention stores the KV cache in fixed-size blocks, like an operating system's pages. "
CACHED_PROMPTS = [SHARED + "First,", SHARED + "Second,", SHARED + "Third,"]
# The noisy draft's weights: the target's plus this much seeded noise (the init range is 0.3), which leaves it
# agreeing with the target on roughly one token in five.
NOISE = 0.01


def _config(draft: str, k: int = 3) -> dict:
    # disable_by_batch_size above the batch: every request speculates.
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "disable_by_batch_size": 64}


def _outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _stats(llm: LLM):
    return llm.llm_engine.core.scheduler.get_stats().spec_decoding


@pytest.fixture(scope="module")
def other_draft_dir(module_tmp_path_factory, default_tokenizer) -> str:
    """A smaller random llama with the target's tokenizer: 2 layers, other widths of MLP and KV heads."""
    return _save_tiny(module_tmp_path_factory.mktemp("tiny-draft"), default_tokenizer, num_hidden_layers=2,
                      intermediate_size=128, num_key_value_heads=4)


@pytest.fixture(scope="module")
def noisy_draft_dir(module_tmp_path_factory, tiny_llama_dir) -> str:
    """The target with seeded noise on every weight: it agrees with the target on some tokens, not all, so that
    drafts are accepted in part and the rest rolled back."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * NOISE)
    path = module_tmp_path_factory.mktemp("noisy-draft")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def plain_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", max_num_seqs=16, kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def plain_outputs(plain_llm):
    return _outputs(plain_llm, PROMPTS, GREEDY), _outputs(plain_llm, CACHED_PROMPTS, GREEDY)


# max_num_seqs: above the batch, and small, so that start-up's decode profiling is quick.
ENGINES = {
    "batched": dict(max_num_seqs=16, kv_cache_memory_bytes=32 << 20),
    "chunked": dict(max_num_seqs=16, max_num_batched_tokens=32, kv_cache_memory_bytes=32 << 20),
    "prefix-cached": dict(max_num_seqs=16, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=True),
    "preempted": dict(max_num_seqs=16, num_gpu_blocks_override=12, max_model_len=192),
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


@pytest.mark.parametrize("engine", ["batched", "preempted"])
def test_greedy_output_is_unchanged_by_a_draft_accepted_in_part(tiny_llama_dir, noisy_draft_dir, plain_outputs,
                                                                  engine):
    llm = LLM(tiny_llama_dir, dtype="float32", speculative_config=_config(noisy_draft_dir, k=4), **ENGINES[engine])
    assert _outputs(llm, PROMPTS, GREEDY) == plain_outputs[0]
    stats = _stats(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_the_drafts_cache_holds_the_targets_kv_after_rejections(tiny_llama_dir):
    """A draft equal to the target, sampled requests (their samples reject greedy drafts often): after every step,
    each position the draft counts as cached holds in the draft's pool what the target's pool holds."""
    import torch

    llm = LLM(tiny_llama_dir, dtype="float32", speculative_config=_config(tiny_llama_dir, k=4), **ENGINES["chunked"])
    engine = llm.llm_engine
    for index, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{index}", prompt, SamplingParams(temperature=1.5, seed=index, max_tokens=MAX_TOKENS,
                                                               ignore_eos=True))
    runner = engine.core.runner
    batch, drafter = runner.input_batch, runner.drafter
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request_id, row in batch.row_of.items():
            cached = min(drafter.computed.get(request_id, 0), int(batch.num_computed[row]))
            positions = torch.arange(cached)
            blocks = torch.from_numpy(batch.block_table[row])[positions // runner.block_size]
            offsets = positions % runner.block_size
            target = runner.kv_pool[:, :, blocks, :, offsets]
            draft = drafter.kv_pool[:, :, blocks, :, offsets]
            torch.testing.assert_close(draft, target, atol=1e-4, rtol=1e-4)
            checked += cached
    stats = _stats(llm)
    assert checked > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_seeded_sampling_is_the_same_with_a_draft_model(tiny_llama_dir, noisy_draft_dir, plain_llm):
    """A seeded request draws the same noise at each output index with drafts or without."""
    params = [SamplingParams(seed=index, temperature=0.7, top_p=0.9, presence_penalty=0.3, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for index in range(4)]
    expected = _outputs(plain_llm, PROMPTS[:4], params)
    llm = LLM(tiny_llama_dir, dtype="float32", speculative_config=_config(noisy_draft_dir), **ENGINES["batched"])
    assert _outputs(llm, PROMPTS[:4], params) == expected
    assert _stats(llm).num_accepted_tokens > 0


def test_the_pool_sizes_blocks_for_target_and_draft_layers(tiny_llama_dir, other_draft_dir):
    budget = 32 << 20
    llm = LLM(tiny_llama_dir, dtype="float32", max_num_seqs=16, kv_cache_memory_bytes=budget,
              speculative_config=_config(other_draft_dir))
    # A draft of other widths, random: its drafts are rejected, the output stays the target's.
    plain = LLM(tiny_llama_dir, dtype="float32", max_num_seqs=16, kv_cache_memory_bytes=budget)
    assert _outputs(llm, PROMPTS[:3], GREEDY) == _outputs(plain, PROMPTS[:3], GREEDY)
    worker = llm.llm_engine.core.executor.driver
    target, draft = worker.pool_spec.target, worker.pool_spec.draft
    assert (target.num_layers, draft.num_layers, draft.num_kv_heads) == (3, 2, 4)
    assert worker.num_blocks == budget // (target.bytes_per_block + draft.bytes_per_block)
    draft_pool = worker.runner.drafter.kv_pool
    assert tuple(draft_pool.shape) == draft.pool_shape(worker.num_blocks)
    assert f"bytes per block {target.bytes_per_block + draft.bytes_per_block:,}" in worker.pool_spec.describe()


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
    ({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 2}, ["EAGLE-3"]),
    ({"method": "eagle", "num_speculative_tokens": 2}, ["model=None", "EAGLE head's checkpoint"]),
    ({"method": "eagle", "model": "/no/such/head", "num_speculative_tokens": 2}, ["does not exist"]),
    ({"method": "mtp", "model": "/tmp", "num_speculative_tokens": 2}, ["model='/tmp'", "leave model unset"]),
    ({"method": "ngram", "model": "/tmp", "num_speculative_tokens": 2}, ["model='/tmp'", "uses no model"]),
    ({"method": "medusa", "num_speculative_tokens": 1}, ["method='medusa'"]),
])
def test_bad_draft_configs_are_refused_naming_the_field(config, words):
    with pytest.raises(ArgumentValueError) as info:
        EngineArgs(speculative_config=config)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_a_draft_model_runs_under_tensor_parallelism(tiny_llama_dir, noisy_draft_dir, plain_outputs):
    """The draft runs on rank 0 alone (draft_tensor_parallel_size=1) and hands its drafts to rank 1 before the
    verifying forward: a rank verifying other tokens than rank 0 would put other K/V in its shard of the cache and
    the output would drift from the TP=1 run's. The noisy draft has drafts rejected, so rollback crosses ranks too."""
    llm = LLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2, speculative_config=_config(noisy_draft_dir, k=4),
              **ENGINES["batched"])
    try:
        assert _outputs(llm, PROMPTS, GREEDY) == plain_outputs[0]
        stats = _stats(llm)
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    finally:
        llm.llm_engine.core.shutdown()


def test_a_draft_of_another_vocabulary_is_refused_naming_both_sizes(tiny_llama_dir, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512).save_pretrained(tmp_path)
    vocab = json.loads((tmp_path / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError) as info:
        LLM(tiny_llama_dir, dtype="float32", max_num_seqs=16, kv_cache_memory_bytes=32 << 20,
            speculative_config=_config(str(tmp_path)))
    message = str(info.value)
    assert f"vocab_size={vocab}" in message and "vocab_size=49152" in message, message


def test_a_draft_with_a_shorter_context_is_refused(tiny_llama_dir, tmp_path, default_tokenizer):
    draft = _save_tiny(tmp_path, default_tokenizer, num_hidden_layers=1, max_position_embeddings=128)
    with pytest.raises(ValueError, match="max_position_embeddings=128.*max_model_len=512"):
        LLM(tiny_llama_dir, dtype="float32", max_num_seqs=16, kv_cache_memory_bytes=32 << 20,
            speculative_config=_config(draft))


def test_catch_up_forwards_hold_at_most_the_token_budget_decodes_first():
    segments = [_Segment(0, 0, 1, True), _Segment(1, 5, 45, True), _Segment(2, 3, 4, False)]
    chunks = _split(segments, 16)
    assert [sum(s.end - s.start for s in chunk) for chunk in chunks] == [16, 16, 10]
    # Row 1's 40 tokens in order across three forwards; only its last piece proposes.
    pieces = [(s.start, s.end, s.proposes) for chunk in chunks for s in chunk if s.row == 1]
    assert pieces == [(5, 20, False), (20, 36, False), (36, 45, True)]
    for chunk in chunks:
        lengths = [s.end - s.start for s in chunk]
        assert lengths == sorted(lengths, key=lambda n: n > 1)


def test_the_scheduler_gets_placeholders_the_runner_fills():
    from pagellm.core.request import Request

    speculator = Speculator(SpeculativeConfig.from_dict(_config("/tmp", k=3)))
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10), 0, 10)
    assert speculator.drafts_for(request, budget=2, max_model_len=64) == [DRAFT_PLACEHOLDER] * 2
