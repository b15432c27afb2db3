"""One step's model inputs, built from the rows of the input batch by bulk indexing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import StepAttentionInputs
from pagellm.attention.paged import to_device
from pagellm.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    # Host arrays: the eager path moves them to the device, a CUDA-graph replay copies them into its buffers.
    input_ids: np.ndarray
    positions: np.ndarray
    attention: StepAttentionInputs
    # Batch positions of the requests that sample, and how many samples each draws at once.
    sample_positions: np.ndarray
    fanout: np.ndarray
    # Flat token index of every logits row to compute: samples (repeated by fanout), then prompt positions.
    logits_index: torch.Tensor
    # (batch position, flat token index, absolute position) of prompt positions scored for prompt_logprobs.
    prompt_logprob_positions: list[tuple[int, np.ndarray, np.ndarray]]


def prepare_inputs(batch: InputBatch, rows: np.ndarray, num_scheduled: np.ndarray, block_size: int,
                   device: torch.device, num_verifying: int = 0) -> StepInputs:
    """rows: the step's rows, decodes (one query token) first, then `num_verifying` rows that verify drafts, then
    the rest; num_scheduled: the tokens each computes."""
    computed = batch.num_computed[rows]
    ends = np.cumsum(num_scheduled)
    starts = ends - num_scheduled
    total = int(ends[-1])
    seq_of_token = np.repeat(np.arange(len(rows)), num_scheduled)
    offset = np.arange(total) - starts[seq_of_token]
    positions = computed[seq_of_token] + offset
    token_rows = rows[seq_of_token]
    input_ids = batch.token_ids[token_rows, positions]
    block_ids = batch.block_table[token_rows, positions // block_size]
    slot_mapping = block_ids * block_size + positions % block_size
    context_lens = computed + num_scheduled

    sample_positions = np.nonzero(context_lens == batch.num_tokens[rows])[0]
    # A request samples all its n sequences at its first sample (n > 1 / best_of), one afterwards.
    sample_rows = rows[sample_positions]
    first_sample = batch.num_tokens[sample_rows] == batch.num_prompt_tokens[sample_rows]
    fanout = np.where(first_sample, batch.num_samples_at_first[sample_rows], 1)
    logits_index = [np.repeat(ends[sample_positions] - 1, fanout)]
    prompt_positions = []
    scoring = np.nonzero(np.isin(rows, list(batch.prompt_scoring_rows)))[0] if batch.prompt_scoring_rows else ()
    for position in scoring:
        state = batch.rows[int(rows[position])]
        absolute = np.arange(computed[position], context_lens[position])
        keep = absolute + 1 < state.num_prompt_tokens
        if keep.any():
            flat = starts[position] + np.nonzero(keep)[0]
            prompt_positions.append((position, flat, absolute[keep]))
            logits_index.append(flat)

    max_blocks = -(-int(context_lens.max()) // block_size)
    attention = _attention_inputs(batch, rows, num_scheduled, num_verifying, positions, token_rows, context_lens,
                                  slot_mapping, max_blocks)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        attention=attention,
        sample_positions=sample_positions,
        fanout=fanout,
        logits_index=to_device(np.concatenate(logits_index), device),
        prompt_logprob_positions=prompt_positions,
    )


def _attention_inputs(batch: InputBatch, rows: np.ndarray, num_scheduled: np.ndarray, num_verifying: int,
                      positions: np.ndarray, token_rows: np.ndarray, context_lens: np.ndarray,
                      slot_mapping: np.ndarray, max_blocks: int) -> StepAttentionInputs:
    """The step as the attention backends take it. Each token of a row that verifies drafts attends as a decode
    of its own (its sequence's block table, the keys up to its position): the attention of a verified token is
    then the very computation a decode of it would have made, so speculation changes no output. (A chunk's
    kernel sums in another order; a difference of one rounding in one layer, through the next layers' int8
    activation quantization, moved a GGUF model's greedy tokens.)"""
    decode_rows = int(np.count_nonzero(num_scheduled == 1)) + num_verifying
    num_decodes = int(num_scheduled[:decode_rows].sum())
    if num_decodes == decode_rows:  # no verifying rows: one row per sequence
        return StepAttentionInputs(num_decodes, num_scheduled, context_lens, batch.block_table[rows, :max_blocks],
                                   slot_mapping)
    query_lens = np.concatenate([np.ones(num_decodes, dtype=np.int64), num_scheduled[decode_rows:]])
    seq_lens = np.concatenate([positions[:num_decodes] + 1, context_lens[decode_rows:]])
    block_tables = np.concatenate([batch.block_table[token_rows[:num_decodes], :max_blocks],
                                   batch.block_table[rows[decode_rows:], :max_blocks]])
    return StepAttentionInputs(num_decodes, query_lens, seq_lens, block_tables, slot_mapping)
