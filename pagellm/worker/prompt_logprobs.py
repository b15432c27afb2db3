"""Log-probabilities of prompt tokens (prompt_logprobs), and the per-token record both they and samples report."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.core.scheduler import ModelRunnerOutput, TokenLogprobs
from pagellm.ops.largest import largest_per_row
from pagellm.sample.sampler import SamplerOutput, ranks_of
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.step_inputs import StepInputs


@dataclass(frozen=True)
class _ScoredSpan:
    """One request's prompt positions scored this step: logits rows [first, first + len(absolute))."""

    first: int
    request_id: str
    table_row: int
    absolute: np.ndarray  # the positions; each is scored on the prompt token after it
    num_logprobs: int


class PromptScorer:
    """Scores prompt positions (prompt_logprobs) from their logits, given a chunk of rows at a time in order;
    each request's records are appended to `output.prompt_logprobs` as its rows arrive."""

    def __init__(self, batch: InputBatch, rows: np.ndarray, inputs: StepInputs, output: ModelRunnerOutput) -> None:
        self.batch = batch
        self.output = output
        self.spans: list[_ScoredSpan] = []
        first = 0
        for position, _, absolute in inputs.prompt_logprob_positions:
            state = batch.rows[int(rows[position])]
            self.spans.append(_ScoredSpan(first, state.request_id, int(rows[position]), absolute,
                                          state.params.prompt_logprobs))
            output.prompt_logprobs[state.request_id] = []
            first += len(absolute)

    def add(self, first_row: int, logits: torch.Tensor) -> None:
        """logits: rows [first_row, first_row + len(logits)) of the scored positions, in the order of
        inputs.prompt_logprob_positions."""
        logprobs = logits.log_softmax(dim=-1)
        end_row = first_row + logits.shape[0]
        for span in self.spans:
            start, end = max(first_row, span.first), min(end_row, span.first + len(span.absolute))
            if start < end:
                self._score(span, span.absolute[start - span.first : end - span.first],
                            logprobs[start - first_row : end - first_row])

    def _score(self, span: _ScoredSpan, absolute: np.ndarray, logprobs: torch.Tensor) -> None:
        next_tokens = torch.from_numpy(self.batch.token_ids[span.table_row, absolute + 1]).to(logprobs.device)
        chosen = logprobs.gather(1, next_tokens.unsqueeze(1)).squeeze(1)
        ranks = ranks_of(logprobs, chosen.unsqueeze(1), torch.empty(logprobs.shape, device=logprobs.device))
        k = span.num_logprobs
        top_lp, top_ids = largest_per_row(logprobs, k) if k else (logprobs[:, :0], next_tokens[:, None][:, :0])
        scored = SamplerOutput(next_tokens, chosen, ranks, top_ids, top_lp)
        self.output.prompt_logprobs[span.request_id].extend(token_logprobs(scored, i, k) for i in range(len(absolute)))


def token_logprobs(result: SamplerOutput, i: int, k: int) -> TokenLogprobs:
    return TokenLogprobs(
        int(result.token_ids[i]),
        float(result.logprobs[i]),
        int(result.ranks[i]),
        result.top_token_ids[i, :k].tolist(),
        result.top_logprobs[i, :k].tolist(),
    )
