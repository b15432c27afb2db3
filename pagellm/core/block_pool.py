"""Physical KV blocks: reference counts, a free queue whose every operation is O(1), and the prefix cache.

A full block's contents are named by a `BlockKey`: its token ids plus the exact cached block before
it (id and generation). Keys are compared by value, never trusted by hash alone, so a hash collision
costs a dictionary probe and can never hand a request the wrong K/V.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockKey:
    # (block_id, generation) of the cached block holding the previous tokens; None for a first block.
    parent: tuple[int, int] | None
    token_ids: tuple[int, ...]
    # Anything else that must keep two blocks of equal tokens apart: a request's cache_salt (on first blocks;
    # the chain carries it on), later a LoRA adapter or multimodal inputs.
    extra: tuple = ()


# The block id in a block table (the core's `block_ids`, the runner's numpy table) of a hole: an entry whose
# block was given back to the pool because every layer's sliding window has moved past it. Holes only ever
# precede a sequence's window; attention starts reading at the window, so nothing dereferences a hole. In
# the KV-cache manager's own tables a hole is None.
HOLE = -1


class BlockAccountingError(RuntimeError):
    """A block was freed more often than it was taken: a bug in the caller, never a user error."""


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "prev_free", "next_free", "key", "generation", "num_tokens")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        # Set while the block's contents are in the prefix cache.
        self.key: BlockKey | None = None
        # Bumped each time the block is handed out for new data, so a child key that names this
        # block as its parent stops matching once the parent's contents are gone.
        self.generation = 0
        # Token slots filled in this block (for KV-waste accounting).
        self.num_tokens = 0

    @property
    def identity(self) -> tuple[int, int]:
        return self.block_id, self.generation

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.key is not None})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves.

    A deque cannot remove from the middle in O(1); prefix caching needs exactly that when a freed
    block with cached contents is hit again, so the links live on the blocks.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise BlockAccountingError("popleft from an empty free queue")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise BlockAccountingError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def appendleft(self, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise BlockAccountingError(f"{block} is already in the free queue")
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise BlockAccountingError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def block_ids(self) -> list[int]:
        """Front-to-back ids; for tests and debugging only (O(n))."""
        ids, block = [], self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """All physical blocks of the KV pool. A block is free exactly when its ref count is 0.

    Free blocks keep their cached contents until handed out again (lazy eviction), and leave the
    free queue from its head: least recently freed first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV pool needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockKey, KVBlock] = {}
        # Token slots filled across blocks in use, and blocks held by more than one owner: kept
        # up to date on every ref-count change so that stats cost nothing per step.
        self.num_stored_tokens = 0
        self.num_shared_blocks = 0
        # Mirrors of each block's ref count and cached flag, written in bulk as blocks change hands, so
        # that a picture of the whole pool (the /kv page) is an array copy, not a walk over the blocks.
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.cached_flags = np.zeros(num_blocks, dtype=np.bool_)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks for new data, all or none, evicting whatever they cached."""
        if num_blocks < 0 or num_blocks > len(self.free_queue):
            raise BlockAccountingError(f"asked for {num_blocks} blocks, {len(self.free_queue)} free")
        taken = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block in taken:
            self._evict(block)
            block.generation += 1
            block.num_tokens = 0
            block.ref_cnt = 1
        if taken:
            self.ref_counts[[block.block_id for block in taken]] = 1
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """One more owner for each block: a prefix-cache hit, or a forked block table.

        A free block that is hit again leaves the free queue from wherever it sits.
        """
        ids = []
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_stored_tokens += block.num_tokens
            elif block.ref_cnt == 1:
                self.num_shared_blocks += 1
            block.ref_cnt += 1
            ids.append(block.block_id)
        np.add.at(self.ref_counts, ids, 1)

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one owner of each block; a block whose last owner left goes to the free queue's tail."""
        ids = []
        for block in blocks:
            if block.ref_cnt <= 0:
                raise BlockAccountingError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 1:
                self.num_shared_blocks -= 1
            elif block.ref_cnt == 0:
                self.num_stored_tokens -= block.num_tokens
                self.free_queue.append(block)
            ids.append(block.block_id)
        np.subtract.at(self.ref_counts, ids, 1)

    def free_unused(self, blocks: list[KVBlock]) -> None:
        """Give back blocks taken and never used for tokens that stay (rejected speculative tokens' slots): to the
        free queue's head, in the order they were taken, as if they had never left it."""
        for block in reversed(blocks):
            if block.ref_cnt != 1:
                raise BlockAccountingError(f"{block} is shared or free; only a sequence's own block is given back")
            block.ref_cnt = 0
            self.num_stored_tokens -= block.num_tokens
            self.free_queue.appendleft(block)
        if blocks:
            self.ref_counts[[block.block_id for block in blocks]] = 0

    def set_num_tokens(self, block: KVBlock, num_tokens: int) -> None:
        self.num_stored_tokens += num_tokens - block.num_tokens
        block.num_tokens = num_tokens

    # ---- prefix cache --------------------------------------------------------------------------

    def lookup(self, key: BlockKey) -> KVBlock | None:
        return self.cached.get(key)

    def cache(self, block: KVBlock, key: BlockKey) -> KVBlock:
        """Publish a full block's contents; returns the block that holds them in the cache, which
        is an older one when another request computed the same contents first."""
        existing = self.cached.get(key)
        if existing is not None:
            return existing
        block.key = key
        self.cached[key] = block
        self.cached_flags[block.block_id] = True
        return block

    def _evict(self, block: KVBlock) -> None:
        if block.key is not None:
            if self.cached.get(block.key) is block:
                del self.cached[block.key]
            block.key = None
            self.cached_flags[block.block_id] = False
