"""Offload of suspended requests to the host and their restore (kvferry.pools.offload)."""

from __future__ import annotations

import pytest
import torch

from kvferry.errors import PoolExhausted
from kvferry.pools.arena import REPLAY
from kvferry.pools.manager import Offload
from tests.support.pools_factories import STATE, make_manager, page_bytes, run_prompt, same, slot_bytes


def test_suspend_resume_into_other_pages_and_slot_keeps_every_byte() -> None:
    m = make_manager(num_pages=8, num_slots=5, num_draft_pages=6)
    arena = m.arena
    assert arena is not None
    m.create("a", list(range(10)))
    m.resume("a", capacity=12)
    m.commit("a", list(range(8)))  # snapshot at the prompt's last full block
    m.commit("a", [8, 9])
    pages, draft, slot = list(m.block_table("a")), list(m.draft_block_table("a")), m.slot_id("a")
    assert slot is not None
    arena.fill_garbage("attention", pages, seed=10)
    arena.fill_garbage("draft", draft, seed=11)
    arena.fill_garbage(STATE, [slot], seed=12)
    arena.fill_garbage(REPLAY, [slot], seed=13)
    m.set_num_accepted("a", 2)
    expected = (page_bytes(m, "attention", pages), page_bytes(m, "draft", draft), slot_bytes(m, slot))
    m.suspend("a")
    # b needs every page: a moves to the host
    m.create("b", list(range(100, 128)))
    m.resume("b")
    assert m.is_offloaded("a") and m.statistics().requests_offloaded == 1
    assert set(pages) <= set(m.block_table("b"))
    arena.fill_garbage("attention", list(m.block_table("b")), seed=20)
    arena.fill_garbage(STATE, [m.slot_id("b")], seed=21)  # type: ignore[list-item]
    m.set_num_accepted("a", 3)  # lands in the host copy, not in a's old slot
    assert slot_bytes(m, slot)[2] != 3
    # c keeps some of those pages busy so a must land elsewhere
    m.suspend("b", offload=Offload.NOW)
    m.create("c", [1, 2, 3, 4, 5])
    m.resume("c")
    r = m.resume("a")
    assert r.restored and not r.first
    new_pages, new_draft, new_slot = list(m.block_table("a")), list(m.draft_block_table("a")), m.slot_id("a")
    assert new_pages != pages and new_slot is not None
    assert same(page_bytes(m, "attention", new_pages), expected[0])
    assert same(page_bytes(m, "draft", new_draft), expected[1])
    state, replay, accepted = slot_bytes(m, new_slot)
    assert same(state, expected[2][0]) and torch.equal(replay, expected[2][1]) and accepted == 3
    # the prefix index points at the restored pages again
    m.create("d", [*range(10), 7])
    assert m.resume("d").reused_tokens == 8


def test_offload_never_is_not_moved() -> None:
    m = make_manager(num_pages=8, num_slots=3, num_draft_pages=4)
    run_prompt(m, "a", list(range(10)))
    m.suspend("a", offload=Offload.NEVER)
    m.create("b", list(range(100, 128)))
    with pytest.raises(PoolExhausted):
        m.resume("b")
    assert not m.is_offloaded("a")


def test_pressure_never_moves_anything_when_it_cannot_help() -> None:
    m = make_manager(num_pages=8, num_slots=4, num_draft_pages=8)
    run_prompt(m, "a", list(range(8)))  # 2 pages
    m.suspend("a")
    m.create("b", list(range(40)))  # 10 pages > 7 usable even with a's 2
    before = m.debug_state()
    with pytest.raises(PoolExhausted):
        m.resume("b")
    assert m.debug_state() == before
    assert not m.is_offloaded("a")


def test_pin_brings_a_request_back_without_a_batch_row_and_keeps_it_there() -> None:
    """A held cache the engine moved to the host comes back for its push (every byte, new pages and slot) while
    every batch row is taken, and stays on the device under pressure until it is resumed or closed."""
    m = make_manager(num_pages=8, num_slots=4, num_draft_pages=6, max_batch_size=1)
    arena = m.arena
    assert arena is not None
    run_prompt(m, "a", list(range(10)))
    pages, draft, slot = list(m.block_table("a")), list(m.draft_block_table("a")), m.slot_id("a")
    assert slot is not None
    arena.fill_garbage("attention", pages, seed=3)
    arena.fill_garbage(STATE, [slot], seed=4)
    expected = (page_bytes(m, "attention", pages), page_bytes(m, "draft", draft), slot_bytes(m, slot))
    m.suspend("a")
    m.create("b", list(range(100, 120)))
    m.resume("b")  # takes the only batch row and pushes a to the host
    assert m.is_offloaded("a")
    m.suspend("b")
    m.create("c", [1, 2, 3])
    m.resume("c")  # the row is taken again
    assert m.pin("a") is True
    assert not m.is_offloaded("a")
    new_pages, new_slot = list(m.block_table("a")), m.slot_id("a")
    assert new_slot is not None
    assert same(page_bytes(m, "attention", new_pages), expected[0])
    assert same(page_bytes(m, "draft", list(m.draft_block_table("a"))), expected[1])
    assert same(slot_bytes(m, new_slot)[0], expected[2][0])
    # pinned: pressure moves b, never a
    m.create("d", list(range(200, 216)))
    with pytest.raises(PoolExhausted):
        m.resume("d")  # the row is still c's
    m.suspend("c")
    m.resume("d")
    assert not m.is_offloaded("a") and m.is_offloaded("b")
    assert m.pin("a") is False  # already on the device: nothing moves
    m.close("a")
    m.close("b")
    m.close("c")
    m.close("d")
    s = m.statistics()
    assert s.pages_free == s.pages_total and s.requests_active + s.requests_suspended == 0


def test_pin_refuses_what_cannot_fit_and_changes_nothing() -> None:
    m = make_manager(num_pages=8, num_slots=4, num_draft_pages=8)
    run_prompt(m, "a", list(range(8)))
    m.suspend("a", offload=Offload.NOW)
    run_prompt(m, "b", list(range(100, 128)))  # every page, active: cannot move
    before = m.debug_state()
    with pytest.raises(PoolExhausted):
        m.pin("a")
    assert m.debug_state() == before and m.is_offloaded("a")
