"""Greedy output equals HuggingFace transformers token for token, in fp32."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from tests.helpers import PROMPTS, check_logprobs_close, hf_greedy, hf_greedy_with_top_logprobs
from tests.test_gguf_loader import assert_matches_transformers, head_dim

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def references(hf_tiny, default_tokenizer):
    prompt_ids = [default_tokenizer.encode(p) for p in PROMPTS]
    return prompt_ids, [hf_greedy(hf_tiny, default_tokenizer, ids, MAX_TOKENS, ignore_eos=True) for ids in prompt_ids]


def _check(llm: LLM, references) -> None:
    prompt_ids, expected = references
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    assert [o.prompt_token_ids for o in outputs] == prompt_ids
    for output, reference in zip(outputs, expected):
        assert output.outputs[0].token_ids == reference, output.prompt
        assert output.outputs[0].finish_reason == "length"


def test_batched_prompts_match_hf(tiny_llama_dir, references):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20)
    # The test model's head size is one the native decode kernel takes: engine tests run the users' kernel.
    assert llm.llm_engine.core.runner.native_decode is not None
    _check(llm, references)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions == 0
    assert stats.kv_cache.num_used_blocks == 0, "every block is back in the pool after the batch"


def test_preemption_keeps_outputs_exact(tiny_llama_dir, references):
    # 12 blocks of 16 tokens: less than the batch needs at once, enough for the longest request alone.
    llm = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=12, max_model_len=192)
    _check(llm, references)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_chunked_prefill_and_block_sizes_match_hf(tiny_llama_dir, references, block_size):
    # A 32-token budget splits the long prompts into chunks computed alongside other requests' decodes.
    llm = LLM(tiny_llama_dir, dtype="float32", max_num_batched_tokens=32, block_size=block_size,
              kv_cache_memory_bytes=32 << 20)
    _check(llm, references)


def test_torch_ops_path_matches_hf(tiny_llama_dir, references, monkeypatch):
    # The model without the C kernels (no compiler, or switched off): the reference path stays exact too.
    from pagellm.ops import cpu_build

    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    cpu_build.native_library.cache_clear()
    try:
        llm = LLM(tiny_llama_dir, dtype="float32", max_num_batched_tokens=32, kv_cache_memory_bytes=32 << 20)
        assert llm.llm_engine.core.runner.native_decode is None
        _check(llm, references)
    finally:
        monkeypatch.delenv("PAGELLM_NATIVE_KERNELS")
        cpu_build.native_library.cache_clear()


def test_one_at_a_time_equals_batched(tiny_llama_dir, references):
    llm = LLM(tiny_llama_dir, dtype="float32", max_num_seqs=1, kv_cache_memory_bytes=32 << 20)
    _check(llm, references)


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a list of three fruits:",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def test_default_model_matches_transformers(hf_smollm2):
    """pagellm's GGUF loader gives transformers' config and dequantized tensors for the default model. Here, beside
    the oracle runs, so that one module alone loads transformers' SmolLM2 (each xdist worker would load its own)."""
    import transformers

    from pagellm.models.gguf_loader import default_model_path, load_gguf

    model_path = default_model_path()
    config, state_dict = load_gguf(model_path)
    assert isinstance(config.to_transformers(), transformers.LlamaConfig)
    assert config.tie_word_embeddings and "lm_head.weight" not in state_dict
    assert state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (
        config.num_key_value_heads * head_dim(config),
        config.hidden_size,
    )
    assert_matches_transformers(model_path, config, state_dict, hf_smollm2)


@pytest.fixture(scope="module")
def smollm2_fp32_references(hf_smollm2, default_tokenizer) -> dict[str, tuple[list[int], list[dict]]]:
    """Per prompt, transformers' fp32 greedy continuation (32 tokens, stopping at EOS as generate does) with each
    position's top 5: the exact test compares the tokens, the kernels' test their first 24 and the top 5, so
    that the 135M-parameter oracle runs once for both."""
    return {prompt: hf_greedy_with_top_logprobs(hf_smollm2, default_tokenizer.encode(prompt), 32, 5)
            for prompt in SMOLLM2_PROMPTS}


def test_default_smollm2_matches_hf(smollm2_fp32_references, default_tokenizer, monkeypatch):
    """Without the kernels (PAGELLM_NATIVE_KERNELS=0) the GGUF's blocks are dequantized once at load and
    multiplied in float32: transformers' tokens on the same dequantized weights (the loading, the tied head and
    the graph). The kernels' own products are the next test's."""
    from pagellm.ops import cpu_build

    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    cpu_build.native_library.cache_clear()
    try:
        llm = LLM(dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=2048)
        params = SamplingParams(temperature=0, max_tokens=32)
        outputs = llm.generate(SMOLLM2_PROMPTS, params, use_tqdm=False)
    finally:
        monkeypatch.delenv("PAGELLM_NATIVE_KERNELS")
        cpu_build.native_library.cache_clear()
    for prompt, output in zip(SMOLLM2_PROMPTS, outputs):
        ids = default_tokenizer.encode(prompt)
        assert output.prompt_token_ids == ids
        expected = smollm2_fp32_references[prompt][0]
        assert output.outputs[0].token_ids == expected, prompt
        assert output.outputs[0].text == default_tokenizer.decode(expected, skip_special_tokens=True)


def test_default_smollm2_on_quantized_kernels_agrees_with_hf(smollm2_fp32_references):
    """The kernels quantize each activation row to int8 before the dot products, as llama.cpp does: close to the
    exact product, not equal. Compared as vLLM's check_logprobs_close does (exact up to the first difference,
    each side's token in the other's top 5)."""
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512)
    assert llm.llm_engine.core.runner.native_decode is not None
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    outputs = llm.generate(SMOLLM2_PROMPTS, params, use_tqdm=False)
    agreed = []
    for output in outputs:
        completion = output.outputs[0]
        ours = (completion.token_ids, [{t: lp.logprob for t, lp in p.items()} for p in completion.logprobs])
        # Greedy is causal: the first 24 of transformers' 32 tokens are its 24-token continuation.
        tokens, tops = smollm2_fp32_references[output.prompt]
        agreed.append(check_logprobs_close(ours, (tokens[:24], tops[:24])))
    assert sum(agreed) >= len(SMOLLM2_PROMPTS) * 8, agreed


def test_default_smollm2_bf16_matches_hf_bf16(hf_smollm2, default_tokenizer):
    """End to end in bfloat16 on the default model, against transformers in bfloat16 on the same weights.
    Two bf16 implementations round differently, so near-ties may flip: compared as vLLM's
    check_logprobs_close does (exact up to the first difference, each side's token in the other's top 5)."""
    import copy

    import torch

    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=64 << 20, max_model_len=512)
    assert llm.llm_engine.core.model_info.dtype == torch.bfloat16
    assert llm.llm_engine.core.runner.native_decode is not None
    hf_bf16 = copy.deepcopy(hf_smollm2).to(torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    outputs = llm.generate(SMOLLM2_PROMPTS, params, use_tqdm=False)
    agreed = []
    for prompt, output in zip(SMOLLM2_PROMPTS, outputs):
        completion = output.outputs[0]
        our_tops = [{t: lp.logprob for t, lp in position.items()} for position in completion.logprobs]
        ours = (completion.token_ids, our_tops)
        agreed.append(check_logprobs_close(ours, hf_greedy_with_top_logprobs(hf_bf16, output.prompt_token_ids, 24, 5)))
    # Most of each greedy continuation agrees exactly; a flip, if any, comes after a common start.
    assert sum(agreed) >= len(SMOLLM2_PROMPTS) * 8, agreed
