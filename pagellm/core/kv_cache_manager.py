"""Per-request block tables over the shared block pool."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.block_pool import BlockPool, KVBlock


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    block_size: int
    # Tokens whose K/V has a slot in the pool.
    num_stored_tokens: int

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def waste(self) -> float:
        """Fraction of the slots in allocated blocks that hold no token (0 when nothing is allocated)."""
        slots = self.num_used_blocks * self.block_size
        return 0.0 if slots == 0 else 1.0 - self.num_stored_tokens / slots


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every block table. Tables are append-only: a block is added only when a token needs a slot."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_slots: dict[str, int] = {}
        self._total_slots = 0

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks still to take so that the request's table covers `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Give the request slots for its first `num_tokens` tokens.

        Returns the ids of the blocks newly added to its table (possibly none), or None, taking
        nothing, when the pool has too few free blocks.
        """
        need = self.num_blocks_needed(request_id, num_tokens)
        if need > self.pool.num_free_blocks:
            return None
        if num_tokens == 0:
            return []
        table = self._tables.setdefault(request_id, [])
        new_blocks = self.pool.allocate(need)
        table.extend(new_blocks)
        old = self._num_slots.get(request_id, 0)
        if num_tokens > old:
            self._num_slots[request_id] = num_tokens
            self._total_slots += num_tokens - old
        return [block.block_id for block in new_blocks]

    def free(self, request_id: str) -> None:
        """Release the request's blocks; unknown ids are fine (a request that never got a block)."""
        table = self._tables.pop(request_id, None)
        self._total_slots -= self._num_slots.pop(request_id, 0)
        if table:
            # Tail first, so that a future prefix cache evicts a sequence's end before its shared start.
            self.pool.free(reversed(table))

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._tables.get(request_id, ())]

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.pool.num_blocks,
            num_used_blocks=self.pool.num_used_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            block_size=self.block_size,
            num_stored_tokens=self._total_slots,
        )
