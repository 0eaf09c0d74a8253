"""Rebalance (kvferry.pools.rebalance): new pool sizes, refused unless nothing can touch the old pools."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvferry.errors import RebalanceRefused
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.manager import CacheManager
from kvferry.pools.spec import preset
from tests.support.pools_factories import STATE, make_manager, page_bytes, same, slot_bytes


def test_rebalance_moves_suspended_requests_and_keeps_bytes() -> None:
    m = make_manager(num_pages=8, num_slots=3, num_draft_pages=4)
    m.create("a", list(range(6)))
    m.resume("a")
    with pytest.raises(RebalanceRefused):
        m.rebalance(num_pages=12)
    pages, slot = list(m.block_table("a")), m.slot_id("a")
    m.arena.fill_garbage("attention", pages, seed=30)  # type: ignore[union-attr]
    m.arena.fill_garbage(STATE, [slot], seed=31)  # type: ignore[union-attr, list-item]
    expected = page_bytes(m, "attention", pages), slot_bytes(m, slot)  # type: ignore[arg-type]
    m.suspend("a")
    m.add_dummy()
    with pytest.raises(RebalanceRefused):
        m.rebalance(num_pages=12)
    m.remove_dummy(0)
    old_arena = m.arena
    m.rebalance(num_pages=12, num_slots=5)
    assert m.arena is not old_arena and m.arena.layout.pool_group("attention").num_slots == 12  # type: ignore[union-attr]
    assert m.statistics().pages_free == 11 and m.statistics().slots_free == 4
    assert m.resume("a").restored
    assert same(page_bytes(m, "attention", list(m.block_table("a"))), expected[0])
    state, replay, accepted = slot_bytes(m, m.slot_id("a"))  # type: ignore[arg-type]
    assert same(state, expected[1][0]) and torch.equal(replay, expected[1][1]) and accepted == expected[1][2]


def _layout(model: str, num_slots: int) -> CacheLayout:
    return CacheLayout.build(
        preset(model).shard(1, 0), num_pages=8, num_slots=num_slots, num_draft_pages=4, max_replay_tokens=3
    )


def _refused_onto_short_replay_buffers(m: CacheManager, model: str, replay_slots: int) -> None:
    """A rebalance to 6 slots onto an arena whose replay buffers hold only ``replay_slots``: refused, nothing
    changed."""
    bigger = _layout(model, 6)
    stuck = attrs.evolve(bigger, replay=attrs.evolve(bigger.replay, num_slots=replay_slots))
    before = m.debug_state()
    with pytest.raises(RebalanceRefused, match="replay buffers"):
        m.rebalance(num_slots=6, arena=CacheArena(stuck, "cpu"))
    assert m.debug_state() == before


def test_rebalance_refused_when_replay_buffers_cannot_grow() -> None:
    _refused_onto_short_replay_buffers(make_manager(num_pages=8, num_slots=3, num_draft_pages=4), "tiny", 3)


def test_kda_replay_buffers_grow_with_the_state_pool_or_the_rebalance_is_refused() -> None:
    m = CacheManager.for_arena(CacheArena(_layout("tiny-kimi", 3), "cpu"), max_batch_size=4)
    m.create("a", list(range(6)))
    m.resume("a")
    slot = m.slot_id("a")
    assert slot is not None and m.arena is not None
    m.arena.fill_garbage("replay", [slot], seed=4)
    m.set_num_accepted("a", 2)
    expected = slot_bytes(m, slot)
    m.suspend("a")
    _refused_onto_short_replay_buffers(m, "tiny-kimi", 5)  # one slot short of the new state pool
    m.rebalance(num_slots=6)
    assert m.arena.layout.replay.num_slots == 6 and m.arena.layout.replay.max_tokens == 3
    assert m.resume("a").restored
    state, replay, accepted = slot_bytes(m, m.slot_id("a"))  # type: ignore[arg-type]
    assert same(state, expected[0]) and torch.equal(replay, expected[1]) and accepted == 2
