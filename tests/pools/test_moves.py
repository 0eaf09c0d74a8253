"""Two-phase offload and restore (CacheManager.start_offload / start_restore / finish): every byte moves, the
request is out of everyone's way while it moves, and whatever ends the move leaves the pools consistent."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from kvferry.errors import CacheMoving, InvalidTransition, PoolExhausted, RebalanceRefused, UnknownRequest
from kvferry.pools.arena import REPLAY
from kvferry.pools.host_memory import HostBuffer
from kvferry.pools.manager import CacheManager, CacheManagerConfig, MoveKind, MoveState, Offload, PendingMove
from tests.support.pools_factories import (
    STATE,
    make_manager,
    page_bytes,
    run_prompt,
    same,
    serve,
    slot_bytes,
)

DEVICES = [
    "cpu",
    pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]
#: a copy thread that has not ended by then has hung
DEADLINE_S = 60.0

Expected = tuple[list[torch.Tensor], list[torch.Tensor], tuple[list[torch.Tensor], torch.Tensor, int]]


def poisoned(m: CacheManager, rid: str, prompt: list[int], generated: list[int], seed: int) -> Expected:
    """Serve a request (drafts committed), fill its pages, draft pages, slot and replay row with distinct bytes,
    record num_accepted 2, suspend it; return those bytes."""
    arena = m.arena
    assert arena is not None
    serve(m, rid, prompt, generated)
    pages, draft, slot = list(m.block_table(rid)), list(m.draft_block_table(rid)), m.slot_id(rid)
    assert slot is not None and draft
    arena.fill_garbage("attention", pages, seed=seed)
    arena.fill_garbage("draft", draft, seed=seed + 1)
    arena.fill_garbage(STATE, [slot], seed=seed + 2)
    arena.fill_garbage(REPLAY, [slot], seed=seed + 3)
    m.set_num_accepted(rid, 2)
    expected = (page_bytes(m, "attention", pages), page_bytes(m, "draft", draft), slot_bytes(m, slot))
    m.suspend(rid)
    return expected


def assert_bytes(m: CacheManager, rid: str, expected: Expected) -> None:
    slot = m.slot_id(rid)
    assert slot is not None
    assert same(page_bytes(m, "attention", list(m.block_table(rid))), expected[0])
    assert same(page_bytes(m, "draft", list(m.draft_block_table(rid))), expected[1])
    state, replay, accepted = slot_bytes(m, slot)
    assert same(state, expected[2][0]) and torch.equal(replay, expected[2][1]) and accepted == expected[2][2]


def state_of(move: PendingMove) -> MoveState:
    return move.state


def in_thread(move: PendingMove) -> None:
    """Run the move's copy in a worker thread, as the async edge does, and wait for it."""
    worker = threading.Thread(target=move.run)
    worker.start()
    worker.join(DEADLINE_S)
    assert not worker.is_alive() and move.done


def all_free(m: CacheManager) -> bool:
    s = m.statistics()
    return (
        s.pages_free == s.pages_total
        and s.draft_pages_free == s.draft_pages_total
        and s.slots_live == 0
        and s.requests_moving == 0
        and s.requests_offloaded == 0
    )


