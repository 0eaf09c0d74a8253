from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.engine.request import Request, RequestState
from kvferry.engine.scheduler import ItemKind, Scheduler, SchedulerConfig
from kvferry.errors import ConfigError, PoolExhausted
from tests.support.engine_fakes import FakeCache, run_step

S = RequestState


def state(request: Request) -> RequestState:
    """The request's state, read afresh: a type checker keeps what an earlier ``assert r.state is X`` narrowed
    ``r.state`` to, across the steps that change it."""
    return request.state


def make(rid: int, prompt_len: int, max_tokens: int = 4, spec_k: int = 0) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), max_tokens=max_tokens, spec_k=spec_k)


def test_config_requires_room_for_prefill_beside_all_decodes() -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig(token_budget=8, max_running=4, max_spec_k=1)
    SchedulerConfig(token_budget=9, max_running=4, max_spec_k=1)


def test_chunked_prefill_under_the_budget_then_decode() -> None:
    cache = FakeCache(num_pages=64, num_slots=4)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=8, max_running=2, max_prefill_chunk=5))
    request = make(1, 12, max_tokens=2)
    scheduler.add(request)
    plan = scheduler.schedule()
    assert [(i.kind, i.start, len(i.token_ids)) for i in plan.items] == [(ItemKind.PREFILL, 0, 5)]
    assert state(request) is S.PREFILLING and not plan.items[0].wants_logits
    run_step(scheduler, plan)
    plan = scheduler.schedule()
    assert [(i.start, i.token_ids) for i in plan.items] == [(5, (6, 7, 8, 9, 10))]
    run_step(scheduler, plan)
    plan = scheduler.schedule()
    assert [(i.start, i.token_ids, i.wants_logits) for i in plan.items] == [(10, (11, 12), True)]
    run_step(scheduler, plan, next_token=40)
    assert state(request) is S.DECODING and request.output_ids == [40]
    plan = scheduler.schedule()
    assert [(i.kind, i.start, i.token_ids) for i in plan.items] == [(ItemKind.DECODE, 12, (40,))]
    run_step(scheduler, plan)
    assert state(request) is S.FINISHED and request.finish_reason == "length"
    assert cache.free_pages == 64 and cache.free_slots == 4
    assert not scheduler.has_work


def test_chunks_end_at_snapshot_boundaries() -> None:
    cache = FakeCache(num_pages=64, num_slots=4, snapshot_interval=8)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=64, max_running=2, max_prefill_chunk=64))
    scheduler.add(make(1, 21))
    spans = []
    while (plan := scheduler.schedule()).items[0].kind is ItemKind.PREFILL:
        spans.append((plan.items[0].start, plan.items[0].start + len(plan.items[0].token_ids)))
        run_step(scheduler, plan)
    assert spans == [(0, 8), (8, 16), (16, 21)]


def test_decodes_come_first_and_a_long_prompt_cannot_starve_them() -> None:
    cache = FakeCache(num_pages=256, num_slots=8)
    config = SchedulerConfig(token_budget=10, max_running=4, max_prefill_chunk=64, max_spec_k=1)
    scheduler = Scheduler(cache, config)
    short = [make(i, 2, max_tokens=50, spec_k=1) for i in range(3)]
    for r in short:
        scheduler.add(r)
    run_step(scheduler, scheduler.schedule())  # three 2-token prompts in one step
    assert all(state(r) is S.DECODING for r in short)
    long = make(10, 100, max_tokens=1)
    scheduler.add(long)
    progressed = []
    while state(long) is not S.FINISHED:
        plan = scheduler.schedule()
        decodes = [i for i in plan.items if i.kind is ItemKind.DECODE]
        assert [i.request for i in decodes] == short  # every decode, every step, oldest first
        assert all(i.num_drafts == 1 for i in decodes)
        assert plan.num_tokens <= config.token_budget
        prefill = [i for i in plan.items if i.kind is ItemKind.PREFILL]
        progressed.append(len(prefill[0].token_ids))
        run_step(scheduler, plan)
    assert sum(progressed) == 100 and set(progressed) == {4}


def test_admission_is_fifo_and_all_or_nothing() -> None:
    cache = FakeCache(num_pages=6, num_slots=8)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=64, max_running=8, max_prefill_chunk=64))
    big = make(1, 20)  # 5 pages
    bigger = make(2, 16)  # 4 pages: does not fit beside big
    small = make(3, 2)  # 1 page: would fit, but must not overtake the older request
    for r in (big, bigger, small):
        scheduler.add(r)
    plan = scheduler.schedule()
    assert [i.request for i in plan.items] == [big]
    assert state(bigger) is S.WAITING and state(small) is S.WAITING
    # the refused admission left nothing behind
    assert cache.free_pages == 1 and cache.free_slots == 7 and 2 not in cache.pages
    assert scheduler.waiting == (bigger, small)


def test_max_running_caps_admission() -> None:
    cache = FakeCache(num_pages=64, num_slots=8)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=64, max_running=2))
    for i in range(4):
        scheduler.add(make(i, 3))
    plan = scheduler.schedule()
    assert [i.request.request_id for i in plan.items] == [0, 1]
    assert scheduler.statistics().num_waiting == 2


