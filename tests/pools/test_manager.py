"""CacheManager as a whole: exact ids through the lifecycle, statistics, all-or-nothing operations, close."""

from __future__ import annotations

import pytest
import torch

from kvferry.errors import ConfigError, InvalidTransition, PoolExhausted, UnknownRequest
from kvferry.pools.manager import CacheManager, CacheManagerConfig, CacheState, Offload
from kvferry.pools.slots import DUMMY_SLOT
from tests.support.pools_factories import make_arena, make_manager, run_prompt

# --- exact ids -------------------------------------------------------------------------------------------------


def test_exact_ids_through_the_lifecycle() -> None:
    m = make_manager()
    m.create("a", list(range(10)))
    assert m.state("a") is CacheState.SUSPENDED
    assert m.block_table("a") == [] and m.slot_id("a") is None
    r = m.resume("a")
    assert (r.reused_tokens, r.first, r.restored) == (0, True, False)
    assert list(m.block_table("a")) == [1, 2, 3]  # ceil(10 / 4)
    assert list(m.draft_block_table("a")) == [1, 2]  # ceil(10 / 8)
    assert m.slot_id("a") == 1 and m.batch_row("a") == 0
    m.create("b", [100 + i for i in range(5)])
    m.resume("b", capacity=9)
    assert list(m.block_table("b")) == [4, 5, 6]
    assert m.slot_id("b") == 2 and m.batch_row("b") == 1
    m.grow("b", 13)
    assert list(m.block_table("b")) == [4, 5, 6, 7]
    assert list(m.draft_block_table("b")) == [3, 4]
    assert m.state_indices.tolist() == [1, 2, DUMMY_SLOT, DUMMY_SLOT]
    m.close("a")
    m.close("b")
    # freed in reverse block-table order, a's then b's: their tail blocks are evicted first
    assert m._pools.pages.free_page_ids() == [8, 9, 10, 11, 12, 13, 14, 15, 3, 2, 1, 7, 6, 5, 4]
    assert m.state_indices.tolist() == [DUMMY_SLOT] * 4
    s = m.statistics()
    assert (s.pages_free, s.slots_free, s.draft_pages_free) == (15, 5, 7)


def test_repr_and_statistics() -> None:
    m = make_manager(snapshot_interval=8)
    run_prompt(m, "a", list(range(10)))
    s = m.statistics()
    assert (s.pages_used, s.pages_cached, s.slots_live, s.slots_snapshot, s.draft_pages_used) == (
        3,
        2,
        1,
        1,
        2,
    )
    assert s.bytes_per_token > 0 and s.bytes_per_slot > 0
    assert s.bytes_per_token == m.arena.layout.bytes_per_token("attention") + m.arena.layout.bytes_per_token(  # type: ignore[union-attr]
        "draft"
    )
    text = repr(m)
    assert "pages: 3 used, 12 free, 2 cached" in text
    assert "slots: 1 live, 1 snapshot, 3 free" in text
    assert "draft pages: 2 used, 5 free" in text
    assert "reuse: 0/1 hits" in text


# --- all-or-nothing --------------------------------------------------------------------------------------------


def test_exhaustion_changes_nothing() -> None:
    m = make_manager(num_pages=8, num_slots=3, num_draft_pages=4, offload_under_pressure=False)
    run_prompt(m, "a", list(range(12)))  # 3 pages, 2 draft pages, 1 slot
    m.create("b", list(range(100, 130)))  # needs 8 pages
    m.create("c", [1, 2, 3])
    snapshot = m.debug_state()
    arena_bytes = {name: t.clone() for name, t in m.arena.pool_tensors().items()}  # type: ignore[union-attr]
    with pytest.raises(PoolExhausted):
        m.resume("b")
    with pytest.raises(PoolExhausted):
        m.grow("a", 40)
    with pytest.raises(PoolExhausted):  # attention pages would fit, draft pages do not
        m.grow("a", 25)
    assert m.debug_state() == snapshot
    assert all(torch.equal(t, arena_bytes[n]) for n, t in m.arena.pool_tensors().items())  # type: ignore[union-attr]
    m.resume("c")  # takes the slot of a's prompt-end snapshot
    assert m.statistics().slots_snapshot == 0
    m.create("d", [1])
    with pytest.raises(PoolExhausted):  # both usable slots are live
        m.resume("d")


def test_bad_commits_change_nothing() -> None:
    m = make_manager()
    m.create("a", [1, 2, 3, 4, 5])
    m.resume("a")
    before = m.debug_state()
    with pytest.raises(InvalidTransition):
        m.commit("a", [1, 2, 3, 9])  # disagrees with the prompt
    with pytest.raises(InvalidTransition):
        m.commit("a", [1, 2, 3, 4, 5, 6])  # past capacity
    with pytest.raises(InvalidTransition):
        m.resume("a")
    with pytest.raises(ConfigError):
        m.commit("a", [[1, 2]])  # type: ignore[list-item]
    with pytest.raises(InvalidTransition):
        m.create("a", [1])
    with pytest.raises(UnknownRequest):
        m.grow("nope", 3)
    assert m.debug_state() == before


# --- close -----------------------------------------------------------------------------------------------------


def test_double_close_is_harmless() -> None:
    m = make_manager(snapshot_interval=4)
    run_prompt(m, "a", list(range(9)))
    m.create("b", [*range(8), 3])  # never resumed: holds pages and a pin
    initial = m.statistics()
    assert m.close("b") is None
    assert m.close("b") is None
    assert m.close("a") is None
    assert m.close("a") is None
    assert m.close("never-existed") is None
    s = m.statistics()
    assert (s.pages_free, s.slots_free + s.slots_snapshot, s.draft_pages_free) == (15, 5, 7)
    assert s.slots_live == 0 and initial.slots_live == 1
    with pytest.raises(UnknownRequest):
        m.state("a")


# --- config ----------------------------------------------------------------------------------------------------


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        CacheManagerConfig(tokens_per_block=4, num_pages=8, snapshot_interval=6)
    with pytest.raises(ConfigError):
        CacheManagerConfig(tokens_per_block=4, num_pages=8, num_slots=1)
    with pytest.raises(ConfigError):
        CacheManager(CacheManagerConfig(tokens_per_block=4, num_pages=9, num_slots=6), make_arena())


def test_bookkeeping_only_manager() -> None:
    m = CacheManager(CacheManagerConfig(tokens_per_block=2, num_pages=5, num_slots=3, snapshot_interval=2))
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    m.suspend("a", offload=Offload.NOW)
    assert m.statistics().pages_free == 4
    assert m.resume("a").restored
    assert list(m.block_table("a")) == [4, 3, 2]
