"""The model runner's side of speculative decoding: a request with k drafts computes 1 + k query tokens (its
last token, then the drafts) like a chunk of prefill over the paged cache, and gets logits at all 1 + k positions.

Acceptance. Position j is sampled as a step without speculation would sample it (the request's temperature,
top-k/top-p/min-p, penalties, bad words, logit bias, min_tokens, and a seeded request's noise for its output
index), with the history up to the draft before it; the request takes the samples up to and including the first
that differs from its draft (or all 1 + k). With the draft a point mass q = delta(d), as n-gram and suffix drafts
are, this is the rejection sampling of Leviathan et al. / Chen et al.: the draft is accepted with probability
min(1, p(d) / q(d)) = p(d), and a rejection samples from norm(max(0, p - q)), which is p without d. Greedy
requests take the longest prefix where argmax == draft, plus the target's next token. A seeded request draws the
same noise at each output index as without speculation, so its tokens are the same with speculation or without.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.paged import to_device
from pagellm.core.scheduler import ModelRunnerOutput
from pagellm.sample.sampler import Sampler
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.prompt_logprobs import token_logprobs
from pagellm.worker.sampling_metadata import SamplingBatchBuilder


@dataclass
class SpecStep:
    """The rows of one step that verify drafts."""

    rows: np.ndarray  # input-batch rows
    num_drafts: np.ndarray  # k per row
    # Flat token indices (into the step's hidden states) of the 1 + k positions of each row, row after row.
    logits_index: np.ndarray

    @property
    def num_logits(self) -> int:
        return len(self.logits_index)


def prepare_spec_step(batch: InputBatch, rows: np.ndarray, num_scheduled: np.ndarray,
                      spec_token_ids: dict[str, list[int]]) -> SpecStep:
    """rows / num_scheduled: the step's rows in the order their tokens are laid out. Writes each row's drafts
    into its token table after its tokens (not counted in num_tokens), where the step's inputs read them."""
    ends = np.cumsum(num_scheduled)
    positions, spec_rows, counts = [], [], []
    row_position = {int(row): i for i, row in enumerate(rows)}
    for request_id, drafts in spec_token_ids.items():
        row = batch.row_of[request_id]
        start = batch.num_tokens[row]
        batch.token_ids[row, start : start + len(drafts)] = drafts
        positions.append(row_position[row])
        spec_rows.append(row)
        counts.append(len(drafts))
    num_drafts = np.array(counts, dtype=np.int64)
    index = [np.arange(ends[p] - k - 1, ends[p]) for p, k in zip(positions, counts)]
    return SpecStep(np.array(spec_rows, dtype=np.int64), num_drafts, np.concatenate(index))


def extend_logits_index(logits_index: torch.Tensor, spec: SpecStep) -> torch.Tensor:
    return torch.cat([logits_index, to_device(spec.logits_index, logits_index.device)])


def verify(logits_chunks: Iterable[tuple[int, torch.Tensor | None]], spec: SpecStep, batch: InputBatch,
           builder: SamplingBatchBuilder, sampler: Sampler, output: ModelRunnerOutput, block_size: int) -> None:
    """logits_chunks: (first row, logits) of the spec rows' sum(1 + k) positions in order, as
    worker/logits.py's logits_in_chunks yields them (None on a rank that does not sample). Fills the output with
    each row's taken tokens and updates the runner's copy: tokens appended, the rejected drafts' positions no
    longer computed."""
    per_row = spec.num_drafts + 1
    sampling_rows = np.repeat(spec.rows, per_row)
    # Position j of a row samples as its (output index + j)-th token, with the drafts before it in its history.
    offsets = np.arange(len(sampling_rows)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    sampling = builder.build(sampling_rows, np.zeros(len(sampling_rows), dtype=np.int64), offsets)
    result = None
    for first, logits in logits_chunks:
        if logits is None:
            return
        if result is None:
            result = sampler.new_output(sampling, logits.device)
        sampler.sample_into(logits, sampling, first, result)
    tokens = result.token_ids.tolist()
    start = 0
    taken_of_row = {}
    for row, k in zip(spec.rows.tolist(), spec.num_drafts.tolist()):
        state = batch.rows[row]
        first = int(batch.num_tokens[row])
        drafts = batch.token_ids[row, first : first + k].tolist()
        samples = tokens[start : start + k + 1]
        accepted = 0
        while accepted < k and samples[accepted] == drafts[accepted]:
            accepted += 1
        taken = samples[: accepted + 1]
        taken_of_row[row] = taken
        output.sampled_token_ids[state.request_id] = taken[0]
        if accepted:
            output.spec_token_ids[state.request_id] = taken[1:]
        if state.wants_logprobs and result.logprobs is not None:
            output.logprobs[state.request_id] = [token_logprobs(result, i, state.num_logprobs)
                                                 for i in range(start, start + accepted + 1)]
        start += k + 1
    keep_taken(batch, spec, taken_of_row, block_size)


def keep_taken(batch: InputBatch, spec: SpecStep, taken_of_row: dict[int, list[int]], block_size: int) -> None:
    """Each verified row keeps its taken tokens (the accepted drafts, then the target's own next token): rank 0
    right after sampling them, the other tensor-parallel ranks when rank 0's next broadcast tells them."""
    for row, k in zip(spec.rows.tolist(), spec.num_drafts.tolist()):
        taken = taken_of_row.get(row)
        if taken is None:
            continue  # no longer in the batch on this rank (finished or aborted meanwhile)
        accepted = len(taken) - 1
        first = int(batch.num_tokens[row])
        batch.token_ids[row, first + accepted] = taken[-1]
        batch.num_tokens[row] = first + accepted + 1
        # The runner counted all 1 + k positions as computed; the rejected drafts' K/V is stale.
        batch.num_computed[row] -= k - accepted
        # The scheduler gives back the blocks past the kept tokens (KVCacheManager.truncate); so does the table.
        batch.num_blocks[row] = min(batch.num_blocks[row], -(-int(batch.num_computed[row]) // block_size))
