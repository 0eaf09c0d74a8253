"""CacheManager.commit_many (kvferry.pools.commits): exactly the one-by-one commits when those succeed, nothing
at all when not."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from kvferry.errors import ConfigError, InvalidTransition, UnknownRequest
from kvferry.pools.manager import CacheManager
from tests.support.pools_factories import (
    STATE,
    active,
    arena_bytes,
    batch_vs_one_by_one,
    busy_manager,
    same,
    scenario,
    two_active_one_suspended,
)

Commit = tuple[str, list[int], int]


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
        m = busy_manager(3, num_pages=16)
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
        assert same(list(c_bytes), list(a_bytes))
    assert states[0] == states[1]


def test_bad_batches_change_nothing() -> None:
    m = two_active_one_suspended(11)
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
    assert same(arena_bytes(m), before_bytes)
    m.commit_many([good, ("a", [4], 1)])  # the slot at 3, the 4th token in the replay buffers
    assert m.num_committed_tokens("a") == 4


def test_token_ids_are_accepted_as_before_and_copied() -> None:
    m = busy_manager(0)
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