@pytest.mark.parametrize("device", DEVICES)
def test_offload_and_restore_in_two_phases_keep_every_byte(device: str) -> None:
    m = make_manager(num_pages=16, num_slots=5, num_draft_pages=12, device=device)
    prompt = list(range(10))
    expected = poisoned(m, "a", prompt, [20, 21, 22], seed=10)
    pages, used = list(m.block_table("a")), m.statistics().pages_used

    move = m.start_offload("a")
    assert move.kind is MoveKind.OFFLOAD and state_of(move) is MoveState.PENDING and move.nbytes > 0
    assert m.is_moving("a") and not m.is_offloaded("a")
    assert m.statistics().pages_used == used and m.statistics().requests_moving == 1  # nothing freed yet
    in_thread(move)
    assert move.copied and move.buffer is not None
    assert move.buffer.pinned is (device != "cpu")
    assert m.finish(move) is True and state_of(move) is MoveState.FINISHED
    assert m.is_offloaded("a") and not m.is_moving("a") and m.statistics().pages_used == 0

    # its old pages and slot go to another request, which writes over them
    run_prompt(m, "b", list(range(100, 160)))  # every page
    assert set(pages) <= set(m.block_table("b"))
    assert m.arena is not None
    m.arena.fill_garbage("attention", list(m.block_table("b")), seed=30)
    m.suspend("b", offload=Offload.NOW)
    m.set_num_accepted("a", 3)  # lands in the host copy
    expected = (expected[0], expected[1], (expected[2][0], expected[2][1], 3))

    move = m.start_restore("a")
    assert move.kind is MoveKind.RESTORE and m.is_moving("a") and m.is_offloaded("a")
    assert list(m.block_table("a")) == []  # the new pages are the request's only once it commits
    in_thread(move)
    assert m.finish(move) is True
    assert not m.is_offloaded("a") and not m.is_moving("a")
    assert_bytes(m, "a", expected)
    resumed = m.resume("a")
    assert not resumed.restored and not resumed.first and resumed.num_committed_tokens == 13
    # its blocks, target and draft, are offered for reuse again in their new pages
    m.create("c", [*prompt, 20, 21, 22, 99])
    reused = m.resume("c")
    assert reused.reused_tokens == 8  # pruned back to the prompt's snapshot
    assert reused.draft_zeroed == (0, 0)  # the draft mirror found a's draft block
    assert m.block_table("c")[:2] == m.block_table("a")[:2]
    for rid in ("a", "b", "c"):
        m.close(rid)
    assert all_free(m)


def test_the_copy_may_run_while_the_manager_serves_others() -> None:
    """The copy touches only the moving request's bytes and its host buffer: other requests run meanwhile."""
    m = make_manager(num_pages=24, num_slots=6, num_draft_pages=12)
    expected = poisoned(m, "a", list(range(10)), [20], seed=3)
    run_prompt(m, "b", list(range(50, 58)))
    move = m.start_offload("a")
    worker = threading.Thread(target=move.run)
    worker.start()
    m.grow("b", 16)
    m.commit("b", [1, 2, 3])
    m.suspend("b")
    run_prompt(m, "c", [7, 8, 9])
    worker.join(DEADLINE_S)
    assert m.finish(move)
    m.resume("a")
    assert_bytes(m, "a", expected)


def test_finish_alone_runs_the_copy_in_place() -> None:
    """The synchronous path: nobody ran the copy, finish runs it here."""
    m = make_manager()
    expected = poisoned(m, "a", list(range(9)), [1], seed=5)
    assert m.finish(m.start_offload("a")) and m.is_offloaded("a")
    assert m.finish(m.start_restore("a")) and not m.is_offloaded("a")
    assert_bytes(m, "a", expected)


def test_a_moving_request_is_never_a_pressure_victim() -> None:
    m = make_manager(num_pages=8, num_slots=4, num_draft_pages=8)
    run_prompt(m, "a", list(range(10)))
    m.suspend("a")
    move = m.start_offload("a")
    m.create("b", list(range(100, 128)))  # needs every page: only a could make room
    run_prompt(m, "c", [1, 2, 3])
    before = m.debug_state()
    with pytest.raises(PoolExhausted):
        m.resume("b")
    with pytest.raises(PoolExhausted):
        m.grow("c", 28)
    assert m.debug_state() == before and not m.is_offloaded("a")
    assert m.finish(move)
    m.grow("c", 20)  # a is on the host now: there is room
    m.close("c")
    m.resume("b")


MOVING_USES: dict[str, Callable[[CacheManager], object]] = {
    "resume": lambda m: m.resume("a"),
    "pin": lambda m: m.pin("a"),
    "offload": lambda m: m.offload("a"),
    "start_offload": lambda m: m.start_offload("a"),
    "start_restore": lambda m: m.start_restore("a"),
    "set_num_accepted": lambda m: m.set_num_accepted("a", 1),
    "set_num_accepted deferred": lambda m: m.set_num_accepted("a", 1, defer=True),
    "drop_replay": lambda m: m.drop_replay("a"),
    "commit_draft": lambda m: m.commit_draft("a", 0, 4),
}


