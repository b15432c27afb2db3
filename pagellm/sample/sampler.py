"""Turn the logits of the sampling positions into tokens, for the whole batch at once.

Order, as vLLM applies it: log-probabilities are taken from the raw logits; then allowed-token
masks, banned tokens (bad words, stop tokens before min_tokens) and logit bias; then presence,
frequency and repetition penalties; then temperature, min-p, top-k and top-p; then the draw.

The batch is worked through in chunks of rows whose rows x vocab is bounded (Sampler.rows_per_chunk),
in buffers of one chunk's size, each allocated at its first use (_Workspace): the sorted copies,
probabilities, sums and masks of the filters take the same memory whatever the batch and the vocabulary.
Every row's result depends on its own logits and settings alone, and the batch's random numbers (one a row) are
drawn chunk after chunk from the one generator (on the CPU the same stream as one draw for the whole
batch), so chunking changes no token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pagellm.ops.largest import largest_per_row
from pagellm.structured_output.matcher import apply_token_bitmask

# How many of each row's largest logits the CPU's top-k/top-p filters try, in turn, before they sort whole rows
# (_apply_top_k_top_p).
_CANDIDATE_COUNTS = (256, 4096)

# Mixes a request's seed with the index of the token it samples, so a seeded request's k-th token
# depends on (seed, k, logits) alone: not on what else is in the batch, nor on preemption.
_SEED_STRIDE = 1_000_003

# Logits elements (rows x vocab) the sampler filters at once; its workspace takes up to 29 bytes an element
# (_Workspace: only the buffers a step's settings use), 14.5 MiB on the CPU, traded for some speed per chunk
# (README, "Memory", has both). On CUDA a larger chunk keeps the kernel launches of a large batch few.
CPU_CHUNK_ELEMENTS = 1 << 19
CUDA_CHUNK_ELEMENTS = 1 << 23


def chunk_elements(device: torch.device) -> int:
    return CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CPU_CHUNK_ELEMENTS


@dataclass
class TokenHistory:
    """The tokens of each sampling row so far, read from the runner's token table when a chunk needs them."""

    token_ids: np.ndarray  # [table rows, max_model_len] int64: the runner's table, not a copy
    rows: np.ndarray  # [S] the table row of each sampling row
    prompt_lens: np.ndarray  # [S]
    lengths: np.ndarray  # [S] tokens so far: the prompt, then the output

    def rows_slice(self, start: int, end: int) -> TokenHistory:
        return TokenHistory(self.token_ids, self.rows[start:end], self.prompt_lens[start:end],
                            self.lengths[start:end])

    def count_into(self, counts: torch.Tensor, seen: torch.Tensor) -> None:
        """counts [rows, V]: occurrences of each token in the output; seen [rows, V]: how often each token is
        in the prompt or the output (> 0 where seen)."""
        width = int(self.lengths.max())
        columns = np.arange(width)
        valid = columns[None, :] < self.lengths[:, None]
        in_output = (columns[None, :] >= self.prompt_lens[:, None]) & valid
        device = counts.device
        tokens = torch.from_numpy(self.token_ids[self.rows, :width]).to(device)
        counts.zero_().scatter_add_(1, tokens, torch.from_numpy(in_output).to(device, torch.float32))
        seen.zero_().scatter_add_(1, tokens, torch.from_numpy(valid).to(device, torch.float32))


@dataclass
class Penalties:
    presence: torch.Tensor  # [S]
    frequency: torch.Tensor  # [S]
    repetition: torch.Tensor  # [S]
    history: TokenHistory

    def rows_slice(self, start: int, end: int) -> Penalties:
        return Penalties(self.presence[start:end], self.frequency[start:end], self.repetition[start:end],
                         self.history.rows_slice(start, end))


@dataclass
class LogitBias:
    """Flattened over the rows with a logit_bias, in row order."""

    rows: torch.Tensor  # [entries] long
    token_ids: torch.Tensor  # [entries] long
    biases: torch.Tensor  # [entries] float
    host_rows: np.ndarray  # rows on the host: a chunk finds its entries without waiting on the device

    def rows_slice(self, start: int, end: int) -> LogitBias | None:
        first, last = np.searchsorted(self.host_rows, [start, end])
        if first == last:
            return None
        return LogitBias(self.rows[first:last] - start, self.token_ids[first:last], self.biases[first:last],
                         self.host_rows[first:last] - start)


