"""LockstepCache's batch calls: every rank makes the same change, or (refused on rank 0) none does."""

from __future__ import annotations

import pytest

from kvferry.engine.runner import EngineOptions, LockstepCache, build_engine
from kvferry.errors import InvalidTransition, PoolExhausted
from kvferry.pools.manager import CacheManager, CacheManagerConfig


def make_cache(tp: int = 2) -> LockstepCache:
    config = CacheManagerConfig(
        tokens_per_block=4, num_pages=12, num_slots=5, max_batch_size=4, snapshot_interval=4
    )
    return LockstepCache(tuple(CacheManager(config) for _ in range(tp)))


def test_batches_run_on_every_rank_or_none() -> None:
    cache = make_cache()
    for rid, prompt in ((1, [1, 2, 3, 4, 5]), (2, [1, 2, 3, 4, 6, 7])):
        cache.create(rid, prompt)
        cache.resume(rid)
    cache.commit_many([(1, [1, 2, 3, 4, 5], 0), (2, [1, 2, 3, 4], 0), (2, [6, 7], 1)])
    cache.grow_many([(1, 9), (2, 12)])
    states = [m.debug_state() for m in cache.managers]
    assert states[0] == states[1]
    assert [m.num_committed_tokens(2) for m in cache.managers] == [6, 6]
    assert cache.block_table(1) == (1, 2, 5) and cache.block_table(2) == (3, 4, 6)
    with pytest.raises(PoolExhausted):
        cache.grow_many([(1, 12), (2, 40)])
    with pytest.raises(InvalidTransition):
        cache.commit_many([(1, [8], 0), (2, [1], 5)])
    assert [m.debug_state() for m in cache.managers] == states


def test_deferred_num_accepted_reaches_every_rank_at_flush() -> None:
    built = build_engine("tiny", EngineOptions(tp=2, max_spec_k=2, num_pages=32, max_running=4))
    cache = built.cache
    for rid in (1, 2):
        cache.create(rid, [1, 2, 3])
        cache.resume(rid)
    cache.set_num_accepted(1, 3, defer=True)
    cache.set_num_accepted(2, 1, defer=True)
    assert all(int(a.num_accepted.sum()) == 0 for a in built.arenas)
    cache.flush_num_accepted()
    for arena in built.arenas:
        assert [int(arena.num_accepted[cache.slot_id(rid)]) for rid in (1, 2)] == [3, 1]


def test_block_tables_are_the_live_lists_replaced_when_a_cache_moves() -> None:
    from kvferry.errors import UnknownRequest

    built = build_engine("tiny", EngineOptions(num_pages=32, max_running=4))
    cache = built.cache
    for rid in (1, 2):
        cache.create(rid, [1, 2, 3, 4, 5])
        cache.resume(rid)
    first = cache.block_tables([2, 1])
    assert [tuple(t) for t in first] == [cache.block_table(2), cache.block_table(1)]
    cache.grow_many([(1, 16)])
    grown = cache.block_tables([1])[0]
    assert grown is first[1] and len(grown) == 4  # pages appended: the same list
    cache.suspend(1)
    cache.offload(1)
    cache.resume(1)
    moved = cache.block_tables([1])[0]
    assert moved is not first[1]  # the cache moved to the host and back: another list
    with pytest.raises(UnknownRequest):
        cache.block_tables([1, 7])
