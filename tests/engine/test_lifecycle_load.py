"""A loaded run with random suspends, offloads, resumes, rebalances and conversation turns (kept, offloaded or
dropped between turns) keeps every token of an undisturbed run and gives every page and slot back."""

from __future__ import annotations

import random

import anyio
import pytest

from kvferry.engine.generation import Generation
from kvferry.engine.request import RequestState
from kvferry.engine.runner import BuiltEngine, build_engine
from kvferry.errors import RebalanceRefused, RequestAborted
from tests.engine.test_engine import options

pytestmark = pytest.mark.anyio

SPEC_K = 2


def engine(**kwargs: object) -> BuiltEngine:
    return build_engine("tiny", options(max_spec_k=SPEC_K, **kwargs))


def plan(seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Plain prompts, and the turns of a few conversations."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(2, 30))] for _ in range(24)]
    chats = [[[rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(3)] for _ in range(4)]
    return prompts, chats


MAX_TOKENS = 8


async def undisturbed(
    prompts: list[list[int]], chats: list[list[list[int]]]
) -> tuple[list[list[int]], list[list[list[int]]]]:
    built = engine(enable_reuse=False, num_pages=512, max_running=16)
    async with built.engine:
        plain = [
            await built.engine.generate(p, max_tokens=MAX_TOKENS, spec_k=SPEC_K * (i % 2)).collect()
            for i, p in enumerate(prompts)
        ]
        turns = []
        for chat in chats:
            with built.engine.conversation(spec_k=SPEC_K) as conversation:
                turns.append([await conversation.turn(t, max_tokens=MAX_TOKENS).collect() for t in chat])
    return plain, turns


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_suspends_offloads_and_rebalances_keep_every_token(seed: int) -> None:
    prompts, chats = plan(seed)
    expected_plain, expected_turns = await undisturbed(prompts, chats)
    built = engine(num_pages=96, max_running=6, host_memory=200_000)
    rng = random.Random(seed)
    plain: dict[int, list[int]] = {}
    turns: dict[int, list[list[int]]] = {}
    live: list[Generation] = []
    done = anyio.Event()
    moves = {"suspends": 0, "rebalances": 0, "refused": 0}

    async def request(i: int) -> None:
        generation = built.engine.generate(prompts[i], max_tokens=MAX_TOKENS, spec_k=SPEC_K * (i % 2))
        live.append(generation)
        plain[i] = await generation.collect()
        live.remove(generation)

    async def chat(c: int) -> None:
        with built.engine.conversation(spec_k=SPEC_K) as conversation:
            turns[c] = []
            for t, prompt in enumerate(chats[c]):
                if t:
                    mode = rng.choice(["keep", "offload", "drop"])
                    if mode == "offload":
                        await conversation.offload()
                    elif mode == "drop":
                        conversation.drop()
                turns[c].append(await conversation.turn(prompt, max_tokens=MAX_TOKENS).collect())
                await anyio.sleep(rng.random() * 0.01)

    async def disturb() -> None:
        sizes = [{"num_pages": 64}, {"num_pages": 128, "num_slots": 20}, {"num_pages": 96, "num_slots": 13}]
        while not done.is_set():
            await anyio.sleep(rng.random() * 0.02)
            running = [g for g in live if g.request.state in (RequestState.PREFILLING, RequestState.DECODING)]
            if running and rng.random() < 0.6:
                victim = rng.choice(running)
                try:
                    await victim.suspend()
                except RequestAborted:
                    continue  # it ended meanwhile
                if rng.random() < 0.5:
                    await victim.offload()
                await anyio.sleep(rng.random() * 0.01)
                victim.resume()
                moves["suspends"] += 1
            else:
                try:
                    await built.engine.rebalance(**rng.choice(sizes))
                    moves["rebalances"] += 1
                except RebalanceRefused:
                    moves["refused"] += 1  # a request would not fit the smaller pools

    with anyio.fail_after(240):
        async with built.engine, anyio.create_task_group() as tg:
            tg.start_soon(disturb)
            async with anyio.create_task_group() as work:
                for i in range(len(prompts)):
                    work.start_soon(request, i)
                for c in range(len(chats)):
                    work.start_soon(chat, c)
            done.set()
    assert [plain[i] for i in range(len(prompts))] == expected_plain
    assert [turns[c] for c in range(len(chats))] == expected_turns
    assert moves["suspends"] > 0 and moves["rebalances"] > 0
    assert built.engine.statistics().num_failed == 0
    for m in built.cache.managers:
        s = m.statistics()
        assert s.pages_used == 0 and s.slots_live == 0 and s.draft_pages_used == 0
        assert s.requests_active == 0 and s.requests_suspended == 0
