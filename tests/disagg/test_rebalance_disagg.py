"""A pool rebalance of either engine of disaggregated serving while it serves: the rebalanced side registers its
new memory and sends its peer the new page tables before it next transfers, so every later transfer lands in (or
is read from) the new pools. Tokens stay those of aggregated serving, a rebalance while a transfer touches the
pools is refused and changes nothing, a page-table update that changes more than a rebalance can is refused,
and after rebalancing back every page is free again, also after a loaded run with random rebalances of both
engines and conversations kept, offloaded or dropped between turns. Over the local transport, over NIXL between two agents of
this process (both sides rebalanced), and with the context engine in another process over NIXL and UCX."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import attrs
import pytest

from kvferry.disagg.protocol import TablesUpdate, encode_control
from kvferry.disagg.roles import ContextWorker, GenerationWorker
from kvferry.disagg.serve import disaggregated
from kvferry.engine.autobalance import AutoBalancer, BalancePolicy
from kvferry.engine.runner import BuiltEngine, build_engine
from kvferry.errors import RebalanceRefused
from kvferry.transports import available_transports
from tests.support.disagg_pair import counts, options, pair, until
from tests.support.disagg_reference import MAX_TOKENS, PROMPTS, SPEC_K, aggregated

pytestmark = pytest.mark.timeout(180)

#: the test engines' pool sizes (tests/support/disagg_pair.options) and the rebalanced ones
PAGES, SLOTS = 512, 2 * options().max_running + 1


async def expected() -> list[list[int]]:
    tokens, _ = await aggregated(PROMPTS)
    return tokens


async def serve_all(router: Any) -> list[list[int]]:
    """Every prompt through ``router`` at once; their tokens."""
    got: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        got[i] = await router.generate(PROMPTS[i], max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
    return got


async def rebalanced(rebalance: Callable[[], Awaitable[None]]) -> int:
    """Run ``rebalance`` until it is not refused (a transfer may touch the pools now); the refusals."""
    refused = 0
    with anyio.fail_after(60):
        while True:
            try:
                await rebalance()
            except RebalanceRefused:
                refused += 1
                await anyio.sleep(0.002)
                continue
            return refused


def sizes(built: BuiltEngine) -> tuple[int, int]:
    config = built.cache.primary.config
    return config.num_pages, config.num_slots


async def serve_while_rebalancing(
    router: Any, workers: list[GenerationWorker | ContextWorker]
) -> list[list[int]]:
    """Every prompt at once while each worker's engine grows its pools once, mid-run."""
    got: list[list[int]] = []

    async def requests() -> None:
        got.extend(await serve_all(router))

    async with anyio.create_task_group() as tg:
        tg.start_soon(requests)
        await anyio.sleep(0.05)  # prefills and transfers under way
        for worker in workers:
            await rebalanced(partial(worker.rebalance, num_pages=PAGES + 96, num_slots=SLOTS + 8))
    return got


@pytest.mark.anyio
async def test_both_engines_rebalanced_while_serving_give_aggregated_tokens_and_free_every_page() -> None:
    want = await expected()
    async with pair() as p:
        before = counts(p.gen), counts(p.ctx)
        first_tables = p.worker.info().page_tables
        got = await serve_while_rebalancing(p.router, [p.worker, p.context])
        assert got == want
        assert sizes(p.gen) == sizes(p.ctx) == (PAGES + 96, SLOTS + 8)
        assert p.worker.epoch == p.context.epoch == 1
        # each side maps to the other's new tables: its link was updated by the peer's TablesUpdate
        assert p.worker.links[0].remote.page_tables == p.context.info().page_tables
        assert p.context._served[0].remote.page_tables == p.worker.info().page_tables != first_tables
        assert await serve_all(p.router) == want  # the next transfers land in the new pools
        for worker in (p.worker, p.context):
            await rebalanced(partial(worker.rebalance, num_pages=PAGES, num_slots=SLOTS))
        assert await serve_all(p.router) == want
        for built in (p.gen, p.ctx):
            await built.engine.wait_idle()
            for m in built.cache.managers:
                m.reset_prefix_cache()
        await until(lambda: (counts(p.gen), counts(p.ctx)) == before, 10, lambda: (counts(p.gen), before))
        assert p.worker.epoch == p.context.epoch == 2
        assert p.worker.statistics()["failed"] == 0


