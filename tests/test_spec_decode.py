"""Speculative decoding end to end on a tiny random model (fp32): outputs equal those without speculation, sampled
tokens follow the target distribution."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.spec_decode.speculator import Speculator
from tests.helpers import PROMPTS

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# disable_by_batch_size above the batch: every request speculates.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": 64}


def _outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def plain_runs(plain_llm):
    """Outputs without speculation: of PROMPTS, and of prompts that repeat themselves (prompt, its output, the
    prompt again), where even a random model's context has n-grams to look up."""
    llm = plain_llm
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    repeating = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids + o.prompt_token_ids}
                 for o in outputs]
    return [o.outputs[0].token_ids for o in outputs], repeating, _outputs(llm, repeating, GREEDY)


@pytest.fixture(scope="module")
def plain_outputs(plain_runs):
    return plain_runs[0]


def _oracle(monkeypatch, references: dict[tuple[int, ...], list[int]], error: float, seed: int = 0,
            vocab_size: int = 1000) -> None:
    """Speculators draft the known continuation, each draft token replaced by a wrong one (below `vocab_size`)
    with probability `error`: exercises acceptance of every length and the rollback of rejected tokens."""
    rng = random.Random(seed)

    def drafts_for(self, request, budget, max_model_len, num_rows=1):
        limit = min(self.config.num_speculative_tokens, budget, max_model_len - request.num_tokens,
                    request.max_output_tokens - request.num_output_tokens - 1)
        done = request.num_output_tokens
        drafts = list(references[tuple(request.prompt_token_ids)][done : done + max(0, limit)])
        return [rng.randrange(vocab_size) if rng.random() < error else token for token in drafts]

    monkeypatch.setattr(Speculator, "drafts_for", drafts_for)


@pytest.mark.parametrize("engine_kwargs", [
    dict(kv_cache_memory_bytes=32 << 20),
    dict(max_num_batched_tokens=32, kv_cache_memory_bytes=32 << 20),  # chunked prefill beside verification
    dict(num_gpu_blocks_override=12, max_model_len=192),  # preempted and recomputed
], ids=["batched", "chunked", "preempted"])
def test_greedy_output_is_unchanged_by_accepted_and_rejected_drafts(tiny_llama_dir, plain_outputs, monkeypatch,
                                                                    engine_kwargs):
    llm = LLM(tiny_llama_dir, dtype="float32", speculative_config=NGRAM, **engine_kwargs)
    prompt_ids = [o.prompt_token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)]
    _oracle(monkeypatch, {tuple(p): out for p, out in zip(prompt_ids, plain_outputs)}, error=0.15)
    assert _outputs(llm, PROMPTS, GREEDY) == plain_outputs
    stats = llm.llm_engine.core.scheduler.get_stats().spec_decoding
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if "num_gpu_blocks_override" in engine_kwargs:
        assert llm.llm_engine.core.scheduler.num_preemptions > 0


def test_greedy_output_is_unchanged_under_tensor_parallelism(tiny_llama_dir, plain_outputs, monkeypatch):
    """Rank 0 verifies; the other rank learns from its next broadcast which drafts each row kept, and its copy of
    the rows (tokens, computed positions, block table) must follow, or its attention reads other positions."""
    llm = LLM(tiny_llama_dir, dtype="float32", speculative_config=NGRAM, tensor_parallel_size=2,
              kv_cache_memory_bytes=32 << 20)
    try:
        prompt_ids = [o.prompt_token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)]
        _oracle(monkeypatch, {tuple(p): out for p, out in zip(prompt_ids, plain_outputs)}, error=0.3)
        assert _outputs(llm, PROMPTS, GREEDY) == plain_outputs
        stats = llm.llm_engine.core.scheduler.get_stats().spec_decoding
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_output_is_unchanged_by_each_method(tiny_llama_dir, plain_runs, config):
    plain_outputs, repeating, plain_repeating = plain_runs
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, speculative_config=config)
    assert _outputs(llm, PROMPTS, GREEDY) == plain_outputs
    # Suffix decoding's global trie now holds those outputs: asked again, it drafts them.
    assert _outputs(llm, PROMPTS[:3], GREEDY) == plain_outputs[:3]
    assert _outputs(llm, repeating, GREEDY) == plain_repeating
    stats = llm.llm_engine.core.scheduler.get_stats().spec_decoding
    assert stats.num_drafts > 0
    if config["method"] == "suffix":
        assert stats.num_accepted_tokens > MAX_TOKENS


