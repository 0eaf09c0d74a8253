"""LockstepCache's batch calls: every rank makes the same change, or (refused on rank 0) none does."""

from __future__ import annotations

import pytest

from kvferry.engine.runner import LockstepCache
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
