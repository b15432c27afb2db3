"""Start-up's profiling steps: the largest prefill and the worst decode on throwaway state, whose activation
peaks the worker measures to size the KV pool."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.sample.sampler import Penalties, SamplingBatch, TokenHistory
from pagellm.worker.logits import model_logits_in_chunks
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.step_inputs import prepare_inputs

# The most top log-probabilities the OpenAI server lets a request ask for (protocol.MAX_LOGPROBS).
PROFILED_LOGPROBS = 20


@torch.inference_mode()
def profile_prefill(runner: ModelRunner, num_tokens: int, kv_caches) -> None:
    """A forward over `num_tokens` prompt tokens on throwaway state, so that the caller can measure
    the activation peak of the largest prefill step.

    `kv_caches` may cover fewer layers than the model has: every layer frees its temporaries before
    the next starts and all layers have one shape, so one layer's peak is the whole forward's, at a
    fraction of the start-up time.
    """
    seq_len = min(num_tokens, runner.max_model_len)
    num_seqs = -(-num_tokens // seq_len)
    lengths = np.full(num_seqs, seq_len, dtype=np.int64)
    lengths[-1] = num_tokens - seq_len * (num_seqs - 1)
    blocks = np.arange(num_seqs * -(-seq_len // runner.block_size)).reshape(num_seqs, -1)
    _profile_step(runner, lengths, blocks, kv_caches, sample=False)


@torch.inference_mode()
def profile_decode(runner: ModelRunner, num_seqs: int, kv_caches) -> None:
    """The worst decode step: `num_seqs` one-token sequences, their logits and the sampler with every
    filter on (a CUDA graph's pool holds about this forward's temporaries).

    Each sequence has a one-token context, all in block 0: the backends that read K/V through the block
    table (Triton, the native CPU kernel) need no memory that grows with the context; the torch path's
    gather of long contexts is not counted.
    """
    _profile_step(runner, np.ones(num_seqs, dtype=np.int64), np.zeros((num_seqs, 1), dtype=np.int64), kv_caches,
                  sample=True)


def _profile_step(runner: ModelRunner, lengths: np.ndarray, blocks: np.ndarray, kv_caches, sample: bool) -> None:
    batch = runner.input_batch
    num_seqs = len(lengths)
    if batch.num_rows < num_seqs:
        batch.grow(num_seqs - batch.num_rows)
    rows = np.arange(num_seqs)
    saved_caches, runner.kv_caches = runner.kv_caches, kv_caches
    # Only the columns the step writes are saved and restored: whole rows of max_model_len would make the
    # token table resident (InputBatch takes its pages as they are written).
    tokens, table = (rows, slice(0, int(lengths.max()) + 1)), (rows, slice(0, blocks.shape[1]))
    saved = (batch.token_ids[tokens].copy(), batch.num_tokens[rows].copy(), batch.num_computed[rows].copy(),
             batch.block_table[table].copy())
    try:
        batch.token_ids[tokens] = 0
        batch.num_tokens[rows] = lengths + 1  # no row samples through the runner: the sampler is probed below
        batch.num_computed[rows] = 0
        batch.block_table[table] = blocks
        hidden = runner.run_model(prepare_inputs(batch, rows, lengths, runner.block_size, runner.device))
        if sample:
            _probe_sampling(runner, hidden)
    finally:
        (batch.token_ids[tokens], batch.num_tokens[rows], batch.num_computed[rows], batch.block_table[table]) = saved
        runner.kv_caches = saved_caches


def _probe_sampling(runner: ModelRunner, hidden: torch.Tensor) -> None:
    """The LM head and the sampler with every filter on, log-probabilities and penalties over full-length
    histories, as a step runs them (a chunk of rows at a time): the most a step's sampling holds at once."""
    num_rows = hidden.shape[0]
    device = runner.device

    def column(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((num_rows,), value, dtype=dtype, device=device)

    rows = np.arange(num_rows)
    history = TokenHistory(runner.input_batch.token_ids, rows, np.zeros(num_rows, dtype=np.int64),
                           np.full(num_rows, runner.max_model_len, dtype=np.int64))
    batch = SamplingBatch(
        temperature=column(1.0),
        top_k=column(50, torch.int64),
        top_p=column(0.9),
        min_p=column(0.05),
        all_greedy=False,
        seeded_rows=[],  # a seeded row redraws its random number in place: no memory of its own
        banned_tokens=[],
        penalties=Penalties(column(0.5), column(0.5), column(1.2), history),
        allowed_tokens=[(row, [0, 1]) for row in range(num_rows)],
        num_logprobs=PROFILED_LOGPROBS,
        sort_whole_rows=True,
    )
    output = runner.sampler.new_output(batch, device) if runner.samples else None
    # The sampler works through a logits chunk a sampler chunk of rows at a time, each chunk of one shape in the
    # same workspace and freeing its temporaries before the next: its first chunk's peak is the whole chunk's, at
    # a fraction of the start-up time (all 256 rows: ~1 s of a tiny model's start on a CPU). Every logits chunk
    # is still computed, so that two of them coexist as they do in a step. The probe's draws come from the
    # engine's generator, whose state is restored: serving's random stream starts at the seed.
    generator_state = runner.sampler.generator.get_state()
    for first, logits in model_logits_in_chunks(runner.model, hidden, runner.logits_rows_per_chunk):
        if logits is not None:  # None on tensor-parallel ranks that do not sample
            runner.sampler.sample_into(logits[: runner.sampler.rows_per_chunk(logits.shape[1])], batch, first, output)
    runner.sampler.generator.set_state(generator_state)