@pytest.mark.parametrize("kind", ["offload", "restore"])
@pytest.mark.parametrize("use", sorted(MOVING_USES))
def test_a_moving_request_refuses_every_use_and_changes_nothing(kind: str, use: str) -> None:
    m = make_manager()
    serve(m, "a", list(range(9)), [1, 2])
    m.suspend("a")
    if kind == "restore":
        m.offload("a")
    move = m.start_offload("a") if kind == "offload" else m.start_restore("a")
    before = m.debug_state()
    with pytest.raises(CacheMoving, match="finish it first"):
        MOVING_USES[use](m)
    assert m.debug_state() == before
    with pytest.raises(RebalanceRefused, match="moves to or from the host"):
        m.rebalance(num_pages=20)
    assert m.finish(move)
    try:  # no longer moving: refused (if at all) for what the request is, not for moving
        MOVING_USES[use](m)
    except InvalidTransition as exc:
        assert not isinstance(exc, CacheMoving)


@pytest.mark.parametrize("kind", ["offload", "restore"])
def test_close_while_moving_frees_everything_only_once_the_copy_ended(kind: str) -> None:
    m = make_manager(num_pages=8, num_slots=3, num_draft_pages=8)
    run_prompt(m, "a", list(range(10)))
    m.suspend("a")
    if kind == "restore":
        m.offload("a")
    move = m.start_offload("a") if kind == "offload" else m.start_restore("a")
    held = m.statistics()
    assert m.close("a") is None and "a" not in m.request_ids()
    assert move.closed and m.close("a") is None  # idempotent
    s = m.statistics()
    assert (s.pages_used, s.slots_live, s.requests_moving) == (held.pages_used, held.slots_live, 1)
    # what the copy reads or writes is handed to nobody: a request that needs every page waits
    m.create("b", list(range(100, 128)))
    with pytest.raises(PoolExhausted):
        m.resume("b")
    m.create("a", [5, 6, 7])  # the id is free again; the old move is not the new request's
    in_thread(move)
    assert m.finish(move) is False
    assert m.finish(move) is False  # idempotent
    m.close("a")
    assert all_free(m)
    m.resume("b")


@pytest.mark.parametrize("release_first", [True, False])
def test_a_quarantined_close_while_offloading_frees_once_released_and_copied(release_first: bool) -> None:
    m = make_manager(num_pages=8, num_slots=3, num_draft_pages=4)
    run_prompt(m, "a", list(range(10)))
    pages = list(m.block_table("a"))
    m.suspend("a")
    move = m.start_offload("a")
    ticket = m.close("a", quarantine=True)
    assert ticket is not None and ticket.pages == tuple(pages)
    used = m.statistics().pages_used
    if release_first:
        m.release(ticket)
        assert ticket.released and m.statistics().pages_used == used  # the copy may still read them
        assert m.finish(move) is False
    else:
        assert m.finish(move) is False
        assert m.statistics().pages_used == used  # the quarantine holds them
        m.release(ticket)
    m.release(ticket)  # idempotent
    assert all_free(m) and m.statistics().quarantines == 0


@pytest.mark.parametrize("kind", ["offload", "restore"])
@pytest.mark.parametrize("how", ["abort before the copy", "abort after the copy", "commit=False"])
def test_a_move_that_is_not_committed_leaves_the_request_where_it_was(kind: str, how: str) -> None:
    m = make_manager(num_pages=12, num_slots=4, num_draft_pages=6)
    expected = poisoned(m, "a", list(range(10)), [1], seed=7)
    if kind == "restore":
        m.offload("a")
    before = m.statistics()
    move = m.start_offload("a") if kind == "offload" else m.start_restore("a")
    if how == "abort before the copy":
        move.abort()
        in_thread(move)
        assert move.state is MoveState.ABORTED and not move.copied
    elif how == "abort after the copy":
        in_thread(move)
        move.abort()  # too late to stop anything: still copied
        assert move.copied
    assert m.finish(move, commit=how != "commit=False") is (how == "abort after the copy")
    if how == "abort after the copy":
        return
    assert not m.is_moving("a") and m.is_offloaded("a") is (kind == "restore")
    s = m.statistics()
    assert (s.pages_used, s.slots_live, s.draft_pages_used, s.requests_offloaded) == (
        before.pages_used,
        before.slots_live,
        before.draft_pages_used,
        before.requests_offloaded,
    )
    m.resume("a")  # from where it was: every byte there
    assert_bytes(m, "a", expected)