@pytest.mark.anyio
async def test_a_rebalance_while_a_transfer_touches_the_pools_is_refused_and_changes_nothing() -> None:
    want = await expected()
    # every chunk of a push starts late: the transfer lasts while both sides are asked to rebalance
    async with pair(context={"write_delay": 0.3, "max_chunk_bytes": 4096}) as p:
        tables = p.worker.info().page_tables, p.context.info().page_tables
        routed = p.router.generate(PROMPTS[2], max_tokens=MAX_TOKENS, spec_k=SPEC_K)
        async with anyio.create_task_group() as tg:

            async def collect() -> None:
                with anyio.fail_after(60):
                    assert await routed.collect() == want[2]

            tg.start_soon(collect)
            # the push is under way: the generation side's request waits for its cache, the context side's cache
            # is pinned for the push
            await until(lambda: p.context.statistics()["sending"] > 0, 30, lambda: p.context.statistics())
            assert p.gen.engine.scheduler.num_transferring == 1
            with pytest.raises(RebalanceRefused, match="wait for their cache"):
                await p.worker.rebalance(num_pages=PAGES + 32)
            with pytest.raises(RebalanceRefused, match="may be in transfer"):
                await p.context.rebalance(num_pages=PAGES + 32)
            assert p.context.statistics()["sending"] == 1  # still pushing: nothing was disturbed
        assert (p.worker.info().page_tables, p.context.info().page_tables) == tables
        assert sizes(p.gen) == sizes(p.ctx) == (PAGES, SLOTS)
        assert p.worker.epoch == p.context.epoch == 0
        assert await serve_all(p.router) == want


@pytest.mark.anyio
async def test_a_tables_update_that_changes_more_than_a_rebalance_can_is_refused() -> None:
    want = await expected()
    async with pair() as p:
        served = p.context._served[0]
        info = p.context.info()
        link = p.worker.links[0]
        table = info.page_tables[0]
        for bad in (
            attrs.evolve(info, instance_id="someone-else"),
            attrs.evolve(info, transport_address="elsewhere:1"),
            attrs.evolve(info, page_tables=(attrs.evolve(table, wire_version=table.wire_version + 1),)),
            attrs.evolve(info, page_tables=(attrs.evolve(table, num_layers=table.num_layers + 1),)),
            attrs.evolve(info, page_tables=(attrs.evolve(table, layer_groups=table.layer_groups[:1]),)),
        ):
            await p.context.transport.send_message(served.peer, encode_control(TablesUpdate(7, bad)))
        # a stale epoch is ignored, a good one applied
        await p.context.transport.send_message(served.peer, encode_control(TablesUpdate(3, info)))
        await p.context.transport.send_message(served.peer, encode_control(TablesUpdate(2, info)))
        await until(lambda: link.epoch == 3, 5, lambda: link.epoch)
        assert link.remote == info
        assert await serve_all(p.router) == want


@pytest.mark.anyio
async def test_a_rebalance_of_the_engine_alone_is_published_before_the_next_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want = await expected()
    async with pair() as p:
        for worker in (p.worker, p.context):
            monkeypatch.setattr(type(worker), "_task_group", lambda self: None)  # no publish right after it
        old_gen, old_ctx = p.worker.info().page_tables, p.context.info().page_tables
        await p.gen.engine.rebalance(num_pages=PAGES + 64)
        await p.ctx.engine.rebalance(num_pages=PAGES + 32)
        assert p.worker.epoch == p.context.epoch == 0  # nothing published yet: the peers know the old tables
        assert p.worker.info().page_tables == old_gen and p.context.info().page_tables == old_ctx
        # the generation side publishes before its receive request, the context side before its push
        assert await serve_all(p.router) == want
        assert p.worker.epoch == p.context.epoch == 1
        assert p.context._served[0].remote.page_tables == p.worker.info().page_tables != old_gen
        assert p.worker.links[0].remote.page_tables == p.context.info().page_tables != old_ctx


def _real(transport: str) -> None:
    if transport not in available_transports():
        pytest.skip(f"{transport} is not installed")


@pytest.mark.anyio
async def test_both_sides_rebalanced_over_nixl_in_one_process() -> None:
    _real("nixl")
    want = await expected()
    async with disaggregated(transport="nixl", separate_process=False, spec_k=SPEC_K) as (router, parts):
        worker, context = parts["worker"], parts["context"]
        got = await serve_while_rebalancing(router, [worker, context])
        assert got == want
        assert await serve_all(router) == want
        assert worker.epoch == context.epoch == 1
        assert worker.statistics()["failed"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["nixl", "ucx"])
async def test_the_generation_engine_rebalanced_with_its_context_engine_in_another_process(
    transport: str,
) -> None:
    _real(transport)
    want = await expected()
    async with disaggregated(transport=transport, spec_k=SPEC_K) as (router, parts):
        worker = parts["worker"]
        got = await serve_while_rebalancing(router, [worker])
        assert got == want
        for pages in (PAGES + 160, PAGES):  # grown, then back: each later transfer lands in the pools in use
            await rebalanced(partial(worker.rebalance, num_pages=pages))
            assert await serve_all(router) == want
        # the engine rebalanced directly: the worker publishes the new tables (at once, or before its next
        # transfer at the latest)
        await rebalanced(lambda: parts["gen"].engine.rebalance(num_pages=PAGES + 64))
        assert await serve_all(router) == want
        assert worker.epoch == 4
        assert worker.statistics()["failed"] == 0


