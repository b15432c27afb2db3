"""Methods "mtp" and "eagle": a head (mtp.py, eagle.py) drafts from the target's hidden states. At position i it
reads the target's hidden state h_i and the token at i + 1, and its output gives the token at i + 2 and stands
in for h_{i+1} at the next draft. Its K/V lives in the paired pool as a draft model's does (draft_model.py:
same block ids, one more plane of layers per block), written by these forwards:

- after each target step (after_step), every eligible row of the step catches the head's cache up over the
  positions the target just computed and kept, but the last: the token after the last one is unknown until the
  next step samples it, or, after a prompt chunk, known but its hidden state is kept back all the same, so that
  every row ends a step alike. That last position's hidden state is kept per request (`pending`), and the next
  catch-up starts with it: a prompt enters the head's cache in the target's chunks, a step behind by one token.
- before the target's verifying forward (propose), a speculating row of n computed tokens runs the head at
  position n - 1 (the pending hidden state, its last token) for draft 1, then at n, n + 1, ... on the head's
  own output for the next drafts: k batched decode forwards. Their K/V past n - 1 is the drafts', in slots the
  target's verification uses; after_step overwrites the accepted ones with the target's hidden states, and a
  rejection leaves the rest past the kept tokens, where nothing reads it.
- a request admitted on a prefix-cache hit trusts the head's K/V in the cached blocks (there whenever the request
  that computed them was eligible to speculate); positions whose target hidden state is gone (the hit's last
  one) keep what the block holds. As with a draft model, stale head K/V only lowers the acceptance.

Unlike a draft model, the head catches up in every step, whether or not anyone speculates: the hidden states it
needs exist only during their step. It is one decoder layer beside the target's num_hidden_layers.
The drafts are greedy (point masses), so verify.py's acceptance is exact rejection sampling.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import StepAttentionInputs
from pagellm.attention.kv_spec import kv_cache_spec_for
from pagellm.attention.paged import to_device
from pagellm.core.scheduler import SchedulerOutput
from pagellm.distributed.parallel_state import SINGLE, TensorParallelGroup
from pagellm.models.deepseek_v2 import mtp_layer_index
from pagellm.spec_decode.draft_model import PairedProposer, _Segment, _split, drafts_eligible
from pagellm.spec_decode.eagle import EagleHead, check_eagle_config, eagle_tensors
from pagellm.spec_decode.mtp import HeadError, MTPHead, check_mtp_target, mtp_tensor_names, mtp_tensors
from pagellm.spec_decode.verify import SpecStep
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.logits import logits_in_chunks



@dataclass
class _Pending:
    """A request's last computed position, whose target hidden state the head has not read yet."""

    position: int
    hidden: torch.Tensor  # [hidden_size]


@dataclass
class _StepLayout:
    """The target's step as its hidden states lie: rows in order, their token counts and first positions."""

    rows: np.ndarray
    num_scheduled: np.ndarray
    starts: np.ndarray


