"""CacheManager.grow_many / commit_many: exactly the one-by-one calls when those succeed, nothing at all when not."""

from __future__ import annotations

import random
from collections.abc import Callable

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from kvferry.errors import ConfigError, InvalidTransition, KvferryError, PoolExhausted, UnknownRequest
from kvferry.pools.arena import REPLAY, CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.manager import CacheManager, CacheState, Offload
from kvferry.pools.spec import preset

# tiny: target tokens_per_block 4, drafter tokens_per_block 8, one STATE group "mamba2"
STATE = "mamba2"
NUM_PAGES, NUM_SLOTS, NUM_DRAFT_PAGES = 14, 8, 9

Commit = tuple[str, list[int], int]


def new_manager(seed: int, num_pages: int = NUM_PAGES) -> CacheManager:
    layout = CacheLayout.build(
        preset("tiny").shard(1, 0),
        num_pages=num_pages,
        num_slots=NUM_SLOTS,
        num_draft_pages=NUM_DRAFT_PAGES,
        max_replay_tokens=3,
    )
    arena = CacheArena(layout, "cpu")
    # distinct bytes everywhere, so a snapshot or offload of the wrong slot or page shows
    arena.fill_garbage(STATE, list(range(NUM_SLOTS)), seed=seed)
    arena.fill_garbage("attention", list(range(num_pages)), seed=seed + 1)
    arena.fill_garbage(REPLAY, list(range(NUM_SLOTS)), seed=seed + 2)
    return CacheManager.for_arena(arena, max_batch_size=6, snapshot_interval=4)


def scenario(seed: int) -> tuple[CacheManager, dict[str, list[int]]]:
    """A small busy manager (and the prompts): shared prefixes (reuse, snapshots), active and suspended requests,
    little room left, so grows move suspended requests to the host or run out."""
    rng = random.Random(seed)
    m = new_manager(seed)
    prompts = {}
    for i in range(5):
        rid = f"r{i}"
        prompt = prompts[rid] = [rng.choice([0, 1]) for _ in range(rng.randint(1, 10))]
        m.create(rid, prompt)
        try:
            m.resume(rid, capacity=len(prompt) + rng.randint(0, 6))
        except PoolExhausted:
            continue  # stays suspended, never resumed
        done = m.num_committed_tokens(rid)
        end = rng.randint(done, len(prompt))
        while done < end:
            boundary = m.next_snapshot_boundary(rid)
            step = end if boundary is None else min(boundary, end)
            m.commit(rid, prompt[done:step])
            done = step
        if rng.random() < 0.4:
            m.suspend(rid, offload=rng.choice([Offload.ON_PRESSURE, Offload.ON_PRESSURE, Offload.NEVER]))
    return m, prompts


def arena_bytes(m: CacheManager) -> list[torch.Tensor]:
    assert m.arena is not None
    tensors = [*m.arena.pool_tensors().values(), m.arena.replay_tensor, m.arena.num_accepted]
    return [t.clone() for t in tensors]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def active(m: CacheManager) -> list[str]:
    return [str(rid) for rid in m.request_ids() if m.state(rid) is CacheState.ACTIVE]


def batch_vs_one_by_one(
    seed: int, one_by_one: Callable[[CacheManager], None], batch: Callable[[CacheManager], None]
) -> tuple[type[KvferryError] | None, CacheManager]:
    """``one_by_one`` on one copy of the scenario, ``batch`` on another: the same state and bytes when every
    single call succeeds; else the batch raises (the same error) and changes nothing."""
    single, batched = scenario(seed)[0], scenario(seed)[0]
    assert single.debug_state() == batched.debug_state()
    before, before_bytes = batched.debug_state(), arena_bytes(batched)
    try:
        one_by_one(single)
    except KvferryError as exc:
        # the same error, except that a bad tuple anywhere is reported before pages run out
        expected: tuple[type[KvferryError], ...] = (type(exc),)
        if isinstance(exc, PoolExhausted):
            expected = (PoolExhausted, UnknownRequest, InvalidTransition)
        with pytest.raises(expected):
            batch(batched)
        assert batched.debug_state() == before
        assert same_bytes(arena_bytes(batched), before_bytes)
        return type(exc), batched
    batch(batched)
    assert batched.debug_state() == single.debug_state()
    assert same_bytes(arena_bytes(batched), arena_bytes(single))
    return None, batched


