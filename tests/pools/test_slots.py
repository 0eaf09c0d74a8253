from __future__ import annotations

import pytest

from kvferry.errors import InvalidTransition, PoolExhausted
from kvferry.pools.blocks import hash_blocks
from kvferry.pools.slots import SlotPool

H = hash_blocks(list(range(40)), 4)


def test_fifo_live_slots() -> None:
    pool = SlotPool(5)
    assert pool.allocate(2) == [1, 2]
    pool.free([1])
    assert pool.free_slot_ids() == [3, 4, 1]
    assert pool.allocate(1) == [3]
    with pytest.raises(InvalidTransition):
        pool.free([1])


def test_snapshots_evicted_lru_never_pinned() -> None:
    pool = SlotPool(5)  # usable 1..4
    [live] = pool.allocate(1)
    assert pool.add_snapshot(H[0], 4) == 2
    assert pool.add_snapshot(H[1], 8) == 3
    assert pool.add_snapshot(H[2], 12) == 4
    assert pool.add_snapshot(H[0], 4) is None  # already there: marked recently used
    assert [s.slot_id for s in pool.snapshots()] == [3, 4, 2]
    pool.pin(H[1])
    # no free slot: a new snapshot evicts the LRU unpinned one (slot 4; slot 3 is pinned)
    assert pool.add_snapshot(H[3], 16) == 4
    assert pool.snapshot(H[2]) is None
    assert pool.statistics() == (4, 1, 3, 1, 0)
    # a live allocation evicts snapshots too, LRU first, still never the pinned one
    assert pool.allocate(2) == [2, 4]
    assert [s.slot_id for s in pool.snapshots()] == [3]
    assert pool.snapshots_evicted == 3
    before = pool.debug_state()
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert pool.add_snapshot(H[4], 20) is None
    assert pool.debug_state() == before
    pool.unpin(H[1])
    assert pool.allocate(1) == [3]
    pool.free([live, 2, 4, 3])
    assert pool.statistics() == (4, 0, 0, 0, 4)


def test_clear_snapshots_keeps_pinned() -> None:
    pool = SlotPool(4)
    pool.add_snapshot(H[0], 4)
    pool.add_snapshot(H[1], 8)
    pool.pin(H[0])
    assert pool.clear_snapshots() == 1
    assert [s.block_hash for s in pool.snapshots()] == [H[0]]
    with pytest.raises(InvalidTransition):
        pool.unpin(H[1])
