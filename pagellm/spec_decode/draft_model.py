"""The "draft_model" method: a smaller model with the target's vocabulary proposes each speculating request's k
drafts, greedily, in k batched decode steps over its own paged cache, before the target's verifying forward.

The draft's KV cache is a second pool tensor, of the draft's layers, indexed by the SAME block ids as the target's
(vLLM v1's layout): a block holds a token's target K/V and its draft K/V, the scheduler's block tables, prefix
cache, copy-on-write and rollback serve both, and start-up sizes the blocks for target + draft layers together.

Which tokens the draft's cache holds, per request (`computed`, kept by request id):
- in a step where it runs, the draft first catches up every eligible row of the step over the tokens the target
  has or is computing now (its prompt chunk; its last token; after a fully accepted draft, the last draft and the
  bonus token), so a prompt enters the draft's cache in the same chunks as the target's; then the rows that
  speculate decode k - 1 more tokens, writing the drafts' K/V in the slots the target's verification uses;
- after a rejection the draft's tokens past the target's kept ones are recomputed next time (its `computed` is
  clamped to the target's), their stale K/V overwritten in place;
- a step with no speculating row runs the draft over its prompt chunks only (every request backing off), or not
  at all (a batch above disable_by_batch_size: a full batch would pay the draft's prefill for drafts it never
  gets); the rows left behind catch up when they next speculate, in forwards of at most the step's token budget
  each, so the draft never exceeds the activation peak start-up profiled;
- a request admitted on a prefix-cache hit trusts the cached blocks' draft K/V: it is there whenever the request
  that computed them was eligible to speculate. (Where it was not - n > 1, beam search, structured outputs, or
  steps the draft skipped - stale draft K/V only lowers the acceptance: verification stays exact.)

The drafts are point masses (greedy argmax of the draft), so verify.py's acceptance is exact rejection sampling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import StepAttentionInputs
from pagellm.attention.kv_spec import GiB, KVCacheSpec
from pagellm.attention.paged import to_device
from pagellm.core.scheduler import SchedulerOutput
from pagellm.distributed.parallel_state import SINGLE, TensorParallelGroup
from pagellm.spec_decode.verify import SpecStep
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.logits import logits_in_chunks

logger = logging.getLogger(__name__)


class DraftModelError(ValueError):
    """A draft model pagellm refuses for this target; the message names both models' values."""


# Draft checkpoints of vLLM's other model-based methods: their heads are no stand-alone causal LM.
_HEAD_MODEL_TYPES = ("medusa", "mlp_speculator", "deepseek_mtp", "eagle")


def check_draft_config(draft_config, target_config, draft_name: str) -> None:
    """Refuses, before the draft's weights load, a draft that cannot propose tokens the target can verify."""
    model_type = getattr(draft_config, "model_type", None)
    if model_type in _HEAD_MODEL_TYPES:
        raise DraftModelError(
            f"speculative_config.model={draft_name!r} is a {model_type} head, not a stand-alone model; pagellm's "
            "draft_model method needs a small causal LM with the target's tokenizer.")
    draft_vocab, target_vocab = draft_config.vocab_size, target_config.vocab_size
    if draft_vocab != target_vocab:
        raise DraftModelError(
            f"speculative_config.model={draft_name!r} has vocab_size={draft_vocab}, the target has "
            f"vocab_size={target_vocab}: a draft must use the target's tokenizer and vocabulary.")
    from pagellm.models.sliding_window import model_sliding_window

    for name, config in (("draft", draft_config), ("target", target_config)):
        window = model_sliding_window(config)
        if window is not None:
            raise DraftModelError(
                f"the {name} model has sliding_window={window}: the draft_model method catches up on tokens the "
                "window may have released; use models without a sliding window, or method ngram/suffix.")


