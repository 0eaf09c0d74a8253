"""Prefix reuse of attention pages and snapshots (kvferry.pools.prefix), through the manager."""

from __future__ import annotations

import pytest

from kvferry.errors import InvalidTransition, PoolExhausted
from kvferry.pools.arena import REPLAY
from kvferry.pools.blocks import hash_blocks
from tests.support.pools_factories import STATE, make_manager, run_prompt, same, slot_bytes


def test_reuse_hit_is_pruned_to_the_last_snapshot() -> None:
    m = make_manager(num_pages=32, num_draft_pages=24, snapshot_interval=8, max_batch_size=8)
    prompt = list(range(20))
    run_prompt(m, "a", prompt)
    a_pages = list(m.block_table("a"))
    assert m.statistics().snapshots_taken == 3  # at 8 and 16 (interval) and 20 (prompt end)
    hashes = hash_blocks(prompt, 4)
    snapshots = {s.block_hash: s.num_tokens for s in m._pools.slots.snapshots()}  # type: ignore[union-attr]
    assert snapshots == {hashes[1]: 8, hashes[3]: 16, hashes[4]: 20}
    m.suspend("a")
    # b shares 14 tokens: 3 full blocks match pages, pruned back to the snapshot at 8
    assert m.create("b", [*prompt[:14], 99, 99, 99, 99]) == 8
    r = m.resume("b")
    assert r.reused_tokens == 8 and r.draft_zeroed == (0, 8)
    assert list(m.block_table("b"))[:2] == a_pages[:2]
    assert m._pools.pages.ref_cnt(a_pages[0]) == 2
    assert m.num_committed_tokens("b") == 8
    # c extends the prompt: the match covers 5 blocks (prompt_len - 1 = 20) and the snapshot at 20
    m.create("c", [*prompt, 5])
    assert m.resume("c").reused_tokens == 20
    # misses: another salt, a one-block prompt, reuse off
    m.create("d", prompt, salt=b"other")
    m.create("e", prompt[:4])
    m.create("f", prompt, reuse=False)
    for rid in "def":
        assert m.resume(rid).reused_tokens == 0
    s = m.statistics()
    assert (s.reuse_queries, s.reuse_hits, s.reuse_hit_tokens) == (5, 2, 28)


def test_snapshot_bytes_are_copied_never_shared() -> None:
    m = make_manager(snapshot_interval=8)
    arena = m.arena
    assert arena is not None
    m.create("a", list(range(12)))
    m.resume("a")
    slot_a = m.slot_id("a")
    assert slot_a is not None
    arena.fill_garbage(STATE, [slot_a], seed=1)
    state_at_8 = slot_bytes(m, slot_a)[0]
    m.commit("a", list(range(8)))  # snapshot of the live slot at 8
    [snap] = m._pools.slots.snapshots()  # type: ignore[union-attr]
    assert same(slot_bytes(m, snap.slot_id)[0], state_at_8)
    arena.fill_garbage(STATE, [slot_a], seed=2)  # the request moves on; the snapshot must not
    m.commit("a", list(range(8, 12)))
    assert same(slot_bytes(m, snap.slot_id)[0], state_at_8)
    m.create("b", [*range(8), 50, 51, 52])
    arena.fill_garbage(REPLAY, list(range(1, 6)), seed=3)
    assert m.resume("b").reused_tokens == 8
    slot_b = m.slot_id("b")
    assert slot_b is not None
    assert slot_b not in (slot_a, snap.slot_id)
    state_b, replay_b, accepted_b = slot_bytes(m, slot_b)
    assert same(state_b, state_at_8)
    assert not replay_b.any() and accepted_b == 0  # fresh replay state
    arena.fill_garbage(STATE, [slot_b], seed=4)
    assert same(slot_bytes(m, snap.slot_id)[0], state_at_8)


def test_snapshot_through_speculative_replay() -> None:
    m = make_manager(snapshot_interval=8)
    m.create("a", list(range(5)))
    m.resume("a", capacity=20)
    m.commit("a", list(range(5)))  # prompt end 4 is inside the chunk: no snapshot (slot at 5)
    assert m.statistics().snapshots_taken == 0
    assert m.next_snapshot_boundary("a") == 8
    # a verify step accepts 3 tokens: committed 8, but the slot is still at 5 (3 pending in replay buffers)
    m.commit("a", [5, 6, 7], num_pending_replay=3)
    assert m.statistics().snapshots_taken == 0
    # next step replays them onto the slot (now at 8) and accepts 2 more, pending
    m.commit("a", [8, 9], num_pending_replay=2)
    assert [s.num_tokens for s in m._pools.slots.snapshots()] == [8]  # type: ignore[union-attr]
    with pytest.raises(InvalidTransition):  # the slot cannot move backwards
        m.commit("a", [10], num_pending_replay=4)


def test_pinned_snapshot_survives_pressure_until_first_resume() -> None:
    m = make_manager(num_slots=4, snapshot_interval=4)  # usable slots 1..3
    m.create("a", list(range(9)))
    m.resume("a")
    m.commit("a", list(range(4)))
    m.commit("a", list(range(4, 8)))
    assert m.statistics().slots_snapshot == 2
    m.close("a")
    m.create("b", [*range(8), 1, 2])  # pins the snapshot at 8
    m.create("x", [7])
    m.create("y", [7])
    m.resume("x")
    m.resume("y")  # evicts the snapshot at 4, never the pinned one
    assert [s.num_tokens for s in m._pools.slots.snapshots()] == [8]  # type: ignore[union-attr]
    m.create("z", [7])
    before = m.debug_state()
    with pytest.raises(PoolExhausted):
        m.resume("z")
    assert m.debug_state() == before
    m.close("x")
    assert m.resume("b").reused_tokens == 8
