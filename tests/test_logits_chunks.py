"""The LM head and the sampler run over a step's logits rows a chunk at a time (pagellm/worker/logits.py): any
chunking gives the tokens, log-probabilities and prompt scores of one whole-batch pass."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.worker.logits import logits_in_chunks, logits_rows_per_chunk

PROMPTS = [
    {"prompt_token_ids": list(range(300, 340))},
    {"prompt_token_ids": list(range(700, 709))},
    {"prompt_token_ids": list(range(1000, 1025))},
]
PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, logprobs=3, prompt_logprobs=2, n=3),
    SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=4, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=12, logprobs=2, presence_penalty=0.5, n=2),
]


def _summary(outputs) -> list:
    def logprobs(entries):
        return None if entries is None else [
            None if entry is None else sorted((token, round(lp.logprob, 4), lp.rank) for token, lp in entry.items())
            for entry in entries]

    return [(logprobs(out.prompt_logprobs),
             [(c.token_ids, logprobs(c.logprobs)) for c in out.outputs]) for out in outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # A small pool: the CPU default (4 GiB, faulted in for a second at start) takes seconds and tests nothing here.
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=128, seed=0, kv_cache_memory_bytes=16 << 20)


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 7])
def test_any_chunking_of_the_logits_rows_gives_the_whole_batch_results(llm, rows_per_chunk):
    runner = llm.llm_engine.core.executor.driver.runner
    whole = runner.logits_rows_per_chunk
    assert whole >= 64  # the tiny model's vocabulary: one chunk holds these steps' rows
    expected = _summary(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    runner.logits_rows_per_chunk = rows_per_chunk
    try:
        chunked = _summary(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    finally:
        runner.logits_rows_per_chunk = whole
    assert chunked == expected


def test_chunks_cover_every_row_in_order_and_bound_the_logits():
    hidden = torch.arange(10.0).unsqueeze(1)
    seen = [(first, logits.squeeze(1).tolist()) for first, logits in logits_in_chunks(lambda h: h * 2, hidden, 4)]
    # 10 rows by at most 4: three chunks of ceil(10 / 3) rows.
    assert seen == [(0, [0.0, 2.0, 4.0, 6.0]), (4, [8.0, 10.0, 12.0, 14.0]), (8, [16.0, 18.0])]
    seen = [(first, len(logits)) for first, logits in logits_in_chunks(lambda h: h, torch.zeros(558, 1), 170)]
    assert seen == [(0, 140), (140, 140), (280, 140), (420, 138)]
    assert logits_rows_per_chunk(262_144, torch.device("cpu")) * 262_144 * 4 <= 32 << 20
    assert logits_rows_per_chunk(10**9, torch.device("cpu")) == 1
