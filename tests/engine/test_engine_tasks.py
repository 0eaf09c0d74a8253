"""An engine entered in one task and left in another (as async fixtures do), and what its own task owns."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

import anyio
import pytest

from kvferry import build_engine
from kvferry.engine.engine import Engine, EngineConfig
from kvferry.engine.request import RequestState
from kvferry.engine.scheduler import SchedulerConfig
from kvferry.errors import EngineClosed, RequestAborted
from tests.support.engine_fakes import FakeCache, FakeRunner


def make_engine(in_thread: bool = False) -> tuple[Engine, FakeCache]:
    cache = FakeCache(num_pages=256, num_slots=16, tokens_per_block=4)
    config = EngineConfig(SchedulerConfig(64, 8, 64, 4), step_in_thread=in_thread)
    return Engine(FakeRunner(), cache, config), cache


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    # the pattern a user writes first (pytest-asyncio runs its setup and teardown in different tasks: that case
    # is tests/plugin_cases/user_tests.py's, run by tests/test_testing_plugin.py)
    async with build_engine("tiny").engine as e:
        yield e


@pytest.mark.anyio
async def test_the_first_fixture_a_user_writes_works(engine: Engine) -> None:
    assert len(await engine.generate([1, 2, 3], max_tokens=3).collect()) == 3


@pytest.mark.anyio
@pytest.mark.parametrize("in_thread", [False, True])
async def test_enter_in_one_task_leave_in_another_cancels_and_frees_everything(in_thread: bool) -> None:
    engine, cache = make_engine(in_thread)
    entered = anyio.Event()
    leave = anyio.Event()
    got: list[int] = []
    errors: list[BaseException] = []

    async def enter() -> None:
        await engine.__aenter__()
        entered.set()

    async def consume() -> None:
        try:
            async for token in engine.generate([1, 2, 3], max_tokens=100_000):
                got.append(token)
                if len(got) == 5:
                    leave.set()
        except RequestAborted as exc:
            errors.append(exc)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(enter)
            await entered.wait()
            tg.start_soon(consume)
            await leave.wait()
            # leave from this task: the loop is cancelled, the open stream ends, its cache is freed
            await engine.__aexit__(None, None, None)
    assert len(errors) == 1 and "CANCELLED" in str(errors[0])
    assert cache.free_pages == 256 and cache.free_slots == 16
    assert "closed" in repr(engine)
    with pytest.raises(EngineClosed):
        await engine.generate([1], max_tokens=1).collect()


@pytest.mark.anyio
async def test_a_loop_that_fails_on_its_own_fails_its_requests_and_raises_at_exit() -> None:
    class BrokenCache(FakeCache):
        def commit(self, request_id: int, token_ids: Sequence[int], *, num_pending_replay: int = 0) -> None:
            raise RuntimeError("cache bug")  # on the loop, outside the model step: nothing catches it

    cache = BrokenCache(num_pages=256, num_slots=16, tokens_per_block=4)
    engine = Engine(FakeRunner(), cache, EngineConfig(SchedulerConfig(64, 8, 64, 4), step_in_thread=False))
    with anyio.fail_after(30), pytest.raises(RuntimeError, match="cache bug"):
        async with engine:
            generation = engine.generate([1, 2, 3], max_tokens=4)
            with pytest.raises(RequestAborted):
                await generation.collect()
    assert generation.statistics().state is RequestState.FAILED


@pytest.mark.anyio
async def test_cancelled_while_entering_leaves_nothing_running() -> None:
    engine, cache = make_engine()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await engine.__aenter__()
    assert engine._done is not None and engine._done.is_set()
    assert cache.free_pages == 256


@pytest.mark.anyio
@pytest.mark.parametrize("in_thread", [False, True])
@pytest.mark.parametrize("consumers", [1, 8])
async def test_a_cancel_scope_reaches_consumers_of_a_busy_engine(in_thread: bool, consumers: int) -> None:
    # anyio delivers a cancellation only to a task whose wake-up is not pending; a step run on the loop itself
    # woke every consumer just before each delivery attempt, so a timeout (or Ctrl-C: `kvferry demo` and
    # `generate` step on the loop) never reached them while the engine was busy
    cache = FakeCache(num_pages=1 << 20, num_slots=16, tokens_per_block=4)
    engine = Engine(
        FakeRunner(), cache, EngineConfig(SchedulerConfig(64, 8, 64, 4), step_in_thread=in_thread)
    )
    got = [0] * consumers
    start = time.monotonic()

    async def consume(i: int) -> None:
        async for _ in engine.generate([1, 2, 3], max_tokens=100_000):
            got[i] += 1
            if time.monotonic() - start > 10:
                return  # the cancellation never came (without this the test would never end)

    async with engine:
        with anyio.move_on_after(0.5) as scope:
            async with anyio.create_task_group() as tg:
                for i in range(consumers):
                    tg.start_soon(consume, i)
        assert time.monotonic() - start < 5 and scope.cancelled_caught and all(got)
        await engine.wait_idle()
    assert cache.free_pages == 1 << 20 and cache.free_slots == 16
