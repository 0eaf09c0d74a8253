"""Engine.rebalance resizes the pools while serving: requests running across it get the tokens of a run without
it (plain, speculative, tensor-parallel), the model follows the new memory, and a rebalance that a transfer or a
request's size forbids is refused with a typed error and changes nothing."""

from __future__ import annotations

import anyio
import pytest

from kvferry.engine.request import RequestState
from kvferry.engine.runner import BuiltEngine, build_engine
from kvferry.errors import RebalanceRefused
from kvferry.pools.lifecycle import Offload
from tests.engine.test_engine import MAX_TOKENS, PROMPTS, options, run_all

pytestmark = pytest.mark.anyio


def engine(**kwargs: object) -> BuiltEngine:
    return build_engine("tiny", options(**kwargs))


def assert_pools_empty(built: BuiltEngine) -> None:
    for m in built.cache.managers:
        s = m.statistics()
        assert s.pages_used == 0 and s.slots_live == 0 and s.draft_pages_used == 0
        assert s.requests_active == 0 and s.requests_suspended == 0


@pytest.mark.parametrize(
    ("kwargs", "spec_k"),
    [({}, 0), ({"max_spec_k": 2}, 2), ({"tp": 2}, 0), ({"tp": 2, "max_spec_k": 2}, 2)],
    ids=["plain", "speculative", "tp2", "tp2-speculative"],
)
async def test_rebalances_in_the_middle_of_a_loaded_run_keep_every_token(
    kwargs: dict[str, object], spec_k: int
) -> None:
    expected = await run_all(engine(enable_reuse=False, **kwargs), spec_k=spec_k)
    built = engine(num_pages=40, **kwargs)
    results: list[list[int]] = [[] for _ in PROMPTS]
    sizes = [{"num_pages": 128}, {"num_pages": 24, "num_slots": 40}, {"num_pages": 60, "num_slots": 12}]
    done: list[int] = []  # how many tokens request 2 (the longest) had read at each rebalance
    with anyio.fail_after(120):
        async with built.engine:

            async def one(i: int) -> None:
                generation = built.engine.generate(PROMPTS[i], max_tokens=MAX_TOKENS[i], spec_k=spec_k)
                async for token in generation:
                    results[i].append(token)
                    if i == 2 and len(done) < len(sizes) and len(results[i]) >= 2 + 3 * len(done):
                        # it is still running (it has tokens to come), and so may others
                        await built.engine.rebalance(**sizes[len(done)])
                        done.append(len(results[i]))

            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(one, i)
    assert len(done) == len(sizes) and done[-1] < MAX_TOKENS[2]
    assert results == expected
    assert built.engine.statistics().num_failed == 0
    assert built.cache.primary.statistics().restores > 0  # the running requests came back from the host
    for m in built.cache.managers:
        assert m.config.num_pages == 60 and m.config.num_slots == 12
        assert m.arena is not None and m.arena.layout.pool_group("attention").num_slots == 60
    assert_pools_empty(built)


async def test_a_grown_engine_serves_every_following_request() -> None:
    expected = await run_all(engine(enable_reuse=False))
    built = engine(num_pages=40)
    async with built.engine:
        await built.engine.rebalance(num_pages=128)
        got = [
            await built.engine.generate(p, max_tokens=n).collect()
            for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
        ]
    assert got == expected


async def test_a_rebalance_while_a_transfer_may_touch_the_pools_is_refused_and_changes_nothing() -> None:
    built = engine()
    async with built.engine:
        conversation = built.engine.conversation()
        first = await conversation.turn(PROMPTS[4], max_tokens=6).collect()
        rid = conversation.conversation_id
        for m in built.cache.managers:  # a push reads it, as a context engine's held cache
            m.pin(rid)
            assert m._get(rid).offload is Offload.NEVER
        before = [m.debug_state() for m in built.cache.managers]
        with pytest.raises(RebalanceRefused, match="transfer"):
            await built.engine.rebalance(num_pages=64)
        assert [m.debug_state() for m in built.cache.managers] == before
        # a request waiting for its cache from another engine forbids it as well
        incoming = built.engine.generate(PROMPTS[2], max_tokens=4)
        await built.engine.admit_transfer(incoming)
        assert incoming.request.state is RequestState.TRANSFERRING
        with pytest.raises(RebalanceRefused, match="wait for their cache"):
            await built.engine.rebalance(num_pages=64)
        incoming.cancel()
        second = await conversation.turn(PROMPTS[3], max_tokens=6).collect()
    expected_first = await run_all(engine(enable_reuse=False), [PROMPTS[4]], [6])
    history = list(PROMPTS[4]) + first + list(PROMPTS[3])
    expected_second = await run_all(engine(enable_reuse=False), [history], [6])
    assert [first] == expected_first and [second] == expected_second


async def test_a_rebalance_that_a_request_or_the_sizes_forbid_is_refused() -> None:
    built = engine()
    async with built.engine:
        conversation = built.engine.conversation()
        await conversation.turn(PROMPTS[5] * 3, max_tokens=8).collect()  # 22 pages of 4 tokens
        with pytest.raises(RebalanceRefused, match="cannot take it back"):
            await built.engine.rebalance(num_pages=8)
        with pytest.raises(RebalanceRefused):
            await built.engine.rebalance(num_pages=1)
        more = await conversation.turn(PROMPTS[0], max_tokens=3).collect()
        assert len(more) == 3
        conversation.close()
    assert_pools_empty(built)


async def test_paused_admissions_let_running_requests_free_their_room_first() -> None:
    prompts = [PROMPTS[4], PROMPTS[5], PROMPTS[3]]
    expected = await run_all(engine(enable_reuse=False), prompts, [8, 8, 8])
    built = engine(max_running=1)
    results: dict[int, list[int]] = {}
    async with built.engine:
        generations = [built.engine.generate(p, max_tokens=8) for p in prompts]
        first_token, first_done = anyio.Event(), anyio.Event()

        async def read(i: int) -> None:
            results[i] = []
            async for token in generations[i]:
                results[i].append(token)
                first_token.set()
            if i == 0:
                first_done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read, 0)
            await first_token.wait()
            with built.engine.admissions_paused():
                for i in (1, 2):
                    tg.start_soon(read, i)
                with anyio.fail_after(30):
                    await first_done.wait()
                await anyio.sleep(0.05)  # steps that would admit them, were admissions not paused
                # the running request went on to its end; nothing waiting was admitted meanwhile
                assert generations[0].request.state is RequestState.FINISHED
                assert all(g.request.state is RequestState.WAITING for g in generations[1:])
    assert [results[i] for i in range(3)] == expected
