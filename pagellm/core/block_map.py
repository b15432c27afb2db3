"""A picture of the whole KV pool: each block's state and owner, as compact arrays (the /kv page's data).

Cheap enough to take between steps: states and owners come from arrays the pool and the KV-cache manager
keep up to date as blocks change hands, in a few vectorised operations; nothing walks the blocks.
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
    # Per block, the serial of the account (user request) that last took it; NO_OWNER for free blocks.
    owners: np.ndarray  # int32 per block
    # Serial -> user request id, for the requests holding blocks. A block shared with a request that took
    # it later and has since finished names no one here.
    owner_ids: dict[int, str]
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
    # Owners as account serials (not renumbered: sorting them would cost more than all the rest).
    owners = np.where(free, NO_OWNER, scheduler.kv.owners).astype(np.int32)
    owner_ids = scheduler.kv.owner_labels()
    stats = scheduler.get_stats()
    return BlockMap(states, owners, owner_ids, stats.num_running, stats.num_waiting, stats.num_preemptions,
                    stats.kv_cache, time.time(), time.perf_counter() - started)
