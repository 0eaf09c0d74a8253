"""offload_request / restore_request: a request's cache moves to the host and back on every TP rank with the
copies in worker threads; a cancel, a failed copy or a close mid-copy leaves every rank's pools consistent."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import anyio
import pytest
import torch

from kvferry.engine.host_moves import offload_request, restore_request
from kvferry.engine.runner import LockstepCache
from kvferry.errors import CacheMoving, PoolExhausted
from kvferry.kernels.host_copy import RowSection
from kvferry.pools.arena import REPLAY, CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.manager import CacheManager, CacheState
from kvferry.pools.spec import preset

pytestmark = pytest.mark.anyio

#: a copy held up by a test waits at most this long before failing it
DEADLINE_S = 30.0


DEVICES = [
    "cpu",
    pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


def lockstep(tp: int = 2, num_pages: int = 16, device: str = "cpu") -> LockstepCache:
    """One manager per rank of ``tiny`` over arenas whose every byte differs (rank by rank too)."""
    managers = []
    for rank in range(tp):
        layout = CacheLayout.build(
            preset("tiny").shard(tp, rank),
            num_pages=num_pages,
            num_slots=6,
            num_draft_pages=10,
            max_replay_tokens=3,
        )
        arena = CacheArena(layout, device)
        seed = 100 * rank
        for group, count in (("attention", num_pages), ("draft", 10), ("mamba2", 6), (REPLAY, 6)):
            arena.fill_garbage(group, list(range(count)), seed=seed)
            seed += 1
        managers.append(CacheManager.for_arena(arena, max_batch_size=4))
    return LockstepCache(tuple(managers))


def arenas(cache: LockstepCache) -> list[CacheArena]:
    out = []
    for m in cache.managers:
        assert m.arena is not None
        out.append(m.arena)
    return out


def request_bytes(cache: LockstepCache, rid: int) -> list[list[torch.Tensor]]:
    """Per rank: the request's pages, draft pages, slot, replay row and num_accepted."""
    out = []
    for m, arena in zip(cache.managers, arenas(cache), strict=True):
        slot = m.slot_id(rid)
        assert slot is not None
        saved = arena.save_slots([slot])
        assert saved.replay is not None and saved.num_accepted is not None
        out.append(
            [
                *arena.save_pages("attention", list(m.block_table(rid))).blocks,
                *arena.save_pages("draft", list(m.draft_block_table(rid))).blocks,
                *saved.blocks,
                saved.replay,
                saved.num_accepted,
            ]
        )
    return out


def same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def suspended(cache: LockstepCache, rid: int, prompt: Sequence[int]) -> list[list[torch.Tensor]]:
    cache.create(rid, list(prompt))
    cache.resume(rid)
    cache.commit(rid, list(prompt))
    cache.commit_draft(rid, 0, len(prompt) - 1)
    cache.set_num_accepted(rid, 2)
    expected = request_bytes(cache, rid)
    cache.suspend(rid)
    return expected


def consistent(cache: LockstepCache) -> None:
    """Every rank holds the same bookkeeping and nothing is moving."""
    states = [m.debug_state() for m in cache.managers]
    assert all(s == states[0] for s in states)
    assert all(m.statistics().requests_moving == 0 for m in cache.managers)


def all_back(cache: LockstepCache) -> None:
    for rid in list(cache.primary.request_ids()):
        cache.close(rid)  # type: ignore[arg-type]
    for m in cache.managers:
        s = m.statistics()
        assert s.pages_free == s.pages_total and s.draft_pages_free == s.draft_pages_total
        assert s.slots_live == 0 and s.requests_moving == 0 and s.requests_offloaded == 0


@pytest.mark.parametrize("device", DEVICES)
async def test_a_request_moves_to_the_host_and_back_on_every_rank(device: str) -> None:
    cache = lockstep(device=device)
    expected = suspended(cache, 1, list(range(10)))
    assert await offload_request(cache, 1) is True
    assert all(m.is_offloaded(1) for m in cache.managers) and not cache.is_moving(1)
    consistent(cache)
    assert await offload_request(cache, 1) is False  # there already
    # another request takes (and writes) the pages it had
    cache.create(2, list(range(50, 110)))
    cache.resume(2)
    cache.suspend(2)
    assert cache.restore_victims(1) == [2]
    with pytest.raises(PoolExhausted):
        await restore_request(cache, 1)
    consistent(cache)
    assert await offload_request(cache, 2) is True
    assert await restore_request(cache, 1, pin=True) is True
    consistent(cache)
    assert not cache.is_offloaded(1)
    assert same(request_bytes(cache, 1), expected)
    assert all(m.resume(1).restored is False for m in cache.managers)
    all_back(cache)


async def test_a_single_manager_is_moved_too() -> None:
    cache = lockstep(tp=1)
    expected = suspended(cache, 1, list(range(9)))
    assert await offload_request(cache.primary, 1)
    assert await restore_request(cache.primary, 1)
    assert same(request_bytes(cache, 1), expected)