@dataclass
class SamplingBatch:
    """Per-row sampling settings, built by the model runner for the rows that sample this step."""

    temperature: torch.Tensor  # [S] float; 0 for greedy rows
    top_k: torch.Tensor | None  # [S] long, vocab size where disabled; None when no row uses it
    top_p: torch.Tensor | None  # [S] float; None when no row uses it
    min_p: torch.Tensor | None  # [S] float; None when no row uses it
    all_greedy: bool
    # (row, seed, index of the output token being sampled) for seeded rows.
    seeded_rows: list[tuple[int, int, int]]
    # (row, token ids) whose logits must be -inf: stop tokens before min_tokens, bad words.
    banned_tokens: list[tuple[int, list[int]]]
    penalties: Penalties | None = None
    logit_bias: LogitBias | None = None
    # (row, token ids): the only tokens the row may sample (allowed_token_ids).
    allowed_tokens: list[tuple[int, list[int]]] = field(default_factory=list)
    # Most top log-probabilities any row asked for; None when no row needs log-probabilities.
    num_logprobs: int | None = None
    # [S, ceil(V/32)] int32: the tokens each row's structured-output grammar allows (all bits set elsewhere).
    token_bitmask: torch.Tensor | None = None
    # Rows whose grammar allows no token (batch index -> why): finished by the runner, not sampled.
    structured_stops: dict[int, str] = field(default_factory=dict)
    # Top-k/top-p sort whole rows, not only each row's largest logits: the start-up profile's worst case.
    sort_whole_rows: bool = False

    @property
    def filters_in_place(self) -> bool:
        """Whether sampling is an argmax after in-place masks: no [rows, vocab] buffers needed."""
        return self.all_greedy and self.num_logprobs is None and self.penalties is None and not self.allowed_tokens

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    def rows_slice(self, start: int, end: int) -> SamplingBatch:
        """Rows [start, end) with their indices from 0. all_greedy stays the whole batch's: a batch that is
        not all greedy draws a random number for every row, greedy or not, and so must each of its chunks."""
        if start == 0 and end >= self.num_rows:
            return self

        def part(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[start:end]

        def shifted(entries):
            return [(row - start, *rest) for row, *rest in entries if start <= row < end]

        return replace(
            self,
            temperature=self.temperature[start:end],
            top_k=part(self.top_k),
            top_p=part(self.top_p),
            min_p=part(self.min_p),
            seeded_rows=shifted(self.seeded_rows),
            banned_tokens=shifted(self.banned_tokens),
            penalties=self.penalties.rows_slice(start, end) if self.penalties is not None else None,
            logit_bias=self.logit_bias.rows_slice(start, end) if self.logit_bias is not None else None,
            allowed_tokens=shifted(self.allowed_tokens),
            token_bitmask=part(self.token_bitmask),
            structured_stops={},  # read by the runner from the whole batch, never by the sampler
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S]
    # Present when some row asked for log-probabilities (computed for every row, cheaply, in bulk).
    logprobs: torch.Tensor | None = None  # [S] of the sampled token
    ranks: torch.Tensor | None = None  # [S]
    top_token_ids: torch.Tensor | None = None  # [S, k]
    top_logprobs: torch.Tensor | None = None  # [S, k]


class _Workspace:
    """[rows, vocab] buffers for one chunk, each allocated at its first use and then reused by every chunk of every
    step: a greedy batch needs none of them, a top-p one two, penalties and log-probabilities more. Allocated per
    chunk, they would come from the C heap (they are below glibc's mmap threshold), whose holes between
    longer-lived allocations the process keeps: measured, RSS grew ~25 MiB a chunk that way."""

    DTYPES = {"logprobs": torch.float32, "probs": torch.float32, "scratch": torch.float32, "counts": torch.float32,
              "sorted": torch.float32, "order": torch.int64, "mask": torch.bool}

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.rows, self.vocab_size, self.device = rows, vocab_size, device
        self._buffers: dict[str, torch.Tensor] = {}
        self._ranks: torch.Tensor | None = None

    def buffer(self, name: str) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None:
            buffer = torch.empty(self.rows, self.vocab_size, dtype=self.DTYPES[name], device=self.device)
            self._buffers[name] = buffer
        return buffer

    @property
    def ranks(self) -> torch.Tensor:
        """[1, vocab] 0, 1, 2, ..."""
        if self._ranks is None:
            self._ranks = torch.arange(self.vocab_size, device=self.device)[None]
        return self._ranks

    def first(self, rows: int) -> _WorkspaceRows:
        return _WorkspaceRows(self, rows)

    def nbytes(self) -> int:
        held = list(self._buffers.values()) + ([self._ranks] if self._ranks is not None else [])
        return sum(t.numel() * t.element_size() for t in held)


class _Rows:
    """A workspace buffer's first rows (a contiguous view), allocating the buffer at its first use."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, view: _WorkspaceRows, owner: type) -> torch.Tensor:
        return view.workspace.buffer(self.name)[: view.rows]


class _WorkspaceRows:
    """The buffers of a chunk of `rows` rows: views of the workspace's first rows."""

    logprobs = _Rows()
    probs = _Rows()
    scratch = _Rows()
    counts = _Rows()
    sorted = _Rows()
    order = _Rows()  # int64
    mask = _Rows()  # bool

    def __init__(self, workspace: _Workspace, rows: int) -> None:
        self.workspace, self.rows = workspace, rows

    @property
    def ranks(self) -> torch.Tensor:
        return self.workspace.ranks

    @property
    def cumulative(self) -> torch.Tensor:
        """float64 sums for the draw, in `order`'s bytes: the draw comes after the filters are done with it."""
        return self.order.view(torch.float64)


class Sampler:
    def __init__(self, generator: torch.Generator, max_chunk_elements: int | None = None) -> None:
        self.generator = generator
        self.max_chunk_elements = max_chunk_elements or chunk_elements(generator.device)
        # torch sorts a chunk's rows in parallel, a row to a thread: a chunk of fewer rows than threads leaves
        # cores idle (README, "Memory", has the figures).
        self._row_per_thread = not max_chunk_elements and generator.device.type != "cuda"
        self._workspace: _Workspace | None = None

    def rows_per_chunk(self, vocab_size: int) -> int:
        floor = torch.get_num_threads() if self._row_per_thread else 1
        return max(floor, self.max_chunk_elements // vocab_size)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [S, V] float32 (modified in place)."""
        output = self.new_output(batch, logits.device)
        self.sample_into(logits, batch, 0, output)
        return output

    def new_output(self, batch: SamplingBatch, device: torch.device) -> SamplerOutput:
        """The results of the batch's rows, for sample_into to fill, possibly over several calls."""
        return _allocate_output(batch.num_rows, batch.num_logprobs, device)

    def sample_into(self, logits: torch.Tensor, batch: SamplingBatch, first_row: int, output: SamplerOutput) -> None:
        """Sample rows [first_row, first_row + len(logits)) of `batch` from `logits` (modified in place) into the
        same rows of `output`. Rows must be given in order, each once: the random stream is drawn row after row."""
        num_rows, vocab_size = logits.shape
        end_row = first_row + num_rows
        if batch.filters_in_place:
            _apply_constraints(logits, batch.rows_slice(first_row, end_row), None)
            output.token_ids[first_row:end_row].copy_(_argmax_rows(logits))
            return
        step = min(num_rows, self.rows_per_chunk(vocab_size))
        workspace = self._workspace_for(step, vocab_size, logits.device)
        # Written chunk by chunk: no chunk's results outlive it in the C heap, between the chunks' buffers.
        for start in range(0, num_rows, step):
            end = min(start + step, num_rows)
            rows = (first_row + start, first_row + end)
            self._sample_rows(logits[start:end], batch.rows_slice(*rows), workspace.first(end - start),
                              _output_rows(output, *rows))

    def _workspace_for(self, rows: int, vocab_size: int, device: torch.device) -> _Workspace:
        current = self._workspace
        if current is None or current.rows < rows or current.vocab_size != vocab_size:
            self._workspace = _Workspace(rows, vocab_size, device)  # allocates nothing until a buffer is used
        return self._workspace

    def release_workspace(self) -> None:
        """Free the chunk buffers; the next steps allocate those they use again (after start-up's profile, which
        used them all)."""
        self._workspace = None

    def workspace_bytes(self) -> int:
        return 0 if self._workspace is None else self._workspace.nbytes()

    def _sample_rows(self, logits: torch.Tensor, batch: SamplingBatch, ws: _WorkspaceRows,
                     out: SamplerOutput) -> None:
        raw_logprobs = torch.log_softmax(logits, dim=-1, out=ws.logprobs) if batch.num_logprobs is not None else None
        _apply_constraints(logits, batch, ws)
        if batch.penalties is not None:
            _apply_penalties(logits, batch.penalties, ws)
        self._draw(logits, batch, ws, out.token_ids)
        if raw_logprobs is not None:
            _gather_logprobs(raw_logprobs, batch.num_logprobs, ws, out)

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, ws: _WorkspaceRows, tokens: torch.Tensor) -> None:
        if batch.all_greedy:
            tokens.copy_(_argmax_rows(logits))
            return
        is_greedy = batch.temperature == 0
        # A whole-row argmax is a large part of a chunk's draw on the CPU, where asking whether any row needs it
        # costs nothing (on CUDA the question would wait on the device).
        greedy_tokens = _argmax_rows(logits) if logits.device.type != "cpu" or bool(is_greedy.any()) else None
        temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
        logits.div_(temperature.unsqueeze(1))
        _apply_min_p(logits, batch.min_p, ws)
        _apply_top_k_top_p(logits, batch.top_k, batch.top_p, ws, batch.sort_whole_rows)
        probs = torch.softmax(logits, dim=-1, out=ws.probs)
        sampled = _sample_inverse_cdf(probs, self.generator, batch.seeded_rows, ws.cumulative)
        if greedy_tokens is None:
            tokens.copy_(sampled)
        else:
            torch.where(is_greedy, greedy_tokens, sampled, out=tokens)


def _allocate_output(num_rows: int, num_logprobs: int | None, device: torch.device) -> SamplerOutput:
    def empty(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    if num_logprobs is None:
        return SamplerOutput(empty(num_rows))
    return SamplerOutput(empty(num_rows), empty(num_rows, dtype=torch.float32), empty(num_rows),
                         empty(num_rows, num_logprobs), empty(num_rows, num_logprobs, dtype=torch.float32))


def _output_rows(output: SamplerOutput, start: int, end: int) -> SamplerOutput:
    def rows(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values[start:end]

    return SamplerOutput(output.token_ids[start:end], rows(output.logprobs), rows(output.ranks),
                         rows(output.top_token_ids), rows(output.top_logprobs))


def _apply_constraints(logits: torch.Tensor, batch: SamplingBatch, ws: _WorkspaceRows | None) -> None:
    if batch.token_bitmask is not None:
        apply_token_bitmask(logits, batch.token_bitmask)
    if batch.allowed_tokens:
        disallowed = ws.mask.fill_(False)
        for row, ids in batch.allowed_tokens:
            disallowed[row] = True
            disallowed[row, ids] = False
        logits.masked_fill_(disallowed, float("-inf"))
    if batch.banned_tokens:
        rows = torch.tensor([row for row, ids in batch.banned_tokens for _ in ids], device=logits.device)
        ids = torch.tensor([i for _, ids in batch.banned_tokens for i in ids], device=logits.device)
        logits[rows, ids] = float("-inf")
    if batch.logit_bias is not None:
        bias = batch.logit_bias
        logits.index_put_((bias.rows, bias.token_ids), bias.biases, accumulate=True)


def _apply_penalties(logits: torch.Tensor, penalties: Penalties, ws: _WorkspaceRows) -> None:
    penalties.history.count_into(ws.counts, ws.scratch)
    # Repetition (CTRL / transformers): shrink the logits of every token seen in prompt or output.
    repetition = penalties.repetition.unsqueeze(1)
    penalized = torch.div(logits, repetition, out=ws.probs)
    shrunk_negatives = torch.mul(logits, repetition, out=ws.sorted)
    torch.where(torch.gt(logits, 0, out=ws.mask), penalized, shrunk_negatives, out=penalized)
    torch.where(torch.gt(ws.scratch, 0, out=ws.mask), penalized, logits, out=logits)
    # Frequency and presence (OpenAI): subtract per occurrence and once, over the output only.
    counts = ws.counts
    logits.sub_(torch.mul(penalties.frequency.unsqueeze(1), counts, out=ws.probs))
    present = ws.probs.copy_(torch.gt(counts, 0, out=ws.mask))
    logits.sub_(present.mul_(penalties.presence.unsqueeze(1)))


def _gather_logprobs(logprobs: torch.Tensor, k: int, ws: _WorkspaceRows, out: SamplerOutput) -> None:
    """The sampled tokens' log-probabilities and ranks, and the k most likely tokens, into `out`."""
    chosen = torch.gather(logprobs, 1, out.token_ids.unsqueeze(1), out=out.logprobs.unsqueeze(1))
    out.ranks.copy_(ranks_of(logprobs, chosen, ws.probs))
    if k > 0:
        values, ids = largest_per_row(logprobs, k)
        out.top_logprobs.copy_(values)
        out.top_token_ids.copy_(ids)


def ranks_of(logprobs: torch.Tensor, chosen: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Each row's rank of `chosen` [rows, 1] among `logprobs` [rows, vocab] (1 for the largest), int64. The larger
    values are counted as float32 ones in `scratch` (float32, logprobs' shape; exact below 2**24 tokens): summing a
    bool mask would first cast it to an int64 [rows, vocab] tensor, most of a scoring step's time."""
    return torch.gt(logprobs, chosen, out=scratch).sum(dim=-1).long().add_(1)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None, ws: _WorkspaceRows) -> None:
    if min_p is None:
        return
    probs = torch.softmax(logits, dim=-1, out=ws.probs)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(torch.lt(probs, threshold, out=ws.mask), float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                       ws: _WorkspaceRows, sort_whole_rows: bool = False) -> None:
    """Keep each row's `top_k` largest logits, then the fewest of those whose probabilities (over what top-k
    kept) reach `top_p`; ties rank the lower token id first. A row with neither (top_k of the whole vocabulary,
    top_p of 1) is left as it is."""
    if top_k is None and top_p is None:
        return
    # On the CPU the filters first look among each row's largest logits only: they keep few tokens, and sorting
    # a whole 262k-token row is most of a sampled step there. (On CUDA each try would wait on the device, where
    # the sort is cheap.)
    if not sort_whole_rows and logits.device.type == "cpu":
        filtered = _filtered_rows(top_k, top_p, logits.shape[-1])
        for count in _CANDIDATE_COUNTS:
            if 4 * count <= logits.shape[-1] and _filter_among_largest(logits, top_k, top_p, filtered, count, ws):
                return
    _filter_sorted_rows(logits, top_k, top_p, ws)


def _filtered_rows(top_k: torch.Tensor | None, top_p: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    filtered = torch.zeros_like(top_k if top_k is not None else top_p, dtype=torch.bool)
    if top_k is not None:
        filtered |= top_k < vocab_size
    if top_p is not None:
        filtered |= top_p < 1
    return filtered


def _filter_sorted_rows(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                        ws: _WorkspaceRows) -> None:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True, out=(ws.sorted, ws.order))
    if top_k is not None:
        sorted_logits.masked_fill_(torch.ge(ws.ranks, top_k.unsqueeze(1), out=ws.mask), float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1, out=ws.probs)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        above = torch.cumsum(probs, dim=-1, out=ws.scratch).sub_(probs)
        dropped = torch.ge(above, top_p.unsqueeze(1), out=ws.mask).logical_and_(top_p.unsqueeze(1) < 1)
        sorted_logits.masked_fill_(dropped, float("-inf"))
    # Every position is written back: the sorted order is a permutation of the row.
    logits.scatter_(-1, order, sorted_logits)


def _filter_among_largest(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                          filtered: torch.Tensor, count: int, ws: _WorkspaceRows) -> bool:
    """_filter_sorted_rows over each row's `count` largest logits, where every filtered row's kept tokens are sure
    to be among them and ranked as a whole-row sort ranks them; False, with nothing changed, where not."""
    vocab_size = logits.shape[-1]
    if top_k is not None and bool(((top_k > count) & (top_k < vocab_size)).any()):
        return False  # top-p would be over top-k tokens that are not all candidates
    values, ids = largest_per_row(logits, count)
    keep = torch.ones_like(values, dtype=torch.bool)
    if top_k is not None:
        keep &= ws.ranks[:, :count] < top_k.unsqueeze(1)
    if top_p is not None:
        kept_values = values.masked_fill(~keep, float("-inf"))
        # Probabilities over what top-k kept, all candidates here, or else over the whole row (a pass over the
        # whole row only where some row has no top-k).
        limited = None if top_k is None else (top_k < vocab_size).unsqueeze(1)
        normalizer = None if limited is None else torch.logsumexp(kept_values, dim=-1, keepdim=True)
        if limited is None or not bool(limited.all()):
            whole = torch.logsumexp(logits, dim=-1, keepdim=True)
            normalizer = whole if limited is None else torch.where(limited, normalizer, whole)
        probs = torch.exp(kept_values - normalizer)
        above = torch.cumsum(probs, dim=-1).sub_(probs)
        keep &= ~((above >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1))
    # The kept tokens are a prefix of the candidates. It is the whole row's where it ends before the last
    # candidate and above its value: every token that ties with a kept one is then a candidate too.
    kept = keep.sum(dim=-1)
    last_kept = values.gather(-1, (kept - 1).clamp_(min=0).unsqueeze(1)).squeeze(1)
    sure = (kept < count) & (last_kept > values[:, -1])
    if not bool((sure | ~filtered).all()):
        return False
    kept_values = values.masked_fill_(~keep, float("-inf"))
    if bool(filtered.all()):
        logits.fill_(float("-inf")).scatter_(-1, ids, kept_values)
    else:
        result = ws.sorted.fill_(float("-inf")).scatter_(-1, ids, kept_values)
        torch.where(filtered.unsqueeze(1), result, logits, out=logits)
    return True


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first maximum; NaN counts as the maximum), as torch.argmax gives it: torch.max's
    indices are the same, and torch computes them several times faster on CPU."""
    return torch.max(x, dim=-1).indices


def _sample_inverse_cdf(
    probs: torch.Tensor, generator: torch.Generator, seeded_rows: list[tuple[int, int, int]], cdf: torch.Tensor
) -> torch.Tensor:
    """Each row's token is the first whose cumulative probability passes a uniform draw times the row's total: one
    random number a row. (The exponential race, argmax(p / E) over an Exp(1) draw per logit, drew one per
    logit: 35 ns each on the CPU, most of a sampled step for a 262k vocabulary.) The sums are float64, so a
    token's share of [0, total) is its probability to ~1e-11 whatever the vocabulary's size; a token of zero
    probability adds no width and is never chosen."""
    cdf.copy_(probs).cumsum_(dim=-1)
    uniform = torch.rand(probs.shape[0], 1, dtype=torch.float64, generator=generator, device=probs.device)
    for row, seed, index in seeded_rows:
        row_generator = torch.Generator(device=probs.device)
        row_generator.manual_seed((seed * _SEED_STRIDE + index) % (2**63))
        uniform[row] = torch.rand(1, dtype=torch.float64, generator=row_generator, device=probs.device)
    total = cdf[:, -1:].contiguous()
    chosen = torch.searchsorted(cdf, uniform.mul_(total), right=True)
    # uniform * total can round up to total: the last token of positive probability is the first to reach it.
    last = torch.searchsorted(cdf, total, right=False)
    # (A row with no finite logit has NaN sums and no meaningful token; it stays an index into the vocabulary.)
    return torch.minimum(chosen, last).clamp_(max=probs.shape[1] - 1).squeeze(1)
