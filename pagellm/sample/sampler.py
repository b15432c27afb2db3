"""Turn the logits of the sampling positions into tokens, for the whole batch at once.

Order, as vLLM applies it: log-probabilities are taken from the raw logits; then allowed-token
masks, banned tokens (bad words, stop tokens before min_tokens) and logit bias; then presence,
frequency and repetition penalties; then temperature, min-p, top-k and top-p; then the draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.structured_output.matcher import apply_token_bitmask

# Mixes a request's seed with the index of the token it samples, so a seeded request's k-th token
# depends on (seed, k, logits) alone: not on what else is in the batch, nor on preemption.
_SEED_STRIDE = 1_000_003


@dataclass
class Penalties:
    presence: torch.Tensor  # [S]
    frequency: torch.Tensor  # [S]
    repetition: torch.Tensor  # [S]
    output_counts: torch.Tensor  # [S, V] occurrences of each token in the row's output so far
    seen: torch.Tensor  # [S, V] bool: in the prompt or the output (what repetition_penalty looks at)


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
    # (rows, token ids, biases) flattened over the rows with a logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    allowed_mask: torch.Tensor | None = None  # [S, V] bool
    # Most top log-probabilities any row asked for; None when no row needs log-probabilities.
    num_logprobs: int | None = None
    # [S, ceil(V/32)] int32: the tokens each row's structured-output grammar allows (all bits set elsewhere).
    token_bitmask: torch.Tensor | None = None
    # Rows whose grammar allows no token (batch index -> why): finished by the runner, not sampled.
    structured_stops: dict[int, str] = field(default_factory=dict)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S]
    # Present when some row asked for log-probabilities (computed for every row, cheaply, in bulk).
    logprobs: torch.Tensor | None = None  # [S] of the sampled token
    ranks: torch.Tensor | None = None  # [S]
    top_token_ids: torch.Tensor | None = None  # [S, k]
    top_logprobs: torch.Tensor | None = None  # [S, k]


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [S, V] float32 (modified in place)."""
        raw_logprobs = logits.log_softmax(dim=-1) if batch.num_logprobs is not None else None
        logits = _apply_constraints(logits, batch)
        if batch.penalties is not None:
            logits = _apply_penalties(logits, batch.penalties)
        tokens = self._draw(logits, batch)
        if raw_logprobs is None:
            return SamplerOutput(tokens)
        return _gather_logprobs(raw_logprobs, tokens, batch.num_logprobs)

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        greedy_tokens = logits.argmax(dim=-1)
        is_greedy = batch.temperature == 0
        temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
        logits = logits / temperature.unsqueeze(1)
        logits = _apply_min_p(logits, batch.min_p)
        logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = logits.softmax(dim=-1)
        sampled = _sample_exponential(probs, self.generator, batch.seeded_rows)
        return torch.where(is_greedy, greedy_tokens, sampled)


def _apply_constraints(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.token_bitmask is not None:
        apply_token_bitmask(logits, batch.token_bitmask)
    if batch.allowed_mask is not None:
        logits = logits.masked_fill(~batch.allowed_mask, float("-inf"))
    if batch.banned_tokens:
        rows = torch.tensor([row for row, ids in batch.banned_tokens for _ in ids], device=logits.device)
        ids = torch.tensor([i for _, ids in batch.banned_tokens for i in ids], device=logits.device)
        logits[rows, ids] = float("-inf")
    if batch.logit_bias is not None:
        rows, ids, biases = batch.logit_bias
        logits.index_put_((rows, ids), biases, accumulate=True)
    return logits


def _apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    # Repetition (CTRL / transformers): shrink the logits of every token seen in prompt or output.
    repetition = penalties.repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(penalties.seen, penalized, logits)
    # Frequency and presence (OpenAI): subtract per occurrence and once, over the output only.
    counts = penalties.output_counts
    logits = logits - penalties.frequency.unsqueeze(1) * counts
    return logits - penalties.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def _gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> SamplerOutput:
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], tokens[:, None][:, :0])
    return SamplerOutput(tokens, chosen, ranks, top_ids, top_logprobs)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        exceeded = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(exceeded, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _sample_exponential(
    probs: torch.Tensor, generator: torch.Generator, seeded_rows: list[tuple[int, int, int]]
) -> torch.Tensor:
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race), with no sync or cumsum search.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, seed, index in seeded_rows:
        row_generator = torch.Generator(device=probs.device)
        row_generator.manual_seed((seed * _SEED_STRIDE + index) % (2**63))
        noise[row].exponential_(generator=row_generator)
    return (probs / noise).argmax(dim=-1)
