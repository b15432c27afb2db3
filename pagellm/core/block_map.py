"""A picture of the whole KV pool: each block's state and owner, as compact arrays (the /kv page's data).

Cheap enough to take between steps: the states come from the pool's ref-count and cached-flag arrays in
a few vectorised operations; only the owners walk the block tables (the blocks in use, not the pool).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pagellm.core.kv_cache_manager import KVCacheStats

# Block states, one byte each: free, free but holding a cached prefix, in use by one sequence; a block
# shared by k sequences is k + 1 (at most MAX_STATE, "255 or more sharers" past that).
FREE, CACHED, USED = 0, 1, 2
MAX_STATE = 255
NO_OWNER = -1


@dataclass(frozen=True)
class BlockMap:
    states: np.ndarray  # uint8 per block
    # Per block, the index in `owner_ids` of the user request holding it (the last one found for a block
    # that several requests share); NO_OWNER for free blocks.
    owners: np.ndarray  # int32 per block
    owner_ids: list[str]
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache: KVCacheStats
    # When it was taken (time.time()), and how long taking it took.
    taken_at: float
    build_seconds: float

    @property
    def num_cached_free_blocks(self) -> int:
        return int(np.count_nonzero(self.states == CACHED))


def take_block_map(scheduler) -> BlockMap:
    """The scheduler's pool as it is now; call it on the thread that steps the engine."""
    started = time.perf_counter()
    pool = scheduler.kv.pool
    refs = pool.ref_counts
    states = (np.minimum(refs, MAX_STATE - 1) + 1).astype(np.uint8)
    free = refs == 0
    states[free] = np.where(pool.cached_flags[free], CACHED, FREE)
    owners = np.full(len(refs), NO_OWNER, dtype=np.int32)
    owner_ids: list[str] = []
    index_of: dict[str, int] = {}
    for request_id, table in scheduler.kv.tables():
        request = scheduler.requests.get(request_id)
        group = request.group_id if request is not None else request_id
        index = index_of.setdefault(group, len(owner_ids))
        if index == len(owner_ids):
            owner_ids.append(group)
        owners[[block.block_id for block in table]] = index
    stats = scheduler.get_stats()
    return BlockMap(states, owners, owner_ids, stats.num_running, stats.num_waiting, stats.num_preemptions,
                    stats.kv_cache, time.time(), time.perf_counter() - started)
