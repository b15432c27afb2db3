"""What one user request cost in KV memory: kept up to date where its blocks change hands.

A user request runs as one sequence, or several (n > 1, beam search) that share blocks; the account is
the request's, shared by all of its sequences. It is updated by the KVCacheManager in bulk, once per
block taken, forked, copied or freed, never per token.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from pagellm.core.block_pool import KVBlock


@dataclass(frozen=True)
class KVUsage:
    """One request's KV memory, as `RequestOutput.kv` and the server's `kv` object report it."""

    # The most distinct physical blocks its sequences held at once (a block they share counts once).
    peak_blocks: int = 0
    # The most blocks held at once that were shared: by two or more of its sequences (n > 1, beam
    # search, until copy-on-write separates them) or taken from the prefix cache.
    shared_blocks: int = 0
    # Shared, partly filled blocks copied before one of its sequences wrote into them.
    cow_copies: int = 0
    # Prompt tokens whose K/V came from the prefix cache when it was first admitted.
    cached_tokens: int = 0
    # Times one of its sequences was preempted (its blocks freed, to be recomputed).
    preemptions: int = 0
    # The most unfilled token slots its blocks held at once: the free tails of its sequences' last blocks.
    peak_waste_slots: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def __add__(self, other: KVUsage) -> KVUsage:
        """Field by field: what a response for several prompts reports (peaks add up to an upper bound)."""
        return KVUsage(*(a + b for a, b in zip(self.to_dict().values(), other.to_dict().values())))


class KVAccount:
    """The live figures behind a request's `KVUsage`: which blocks it holds, and how often each."""

    __slots__ = ("block_size", "label", "serial", "_refs", "_hits", "_filled", "_shared", "peak_blocks", "peak_shared",
                 "peak_waste", "cow_copies", "cached_tokens", "preemptions")

    # Serials fit the pool's int32 owner array: they wrap after 2**31 requests (a label is then ambiguous
    # only between requests two billion apart).
    _serials = itertools.count()

    def __init__(self, block_size: int, label: str = "") -> None:
        self.block_size = block_size
        # The user request's id, and a number naming the account in the pool's per-block owner array.
        self.label = label
        self.serial = next(KVAccount._serials) % (1 << 31)
        # block id -> how many of the request's block tables reference it.
        self._refs: dict[int, int] = {}
        # Held blocks that came from the prefix cache.
        self._hits: set[int] = set()
        # Token slots filled across the held blocks, and how many held blocks are shared.
        self._filled = 0
        self._shared = 0
        self.peak_blocks = 0
        self.peak_shared = 0
        self.peak_waste = 0
        self.cow_copies = 0
        self.cached_tokens = 0
        self.preemptions = 0

    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    @property
    def waste(self) -> int:
        return len(self._refs) * self.block_size - self._filled

    def _is_shared(self, block_id: int) -> bool:
        return self._refs.get(block_id, 0) > 1 or block_id in self._hits

    def add(self, blocks: Iterable[KVBlock], from_prefix_cache: bool = False) -> None:
        """One more of the request's tables references each block."""
        for block in blocks:
            block_id = block.block_id
            was_shared = self._is_shared(block_id)
            count = self._refs.get(block_id, 0)
            self._refs[block_id] = count + 1
            if count == 0:
                self._filled += block.num_tokens
            if from_prefix_cache:
                self._hits.add(block_id)
            self._shared += self._is_shared(block_id) - was_shared

    def remove(self, blocks: Iterable[KVBlock]) -> None:
        """One of the request's tables dropped each block (freed, or replaced by its copy)."""
        for block in blocks:
            block_id = block.block_id
            was_shared = self._is_shared(block_id)
            count = self._refs[block_id] - 1
            if count == 0:
                del self._refs[block_id]
                self._hits.discard(block_id)
                self._filled -= block.num_tokens
            else:
                self._refs[block_id] = count
            self._shared += self._is_shared(block_id) - was_shared

    def fill(self, num_slots: int) -> None:
        """Slots newly filled in blocks the request holds alone."""
        self._filled += num_slots

    def update_peaks(self) -> None:
        """Called at the end of each change, when the blocks taken have been filled."""
        self.peak_blocks = max(self.peak_blocks, len(self._refs))
        self.peak_shared = max(self.peak_shared, self._shared)
        self.peak_waste = max(self.peak_waste, self.waste)

    def snapshot(self) -> KVUsage:
        return KVUsage(self.peak_blocks, self.peak_shared, self.cow_copies, self.cached_tokens, self.preemptions,
                       self.peak_waste)