# --- grow_many -------------------------------------------------------------------------------------------------


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


# --- commit_many -----------------------------------------------------------------------------------------------


@st.composite
def commits_for(draw: st.DrawFn, m: CacheManager, prompts: dict[str, list[int]]) -> list[Commit]:
    """Mostly valid commits (prompt continuations, pending replay that keeps the slot moving forward), some
    requests twice, sometimes a bad one (unknown request, a token off the prompt, past capacity, backwards)."""
    rids = active(m)
    committed = {rid: m.num_committed_tokens(rid) for rid in rids}
    commits: list[Commit] = []
    for _ in range(draw(st.integers(0, 5))):
        if not rids or draw(st.integers(0, 19)) == 0:
            commits.append(("unknown", [1], 0))
            continue
        rid = draw(st.sampled_from(rids))
        start, n = committed[rid], draw(st.integers(0, 4))
        tokens = prompts[rid][start : start + n]
        tokens += [draw(st.integers(0, 255)) for _ in range(n - len(tokens))]
        if tokens and draw(st.integers(0, 14)) == 0:
            tokens[0] += 1  # disagrees with the prompt, if it is still in the prompt
        commits.append((rid, tokens, draw(st.integers(0, min(n, 3)))))
        committed[rid] = start + n
    return commits


@given(seed=st.integers(0, 2**16), data=st.data())
@settings(max_examples=80, deadline=None)
def test_commit_many_is_commit_one_by_one_or_nothing(seed: int, data: st.DataObject) -> None:
    commits = data.draw(commits_for(*scenario(seed)))

    def one_by_one(m: CacheManager) -> None:
        for rid, tokens, pending in commits:
            m.commit(rid, tokens, num_pending_replay=pending)

    batch_vs_one_by_one(seed, one_by_one, lambda m: m.commit_many(commits))


def test_commit_many_indexes_the_first_page_and_snapshots_the_committing_slot() -> None:
    """Two requests fill the same block in one batch: the first one's page is indexed, and the boundary
    snapshot is a copy of the slot of the request that reached it first (a later turn starts from it)."""
    states = []
    for batch in (False, True):
        m = new_manager(3, num_pages=16)
        assert m.arena is not None
        prompt = [5, 6, 7, 8, 9, 10]
        for seed, rid in enumerate(("a", "b")):
            m.create(rid, prompt)
            m.resume(rid)
            slot = m.slot_id(rid)
            assert slot is not None
            m.arena.fill_garbage(STATE, [slot], seed=10 + seed)  # what the model step wrote
        a_bytes = m.arena.save_slots([1], replay=False).blocks  # a's slot
        commits = [("a", prompt[:4], 0), ("b", prompt[:4], 0), ("a", prompt[4:], 0), ("b", prompt[4:], 2)]
        if batch:
            m.commit_many(commits)
        else:
            for rid, tokens, pending in commits:
                m.commit(rid, tokens, num_pending_replay=pending)
        states.append(m.debug_state())
        stats = m.statistics()
        assert (stats.pages_cached, stats.snapshots_taken) == (1, 1)  # block [5..8] once; a's slot at 4
        m.close("a")
        m.close("b")
        m.create("c", [*prompt, 11])
        assert m.resume("c").reused_tokens == 4
        slot = m.slot_id("c")
        assert slot is not None and slot != 1
        c_bytes = m.arena.save_slots([slot], replay=False).blocks
        assert same_bytes(list(c_bytes), list(a_bytes))
    assert states[0] == states[1]


