"""Bounced transfers: the bounded staging pool, bounce == direct bit for bit over the local transport for
several TP pairs (and across processes over nixl), fallbacks when staging is short, and cancel mid-bounce."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch

from kvferry.disagg.link import pump
from kvferry.disagg.mapping import BouncePolicy, PeerMap
from kvferry.disagg.protocol import ChunkResult, ChunkStatus, ReceiveRequest
from kvferry.disagg.session import Receiver, ReceiveSession, SendSession
from kvferry.disagg.staging import ReceiveStaging, StagingPool
from kvferry.disagg.transfer import (
    ManagerHold,
    WriterPlan,
    destinations,
    expected_writers,
    offer_staging,
    plan_transfer,
)
from kvferry.errors import ConfigError, WireFormatError
from kvferry.pools.pagetable import PageTable
from tests.support.disagg_harness import Side, connected, make_side, tiny_spec, whole_cache
from tests.support.disagg_session import PROMPT, ContextMessages, GatedTransport, cancel_when, send_when_asked

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).parents[2]


# --- the pool ---------------------------------------------------------------------------------------------


def test_pool_leases_are_bounded_aligned_and_merge_back() -> None:
    pool = StagingPool.allocate(4096)
    a, b, c = pool.try_reserve(1000), pool.try_reserve(2000), pool.try_reserve(1024)
    assert a is not None and b is not None and c is not None
    assert (a.offset, b.offset, c.offset) == (0, 1024, 3072)  # aligned starts, first fit
    assert pool.try_reserve(1) is None and pool.statistics()["refused"] == 1
    assert pool.used == 4024 and pool.available == 0
    b.release()
    b.release()  # idempotent
    assert pool.available == 2048 and pool.try_reserve(2049) is None
    d = pool.try_reserve(2048)
    assert d is not None and d.offset == 1024 and d.address == pool.buffer.data_ptr() + 1024
    for lease in (a, c, d):
        lease.release()
    s = pool.statistics()
    assert (s["used"], s["held"], s["free_ranges"], s["peak_bytes"]) == (0, 0, 1, 4072)
    assert pool.try_reserve(4096) is not None  # everything merged back into one range
    with pytest.raises(ConfigError):
        pool.try_reserve(0)
    with pytest.raises(ConfigError):
        pool.release(StagingPool.allocate(512).try_reserve(8))  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        StagingPool(torch.zeros(4, dtype=torch.int32))


@pytest.mark.anyio
async def test_pool_reserve_waits_for_a_release_or_gives_up() -> None:
    pool = StagingPool.allocate(1024)
    held = pool.try_reserve(1024)
    assert held is not None
    assert await pool.reserve(2048, wait=10) is None  # can never fit: no wait
    with anyio.fail_after(5):
        assert await pool.reserve(512, wait=0.05) is None  # nobody releases
    async with anyio.create_task_group() as tg:

        async def later() -> None:
            await anyio.sleep(0.05)
            held.release()

        tg.start_soon(later)
        with anyio.fail_after(5):
            got = await pool.reserve(512, wait=5)
    assert got is not None and got.nbytes == 512
    got.release()
    assert pool.used == 0


def test_receive_session_refuses_staged_reports_it_did_not_offer() -> None:
    session = ReceiveSession(1, "k", (0, 1), staging_writers=frozenset({1}))
    session.requested()
    with pytest.raises(WireFormatError):
        session.on_result(ChunkResult(1, 0, 0, 1, ChunkStatus.OK, 8, 1, staged=True))
    session.on_result(ChunkResult(1, 1, 0, 2, ChunkStatus.OK, 8, 1, staged=True))
    with pytest.raises(WireFormatError):  # a writer cannot mix staged and direct chunks
        session.on_result(ChunkResult(1, 1, 1, 2, ChunkStatus.OK, 8, 1, staged=False))
    assert [(r.writer, r.chunk) for r in session.staged_landed()] == [(1, 0)]
    session.on_result(ChunkResult(1, 1, 1, 2, ChunkStatus.OK, 8, 1, staged=True))
    assert [(r.writer, r.chunk) for r in session.staged_landed()] == [(1, 0), (1, 1)]


# --- whole transfers over the local transport ------------------------------------------------------------


def sender_plan(
    ctx: Side,
    peer_map: PeerMap,
    request: ReceiveRequest,
    tables: list[PageTable],
    tx_pool: StagingPool | None,
    *,
    policy: BouncePolicy,
    chunk: int | None = None,
) -> WriterPlan:
    """The context side's plan of request "c" for ``request`` (every context rank; its pools and staging)."""
    return plan_transfer(
        peer_map,
        range(ctx.tp),
        ctx.blocks("c"),
        ctx.slot("c"),
        request,
        tables,
        max_chunk_bytes=chunk,
        policy=policy,
        src_pools=[a.pool_tensors() for a in ctx.arenas],
        staging=tx_pool,
    )