class HeldCopy:
    """Replaces the host copy with one that signals it started, then copies nothing until ``stop()`` (or a
    test's ``release``) ends it: a copy that is in the middle of its bytes for as long as the test needs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, ranks: int = 2) -> None:
        self.all_started = threading.Event()
        self.release = threading.Event()
        self._ranks = ranks
        self._calls = 0
        self._lock = threading.Lock()
        monkeypatch.setattr(f"kvferry.pools.offload.{name}", self.copy)

    def copy(self, sections: Sequence[RowSection], *, stop: Callable[[], bool] | None = None) -> bool:
        assert stop is not None
        with self._lock:
            self._calls += 1
            if self._calls == self._ranks:
                self.all_started.set()
        for _ in range(int(DEADLINE_S / 0.005)):
            if stop():
                return False
            if self.release.wait(0.005):
                return False  # as if aborted: this copy never writes a byte
        raise TimeoutError("the held copy was neither stopped nor released")

    async def wait_started(self) -> None:
        """Until every rank's copy runs."""
        assert await anyio.to_thread.run_sync(self.all_started.wait, DEADLINE_S)


def counts(cache: LockstepCache) -> list[object]:
    """Every rank's statistics but the host memory kept for reuse."""
    return [m.statistics()._replace(host_bytes=0) for m in cache.managers]


@pytest.mark.parametrize("kind", ["offload", "restore"])
async def test_a_cancel_mid_copy_rolls_every_rank_back(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = lockstep()
    expected = suspended(cache, 1, list(range(10)))
    if kind == "restore":
        assert await offload_request(cache, 1)
    before = counts(cache)
    held = HeldCopy(monkeypatch, "to_host" if kind == "offload" else "from_host")
    move = offload_request if kind == "offload" else restore_request
    async with anyio.create_task_group() as tg:
        tg.start_soon(move, cache, 1)
        await held.wait_started()  # both ranks are copying
        assert cache.is_moving(1)
        tg.cancel_scope.cancel()
    consistent(cache)
    assert not cache.is_moving(1) and cache.is_offloaded(1) is (kind == "restore")
    assert counts(cache) == before
    monkeypatch.undo()
    if kind == "restore":
        assert await restore_request(cache, 1)
    assert same(request_bytes(cache, 1), expected)
    all_back(cache)


async def test_a_copy_that_fails_on_one_rank_rolls_every_rank_back(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = lockstep()
    expected = suspended(cache, 1, list(range(10)))
    rank1 = {t.data_ptr() for t in arenas(cache)[1].pool_tensors().values()}
    from kvferry.kernels.host_copy import to_host

    def copy(sections: Sequence[RowSection], *, stop: Callable[[], bool] | None = None) -> bool:
        if any(s.rows.untyped_storage().data_ptr() in rank1 for s in sections):
            raise MemoryError("rank 1 has no host memory")
        return to_host(sections, stop=stop)

    monkeypatch.setattr("kvferry.pools.offload.to_host", copy)
    with pytest.raises(MemoryError, match="rank 1"):
        await offload_request(cache, 1)
    consistent(cache)
    assert not any(m.is_offloaded(1) for m in cache.managers)
    assert same(request_bytes(cache, 1), expected)
    all_back(cache)


@pytest.mark.parametrize("kind", ["offload", "restore"])
async def test_a_close_while_the_copy_runs_frees_everything_after_it(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = lockstep()
    suspended(cache, 1, list(range(10)))
    if kind == "restore":
        assert await offload_request(cache, 1)
    held = HeldCopy(monkeypatch, "to_host" if kind == "offload" else "from_host")
    move = offload_request if kind == "offload" else restore_request
    results: list[bool] = []

    async def run() -> None:
        results.append(await move(cache, 1))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await held.wait_started()
        cache.close(1)
        used = [m.statistics().pages_used for m in cache.managers]
        assert all(m.statistics().requests_moving == 1 for m in cache.managers)
        held.release.set()
    assert results == [False]
    assert used[0] > 0 or kind == "restore"
    all_back(cache)


async def test_a_second_move_of_a_moving_request_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = lockstep()
    suspended(cache, 1, list(range(10)))
    held = HeldCopy(monkeypatch, "to_host")
    async with anyio.create_task_group() as tg:
        tg.start_soon(offload_request, cache, 1)
        await held.wait_started()
        before = [m.debug_state() for m in cache.managers]
        with pytest.raises(CacheMoving):
            await offload_request(cache, 1)
        with pytest.raises(CacheMoving):
            cache.resume(1)
        assert [m.debug_state() for m in cache.managers] == before
        tg.cancel_scope.cancel()
    consistent(cache)
    assert not cache.is_offloaded(1) and cache.primary.state(1) is CacheState.SUSPENDED
    all_back(cache)