def load_draft_runner(config, target_config, max_model_len: int, dtype: torch.dtype, device: torch.device,
                      block_size: int, input_batch: InputBatch, seed: int, cache_dtype: str, load_format: str,
                      download_dir: str | None, trust_remote_code: bool):
    """The draft model, loaded in the target's dtype on the target's device, in a ModelRunner of its own (its
    attention backend and LM head) that shares the target runner's input batch, and its KV spec. `config` is the
    validated SpeculativeConfig."""
    from pagellm.layers.quantization import check_source_quantization
    from pagellm.models import loader
    from pagellm.models.llama import head_dim_of
    from pagellm.attention.kv_spec import kv_cache_spec_for
    from pagellm.distributed.parallel_state import building_with
    from pagellm.worker.model_runner import ModelRunner

    name = config.model
    try:
        source = loader.resolve_model(name, config.revision, download_dir)
        check_source_quantization(source.is_gguf, config.quantization, None)
    except ValueError as error:
        raise DraftModelError(f"speculative_config.model: {error}") from None
    draft_config, gguf_state_dict = loader.load_hf_config(source, trust_remote_code)
    check_draft_config(draft_config, target_config, name)
    loader.check_architecture(draft_config)
    limit = getattr(draft_config, "max_position_embeddings", None) or max_model_len
    if limit < max_model_len:
        raise DraftModelError(
            f"speculative_config.model={name!r} has max_position_embeddings={limit}, less than the engine's "
            f"max_model_len={max_model_len}; lower max_model_len to at most {limit} or use a longer-context draft.")
    with building_with(SINGLE):
        model = loader.load_model(source, draft_config, gguf_state_dict, dtype, device, max_model_len, load_format,
                                  seed, config.quantization)
    del gguf_state_dict
    spec = kv_cache_spec_for(draft_config, model.num_kv_heads_per_rank, head_dim_of(draft_config), block_size, dtype,
                             cache_dtype)
    runner = ModelRunner(model, device, block_size, max_model_len, 1, seed, set(), spec.format)
    runner.input_batch = input_batch  # the rows' tokens and block tables are the target's
    return runner, spec


@dataclass(frozen=True)
class PairedKVSpec:
    """The pool as start-up sizes it: every block holds the target's and the draft's (a draft model's or an
    MTP / EAGLE head's) K/V of its tokens."""

    target: KVCacheSpec
    draft: KVCacheSpec

    @property
    def block_size(self) -> int:
        return self.target.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.target.bytes_per_block + self.draft.bytes_per_block

    @property
    def tokens_per_gib(self) -> float:
        return GiB / self.bytes_per_block * self.block_size

    def describe(self) -> str:
        return (f"{self.target.describe()} of the target's layers alone, {self.tokens_per_gib:,.0f} with the draft's "
                f"(bytes per block {self.bytes_per_block:,} = target {self.target.bytes_per_block:,} for "
                f"{self.target.num_layers} layers + draft {self.draft.bytes_per_block:,} for "
                f"{self.draft.num_layers} layers)")


@dataclass
class _Segment:
    """Tokens [start, end) of a row that one catch-up forward computes."""

    row: int
    start: int
    end: int
    proposes: bool  # the row speculates and this segment ends at its last token: its logits give draft 1


class PairedProposer:
    """What every proposer with a paged cache of its own keeps: `runner`, a ModelRunner over its model (attention
    backend, KV pool views, LM head) sharing the target runner's input batch, and per request how many leading
    positions its cache holds."""

    # Whether after_step reads the tokens the target's verification kept in the same step (a head does).
    reads_kept_tokens = False

    def __init__(self, runner, max_tokens_per_forward: int) -> None:
        self.runner = runner
        self.max_tokens_per_forward = max_tokens_per_forward
        # Request id -> tokens whose K/V are in this proposer's cache (positions [0, computed)).
        self.computed: dict[str, int] = {}
        self.num_forwards = 0

    @property
    def kv_pool(self) -> torch.Tensor:
        return self.runner.kv_pool

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """The scheduler's changes, after the target runner applied them to the input batch."""
        for request_id in scheduler_output.finished_request_ids:
            self.computed.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.computed[new.request_id] = new.num_computed_tokens

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        pool = self.runner.kv_pool
        pool[:, :, dst] = pool[:, :, src]

    @staticmethod
    def _write(batch: InputBatch, rows: list[int], tokens: list[int], index: int) -> None:
        """Draft `index` (0-based) of each row, into the token table after the row's tokens."""
        for row, token in zip(rows, tokens):
            batch.token_ids[row, batch.num_tokens[row] + index] = token

    def after_step(self, batch: InputBatch, hidden: torch.Tensor) -> None:
        """After the target's forward and verification: `hidden` is the target's output at every token of the
        step. A draft model reads none of it."""


