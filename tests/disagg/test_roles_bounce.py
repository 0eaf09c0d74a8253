"""The bounce path through the engine roles: with a policy that bounces every writer, disaggregated serving gives
the tokens and draft proposals of aggregated serving, every writer with bytes bounced, and the staging pools
are empty again afterwards; with a staging pool too small for any writer it falls back to direct writes and
stays identical."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from kvferry.disagg.mapping import BouncePolicy, PeerMap
from kvferry.disagg.roles import ContextWorker, GenerationWorker
from kvferry.disagg.serve import disaggregated
from kvferry.disagg.staging import StagingPool
from tests.support.disagg_reference import PROMPTS, SPEC_K, Result, aggregated, run_disaggregated

pytestmark = pytest.mark.timeout(120)

_expected: list[Result] = []


async def expected() -> Result:
    """The aggregated reference (the same for every case here: computed once)."""
    if not _expected:
        _expected.append(await aggregated(PROMPTS))
    return _expected[0]


def writing_pairs(peer_map: PeerMap) -> int:
    """Writers with bytes to send (elected-out writers report an empty write and never bounce)."""
    return sum(peer_map.writes(s, d) for d in range(peer_map.dst_tp) for s in peer_map.expected_writers(d))


async def settled(parts: dict[str, Any]) -> None:
    """Every cache is back in its pools and every staging lease returned."""
    worker: GenerationWorker = parts["worker"]
    context = parts["context"]
    with anyio.fail_after(5):
        while isinstance(context, ContextWorker) and (  # noqa: ASYNC110
            context.statistics()["held"] or context.statistics()["sending"]
        ):
            await anyio.sleep(0.01)
    assert worker.staging is not None and worker.staging.used == 0, worker.staging
    assert worker.statistics()["staging_bytes"] == 0  # nothing quarantined with the pages either
    if isinstance(context, ContextWorker):
        assert context.staging is not None and context.staging.used == 0, context.staging
    for m in parts["gen"].cache.managers:
        s = m.statistics()
        assert (s.requests_active + s.requests_suspended, s.quarantines) == (0, 0)


CASES = [
    pytest.param(1, 2, "local", False, id="1-2-local"),
    pytest.param(4, 2, "local", False, id="4-2-local"),
    pytest.param(2, 1, "nixl", True, id="2-1-nixl-two-processes"),
]


@pytest.mark.parametrize(("ctx_tp", "gen_tp", "transport", "separate"), CASES)
@pytest.mark.anyio
async def test_forced_bounce_equals_aggregated(
    ctx_tp: int, gen_tp: int, transport: str, separate: bool
) -> None:
    reference = await expected()
    async with disaggregated(
        transport=transport,
        ctx_tp=ctx_tp,
        gen_tp=gen_tp,
        spec_k=SPEC_K,
        separate_process=separate,
        bounce=BouncePolicy.always(),
    ) as (router, parts):
        got, transfers = await run_disaggregated(router, parts)
        assert got == reference
        worker: GenerationWorker = parts["worker"]
        assert worker.peer_map is not None
        bouncing = writing_pairs(worker.peer_map)
        assert bouncing >= 1
        # every writer with bytes bounced, in every transfer (and the posted writes are the few staged ones)
        assert [t.bounced for t in transfers] == [bouncing] * len(PROMPTS)
        assert all(t.fragments == t.chunks for t in transfers)
        assert worker.statistics()["bounced"] == bouncing * len(PROMPTS)
        assert worker.staging is not None and worker.staging.statistics()["leases"] == bouncing * len(PROMPTS)
        if not separate:
            assert parts["context"].statistics()["bounced"] == bouncing * len(PROMPTS)
        await settled(parts)
        assert len(worker.registrations) == 2  # arenas + staging, registered once


@pytest.mark.parametrize("short", ["both", "context"])
@pytest.mark.anyio
async def test_a_staging_pool_too_small_falls_back_to_direct_or_half_bounced_writes(short: str) -> None:
    reference = await expected()
    async with disaggregated(
        transport="local",
        ctx_tp=1,
        gen_tp=2,
        spec_k=SPEC_K,
        separate_process=False,
        bounce=BouncePolicy.always(),
        staging_bytes=16 << 10 if short == "both" else 64 << 20,
    ) as (router, parts):
        worker: GenerationWorker = parts["worker"]
        context: ContextWorker = parts["context"]
        if short == "context":
            # the receiver offers areas; the writers find no room in their own pool and write directly
            # (a stand-in pool: nothing is ever reserved in it, so it needs no registration)
            context.staging = StagingPool.allocate(16 << 10)
        got, transfers = await run_disaggregated(router, parts)
        assert got == reference
        # offered areas without room to pack: the writers write their own runs into the areas (half-bounce)
        assert [t.bounced for t in transfers] == [0 if short == "both" else 2] * len(PROMPTS)
        assert context.statistics()["bounced"] == 0
        assert context.staging is not None and worker.staging is not None
        offered, own = worker.staging.statistics(), context.staging.statistics()
        if short == "both":  # no area offered, no room to pack in their own pool either
            assert (offered["refused"] > 0, offered["leases"], own["refused"] > 0, own["leases"]) == (
                True,
                0,
                True,
                0,
            )
        else:  # offered, refused by the writers' pool, released with the pages
            assert (offered["leases"] > 0, own["refused"] > 0, own["leases"]) == (True, True, 0)
        await settled(parts)


@pytest.mark.anyio
async def test_each_worker_registers_its_memory_once_for_its_life(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests (bounced or not) never register or deregister memory: NIXL refuses the metadata of regions
    re-registered at addresses a deregistered region used on the same live connection."""
    from kvferry.transports.local import LocalTransport

    calls: list[tuple[str, int]] = []
    register, deregister = LocalTransport.register, LocalTransport.deregister

    async def counting_register(self: LocalTransport, regions: Any) -> Any:
        calls.append(("register", id(self)))
        return await register(self, regions)

    async def counting_deregister(self: LocalTransport, registration: Any) -> None:
        calls.append(("deregister", id(self)))
        await deregister(self, registration)

    monkeypatch.setattr(LocalTransport, "register", counting_register)
    monkeypatch.setattr(LocalTransport, "deregister", counting_deregister)
    async with disaggregated(
        transport="local", spec_k=SPEC_K, separate_process=False, bounce=BouncePolicy.always()
    ) as (router, parts):
        after_start = list(calls)
        reference = await expected()
        for round_ in range(2):
            got, _transfers = await run_disaggregated(router, parts)
            # the second round reuses the context side's prefix cache, whose draft KV the manager zeroes (so
            # do aggregated engines: their drafts differ on a reused prompt too); tokens stay exact
            assert got == reference if round_ == 0 else got[0] == reference[0]
        await parts["context"].register()  # idempotent
        await parts["worker"].register()
        assert calls == after_start
    # two workers, each: one registration of its arenas and one of its staging, nothing deregistered
    assert sorted(kind for kind, _ in after_start) == ["register"] * 4
    assert len({owner for _, owner in after_start}) == 2
