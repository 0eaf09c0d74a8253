"""EngineConfig.overlap: the loop hands the last step's commits to the manager and grows the next step's decodes
while a step's model runs. The tokens are those without overlap (greedy, seeded, speculative, under preemption,
with cancellations), the manager ends in the same state, and the overlap really happens."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import attrs
import pytest
from attrs import define

from kvferry.engine.runner import BuiltEngine, EngineOptions, build_engine
from kvferry.engine.scheduler import Scheduler, StepPlan
from tests.engine.test_conversation import MAX_TOKENS as TURN_TOKENS
from tests.engine.test_conversation import TURNS
from tests.engine.test_engine import (
    MAX_TOKENS,
    PROMPTS,
    assert_all_free,
    free_counts,
    run_all,
    submits_in_order,
)


def options(overlap: bool, **kwargs: object) -> EngineOptions:
    base: dict[str, object] = {
        "dtype": "float64",
        "num_pages": 128,
        "max_running": 8,
        # without overlap the step runs on the loop: the reference order of every manager operation
        "step_in_thread": overlap,
        "overlap": overlap,
    }
    base.update(kwargs)
    return EngineOptions(**base)  # type: ignore[arg-type]


@define(eq=False)
class CountingScheduler(Scheduler):
    """Counts the grows done ahead, and the flushes that found commits, while steps ran."""

    grown_ahead: int = attrs.field(default=0, init=False)

    def grow_ahead(self, plan: StepPlan) -> bool:
        grew = super().grow_ahead(plan)
        self.grown_ahead += grew
        return grew


def counting(built: BuiltEngine) -> CountingScheduler:
    scheduler = CountingScheduler(built.cache, built.engine.config.scheduler)
    built.engine.scheduler = scheduler
    return scheduler


LONG = [24, 19, 30, 17, 26, 21]  # long enough for many pure decode steps (and blocks filling during them)


@pytest.mark.parametrize(
    ("case", "kwargs", "run_kwargs"),
    [
        ("greedy", {}, {}),
        ("seeded", {}, {"seed": 5}),
        ("decode snapshots", {"snapshot_interval": 8}, {}),
        ("speculative", {"max_spec_k": 2, "max_prefill_chunk": 5}, {"spec_k": 2}),
        ("tensor parallel", {"tp": 2}, {}),
    ],
)
@pytest.mark.anyio
async def test_overlap_gives_the_same_tokens_and_manager_state(
    case: str, kwargs: dict[str, object], run_kwargs: dict[str, int]
) -> None:
    runs = []
    for overlap in (False, True):
        built = build_engine("tiny", options(overlap, **kwargs))
        scheduler = counting(built)
        initial = free_counts(built)
        tokens = await run_all(built, PROMPTS, LONG, **run_kwargs)  # type: ignore[arg-type]
        stats = built.cache.statistics()
        runs.append((tokens, stats.snapshots_taken, stats.reuse_hit_tokens))
        if overlap and not run_kwargs.get("spec_k"):  # speculating requests grow at schedule (window unknown)
            assert scheduler.grown_ahead >= 5, case
        if overlap:
            assert all(t.overlapped_seconds > 0 for t in built.engine.step_timings), case
        assert_all_free(built, initial)
    assert runs[0] == runs[1], case
    assert [len(t) for t in runs[0][0]] == LONG


@pytest.mark.anyio
async def test_overlap_under_page_pressure_preempts_and_gives_the_same_tokens(anyio_backend: str) -> None:
    # 12 usable pages of 4 tokens: the six requests need ~24 together, so some are suspended and resumed
    results = []
    for overlap in (False, True):
        built = build_engine("tiny", options(overlap, num_pages=13, max_prefill_chunk=4, enable_reuse=False))
        initial = free_counts(built)
        results.append(await run_all(built))
        if submits_in_order(anyio_backend):  # trio's order of submission may fit without preempting
            assert built.engine.scheduler.statistics().num_preemptions > 0
        stats = built.cache.statistics()
        assert stats.restores == stats.offloads
        assert_all_free(built, initial)
    assert results[0] == results[1]
    assert [len(t) for t in results[0]] == MAX_TOKENS


async def cancel_mid_stream(built: BuiltEngine, stops: Sequence[int | None]) -> list[list[int]]:
    """Every prompt's stream; stream ``i`` is left after ``stops[i]`` tokens (None: read to the end)."""
    results: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        async with anyio.create_task_group():
            generation = built.engine.generate(PROMPTS[i], max_tokens=LONG[i])
            async for token in generation:
                results[i].append(token)
                if len(results[i]) == stops[i]:
                    break  # the engine frees the request at its next step boundary

    with anyio.fail_after(60):
        async with built.engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(one, i)
            await built.engine.wait_idle()
    return results