async def transfer(
    ctx: Side,
    gen: Side,
    *,
    rx_capacity: int | None,
    tx_capacity: int | None,
    policy: BouncePolicy,
    chunk: int = 2048,
) -> tuple[Any, StagingPool | None, StagingPool | None]:
    """Receive ``PROMPT``'s cache from ``ctx`` into a new request "g" of ``gen`` (poisoned first); staging pools
    of the given capacities (None: no bouncing on that side). Returns (stats, rx pool, tx pool)."""
    async with connected(ctx, gen) as (to_gen, to_ctx):
        assert gen.transport is not None and ctx.transport is not None
        rx_pool = tx_pool = None
        if rx_capacity is not None:
            rx_pool = StagingPool.allocate(rx_capacity)
            await gen.transport.register(rx_pool.buffer)
        if tx_capacity is not None:
            tx_pool = StagingPool.allocate(tx_capacity)
            await ctx.transport.register(tx_pool.buffer)
        # the plan goes to the sender directly, not over the channel: a message after the registration makes
        # sure the sender has seen the receiver's staging regions (the channel is ordered)
        await gen.transport.send_message(to_ctx, b"registered")
        assert await ctx.transport.receive_message(to_gen) == b"registered"
        tables = [a.page_table() for a in gen.arenas]
        peer_map = PeerMap.build([a.page_table() for a in ctx.arenas], tables)
        receiver = Receiver(
            gen.transport,
            to_ctx,
            expected_writers(peer_map),
            stall_timeout=10,
            destinations=partial(destinations, peer_map),
        )
        gen.create("g", PROMPT)
        for arena, m in zip(gen.arenas, gen.managers, strict=True):
            arena.fill_garbage("attention", list(m.block_table("g")), seed=99)
            arena.fill_garbage("draft", list(m.draft_block_table("g")), seed=98)
            state = "kda" if arena.layout.has_group("kda") else "mamba2"
            arena.fill_garbage(state, [gen.slot("g")], seed=97)
        request = gen.receive_request(0, "r", "g", len(PROMPT))
        staging = None
        if rx_pool is not None:
            request, staging = offer_staging(
                peer_map, request, [a.pool_tensors() for a in gen.arenas], rx_pool, policy=policy
            )
        session = receiver.new_session("r", ManagerHold(gen.managers, "g"), staging)
        request = type(request)(
            session.session_id,
            *[getattr(request, f) for f in ("key", "token_start", "token_end", "blocks", "slot", "staging")],
        )
        plan = sender_plan(ctx, peer_map, request, tables, tx_pool, policy=policy, chunk=chunk)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump, gen.transport, to_ctx, receiver)
            tg.start_soon(send_when_asked, ctx.transport, to_gen, SendSession(session.session_id, plan))
            stats = await receiver.receive(session, request)
            tg.cancel_scope.cancel()
        assert receiver.statistics()["sessions"] == 0 and receiver.statistics()["staging_bytes"] == 0
        return stats, rx_pool, tx_pool


def bounced_writers(ctx: Side, gen: Side) -> int:
    peer_map = PeerMap.build([a.page_table() for a in ctx.arenas], [a.page_table() for a in gen.arenas])
    return sum(peer_map.writes(s, d) for s in range(ctx.tp) for d in peer_map.targets(s))