def test_preemption_suspends_the_newest_and_resumes_it_first() -> None:
    cache = FakeCache(num_pages=3, num_slots=4, tokens_per_block=4)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=32, max_running=4))
    old, new, later = make(1, 4, max_tokens=8), make(2, 4, max_tokens=3), make(3, 1, max_tokens=1)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler, scheduler.schedule())
    assert state(old) is S.DECODING and state(new) is S.DECODING and cache.free_pages == 1
    scheduler.add(later)
    # both grow into a second page; the older gets the last one, the newer cannot preempt an older one
    plan = scheduler.schedule()
    assert [i.request for i in plan.items] == [old] and plan.preempted == ()
    assert state(later) is S.WAITING and state(new) is S.DECODING
    run_step(scheduler, plan)
    for _ in range(3):  # old decodes up to 8 tokens: fits its two pages; new still blocked
        plan = scheduler.schedule()
        assert [i.request for i in plan.items] == [old]
        run_step(scheduler, plan)
    # old needs a third page: the newest running request (new) is suspended for it
    plan = scheduler.schedule()
    assert [i.request for i in plan.items] == [old] and plan.preempted == (new,)
    assert state(new) is S.PREEMPTED and new.num_preemptions == 1
    assert scheduler.waiting == (new, later)  # the preempted request goes back first
    assert ("suspend", 2) in cache.log
    run_step(scheduler, plan)
    while state(old) is not S.FINISHED:
        run_step(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    assert [i.request for i in plan.items] == [new, later]
    assert state(new) is S.DECODING and plan.items[0].kind is ItemKind.DECODE
    assert plan.items[0].start == 4 and plan.items[0].token_ids == (9,)
    while scheduler.has_work:
        run_step(scheduler, scheduler.schedule())
    assert [len(r.output_ids) for r in (old, new, later)] == [8, 3, 1]
    assert scheduler.statistics().num_preemptions == 1
    assert cache.free_pages == 3 and cache.free_slots == 4 and not cache.pages and not cache.offloaded


def test_a_request_that_can_never_fit_fails_instead_of_deadlocking() -> None:
    cache = FakeCache(num_pages=2, num_slots=2, tokens_per_block=4)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=32, max_running=2, max_prefill_chunk=4))
    request = make(1, 20)
    scheduler.add(request)
    run_step(scheduler, scheduler.schedule())
    run_step(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    assert plan.failed == (request,) and state(request) is S.FAILED
    assert isinstance(request.error, PoolExhausted)
    assert cache.free_pages == 2 and cache.free_slots == 2


def test_finish_closes_the_cache_in_any_state_and_is_idempotent() -> None:
    cache = FakeCache(num_pages=16, num_slots=4)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=16, max_running=4, max_prefill_chunk=2))
    a, b = make(1, 6), make(2, 6)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    scheduler.finish(a, S.CANCELLED)
    scheduler.finish(a, S.CANCELLED)
    waiting = make(3, 2)
    scheduler.add(waiting)
    scheduler.finish(waiting, S.CANCELLED)  # never admitted: nothing to close
    scheduler.finish(b, S.CANCELLED)
    assert cache.free_pages == 16 and cache.free_slots == 4 and not scheduler.has_work
    assert [e for e in cache.log if e[0] == "close"] == [("close", 1), ("close", 2)]
    assert "0 running, 0 waiting" in repr(scheduler)


def test_spec_k_above_the_engine_limit_is_refused() -> None:
    scheduler = Scheduler(FakeCache(num_pages=4, num_slots=1), SchedulerConfig(max_spec_k=2))
    with pytest.raises(ConfigError):
        scheduler.add(make(1, 2, spec_k=3))
    assert not scheduler.has_work


def test_a_prompt_that_can_never_be_admitted_fails_instead_of_waiting_forever() -> None:
    cache = FakeCache(num_pages=2, num_slots=2, tokens_per_block=4)
    scheduler = Scheduler(cache, SchedulerConfig(token_budget=32, max_running=2))
    huge, small = make(1, 20), make(2, 3)
    scheduler.add(huge)
    scheduler.add(small)
    plan = scheduler.schedule()
    assert plan.failed == (huge,) and state(huge) is S.FAILED and not plan.items
    plan = scheduler.schedule()
    assert [i.request for i in plan.items] == [small]


@given(
    prompts=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    max_tokens=st.integers(1, 12),
    pages=st.integers(8, 40),
    chunk=st.integers(1, 16),
    spec_k=st.integers(0, 3),
)
@settings(max_examples=40, deadline=None)
def test_random_workloads_finish_within_budget_and_free_everything(
    prompts: list[int], max_tokens: int, pages: int, chunk: int, spec_k: int
) -> None:
    cache = FakeCache(num_pages=pages, num_slots=5, tokens_per_block=4)
    config = SchedulerConfig(
        token_budget=4 * (1 + 3) + 1 + chunk, max_running=4, max_prefill_chunk=chunk, max_spec_k=3
    )
    scheduler = Scheduler(cache, config)
    requests = [make(i, n, max_tokens=max_tokens, spec_k=spec_k) for i, n in enumerate(prompts)]
    for r in requests:
        scheduler.add(r)
    for _ in range(2000):
        if not scheduler.has_work:
            break
        plan = scheduler.schedule()
        assert plan.num_tokens <= config.token_budget
        assert len({i.request.request_id for i in plan.items}) == len(plan.items)
        assert all(i.request.state in (S.PREFILLING, S.DECODING) for i in plan.items)
        run_step(scheduler, plan)
    assert not scheduler.has_work
    for r in requests:
        # a request fails only when it cannot fit alone: more pages than the pool has
        if state(r) is S.FAILED:
            assert -(-(r.num_prompt + max_tokens) // 4) > pages - 1 or -(-r.num_prompt // 4) > pages
        else:
            assert state(r) is S.FINISHED and len(r.output_ids) == max_tokens
    assert cache.free_pages == pages and cache.free_slots == 5 and not cache.pages and not cache.offloaded
