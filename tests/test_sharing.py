"""Parallel sampling and beam search on shared blocks, log-probabilities and penalties, against transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import BeamSearchParams
from tests.helpers import PROMPTS

PROMPT = PROMPTS[2]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256)


def _peak_blocks(model_dir, requests) -> tuple[int, int]:
    """Peak blocks in use and copy-on-write copies, with prefix caching off so only forks share."""
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", kv_cache_memory_bytes=16 << 20,
                                  max_model_len=256, enable_prefix_caching=False))
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.get_stats().kv_cache.num_used_blocks)
    stats = engine.get_stats().kv_cache
    assert stats.num_used_blocks == 0
    return peak, stats.num_cow_copies


# ---- parallel sampling -----------------------------------------------------------------------------


def test_n4_peak_blocks_are_what_sharing_predicts(tiny_llama_dir):
    prompt = {"prompt_token_ids": list(range(1000, 1040))}  # 40 tokens: blocks 0-1 full, block 2 half
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)
    shared_peak, copies = _peak_blocks(tiny_llama_dir, [("g", prompt, params)])
    # Each sequence ends with 59 computed tokens (4 blocks): blocks 0-1 shared by all four, block 2
    # copied on write by three of them (the fourth keeps the original), block 3 each its own.
    assert shared_peak == 2 + 4 * 2
    assert copies == 3
    single = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    independent_peak, _ = _peak_blocks(tiny_llama_dir, [(f"r{i}", prompt, single) for i in range(4)])
    assert independent_peak == 4 * 4 > shared_peak


def test_no_copy_when_the_prompt_fills_whole_blocks(tiny_llama_dir):
    prompt = {"prompt_token_ids": list(range(1000, 1032))}
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5, ignore_eos=True)
    _, copies = _peak_blocks(tiny_llama_dir, [("g", prompt, params)])
    assert copies == 0


def test_each_sample_equals_a_separate_request_with_its_seed(llm):
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    samples = [c.token_ids for c in output.outputs]
    assert len({tuple(s) for s in samples}) == 4, "the samples differ from each other"
    for i, sample in enumerate(samples):
        alone = SamplingParams(temperature=1.0, top_p=0.95, seed=11 + i, max_tokens=12, ignore_eos=True)
        assert llm.generate([PROMPT], alone, use_tqdm=False)[0].outputs[0].token_ids == sample
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == samples[0]


def test_best_of_returns_the_most_likely_samples(llm):
    three = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=8, ignore_eos=True,
                                                  logprobs=0), use_tqdm=False)[0].outputs
    best = llm.generate([PROMPT], SamplingParams(n=1, best_of=3, temperature=1.0, seed=4, max_tokens=8,
                                                 ignore_eos=True), use_tqdm=False)[0].outputs
    winner = max(three, key=lambda c: c.cumulative_logprob)
    assert len(best) == 1 and best[0].token_ids == winner.token_ids
    assert best[0].cumulative_logprob == pytest.approx(winner.cumulative_logprob, abs=1e-5)


def test_stop_string_ends_one_sample_not_its_siblings(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=16, ignore_eos=True)
    samples = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    stop = samples[0].text[3:7]
    assert stop.strip()
    stopped = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=16, ignore_eos=True,
                                                    stop=[stop]), use_tqdm=False)[0].outputs
    assert stopped[0].finish_reason == "stop" and stopped[0].text == samples[0].text[:3]
    for before, after in zip(samples[1:], stopped[1:]):
        if stop not in before.text:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"


# ---- beam search -----------------------------------------------------------------------------------


def _hf_beams(model, prompt_ids, width, max_tokens, **kwargs):
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                         do_sample=False, max_new_tokens=max_tokens, output_scores=True,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences[:, len(prompt_ids):].tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_hf_without_eos(llm, hf_tiny, default_tokenizer, width):
    prompt_ids = default_tokenizer.encode(PROMPT)
    (result,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True))
    tokens, scores = _hf_beams(hf_tiny, prompt_ids, width, 10, eos_token_id=None, pad_token_id=0)
    assert [s.tokens[len(prompt_ids):] for s in result.sequences] == tokens
    # fp32 sums of 12 log-softmaxes, each from attention rounded in another order than HF's (the native
    # kernels accumulate differently from SDPA, equally accurate against a float64 reference).
    assert [s.score for s in result.sequences] == pytest.approx(scores, abs=1e-4)
    assert result.sequences[0].text == default_tokenizer.decode(result.sequences[0].tokens, skip_special_tokens=True)
    assert llm.llm_engine.get_stats().kv_cache.num_used_blocks == 0


@pytest.fixture(scope="module")
def eos_model(tiny_llama_dir, module_tmp_path_factory, llm, default_tokenizer):
    """The tiny model with EOS set to a token its beams often produce, so hypotheses end early."""
    (result,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))
    counts: dict[int, int] = {}
    prompt_len = len(default_tokenizer.encode(PROMPT))
    for sequence in result.sequences:
        for token in sequence.tokens[prompt_len + 1:]:
            counts[token] = counts.get(token, 0) + 1
    eos = max(counts, key=counts.get)
    model_dir = module_tmp_path_factory.mktemp("eos-beams") / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256), eos


@pytest.mark.parametrize(
    "early_stopping, length_penalty, ends_by_eos",
    # A length penalty of 2 rewards long hypotheses so much that none ending in EOS survives.
    [(True, 1.0, True), (False, 1.0, True), ("never", 1.0, True), (False, 0.0, True), (False, 2.0, False)],
)
def test_beam_search_equals_hf_with_eos(eos_model, hf_tiny, default_tokenizer, early_stopping, length_penalty,
                                        ends_by_eos):
    llm, eos = eos_model
    prompt_ids = default_tokenizer.encode(PROMPT)
    params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    (result,) = llm.beam_search([PROMPT], params)
    tokens, scores = _hf_beams(hf_tiny, prompt_ids, 3, 12, eos_token_id=eos, pad_token_id=eos,
                               early_stopping=early_stopping, length_penalty=length_penalty)
    ours = [s.tokens[len(prompt_ids):] for s in result.sequences]
    assert any(s.finish_reason == "stop" for s in result.sequences) == ends_by_eos
    for mine, theirs in zip(ours, tokens):
        assert theirs[: len(mine)] == mine and set(theirs[len(mine):]) <= {eos}
    # fp32 sums of 12 log-softmaxes, each from attention rounded in another order than HF's (the native
    # kernels accumulate differently from SDPA, equally accurate against a float64 reference).
    assert [s.score for s in result.sequences] == pytest.approx(scores, abs=1e-4)


def test_beam_search_params_are_validated():
    with pytest.raises(ValueError, match="beam_width=0"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")


# ---- log-probabilities -----------------------------------------------------------------------------


def test_logprobs_equal_log_softmax_of_hf_logits(llm, hf_tiny, default_tokenizer):
    prompt_ids = default_tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    completion = output.outputs[0]
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([prompt_ids + completion.token_ids])).logits[0].float()
    reference = logits.log_softmax(dim=-1)
    for step, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt_ids) - 1 + step]
        top_values, top_ids = row.topk(5)
        assert set(position) == {token, *top_ids.tolist()}
        assert position[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert position[token].rank == 1  # greedy picks the most likely token
        for value, token_id in zip(top_values.tolist(), top_ids.tolist()):
            assert position[token_id].logprob == pytest.approx(value, abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(
        sum(reference[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(completion.token_ids)), abs=1e-3)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt_ids)
    for i, position in enumerate(output.prompt_logprobs[1:], start=1):
        token = prompt_ids[i]
        assert position[token].logprob == pytest.approx(reference[i - 1, token].item(), abs=1e-4)
        assert len(position) <= 4


# ---- penalties and constraints ---------------------------------------------------------------------


def _reference_penalized_greedy(model, prompt_ids, steps, presence, frequency, repetition):
    tokens = list(prompt_ids)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[tokens] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
        counts = torch.zeros_like(logits)
        for token in tokens[len(prompt_ids):]:
            counts[token] += 1
        logits = logits - frequency * counts - presence * (counts > 0).float()
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt_ids):]


@pytest.mark.parametrize("presence, frequency, repetition", [(1.5, 0.0, 1.0), (0.0, 1.0, 1.8), (0.5, 0.5, 1.3)])
def test_penalties_match_a_reference(llm, hf_tiny, default_tokenizer, presence, frequency, repetition):
    prompt = "the the the the the the the"
    prompt_ids = default_tokenizer.encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency, repetition_penalty=repetition)
    ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == _reference_penalized_greedy(hf_tiny, prompt_ids, 10, presence, frequency, repetition)


def test_logit_bias_allowed_tokens_and_bad_words(llm, default_tokenizer):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    favoured = default_tokenizer.encode(" banana", add_special_tokens=False)[0]
    biased = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                   logit_bias={favoured: 100}), use_tqdm=False)
    assert biased[0].outputs[0].token_ids == [favoured] * 4
    allowed = [greedy[1], greedy[2], favoured]
    constrained = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=0, max_tokens=12, ignore_eos=True,
                                                        allowed_token_ids=allowed), use_tqdm=False)
    assert set(constrained[0].outputs[0].token_ids) <= set(allowed)
    word = default_tokenizer.decode([greedy[0]]).strip()
    banned_ids = {ids[0] for ids in (default_tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word))
                  if len(ids) == 1}
    assert greedy[0] in banned_ids
    cleaned = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word]),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert not banned_ids & set(cleaned)
