"""The LM head and the sampler run over a step's logits rows a chunk at a time (pagellm/worker/logits.py): any
chunking gives the tokens, log-probabilities and prompt scores of one whole-batch pass."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.worker.logits import logits_in_chunks, logits_rows_per_chunk, model_logits_in_chunks

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


class _TwoStepModel:
    """compute_logits in two steps, as LlamaForCausalLM splits it; records the rows of each head call."""

    def __init__(self, ranked_first: bool = True) -> None:
        self.head_rows: list[int] = []
        self.ranked_first = ranked_first

    def compute_head(self, hidden: torch.Tensor) -> torch.Tensor | None:
        self.head_rows.append(hidden.shape[0])
        return hidden * 2 if self.ranked_first else None

    def finish_logits(self, output: torch.Tensor) -> torch.Tensor:
        return output.float() + 1

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        output = self.compute_head(hidden)
        return None if output is None else self.finish_logits(output)


def test_a_narrow_head_runs_over_twice_the_rows_and_hands_out_half_chunks():
    model = _TwoStepModel()
    hidden = torch.arange(10.0).unsqueeze(1).to(torch.bfloat16)
    seen = [(first, logits.dtype, logits.squeeze(1).tolist())
            for first, logits in model_logits_in_chunks(model, hidden, 4)]
    # Head calls over equal groups of at most 8 rows (two of 5); float32 chunks of at most 2 rows from each.
    assert model.head_rows == [5, 5]
    assert [(first, values) for first, _, values in seen] == [
        (0, [1.0, 3.0]), (2, [5.0, 7.0]), (4, [9.0]), (5, [11.0, 13.0]), (7, [15.0, 17.0]), (9, [19.0])]
    assert {dtype for _, dtype, _ in seen} == {torch.float32}
    # float32 activations: the logits chunks as before, one head call each
    model = _TwoStepModel()
    seen = [(first, len(logits)) for first, logits in model_logits_in_chunks(model, hidden.float(), 4)]
    assert seen == [(0, 4), (4, 4), (8, 2)] and model.head_rows == [4, 4, 2]
    # a tensor-parallel rank that does not sample: one None per head call
    model = _TwoStepModel(ranked_first=False)
    assert list(model_logits_in_chunks(model, hidden, 4)) == [(0, None), (5, None)]
    # a model without the two steps keeps compute_logits
    plain = type("Plain", (), {"compute_logits": staticmethod(lambda h: h.float() * 3)})()
    assert [len(logits) for _, logits in model_logits_in_chunks(plain, hidden, 4)] == [4, 4, 2]
