"""Log-probabilities of prompt tokens (prompt_logprobs), and the per-token record both they and samples report."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.core.scheduler import ModelRunnerOutput, TokenLogprobs
from pagellm.sample.sampler import SamplerOutput
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.step_inputs import StepInputs


def score_prompt(logits: torch.Tensor, batch: InputBatch, rows: np.ndarray, inputs: StepInputs,
                 output: ModelRunnerOutput) -> None:
    """logits: one row per scored prompt position, in the order of inputs.prompt_logprob_positions."""
    logprobs = logits.log_softmax(dim=-1)
    offset = 0
    for position, _, absolute in inputs.prompt_logprob_positions:
        row = int(rows[position])
        state = batch.rows[row]
        count = len(absolute)
        next_tokens = torch.from_numpy(batch.token_ids[row, absolute + 1]).to(logits.device)
        part = logprobs[offset : offset + count]
        chosen = part.gather(1, next_tokens.unsqueeze(1)).squeeze(1)
        ranks = (part > chosen.unsqueeze(1)).sum(dim=-1) + 1
        k = state.params.prompt_logprobs
        top_lp, top_ids = part.topk(k, dim=-1) if k else (part[:, :0], next_tokens[:, None][:, :0])
        scored = SamplerOutput(next_tokens, chosen, ranks, top_ids, top_lp)
        output.prompt_logprobs[state.request_id] = [token_logprobs(scored, i, k) for i in range(count)]
        offset += count


def token_logprobs(result: SamplerOutput, i: int, k: int) -> TokenLogprobs:
    return TokenLogprobs(
        int(result.token_ids[i]),
        float(result.logprobs[i]),
        int(result.ranks[i]),
        result.top_token_ids[i, :k].tolist(),
        result.top_logprobs[i, :k].tolist(),
    )
