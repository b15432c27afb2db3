"""Block pool: reference counts and the O(1) free queue."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagellm.core.block_pool import BlockAccountingError, BlockPool, FreeBlockQueue, KVBlock

# tests/conftest.py loads the shared "ci" profile; these settings are applied per test (never
# loaded globally, which would override the profile for every other module) so that the
# property tests here stay derandomized and deadline-free whichever profile is active.
PROPERTY = settings(
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)


def check_pool(pool: BlockPool) -> None:
    """Every structural invariant of a pool, checked from the blocks themselves."""
    ids = pool.free_queue.block_ids()
    assert len(ids) == len(set(ids)), f"duplicate in free queue: {ids}"
    assert len(ids) == len(pool.free_queue) == pool.num_free_blocks
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    free = set(ids)
    for block in pool.blocks:
        assert block.ref_cnt >= 0, block
        if block.block_id in free:
            assert block.ref_cnt == 0, block
        else:
            assert block.ref_cnt > 0, block
            assert block.prev_free is None and block.next_free is None, block


# ---- FreeBlockQueue ---------------------------------------------------------------------


def test_queue_starts_in_order():
    q = FreeBlockQueue(KVBlock(i) for i in range(5))
    assert len(q) == 5
    assert q.block_ids() == [0, 1, 2, 3, 4]


def test_queue_popleft_append_order():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert q.block_ids() == [2, 3]
    q.append(blocks[0])
    assert q.block_ids() == [2, 3, 0]
    assert len(q) == 3
    # A popped block is fully unlinked.
    b1 = blocks[1]
    assert b1.prev_free is None and b1.next_free is None


@pytest.mark.parametrize("victim", [0, 2, 4])
def test_queue_remove_head_middle_tail(victim):
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[victim])
    assert q.block_ids() == [i for i in range(5) if i != victim]
    assert len(q) == 4
    assert blocks[victim].prev_free is None and blocks[victim].next_free is None
    # Re-append goes to the back.
    q.append(blocks[victim])
    assert q.block_ids() == [i for i in range(5) if i != victim] + [victim]


def test_queue_remove_only_element_then_empty():
    b = KVBlock(7)
    q = FreeBlockQueue([b])
    q.remove(b)
    assert len(q) == 0
    assert q.block_ids() == []
    with pytest.raises(BlockAccountingError):
        q.popleft()
    q.append(b)
    assert q.block_ids() == [7]


def test_queue_popleft_empty_raises():
    q = FreeBlockQueue([])
    assert len(q) == 0
    with pytest.raises(BlockAccountingError):
        q.popleft()
    assert len(q) == 0


def test_queue_double_append_raises_and_keeps_state():
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    with pytest.raises(BlockAccountingError):
        q.append(blocks[1])
    assert q.block_ids() == [0, 1, 2]
    assert len(q) == 3
    # The single-element case too (the block's links point at sentinels).
    q2 = FreeBlockQueue([KVBlock(9)])
    only = q2.popleft()
    q2.append(only)
    with pytest.raises(BlockAccountingError):
        q2.append(only)
    assert q2.block_ids() == [9]


def test_queue_remove_absent_raises():
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    b = q.popleft()
    with pytest.raises(BlockAccountingError):
        q.remove(b)
    assert q.block_ids() == [1, 2]
    assert len(q) == 2


# ---- BlockPool --------------------------------------------------------------------------


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_allocate_free_refcounts():
    pool = BlockPool(4)
    assert (pool.num_blocks, pool.num_free_blocks, pool.num_used_blocks) == (4, 4, 0)
    taken = pool.allocate(3)
    assert [b.block_id for b in taken] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in taken)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    check_pool(pool)
    pool.free([taken[1]])
    assert taken[1].ref_cnt == 0
    assert pool.free_queue.block_ids() == [3, 1]
    check_pool(pool)
    pool.free([taken[2], taken[0]])
    assert pool.free_queue.block_ids() == [3, 1, 2, 0]
    assert pool.num_used_blocks == 0
    check_pool(pool)
    # Reuse follows the free order (LRU-ish).
    again = pool.allocate(2)
    assert [b.block_id for b in again] == [3, 1]
    check_pool(pool)


def test_allocate_zero():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_allocate_too_many_raises_and_takes_nothing():
    pool = BlockPool(3)
    pool.allocate(1)
    before = pool.free_queue.block_ids()
    with pytest.raises(BlockAccountingError):
        pool.allocate(3)
    assert pool.free_queue.block_ids() == before
    assert pool.num_free_blocks == 2
    assert all(b.ref_cnt == 0 for b in pool.blocks if b.block_id in before)
    check_pool(pool)
    # Exactly what is free still works.
    assert len(pool.allocate(2)) == 2
    with pytest.raises(BlockAccountingError):
        pool.allocate(1)
    check_pool(pool)


def test_touch_and_free():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.touch([a, b])
    pool.touch([a])
    assert (a.ref_cnt, b.ref_cnt) == (3, 2)
    pool.free([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (2, 1)
    assert pool.num_free_blocks == 1
    pool.free([b])
    assert b.ref_cnt == 0
    assert pool.free_queue.block_ids() == [2, b.block_id]
    pool.free([a])
    pool.free([a])
    assert a.ref_cnt == 0
    assert pool.num_free_blocks == 3
    check_pool(pool)


def test_touching_a_free_block_takes_it_out_of_the_middle_of_the_free_queue():
    pool = BlockPool(3)
    pool.touch([pool.blocks[1]])
    assert pool.blocks[1].ref_cnt == 1
    assert pool.free_queue.block_ids() == [0, 2]
    check_pool(pool)


def test_double_free_raises_and_refcount_never_negative():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(BlockAccountingError, match="double free"):
        pool.free([a])
    assert a.ref_cnt == 0
    assert pool.free_queue.block_ids().count(a.block_id) == 1
    check_pool(pool)
    # Freeing a block that was never taken is also a double free.
    with pytest.raises(BlockAccountingError):
        pool.free([pool.blocks[1]])
    assert pool.blocks[1].ref_cnt == 0
    check_pool(pool)


def test_double_free_within_one_call():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    with pytest.raises(BlockAccountingError):
        pool.free([a, a])
    # Whatever was applied before the error, nothing went negative or got queued twice.
    assert a.ref_cnt == 0
    check_pool(pool)


# ---- Rule-based model test ---------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Drive a pool with allocate/share/free in random order against a dict of ref counts."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.refs: dict[int, int] = {}
        # Expected free-queue order: a plain list is a fine model for the O(1) linked list.
        self.free_order: list[int] = []

    @precondition(lambda self: self.pool is None)
    @rule(n=st.integers(1, 12))
    def create(self, n):
        self.pool = BlockPool(n)
        self.refs = {i: 0 for i in range(n)}
        self.free_order = list(range(n))

    @precondition(lambda self: self.pool is not None)
    @rule(k=st.integers(0, 14))
    def allocate(self, k):
        if k > len(self.free_order):
            with pytest.raises(BlockAccountingError):
                self.pool.allocate(k)
            return
        taken = self.pool.allocate(k)
        expect, self.free_order = self.free_order[:k], self.free_order[k:]
        assert [b.block_id for b in taken] == expect
        for i in expect:
            self.refs[i] = 1

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data())
    def touch(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.refs)), max_size=4, unique=True))
        self.pool.touch([self.pool.blocks[i] for i in ids])
        for i in ids:
            if self.refs[i] == 0:
                self.free_order.remove(i)
            self.refs[i] += 1

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data())
    def free_owned(self, data):
        owned = sorted(i for i, r in self.refs.items() if r > 0)
        if not owned:
            return
        ids = data.draw(st.lists(st.sampled_from(owned), min_size=1, max_size=4, unique=True))
        self.pool.free([self.pool.blocks[i] for i in ids])
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                self.free_order.append(i)

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data())
    def double_free(self, data):
        unowned = sorted(i for i, r in self.refs.items() if r == 0)
        if not unowned:
            return
        i = data.draw(st.sampled_from(unowned))
        with pytest.raises(BlockAccountingError):
            self.pool.free([self.pool.blocks[i]])

    @invariant()
    def matches_model(self):
        if self.pool is None:
            return
        check_pool(self.pool)
        assert {b.block_id: b.ref_cnt for b in self.pool.blocks} == self.refs
        assert self.pool.free_queue.block_ids() == self.free_order
        assert self.pool.num_free_blocks == sum(1 for r in self.refs.values() if r == 0)


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(PROPERTY, max_examples=80, stateful_step_count=40)