@pytest.mark.parametrize(
    ("ctx_tp", "gen_tp", "model"),
    [
        (1, 1, "tiny"),
        (2, 2, "tiny"),
        (1, 2, "tiny"),
        (2, 1, "tiny"),
        (4, 2, "tiny"),
        # KimiLinear: KDA state, and latent pages every receiver rank gets whole from one sender rank
        (1, 4, "tiny-kimi"),
        (4, 2, "tiny-kimi"),
    ],
)
@pytest.mark.anyio
async def test_bounce_and_direct_give_identical_receiver_bytes(ctx_tp: int, gen_tp: int, model: str) -> None:
    spec = tiny_spec(model=model)
    ctx, direct, bounced = make_side(spec, ctx_tp), make_side(spec, gen_tp), make_side(spec, gen_tp)
    ctx.fake_prefill("c", PROMPT, seed=11)
    before = bounced.free_counts()
    d_stats, _, _ = await transfer(ctx, direct, rx_capacity=None, tx_capacity=None, policy=BouncePolicy())
    b_stats, rx, tx = await transfer(
        ctx, bounced, rx_capacity=1 << 20, tx_capacity=1 << 20, policy=BouncePolicy.always()
    )
    assert d_stats.bounced == 0 and b_stats.bounced == bounced_writers(ctx, bounced) > 0
    assert b_stats.nbytes == d_stats.nbytes and b_stats.fragments == b_stats.chunks  # one per staged write
    for a, b in zip(direct.read("g", len(PROMPT)), bounced.read("g", len(PROMPT)), strict=True):
        assert a.keys() == b.keys()
        for group in a:
            assert torch.equal(a[group], b[group]), group
    src, dst = whole_cache(ctx, "c", len(PROMPT)), whole_cache(bounced, "g", len(PROMPT))
    for key in src:
        assert torch.equal(src[key], dst[key]), key
    assert rx is not None and tx is not None
    assert rx.used == 0 and tx.used == 0 and rx.statistics()["leases"] == b_stats.bounced
    ManagerHold(bounced.managers, "g").free()
    assert bounced.free_counts() == before


@pytest.mark.parametrize(
    ("ctx_tp", "gen_tp", "model"), [(1, 2, "tiny"), (2, 1, "tiny"), (1, 1, "tiny"), (2, 4, "tiny-kimi")]
)
@pytest.mark.parametrize("side", ["sender", "receiver"])
@pytest.mark.parametrize("chunk", [512, 1 << 20])
@pytest.mark.anyio
async def test_half_bounces_give_identical_bytes(
    ctx_tp: int, gen_tp: int, model: str, side: str, chunk: int
) -> None:
    """Only one side stages: the writers pack into the receiver's pages (sender), or write their own runs into
    the receiver's areas, unpacked chunk by chunk as they land (receiver); several chunks or one."""
    spec = tiny_spec(model=model)
    ctx, gen = make_side(spec, ctx_tp), make_side(spec, gen_tp)
    ctx.fake_prefill("c", PROMPT, seed=13)
    rx_cap, tx_cap = (None, 1 << 20) if side == "sender" else (1 << 20, None)
    stats, rx, tx = await transfer(
        ctx, gen, rx_capacity=rx_cap, tx_capacity=tx_cap, policy=BouncePolicy.always(), chunk=chunk
    )
    writers = bounced_writers(ctx, gen)
    assert stats.bounced == (0 if side == "sender" else writers)
    assert (tx if side == "sender" else rx).statistics()["leases"] == writers  # type: ignore[union-attr]
    if chunk == 512:
        assert stats.chunks > writers
    src, dst = whole_cache(ctx, "c", len(PROMPT)), whole_cache(gen, "g", len(PROMPT))
    for key in src:
        assert torch.equal(src[key], dst[key]), key
    for pool in (rx, tx):
        assert pool is None or pool.used == 0


