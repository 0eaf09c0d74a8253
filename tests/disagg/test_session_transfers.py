"""Whole transfers between two sides of one process over the local transport: the receiver and send() over
real writes (bit-exact pages, poisoned receivers, cancellation at every step, stalls, peer loss, reports that
overtake the receive request)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch

from kvferry.disagg.link import pump
from kvferry.disagg.protocol import (
    BlockIds,
    ChunkResult,
    ChunkStatus,
    ReceiveRequest,
)
from kvferry.disagg.session import (
    Chunk,
    Receiver,
    ReceiveState,
    SendSession,
    send,
)
from kvferry.disagg.transfer import (
    ManagerHold,
)
from kvferry.errors import (
    PeerDisconnected,
    TransferCancelled,
    TransferError,
    TransferInDoubt,
)
from kvferry.transports import Peer
from tests.support.disagg_harness import connected, make_side, tiny_spec, whole_cache
from tests.support.disagg_session import (
    PROMPT,
    ContextMessages,
    CountingHold,
    GatedTransport,
    ReportsFirst,
    attention_rows,
    cancel_when,
    ok,
    plan_for,
    receiver_for,
    run_pair,
    send_when_asked,
    writers,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("chunk_bytes", [4096, None])
@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 1), (2, 2), (1, 2), (4, 2)])
@pytest.mark.anyio
async def test_transfer_is_bit_exact_and_ignores_poison(
    ctx_tp: int, gen_tp: int, chunk_bytes: int | None
) -> None:
    """Many chunks per writer, or one (the default for direct writers); one-chunk writers' chunks move as one
    write (``write_many``, combined by the local transport) when there are several writers."""
    spec = tiny_spec()
    ctx, gen = make_side(spec, ctx_tp), make_side(spec, gen_tp)
    ctx.fake_prefill("c", PROMPT, seed=11)
    before = gen.free_counts()
    async with connected(ctx, gen) as (to_gen, to_ctx):
        assert gen.transport is not None and ctx.transport is not None
        receiver = receiver_for(ctx, gen, to_ctx)
        gen.create("g", PROMPT)
        for m_arena, m in zip(gen.arenas, gen.managers, strict=True):  # poison the receiving pages
            m_arena.fill_garbage("attention", list(m.block_table("g")), seed=99)
            m_arena.fill_garbage("draft", list(m.draft_block_table("g")), seed=98)
            slot = m.slot_id("g")
            assert slot is not None
            m_arena.fill_garbage("mamba2", [slot], seed=97)
        session = receiver.new_session("r", ManagerHold(gen.managers, "g"))
        request, plan = plan_for(ctx, gen, session.session_id, max_chunk_bytes=chunk_bytes)
        if chunk_bytes is None:
            assert all(len(v) <= 1 for v in plan.values())
        else:
            assert sum(len(v) for v in plan.values()) > 2 * gen_tp
        combined_before = ctx.transport.statistics().writes_combined
        sent_before = ctx.transport.statistics().messages_sent
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump, gen.transport, to_ctx, receiver)
            stats_box = []

            async def run_send() -> None:
                await send_when_asked(ctx.transport, to_gen, SendSession(session.session_id, plan))

            tg.start_soon(run_send)
            stats_box.append(await receiver.receive(session, request))
            tg.cancel_scope.cancel()
        stats = stats_box[0]
    src, dst = whole_cache(ctx, "c", len(PROMPT)), whole_cache(gen, "g", len(PROMPT))
    assert src.keys() == dst.keys()
    for key in src:
        assert not (src[key] == -12345).all(-1).any(), key  # every element assembled from some rank
        assert torch.equal(src[key], dst[key]), key
    assert stats.nbytes > 0 and stats.writers == len(writers(ctx, gen))
    # direct writers of one chunk (the default) post it together; chunked writers post chunk by chunk
    with_bytes = sum(1 for v in plan.values() if v)
    together = with_bytes if chunk_bytes is None and with_bytes > 1 else 0
    assert ctx.transport.statistics().writes_combined - combined_before == together
    # the writers that moved together report in one message (ChunkResults); the rest one report each (a
    # notification after each write, or a message for an empty writer)
    messages = ctx.transport.statistics().messages_sent - sent_before
    empty = sum(1 for v in plan.values() if not v)
    assert messages == (1 + empty if together else empty)
    assert receiver.statistics()["sessions"] == 0
    ManagerHold(gen.managers, "g").free()
    assert gen.free_counts() == before


@pytest.mark.anyio
async def test_a_refused_first_chunk_fails_its_writer_only() -> None:
    """One writer's chunk points outside what the receiver registered: it is refused (nothing written) and reported
    FAILED; the other writer's chunk, posted in the same ``write_many``, lands and is reported OK."""
    spec = tiny_spec()
    ctx, gen = make_side(spec, 2), make_side(spec, 2)
    ctx.fake_prefill("c", PROMPT, seed=4)
    async with connected(ctx, gen) as (to_gen, to_ctx):
        assert gen.transport is not None and ctx.transport is not None
        receiver = receiver_for(ctx, gen, to_ctx)
        gen.create("g", PROMPT)
        session = receiver.new_session("r", ManagerHold(gen.managers, "g"))
        request, plan = plan_for(ctx, gen, session.session_id, max_chunk_bytes=None)
        good_writer, bad_writer = sorted(plan)
        bad = plan[bad_writer][0]
        src, dst = bad.fragments()
        outside = dst.copy()
        outside[:, 0] += np.uint64(1 << 44)
        plan = {**plan, bad_writer: [Chunk(bad.dst_rank, src, outside)]}
        sending = SendSession(session.session_id, plan)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump, gen.transport, to_ctx, receiver)
            tg.start_soon(send_when_asked, ctx.transport, to_gen, sending)
            with pytest.raises(TransferError, match=rf"writer {bad_writer} .*RegionError"):
                await receiver.receive(session, request)
            tg.cancel_scope.cancel()
    good, failed = sending.report(good_writer, 0), sending.report(bad_writer, 0)
    assert good is not None and good.status is ChunkStatus.OK
    assert failed is not None and failed.status is ChunkStatus.FAILED
    assert ctx.transport.statistics().writes_failed == 0  # refused before anything was written


