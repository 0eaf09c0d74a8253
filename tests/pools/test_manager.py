from __future__ import annotations

import attrs
import pytest
import torch

from kvferry.errors import ConfigError, InvalidTransition, PoolExhausted, RebalanceRefused, UnknownRequest
from kvferry.pools.arena import REPLAY, CacheArena
from kvferry.pools.blocks import hash_blocks
from kvferry.pools.layout import CacheLayout
from kvferry.pools.manager import CacheManager, CacheManagerConfig, CacheState, Offload
from kvferry.pools.slots import DUMMY_SLOT
from kvferry.pools.spec import preset

# tiny: target tokens_per_block 4, drafter tokens_per_block 8, one STATE group "mamba2"
STATE = "mamba2"


def make_arena(num_pages: int = 16, num_slots: int = 6, num_draft_pages: int = 8) -> CacheArena:
    layout = CacheLayout.build(
        preset("tiny").shard(1, 0),
        num_pages=num_pages,
        num_slots=num_slots,
        num_draft_pages=num_draft_pages,
        max_replay_tokens=3,
    )
    return CacheArena(layout, "cpu")


def make_manager(
    num_pages: int = 16, num_slots: int = 6, num_draft_pages: int = 8, **kwargs: object
) -> CacheManager:
    kwargs.setdefault("max_batch_size", 4)
    return CacheManager.for_arena(make_arena(num_pages, num_slots, num_draft_pages), **kwargs)  # type: ignore[arg-type]


def page_bytes(m: CacheManager, group: str, ids: list[int]) -> list[torch.Tensor]:
    assert m.arena is not None
    return [b.clone() for b in m.arena.save_pages(group, ids).blocks]


def slot_bytes(m: CacheManager, slot: int) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    assert m.arena is not None
    saved = m.arena.save_slots([slot])
    assert saved.replay is not None and saved.num_accepted is not None
    return [b.clone() for b in saved.blocks], saved.replay.clone(), int(saved.num_accepted[0])


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def run_prompt(m: CacheManager, rid: str, prompt: list[int], *, chunk_at_boundaries: bool = True) -> None:
    """Create, resume and commit the whole prompt, ending chunks at snapshot boundaries."""
    m.create(rid, prompt)
    resumed = m.resume(rid)
    done = resumed.reused_tokens
    while done < len(prompt):
        boundary = m.next_snapshot_boundary(rid) if chunk_at_boundaries else None
        end = len(prompt) if boundary is None else min(boundary, len(prompt))
        m.commit(rid, prompt[done:end])
        done = end


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


# --- prefix reuse and snapshots -----------------------------------------------------------------------------------


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
    assert slot_b not in (slot_a, snap.slot_id)
    state_b, replay_b, accepted_b = slot_bytes(m, slot_b)  # type: ignore[arg-type]
    assert same(state_b, state_at_8)
    assert not replay_b.any() and accepted_b == 0  # fresh replay state
    arena.fill_garbage(STATE, [slot_b], seed=4)
    assert same(slot_bytes(m, snap.slot_id)[0], state_at_8)


def test_draft_pages_of_the_reused_prefix_are_zeroed() -> None:
    m = make_manager(snapshot_interval=8)
    arena = m.arena
    assert arena is not None
    run_prompt(m, "a", list(range(20)))
    m.close("a")
    arena.fill_garbage("draft", list(range(1, 8)), seed=5)
    m.create("b", [*range(17), 1])
    r = m.resume("b")
    assert r.reused_tokens == 16 and r.draft_zeroed == (0, 16)
    draft = list(m.draft_block_table("b"))
    assert len(draft) == 3
    zeroed, untouched = page_bytes(m, "draft", draft[:2]), page_bytes(m, "draft", draft[2:])
    assert all(not b.any() for b in zeroed)
    assert all(b.any() for b in untouched)  # not in the reused range: the drafter writes it before reading


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


# --- all-or-nothing -------------------------------------------------------------------------------------------------


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


def test_batch_rows_run_out_without_side_effects() -> None:
    m = make_manager(num_pages=32, num_slots=8, max_batch_size=2)
    m.create("a", [1])
    m.create("b", [1])
    m.resume("a")
    m.add_dummy()
    before = m.debug_state()
    with pytest.raises(PoolExhausted):
        m.resume("b")
    with pytest.raises(PoolExhausted):
        m.add_dummy()
    assert m.debug_state() == before


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


# --- close, quarantine, dummies --------------------------------------------------------------------------------------


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


def test_dummies_never_shift_real_rows() -> None:
    m = make_manager(num_pages=32, num_slots=8, max_batch_size=6)
    for rid in "abc":
        m.create(rid, [1, 2, 3])
        m.resume(rid)
    rows = {rid: m.batch_row(rid) for rid in "abc"}
    slots = {rid: m.slot_id(rid) for rid in "abc"}
    assert rows == {"a": 0, "b": 1, "c": 2}
    d1 = m.add_dummy()
    m.suspend("b")  # b's row is free again and reset to the dummy slot
    d2 = m.add_dummy()
    assert (d1, d2) == (3, 1)
    m.create("e", [4])
    m.resume("e")
    assert m.batch_row("e") == 4
    for rid in "ac":
        assert m.batch_row(rid) == rows[rid]
        assert m.state_indices[rows[rid]].item() == slots[rid]
    assert m.state_indices.tolist() == [
        slots["a"],
        DUMMY_SLOT,
        slots["c"],
        DUMMY_SLOT,
        m.slot_id("e"),
        DUMMY_SLOT,
    ]
    m.remove_dummy(d1)
    m.remove_dummy(d1)
    m.close("a")
    assert m.state_indices[0].item() == DUMMY_SLOT
    with pytest.raises(UnknownRequest):
        m.batch_row("a")
    assert m.batch_row("b") is None
    tensor = m.state_indices
    m.resume("b")
    assert m.batch_row("b") == 0 and m.state_indices is tensor


# --- suspend / offload / resume ----------------------------------------------------------------------------------


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


# --- rebalance -------------------------------------------------------------------------------------------------------


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


def test_rebalance_refused_when_replay_buffers_cannot_grow() -> None:
    m = make_manager(num_pages=8, num_slots=3, num_draft_pages=4)
    bigger = CacheLayout.build(
        preset("tiny").shard(1, 0), num_pages=8, num_slots=6, num_draft_pages=4, max_replay_tokens=3
    )
    stuck = attrs.evolve(bigger, replay=attrs.evolve(bigger.replay, num_slots=3))
    before = m.debug_state()
    with pytest.raises(RebalanceRefused, match="replay buffers"):
        m.rebalance(num_slots=6, arena=CacheArena(stuck, "cpu"))
    assert m.debug_state() == before


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