def test_bad_batches_change_nothing() -> None:
    m = new_manager(11, num_pages=32)
    for rid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [7, 8])):
        m.create(rid, prompt)
        m.resume(rid, capacity=8)
    m.commit("a", [1, 2])
    m.create("s", [1])  # suspended
    good = ("a", [3], 0)
    before, before_bytes = m.debug_state(), arena_bytes(m)
    bad_commits: list[tuple[list[tuple[str, object, int]], type[Exception]]] = [
        ([good, ("nope", [1], 0)], UnknownRequest),
        ([good, ("s", [1], 0)], InvalidTransition),  # not active
        ([good, ("a", [9], 0)], InvalidTransition),  # a's 4th token is 4: disagrees with the prompt
        ([good, ("b", [7, 8, 1, 2, 3, 4, 5, 6, 7], 0)], InvalidTransition),  # past capacity
        ([good, ("a", [4], 3)], InvalidTransition),  # fine alone; after good the slot would move backwards
        ([good, ("b", [2**63], 0)], ConfigError),  # not an int64
        ([good, ("b", [1.5], 0)], ConfigError),
        ([good, ("b", np.array([[7]]), 0)], ConfigError),
    ]
    for commits, error in bad_commits:
        with pytest.raises(error):
            m.commit_many(commits)  # type: ignore[arg-type]
        assert m.debug_state() == before
    bad_grows: list[tuple[list[tuple[str, int]], type[Exception]]] = [
        ([("a", 12), ("nope", 12)], UnknownRequest),
        ([("a", 12), ("s", 12)], InvalidTransition),
        ([("a", 12), ("b", 10_000)], PoolExhausted),
    ]
    for grows, error in bad_grows:
        with pytest.raises(error):
            m.grow_many(grows)
        assert m.debug_state() == before
    assert same_bytes(arena_bytes(m), before_bytes)
    m.commit_many([good, ("a", [4], 1)])  # the slot at 3, the 4th token in the replay buffers
    assert m.num_committed_tokens("a") == 4


def test_token_ids_are_accepted_as_before_and_copied() -> None:
    m = new_manager(0)
    m.create("t", [1, 2, 3, 4, 5, 6])
    m.resume("t", capacity=12)
    m.commit_many([("t", np.array([1, 2], dtype=np.uint64), 0), ("t", (3, 4), 0), ("t", np.array([5, 6]), 0)])
    m.commit("t", [np.int64(7)])  # type: ignore[list-item]  # numpy scalars in a list
    caller = [8]
    m.commit("t", caller)
    caller.append(99)  # the manager keeps its own copy
    m.grow_many([("t", 13), ("t", 12), ("t", 16)])  # the largest wins; smaller ones are no-ops
    assert m.num_committed_tokens("t") == 8 and m.capacity("t") == 16
    assert list(m.block_table("t")) == [1, 2, 3, 4]
    with pytest.raises(ConfigError):
        m.commit("t", np.array([2**63], dtype=np.uint64))
    assert m.num_committed_tokens("t") == 8


# --- deferred num_accepted -------------------------------------------------------------------------------------


def test_deferred_num_accepted_lands_at_flush_and_before_slots_move() -> None:
    m = new_manager(5, num_pages=32)
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
    assert (int(accepted[slot["a"]]), int(accepted[slot["b"]])) == (3, 1)  # type: ignore[index]
    assert torch.equal(accepted[slot["c"]], before[slot["c"]])  # type: ignore[index]

    m.set_num_accepted("a", 1, defer=True)
    m.suspend("a", offload=Offload.NOW)  # the host copy carries the queued value
    m.create("d", [4])
    m.resume("d")
    m.resume("a")  # restored into another slot, with its num_accepted
    assert int(accepted[m.slot_id("a")]) == 1  # type: ignore[index]

    m.set_num_accepted("b", 2, defer=True)
    m.close("b")  # written first: nothing queued can reach the slot's next owner
    assert int(accepted[slot["b"]]) == 2 and m.debug_state()[-1] == ()  # type: ignore[index]

    m.set_num_accepted("c", 2, defer=True)
    m.drop_replay("c")  # forgets it
    m.flush_num_accepted()
    assert int(accepted[slot["c"]]) == 0  # type: ignore[index]


def test_deferred_num_accepted_survives_a_refused_operation() -> None:
    m = new_manager(6, num_pages=8)
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
    assert m.debug_state() == before and same_bytes(arena_bytes(m), before_bytes)
    m.flush_num_accepted()
    assert int(m.arena.num_accepted[m.slot_id("a")]) == 2  # type: ignore[index]
