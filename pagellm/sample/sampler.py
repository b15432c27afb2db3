"""Turn the logits of the sampling positions into tokens, for the whole batch at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Mixes a request's seed with the index of the token it samples, so a seeded request's k-th token
# depends on (seed, k, logits) alone: not on what else is in the batch, nor on preemption.
_SEED_STRIDE = 1_000_003


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
    # (row, token ids) whose logits must be -inf: stop tokens before min_tokens is reached.
    banned_tokens: list[tuple[int, list[int]]]


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits: [S, V] float32. Returns [S] sampled token ids."""
        for row, token_ids in batch.banned_tokens:
            logits[row, token_ids] = float("-inf")
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
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        exceeded = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p.unsqueeze(1)
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
