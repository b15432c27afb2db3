"""SchedulerOutput -> input tensors -> forward -> logits of the sampling positions -> sampled tokens.

The pieces live beside it: the rows of the running sequences (input_batch.py), a step's inputs
(step_inputs.py), the sampler's per-row settings (sampling_metadata.py), the LM head's row chunks (logits.py),
prompt log-probabilities (prompt_logprobs.py) and start-up's profiling steps (profiling.py).
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.attention.backend import AttentionShape, select_backend
from pagellm.attention.kv_spec import KVCacheFormat, mla_latent_dim
from pagellm.attention.paged import to_device
from pagellm.core.scheduler import ModelRunnerOutput, SchedulerOutput
from pagellm.layers.fused_moe import cuda_graph_safe
from pagellm.layers.quantization.gguf import kernel_switch_rows
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.models.llama import LlamaForCausalLM, head_dim_of
from pagellm.sample.sampler import Sampler, SamplerOutput, SamplingBatch
from pagellm.spec_decode.verify import SpecStep, extend_logits_index, keep_taken, prepare_spec_step, verify
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.kv_cache import layer_views
from pagellm.worker.logits import logits_in_chunks, logits_rows_per_chunk, model_logits_in_chunks
from pagellm.worker.prompt_logprobs import PromptScorer, token_logprobs
from pagellm.worker.sampling_metadata import SamplingBatchBuilder
from pagellm.worker.step_inputs import StepInputs, prepare_inputs


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
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks)
        self.sampling_batches = SamplingBatchBuilder(self.input_batch, self.vocab_size, device)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.sampler = Sampler(generator)
        self.logits_rows_per_chunk = logits_rows_per_chunk(self.vocab_size, device)
        # Under tensor parallelism only rank 0 samples; the other ranks skip building sampling inputs.
        self.samples = model.group.rank == 0
        # On a rank that does not sample: last step's verified rows, kept until rank 0 says what they took.
        self._unsettled_spec: SpecStep | None = None
        # Rows whose verification this rank settled within its step (_settle_spec_now), not at the next broadcast.
        self._settled_rows: set[int] = set()
        self.kv_pool: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # This rank's heads (all of them without tensor parallelism).
        # An MLA model's one cache "head" is its latent row (kv_spec.mla_latent_dim).
        head_dim = mla_latent_dim(model.config) or head_dim_of(model.config)
        shape = AttentionShape(model.num_heads_per_rank, self.num_kv_heads, head_dim, block_size, kv_format,
                               getattr(model.config, "kv_lora_rank", None) or 0)
        self.attn_backend = select_backend(device, model.activation_dtype, shape)
        self.max_num_seqs = max_num_seqs
        # Captured after the KV pool exists (capture_cuda_graphs); None runs every step eagerly.
        self.graphs = None  # a cuda_graphs.DecodeGraphs
        # With enable_lora: the adapters' device slots and host cache (a pagellm.lora.manager.LoRAManager).
        self.lora = None
        # With speculative_config method draft_model, mtp or eagle: its proposer (pagellm.spec_decode.draft_model,
        # pagellm.spec_decode.heads).
        self.drafter = None

    def kernel_switch_rows(self) -> int | None:
        """Rows of a step from which one of the model's products runs another kernel (quantization/gguf.py's
        kernel_switch_rows): speculation keeps its verification steps below it."""
        return kernel_switch_rows(self.model, self.model.activation_dtype)

    @property
    def native_decode(self):
        """The native CPU decode kernel the attention backend runs decodes on, or None."""
        return getattr(self.attn_backend, "native_decode", None)

    def set_kv_pool(self, pool: torch.Tensor) -> None:
        """pool: [num_layers, 2, num_blocks, kv_heads, block_size, head_dim]."""
        self.kv_pool = pool
        self.kv_caches = layer_views(pool)

    def release_profiled_buffers(self) -> None:
        """Free what start-up's profiling steps grew and serving may never need: the sampler's chunk buffers and
        rotary tables past their first positions. Each grows back as a step needs it; the profile has counted it."""
        self.sampler.release_workspace()
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.trim()

    def can_capture_cuda_graphs(self) -> bool:
        return (self.device.type == "cuda" and self.attn_backend.supports_cuda_graphs
                and cuda_graph_safe(self.model))

    def capture_cuda_graphs(self) -> int:
        """Capture decode steps at bucketed batch sizes over the KV pool; returns the graph pool's bytes."""
        from pagellm.worker.cuda_graphs import DecodeGraphs  # imports triton, which CPU-only installs may lack

        self.graphs = DecodeGraphs(self.model, self.attn_backend, self.kv_caches, self.max_num_seqs,
                                   self.max_blocks, self.max_model_len, self.device)
        return self.graphs.capture()

    def _apply(self, scheduler_output: SchedulerOutput) -> None:
        for slot, lora_request in scheduler_output.lora_loads:
            self.lora.activate(slot, lora_request)
        for request_id in scheduler_output.finished_request_ids:
            self.input_batch.remove_request(request_id)
        if scheduler_output.block_copies:
            # Before any write of this step: a sequence that still shares the source may write into it.
            src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*scheduler_output.block_copies))
            self.kv_pool[:, :, dst] = self.kv_pool[:, :, src]
            if self.drafter is not None:
                self.drafter.copy_blocks(src, dst)
        for new in scheduler_output.new_requests:
            self.input_batch.add_request(new)
        for cached in scheduler_output.cached_requests:
            self.input_batch.update_request(cached)
        if self.drafter is not None:
            self.drafter.apply(scheduler_output)

    # ---- one step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._apply(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        batch = self.input_batch
        request_ids = list(scheduler_output.num_scheduled_tokens)
        rows = np.fromiter((batch.row_of[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
        num_scheduled = np.fromiter(
            scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(request_ids)
        )
        # Decodes (one query token) first: they share one attention call without query padding. Then the rows
        # that verify drafts, whose tokens attend as decodes do (prepare_inputs), then prefill chunks.
        chunk = num_scheduled > 1
        verifying = np.zeros_like(chunk)
        if scheduler_output.spec_token_ids:
            verifying = chunk & np.fromiter((r in scheduler_output.spec_token_ids for r in request_ids), dtype=bool,
                                            count=len(request_ids))
        order = np.argsort(chunk.astype(np.int64) + (chunk & ~verifying), kind="stable")
        rows, num_scheduled = rows[order], num_scheduled[order]

        spec = prepare_spec_step(batch, rows, num_scheduled, scheduler_output.spec_token_ids) \
            if scheduler_output.spec_token_ids else None
        if self.drafter is not None:
            # Fills the drafts (placeholders until now) before the target's inputs read them.
            self.drafter.propose(batch, rows, num_scheduled, spec)
        inputs = prepare_inputs(batch, rows, num_scheduled, self.block_size, self.device,
                                int(np.count_nonzero(verifying)))
        if spec is not None:
            inputs.logits_index = extend_logits_index(inputs.logits_index, spec)
        if self.lora is not None:
            self.lora.prepare_step(np.repeat(batch.lora_slots[rows], num_scheduled))
        num_samples = int(inputs.fanout.sum())
        # Built (and sent to the device) before the forward is queued: building it after would make each
        # host-to-device copy wait for the forward, and the GPU would idle while the sampler is launched.
        sampling = self.sampling_batches.for_step(rows, inputs) if num_samples and self.samples else None
        hidden = self.run_model(inputs)
        output = ModelRunnerOutput()
        # The drafts' verification rows come last in logits_index (extend_logits_index).
        num_plain = len(inputs.logits_index) - (spec.num_logits if spec is not None else 0)
        if num_plain:
            self._consume_logits(hidden[inputs.logits_index[:num_plain]], num_samples, rows, inputs, sampling, output)
        batch.num_computed[rows] += num_scheduled
        if spec is not None:
            spec_logits = logits_in_chunks(self.model.compute_logits, hidden[inputs.logits_index[num_plain:]],
                                           self.logits_rows_per_chunk)
            verify(spec_logits, spec, batch, self.sampling_batches, self.sampler, output, self.block_size)
            if not self.samples:
                self._unsettled_spec = spec
            if self.drafter is not None and self.drafter.reads_kept_tokens and self.model.group.size > 1:
                self._settle_spec_now(output)
        if self.drafter is not None:
            # An MTP or EAGLE head reads the target's hidden states of the tokens just kept.
            self.drafter.after_step(batch, hidden)
        return output

    def _consume_logits(self, hidden: torch.Tensor, num_samples: int, rows: np.ndarray, inputs: StepInputs,
                        sampling: SamplingBatch | None, output: ModelRunnerOutput) -> None:
        """Samples, then prompt scores, from the logits of `hidden`'s rows, computed a chunk at a time."""
        scorer = PromptScorer(self.input_batch, rows, inputs, output) \
            if inputs.prompt_logprob_positions and self.samples else None
        result = self.sampler.new_output(sampling, hidden.device) if sampling is not None else None
        for first, logits in model_logits_in_chunks(self.model, hidden, self.logits_rows_per_chunk):
            if logits is None:
                continue  # a tensor-parallel rank other than 0: rank 0 samples, and sends its tokens next step
            sampled = logits[: max(0, num_samples - first)]
            if len(sampled):
                self.sampler.sample_into(sampled, sampling, first, result)
            if scorer is not None and first + len(logits) > num_samples:
                scorer.add(max(0, first - num_samples), logits[len(sampled):])
        if result is not None:
            self._emit_samples(result, rows, inputs, sampling, output)

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs.attention):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.attention)
        meta = self.attn_backend.build_metadata(inputs.attention)
        return self.model(self._to_device(inputs.input_ids), self._to_device(inputs.positions), self.kv_caches, meta)

    def _emit_samples(self, result: SamplerOutput, rows: np.ndarray, inputs: StepInputs, sampling: SamplingBatch,
                      output: ModelRunnerOutput) -> None:
        batch = self.input_batch
        sample_rows = rows[inputs.sample_positions]
        tokens = result.token_ids.tolist()  # the step's one wait on the device
        if batch.plain_greedy[sample_rows].all():
            # One token per row, no log-probabilities, each appended: the whole batch at once.
            output.sampled_token_ids.update(zip(batch.row_request_ids[sample_rows].tolist(), tokens))
            batch.token_ids[sample_rows, batch.num_tokens[sample_rows]] = tokens
            batch.num_tokens[sample_rows] += 1
            return
        offset = 0
        appending = []
        for row, fanout in zip(sample_rows.tolist(), inputs.fanout.tolist()):
            state = batch.rows[row]
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
                    token_logprobs(result, i, state.num_logprobs) for i in range(offset, offset + fanout)
                ]
            if state.appends_sampled_tokens:
                appending.append((row, tokens[offset]))
            offset += fanout
        batch.append_tokens(appending)

    def append_sampled_tokens(self, sampled_token_ids: dict[str, int],
                              accepted_draft_ids: dict[str, list[int]]) -> None:
        """On a tensor-parallel rank that does not sample: the tokens rank 0 sampled last step, and the drafts it
        accepted after them (its verified rows keep exactly what rank 0's kept)."""
        batch = self.input_batch
        verified = self._settle_verified(sampled_token_ids, accepted_draft_ids) | self._settled_rows
        self._settled_rows = set()
        batch.append_tokens([(batch.row_of[request_id], token) for request_id, token in sampled_token_ids.items()
                             if request_id in batch.row_of and batch.row_of[request_id] not in verified
                             and batch.rows[batch.row_of[request_id]].appends_sampled_tokens])

    def _settle_verified(self, sampled_token_ids: dict[str, int],
                         accepted_draft_ids: dict[str, list[int]]) -> set[int]:
        """On a rank that does not sample: the last verifying step's rows keep what rank 0 kept; returns them."""
        if self._unsettled_spec is None:
            return set()
        spec, self._unsettled_spec = self._unsettled_spec, None
        batch = self.input_batch
        verified = set(spec.rows.tolist())
        ids = batch.row_request_ids
        taken = {row: [sampled_token_ids[ids[row]], *accepted_draft_ids.get(ids[row], [])]
                 for row in verified if ids[row] in sampled_token_ids}
        keep_taken(batch, spec, taken, self.block_size)
        return verified

    def _settle_spec_now(self, output: ModelRunnerOutput) -> None:
        """Under tensor parallelism, for a head whose after_step reads the tokens kept in this very step: rank 0's
        verification reaches the other ranks now, not with the next step's broadcast, so that every rank's head
        catches up over the same positions (its collectives keep the ranks in lockstep)."""
        group = self.model.group
        if self.samples:
            group.broadcast_object((output.sampled_token_ids, output.spec_token_ids))
            return
        sampled_token_ids, accepted_draft_ids = group.broadcast_object()
        self._settled_rows = self._settle_verified(sampled_token_ids, accepted_draft_ids)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
