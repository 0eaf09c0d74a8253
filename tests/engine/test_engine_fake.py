"""Engine mechanics over a fake model and a fake cache: concurrency, speculation, cancellation, accounting."""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from contextlib import aclosing
from typing import TypeVar

import anyio
import pytest

from kvferry.engine.engine import Engine, EngineConfig
from kvferry.engine.request import RequestState
from kvferry.engine.scheduler import SchedulerConfig
from kvferry.errors import ConfigError, EngineClosed, RequestAborted
from tests.support.engine_fakes import FakeCache, FakeRunner

pytestmark = pytest.mark.anyio

T = TypeVar("T")

PROMPTS = [[(7 * i + j) % 64 for j in range(3 + 5 * i)] for i in range(8)]


def make_engine(
    *,
    pages: int = 256,
    slots: int = 16,
    budget: int = 64,
    running: int = 8,
    chunk: int = 64,
    max_k: int = 4,
    in_thread: bool = False,
    runner: FakeRunner | None = None,
) -> tuple[Engine, FakeCache, FakeRunner]:
    cache = FakeCache(num_pages=pages, num_slots=slots, tokens_per_block=4)
    runner = runner or FakeRunner()
    config = EngineConfig(SchedulerConfig(budget, running, chunk, max_k), step_in_thread=in_thread)
    return Engine(runner, cache, config), cache, runner


async def test_one_request_matches_the_reference() -> None:
    engine, cache, runner = make_engine()
    with anyio.fail_after(10):
        async with engine:
            generation = engine.generate(PROMPTS[2], max_tokens=9)
            tokens = await generation.collect()
    assert tokens == runner.greedy(PROMPTS[2], 9)
    stats = generation.statistics()
    assert stats.state is RequestState.FINISHED and stats.finish_reason == "length"
    assert stats.num_generated == 9 and stats.num_drafted == 0
    assert cache.free_pages == 256 and cache.free_slots == 16


@pytest.mark.parametrize(
    ("spec_k", "chunk", "budget", "pages", "in_thread"),
    [(0, 64, 64, 256, False), (1, 3, 64, 256, True), (2, 5, 48, 24, False), (4, 1, 48, 20, False)],
)
async def test_batched_speculative_chunked_and_preempted_runs_equal_the_reference(
    spec_k: int, chunk: int, budget: int, pages: int, in_thread: bool
) -> None:
    engine, cache, runner = make_engine(pages=pages, budget=budget, chunk=chunk, in_thread=in_thread)
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        results[i] = await engine.generate(PROMPTS[i], max_tokens=6 + i, spec_k=spec_k).collect()

    with anyio.fail_after(20):
        async with engine, anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
    for i, prompt in enumerate(PROMPTS):
        assert results[i] == runner.greedy(prompt, 6 + i), i
    stats = engine.statistics()
    assert stats.num_generated == sum(6 + i for i in range(len(PROMPTS)))
    if spec_k:
        assert 0 < stats.num_accepted < stats.num_drafted  # both accept and reject paths ran
        assert all(n >= 1 for seq in runner.accepted.values() for n in seq)
    if pages < 64:
        assert engine.scheduler.statistics().num_preemptions > 0
    assert cache.free_pages == pages and cache.free_slots == 16 and not cache.offloaded


async def test_stop_ids_end_the_stream_and_are_yielded() -> None:
    engine, _, runner = make_engine()
    reference = runner.greedy(PROMPTS[1], 12)
    stop = reference[4]
    first = reference.index(stop)
    async with engine:
        tokens = await engine.generate(PROMPTS[1], max_tokens=12, stop_ids=[stop], spec_k=3).collect()
    assert tokens == reference[: first + 1]


async def test_seeded_sampling_is_the_same_alone_batched_and_speculative() -> None:
    engine, _, _ = make_engine()
    async with engine:
        alone = await engine.generate(PROMPTS[3], max_tokens=10, seed=5).collect()
        greedy = await engine.generate(PROMPTS[3], max_tokens=10).collect()
        results: dict[int, list[int]] = {}

        async def one(i: int, k: int) -> None:
            results[i] = await engine.generate(PROMPTS[3], max_tokens=10, seed=5, spec_k=k).collect()

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i, i)
    assert alone != greedy
    assert all(tokens == alone for tokens in results.values())


