"""Conversations in disaggregated serving: the context engine prefills each turn's whole history, the generation
engine keeps the conversation's cache between turns, so each transfer writes only what it lacks; every turn's
tokens are those of aggregated serving, and closing the conversation gives every page back."""

from __future__ import annotations

import anyio
import pytest

from kvferry.engine.runner import build_engine
from kvferry.errors import ConfigError
from tests.support.disagg_pair import counts, options, pair, until

pytestmark = pytest.mark.timeout(120)

TURNS = [tuple(range(30, 49)), (7, 8, 9), tuple(range(100, 111)), (5,)]
MAX_TOKENS = [9, 6, 7, 8]


async def aggregated(spec_k: int) -> list[list[int]]:
    built = build_engine("tiny", options(enable_reuse=False))
    out = []
    async with built.engine:
        with built.engine.conversation(spec_k=spec_k) as conversation:
            for prompt, max_tokens in zip(TURNS, MAX_TOKENS, strict=True):
                out.append(await conversation.turn(prompt, max_tokens=max_tokens).collect())
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("spec_k", [0, 2])
async def test_turns_transfer_only_what_the_kept_cache_lacks(spec_k: int) -> None:
    expected = await aggregated(spec_k)
    async with pair() as p:
        gen_before = counts(p.gen)
        got: list[list[int]] = []
        sent: list[int] = []
        starts: list[int] = []
        with p.router.conversation(spec_k=spec_k) as conversation:
            for prompt, max_tokens in zip(TURNS, MAX_TOKENS, strict=True):
                before = p.worker.statistics()["reused_tokens"]
                routed = conversation.turn(prompt, max_tokens=max_tokens)
                tokens = []
                with anyio.fail_after(60):
                    async for token in routed:
                        tokens.append(token)
                        with pytest.raises(ConfigError, match="not ended"):
                            conversation.turn((1,), max_tokens=2)
                got.append(tokens)
                assert routed.transfer is not None
                sent.append(routed.transfer.nbytes)
                starts.append(p.worker.statistics()["reused_tokens"] - before)
            history = len(conversation.conversation.history)
        await p.gen.engine.wait_idle()
        for m in p.gen.cache.managers:
            m.reset_prefix_cache()
        await until(lambda: counts(p.gen) == gen_before, 5, lambda: (counts(p.gen), gen_before))
    assert got == expected
    assert history == sum(map(len, TURNS)) + sum(MAX_TOKENS)
    assert starts[0] == 0
    done = 0
    for turn in range(1, len(TURNS)):
        done += len(TURNS[turn - 1]) + MAX_TOKENS[turn - 1]
        # everything but the last answer token is kept: the transfer starts at that token's block
        assert starts[turn] == (done - 1) // 4 * 4
        assert sent[turn] < sent[0]


@pytest.mark.anyio
@pytest.mark.parametrize("spec_k", [0, 2])
async def test_a_conversation_keeps_its_turns_across_rebalances_of_both_engines(spec_k: int) -> None:
    expected = await aggregated(spec_k)
    async with pair() as p:
        got: list[list[int]] = []
        with p.router.conversation(spec_k=spec_k) as conversation:
            for turn, (prompt, max_tokens) in enumerate(zip(TURNS, MAX_TOKENS, strict=True)):
                if turn:
                    # the kept cache moves to the host and back into the new pools; the peer learns the tables
                    grown = turn % 2
                    for worker in (p.worker, p.context):
                        await worker.rebalance(num_pages=512 + grown * 128, num_slots=33 + grown * 8)
                before = p.worker.statistics()["reused_tokens"]
                with anyio.fail_after(60):
                    got.append(await conversation.turn(prompt, max_tokens=max_tokens).collect())
                if turn:  # the kept turns were not sent again
                    assert p.worker.statistics()["reused_tokens"] > before
    assert got == expected
    assert p.worker.epoch == p.context.epoch == len(TURNS) - 1
