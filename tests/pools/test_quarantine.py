"""Quarantines (kvferry.pools.quarantine): a closed request's memory held back while a transfer may touch it."""

from __future__ import annotations

import pytest

from kvferry.errors import PoolExhausted, RebalanceRefused, UnknownRequest
from tests.support.pools_factories import make_manager


def test_quarantine_keeps_pages_until_released() -> None:
    m = make_manager(num_pages=6, num_slots=3, num_draft_pages=4)
    m.create("a", list(range(8)))
    m.resume("a")
    pages, slot = list(m.block_table("a")), m.slot_id("a")
    q = m.close("a", quarantine=True)
    assert q is not None and q.pages == tuple(pages) and q.slot == slot
    s = m.statistics()
    assert (s.pages_quarantined, s.slots_quarantined, s.quarantines) == (2, 1, 1)
    m.create("b", list(range(12)))
    m.resume("b")
    assert not set(m.block_table("b")) & set(pages) and m.slot_id("b") != slot
    m.create("c", [1])
    with pytest.raises(PoolExhausted):
        m.resume("c")  # one usable slot is b's, the other quarantined
    with pytest.raises(RebalanceRefused):
        m.rebalance(num_pages=8)
    m.release(q)
    m.release(q)
    assert m.resume("c").reused_tokens == 0
    assert m.slot_id("c") == slot
    assert m.statistics().quarantines == 0


def test_a_quarantine_goes_back_only_to_its_own_manager() -> None:
    m, other = make_manager(), make_manager()
    m.create("a", [1, 2, 3])
    m.resume("a")
    q = m.close("a", quarantine=True)
    assert q is not None
    before = other.debug_state()
    with pytest.raises(UnknownRequest):
        other.release(q)
    assert other.debug_state() == before and not q.released
    m.release(q)
    assert q.released and m.statistics().pages_quarantined == 0
