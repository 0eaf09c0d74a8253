"""Prefix reuse on the generation side of disaggregated serving: when the generation engine's prefix cache holds
the start of a prompt (an earlier turn it decoded, with the recurrent-state snapshots its decode took), the
transfer starts after it (the context side sends only the rest); tokens stay those of aggregated serving and the
bytes not sent are counted."""

from __future__ import annotations

import anyio
import pytest

from kvferry.engine.runner import build_engine
from tests.support.disagg_pair import counts, options, pair, until

pytestmark = pytest.mark.timeout(120)

FIRST = list(range(40, 40 + 21))
SECOND = [7, 8, 9, 10, 11]
MAX_TOKENS = 14
#: the generation engine snapshots the recurrent state every 8 tokens: its decode of the first turn leaves
#: snapshots a second turn can start from
SNAPSHOTS = {"snapshot_interval": 8}


async def aggregated(spec_k: int) -> list[list[int]]:
    built = build_engine("tiny", options(enable_reuse=False))
    async with built.engine:
        first = await built.engine.generate(FIRST, max_tokens=MAX_TOKENS, spec_k=spec_k).collect()
        second = await built.engine.generate(
            FIRST + first + SECOND, max_tokens=MAX_TOKENS, spec_k=spec_k
        ).collect()
    return [first, second]


@pytest.mark.anyio
@pytest.mark.parametrize("spec_k", [0, 2])
async def test_a_prefix_the_generation_engine_holds_is_not_sent_again(spec_k: int) -> None:
    expected = await aggregated(spec_k)
    async with pair(gen_options=options(**SNAPSHOTS)) as p:
        gen_before = counts(p.gen)
        got: list[list[int]] = []
        sent: list[int] = []
        for turn in range(2):
            prompt = FIRST if turn == 0 else FIRST + got[0] + SECOND
            routed = p.router.generate(prompt, max_tokens=MAX_TOKENS, spec_k=spec_k)
            with anyio.fail_after(60):
                got.append(await routed.collect())
            assert routed.transfer is not None
            sent.append(routed.transfer.nbytes)
        stats = p.worker.statistics()
        await p.gen.engine.wait_idle()
        for m in p.gen.cache.managers:
            m.reset_prefix_cache()
        await until(lambda: counts(p.gen) == gen_before, 5, lambda: (counts(p.gen), gen_before))
    assert got == expected
    # the second turn's prompt is 40 tokens; the snapshot at 32 covers all but the last 8
    assert stats["reused_tokens"] == 32 and stats["saved_bytes"] > 0
    assert sent[1] < sent[0]