@pytest.mark.anyio
async def test_cancellations_while_steps_run_change_no_other_token() -> None:
    stops = [3, None, 11, None, 1, 7]
    results = []
    for overlap in (False, True):
        built = build_engine("tiny", options(overlap))
        initial = free_counts(built)
        results.append(await cancel_mid_stream(built, stops))
        assert built.engine.statistics().num_cancelled == 4
        assert_all_free(built, initial)
    assert results[0] == results[1]
    assert [len(t) for t in results[0]] == [s or n for s, n in zip(stops, LONG, strict=True)]


class CountingPrepares:
    """The runner, counting the steps prepared (on the loop, right before each step's model starts)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.prepared = 0

    def prepare_step(self) -> None:
        self.prepared += 1
        self.inner.prepare_step()  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.anyio
async def test_with_overlap_a_stream_takes_a_steps_token_while_the_next_step_runs(overlap: bool) -> None:
    built = build_engine("tiny", options(overlap))
    runner = CountingPrepares(built.engine.runner)
    built.engine.runner = runner  # type: ignore[assignment]
    with anyio.fail_after(60):
        async with built.engine:
            # per token: steps prepared minus steps done when the stream got it
            seen = [
                runner.prepared - built.engine.statistics().num_steps
                async for _ in built.engine.generate(PROMPTS[2], max_tokens=10)
            ]
    # with overlap the streams wake once the next step has started (the last token: before the loop idles)
    assert seen == ([1] * 9 + [0] if overlap else [0] * 10)


async def run_mixed(built: BuiltEngine, *, sequential: bool) -> list[list[int]]:
    """Greedy and seeded requests (seeded: every other prompt) in one engine."""
    results: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        seed = 7 + i if i % 2 else None
        results[i] = await built.engine.generate(PROMPTS[i], max_tokens=LONG[i], seed=seed).collect()

    with anyio.fail_after(60):
        async with built.engine:
            if sequential:
                for i in range(len(PROMPTS)):
                    await one(i)
            else:
                async with anyio.create_task_group() as tg:
                    for i in range(len(PROMPTS)):
                        tg.start_soon(one, i)
    return results


@pytest.mark.anyio
async def test_greedy_and_seeded_requests_in_one_batch_get_their_own_tokens() -> None:
    alone = await run_mixed(build_engine("tiny", options(False)), sequential=True)
    for overlap in (False, True):
        built = build_engine("tiny", options(overlap))
        assert await run_mixed(built, sequential=False) == alone
        assert built.engine.statistics().num_steps < sum(LONG)  # they really were batched


async def talk(built: BuiltEngine, shift: int, spec_k: int, seen: list[tuple[list[int], int, int]]) -> None:
    """A conversation of TURNS (shifted by ``shift``), each turn's tokens, reuse and kept cache into ``seen``."""
    with built.engine.conversation(spec_k=spec_k) as conversation:
        for prompt, max_tokens in zip(TURNS, TURN_TOKENS, strict=True):
            turn = conversation.turn([(t + shift) % 256 for t in prompt], max_tokens=max_tokens + shift)
            tokens = await turn.collect()
            seen.append((tokens, conversation.turns[-1].reused_tokens, conversation.cached_tokens))


@pytest.mark.parametrize("spec_k", [0, 2])
@pytest.mark.anyio
async def test_conversations_keep_the_same_cache_with_overlap(spec_k: int) -> None:
    """Two conversations side by side, turn after turn: the same tokens, reuse and kept cache on and off."""
    runs = []
    for overlap in (False, True):
        built = build_engine("tiny", options(overlap, max_spec_k=2, snapshot_interval=8))
        initial = free_counts(built)
        seen: list[tuple[list[int], int, int]] = []
        with anyio.fail_after(120):
            async with built.engine, anyio.create_task_group() as tg:
                tg.start_soon(talk, built, 0, spec_k, seen)
                tg.start_soon(talk, built, 3, spec_k, seen)
        runs.append(sorted(seen))
        assert_all_free(built, initial)
    assert runs[0] == runs[1]
    assert any(reused for _, reused, _ in runs[0])