class DraftProposer(PairedProposer):
    """Runs the draft model for the target's model runner: on rank 0 of a tensor-parallel group, which hands the
    drafts to the other ranks (their DraftRelay)."""

    def __init__(self, runner, max_tokens_per_forward: int, disable_by_batch_size: int,
                 group: TensorParallelGroup = SINGLE) -> None:
        super().__init__(runner, max_tokens_per_forward)
        # A step of more rows than this proposes nothing (the scheduler's rule, seen from the runner), and its
        # prompt chunks wait for the draft until their requests speculate.
        self.disable_by_batch_size = disable_by_batch_size
        self.group = group

    def propose(self, batch: InputBatch, rows: np.ndarray, num_scheduled: np.ndarray, spec: SpecStep | None) -> None:
        self._propose(batch, rows, num_scheduled, spec)
        share_drafts(self.group, batch, spec)

    @torch.inference_mode()
    def _propose(self, batch: InputBatch, rows: np.ndarray, num_scheduled: np.ndarray, spec: SpecStep | None) -> None:
        """rows / num_scheduled: the step's rows and the tokens the target computes for each (drafts included);
        spec: the rows that verify drafts and how many. Writes each spec row's drafts into its token table after
        its tokens, where verify.py reads them."""
        drafts_of = dict(zip(spec.rows.tolist(), spec.num_drafts.tolist())) if spec is not None else {}
        segments = self._catch_up_segments(batch, rows, num_scheduled, drafts_of)
        if not segments or (not drafts_of and len(rows) > self.disable_by_batch_size):
            return  # no speculation now, nor soon: the rows catch up when they next speculate
        proposing = []
        for chunk in _split(segments, self.max_tokens_per_forward):
            tokens = self._forward(batch, chunk)
            proposing += [s.row for s in chunk if s.proposes]
            self._write(batch, [s.row for s in chunk if s.proposes], tokens, 0)
        for segment in segments:
            request_id = batch.rows[segment.row].request_id
            self.computed[request_id] = segment.end
        # Draft j + 1 from draft j: one batched decode step per draft, over the rows that want that many.
        for j in range(1, max(drafts_of.values(), default=0)):
            step_rows = np.array([row for row in proposing if drafts_of[row] > j], dtype=np.int64)
            positions = batch.num_computed[step_rows] + j
            tokens = self._forward(batch, [_Segment(int(r), int(p), int(p) + 1, True)
                                           for r, p in zip(step_rows, positions)])
            self._write(batch, step_rows.tolist(), tokens, j)
            for row, position in zip(step_rows.tolist(), positions.tolist()):
                self.computed[batch.rows[row].request_id] = position + 1

    def _catch_up_segments(self, batch: InputBatch, rows: np.ndarray, num_scheduled: np.ndarray,
                           drafts_of: dict[int, int]) -> list[_Segment]:
        """Per eligible row of the step: the tokens the target has or computes now that the draft lacks."""
        segments = []
        for row, scheduled in zip(rows.tolist(), num_scheduled.tolist()):
            state = batch.rows[row]
            computed = int(batch.num_computed[row])
            # Before the target computes past them: the draft's K/V beyond the target's kept tokens is that of
            # rejected drafts, to be recomputed whenever the draft next runs, even many steps later.
            if self.computed.get(state.request_id, 0) > computed:
                self.computed[state.request_id] = computed
            # Without drafts to propose, only prompt chunks are worth a draft forward (see the module's note).
            if not drafts_eligible(state) or (not drafts_of and batch.num_computed[row] >= state.num_prompt_tokens):
                continue
            end = computed + scheduled - drafts_of.get(row, 0)
            start = self.computed.get(state.request_id, computed)
            if start < end:
                segments.append(_Segment(row, start, end, row in drafts_of))
            elif row in drafts_of:
                raise RuntimeError(f"request {state.request_id} speculates with nothing for the draft to read")
        return segments

    def _forward(self, batch: InputBatch, segments: list[_Segment]) -> list[int]:
        """One draft forward over the segments; the greedy token after each proposing segment."""
        runner = self.runner
        block_size = runner.block_size
        lengths = np.array([s.end - s.start for s in segments], dtype=np.int64)
        token_rows = np.repeat(np.array([s.row for s in segments], dtype=np.int64), lengths)
        positions = np.concatenate([np.arange(s.start, s.end) for s in segments])
        input_ids = batch.token_ids[token_rows, positions]
        slot_mapping = batch.block_table[token_rows, positions // block_size] * block_size + positions % block_size
        seq_lens = np.array([s.end for s in segments], dtype=np.int64)
        seq_rows = np.array([s.row for s in segments], dtype=np.int64)
        num_decodes = int(np.count_nonzero(lengths == 1))
        max_blocks = -(-int(seq_lens.max()) // block_size)
        attention = StepAttentionInputs(num_decodes, lengths, seq_lens, batch.block_table[seq_rows, :max_blocks],
                                        slot_mapping)
        device = runner.device
        meta = runner.attn_backend.build_metadata(attention)
        hidden = runner.model(to_device(input_ids, device), to_device(positions, device), runner.kv_caches, meta)
        self.num_forwards += 1
        last = np.cumsum(lengths)[[i for i, s in enumerate(segments) if s.proposes]] - 1
        if len(last) == 0:
            return []
        # A chunk of rows at a time, as every logits row of the target (worker/logits.py): the peak start-up sized.
        tokens: list[int] = []
        for _, logits in logits_in_chunks(runner.model.compute_logits, hidden[to_device(last, device)],
                                          runner.logits_rows_per_chunk):
            tokens += logits.argmax(dim=-1).tolist()
        return tokens

class DraftRelay:
    """The drafter of a tensor-parallel rank other than 0 under the draft_model method. The draft model runs
    unsharded on rank 0 alone (vLLM's draft_tensor_parallel_size=1): a small draft gains nothing from sharding but
    collectives, and only rank 0 samples. This rank holds no draft weights or draft K/V; it takes rank 0's drafts
    into its token table before the target's forward, so that every rank verifies the same tokens."""

    reads_kept_tokens = False

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        pass

    def propose(self, batch: InputBatch, rows: np.ndarray, num_scheduled: np.ndarray, spec: SpecStep | None) -> None:
        share_drafts(self.group, batch, spec)

    def after_step(self, batch: InputBatch, hidden: torch.Tensor) -> None:
        pass


def share_drafts(group: TensorParallelGroup, batch: InputBatch, spec: SpecStep | None) -> None:
    """Rank 0's drafts of the step's verifying rows, from its token table into every other rank's. Each rank
    knows the rows and their draft counts from the schedule, so only the tokens travel."""
    if group.size == 1 or spec is None or not len(spec.rows):
        return
    counts = spec.num_drafts.astype(np.int64)
    token_rows = np.repeat(spec.rows, counts)
    index_in_row = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    columns = batch.num_tokens[token_rows] + index_in_row
    drafts = np.ascontiguousarray(batch.token_ids[token_rows, columns], dtype=np.int64)
    group.broadcast_tensor(torch.from_numpy(drafts))  # in place: `drafts` holds rank 0's tokens after it
    if group.rank != 0:
        batch.token_ids[token_rows, columns] = drafts


def drafts_eligible(state) -> bool:
    """The rows that may ever speculate (Speculator.eligible's conditions, as the runner sees a row): only their
    tokens enter the draft's cache."""
    params = state.params
    return state.appends_sampled_tokens and params.num_sequences == 1 and params.structured_outputs is None


def _split(segments: list[_Segment], max_tokens: int) -> list[list[_Segment]]:
    """The segments in forwards of at most max_tokens tokens; a longer segment is split like a chunked prefill
    (its later part goes in a later forward, so it reads the earlier part's K/V from the cache)."""
    chunks: list[list[_Segment]] = []
    current: list[_Segment] = []
    room = max_tokens
    for segment in segments:
        start = segment.start
        while start < segment.end:
            take = min(segment.end - start, room)
            last = start + take == segment.end
            current.append(_Segment(segment.row, start, start + take, segment.proposes and last))
            start += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], max_tokens
    if current:
        chunks.append(current)
    # Decodes (one query token) first in each forward, as the attention backends take them.
    return [sorted(chunk, key=lambda s: s.end - s.start > 1) for chunk in chunks]