class HeadProposer(PairedProposer):
    """Runs an MTP or EAGLE head for the target's model runner; `runner` is a ModelRunner over the head."""

    reads_kept_tokens = True

    def __init__(self, runner, max_tokens_per_forward: int, group: TensorParallelGroup = SINGLE) -> None:
        super().__init__(runner, max_tokens_per_forward)
        # Under tensor parallelism every rank runs its shard of the head (over its shard of the target's embedding
        # and LM head) in lockstep; rank 0 alone has the logits, and hands each draft's tokens to the others.
        self.group = group
        self.pending: dict[str, _Pending] = {}
        self._layout: _StepLayout | None = None

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        super().apply(scheduler_output)
        for request_id in scheduler_output.finished_request_ids:
            self.pending.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.pending.pop(new.request_id, None)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray, num_scheduled: np.ndarray, spec: SpecStep | None) -> None:
        """Writes each spec row's drafts into its token table after its tokens, where verify.py reads them; notes
        the step's layout for after_step."""
        self._layout = _StepLayout(rows.copy(), num_scheduled.copy(), batch.num_computed[rows].copy())
        for row in rows.tolist():
            request_id, computed = batch.rows[row].request_id, int(batch.num_computed[row])
            # The head's K/V past the target's kept tokens is that of rejected drafts.
            if self.computed.get(request_id, 0) > computed:
                self.computed[request_id] = computed
            pending = self.pending.get(request_id)
            if pending is not None and pending.position >= computed:
                del self.pending[request_id]
        if spec is None or not len(spec.rows):
            return
        spec_rows, num_drafts = spec.rows, spec.num_drafts
        computed = batch.num_computed[spec_rows].astype(np.int64)
        hidden = torch.stack([self._pending_before(batch, row, n) for row, n in zip(spec_rows, computed)])
        tokens = batch.token_ids[spec_rows, computed]
        positions = computed - 1
        active = np.arange(len(spec_rows))
        for index in range(int(num_drafts.max())):
            out = self._forward(batch, [_Segment(int(spec_rows[i]), int(p), int(p) + 1, True)
                                        for i, p in zip(active, positions)], tokens, hidden)
            drafts = self._greedy(out)
            self._write(batch, spec_rows[active].tolist(), drafts, index)
            more = num_drafts[active] > index + 1
            active, positions = active[more], positions[more] + 1
            tokens = np.asarray(drafts, dtype=np.int64)[more]
            hidden = out[to_device(np.flatnonzero(more), out.device)]
        for row, n in zip(spec_rows.tolist(), computed.tolist()):
            request_id = batch.rows[row].request_id
            self.computed[request_id] = n
            del self.pending[request_id]

    def _pending_before(self, batch: InputBatch, row: int, computed: int) -> torch.Tensor:
        request_id = batch.rows[row].request_id
        pending = self.pending.get(request_id)
        if pending is None or pending.position != computed - 1:
            raise RuntimeError(f"request {request_id} speculates at {computed} tokens without the target's hidden "
                               f"state at position {computed - 1} (pending: {pending and pending.position})")
        return pending.hidden

    @torch.inference_mode()
    def after_step(self, batch: InputBatch, hidden: torch.Tensor) -> None:
        """Catches each eligible row of the step up over the positions the target kept, but the last, whose hidden
        state becomes the row's pending one (the module's note)."""
        layout, self._layout = self._layout, None
        if layout is None:
            return
        offsets = np.cumsum(layout.num_scheduled) - layout.num_scheduled
        segments: list[_Segment] = []
        sources: dict[int, tuple[int, torch.Tensor]] = {}  # row -> (first position, hidden states from there)
        kept: list[tuple[str, int, int]] = []  # (request id, last kept position, its index in `hidden`)
        for row, start, offset in zip(layout.rows.tolist(), layout.starts.tolist(), offsets.tolist()):
            state = batch.rows[row]
            if not drafts_eligible(state):
                continue
            request_id, end = state.request_id, int(batch.num_computed[row]) - 1
            pending = self.pending.get(request_id)
            source = hidden[offset: offset + end - start]
            first = start
            if pending is not None and pending.position == start - 1:
                first, source = start - 1, torch.cat([pending.hidden[None], source])
            begin = max(self.computed.get(request_id, start), first)
            if begin < end:
                segments.append(_Segment(row, begin, end, False))
                sources[row] = (first, source)
            self.computed[request_id] = end
            kept.append((request_id, end, offset + end - start))
        for chunk in _split(segments, self.max_tokens_per_forward):
            tokens = np.concatenate([batch.token_ids[s.row, s.start + 1: s.end + 1] for s in chunk])
            states = torch.cat([sources[s.row][1][s.start - sources[s.row][0]: s.end - sources[s.row][0]]
                                for s in chunk])
            self._forward(batch, chunk, tokens, states)
        if kept:
            last = hidden[to_device(np.array([index for _, _, index in kept], dtype=np.int64), hidden.device)]
            for (request_id, position, _), state in zip(kept, last):
                self.pending[request_id] = _Pending(position, state)

    def _forward(self, batch: InputBatch, segments: list[_Segment], input_ids: np.ndarray,
                 hidden: torch.Tensor) -> torch.Tensor:
        """One head forward over the segments (decodes first), with the token and the hidden state at each of
        their positions; the head's output at every position."""
        runner = self.runner
        block_size = runner.block_size
        lengths = np.array([s.end - s.start for s in segments], dtype=np.int64)
        token_rows = np.repeat(np.array([s.row for s in segments], dtype=np.int64), lengths)
        positions = np.concatenate([np.arange(s.start, s.end) for s in segments])
        slot_mapping = batch.block_table[token_rows, positions // block_size] * block_size + positions % block_size
        seq_lens = np.array([s.end for s in segments], dtype=np.int64)
        seq_rows = np.array([s.row for s in segments], dtype=np.int64)
        max_blocks = -(-int(seq_lens.max()) // block_size)
        attention = StepAttentionInputs(int(np.count_nonzero(lengths == 1)), lengths, seq_lens,
                                        batch.block_table[seq_rows, :max_blocks], slot_mapping)
        meta = runner.attn_backend.build_metadata(attention)
        device = runner.device
        self.num_forwards += 1
        return runner.model(to_device(np.ascontiguousarray(input_ids, dtype=np.int64), device),
                            to_device(positions, device), runner.kv_caches, meta, hidden_states=hidden)

    def _greedy(self, out: torch.Tensor) -> list[int]:
        tokens: list[int] = []
        for _, logits in logits_in_chunks(self.runner.model.compute_logits, out, self.runner.logits_rows_per_chunk):
            if logits is not None:  # None on a tensor-parallel rank other than 0
                tokens += logits.argmax(dim=-1).tolist()
        if self.group.size == 1:
            return tokens
        shared = torch.tensor(tokens, dtype=torch.int64) if self.group.rank == 0 else \
            torch.empty(len(out), dtype=torch.int64)
        return self.group.broadcast_tensor(shared).tolist()


# ---- loading ---------------------------------------------------------------------------------------------------

def load_head_runner(config, target, source, target_config, max_model_len: int, dtype: torch.dtype,
                     device: torch.device, block_size: int, input_batch: InputBatch, seed: int, cache_dtype: str,
                     load_format: str, download_dir: str | None, trust_remote_code: bool,
                     group: TensorParallelGroup = SINGLE):
    """The head of `config` (a validated SpeculativeConfig with method mtp or eagle) over the loaded `target`
    model (from `source`), in a ModelRunner of its own sharing the target runner's input batch, and its KV spec.
    Its layers shard over `group` as the target's do."""
    from pagellm.layers.weights import process_weights_after_loading
    from pagellm.models.loader import initialize_dummy_weights
    from pagellm.worker.model_runner import ModelRunner

    from pagellm.models.sliding_window import model_sliding_window

    window = model_sliding_window(target_config)
    if window is not None:
        raise HeadError(f"speculative_config method {config.method!r}: the target has sliding_window={window}, "
                        "whose released blocks the head's cache would still read; use method ngram or suffix.")
    dummy = load_format == "dummy"
    if config.method == "mtp":
        head, tensors = _mtp_head(target, source, target_config, dtype, device, dummy, group)
    else:
        head, tensors = _eagle_head(config, target, target_config, max_model_len, dtype, device, dummy,
                                    download_dir, trust_remote_code, group)
    if dummy:
        initialize_dummy_weights(head, seed)
    else:
        try:
            head.load_weights(tensors)
        except ValueError as error:
            raise HeadError(f"speculative_config method {config.method!r}: {error}") from None
    process_weights_after_loading(head)
    head.eval()
    spec = kv_cache_spec_for(head.config, head.num_kv_heads_per_rank, head.head_dim, block_size, dtype, cache_dtype)
    spec = dataclasses.replace(spec, num_layers=head.num_cache_layers)
    runner = ModelRunner(head, device, block_size, max_model_len, 1, seed, set(), spec.format)
    runner.input_batch = input_batch  # the rows' tokens and block tables are the target's
    return runner, spec


def _mtp_head(target, source, target_config, dtype: torch.dtype, device: torch.device, dummy: bool,
              group: TensorParallelGroup) -> tuple[MTPHead, Iterator[tuple[str, torch.Tensor]]]:
    check_mtp_target(target_config, source.name)
    files = [] if dummy else _safetensors_of(source, "the target", "mtp")
    num_layers = target_config.num_hidden_layers
    layer_tensors = {name for name in _tensor_names(files) if mtp_layer_index(name, num_layers) == 0}
    names = mtp_tensor_names(layer_tensors, num_layers)
    if files and not names:
        raise HeadError(f"speculative_config method 'mtp': model {source.name!r} has num_nextn_predict_layers="
                        f"{target_config.num_nextn_predict_layers} but its checkpoint holds no tensor of that layer "
                        f"(model.layers.{num_layers}.*); use a checkpoint that keeps it, or another method.")
    with _building(device, dtype, group):
        head = MTPHead(target_config, target, target.quant_config, "embed_tokens.weight" in names,
                       "shared_head.head.weight" in names)
    return head, mtp_tensors(_read(files, layer_tensors), num_layers)


def _eagle_head(config, target, target_config, max_model_len: int, dtype: torch.dtype, device: torch.device,
                dummy: bool, download_dir: str | None, trust_remote_code: bool,
                group: TensorParallelGroup) -> tuple[EagleHead, Iterator[tuple[str, torch.Tensor]]]:
    from pagellm.layers.quantization import quantization_config_for
    from pagellm.layers.rotary import RotaryEmbedding
    from pagellm.models import loader

    try:
        source = loader.resolve_model(config.model, config.revision, download_dir)
    except ValueError as error:
        raise HeadError(f"speculative_config.model: {error}") from None
    head_config, gguf = loader.load_hf_config(source, trust_remote_code)
    if gguf is not None:
        raise HeadError(f"speculative_config.model={config.model!r} is a GGUF file; method 'eagle' reads an EAGLE "
                        "head's HuggingFace directory (safetensors).")
    check_eagle_config(head_config, target_config, config.model)
    files = [] if dummy else _safetensors_of(source, "the EAGLE head", "eagle")
    fc_bias = any(name.removeprefix("model.") == "fc.bias" for name in _tensor_names(files))
    with _building(device, dtype, group):
        head = EagleHead(head_config, target, max_model_len, quantization_config_for(head_config, config.quantization),
                         fc_bias)
    head.rotary.reset_cache(device)
    return head, eagle_tensors(_read(files))


@contextlib.contextmanager
def _building(device: torch.device, dtype: torch.dtype, group: TensorParallelGroup) -> Iterator[None]:
    """As the loader builds a model: parameters made on the device in `dtype`, sharded over `group`."""
    from pagellm.distributed.parallel_state import building_with
    from pagellm.models.loader import default_dtype

    with torch.device(device), default_dtype(dtype), building_with(group):
        yield


def _safetensors_of(source, what: str, method: str) -> list[str]:
    from pagellm.models.loader import checkpoint_files

    if source.is_gguf:
        raise HeadError(f"speculative_config method {method!r}: {what} is a GGUF file ({source.path}), which keeps "
                        "no head; use its HuggingFace checkpoint (safetensors).")
    files = checkpoint_files(source.path)
    if not files:
        raise HeadError(f"speculative_config method {method!r}: {what} ({source.path}) has no *.safetensors "
                        "files; the head is read from safetensors.")
    return files


def _tensor_names(files: list[str]) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names += list(f.keys())
    return names


def _read(files: list[str], wanted: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors named in `wanted` (all without it), read one at a time: the rest of the checkpoint is not
    read."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if wanted is None or name in wanted:
                    yield name, f.get_tensor(name)