@pytest.mark.anyio
async def test_cancel_before_the_receive_request_frees_everything() -> None:
    spec = tiny_spec()
    ctx, gen = make_side(spec, 1), make_side(spec, 1)
    before = gen.free_counts()

    async def body(receiver: Receiver, *_: Any) -> None:
        gen.create("g", PROMPT)
        session = receiver.new_session("r", ManagerHold(gen.managers, "g"))
        request = gen.receive_request(session.session_id, "r", "g", len(PROMPT))
        with anyio.CancelScope() as scope:
            scope.cancel()
            await receiver.receive(session, request)
        assert session.state is ReceiveState.CANCELLED
        assert gen.free_counts() == before

    await run_pair(ctx, gen, body)
    assert gen.free_counts() == before


@pytest.mark.parametrize("where", ["during_writes", "after_writes_before_result"])
@pytest.mark.anyio
async def test_cancel_quarantines_until_every_writer_reports_and_no_late_write_lands(where: str) -> None:
    spec = tiny_spec()
    ctx, gen = make_side(spec, 1), make_side(spec, 1)
    ctx_before, gen_before = ctx.free_counts(), gen.free_counts()
    ctx.fake_prefill("c", PROMPT, seed=5)

    async with connected(ctx, gen) as (to_gen, to_ctx):
        assert gen.transport is not None and ctx.transport is not None
        gated = GatedTransport(ctx.transport)
        receiver = receiver_for(ctx, gen, to_ctx)
        gen.create("g", PROMPT)
        quarantined = list(gen.managers[0].block_table("g"))
        session = receiver.new_session("r", ManagerHold(gen.managers, "g"))
        request, plan = plan_for(ctx, gen, session.session_id, max_chunk_bytes=2048)
        assert len(plan[0]) > 3
        send_session = SendSession(session.session_id, plan)
        context = ContextMessages(send_session)  # the context side obeys CancelTransfer

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: pump(ctx.transport, to_gen, on_message=context))  # type: ignore[arg-type]
            if where == "during_writes":
                tg.start_soon(pump, gen.transport, to_ctx, receiver)
                tg.start_soon(context.send, gated, to_gen)
                with anyio.CancelScope() as scope:
                    tg.start_soon(cancel_when, scope, lambda: gated.posted >= 1)
                    await receiver.receive(session, request)
            else:
                # every write lands (notifications queue up unread), then the receiver is cancelled
                gated.gate.set()
                with anyio.CancelScope() as scope:
                    tg.start_soon(cancel_when, scope, lambda: send_session.finished)
                    tg.start_soon(context.send, gated, to_gen)
                    await receiver.receive(session, request)
            assert scope.cancelled_caught
            # the caller is gone; its pages are out of the pools, not free
            assert receiver.statistics()["quarantined"] == 1
            stats = gen.managers[0].statistics()
            assert stats.quarantines == 1 and stats.pages_quarantined == len(quarantined)
            # take everything that is free: none of it is a quarantined page; poison it
            gen.managers[0].create("other", list(range(1, 4 * stats.pages_free + 1)), reuse=False)
            gen.managers[0].resume("other")
            taken = list(gen.managers[0].block_table("other"))
            assert not set(taken) & set(quarantined)
            gen.arenas[0].fill_garbage("attention", taken, seed=3)
            poisoned = attention_rows(gen, taken)
            if where == "after_writes_before_result":
                tg.start_soon(pump, gen.transport, to_ctx, receiver)  # now the reports arrive
            else:
                with anyio.fail_after(5):  # the context side got the CancelTransfer before the writes go on
                    while not send_session.cancelled:  # noqa: ASYNC110
                        await anyio.sleep(0.002)
            gated.gate.set()
            with anyio.fail_after(10):
                while receiver.statistics()["quarantined"] or not send_session.finished:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert torch.equal(attention_rows(gen, taken), poisoned)  # no late write reached them
            if where == "during_writes":
                assert any(r.status is ChunkStatus.CANCELLED for r in send_session._reports.values())
            gen.managers[0].close("other")
            tg.cancel_scope.cancel()
    for m in ctx.managers:
        m.close("c")
    assert gen.free_counts() == gen_before
    assert ctx.free_counts() == ctx_before


