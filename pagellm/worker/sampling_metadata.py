"""The sampler's per-row settings (SamplingBatch) for the rows that sample this step, from the input batch."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.attention.paged import to_device
from pagellm.sample.sampler import LogitBias, Penalties, SamplingBatch, TokenHistory
from pagellm.sampling_params import SamplingParams
from pagellm.worker.input_batch import InputBatch, RowState
from pagellm.worker.step_inputs import StepInputs


class SamplingBatchBuilder:
    def __init__(self, batch: InputBatch, vocab_size: int, device: torch.device) -> None:
        self.batch = batch
        self.vocab_size = vocab_size
        self.device = device
        # A batch of plain greedy rows needs no per-row settings: its SamplingBatch is the same every step of
        # its size, built once.
        self._greedy_batches: dict[int, SamplingBatch] = {}

    def for_step(self, rows: np.ndarray, inputs: StepInputs) -> SamplingBatch:
        """One sampling row per sample: a row that draws several samples at once (fanout) is repeated."""
        expanded_rows = np.repeat(rows[inputs.sample_positions], inputs.fanout)
        fork_index = np.arange(len(expanded_rows)) - np.repeat(np.cumsum(inputs.fanout) - inputs.fanout, inputs.fanout)
        return self.build(expanded_rows, fork_index)

    def build(self, rows: np.ndarray, fork_index: np.ndarray, ahead: np.ndarray | None = None) -> SamplingBatch:
        """ahead: per sampling row, tokens past the row's num_tokens that precede its sample (speculative decoding's
        drafts, in the token table): they count in its history, its output index and min_tokens."""
        if self.batch.plain_greedy[rows].all():
            cached = self._greedy_batches.get(len(rows))
            if cached is None:
                cached = self._greedy_batches[len(rows)] = self._full(rows, fork_index)
            return cached
        return self._full(rows, fork_index, ahead)

    def _full(self, rows: np.ndarray, fork_index: np.ndarray, ahead: np.ndarray | None = None) -> SamplingBatch:
        batch = self.batch
        states = [batch.rows[int(r)] for r in rows]
        params = [s.params for s in states]
        lengths = batch.num_tokens[rows] if ahead is None else batch.num_tokens[rows] + ahead
        num_outputs = lengths - batch.num_prompt_tokens[rows]
        temperature = self._to_device(np.array([p.temperature for p in params], dtype=np.float32))
        all_greedy = all(p.temperature == 0 for p in params)
        top_k = top_p = min_p = None
        if not all_greedy:
            if any(p.top_k for p in params):
                top_k = self._to_device(np.array([min(p.top_k or self.vocab_size, self.vocab_size) for p in params],
                                                 dtype=np.int64))
            if any(p.top_p < 1 for p in params):
                top_p = self._to_device(np.array([p.top_p for p in params], dtype=np.float32))
            if any(p.min_p > 0 for p in params):
                min_p = self._to_device(np.array([p.min_p for p in params], dtype=np.float32))
        # Sample j of a sequence with completion index i uses seed + i + j: the same draws as a
        # separate request with that seed (vLLM's convention for n > 1).
        seeded = [
            (i, p.seed + s.sample_index + int(fork_index[i]), int(num_outputs[i]))
            for i, (p, s) in enumerate(zip(params, states))
            if p.seed is not None and p.temperature > 0
        ]
        banned = [
            (i, s.min_tokens_stop_ids)
            for i, s in enumerate(states)
            if s.min_tokens_stop_ids and num_outputs[i] < s.params.min_tokens
        ]
        banned += self._bad_word_bans(rows, states, num_outputs, lengths)
        wanting = [s.num_logprobs for s in states if s.wants_logprobs]
        token_bitmask, structured_stops = self._grammar_bitmask(rows, states)
        return SamplingBatch(
            temperature, top_k, top_p, min_p, all_greedy, seeded, banned,
            penalties=self._penalties(rows, params, lengths) if any(p.has_penalties for p in params) else None,
            logit_bias=self._logit_bias(params),
            allowed_tokens=self._allowed_tokens(params),
            token_bitmask=token_bitmask,
            num_logprobs=max(wanting) if wanting else None,
            structured_stops=structured_stops,
        )

    def _bad_word_bans(self, rows, states, num_outputs, lengths) -> list[tuple[int, list[int]]]:
        bans = []
        for i, state in enumerate(states):
            words = state.params.bad_words_token_ids
            if not words:
                continue
            row, end = int(rows[i]), int(lengths[i])
            output = self.batch.token_ids[row, end - int(num_outputs[i]) : end]
            banned = [w[-1] for w in words if len(w) == 1 or (len(output) >= len(w) - 1 and
                                                             list(output[len(output) - len(w) + 1 :]) == w[:-1])]
            if banned:
                bans.append((i, banned))
        return bans

    def _penalties(self, rows: np.ndarray, params: list[SamplingParams], lengths: np.ndarray) -> Penalties:
        # The occurrence counts ([rows, vocab]) are built by the sampler, one chunk of rows at a time.
        history = TokenHistory(self.batch.token_ids, rows, self.batch.num_prompt_tokens[rows], lengths)

        def column(name: str) -> torch.Tensor:
            return self._to_device(np.array([getattr(p, name) for p in params], dtype=np.float32))

        return Penalties(column("presence_penalty"), column("frequency_penalty"), column("repetition_penalty"),
                         history)

    def _logit_bias(self, params: list[SamplingParams]) -> LogitBias | None:
        entries = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()
                   if t < self.vocab_size]
        if not entries:
            return None
        rows, ids, biases = (np.array(x) for x in zip(*entries))
        return LogitBias(self._to_device(rows.astype(np.int64)), self._to_device(ids.astype(np.int64)),
                         self._to_device(biases.astype(np.float32)), rows.astype(np.int64))

    def _grammar_bitmask(self, rows: np.ndarray, states: list[RowState]) -> tuple[torch.Tensor | None, dict[int, str]]:
        """The grammar-allowed tokens of every sampling row ([S, ceil(V/32)] int32 bits, all set for unconstrained
        rows; None when no row is constrained), and the rows whose grammar allows nothing (finished with the
        reason instead of sampled)."""
        constrained = [i for i, s in enumerate(states) if s.grammar is not None]
        if not constrained:
            return None, {}
        bitmask = torch.full((len(states), -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        stops: dict[int, str] = {}
        for i in constrained:
            row, state = int(rows[i]), states[i]
            # A no-op for the repeats of a row that samples several sequences at once (fanout).
            state.grammar.catch_up(self.batch.token_ids[row, state.num_prompt_tokens : self.batch.num_tokens[row]])
            reason = state.grammar.fill_bitmask(bitmask, i)
            if reason is not None:
                stops[i] = reason
                bitmask[i] = -1  # the row is not sampled; an all-allowed row keeps the sampler's math finite
        return bitmask.to(self.device, non_blocking=True), stops

    def _allowed_tokens(self, params: list[SamplingParams]) -> list[tuple[int, list[int]]]:
        # The [rows, vocab] mask is built by the sampler, one chunk of rows at a time.
        return [(i, [t for t in p.allowed_token_ids if t < self.vocab_size])
                for i, p in enumerate(params) if p.allowed_token_ids]

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
