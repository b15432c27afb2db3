"""Physical KV blocks: reference counts and a free queue whose every operation is O(1)."""

from __future__ import annotations

from collections.abc import Iterable


class BlockAccountingError(RuntimeError):
    """A block was freed more often than it was taken: a bug in the caller, never a user error."""


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


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
    """All physical blocks of the KV pool. A block is free exactly when its ref count is 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV pool needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

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
        """Take `num_blocks` blocks, all or none."""
        if num_blocks < 0 or num_blocks > len(self.free_queue):
            raise BlockAccountingError(f"asked for {num_blocks} blocks, {len(self.free_queue)} free")
        taken = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block in taken:
            block.ref_cnt = 1
        return taken

    def share(self, blocks: Iterable[KVBlock]) -> None:
        """One more owner for each block (a forked block table)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise BlockAccountingError(f"cannot share free {block}")
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one owner of each block; a block whose last owner left goes back to the free queue."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise BlockAccountingError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