def load_plan(seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Plain prompts, and the turns of a few conversations."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(2, 40))] for _ in range(16)]
    chats = [[[rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(3)] for _ in range(3)]
    return prompts, chats


async def undisturbed(
    prompts: list[list[int]], chats: list[list[list[int]]]
) -> tuple[list[list[int]], list[list[list[int]]]]:
    built = build_engine("tiny", options(enable_reuse=False))
    async with built.engine:
        plain = [
            await built.engine.generate(p, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect() for p in prompts
        ]
        turns = []
        for chat in chats:
            with built.engine.conversation(spec_k=SPEC_K) as conversation:
                turns.append([await conversation.turn(t, max_tokens=MAX_TOKENS).collect() for t in chat])
    return plain, turns


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [3, 4])
async def test_a_loaded_run_with_random_rebalances_offloads_and_drops_keeps_every_token(seed: int) -> None:
    prompts, chats = load_plan(seed)
    expected_plain, expected_turns = await undisturbed(prompts, chats)
    rng = random.Random(seed)
    plain: dict[int, list[int]] = {}
    turns: dict[int, list[list[int]]] = {}
    small = options(num_pages=160, max_running=6)  # room for the load, not for much more
    async with pair(gen_options=small, ctx_options=small) as p:
        before = counts(p.gen), counts(p.ctx)
        base = sizes(p.gen)

        async def one(i: int) -> None:
            await anyio.sleep(rng.random() * 0.05)
            plain[i] = await p.router.generate(prompts[i], max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()

        async def chat(c: int) -> None:
            got = []
            with p.router.conversation(spec_k=SPEC_K) as conversation:
                for turn, prompt in enumerate(chats[c]):
                    if turn:  # the kept cache stays, moves to the host, or is dropped (recomputed)
                        between = rng.choice(["keep", "offload", "drop"])
                        if between == "offload":
                            await conversation.conversation.offload()
                        elif between == "drop":
                            conversation.conversation.drop()
                    got.append(await conversation.turn(prompt, max_tokens=MAX_TOKENS).collect())
            turns[c] = got

        async def disturb() -> None:
            for _ in range(6):
                await anyio.sleep(rng.random() * 0.03)
                worker = rng.choice([p.worker, p.context])
                pages, slots = base[0] + rng.choice([0, 32, 64]), base[1] + rng.choice([0, 4])
                await rebalanced(partial(worker.rebalance, num_pages=pages, num_slots=slots))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
                for c in range(len(chats)):
                    tg.start_soon(chat, c)
                tg.start_soon(disturb)
        for worker in (p.worker, p.context):
            await rebalanced(partial(worker.rebalance, num_pages=base[0], num_slots=base[1]))
        for built in (p.gen, p.ctx):
            await built.engine.wait_idle()
            for m in built.cache.managers:
                m.reset_prefix_cache()
        await until(lambda: (counts(p.gen), counts(p.ctx)) == before, 10, lambda: (counts(p.gen), before))
        epochs = p.worker.epoch + p.context.epoch
    assert [plain[i] for i in range(len(prompts))] == expected_plain
    assert [turns[c] for c in range(len(chats))] == expected_turns
    assert epochs >= 6 + 2  # six rebalances under load, and one back on each side


@pytest.mark.anyio
async def test_the_auto_balancer_resizes_a_generation_engine_while_it_serves() -> None:
    rng = random.Random(8)
    long = [[rng.randrange(256) for _ in range(40)] for _ in range(12)]
    short = [[rng.randrange(256) for _ in range(3)] for _ in range(24)]
    built = build_engine("tiny", options(enable_reuse=False))
    async with built.engine:
        expected = [await built.engine.generate(q, max_tokens=MAX_TOKENS).collect() for q in long + short]
    policy = BalancePolicy(min_interval=0.001, check_interval=0.005, min_requests=8, window=12)
    async with pair(gen_options=options(num_pages=64, num_slots=17, max_running=8)) as p:
        balancer = AutoBalancer(p.gen.engine, policy)
        got: list[list[int]] = []
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(balancer.run)
                for batch in (long, short):
                    results: dict[int, list[int]] = {}

                    async def one(
                        i: int, batch: list[list[int]] = batch, results: dict[int, list[int]] = results
                    ) -> None:
                        results[i] = await p.router.generate(batch[i], max_tokens=MAX_TOKENS).collect()

                    async with anyio.create_task_group() as work:
                        for i in range(len(batch)):
                            work.start_soon(one, i)
                    got += [results[i] for i in range(len(batch))]
                    await anyio.sleep(0.05)  # a few looks at what was observed
                tg.cancel_scope.cancel()
        assert got == expected
        assert balancer.applied  # the split followed the lengths
        assert p.worker.epoch >= 1  # and the context engine learnt each split's tables before its transfers
        assert p.context._served[0].remote.page_tables == p.worker.info().page_tables
        assert p.worker.statistics()["failed"] == 0
