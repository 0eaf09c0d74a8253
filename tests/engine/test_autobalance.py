"""Auto-balance picks the page/slot split of a fixed budget from the lengths served, with hysteresis, and its
rebalances keep every token."""

from __future__ import annotations

import random

import anyio
import pytest

from kvferry.engine.autobalance import AutoBalancer, BalancePolicy, target_split
from kvferry.engine.runner import BuiltEngine, build_engine
from kvferry.errors import ConfigError
from tests.engine.test_engine import options

pytestmark = pytest.mark.anyio


def engine(**kwargs: object) -> BuiltEngine:
    return build_engine("tiny", options(**kwargs))


def layout_of(built: BuiltEngine):  # type: ignore[no-untyped-def]
    return built.arenas[0].layout


def test_long_requests_get_pages_short_ones_get_slots_within_the_budget() -> None:
    layout = layout_of(engine(max_spec_k=2))
    tpb, draft_tpb = (layout.layer_group(g).tokens_per_block for g in ("attention", "draft"))
    page_cost = layout.page_bytes("attention") + tpb / draft_tpb * layout.page_bytes("draft")
    memory = int(200 * page_cost + 40 * layout.bytes_per_slot)
    long = target_split([120] * 10, layout, max_running=8, memory_bytes=memory, headroom=1.25)
    short = target_split([6] * 10, layout, max_running=8, memory_bytes=memory, headroom=1.25)
    assert long.num_pages > short.num_pages and long.num_slots < short.num_slots
    for split in (long, short):
        assert split.num_slots >= 8 + 1
        # the draft pages cover the tokens the pages cover
        assert split.num_draft_pages is not None
        assert split.num_draft_pages * draft_tpb >= (split.num_pages - 1) * tpb
        used = split.num_pages * page_cost + split.num_slots * layout.bytes_per_slot
        assert used <= memory
    with pytest.raises(ConfigError, match="no request lengths"):
        target_split([], layout, max_running=8, memory_bytes=memory, headroom=1.25)
    with pytest.raises(ConfigError, match="cannot hold"):
        target_split([10], layout, max_running=8, memory_bytes=int(page_cost * 4), headroom=1.25)
    with pytest.raises(ConfigError):
        BalancePolicy(hysteresis=1.5)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


async def reference(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    built = engine(enable_reuse=False, num_pages=512)
    async with built.engine:
        return [await built.engine.generate(p, max_tokens=max_tokens).collect() for p in batch]


async def test_the_split_follows_the_lengths_with_hysteresis_and_keeps_tokens() -> None:
    long, short = prompts(16, 36, 1), prompts(40, 3, 2)
    expected = await reference(long, 10) + await reference(short, 2)
    built = engine(num_pages=64, num_slots=17)
    policy = BalancePolicy(min_interval=0.001, check_interval=0.005, min_requests=8, window=16)
    balancer = AutoBalancer(built.engine, policy)
    got: list[list[int]] = []
    with anyio.fail_after(120):
        async with built.engine, anyio.create_task_group() as tg:
            tg.start_soon(balancer.run)
            for batch, max_tokens in ((long, 10), (short, 2)):
                results: dict[int, list[int]] = {}

                async def one(
                    i: int,
                    batch: list[list[int]] = batch,
                    max_tokens: int = max_tokens,
                    results: dict[int, list[int]] = results,
                ) -> None:
                    results[i] = await built.engine.generate(batch[i], max_tokens=max_tokens).collect()

                async with anyio.create_task_group() as work:
                    for i in range(len(batch)):
                        work.start_soon(one, i)
                got += [results[i] for i in range(len(batch))]
                await anyio.sleep(0.05)  # a few looks at what was observed
                if batch is long:
                    grown = built.cache.primary.config.num_pages
                    assert grown > 64  # long requests: more pages
            tg.cancel_scope.cancel()
    assert got == expected
    final = built.cache.primary.config
    assert final.num_pages < grown and final.num_slots > 17  # short requests: pages went to slots
    assert len(balancer.applied) >= 2
    # within the hysteresis nothing more happens: the same lengths decide nothing
    assert balancer.decide() is None
