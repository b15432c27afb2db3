"""The runner's copy of each running sequence: its tokens, block table and sampling settings, one row each.

Rows live in preallocated numpy arrays, updated from the scheduler's deltas, so that a step's inputs are
built by bulk indexing rather than per-token Python.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from pagellm.core.scheduler import CachedRequestData, NewRequestData
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.matcher import SequenceGrammar


@dataclass
class RowState:
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


class InputBatch:
    """Rows are sized for max_num_seqs at first; forks (n > 1, beam search) may briefly need more."""

    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks: int) -> None:
        self.max_model_len = max_model_len
        self.max_blocks = max_blocks
        self.token_ids = lazily_zeroed(0, max_model_len)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.num_computed = np.zeros(0, dtype=np.int64)
        self.block_table = lazily_zeroed(0, max_blocks)
        self.num_blocks = np.zeros(0, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.rows: dict[int, RowState] = {}
        # Per row, in arrays so that a step reads them for the whole batch at once (see RowState).
        self.num_prompt_tokens = np.zeros(0, dtype=np.int64)
        self.num_samples_at_first = np.zeros(0, dtype=np.int64)
        self.plain_greedy = np.zeros(0, dtype=bool)
        self.row_request_ids = np.zeros(0, dtype=object)
        # The device slot of each row's LoRA adapter (-1: the base model).
        self.lora_slots = np.zeros(0, dtype=np.int64)
        # Rows whose requests asked for prompt_logprobs: the only ones a step must look at for them.
        self.prompt_scoring_rows: set[int] = set()
        self.free_rows: list[int] = []
        self.grow(max_num_seqs)

    @property
    def num_rows(self) -> int:
        return len(self.num_tokens)

    def grow(self, extra: int) -> None:
        old = len(self.num_tokens)
        self.token_ids = _grown(self.token_ids, extra, int(self.num_tokens.max(initial=0)))
        self.block_table = _grown(self.block_table, extra, int(self.num_blocks.max(initial=0)))
        for name in ("num_tokens", "num_computed", "num_blocks", "num_prompt_tokens", "num_samples_at_first"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, np.int64)]))
        self.plain_greedy = np.concatenate([self.plain_greedy, np.zeros(extra, bool)])
        self.row_request_ids = np.concatenate([self.row_request_ids, np.zeros(extra, object)])
        self.lora_slots = np.concatenate([self.lora_slots, np.full(extra, -1, np.int64)])
        self.free_rows.extend(range(old + extra - 1, old - 1, -1))

    def add_request(self, new: NewRequestData) -> None:
        if not self.free_rows:
            self.grow(max(8, len(self.num_tokens)))
        row = self.free_rows.pop()
        self.row_of[new.request_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        params = new.sampling_params
        stop_ids = sorted(params.all_stop_token_ids) if params.min_tokens else []
        grammar = SequenceGrammar(params.structured_grammar) if params.structured_grammar is not None else None
        state = self.rows[row] = RowState(new.request_id, params, new.num_prompt_tokens, new.sample_index,
                                          new.num_samples_at_first, new.appends_sampled_tokens, stop_ids, grammar)
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_samples_at_first[row] = new.num_samples_at_first
        self.plain_greedy[row] = state.is_plain_greedy
        self.row_request_ids[row] = new.request_id
        self.lora_slots[row] = new.lora_slot
        if params.prompt_logprobs is not None:
            self.prompt_scoring_rows.add(row)

    def remove_request(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            del self.rows[row]
            self.plain_greedy[row] = False
            self.prompt_scoring_rows.discard(row)
            self.free_rows.append(row)

    def update_request(self, cached: CachedRequestData) -> None:
        """A running request's new blocks, blocks replaced by copy-on-write, and tokens sampled elsewhere."""
        row = self.row_of[cached.request_id]
        for index, block_id in cached.replaced_blocks:
            self.block_table[row, index] = block_id
        self.append_blocks(row, cached.new_block_ids)
        for token_id in cached.new_token_ids:
            self.token_ids[row, self.num_tokens[row]] = token_id
            self.num_tokens[row] += 1

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = self.num_blocks[row]
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, appending: list[tuple[int, int]]) -> None:
        """(row, token) pairs: one sampled token appended to each row."""
        if appending:
            append_rows, append_tokens = (np.array(x, dtype=np.int64) for x in zip(*appending))
            self.token_ids[append_rows, self.num_tokens[append_rows]] = append_tokens
            self.num_tokens[append_rows] += 1


def lazily_zeroed(rows: int, width: int) -> np.ndarray:
    """An int64 [rows, width] array of zeros whose memory is taken a 4 KiB page at a time, as it is first written.
    A table sized for max_num_seqs sequences of max_model_len tokens (256 x 32,768 int64: 64 MiB) is mostly never
    written; np.zeros of that size would come on huge pages (numpy advises them), so that one token in a row
    would make its whole 2 MiB resident."""
    nbytes = rows * width * 8
    if nbytes == 0:
        return np.zeros((rows, width), dtype=np.int64)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, dtype=np.int64).reshape(rows, width)


def _grown(table: np.ndarray, extra: int, used_columns: int) -> np.ndarray:
    """`table` with `extra` more rows; only the columns any row uses are copied, so unwritten pages stay so."""
    rows, width = table.shape
    grown = lazily_zeroed(rows + extra, width)
    grown[:rows, :used_columns] = table[:, :used_columns]
    return grown
