"""The lifecycle on a GPU: a conversation kept, offloaded, restored and dropped between turns, requests suspended
and offloaded mid-decode, and rebalances while serving give the tokens of undisturbed runs on the same device;
skipped without CUDA."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvferry.engine.runner import BuiltEngine, EngineOptions, build_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.anyio,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TURNS = [list(range(40, 70)), [5, 6, 7], list(range(100, 121)), [9]]
PROMPTS = [list(range(10, 10 + n)) for n in (3, 17, 33, 9, 25, 40)]


def engine(**kwargs: object) -> BuiltEngine:
    base: dict[str, object] = {"device": "cuda", "dtype": "float32", "max_spec_k": 2, "num_pages": 256}
    return build_engine("tiny", EngineOptions(**{**base, **kwargs}))  # type: ignore[arg-type]


async def test_conversation_turns_on_cuda_equal_fresh_runs_in_every_mode() -> None:
    expected: list[list[int]] = []
    history: list[int] = []
    fresh = engine(enable_reuse=False)
    async with fresh.engine:
        for turn in TURNS:
            history += turn
            tokens = await fresh.engine.generate(history, max_tokens=8, spec_k=2).collect()
            history += tokens
            expected.append(tokens)
    for mode in ("keep", "offload", "restore", "drop", "rebalance"):
        built = engine()
        got = []
        async with built.engine:
            with built.engine.conversation(spec_k=2) as conversation:
                for i, turn in enumerate(TURNS):
                    if i and mode in ("offload", "restore"):
                        await conversation.offload()
                        assert conversation.host_nbytes > 0
                    if i and mode == "restore":
                        assert await conversation.restore()
                    if i and mode == "drop":
                        conversation.drop()
                    if i and mode == "rebalance":
                        await built.engine.rebalance(num_pages=256 + 64 * (i % 2), num_slots=33 + 8 * (i % 2))
                    got.append(await conversation.turn(turn, max_tokens=8).collect())
        assert got == expected, mode


async def test_requests_suspended_offloaded_and_rebalanced_mid_decode_on_cuda() -> None:
    reference = engine(enable_reuse=False)
    async with reference.engine:
        expected = [await reference.engine.generate(p, max_tokens=12, spec_k=2).collect() for p in PROMPTS]
    built = engine(num_pages=64)
    results: dict[int, list[int]] = {}
    async with built.engine:
        generations = [built.engine.generate(p, max_tokens=12, spec_k=2) for p in PROMPTS]
        started = anyio.Event()

        async def read(i: int) -> None:
            results[i] = []
            async for token in generations[i]:
                results[i].append(token)
                if i == 2 and len(results[i]) == 2:
                    started.set()

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(read, i)
            await started.wait()
            await generations[2].suspend()
            await generations[2].offload()
            await built.engine.rebalance(num_pages=160)
            generations[2].resume()
            await built.engine.rebalance(num_pages=96, num_slots=40)
    assert [results[i] for i in range(len(PROMPTS))] == expected
    for m in built.cache.managers:
        assert m.statistics().pages_used == 0