@pytest.mark.parametrize("kind", ["offload", "restore"])
def test_a_failed_copy_rolls_back_and_raises_its_error(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    m = make_manager()
    expected = poisoned(m, "a", list(range(10)), [1], seed=9)
    if kind == "restore":
        m.offload("a")
    boom = MemoryError("host memory exhausted")

    def fail(*args: object, **kwargs: object) -> bool:
        raise boom

    if kind == "offload":
        monkeypatch.setattr(HostBuffer, "materialize", fail)
    else:
        monkeypatch.setattr("kvferry.pools.offload.from_host", fail)
    move = m.start_offload("a") if kind == "offload" else m.start_restore("a")
    in_thread(move)
    assert move.state is MoveState.FAILED and move.error is boom
    with pytest.raises(MemoryError, match="host memory exhausted"):
        m.finish(move)
    assert not m.is_moving("a") and m.is_offloaded("a") is (kind == "restore")
    assert m.statistics().requests_moving == 0
    monkeypatch.undo()
    m.resume("a")
    assert_bytes(m, "a", expected)


def test_finish_refuses_another_managers_move() -> None:
    m, other = make_manager(), make_manager()
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    m.suspend("a")
    move = m.start_offload("a")
    with pytest.raises(UnknownRequest, match="not started by this manager"):
        other.finish(move)
    assert m.finish(move)


def test_start_restore_takes_free_memory_only_and_names_what_to_offload_first() -> None:
    m = make_manager(num_pages=8, num_slots=4, num_draft_pages=8)
    run_prompt(m, "a", list(range(8)))
    m.suspend("a", offload=Offload.NOW)
    run_prompt(m, "b", list(range(100, 124)))  # 6 of 7 usable pages
    m.suspend("b")
    before = m.debug_state()
    with pytest.raises(PoolExhausted, match="restore_victims"):
        m.start_restore("a")
    assert m.debug_state() == before
    assert m.restore_victims("a") == ["b"]
    assert m.finish(m.start_offload("b"))
    assert m.restore_victims("a") == []
    assert m.finish(m.start_restore("a", pin=True))
    # pinned: pressure cannot move it out before it runs
    m.create("c", list(range(200, 224)))  # 6 pages: 5 are free
    with pytest.raises(PoolExhausted):
        m.resume("c")
    assert not m.is_offloaded("a")
    m.resume("a")
    m.suspend("a")  # the pin lasts until the next resume
    m.resume("c")
    assert m.is_offloaded("a")


def test_moves_with_nothing_to_do() -> None:
    m = make_manager()
    m.create("new", [1, 2, 3])
    move = m.start_offload("new")  # never resumed: holds only shared prefix pages
    assert move.done and move.nbytes == 0 and not m.is_moving("new")
    assert m.finish(move) is False
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    m.suspend("a")
    move = m.start_restore("a", pin=True)  # on the device already: only pinned
    assert m.finish(move) is False and not m.is_offloaded("a")
    m.offload("a")
    assert m.finish(m.start_offload("a")) is False  # on the host already
    with pytest.raises(UnknownRequest):
        m.start_offload("missing")
    run_prompt(m, "b", [9, 8, 7])
    with pytest.raises(InvalidTransition, match="it is active"):
        m.start_offload("b")


def test_a_manager_without_an_arena_moves_its_bookkeeping() -> None:
    config = CacheManagerConfig(tokens_per_block=4, num_pages=8, num_slots=3, max_batch_size=2)
    m = CacheManager(config)
    run_prompt(m, "a", list(range(10)))
    m.suspend("a")
    move = m.start_offload("a")
    assert move.nbytes == 0 and move.done
    assert m.finish(move) and m.is_offloaded("a") and m.statistics().pages_used == 0
    move = m.start_restore("a")
    assert m.finish(move) and len(m.block_table("a")) == 3 and m.slot_id("a") is not None
    assert m.statistics().host_bytes == 0


def test_host_buffers_are_kept_for_reuse_trimmed_and_closed() -> None:
    m = make_manager()
    run_prompt(m, "a", list(range(10)))
    m.suspend("a")
    m.offload("a")
    held = m.statistics().host_bytes
    assert held > 0 and m.trim_host_memory() == 0  # a's bytes live there
    m.finish(m.start_restore("a"))
    assert m.statistics().host_bytes == held  # kept for the next offload
    m.finish(m.start_offload("a"))
    assert m.statistics().host_bytes == held  # the same block again
    m.finish(m.start_restore("a"))
    assert m.trim_host_memory() == held and m.statistics().host_bytes == 0
    m.close_host_memory()
    m.offload("a")
    assert m.statistics().host_bytes == held
    m.close("a")  # a closed request gives its buffer back: freed now
    assert m.statistics().host_bytes == 0
