"""Per-request block tables over the shared block pool, with automatic prefix caching."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagellm.core.block_pool import BlockKey, BlockPool, KVBlock
from pagellm.core.kv_usage import KVAccount


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    block_size: int
    # Token slots filled across the blocks in use (a shared block counts once).
    num_stored_tokens: int
    # Prompt tokens looked up in the prefix cache, and how many of them it held (since start-up).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_cached_blocks: int = 0
    # Blocks in use by more than one sequence, and copies copy-on-write has made (since start-up).
    num_shared_blocks: int = 0
    num_cow_copies: int = 0

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


@dataclass(frozen=True)
class CachedPrefix:
    """Leading full blocks of a request that the prefix cache already holds."""

    blocks: list[KVBlock]
    num_tokens: int


NO_CACHED_PREFIX = CachedPrefix([], 0)


class KVCacheManager:
    """Owns every block table. Tables are append-only: a block is added only when a token needs a slot."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_slots: dict[str, int] = {}
        # Per request: how many leading blocks are published in the prefix cache, and the identity
        # of the cached block holding the last of them (the parent of the next key).
        self._num_published: dict[str, int] = {}
        self._last_published: dict[str, tuple[int, int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Copy-on-write: block copies the runner must make before the next forward, and per request
        # which table entries they replaced.
        self._pending_copies: list[tuple[int, int]] = []
        self._replaced: dict[str, list[tuple[int, int]]] = {}
        self.num_cow_copies = 0
        # Per sequence, the account of the user request it belongs to (shared by a request's sequences).
        self._accounts: dict[str, KVAccount] = {}
        # Per block, the serial of the account that last took it (its owner while it is in use), written
        # in bulk as tables gain blocks: a picture of the pool reads owners without walking the tables.
        self.owners = np.full(num_blocks, -1, dtype=np.int32)

    # ---- prefix cache ------------------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        """The longest run of leading full blocks of `token_ids` held in the cache.

        At least the last token is always left to compute: its logits sample the next token.
        """
        if not self.enable_prefix_caching:
            return NO_CACHED_PREFIX
        size = self.block_size
        blocks: list[KVBlock] = []
        parent = None
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            block = self.pool.lookup(BlockKey(parent, tuple(token_ids[start : start + size])))
            if block is None:
                break
            blocks.append(block)
            parent = block.identity
        return CachedPrefix(blocks, len(blocks) * size)

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission, not per lookup: a request that waits is looked up every step."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def publish_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Put the request's newly completed blocks (their K/V is written) into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id)
        if table is None:
            return
        size = self.block_size
        done = self._num_published.get(request_id, 0)
        parent = self._last_published.get(request_id)
        for index in range(done, num_computed_tokens // size):
            block = table[index]
            if block.key is None:
                key = BlockKey(parent, tuple(token_ids[index * size : (index + 1) * size]))
                # Another request may have published the same contents first: chain on to that
                # block, so this request's later blocks stay reachable from the cache.
                block = self.pool.cache(block, key)
            parent = block.identity
            done = index + 1
        self._num_published[request_id] = done
        if parent is not None:
            self._last_published[request_id] = parent

    # ---- block tables ------------------------------------------------------------------------------

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks still to take so that the request's table covers `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def allocate_slots(
        self, request_id: str, num_tokens: int, cached: CachedPrefix = NO_CACHED_PREFIX,
        account: KVAccount | None = None,
    ) -> list[int] | None:
        """Give the request slots for its first `num_tokens` tokens, starting from `cached` blocks
        for a request that has no table yet. `account` (for a request without a table) is charged
        with its blocks; by default it gets one of its own.

        Returns the ids of the blocks newly taken from the free pool (possibly none), or None, taking
        nothing, when the pool has too few free blocks.
        """
        table = self._tables.get(request_id)
        need = max(0, self.num_blocks_needed(request_id, num_tokens) - len(cached.blocks))
        # Cached blocks that nobody holds sit in the free queue: taking them uses up free blocks too.
        revived = sum(1 for block in cached.blocks if block.ref_cnt == 0)
        shared_tail = self._shared_tail_index(request_id, num_tokens)
        if need + revived + (shared_tail is not None) > self.pool.num_free_blocks:
            return None
        if num_tokens == 0:
            return []
        if shared_tail is not None:
            self._copy_on_write(request_id, shared_tail)
        fresh = table is None
        if fresh:
            table = self._tables[request_id] = []
            account = self._accounts[request_id] = account or KVAccount(self.block_size, request_id)
            if cached.blocks:
                self.pool.touch(cached.blocks)
                table.extend(cached.blocks)
                account.add(cached.blocks, from_prefix_cache=True)
                self._set_owner(cached.blocks, account)
                self._num_published[request_id] = len(cached.blocks)
                self._last_published[request_id] = cached.blocks[-1].identity
        else:
            account = self._accounts[request_id]
        new_blocks = self.pool.allocate(need) if need else []
        if new_blocks:
            table.extend(new_blocks)
            account.add(new_blocks)
            self._set_owner(new_blocks, account)
        self._fill(request_id, table, num_tokens, account)
        # The peaks can rise only when the request gains blocks (new, cached, or a copy beside the
        # original); a plain decode step fills a slot and skips this.
        if new_blocks or fresh or shared_tail is not None:
            account.update_peaks()
        return [block.block_id for block in new_blocks]

    def _shared_tail_index(self, request_id: str, num_tokens: int) -> int | None:
        """Index of the partly filled, shared block that the next tokens would be written into."""
        table = self._tables.get(request_id)
        filled = self._num_slots.get(request_id, 0)
        if not table or num_tokens <= filled or filled % self.block_size == 0:
            return None
        index = filled // self.block_size
        return index if table[index].ref_cnt > 1 else None

    def _copy_on_write(self, request_id: str, index: int) -> None:
        table = self._tables[request_id]
        shared = table[index]
        (private,) = self.pool.allocate(1)
        self.pool.set_num_tokens(private, shared.num_tokens)
        table[index] = private
        self.pool.free([shared])
        account = self._accounts[request_id]
        account.add([private])
        account.remove([shared])
        self.owners[private.block_id] = account.serial
        account.cow_copies += 1
        self._pending_copies.append((shared.block_id, private.block_id))
        self._replaced.setdefault(request_id, []).append((index, private.block_id))
        self.num_cow_copies += 1

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies made since the last call, in order."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_replaced_blocks(self, request_id: str) -> list[tuple[int, int]]:
        """(table index, new block id) entries copy-on-write changed in the request's table."""
        return self._replaced.pop(request_id, [])

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` a table referencing all of the parent's blocks (the partly filled last one
        included); whichever of them writes into a shared block first copies it."""
        table = self._tables.get(parent_id)
        if table is None:
            return
        self.pool.touch(table)
        self._tables[child_id] = list(table)
        account = self._accounts[child_id] = self._accounts[parent_id]
        account.add(table)
        account.update_peaks()
        self._num_slots[child_id] = self._num_slots.get(parent_id, 0)
        if parent_id in self._num_published:
            self._num_published[child_id] = self._num_published[parent_id]
        if parent_id in self._last_published:
            self._last_published[child_id] = self._last_published[parent_id]

    def _set_owner(self, blocks: list[KVBlock], account: KVAccount) -> None:
        self.owners[[block.block_id for block in blocks]] = account.serial

    def _fill(self, request_id: str, table: list[KVBlock], num_tokens: int, account: KVAccount) -> None:
        """Record which slots now hold (or are about to hold) tokens, for the waste figure."""
        old = self._num_slots.get(request_id, 0)
        if num_tokens <= old:
            return
        size = self.block_size
        filled = 0
        for index in range(old // size, cdiv(num_tokens, size)):
            block = table[index]
            count = min(size, num_tokens - index * size)
            filled += count - block.num_tokens
            self.pool.set_num_tokens(block, count)
        account.fill(filled)
        self._num_slots[request_id] = num_tokens

    def free(self, request_id: str) -> None:
        """Release the request's blocks; unknown ids are fine (a request that never got a block)."""
        table = self._tables.pop(request_id, None)
        self._num_slots.pop(request_id, None)
        self._num_published.pop(request_id, None)
        self._last_published.pop(request_id, None)
        self._replaced.pop(request_id, None)
        account = self._accounts.pop(request_id, None)
        if table:
            # Tail first: under memory pressure a sequence's end is evicted before its shared start.
            self.pool.free(reversed(table))
            account.remove(table)

    def account_of(self, request_id: str) -> KVAccount | None:
        """The account charged with the request's blocks, while it holds a table."""
        return self._accounts.get(request_id)

    def owner_labels(self) -> dict[int, str]:
        """Account serial -> user request id, for the accounts holding blocks now."""
        return {account.serial: account.label for account in self._accounts.values()}

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
            num_stored_tokens=self.pool.num_stored_tokens,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_cached_blocks=len(self.pool.cached),
            num_shared_blocks=self.pool.num_shared_blocks,
            num_cow_copies=self.num_cow_copies,
        )