@pytest.mark.parametrize("short", ["receiver", "sender"])
@pytest.mark.anyio
async def test_short_staging_falls_back_to_half_bounces(short: str) -> None:
    """No room on one side: that side is written (receiver) or read (sender) in place; the other still stages:
    the writers pack into the receiver's pages, or write their own runs into the receiver's areas."""
    spec = tiny_spec()
    ctx, gen = make_side(spec, 2), make_side(spec, 1)
    ctx.fake_prefill("c", PROMPT, seed=3)
    rx_cap, tx_cap = (256, 1 << 20) if short == "receiver" else (1 << 20, 256)
    stats, rx, tx = await transfer(
        ctx, gen, rx_capacity=rx_cap, tx_capacity=tx_cap, policy=BouncePolicy.always()
    )
    # ``bounced`` counts writers whose bytes came through the receiver's staging
    assert stats.bounced == (0 if short == "receiver" else 2)
    assert rx is not None and tx is not None
    assert (tx if short == "receiver" else rx).statistics()["leases"] == 2
    src, dst = whole_cache(ctx, "c", len(PROMPT)), whole_cache(gen, "g", len(PROMPT))
    for key in src:
        assert torch.equal(src[key], dst[key]), key
    assert rx.used == 0 and tx.used == 0
    assert (rx if short == "receiver" else tx).statistics()["refused"] > 0


@pytest.mark.anyio
async def test_cancel_during_a_bounce_keeps_staging_quarantined_until_the_writer_reports() -> None:
    spec = tiny_spec()
    ctx, gen = make_side(spec, 1), make_side(spec, 1)
    ctx.fake_prefill("c", PROMPT, seed=5)
    gen_before = gen.free_counts()
    async with connected(ctx, gen) as (to_gen, to_ctx):
        assert gen.transport is not None and ctx.transport is not None
        rx_pool, tx_pool = StagingPool.allocate(1 << 20), StagingPool.allocate(1 << 20)
        await gen.transport.register(rx_pool.buffer)
        await ctx.transport.register(tx_pool.buffer)
        gated = GatedTransport(ctx.transport)
        tables = [a.page_table() for a in gen.arenas]
        peer_map = PeerMap.build([a.page_table() for a in ctx.arenas], tables)
        receiver = Receiver(
            gen.transport,
            to_ctx,
            expected_writers(peer_map),
            stall_timeout=10,
            destinations=partial(destinations, peer_map),
        )
        gen.create("g", PROMPT)
        request = gen.receive_request(0, "r", "g", len(PROMPT))
        request, staging = offer_staging(
            peer_map, request, [a.pool_tensors() for a in gen.arenas], rx_pool, policy=BouncePolicy.always()
        )
        session = receiver.new_session("r", ManagerHold(gen.managers, "g"), staging)
        request = type(request)(
            session.session_id,
            *[getattr(request, f) for f in ("key", "token_start", "token_end", "blocks", "slot", "staging")],
        )
        plan = sender_plan(ctx, peer_map, request, tables, tx_pool, policy=BouncePolicy.always(), chunk=1024)
        assert len(plan[0]) > 3 and all(c.staged is not None for c in plan[0])
        send_session = SendSession(session.session_id, plan)
        area = rx_pool.used
        context = ContextMessages(send_session)  # the context side obeys CancelTransfer

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: pump(ctx.transport, to_gen, on_message=context))  # type: ignore[arg-type]
            tg.start_soon(pump, gen.transport, to_ctx, receiver)
            tg.start_soon(lambda: context.send(gated, to_gen, max_in_flight=1))
            with anyio.CancelScope() as scope:
                tg.start_soon(cancel_when, scope, lambda: gated.posted >= 1)
                await receiver.receive(session, request)
            assert scope.cancelled_caught
            # a posted write may still land in the staging area: it stays reserved, the pages quarantined
            assert rx_pool.used == area > 0 and tx_pool.used > 0
            assert receiver.statistics()["quarantined"] == 1
            assert rx_pool.try_reserve(rx_pool.capacity - area + 1) is None
            with anyio.fail_after(5):  # the context side got the CancelTransfer before the writes go on
                while not send_session.cancelled:  # noqa: ASYNC110
                    await anyio.sleep(0.002)
            gated.gate.set()
            with anyio.fail_after(10):
                while receiver.statistics()["quarantined"] or not send_session.finished:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert any(r.status is ChunkStatus.CANCELLED for r in send_session._reports.values())
            with anyio.fail_after(10):
                while tx_pool.used:  # noqa: ASYNC110 (send() releases when its last write ended)
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert rx_pool.used == 0 and tx_pool.used == 0
    assert rx_pool.statistics()["free_ranges"] == 1 and tx_pool.statistics()["free_ranges"] == 1
    for m in ctx.managers:
        m.close("c")
    assert gen.free_counts() == gen_before