SAMPLED = dict(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, presence_penalty=0.3, frequency_penalty=0.2,
               repetition_penalty=1.1, logit_bias={100: 2.0}, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def test_seeded_sampling_and_logprobs_are_the_same_with_speculation(tiny_llama_dir, plain_llm, monkeypatch):
    """A seeded request draws the same noise at each output index with drafts or without, so its tokens (and their
    log-probabilities) do not change; rejected drafts are resampled from the target's distribution."""
    params = [SamplingParams(seed=index, **SAMPLED) for index in range(len(PROMPTS))]
    expected = plain_llm.generate(PROMPTS, params, use_tqdm=False)
    references = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in expected}
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, speculative_config=NGRAM)
    _oracle(monkeypatch, references, error=0.3, seed=1)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    for ours, theirs in zip(got, expected):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for mine, ref in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert mine.keys() == ref.keys()
            assert all(math.isclose(mine[t].logprob, ref[t].logprob, abs_tol=1e-4) for t in mine)
        assert math.isclose(ours.outputs[0].cumulative_logprob, theirs.outputs[0].cumulative_logprob, abs_tol=1e-3)
    assert llm.llm_engine.core.scheduler.get_stats().spec_decoding.num_accepted_tokens > 0


# Above the 20 top log-probabilities that start-up profiles the sampler with.
VOCAB = 32


@pytest.fixture(scope="module")
def small_vocab_dir(module_tmp_path_factory, default_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY_CONFIG

    torch.manual_seed(0)
    # A narrow init keeps the tokens' probabilities spread: drafts are accepted and rejected alike.
    config = LlamaConfig(**{**TINY_CONFIG, "initializer_range": 0.05}, vocab_size=VOCAB, bos_token_id=0, eos_token_id=VOCAB - 1)
    path = module_tmp_path_factory.mktemp("tiny-vocab32")
    LlamaForCausalLM(config).save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return str(path)


def test_sampled_tokens_follow_the_target_distribution(small_vocab_dir, monkeypatch):
    """Chi-square: the second token of unseeded samples, verified against a fixed (often wrong) draft, has the
    model's marginal distribution sum_t0 p(t0) p(t1 | t0)."""
    from transformers import AutoModelForCausalLM

    prompt = [3, 7, 1]
    draft = 5
    model = AutoModelForCausalLM.from_pretrained(small_vocab_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        contexts = torch.tensor([prompt + [t] for t in range(VOCAB)])
        second = model(contexts).logits[:, -1].softmax(-1)
    expected = (first[:, None] * second).sum(0)

    def drafts_for(self, request, budget, max_model_len, num_rows=1):
        return [draft] if request.num_output_tokens == 1 else []

    monkeypatch.setattr(Speculator, "drafts_for", drafts_for)
    llm = LLM(small_vocab_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, seed=1234, enable_prefix_caching=False,
              speculative_config={**NGRAM, "disable_by_batch_size": 4096})
    num = 3000
    outputs = llm.generate([{"prompt_token_ids": prompt}] * num,
                           SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.core.scheduler.get_stats().spec_decoding
    assert stats.num_drafts == num and 0 < stats.num_accepted_tokens < num
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outputs]), minlength=VOCAB).double()
    cells = expected * num
    chi2 = float(((counts - cells) ** 2 / cells).sum())
    # 31 degrees of freedom: exceeded with probability 0.001 when the distributions agree.
    assert chi2 < 61.10, (chi2, counts.tolist(), cells.tolist())
