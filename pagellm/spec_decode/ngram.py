"""Prompt lookup (vLLM's "ngram" method): find the longest n-gram, prompt_lookup_max >= n >= prompt_lookup_min,
that ends the sequence and also occurs earlier in its prompt or output; propose the tokens that followed that
earlier occurrence (its most recent one). No model, no torch."""

from __future__ import annotations

import numpy as np


class TokenBuffer:
    """A sequence's tokens in a growing numpy array, synced from the request's token list by appending."""

    def __init__(self) -> None:
        self.array = np.zeros(256, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n < self.length:
            self.length = 0  # never happens for a live request; rebuilt rather than trusted
        if n > len(self.array):
            grown = np.zeros(max(n, 2 * len(self.array)), dtype=np.int64)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        if n > self.length:
            self.array[self.length : n] = token_ids[self.length : n]
            self.length = n
        return self.array[:n]


def propose_ngram(tokens: np.ndarray, lookup_min: int, lookup_max: int, max_drafts: int) -> list[int]:
    """Up to max_drafts tokens that followed the latest earlier occurrence of the longest matching suffix."""
    n = len(tokens)
    if max_drafts <= 0 or n < lookup_min + 1:
        return []
    # Candidate ends j (< n - 1) of an earlier occurrence: tokens[j] equals the last token. Each candidate's match
    # is extended backwards one token at a time, for as long as it keeps matching, up to lookup_max.
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    if len(ends) == 0:
        return []
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(lookup_max, n - 1)):
        starts = ends - back
        ok = alive & (starts >= 0)
        ok[ok] = tokens[starts[ok]] == tokens[n - 1 - back]
        if not ok.any():
            break
        lengths += ok
        alive = ok
    best = int(lengths.max())
    if best < lookup_min:
        return []
    # The latest occurrence among the longest: the nearest context is the likeliest to repeat.
    end = int(ends[np.flatnonzero(lengths == best)[-1]])
    return tokens[end + 1 : end + 1 + max_drafts].tolist()
