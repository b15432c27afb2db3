"""Per-request block tables over the shared block pool, with automatic prefix caching.

Sliding windows: when every layer of the model attends through a window (`models/sliding_window.py`; the
widest one is what counts), blocks a sequence has moved past are given back to the pool while it runs. The
table entry becomes a hole (None here, `block_pool.HOLE` in block ids), and holes are always a prefix of the
table. A chunk whose first query sits at position p needs keys from p - window + 1 on, so a block is released
once it lies wholly before that for the sequence's next token; a request admitted on a prefix-cache hit
takes only the cached blocks its window touches, the earlier ones start as holes.

Prefix caching with holes: a block is published before it is released, so it stays in the prefix cache as
a free, evictable block (as vLLM does). A hit is a chain of cached blocks from the first one, each still
holding its contents, so a request never starts from a prefix with a hole in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagellm.core.block_pool import HOLE, BlockKey, BlockPool, KVBlock
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


def _block_key(parent: tuple[int, int] | None, token_ids: Sequence[int], cache_salt: str | None,
               lora_int_id: int = 0) -> BlockKey:
    """Only a first block carries the salt and the LoRA adapter: every later key chains on to its parent's
    identity, so a salted chain and an unsalted one (or two adapters' chains) share no block."""
    extra = ("cache_salt", cache_salt) if parent is None and cache_salt is not None else ()
    if parent is None and lora_int_id:
        extra += ("lora", lora_int_id)
    return BlockKey(parent, tuple(token_ids), extra)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CachedPrefix:
    """Leading full blocks of a request that the prefix cache already holds."""

    blocks: list[KVBlock]
    num_tokens: int


NO_CACHED_PREFIX = CachedPrefix([], 0)


def max_blocks_per_sequence(max_model_len: int, block_size: int, sliding_window: int | None,
                            max_chunk_tokens: int) -> int:
    """The most blocks one sequence of up to max_model_len tokens holds at once: all of them, or with a
    sliding window the window before a chunk of up to max_chunk_tokens plus that chunk (and one block of
    misalignment)."""
    every_block = cdiv(max_model_len, block_size)
    if sliding_window is None:
        return every_block
    return min(every_block, cdiv(sliding_window - 1 + min(max_chunk_tokens, max_model_len), block_size) + 1)


class KVCacheManager:
    """Owns every block table. Tables grow only at the end, when a token needs a slot; with a sliding window
    their leading entries become holes as the window moves on."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window}: a window must hold at least one token")
        self.block_size = block_size
        # Keys older than this many tokens before a query are read by no layer (None: every key is).
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        # None entries are holes (released blocks), always a prefix of the table.
        self._tables: dict[str, list[KVBlock | None]] = {}
        self._num_holes: dict[str, int] = {}
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

    def find_cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                           lora_int_id: int = 0) -> CachedPrefix:
        """The longest run of leading full blocks of `token_ids` held in the cache (under `cache_salt`, computed
        with LoRA adapter `lora_int_id`).

        At least the last token is always left to compute: its logits sample the next token.
        """
        if not self.enable_prefix_caching:
            return NO_CACHED_PREFIX
        size = self.block_size
        blocks: list[KVBlock] = []
        parent = None
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            block = self.pool.lookup(_block_key(parent, token_ids[start : start + size], cache_salt, lora_int_id))
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

    def publish_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                            cache_salt: str | None = None, lora_int_id: int = 0) -> None:
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
                key = _block_key(parent, token_ids[index * size : (index + 1) * size], cache_salt, lora_int_id)
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
        # Cached blocks before the window of the first query are not taken: they start as holes.
        skipped = self._first_kept_block(cached.num_tokens) if table is None else 0
        kept = cached.blocks[skipped:]
        # Cached blocks that nobody holds sit in the free queue: taking them uses up free blocks too.
        revived = sum(1 for block in kept if block.ref_cnt == 0)
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
                self.pool.touch(kept)
                table.extend([None] * skipped + kept)
                self._num_holes[request_id] = skipped
                account.add(kept, from_prefix_cache=True)
                self._set_owner(kept, account)
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

    def _first_kept_block(self, first_query_position: int) -> int:
        """Index of the first block a query at this position (and every later one) may read."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query_position - self.sliding_window + 1) // self.block_size

    def release_slid_out_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the blocks of a sequence with `num_computed_tokens` computed that its next token's window
        has moved past; their entries become holes. Returns how many entries became holes."""
        table = self._tables.get(request_id)
        if table is None or self.sliding_window is None:
            return 0
        first = self._num_holes.get(request_id, 0)
        kept = min(self._first_kept_block(num_computed_tokens), len(table))
        if kept <= first:
            return 0
        released = table[first:kept]
        table[first:kept] = [None] * (kept - first)
        self._num_holes[request_id] = kept
        self.pool.free(released)
        self._accounts[request_id].remove(released)
        replaced = self._replaced.setdefault(request_id, [])
        replaced.extend((index, HOLE) for index in range(first, kept))
        return kept - first

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Take back the slots given for tokens past the first `num_tokens` (speculative tokens the target rejected):
        blocks past the kept length return to the pool's free queue head, never published in the prefix cache."""
        table = self._tables.get(request_id)
        filled = self._num_slots.get(request_id, 0)
        if table is None or filled <= num_tokens:
            return
        size, account = self.block_size, self._accounts[request_id]
        keep = max(cdiv(num_tokens, size), self._num_holes.get(request_id, 0))
        dropped = table[keep:]
        if dropped:
            del table[keep:]
            account.remove(dropped)
            self.pool.free_unused(dropped)
        if keep and table[-1] is not None and num_tokens < keep * size:
            last = table[-1]
            count = num_tokens - (keep - 1) * size
            account.fill(count - last.num_tokens)
            self.pool.set_num_tokens(last, count)
        self._num_slots[request_id] = num_tokens

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
        held = [block for block in table if block is not None]
        self.pool.touch(held)
        self._tables[child_id] = list(table)
        self._num_holes[child_id] = self._num_holes.get(parent_id, 0)
        account = self._accounts[child_id] = self._accounts[parent_id]
        account.add(held)
        account.update_peaks()
        self._num_slots[child_id] = self._num_slots.get(parent_id, 0)
        if parent_id in self._num_published:
            self._num_published[child_id] = self._num_published[parent_id]
        if parent_id in self._last_published:
            self._last_published[child_id] = self._last_published[parent_id]

    def _set_owner(self, blocks: list[KVBlock], account: KVAccount) -> None:
        self.owners[[block.block_id for block in blocks]] = account.serial

    def _fill(self, request_id: str, table: list[KVBlock | None], num_tokens: int, account: KVAccount) -> None:
        """Record which slots now hold (or are about to hold) tokens, for the waste figure."""
        old = self._num_slots.get(request_id, 0)
        if num_tokens <= old:
            return
        size = self.block_size
        filled = 0
        for index in range(max(old // size, self._num_holes.get(request_id, 0)), cdiv(num_tokens, size)):
            block = table[index]
            count = min(size, num_tokens - index * size)
            filled += count - block.num_tokens
            self.pool.set_num_tokens(block, count)
        account.fill(filled)
        self._num_slots[request_id] = num_tokens

    def free(self, request_id: str) -> None:
        """Release the request's blocks; unknown ids are fine (a request that never got a block)."""
        table = self._tables.pop(request_id, None)
        holes = self._num_holes.pop(request_id, 0)
        self._num_slots.pop(request_id, None)
        self._num_published.pop(request_id, None)
        self._last_published.pop(request_id, None)
        self._replaced.pop(request_id, None)
        account = self._accounts.pop(request_id, None)
        if table:
            held = table[holes:]
            # Tail first: under memory pressure a sequence's end is evicted before its shared start.
            self.pool.free(reversed(held))
            account.remove(held)

    def account_of(self, request_id: str) -> KVAccount | None:
        """The account charged with the request's blocks, while it holds a table."""
        return self._accounts.get(request_id)

    def owner_labels(self) -> dict[int, str]:
        """Account serial -> user request id, for the accounts holding blocks now."""
        return {account.serial: account.label for account in self._accounts.values()}

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table; HOLE for a released block."""
        return [HOLE if block is None else block.block_id for block in self._tables.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Table entries of the request that are blocks, not holes."""
        return len(self._tables.get(request_id, ())) - self._num_holes.get(request_id, 0)

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
