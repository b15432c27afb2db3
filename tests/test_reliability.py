"""Issue 13 on the engine side: every step makes progress, prompt scores survive preemption, and one
request's failure inside a step is that request's alone."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from tests.helpers import PROMPTS


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _assert_pool_empty(llm: LLM) -> None:
    stats = llm.llm_engine.get_stats()
    assert (stats.kv_cache.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)


# ---- item 3: no step schedules nothing -------------------------------------------------------------


def test_whole_budget_prompt_beside_two_decodes_at_max_num_seqs(tiny_llama_dir):
    # The repro: two 5-token prompts decoding at max_num_seqs=2, then a 63-token prompt that fits
    # only a whole step's budget. The step used to schedule nothing and fail every request.
    llm = LLM(tiny_llama_dir, dtype="float32", enable_chunked_prefill=False, max_num_seqs=2,
              max_num_batched_tokens=64, max_model_len=64, kv_cache_memory_bytes=8 << 20)
    engine = llm.llm_engine
    short = [{"prompt_token_ids": list(range(100 + 10 * i, 105 + 10 * i))} for i in range(2)]
    long = {"prompt_token_ids": list(range(300, 363))}
    engine.add_request("a", short[0], _greedy(8))
    engine.add_request("b", short[1], _greedy(12))
    finished = {}
    for _ in range(2):
        engine.step()
    engine.add_request("long", long, _greedy(1))
    for _ in range(40):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert sorted(finished) == ["a", "b", "long"]
    alone = [llm.generate([p], _greedy(n), use_tqdm=False)[0].outputs[0].token_ids
             for p, n in ((short[0], 8), (short[1], 12), (long, 1))]
    assert [finished["a"], finished["b"], finished["long"]] == alone
    _assert_pool_empty(llm)


# ---- item 4: prompt logprobs after preemption --------------------------------------------------------


def test_prompt_logprobs_are_reported_once_after_preemption(tiny_llama_dir):
    # 12 blocks of 16 tokens: the batch does not fit, and the newest request (the one scoring its prompt)
    # is preempted and recomputed; its prompt scores are reported once, with the first computation's values.
    llm = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=12, max_model_len=192)
    scored_prompt = {"prompt_token_ids": list(range(500, 520))}
    scoring = _greedy(24, prompt_logprobs=3, logprobs=1)
    prompts = [*PROMPTS, scored_prompt]
    params = [_greedy(24)] * len(PROMPTS) + [scoring]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    preempted = outputs[-1]
    alone = llm.generate([scored_prompt], scoring, use_tqdm=False)[0]
    assert len(preempted.prompt_logprobs) == len(alone.prompt_logprobs) == 20
    assert preempted.prompt_logprobs[0] is None
    for got, want in zip(preempted.prompt_logprobs[1:], alone.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        for token_id, logprob in got.items():
            assert logprob.logprob == pytest.approx(want[token_id].logprob, abs=1e-5)
            assert logprob.rank == want[token_id].rank
    assert preempted.outputs[0].token_ids == alone.outputs[0].token_ids
    _assert_pool_empty(llm)
