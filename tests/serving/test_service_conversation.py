"""Conversations through the public serving API: every turn's tokens are those of an engine's conversation, the
turns run one at a time, and closing a conversation gives its cache back; aggregated and disaggregated alike."""

from __future__ import annotations

import pytest

from kvferry import ConfigError, FinishReason
from kvferry.engine.runner import build_engine
from tests.serving.test_service import MODES, OPTIONS, occupancy, service

pytestmark = pytest.mark.timeout(120)

TURNS = [list(range(60, 75)), [3, 4], list(range(200, 209))]


async def offline() -> list[list[int]]:
    built = build_engine("tiny", OPTIONS)
    async with built.engine:
        with built.engine.conversation(spec_k=2) as conversation:
            return [await conversation.turn(t, max_tokens=6).collect() for t in TURNS]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.anyio
async def test_turns_give_the_tokens_of_an_engine_conversation(mode: str) -> None:
    expected = await offline()
    async with service(mode) as s:
        before = occupancy(s)
        got = []
        with s.conversation(spec_k=2) as conversation:
            for i, turn in enumerate(TURNS):
                handle = await conversation.submit(turn, max_tokens=6)
                if i == 0:
                    with pytest.raises(ConfigError, match=r"not ended|still running"):
                        await conversation.submit([1], max_tokens=2)
                result = await handle.result()
                assert result.finish_reason is FinishReason.LENGTH
                got.append(list(result.token_ids))
            assert len(conversation.history) == sum(map(len, TURNS)) + 6 * len(TURNS)
            assert occupancy(s)[0] > 0  # its cache is kept between turns, state slot included
        assert occupancy(s) == before
    assert got == expected
