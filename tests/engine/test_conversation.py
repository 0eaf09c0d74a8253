"""Conversations keep the whole cache between turns: every turn gives exactly the tokens of a fresh run of its whole
history, whether the cache stayed on the device, went to the host and back, or was dropped and recomputed; a turn
suspended, offloaded and resumed in the middle of its decode too; and the pools end as they began."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from kvferry.engine.conversation import Conversation
from kvferry.engine.request import RequestState
from kvferry.engine.runner import BuiltEngine, build_engine
from kvferry.errors import ConfigError, EngineClosed, RequestAborted
from tests.engine.test_engine import assert_all_free, free_counts, options

pytestmark = pytest.mark.anyio

TURNS: list[tuple[int, ...]] = [
    tuple(b"hello there"),
    tuple(b"and then?"),
    tuple(b"ok"),
    tuple(b"tell me more!"),
]
MAX_TOKENS = [9, 6, 11, 7]


def engine(**kwargs: object) -> BuiltEngine:
    return build_engine("tiny", options(**kwargs))


async def fresh(built: BuiltEngine, prompt: Sequence[int], max_tokens: int, spec_k: int = 0) -> list[int]:
    """The tokens a fresh request of ``prompt`` gets (no prefix reuse: a new engine)."""
    async with built.engine:
        return await built.engine.generate(prompt, max_tokens=max_tokens, spec_k=spec_k).collect()


async def expected_turns(spec_k: int, **kwargs: object) -> list[list[int]]:
    history: list[int] = []
    out = []
    for prompt, max_tokens in zip(TURNS, MAX_TOKENS, strict=True):
        history += prompt
        tokens = await fresh(engine(enable_reuse=False, **kwargs), history, max_tokens, spec_k)
        history += tokens
        out.append(tokens)
    return out


async def between_turns(conversation: Conversation, mode: str) -> None:
    if mode in ("offload", "restore"):
        await conversation.offload()
        assert conversation.host_nbytes > 0
    if mode == "restore":  # back on the device before the turn: the turn restores nothing
        assert await conversation.restore()
        assert conversation.host_nbytes == 0
    elif mode == "drop":
        conversation.drop()
        assert conversation.cached_tokens == 0


@pytest.mark.parametrize("spec_k", [0, 2])
@pytest.mark.parametrize("mode", ["device", "offload", "restore", "drop"])
async def test_turns_equal_fresh_runs(spec_k: int, mode: str) -> None:
    kwargs: dict[str, object] = {"max_spec_k": 2} if spec_k else {}
    expected = await expected_turns(spec_k, **kwargs)
    built = engine(**kwargs)
    initial = free_counts(built)
    with anyio.fail_after(120):
        async with built.engine:
            with built.engine.conversation(spec_k=spec_k) as conversation:
                got = []
                for i, (prompt, max_tokens) in enumerate(zip(TURNS, MAX_TOKENS, strict=True)):
                    if i:
                        await between_turns(conversation, mode)
                    got.append(await conversation.turn(prompt, max_tokens=max_tokens).collect())
                    assert conversation.cached_tokens == len(conversation.history) - 1
                turns = conversation.turns
    assert got == expected
    assert [t.num_generated for t in turns] == MAX_TOKENS
    history = 0
    for i, turn in enumerate(turns):
        if i == 0:
            assert turn.restored_bytes == turn.recomputed_tokens == 0
        elif mode == "drop":
            assert turn.recomputed_tokens > 0 and turn.reused_tokens < history - 1
            assert turn.restored_bytes == 0
        else:
            # everything earlier turns computed (all but the last answer token) came from the kept cache
            assert turn.reused_tokens == history - 1 and turn.recomputed_tokens == 0
            assert (turn.restored_bytes > 0) == (mode == "offload")
        history += turn.num_prompt + turn.num_generated
    assert_all_free(built, initial)


@pytest.mark.parametrize("spec_k", [0, 2])
async def test_turn_suspended_offloaded_and_resumed_mid_decode(spec_k: int) -> None:
    kwargs: dict[str, object] = {"max_spec_k": 2} if spec_k else {}
    expected = await expected_turns(spec_k, **kwargs)
    built = engine(**kwargs)
    initial = free_counts(built)
    with anyio.fail_after(120):
        async with built.engine:
            with built.engine.conversation(spec_k=spec_k) as conversation:
                got = []
                for prompt, max_tokens in zip(TURNS, MAX_TOKENS, strict=True):
                    turn = conversation.turn(prompt, max_tokens=max_tokens)
                    tokens: list[int] = []
                    async for token in turn:
                        tokens.append(token)
                        if len(tokens) == 2:
                            await conversation.suspend()
                            assert turn.request.state is RequestState.SUSPENDED
                            await conversation.offload()
                            assert conversation.host_nbytes > 0
                            await anyio.sleep(0.01)  # the engine keeps running without it
                            assert turn.request.state is RequestState.SUSPENDED
                            conversation.resume()
                    got.append(tokens)
    assert got == expected
    assert_all_free(built, initial)


async def test_suspend_offload_resume_a_plain_request_among_others() -> None:
    prompts = [tuple(b"first request"), tuple(b"second"), tuple(b"third one here")]
    expected = [await fresh(engine(enable_reuse=False), p, 12) for p in prompts]
    built = engine(max_running=2, num_pages=24)
    initial = free_counts(built)
    results: dict[int, list[int]] = {}
    three = anyio.Event()
    done = [anyio.Event() for _ in prompts]
    with anyio.fail_after(120):
        async with built.engine:
            generations = [built.engine.generate(p, max_tokens=12) for p in prompts]

            async def read(i: int) -> None:
                results[i] = []
                async for token in generations[i]:
                    results[i].append(token)
                    if i == 0 and len(results[i]) == 3:
                        three.set()
                done[i].set()

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(read, i)
                await three.wait()
                await generations[0].suspend()
                await generations[0].offload()
                # the others get its row and pages meanwhile
                for event in done[1:]:
                    await event.wait()
                assert generations[0].request.state is RequestState.SUSPENDED
                generations[0].resume()
    assert [results[i] for i in range(len(prompts))] == expected
    assert_all_free(built, initial)


async def test_host_memory_bound_drops_least_recently_used() -> None:
    first = engine()
    async with first.engine:
        conversation = first.engine.conversation()
        await conversation.turn(TURNS[0], max_tokens=5).collect()
        await conversation.offload()
        one = conversation.host_nbytes
    # room for one conversation on the host, not two
    built = engine(host_memory=one + one // 2)
    with anyio.fail_after(60):
        async with built.engine:
            a = built.engine.conversation()
            b = built.engine.conversation()
            await a.turn(TURNS[0], max_tokens=5).collect()
            await b.turn(TURNS[0], max_tokens=5).collect()
            await a.offload()
            assert a.host_nbytes > 0
            await b.offload()  # past the bound: a (used least recently) is dropped
            assert a.cached_tokens == 0 and a.num_drops == 1
            assert b.host_nbytes > 0 and b.num_drops == 0
            await a.turn(TURNS[1], max_tokens=4).collect()
            assert a.turns[-1].recomputed_tokens > 0
            a.close()
            b.close()
            for m in built.cache.managers:
                assert m.statistics().requests_suspended == 0


async def test_cancelled_turn_keeps_what_it_generated() -> None:
    built = engine()
    initial = free_counts(built)
    with anyio.fail_after(60):
        async with built.engine:
            with built.engine.conversation() as conversation:
                turn = conversation.turn(TURNS[0], max_tokens=30)
                tokens = []
                async for token in turn:
                    tokens.append(token)
                    if len(tokens) == 3:
                        break  # leaving the stream cancels the turn
                await built.engine.wait_idle()
                assert not conversation.busy
                assert conversation.turns[-1].state is RequestState.CANCELLED
                assert conversation.history[: len(TURNS[0])] == TURNS[0]
                assert len(conversation.history) >= len(TURNS[0]) + 3
                history = list(conversation.history)
                more = await conversation.turn(TURNS[1], max_tokens=5).collect()
    alone = await fresh(engine(enable_reuse=False), history + list(TURNS[1]), 5)
    assert more == alone
    assert_all_free(built, initial)


async def test_misuse_is_refused_with_typed_errors() -> None:
    built = engine()
    async with built.engine:
        conversation = built.engine.conversation()
        with pytest.raises(ConfigError):
            built.engine.conversation(spec_k=3)  # beyond max_spec_k
        with pytest.raises(ConfigError):
            conversation.turn([], max_tokens=3)
        with pytest.raises(ConfigError):
            conversation.turn([10**6], max_tokens=3)
        turn = conversation.turn(TURNS[0], max_tokens=20)
        with pytest.raises(ConfigError, match="still running"):
            conversation.turn(TURNS[1], max_tokens=3)
        with pytest.raises(ConfigError, match="suspend it"):
            await conversation.offload()
        await turn.collect()
        conversation.close()
        with pytest.raises(EngineClosed):
            conversation.turn(TURNS[1], max_tokens=3)
        plain = built.engine.generate(TURNS[0], max_tokens=2)
        with pytest.raises(ConfigError, match="not submitted"):
            await plain.suspend()
        await plain.collect()
        with pytest.raises(RequestAborted):
            await plain.suspend()


@pytest.mark.parametrize("spec_k", [0, 2])
async def test_a_request_resumed_while_its_offload_copies_waits_for_the_copy(spec_k: int) -> None:
    kwargs: dict[str, object] = {"max_spec_k": 2} if spec_k else {}
    prompt = tuple(b"a request that moves")
    expected = await fresh(engine(enable_reuse=False, **kwargs), prompt, 14, spec_k)
    built = engine(**kwargs)
    initial = free_counts(built)
    tokens: list[int] = []
    with anyio.fail_after(60):
        async with built.engine:
            generation = built.engine.generate(prompt, max_tokens=14, spec_k=spec_k)
            three = anyio.Event()

            async def read() -> None:
                async for token in generation:
                    tokens.append(token)
                    if len(tokens) == 3:
                        three.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await three.wait()
                await generation.suspend()
                async with anyio.create_task_group() as moves:
                    moves.start_soon(generation.offload)
                    await anyio.lowlevel.checkpoint()
                    generation.resume()  # queued while the copy may still run: admitted once it landed
    assert tokens == expected
    assert built.cache.primary.statistics().offloads >= 1
    assert_all_free(built, initial)