async def test_cancel_at_random_points_frees_everything_and_the_engine_keeps_serving() -> None:
    engine, cache, runner = make_engine(pages=40, budget=48, chunk=3, in_thread=True)
    rng = random.Random(1)
    tasks_before = len(anyio.get_running_tasks())

    async def consumer(i: int) -> None:
        stop_after = rng.randrange(0, 8)
        mode = rng.choice(["break", "scope", "aclose"])
        generation = engine.generate(PROMPTS[i % 8], max_tokens=12, spec_k=i % 3)
        if mode == "scope":
            with anyio.move_on_after(rng.random() * 0.02):
                await generation.collect()
        elif mode == "aclose":
            iterator = generation.__aiter__()
            assert isinstance(iterator, AsyncGenerator)
            async with aclosing(iterator) as tokens:
                async for n, _ in aenumerate(tokens):
                    if n >= stop_after:
                        break
        else:
            async for n, _ in aenumerate(generation):
                if n >= stop_after:
                    break

    with anyio.fail_after(20):
        async with engine:
            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(consumer, i)
            await engine.wait_idle()
            assert cache.free_pages == 40 and cache.free_slots == 16 and not cache.pages
            assert not runner.history
            assert engine.statistics().num_cancelled > 0
            # still serving, still correct
            tokens = await engine.generate(PROMPTS[4], max_tokens=5, spec_k=2).collect()
            assert tokens == runner.greedy(PROMPTS[4], 5)
    assert len(anyio.get_running_tasks()) == tasks_before
    assert cache.free_pages == 40 and cache.free_slots == 16


async def aenumerate(iterable: AsyncIterable[T]) -> AsyncIterator[tuple[int, T]]:
    n = 0
    async for item in iterable:
        yield n, item
        n += 1


async def test_closing_the_engine_aborts_open_streams_and_frees_them() -> None:
    engine, cache, _ = make_engine(in_thread=True)
    got: list[int] = []
    errors: list[BaseException] = []
    three = anyio.Event()

    async def consumer() -> None:
        try:
            async for token in engine.generate(PROMPTS[5], max_tokens=10_000):
                got.append(token)
                if len(got) == 3:
                    three.set()
        except RequestAborted as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, engine:
            tg.start_soon(consumer)
            await three.wait()
    assert len(errors) == 1 and "CANCELLED" in str(errors[0])
    assert cache.free_pages == 256 and cache.free_slots == 16
    with pytest.raises(EngineClosed):
        await engine.generate(PROMPTS[0], max_tokens=1).collect()
    assert "closed" in repr(engine)


async def test_a_failed_model_step_fails_its_requests_and_the_engine_keeps_serving() -> None:
    runner = FakeRunner(fail_on_token=63)
    engine, cache, _ = make_engine(runner=runner)
    async with engine:
        with pytest.raises(RequestAborted, match="model step failed"):
            await engine.generate([1, 2, 63], max_tokens=3).collect()
        tokens = await engine.generate(PROMPTS[0], max_tokens=4).collect()
        assert tokens == runner.greedy(PROMPTS[0], 4)
        assert engine.statistics().num_failed == 1
    assert cache.free_pages == 256


async def test_bad_arguments_are_refused_before_anything_is_submitted() -> None:
    engine, _, _ = make_engine(max_k=2)
    async with engine:
        with pytest.raises(ConfigError):
            engine.generate([1, 64], max_tokens=2)
        with pytest.raises(ConfigError):
            engine.generate([1], max_tokens=2, spec_k=3)
        with pytest.raises(ConfigError):
            engine.generate([], max_tokens=2)
        with pytest.raises(ConfigError):
            engine.generate([1], max_tokens=0)
        assert engine.statistics().num_waiting == 0


async def test_an_error_in_the_engine_block_propagates_unwrapped_and_frees_everything() -> None:
    engine, cache, _ = make_engine()
    with pytest.raises(KeyError, match="boom"):
        async with engine:
            generation = engine.generate(PROMPTS[0], max_tokens=100)
            async for _ in generation:
                raise KeyError("boom")
    assert cache.free_pages == 256 and cache.free_slots == 16
    assert generation.statistics().state is RequestState.CANCELLED
