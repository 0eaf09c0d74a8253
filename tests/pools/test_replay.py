"""Replay state (kvferry.pools.replay): num_accepted written now, deferred, into host copies, and dropped."""

from __future__ import annotations

import pytest
import torch

from kvferry.errors import PoolExhausted
from kvferry.pools.manager import Offload
from tests.support.pools_factories import arena_bytes, busy_manager, same


def test_deferred_num_accepted_lands_at_flush_and_before_slots_move() -> None:
    m = busy_manager(5, num_pages=32)
    assert m.arena is not None
    accepted = m.arena.num_accepted
    for rid in ("a", "b", "c"):
        m.create(rid, [1, 2, 3])
        m.resume(rid)
    slot = {rid: m.slot_id(rid) for rid in ("a", "b", "c")}
    before = accepted.clone()
    m.set_num_accepted("a", 2, defer=True)
    m.set_num_accepted("b", 1, defer=True)
    m.set_num_accepted("a", 3, defer=True)  # the last one counts
    assert torch.equal(accepted, before)  # nothing written yet
    m.commit_many([("a", [1, 2, 3], 3), ("b", [1, 2, 3], 1)])  # commits leave them queued
    assert torch.equal(accepted, before)
    m.flush_num_accepted()
    assert (int(accepted[slot["a"]]), int(accepted[slot["b"]])) == (3, 1)
    assert torch.equal(accepted[slot["c"]], before[slot["c"]])

    m.set_num_accepted("a", 1, defer=True)
    m.suspend("a", offload=Offload.NOW)  # the host copy carries the queued value
    m.create("d", [4])
    m.resume("d")
    m.resume("a")  # restored into another slot, with its num_accepted
    assert int(accepted[m.slot_id("a")]) == 1

    m.set_num_accepted("b", 2, defer=True)
    m.close("b")  # written first: nothing queued can reach the slot's next owner
    assert int(accepted[slot["b"]]) == 2 and m.debug_state()[-1] == ()

    m.set_num_accepted("c", 2, defer=True)
    m.drop_replay("c")  # forgets it
    m.flush_num_accepted()
    assert int(accepted[slot["c"]]) == 0


def test_deferred_num_accepted_survives_a_refused_operation() -> None:
    m = busy_manager(6, num_pages=8)
    assert m.arena is not None
    m.create("a", [1, 2, 3])
    m.resume("a")
    m.set_num_accepted("a", 2, defer=True)
    m.create("big", list(range(40)))
    before, before_bytes = m.debug_state(), arena_bytes(m)
    with pytest.raises(PoolExhausted):
        m.resume("big")
    with pytest.raises(PoolExhausted):
        m.grow_many([("a", 100)])
    assert m.debug_state() == before and same(arena_bytes(m), before_bytes)
    m.flush_num_accepted()
    assert int(m.arena.num_accepted[m.slot_id("a")]) == 2
