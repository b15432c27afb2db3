"""SchedulerOutput -> input tensors -> forward -> logits of the sampling positions -> sampled tokens.

The runner keeps its own copy of each running sequence's tokens and block table in preallocated
numpy arrays (one row per sequence), updated from the scheduler's deltas, so that a step's inputs
are built by bulk indexing rather than per-token Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import AttentionShape, StepAttentionInputs, select_backend
from pagellm.attention.kv_spec import KVCacheFormat
from pagellm.attention.paged import to_device
from pagellm.core.scheduler import ModelRunnerOutput, NewRequestData, SchedulerOutput, TokenLogprobs
from pagellm.models.llama import LlamaForCausalLM, head_dim_of
from pagellm.sample.sampler import Penalties, Sampler, SamplerOutput, SamplingBatch
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.matcher import SequenceGrammar
from pagellm.worker.kv_cache import layer_views


@dataclass
class _RowState:
    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    sample_index: int
    num_samples_at_first: int
    appends_sampled_tokens: bool
    # Stop tokens masked until min_tokens are out.
    min_tokens_stop_ids: list[int]
    # The matcher of a request with structured_outputs, else None.
    grammar: SequenceGrammar | None = None

    @property
    def wants_logprobs(self) -> bool:
        # best_of ranks sequences by cumulative log-probability; beam candidates report top log-probabilities.
        params = self.params
        return params.logprobs is not None or params.num_sequences > params.n or not self.appends_sampled_tokens

    @property
    def num_logprobs(self) -> int:
        return self.params.logprobs or 0

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing else to apply or report: its sample is the argmax, one token, appended."""
        params = self.params
        return (
            params.temperature == 0
            and self.num_samples_at_first == 1
            and self.appends_sampled_tokens
            and not self.wants_logprobs
            and not self.min_tokens_stop_ids
            and not params.bad_words_token_ids
            and not params.has_penalties
            and not params.logit_bias
            and not params.allowed_token_ids
            # A structured-output grammar constrains every sample.
            and params.structured_outputs is None
        )


