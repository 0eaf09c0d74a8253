"""The scheduler's batched cache calls: a step's commits reach the cache in one commit_many (at the next schedule,
a finish or a flush), decodes grow with one grow_many; plans and cache state are those of the one-by-one calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.engine.request import Request, RequestState
from kvferry.engine.scheduler import ItemKind, Scheduler, SchedulerConfig, StepPlan
from kvferry.errors import InvalidTransition
from kvferry.pools.manager import CacheManager, CacheManagerConfig
from tests.support.engine_fakes import FakeCache, run_step

S = RequestState


class BatchingFake(FakeCache):
    """The fake cache with commit_many / grow_many that log each batch."""

    batches: list[tuple[str, list[Any]]]

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.batches = []

    def commit_many(self, commits: Sequence[tuple[int, Sequence[int], int]]) -> None:
        self.batches.append(("commit", [(rid, list(tokens), pending) for rid, tokens, pending in commits]))
        for rid, tokens, pending in commits:
            self.commit(rid, tokens, num_pending_replay=pending)

    def grow_many(self, grows: Sequence[tuple[int, int]]) -> None:
        before = (self.free_pages, dict(self.pages))
        try:
            for rid, capacity in grows:
                self.grow(rid, capacity)
        except Exception:
            self.free_pages, self.pages = before  # all or nothing, like the manager
            raise
        self.batches.append(("grow", list(grows)))

    def close(self, request_id: int) -> None:
        super().close(request_id)
        self.batches.append(("close", [request_id]))


def test_commits_reach_the_cache_in_one_batch_at_the_next_schedule() -> None:
    cache = BatchingFake(num_pages=64, num_slots=4)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=16, max_running=3, max_prefill_chunk=8))
    requests = [Request(i, [1, 2, 3], max_tokens=3) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    run_step(scheduler, scheduler.schedule(), distinct_decodes=True)  # three prompts
    assert cache.committed == {0: 0, 1: 0, 2: 0}  # not yet: the manager lags until the next schedule
    assert all(r.num_computed == 3 and r.state is S.DECODING for r in requests)
    plan = scheduler.schedule()
    assert cache.committed == {0: 3, 1: 3, 2: 3}
    assert cache.batches == [
        ("commit", [(0, [1, 2, 3], 0), (1, [1, 2, 3], 0), (2, [1, 2, 3], 0)]),
        ("grow", [(0, 4), (1, 4), (2, 4)]),  # room for the decode at 3, for all three at once
    ]
    assert [(i.request.request_id, i.kind, i.start, i.token_ids) for i in plan.items] == [
        (r, ItemKind.DECODE, 3, (9,)) for r in range(3)
    ]
    assert plan.num_tokens == 3 == scheduler.statistics().last_step_tokens
    run_step(scheduler, plan, distinct_decodes=True)
    scheduler.flush()  # now, without a schedule
    assert cache.batches[-1] == ("commit", [(0, [9], 0), (1, [9], 0), (2, [9], 0)])
    scheduler.flush()  # nothing pending: no call
    assert len(cache.batches) == 3


def test_finish_hands_over_pending_commits_before_closing() -> None:
    cache = BatchingFake(num_pages=64, num_slots=4)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=16, max_running=2, max_prefill_chunk=8))
    a, b, c = (
        Request(0, [1, 2, 3], max_tokens=5),
        Request(1, [4, 5], max_tokens=1),
        Request(2, [6], max_tokens=5),
    )
    for r in (a, b, c):
        scheduler.add(r)
    run_step(
        scheduler, scheduler.schedule(), distinct_decodes=True
    )  # b finishes on its prompt step (max_tokens=1)
    # the commits so far, in step order, reached the cache before b's close (its blocks stay reusable)
    assert cache.batches == [("commit", [(0, [1, 2, 3], 0), (1, [4, 5], 0)]), ("close", [1])]
    scheduler.schedule()  # nothing was left to hand over; a decodes, c is admitted
    assert cache.batches[2:] == [("grow", [(0, 4)])] and cache.committed == {0: 3, 2: 0}


def test_decodes_grow_in_one_batch_and_fall_back_to_preemption_when_short() -> None:
    cache = BatchingFake(num_pages=7, num_slots=4, tokens_per_block=4)
    config = SchedulerConfig(token_budget=9, max_running=3, max_prefill_chunk=4, grow_granularity=4)
    scheduler = Scheduler(cache, config)
    requests = [Request(i, [1, 2, 3], max_tokens=20) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    run_step(scheduler, scheduler.schedule(), distinct_decodes=True)  # 3 prompts: 3 pages
    run_step(scheduler, scheduler.schedule(), distinct_decodes=True)  # decode at 3: capacity 4 suffices
    cache.batches.clear()
    plan = scheduler.schedule()  # decode at 4: each needs a second page: 6 of 7, one grow_many
    assert [b for b in cache.batches if b[0] == "grow"] == [("grow", [(0, 8), (1, 8), (2, 8)])]
    assert [i.request.request_id for i in plan.items] == [0, 1, 2] and not plan.preempted
    for _ in range(4):
        run_step(scheduler, plan, distinct_decodes=True)
        plan = scheduler.schedule()
    # at 8 all three need a third page (9 > 7): the batch is refused, request by request the newest is
    # preempted so the older two fit
    assert [r.request_id for r in plan.preempted] == [2]
    assert [i.request.request_id for i in plan.items] == [0, 1]
    assert requests[2].state is S.PREEMPTED and scheduler.waiting == (requests[2],)


class OneByOne:
    """A real manager seen without its batch methods: the scheduler falls back to one call per request."""

    def __init__(self, manager: CacheManager) -> None:
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_many"):
            raise AttributeError(name)
        return getattr(self._manager, name)


def plan_signature(plan: StepPlan) -> tuple[Any, ...]:
    return (
        tuple((i.request.request_id, i.kind, i.token_ids, i.start, i.num_drafts) for i in plan.items),
        tuple(r.request_id for r in plan.preempted),
        tuple(r.request_id for r in plan.failed),
        plan.num_tokens,
    )


@given(
    prompts=st.lists(st.integers(1, 14), min_size=1, max_size=7),
    max_tokens=st.integers(1, 12),
    spec_k=st.integers(0, 2),
    pages=st.integers(5, 16),
    shared=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_batched_and_one_by_one_scheduling_are_identical(
    prompts: list[int], max_tokens: int, spec_k: int, pages: int, shared: bool
) -> None:
    """Random workloads over a real (bookkeeping) manager with prefix reuse, snapshots, preemption and offload:
    every plan and the manager's whole state after every step are the same with and without the batch calls."""
    runs = []
    for batched in (True, False):
        manager = CacheManager(
            CacheManagerConfig(
                tokens_per_block=4, num_pages=pages, num_slots=6, max_batch_size=3, snapshot_interval=4
            )
        )
        cache = manager if batched else OneByOne(manager)
        config = SchedulerConfig(
            token_budget=3 * (1 + 2) + 1 + 4,
            max_running=3,
            max_prefill_chunk=4,
            max_spec_k=2,
            grow_granularity=4,
        )
        scheduler = Scheduler(cache, config)  # type: ignore[arg-type]
        base = [7] * 8 if shared else []  # two shared blocks: prefix reuse and snapshots
        requests = [
            Request(i, base + [i * 3 + j for j in range(n)], max_tokens=max_tokens, spec_k=spec_k)
            for i, n in enumerate(prompts)
        ]
        for r in requests:
            scheduler.add(r)
        trace = []
        for _ in range(300):
            if not scheduler.has_work:
                break
            plan = scheduler.schedule()
            run_step(scheduler, plan, distinct_decodes=True)
            scheduler.flush()
            trace.append((plan_signature(plan), manager.debug_state()))
        assert not scheduler.has_work
        runs.append((trace, [(r.state, tuple(r.output_ids)) for r in requests]))
    assert runs[0] == runs[1]


def test_a_refused_batch_still_lets_finish_close_the_request() -> None:
    class Refusing(BatchingFake):
        def commit_many(self, commits: Sequence[tuple[int, Sequence[int], int]]) -> None:
            raise InvalidTransition("refused")

    cache = Refusing(num_pages=64, num_slots=4)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=16, max_running=2, max_prefill_chunk=8))
    request = Request(0, [1, 2, 3], max_tokens=5)
    scheduler.add(request)
    run_step(scheduler, scheduler.schedule(), distinct_decodes=True)
    with pytest.raises(InvalidTransition):
        scheduler.finish(request, S.CANCELLED)
    assert request.state is S.CANCELLED and not scheduler.has_work
    assert cache.log[-1] == ("close", 0) and not cache.live
    scheduler.flush()  # the refused batch is gone
