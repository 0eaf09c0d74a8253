"""What the engine's overlap asks of the scheduler: ``schedule(defer=True)`` leaves a decode step's commits for the
caller to flush while the step runs (never those that may take a snapshot, never before a prefill or an
admission), and ``grow_ahead`` grows the next step's plain decodes so that the next schedule grows nothing."""

from __future__ import annotations

from collections.abc import Sequence

from kvferry.engine.request import Request, RequestState
from kvferry.engine.scheduler import ItemKind, Scheduler, SchedulerConfig
from kvferry.pools.manager import CacheManager, CacheManagerConfig
from tests.support.engine_fakes import run_step

TPB = 4


class CountingManager(CacheManager):
    """A bookkeeping-only manager that counts its batch calls."""

    def __init__(self, config: CacheManagerConfig) -> None:
        super().__init__(config)
        self.grows: list[list[tuple[int, int]]] = []

    def grow_many(self, grows: Sequence[tuple[int, int]], *, offload: bool = True) -> None:  # type: ignore[override]
        super().grow_many(grows, offload=offload)
        self.grows.append(list(grows))


def decoding(
    num_pages: int = 64, snapshot_interval: int = 0, n: int = 3, max_tokens: int = 40
) -> tuple[CountingManager, Scheduler]:
    """``n`` requests past their 3-token prompts, decoding (their first decode's commits handed over)."""
    manager = CountingManager(
        CacheManagerConfig(
            tokens_per_block=TPB,
            num_pages=num_pages,
            num_slots=2 * n + 1,
            snapshot_interval=snapshot_interval,
        )
    )
    config = SchedulerConfig(token_budget=32, max_running=n + 1, max_prefill_chunk=8, grow_granularity=TPB)
    scheduler = Scheduler(manager, config)  # type: ignore[arg-type]  # request ids of any hashable type
    for i in range(n):
        scheduler.add(Request(i, [1 + i, 2, 3], max_tokens=max_tokens))
    run_step(scheduler, scheduler.schedule(), distinct_decodes=True)
    assert all(r.state is RequestState.DECODING for r in scheduler.running)
    return manager, scheduler


def committed(manager: CacheManager, n: int = 3) -> list[int]:
    return [manager.num_committed_tokens(i) for i in range(n)]


def test_a_decode_step_leaves_its_commits_to_the_caller_and_a_prefill_takes_them() -> None:
    manager, scheduler = decoding()
    plan = scheduler.schedule(defer=True)  # the prompts' commits: a prefill step's, but only decodes run now
    assert [i.kind for i in plan.items] == [ItemKind.DECODE] * 3
    # the prompt ends (3 tokens) are no snapshot boundary (not a full block): the commits wait
    assert committed(manager) == [0, 0, 0]
    scheduler.flush()  # what the engine does while the step runs
    assert committed(manager) == [3, 3, 3]
    run_step(scheduler, plan, distinct_decodes=True)
    scheduler.add(Request(9, [5, 6], max_tokens=4))  # an admission: the prefix index must see every commit
    plan = scheduler.schedule(defer=True)
    assert committed(manager) == [4, 4, 4]
    assert [i.kind for i in plan.items] == [ItemKind.DECODE] * 3 + [ItemKind.PREFILL]


def test_commits_that_may_take_a_snapshot_reach_the_manager_before_the_step() -> None:
    manager, scheduler = decoding(snapshot_interval=8)
    deferred = []
    for _ in range(7):
        plan = scheduler.schedule(defer=True)
        deferred.append(committed(manager)[0])
        scheduler.flush()  # what the engine does while the step runs
        run_step(scheduler, plan, distinct_decodes=True)
    # the manager lags one step behind (the caller flushes while the step runs), except for the commit that
    # lands on 8, a snapshot boundary: schedule itself handed it over, before the step moves the slot on
    assert deferred == [0, 3, 4, 5, 6, 8, 8]
    assert manager.statistics().snapshots_taken == 3


def test_grow_ahead_grows_the_next_steps_decodes_and_leaves_schedule_nothing_to_grow() -> None:
    manager, scheduler = decoding()
    for _ in range(8):
        plan = scheduler.schedule(defer=True)
        grown = len(manager.grows)
        scheduler.flush()
        scheduler.grow_ahead(plan)
        run_step(scheduler, plan, distinct_decodes=True)
        plan_grows = len(manager.grows) - grown
        assert plan_grows == 0 or all(i.start + 2 <= i.request.capacity for i in plan.items)
    assert scheduler.statistics().num_preemptions == 0
    # every grow since the first decode came from grow_ahead: schedule found its decodes grown
    first = len(manager.grows)
    plan = scheduler.schedule(defer=True)
    assert len(manager.grows) == first
    assert all(i.start + 1 <= i.request.capacity <= i.start + 1 + TPB for i in plan.items)


def test_grow_ahead_refuses_what_the_free_pages_do_not_hold() -> None:
    manager, scheduler = decoding(num_pages=4)  # 3 usable pages: one per request, none to grow into
    plan = scheduler.schedule(defer=True)  # decodes at 3; the next ones, at 4, need a second page each
    before = manager.debug_state()
    assert not scheduler.grow_ahead(plan)
    assert manager.debug_state() == before
    assert all(r.capacity == TPB for r in scheduler.running)


def test_grow_ahead_skips_a_requests_last_step() -> None:
    manager, scheduler = decoding(max_tokens=2)  # the prompt step gave one token: the decode at 3 is the last
    plan = scheduler.schedule(defer=True)
    assert [i.start for i in plan.items] == [3, 3, 3]
    grows = len(manager.grows)
    assert not scheduler.grow_ahead(plan) and len(manager.grows) == grows
