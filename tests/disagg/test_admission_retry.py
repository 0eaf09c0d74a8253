"""A transferred request whose admission did not fit at first is admitted later without matching the generation
engine's prefix cache: the transfer writes every page of its prompt, and its whole prompt is committed when
the cache lands.

Matching the prefix cache on the retry would give the request committed tokens before its cache landed, and
the landing's commit of the whole prompt would exceed its capacity: the generation engine's step loop fails
(:class:`~kvferry.errors.InvalidTransition`) and every request on it with it.
"""

from __future__ import annotations

import random

import anyio
import pytest

from kvferry.engine.request import RequestState
from kvferry.engine.runner import build_engine
from tests.support.disagg_pair import counts, options, pair, until

pytestmark = pytest.mark.timeout(120)

rng = random.Random(21)
#: runs on the generation engine itself: its prompt (four whole blocks of 4 tokens) goes to that engine's prefix
#: cache, with a snapshot of its state at its end
LOCAL = [rng.randrange(256) for _ in range(16)]
LOCAL_TOKENS = 70
#: routed; its prompt starts with LOCAL's
ROUTED = LOCAL + [rng.randrange(256) for _ in range(20)]
#: 24 pages of 4 tokens: LOCAL ends up with 22 of them, ROUTED's admission needs 9
GEN_PAGES = 25


async def aggregated(prompt: list[int], max_tokens: int) -> list[int]:
    built = build_engine("tiny", options())
    async with built.engine:
        return await built.engine.generate(prompt, max_tokens=max_tokens, spec_k=0).collect()


@pytest.mark.anyio
async def test_a_transfer_admitted_on_a_retry_does_not_match_the_prefix_cache() -> None:
    expected_local = await aggregated(LOCAL, LOCAL_TOKENS)
    expected_routed = await aggregated(ROUTED, 6)
    async with pair(gen_options=options(num_pages=GEN_PAGES, max_running=2)) as p:
        gen_before = counts(p.gen)
        got: dict[str, list[int]] = {}
        local = p.gen.engine.generate(LOCAL, max_tokens=LOCAL_TOKENS, spec_k=0)

        async def run_local() -> None:
            got["local"] = await local.collect()

        async def run_routed() -> None:
            got["routed"] = await p.router.generate(ROUTED, max_tokens=6, spec_k=0).collect()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_local)
            # the local request holds more than 15 pages: the routed one's 9 do not fit until it ends
            await until(lambda: p.gen.cache.primary.statistics().pages_free < 9, 30, lambda: counts(p.gen))
            assert "local" not in got
            tg.start_soon(run_routed)
        assert got == {"local": expected_local, "routed": expected_routed}
        assert p.gen.engine.statistics().num_failed == 0
        await p.gen.engine.wait_idle()
        await until(lambda: counts(p.gen) == gen_before, 5, lambda: (counts(p.gen), gen_before))


@pytest.mark.anyio
async def test_transfers_cancelled_before_admission_leave_nothing() -> None:
    """Requests cancelled while they wait for admission (some tried and refused, some never tried) leave nothing
    behind."""
    async with pair(gen_options=options(num_pages=GEN_PAGES, max_running=2)) as p:
        gen_before = counts(p.gen)
        local = p.gen.engine.generate(LOCAL, max_tokens=LOCAL_TOKENS, spec_k=0)
        routed = [p.router.generate([*ROUTED, i], max_tokens=6, spec_k=0) for i in range(3)]

        async def drain(i: int) -> None:
            async for _ in routed[i]:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(local.collect)
            await until(lambda: p.gen.cache.primary.statistics().pages_free < 9, 30, lambda: counts(p.gen))
            async with anyio.create_task_group() as clients:
                for i in range(len(routed)):
                    clients.start_soon(drain, i)
                await until(
                    lambda: all(
                        r.generation is not None and r.generation.request.state is RequestState.WAITING
                        for r in routed
                    ),
                    30,
                    p.context.statistics,
                )
                clients.cancel_scope.cancel()
        await p.gen.engine.wait_idle()
        await until(lambda: counts(p.gen) == gen_before, 5, lambda: (counts(p.gen), gen_before))
        await until(lambda: p.context.statistics()["held"] == 0, 5, p.context.statistics)