# --- across processes ------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_bounce_across_processes_over_nixl_is_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("nixl")
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "disagg_2p.py"),
            "--preset",
            "tiny",
            "--tokens",
            "37",
            "--cases",
            "2-1,1-2",
            "--repeat",
            "1",
            "--chunk-mib",
            "1",
            "--transport",
            "nixl",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["src_tp"], r["dst_tp"]) for r in rows] == [(2, 1), (1, 2)]
    for r in rows:
        assert r["direct_identical"] and r["bounce_identical"] and r["contiguous_identical"]
        assert r["bounce_bounced_writers"] > 0 and r["direct_bounced_writers"] == 0
        assert r["bounce_posted_fragments"] < r["direct_posted_fragments"]
        # every mode also set against a copy of the same bytes in the receiver process
        assert r["copy_s"] > 0 and all(r[f"{m}_ratio_memcpy"] > 0 for m in ("contiguous", "direct", "bounce"))


def offered(
    ctx_tp: int, gen_tp: int, rx_pool: StagingPool
) -> tuple[Side, list[PageTable], PeerMap, ReceiveRequest, ReceiveStaging]:
    """A context side that prefilled "c", and the receive request of a generation side's "g" that offers every
    writer a staging area of ``rx_pool`` (with the receiver's page tables, the peer map and the offer)."""
    spec = tiny_spec()
    ctx, gen = make_side(spec, ctx_tp), make_side(spec, gen_tp)
    ctx.fake_prefill("c", PROMPT, seed=3)
    gen.create("g", PROMPT)
    tables = [a.page_table() for a in gen.arenas]
    peer_map = PeerMap.build([a.page_table() for a in ctx.arenas], tables)
    request, staging = offer_staging(
        peer_map,
        gen.receive_request(1, "r", "g", len(PROMPT)),
        [a.pool_tensors() for a in gen.arenas],
        rx_pool,
        policy=BouncePolicy.always(),
    )
    return ctx, tables, peer_map, request, staging


def test_a_plan_that_fails_midway_keeps_no_staging_reserved() -> None:
    rx_pool, tx_pool = StagingPool.allocate(1 << 20), StagingPool.allocate(1 << 20)
    ctx, tables, peer_map, request, staging = offered(2, 1, rx_pool)
    assert len(request.staging) == 2 and rx_pool.used > 0
    areas = list(request.staging)
    areas[-1] = attrs.evolve(areas[-1], nbytes=8)  # the last writer's area is too small: a peer's bad request
    with pytest.raises(WireFormatError):
        sender_plan(
            ctx,
            peer_map,
            attrs.evolve(request, staging=tuple(areas)),
            tables,
            tx_pool,
            policy=BouncePolicy.always(),
        )
    assert tx_pool.used == 0 and tx_pool.statistics()["leases"] == 1  # the first writer's lease came back
    staging.release()
    assert rx_pool.used == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bounced_chunks_by_default_are_small_on_host_memory_and_whole_on_a_device(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packing on the host overlaps writing, chunk by chunk; a device packs a whole writer at once, so a chunk
    would only add a launch, a thread hop and a device wait per side (a "meta" staging stands in for one)."""
    from kvferry.disagg import transfer as transfer_module

    assert transfer_module.default_chunk_bytes("cpu") == transfer_module.DEFAULT_CHUNK_BYTES
    assert transfer_module.default_chunk_bytes("cuda") == transfer_module.DEFAULT_DEVICE_CHUNK_BYTES
    monkeypatch.setattr(transfer_module, "DEFAULT_CHUNK_BYTES", 512)
    rx_pool = StagingPool.allocate(1 << 20)
    tx_pool = StagingPool(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    ctx, tables, peer_map, request, staging = offered(1, 1, rx_pool)
    plan = sender_plan(ctx, peer_map, request, tables, tx_pool, policy=BouncePolicy.always())
    (chunks,) = plan.values()
    nbytes = sum(c.nbytes for c in chunks)
    assert nbytes > 512 and all(c.staged is not None for c in chunks)
    assert len(chunks) == (-(-nbytes // 512) if device == "cpu" else 1)
    SendSession(0, plan).release_staging()
    staging.release()
    assert tx_pool.used == 0 and rx_pool.used == 0