@pytest.mark.anyio
async def test_stall_gives_in_doubt_and_keeps_pages_quarantined() -> None:
    spec = tiny_spec()
    ctx, gen = make_side(spec, 1), make_side(spec, 1)
    before = gen.free_counts()

    async def body(receiver: Receiver, *_: Any) -> None:
        gen.create("g", PROMPT)
        session = receiver.new_session("r", ManagerHold(gen.managers, "g"))
        request = gen.receive_request(session.session_id, "r", "g", len(PROMPT))
        with pytest.raises(TransferInDoubt):
            await receiver.receive(session, request)  # nobody sends
        assert gen.managers[0].statistics().quarantines == 1
        # a late report from the (slow) writer releases the pages
        receiver.on_result(ChunkResult(session.session_id, 0, 0, 1, ChunkStatus.OK))
        assert gen.free_counts() == before

    await run_pair(ctx, gen, body, stall=0.2)


@pytest.mark.anyio
async def test_peer_lost_fails_the_transfer_and_frees() -> None:
    spec = tiny_spec()
    ctx, gen = make_side(spec, 1), make_side(spec, 1)
    before = gen.free_counts()

    async def body(receiver: Receiver, transport: Any, to_gen: Peer, tg: Any) -> None:
        gen.create("g", PROMPT)
        session = receiver.new_session("r", ManagerHold(gen.managers, "g"))
        request = gen.receive_request(session.session_id, "r", "g", len(PROMPT))

        async def vanish() -> None:
            await anyio.sleep(0.05)
            await to_gen.aclose()  # the context side drops the connection

        tg.start_soon(vanish)
        with pytest.raises(TransferError) as info:
            await receiver.receive(session, request)
        assert not isinstance(info.value, (TransferCancelled, TransferInDoubt))
        assert receiver.lost

    await run_pair(ctx, gen, body)
    assert gen.free_counts() == before


@pytest.mark.anyio
async def test_send_reports_peer_loss() -> None:
    spec = tiny_spec()
    ctx, gen = make_side(spec, 1), make_side(spec, 1)
    ctx.fake_prefill("c", PROMPT, seed=1)

    async def body(receiver: Receiver, transport: Any, to_gen: Peer, tg: Any) -> None:
        gen.create("g", PROMPT)
        _request, plan = plan_for(ctx, gen, 9)
        await to_gen.aclose()
        with pytest.raises(PeerDisconnected):
            await send(transport, to_gen, SendSession(9, plan))
        ManagerHold(gen.managers, "g").free()

    await run_pair(ctx, gen, body)


@pytest.mark.parametrize("status", [ChunkStatus.OK, ChunkStatus.FAILED])
@pytest.mark.anyio
async def test_every_report_before_the_send_returns_still_settles(status: ChunkStatus) -> None:
    reports = [ok(1, 0, 0, 2), ok(1, 1, 0, 1, status), ok(1, 0, 1, 2)]
    transport = ReportsFirst(reports)
    receiver = Receiver(transport, object(), (0, 1), stall_timeout=5)  # type: ignore[arg-type]
    transport.receiver = receiver
    hold = CountingHold()
    session = receiver.new_session("k", hold)
    request = ReceiveRequest(session.session_id, "k", 0, 4, (BlockIds("attention", (1,)),), 1)
    with anyio.fail_after(2):  # well inside stall_timeout: reports before the send must settle the session
        if status is ChunkStatus.OK:
            stats = await receiver.receive(session, request)
            assert (stats.nbytes, stats.writers) == (24, 2)
            assert session.state is ReceiveState.COMPLETE and hold.freed == 0  # the pages are the caller's
        else:
            with pytest.raises(TransferError, match="writer 1"):
                await receiver.receive(session, request)
            assert session.state is ReceiveState.FAILED and hold.freed == 1
    assert len(transport.sent) == 1 and hold.quarantined == 0
    assert receiver.statistics()["sessions"] == 0


@pytest.mark.anyio
async def test_a_receive_request_the_transport_refuses_whole_frees_the_pages() -> None:
    transport = ReportsFirst([], refuse=True)
    receiver = Receiver(transport, object(), (0,), stall_timeout=5)  # type: ignore[arg-type]
    hold = CountingHold()
    session = receiver.new_session("k", hold)
    request = ReceiveRequest(session.session_id, "k", 0, 4, (BlockIds("attention", (1,)),), 1)
    with anyio.fail_after(2), pytest.raises(TransferError, match="refused"):
        await receiver.receive(session, request)
    assert (hold.freed, hold.quarantined) == (1, 0) and session.state is ReceiveState.FAILED
