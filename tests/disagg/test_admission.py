"""Admission and backpressure across disaggregation: the generation engine admits a transferred request only
when its scheduler can give it a batch row, pages and a slot (in arrival order, with every other request), and
the context side keeps the finished prefill (moved to the host when its engine needs the room) until it is
pulled. Load far above one batch and above both engines' pages completes, token for token as aggregated, and
every pool comes back to where it started."""

from __future__ import annotations

import random

import anyio
import pytest

from kvferry.disagg.router import RoutedGeneration
from kvferry.engine.request import RequestState
from kvferry.engine.runner import build_engine
from tests.support.disagg_pair import counts, options, pair, until
from tests.support.disagg_reference import SPEC_K

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 6
#: tight pools on both sides: 40 requests need about 6 pages each, the engines have 48 (and 4 batch rows)
TIGHT = {"num_pages": 49, "max_running": 4}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


async def aggregated(batch: list[list[int]]) -> list[list[int]]:
    built = build_engine("tiny", options())
    async with built.engine:
        return [await built.engine.generate(p, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect() for p in batch]


@pytest.mark.anyio
async def test_load_above_one_batch_and_the_pools_completes_identically() -> None:
    batch = prompts(40, seed=3)
    expected = await aggregated(batch)
    async with pair(gen_options=options(**TIGHT), ctx_options=options(**TIGHT)) as p:
        gen_before, ctx_before = counts(p.gen), counts(p.ctx)
        most_running = 0

        def watch() -> None:
            nonlocal most_running
            most_running = max(most_running, p.gen.engine.scheduler.statistics().num_running)

        routed = [p.router.generate(prompt, max_tokens=MAX_TOKENS, spec_k=SPEC_K) for prompt in batch]
        got: list[list[int]] = [[] for _ in batch]

        async def one(i: int) -> None:
            got[i] = await routed[i].collect()

        async with anyio.create_task_group() as tg:
            for i in range(len(batch)):
                tg.start_soon(one, i)
            with anyio.fail_after(150):
                while any(not g for g in got):
                    watch()
                    await anyio.sleep(0.002)
        assert got == expected
        # the generation side never ran more than its rows: the rest waited for admission, none failed
        assert most_running <= TIGHT["max_running"]
        assert p.gen.engine.statistics().num_failed == 0 and p.ctx.engine.statistics().num_failed == 0
        # the context side moved held caches to the host to make room for later prompts, and back for the push
        ctx_stats = p.ctx.cache.statistics()
        assert ctx_stats.offloads > 0 and ctx_stats.restores > 0
        await until(lambda: p.context.statistics()["held"] == 0, 5, p.context.statistics)
        await p.gen.engine.wait_idle()
        await until(lambda: counts(p.gen) == gen_before, 5, lambda: (counts(p.gen), gen_before))
        await until(lambda: counts(p.ctx) == ctx_before, 5, lambda: (counts(p.ctx), ctx_before))


@pytest.mark.anyio
async def test_cancel_while_queued_for_admission_frees_both_sides() -> None:
    """Requests that wait for a batch row on the generation side (their caches held by the context side) are
    cancelled: the context side frees their caches, nothing stays allocated on either side."""
    batch = prompts(12, seed=5)
    async with pair(
        gen_options=options(num_pages=49, max_running=1), ctx_options=options(num_pages=49, max_running=4)
    ) as p:
        gen_before, ctx_before = counts(p.gen), counts(p.ctx)
        routed = [p.router.generate(prompt, max_tokens=40, spec_k=SPEC_K) for prompt in batch]

        async def drain(r: RoutedGeneration) -> None:
            async for _ in r:
                pass

        async with anyio.create_task_group() as tg:
            for r in routed:
                tg.start_soon(drain, r)
            # some are decoding or transferring, the rest wait for admission with their caches held
            await until(
                lambda: (
                    any(
                        r.generation is not None and r.generation.request.state is RequestState.WAITING
                        for r in routed
                    )
                    and p.context.statistics()["held"] >= 3
                ),
                60,
                p.context.statistics,
            )
            tg.cancel_scope.cancel()
        await until(lambda: p.context.statistics()["held"] == 0, 10, p.context.statistics)
        await until(lambda: counts(p.gen) == gen_before, 10, lambda: (counts(p.gen), gen_before))
        await until(lambda: counts(p.ctx) == ctx_before, 10, lambda: (counts(p.ctx), ctx_before))
        assert p.gen.engine.statistics().num_running == 0 and p.gen.engine.statistics().num_waiting == 0
        # and the pair still serves
        assert len(await p.router.generate(batch[0], max_tokens=4, spec_k=SPEC_K).collect()) == 4


@pytest.mark.anyio
async def test_each_context_engine_gets_at_most_its_window_and_the_rest_wait_in_order() -> None:
    batch = prompts(12, seed=7)
    expected = await aggregated(batch)
    async with pair() as p:
        p.router.context_window = 2
        most = 0
        started: list[int] = []
        routed = [p.router.generate(prompt, max_tokens=MAX_TOKENS, spec_k=SPEC_K) for prompt in batch]
        got: list[list[int]] = [[] for _ in batch]

        async def one(i: int) -> None:
            async for token in routed[i]:
                if not got[i]:
                    started.append(i)
                got[i].append(token)

        async with anyio.create_task_group() as tg:
            for i in range(len(batch)):
                tg.start_soon(one, i)
                await anyio.lowlevel.checkpoint()  # arrival order = index order
            with anyio.fail_after(120):
                while any(len(g) < MAX_TOKENS for g in got):
                    most = max(
                        most, p.worker.links[0].in_flight, len(p.context.statistics() and p.context._held)
                    )
                    await anyio.sleep(0.001)
        assert got == expected
        assert most <= 2
        # prompts this short prefill in one step: first tokens come in arrival order when the queue is fair
        assert started == sorted(started)
        assert p.router.queued == 0 and p.worker.links[0].in_flight == 0