@dataclass
class _StepInputs:
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
        kv_format: KVCacheFormat | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.num_kv_heads = model.num_kv_heads_per_rank  # this tensor-parallel rank's share of the pool
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((0, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.num_computed = np.zeros(0, dtype=np.int64)
        self.block_table = np.zeros((0, self.max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(0, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.rows: dict[int, _RowState] = {}
        # Per row, in arrays so that a step reads them for the whole batch at once (see _RowState).
        self.num_prompt_tokens = np.zeros(0, dtype=np.int64)
        self.num_samples_at_first = np.zeros(0, dtype=np.int64)
        self.plain_greedy = np.zeros(0, dtype=bool)
        self.row_request_ids = np.zeros(0, dtype=object)
        # A batch of plain greedy rows needs no per-row settings: its SamplingBatch is the same every step of
        # its size, built once.
        self._greedy_batches: dict[int, SamplingBatch] = {}
        # Rows whose requests asked for prompt_logprobs: the only ones a step must look at for them.
        self.prompt_scoring_rows: set[int] = set()
        self.free_rows: list[int] = []
        self._grow_rows(max_num_seqs)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.sampler = Sampler(generator)
        # Under tensor parallelism only rank 0 samples; the other ranks skip building sampling inputs.
        self.samples = model.group.rank == 0
        self.kv_pool: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # This rank's heads (all of them without tensor parallelism).
        shape = AttentionShape(model.num_heads_per_rank, self.num_kv_heads, head_dim_of(model.config), block_size,
                               kv_format)
        self.attn_backend = select_backend(device, model.activation_dtype, shape)
        self.max_num_seqs = max_num_seqs
        # Captured after the KV pool exists (capture_cuda_graphs); None runs every step eagerly.
        self.graphs = None  # a cuda_graphs.DecodeGraphs

    @property
    def native_decode(self):
        """The native CPU decode kernel the attention backend runs decodes on, or None."""
        return getattr(self.attn_backend, "native_decode", None)

    def set_kv_pool(self, pool: torch.Tensor) -> None:
        """pool: [num_layers, 2, num_blocks, kv_heads, block_size, head_dim]."""
        self.kv_pool = pool
        self.kv_caches = layer_views(pool)

    def can_capture_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and self.attn_backend.supports_cuda_graphs

    def capture_cuda_graphs(self) -> int:
        """Capture decode steps at bucketed batch sizes over the KV pool; returns the graph pool's bytes."""
        from pagellm.worker.cuda_graphs import DecodeGraphs  # imports triton, which CPU-only installs may lack

        self.graphs = DecodeGraphs(self.model, self.attn_backend, self.kv_caches, self.max_num_seqs,
                                   self.max_blocks, self.max_model_len, self.device)
        return self.graphs.capture()

    # ---- sequence state ----------------------------------------------------------------------------

    def _grow_rows(self, extra: int) -> None:
        """Rows are sized for max_num_seqs; forks (n > 1, beam search) may briefly need more."""
        old = len(self.num_tokens)
        self.token_ids = np.concatenate([self.token_ids, np.zeros((extra, self.max_model_len), np.int64)])
        self.block_table = np.concatenate([self.block_table, np.zeros((extra, self.max_blocks), np.int64)])
        for name in ("num_tokens", "num_computed", "num_blocks", "num_prompt_tokens", "num_samples_at_first"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, np.int64)]))
        self.plain_greedy = np.concatenate([self.plain_greedy, np.zeros(extra, bool)])
        self.row_request_ids = np.concatenate([self.row_request_ids, np.zeros(extra, object)])
        self.free_rows.extend(range(old + extra - 1, old - 1, -1))

    def _add_request(self, new: NewRequestData) -> None:
        if not self.free_rows:
            self._grow_rows(max(8, len(self.num_tokens)))
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
        grammar = SequenceGrammar(params.structured_grammar) if params.structured_grammar is not None else None
        state = self.rows[row] = _RowState(new.request_id, params, new.num_prompt_tokens, new.sample_index,
                                           new.num_samples_at_first, new.appends_sampled_tokens, stop_ids, grammar)
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_samples_at_first[row] = new.num_samples_at_first
        self.plain_greedy[row] = state.is_plain_greedy
        self.row_request_ids[row] = new.request_id
        if params.prompt_logprobs is not None:
            self.prompt_scoring_rows.add(row)

    def _remove_request(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            del self.rows[row]
            self.plain_greedy[row] = False
            self.prompt_scoring_rows.discard(row)
            self.free_rows.append(row)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = self.num_blocks[row]
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def _apply(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self._remove_request(request_id)
        if scheduler_output.block_copies:
            # Before any write of this step: a sequence that still shares the source may write into it.
            src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*scheduler_output.block_copies))
            self.kv_pool[:, :, dst] = self.kv_pool[:, :, src]
        for new in scheduler_output.new_requests:
            self._add_request(new)
        for cached in scheduler_output.cached_requests:
            row = self.row_of[cached.request_id]
            for index, block_id in cached.replaced_blocks:
                self.block_table[row, index] = block_id
            self._append_blocks(row, cached.new_block_ids)
            for token_id in cached.new_token_ids:
                self.token_ids[row, self.num_tokens[row]] = token_id
                self.num_tokens[row] += 1

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

        inputs = self._prepare_inputs(rows, num_scheduled)
        num_samples = int(inputs.fanout.sum())
        # Built (and sent to the device) before the forward is queued: building it after would make each
        # host-to-device copy wait for the forward, and the GPU would idle while the sampler is launched.
        sampling = self._step_sampling_batch(rows, inputs) if num_samples and self.samples else None
        hidden = self._run_model(inputs)
        output = ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[inputs.logits_index]) if len(inputs.logits_index) else None
        # None on tensor-parallel ranks other than 0: rank 0 samples, and sends its tokens with the next step.
        if logits is not None:
            if num_samples:
                self._sample(logits[:num_samples], rows, inputs, sampling, output)
            if inputs.prompt_logprob_positions:
                self._score_prompt(logits[num_samples:], rows, inputs, output)
        self.num_computed[rows] += num_scheduled
        return output

    def _run_model(self, inputs: _StepInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs.attention):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.attention)
        meta = self.attn_backend.build_metadata(inputs.attention)
        return self.model(self._to_device(inputs.input_ids), self._to_device(inputs.positions), self.kv_caches, meta)

    def _step_sampling_batch(self, rows: np.ndarray, inputs: _StepInputs) -> SamplingBatch:
        expanded_rows = np.repeat(rows[inputs.sample_positions], inputs.fanout)
        fork_index = np.arange(len(expanded_rows)) - np.repeat(np.cumsum(inputs.fanout) - inputs.fanout, inputs.fanout)
        return self._sampling_batch(expanded_rows, fork_index)

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, inputs: _StepInputs, sampling: SamplingBatch,
                output: ModelRunnerOutput) -> None:
        sample_rows = rows[inputs.sample_positions]
        result = self.sampler(logits, sampling)
        tokens = result.token_ids.tolist()  # the step's one wait on the device
        if self.plain_greedy[sample_rows].all():
            # One token per row, no log-probabilities, each appended: the whole batch at once.
            output.sampled_token_ids.update(zip(self.row_request_ids[sample_rows].tolist(), tokens))
            self.token_ids[sample_rows, self.num_tokens[sample_rows]] = tokens
            self.num_tokens[sample_rows] += 1
            return
        offset = 0
        appending = []
        for row, fanout in zip(sample_rows.tolist(), inputs.fanout.tolist()):
            state = self.rows[row]
            stop_reason = sampling.structured_stops.get(offset)
            if stop_reason is not None:
                output.structured_stops[state.request_id] = stop_reason
                offset += fanout
                continue
            output.sampled_token_ids[state.request_id] = tokens[offset]
            if fanout > 1:
                output.forked_token_ids[state.request_id] = tokens[offset + 1 : offset + fanout]
            if state.wants_logprobs and result.logprobs is not None:
                output.logprobs[state.request_id] = [
                    _token_logprobs(result, i, state.num_logprobs) for i in range(offset, offset + fanout)
                ]
            if state.appends_sampled_tokens:
                appending.append((row, tokens[offset]))
            offset += fanout
        self._append_tokens(appending)

    def append_sampled_tokens(self, sampled_token_ids: dict[str, int]) -> None:
        """On a tensor-parallel rank that does not sample: the tokens rank 0 sampled last step."""
        self._append_tokens([(self.row_of[request_id], token) for request_id, token in sampled_token_ids.items()
                             if request_id in self.row_of and self.rows[self.row_of[request_id]].appends_sampled_tokens])

    def _append_tokens(self, appending: list[tuple[int, int]]) -> None:
        if appending:
            append_rows, append_tokens = (np.array(x, dtype=np.int64) for x in zip(*appending))
            self.token_ids[append_rows, self.num_tokens[append_rows]] = append_tokens
            self.num_tokens[append_rows] += 1

    def _score_prompt(self, logits: torch.Tensor, rows, inputs: _StepInputs, output: ModelRunnerOutput) -> None:
        logprobs = logits.log_softmax(dim=-1)
        offset = 0
        for position, _, absolute in inputs.prompt_logprob_positions:
            row = int(rows[position])
            state = self.rows[row]
            count = len(absolute)
            next_tokens = torch.from_numpy(self.token_ids[row, absolute + 1]).to(self.device)
            part = logprobs[offset : offset + count]
            chosen = part.gather(1, next_tokens.unsqueeze(1)).squeeze(1)
            ranks = (part > chosen.unsqueeze(1)).sum(dim=-1) + 1
            k = state.params.prompt_logprobs
            top_lp, top_ids = part.topk(k, dim=-1) if k else (part[:, :0], next_tokens[:, None][:, :0])
            scored = SamplerOutput(next_tokens, chosen, ranks, top_ids, top_lp)
            output.prompt_logprobs[state.request_id] = [_token_logprobs(scored, i, k) for i in range(count)]
            offset += count

    def _prepare_inputs(self, rows: np.ndarray, num_scheduled: np.ndarray) -> _StepInputs:
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

        sample_positions = np.nonzero(context_lens == self.num_tokens[rows])[0]
        # A request samples all its n sequences at its first sample (n > 1 / best_of), one afterwards.
        sample_rows = rows[sample_positions]
        first_sample = self.num_tokens[sample_rows] == self.num_prompt_tokens[sample_rows]
        fanout = np.where(first_sample, self.num_samples_at_first[sample_rows], 1)
        logits_index = [np.repeat(ends[sample_positions] - 1, fanout)]
        prompt_positions = []
        scoring = np.nonzero(np.isin(rows, list(self.prompt_scoring_rows)))[0] if self.prompt_scoring_rows else ()
        for position in scoring:
            state = self.rows[int(rows[position])]
            absolute = np.arange(computed[position], context_lens[position])
            keep = absolute + 1 < state.num_prompt_tokens
            if keep.any():
                flat = starts[position] + np.nonzero(keep)[0]
                prompt_positions.append((position, flat, absolute[keep]))
                logits_index.append(flat)

        num_decodes = int(np.count_nonzero(num_scheduled == 1))
        max_blocks = -(-int(context_lens.max()) // self.block_size)
        attention = StepAttentionInputs(num_decodes, num_scheduled, context_lens,
                                        self.block_table[rows, :max_blocks], slot_mapping)
        return _StepInputs(
            input_ids=input_ids,
            positions=positions,
            attention=attention,
            sample_positions=sample_positions,
            fanout=fanout,
            logits_index=self._to_device(np.concatenate(logits_index)),
            prompt_logprob_positions=prompt_positions,
        )

    def _sampling_batch(self, rows: np.ndarray, fork_index: np.ndarray) -> SamplingBatch:
        if self.plain_greedy[rows].all():
            batch = self._greedy_batches.get(len(rows))
            if batch is None:
                batch = self._greedy_batches[len(rows)] = self._full_sampling_batch(rows, fork_index)
            return batch
        return self._full_sampling_batch(rows, fork_index)

    def _full_sampling_batch(self, rows: np.ndarray, fork_index: np.ndarray) -> SamplingBatch:
        states = [self.rows[int(r)] for r in rows]
        params = [s.params for s in states]
        num_outputs = self.num_tokens[rows] - self.num_prompt_tokens[rows]
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
        banned += self._bad_word_bans(rows, states, num_outputs)
        wanting = [s.num_logprobs for s in states if s.wants_logprobs]
        token_bitmask, structured_stops = self._grammar_bitmask(rows, states)
        return SamplingBatch(
            temperature, top_k, top_p, min_p, all_greedy, seeded, banned,
            penalties=self._penalties(rows, params) if any(p.has_penalties for p in params) else None,
            logit_bias=self._logit_bias(params),
            allowed_mask=self._allowed_mask(params),
            token_bitmask=token_bitmask,
            num_logprobs=max(wanting) if wanting else None,
            structured_stops=structured_stops,
        )

    def _bad_word_bans(self, rows, states, num_outputs) -> list[tuple[int, list[int]]]:
        bans = []
        for i, state in enumerate(states):
            words = state.params.bad_words_token_ids
            if not words:
                continue
            row, end = int(rows[i]), int(self.num_tokens[rows[i]])
            output = self.token_ids[row, end - int(num_outputs[i]) : end]
            banned = [w[-1] for w in words if len(w) == 1 or (len(output) >= len(w) - 1 and
                                                             list(output[len(output) - len(w) + 1 :]) == w[:-1])]
            if banned:
                bans.append((i, banned))
        return bans

    def _penalties(self, rows: np.ndarray, params: list[SamplingParams]) -> Penalties:
        num_rows, vocab = len(rows), self.vocab_size
        lengths = self.num_tokens[rows]
        prompt_lens = self.num_prompt_tokens[rows]
        width = int(lengths.max())
        columns = np.arange(width)
        tokens = self._to_device(self.token_ids[rows, :width])
        valid = self._to_device(columns[None, :] < lengths[:, None])
        in_output = self._to_device((columns[None, :] >= prompt_lens[:, None]) & (columns[None, :] < lengths[:, None]))
        counts = torch.zeros(num_rows, vocab, device=self.device)
        counts.scatter_add_(1, tokens, in_output.to(torch.float32))
        seen = torch.zeros(num_rows, vocab, device=self.device)
        seen.scatter_add_(1, tokens, valid.to(torch.float32))

        def column(name: str) -> torch.Tensor:
            return self._to_device(np.array([getattr(p, name) for p in params], dtype=np.float32))

        return Penalties(column("presence_penalty"), column("frequency_penalty"), column("repetition_penalty"),
                         counts, seen > 0)

    def _logit_bias(self, params: list[SamplingParams]):
        entries = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()
                   if t < self.vocab_size]
        if not entries:
            return None
        rows, ids, biases = zip(*entries)
        return (self._to_device(np.array(rows, dtype=np.int64)), self._to_device(np.array(ids, dtype=np.int64)),
                self._to_device(np.array(biases, dtype=np.float32)))

    def _grammar_bitmask(self, rows: np.ndarray, states: list[_RowState]) -> tuple[torch.Tensor | None, dict[int, str]]:
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
            state.grammar.catch_up(self.token_ids[row, state.num_prompt_tokens : self.num_tokens[row]])
            reason = state.grammar.fill_bitmask(bitmask, i)
            if reason is not None:
                stops[i] = reason
                bitmask[i] = -1  # the row is not sampled; an all-allowed row keeps the sampler's math finite
        return bitmask.to(self.device, non_blocking=True), stops

    def _allowed_mask(self, params: list[SamplingParams]) -> torch.Tensor | None:
        if not any(p.allowed_token_ids for p in params):
            return None
        mask = torch.ones(len(params), self.vocab_size, dtype=torch.bool, device=self.device)
        for i, p in enumerate(params):
            if p.allowed_token_ids:
                mask[i] = False
                mask[i, [t for t in p.allowed_token_ids if t < self.vocab_size]] = True
        return mask

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    # ---- start-up ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_prefill(self, num_tokens: int, kv_caches) -> None:
        """A forward over `num_tokens` prompt tokens on throwaway state, so that the caller can measure
        the activation peak of the largest prefill step.

        `kv_caches` may cover fewer layers than the model has: every layer frees its temporaries before
        the next starts and all layers have one shape, so one layer's peak is the whole forward's, at a
        fraction of the start-up time.
        """
        seq_len = min(num_tokens, self.max_model_len)
        num_seqs = -(-num_tokens // seq_len)
        lengths = np.full(num_seqs, seq_len, dtype=np.int64)
        lengths[-1] = num_tokens - seq_len * (num_seqs - 1)
        blocks = np.arange(num_seqs * -(-seq_len // self.block_size)).reshape(num_seqs, -1)
        self._profile_step(lengths, blocks, kv_caches, sample=False)

    @torch.inference_mode()
    def profile_decode(self, num_seqs: int, kv_caches) -> None:
        """The worst decode step: `num_seqs` one-token sequences, their logits and the sampler with every
        filter on (a CUDA graph's pool holds about this forward's temporaries).

        Each sequence has a one-token context, all in block 0: the backends that read K/V through the block
        table (Triton, the native CPU kernel) need no memory that grows with the context; the torch path's
        gather of long contexts is not counted.
        """
        self._profile_step(np.ones(num_seqs, dtype=np.int64), np.zeros((num_seqs, 1), dtype=np.int64), kv_caches,
                           sample=True)

    def _profile_step(self, lengths: np.ndarray, blocks: np.ndarray, kv_caches, sample: bool) -> None:
        num_seqs = len(lengths)
        if len(self.num_tokens) < num_seqs:
            self._grow_rows(num_seqs - len(self.num_tokens))
        rows = np.arange(num_seqs)
        saved_caches, self.kv_caches = self.kv_caches, kv_caches
        saved = (self.token_ids[rows].copy(), self.num_tokens[rows].copy(), self.num_computed[rows].copy(),
                 self.block_table[rows].copy())
        try:
            self.token_ids[rows] = 0
            self.num_tokens[rows] = lengths + 1  # no row samples through the runner: the sampler is probed below
            self.num_computed[rows] = 0
            self.block_table[rows, : blocks.shape[1]] = blocks
            hidden = self._run_model(self._prepare_inputs(rows, lengths))
            logits = self.model.compute_logits(hidden) if sample else None
            if logits is not None:  # None on tensor-parallel ranks that do not sample
                self._probe_sampler(logits)
        finally:
            (self.token_ids[rows], self.num_tokens[rows], self.num_computed[rows], self.block_table[rows]) = saved
            self.kv_caches = saved_caches

    def _probe_sampler(self, logits: torch.Tensor) -> None:
        rows = logits.shape[0]
        probe = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05)
        self.sampler(logits, SamplingBatch(
            temperature=torch.full((rows,), probe.temperature, device=self.device),
            top_k=torch.full((rows,), probe.top_k, device=self.device),
            top_p=torch.full((rows,), probe.top_p, device=self.device),
            min_p=torch.full((rows,), probe.min_p, device=self.device),
            all_greedy=False, seeded_rows=[], banned_tokens=[],
        ))


def _token_logprobs(result: SamplerOutput, i: int, k: int) -> TokenLogprobs:
    return TokenLogprobs(
        int(result.token_ids[i]),
        float(result.logprobs[i]),
        int(result.ranks[i]),
        result.top_token_ids[i, :k].tolist(),
        result.top_logprobs[i, :k].tolist(),
    )
