"""CacheManager.grow_many (kvferry.pools.capacity): exactly the one-by-one grows when those succeed, nothing at
all when not."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvferry.errors import InvalidTransition, PoolExhausted, UnknownRequest
from kvferry.pools.manager import CacheManager
from tests.support.pools_factories import (
    active,
    arena_bytes,
    batch_vs_one_by_one,
    same,
    scenario,
    two_active_one_suspended,
)


@given(seed=st.integers(0, 2**16), data=st.data())
@settings(max_examples=60, deadline=None)
def test_grow_many_is_grow_one_by_one_or_nothing(seed: int, data: st.DataObject) -> None:
    m, _ = scenario(seed)
    rids = active(m) + (["unknown"] if data.draw(st.integers(0, 9)) == 0 else [])
    grows = (
        data.draw(st.lists(st.tuples(st.sampled_from(rids), st.integers(0, 36)), max_size=6)) if rids else []
    )

    def one_by_one(m: CacheManager) -> None:
        for rid, capacity in grows:
            m.grow(rid, capacity)

    batch_vs_one_by_one(seed, one_by_one, lambda m: m.grow_many(grows))


def test_grow_many_moves_the_same_suspended_requests_to_the_host() -> None:
    """Grows that fit only after offloading: the batch moves the same requests (LRU) and takes the same pages."""
    moved = 0
    for seed in range(40):
        m, _ = scenario(seed)
        rids = active(m)
        if len(rids) < 2:
            continue
        free = m.statistics().pages_free
        grows = [(rid, 4 * (len(m.block_table(rid)) + free // 2 + 1)) for rid in rids[:2]]

        def one_by_one(m: CacheManager, grows: list[tuple[str, int]] = grows) -> None:
            for rid, capacity in grows:
                m.grow(rid, capacity)

        def batch(m: CacheManager, grows: list[tuple[str, int]] = grows) -> None:
            m.grow_many(grows)

        error, batched = batch_vs_one_by_one(seed, one_by_one, batch)
        if error is None and batched.statistics().offloads > m.statistics().offloads:
            moved += 1
    assert moved >= 10


def test_bad_grows_change_nothing() -> None:
    m = two_active_one_suspended(11)
    before, before_bytes = m.debug_state(), arena_bytes(m)
    bad_grows: list[tuple[list[tuple[str, int]], type[Exception]]] = [
        ([("a", 12), ("nope", 12)], UnknownRequest),
        ([("a", 12), ("s", 12)], InvalidTransition),
        ([("a", 12), ("b", 10_000)], PoolExhausted),
    ]
    for grows, error in bad_grows:
        with pytest.raises(error):
            m.grow_many(grows)
        assert m.debug_state() == before
    assert same(arena_bytes(m), before_bytes)
    m.grow_many([("a", 12), ("a", 9)])  # the smaller one is a no-op
    assert m.capacity("a") == 12 and len(m.block_table("a")) == 3


def test_grow_many_without_offload_refuses_what_needs_a_move_and_grows_the_rest() -> None:
    refused = grown = 0
    for seed in range(40):
        m, _ = scenario(seed)
        rids = active(m)
        if len(rids) < 2:
            continue
        free = m.statistics().pages_free
        # more pages than are free (the moving batch above), or what the free pages hold
        extra = free // 2 + 1 if seed % 2 else free // 2
        grows = [(rid, 4 * (len(m.block_table(rid)) + extra)) for rid in rids[:2]]
        before, before_bytes = m.debug_state(), arena_bytes(m)
        try:
            m.grow_many(grows, offload=False)
        except PoolExhausted:
            refused += 1
            assert m.debug_state() == before  # nothing moved to the host, nothing taken
            assert same(arena_bytes(m), before_bytes)
            continue
        grown += 1
        assert m.statistics().offloads == before[0].offloads
        assert [m.capacity(rid) for rid, _ in grows] == [capacity for _, capacity in grows]
    assert refused >= 10 and grown >= 1
