"""SchedulerOutput -> input tensors -> forward -> logits of the sampling positions -> sampled tokens.

The runner keeps its own copy of each running request's tokens and block table in preallocated
numpy arrays (one row per request), updated from the scheduler's deltas, so that a step's inputs are
built by bulk indexing rather than per-token Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.paged import AttentionMetadata, PrefillMetadata
from pagellm.core.scheduler import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagellm.models.llama import LlamaForCausalLM
from pagellm.sample.sampler import Sampler, SamplingBatch
from pagellm.sampling_params import SamplingParams


@dataclass
class _RowState:
    sampling_params: SamplingParams
    num_prompt_tokens: int
    stop_token_ids: list[int]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        seed: int,
        eos_token_ids: set[int],
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.rows: dict[int, _RowState] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.sampler = Sampler(generator)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- request state -------------------------------------------------------------------------

    def _add_request(self, new: NewRequestData) -> None:
        row = self.free_rows.pop()
        self.row_of[new.request_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)
        params = new.sampling_params
        stop_ids = sorted(params.all_stop_token_ids) if params.min_tokens else []
        self.rows[row] = _RowState(params, new.num_prompt_tokens, stop_ids)

    def _remove_request(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            del self.rows[row]
            self.free_rows.append(row)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = self.num_blocks[row]
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def _apply(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self._remove_request(request_id)
        for new in scheduler_output.new_requests:
            self._add_request(new)
        for cached in scheduler_output.cached_requests:
            self._append_blocks(self.row_of[cached.request_id], cached.new_block_ids)

    # ---- one step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._apply(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        request_ids = list(scheduler_output.num_scheduled_tokens)
        rows = np.fromiter((self.row_of[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
        num_scheduled = np.fromiter(
            scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(request_ids)
        )
        # Decodes (one query token) first: they share one attention call without query padding.
        order = np.argsort(num_scheduled > 1, kind="stable")
        rows, num_scheduled = rows[order], num_scheduled[order]
        request_ids = [request_ids[i] for i in order]

        inputs = self._prepare_inputs(rows, num_scheduled)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        sampled_tokens = np.empty(0, dtype=np.int64)
        if len(inputs.sample_rows):
            logits = self.model.compute_logits(hidden[inputs.logits_index])
            batch = self._sampling_batch(inputs.sample_rows)
            sampled_tokens = self.sampler(logits, batch).cpu().numpy()

        self.num_computed[rows] += num_scheduled
        sample_rows = inputs.sample_rows
        self.token_ids[sample_rows, self.num_tokens[sample_rows]] = sampled_tokens
        self.num_tokens[sample_rows] += 1
        sampled = {request_ids[i]: int(t) for i, t in zip(inputs.sample_positions, sampled_tokens)}
        return ModelRunnerOutput(sampled)

    def _prepare_inputs(self, rows: np.ndarray, num_scheduled: np.ndarray) -> "_StepInputs":
        computed = self.num_computed[rows]
        ends = np.cumsum(num_scheduled)
        starts = ends - num_scheduled
        total = int(ends[-1])
        seq_of_token = np.repeat(np.arange(len(rows)), num_scheduled)
        offset = np.arange(total) - starts[seq_of_token]
        positions = computed[seq_of_token] + offset
        token_rows = rows[seq_of_token]
        input_ids = self.token_ids[token_rows, positions]
        block_ids = self.block_table[token_rows, positions // self.block_size]
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        context_lens = computed + num_scheduled

        samples = context_lens == self.num_tokens[rows]
        sample_positions = np.nonzero(samples)[0]
        num_decodes = int(np.count_nonzero(num_scheduled == 1))
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            num_decode_tokens=num_decodes,
            decode_block_tables=None,
            decode_mask=None,
            prefill=None,
        )
        if num_decodes:
            meta.decode_block_tables, meta.decode_mask = self._decode_metadata(rows[:num_decodes], context_lens[:num_decodes])
        if num_decodes < len(rows):
            meta.prefill = self._prefill_metadata(
                rows[num_decodes:], num_scheduled[num_decodes:], computed[num_decodes:], context_lens[num_decodes:],
                offset[num_decodes:],
            )
        return _StepInputs(
            input_ids=self._to_device(input_ids),
            positions=self._to_device(positions),
            attn_metadata=meta,
            logits_index=self._to_device(ends[sample_positions] - 1),
            sample_rows=rows[sample_positions],
            sample_positions=sample_positions,
        )

    def _decode_metadata(self, rows: np.ndarray, context_lens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        max_blocks = -(-int(context_lens.max()) // self.block_size)
        tables = self.block_table[rows, :max_blocks]
        keys = np.arange(max_blocks * self.block_size)
        mask = keys[None, :] < context_lens[:, None]
        return self._to_device(tables), self._to_device(mask)[:, None, None, :]

    def _prefill_metadata(self, rows, num_scheduled, computed, context_lens, token_offsets) -> PrefillMetadata:
        num_prefills = len(rows)
        max_query = int(num_scheduled.max())
        max_blocks = -(-int(context_lens.max()) // self.block_size)
        starts = np.cumsum(num_scheduled) - num_scheduled
        padded = np.arange(max_query)
        query_index = starts[:, None] + np.minimum(padded[None, :], num_scheduled[:, None] - 1)
        output_index = np.repeat(np.arange(num_prefills) * max_query, num_scheduled) + token_offsets
        keys = np.arange(max_blocks * self.block_size)
        query_positions = computed[:, None] + padded[None, :]
        mask = (keys[None, None, :] <= query_positions[:, :, None]) & (keys[None, None, :] < context_lens[:, None, None])
        return PrefillMetadata(
            query_index=self._to_device(query_index.reshape(-1)),
            output_index=self._to_device(output_index),
            block_tables=self._to_device(self.block_table[rows, :max_blocks]),
            mask=self._to_device(mask)[:, None],
            max_query_len=max_query,
        )

    def _sampling_batch(self, sample_rows: np.ndarray) -> SamplingBatch:
        states = [self.rows[int(r)] for r in sample_rows]
        params = [s.sampling_params for s in states]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device)
        all_greedy = all(p.temperature == 0 for p in params)
        top_k = top_p = min_p = None
        if not all_greedy:
            if any(p.top_k for p in params):
                top_k = torch.tensor([p.top_k or self.vocab_size for p in params], device=self.device)
            if any(p.top_p < 1 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device)
            if any(p.min_p > 0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=self.device)
        num_outputs = self.num_tokens[sample_rows] - np.array([s.num_prompt_tokens for s in states])
        seeded = [
            (i, p.seed, int(num_outputs[i]))
            for i, p in enumerate(params)
            if p.seed is not None and p.temperature > 0
        ]
        banned = [
            (i, s.stop_token_ids)
            for i, s in enumerate(states)
            if s.stop_token_ids and num_outputs[i] < s.sampling_params.min_tokens
        ]
        return SamplingBatch(temperature, top_k, top_p, min_p, all_greedy, seeded, banned)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    # ---- start-up ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_sampling_rows: int, kv_caches) -> None:
        """A forward over `num_tokens` prompt tokens and sampling over `num_sampling_rows` rows, on
        throwaway state, so that the caller can measure the activation peak.

        `kv_caches` may cover fewer layers than the model has: every layer frees its temporaries before
        the next starts and all layers have one shape, so one layer's peak is the whole forward's, at a
        fraction of the start-up time.
        """
        saved_caches, self.kv_caches = self.kv_caches, kv_caches
        try:
            seq_len = min(num_tokens, self.max_model_len)
            num_seqs = -(-num_tokens // seq_len)
            lengths = np.full(num_seqs, seq_len, dtype=np.int64)
            lengths[-1] = num_tokens - seq_len * (num_seqs - 1)
            blocks_per_seq = -(-seq_len // self.block_size)
            rows = np.arange(num_seqs)
            saved = (self.token_ids[rows].copy(), self.num_tokens[rows].copy(), self.num_computed[rows].copy(),
                     self.block_table[rows].copy())
            self.token_ids[rows] = 0
            self.num_tokens[rows] = lengths
            self.num_computed[rows] = 0
            self.block_table[rows, :blocks_per_seq] = np.arange(num_seqs * blocks_per_seq).reshape(num_seqs, -1)
            inputs = self._prepare_inputs(rows, lengths)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
            rows_to_sample = hidden[-1:].expand(num_sampling_rows, -1)
            logits = self.model.compute_logits(rows_to_sample)
            probe = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05)
            batch = SamplingBatch(
                torch.full((num_sampling_rows,), probe.temperature, device=self.device),
                torch.full((num_sampling_rows,), probe.top_k, device=self.device),
                torch.full((num_sampling_rows,), probe.top_p, device=self.device),
                torch.full((num_sampling_rows,), probe.min_p, device=self.device),
                False, [], [],
            )
            self.sampler(logits, batch)
            (self.token_ids[rows], self.num_tokens[rows], self.num_computed[rows], self.block_table[rows]) = saved
        finally:
            self.kv_caches = saved_caches


@dataclass
class _StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_index: torch.Tensor
    sample_rows: np.ndarray
    sample_positions: np.ndarray
