"""Sessions: the synchronous cores, and whole transfers between two sides of one process over the local
transport (bit-exact pages, poisoned receivers, cancellation at every step, stalls, peer loss)."""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import numpy as np
import pytest
import torch

from kvferry.disagg.link import pump
from kvferry.disagg.mapping import PeerMap
from kvferry.disagg.protocol import (
    BlockIds,
    CancelAck,
    CancelTransfer,
    ChunkResult,
    ChunkResults,
    ChunkStatus,
    ReceiveRequest,
    decode_control,
    encode_control,
    reports_of,
)
from kvferry.disagg.session import (
    Chunk,
    Receiver,
    ReceiveSession,
    ReceiveState,
    SendSession,
    send,
    split_chunks,
)
from kvferry.disagg.transfer import (
    ManagerHold,
    _dst_cache,
    destinations,
    expected_writers,
    plan_transfer,
    prepare_source,
)
from kvferry.errors import (
    ConfigError,
    PeerDisconnected,
    TransferCancelled,
    TransferError,
    TransferInDoubt,
    WireFormatError,
)
from kvferry.transports import Peer, Transport
from kvferry.wire import PackedInts
from tests.support.disagg_harness import Side, connected, make_side, tiny_spec, whole_cache

pytestmark = pytest.mark.timeout(60)


def ok(session: int, writer: int, chunk: int, n: int, status: ChunkStatus = ChunkStatus.OK) -> ChunkResult:
    return ChunkResult(session, writer, chunk, n, status, 8, 1)


# --- cores --------------------------------------------------------------------------------------------------


def test_split_chunks_keeps_every_byte_and_honours_the_limit() -> None:
    src = np.array([[0, 10], [100, 10], [110, 30], [500, 64]], dtype=np.uint64)
    dst = np.array([[1000, 10], [2000, 10], [2010, 30], [3000, 64]], dtype=np.uint64)
    chunks = split_chunks(2, src, dst, max_bytes=40)
    # [100,10]+[110,30] coalesce into one 40-byte row; the 64-byte row is a chunk of its own
    assert [c.src.tolist() for c in chunks] == [[[0, 10]], [[100, 40]], [[500, 64]]]
    assert [c.dst.tolist() for c in chunks] == [[[1000, 10]], [[2000, 40]], [[3000, 64]]]
    assert all(c.dst_rank == 2 for c in chunks)
    assert split_chunks(0, src, dst, max_bytes=1 << 20)[0].nbytes == 114


def test_receive_session_completes_only_when_every_writer_reported_everything() -> None:
    s = ReceiveSession(7, "k", (0, 1))
    s.requested()
    s.on_result(ok(7, 0, 0, 2))
    s.on_result(ok(7, 1, 0, 1))
    assert s.state is ReceiveState.REQUESTED and s.outstanding == 1
    s.on_result(ok(7, 0, 1, 2))
    assert s.state is ReceiveState.COMPLETE
    assert s.statistics().nbytes == 24


def test_receive_session_failure_waits_for_every_writer() -> None:
    s = ReceiveSession(1, "k", (0, 1))
    s.requested()
    s.on_result(ok(1, 0, 0, 1, ChunkStatus.FAILED))
    assert s.state is ReceiveState.REQUESTED  # writer 1 may still write
    s.on_result(ok(1, 1, 0, 1))
    assert s.state is ReceiveState.FAILED and "writer 0" in s.detail


def test_receive_session_refuses_strangers_and_inconsistent_counts() -> None:
    s = ReceiveSession(1, "k", (0,))
    s.requested()
    with pytest.raises(WireFormatError):
        s.on_result(ok(1, 3, 0, 1))
    s.on_result(ok(1, 0, 0, 2))
    with pytest.raises(WireFormatError):
        s.on_result(ok(1, 0, 1, 3))
    assert s.state is ReceiveState.REQUESTED


def test_receive_session_cancel_paths() -> None:
    fresh = ReceiveSession(1, "k", (0,))
    assert fresh.cancel().value == "free" and fresh.state is ReceiveState.CANCELLED
    asked = ReceiveSession(2, "k", (0,))
    asked.requested()
    assert asked.cancel().value == "quarantine" and asked.state is ReceiveState.CANCELLING
    asked.on_result(ok(2, 0, 0, 1))  # the late report settles it
    assert asked.state is ReceiveState.CANCELLED
    stalled = ReceiveSession(3, "k", (0,))
    stalled.requested()
    assert stalled.stalled() and stalled.state is ReceiveState.IN_DOUBT
    stalled.peer_lost("gone")
    assert stalled.state is ReceiveState.CANCELLED


def test_send_session_cancel_reports_the_unposted() -> None:
    chunk = Chunk(0, np.array([[0, 8]], dtype=np.uint64), np.array([[0, 8]], dtype=np.uint64))
    s = SendSession(4, {0: [chunk, chunk, chunk], 1: []})
    assert s.next_post(0) == (0, chunk)
    assert s.next_post(1) == (0, None)
    s.finish_post(1, 0, s.result(1, 0, ChunkStatus.OK))
    s.cancel()
    assert s.next_post(0) is None and not s.finished  # chunk 0 is still in flight
    s.finish_post(0, 0, s.result(0, 0, ChunkStatus.OK))
    cancelled = s.unposted(0)
    assert [(r.chunk, r.status) for r in cancelled] == [
        (1, ChunkStatus.CANCELLED),
        (2, ChunkStatus.CANCELLED),
    ]
    assert s.finished and not s.ok


# --- transfers over the local transport ------------------------------------------------------------------


class GatedTransport:
    """Wraps a transport: writes wait for ``gate`` (so a test can act while a write is posted)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.gate = anyio.Event()
        self.posted = 0
        self.drop_notify = False

    async def write(self, peer: Peer, src: Any, dst: Any, notify: bytes | None = None, **kw: Any) -> None:
        self.posted += 1
        await self.gate.wait()
        await self.inner.write(peer, src, dst, None if self.drop_notify else notify, **kw)

    async def write_many(self, peer: Peer, writes: Any, **kw: Any) -> list[Exception | None]:
        # each through the gate (Transport's default: the writes one by one, concurrently)
        return await Transport.write_many(self, peer, writes, **kw)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


PROMPT = list(range(3, 40))  # 37 tokens: 10 attention blocks of 4, 5 draft blocks of 8


async def send_when_asked(transport: Any, peer: Peer, session: SendSession, **options: Any) -> None:
    """:func:`send` once the receive request arrived, as a context side does: the receiver grants the request's
    destinations before it sends the request, so its writes find the grant (the control channel is ordered)."""
    assert isinstance(decode_control(await transport.receive_message(peer)), ReceiveRequest)
    await send(transport, peer, session, **options)


class ContextMessages:
    """A context side's reader for tests that run :func:`send` themselves: ``asked`` is set once the receive
    request arrived (send after it: it follows the grant), and a CancelTransfer cancels ``session``."""

    def __init__(self, session: SendSession) -> None:
        self.session = session
        self.asked = anyio.Event()

    async def __call__(self, message: Any) -> None:
        if isinstance(message, ReceiveRequest):
            self.asked.set()
        elif isinstance(message, CancelTransfer) and message.session_id == self.session.session_id:
            self.session.cancel()

    async def send(self, transport: Any, peer: Peer, **options: Any) -> None:
        await self.asked.wait()
        await send(transport, peer, self.session, **options)


def plan_for(ctx: Side, gen: Side, sid: int, max_chunk_bytes: int = 1 << 20) -> Any:
    request = gen.receive_request(sid, "r", "g", len(PROMPT))
    peer_map = PeerMap.build([a.page_table() for a in ctx.arenas], [a.page_table() for a in gen.arenas])
    plan = plan_transfer(
        peer_map,
        range(ctx.tp),
        ctx.blocks("c"),
        ctx.slot("c"),
        request,
        [a.page_table() for a in gen.arenas],
        max_chunk_bytes=max_chunk_bytes,
    )
    return request, plan


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 1), (1, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("drafter", [True, False])
def test_a_prepared_source_plans_the_same(ctx_tp: int, gen_tp: int, drafter: bool) -> None:
    """The sender's side mapped ahead (prepare_source) gives the plan planning from the block table gives; the
    whole-prompt request uses what was prepared (nothing more is worked out; also for a receiver without a
    drafter, whose writes read the same ids), and a request for less (a reused prefix on the receiver) works
    its own ids out."""
    ctx, gen = make_side(tiny_spec(), ctx_tp), make_side(tiny_spec(drafter=drafter), gen_tp)
    ctx.fake_prefill("c", PROMPT, seed=11)
    gen.create("g", PROMPT)
    peer_map = PeerMap.build([a.page_table() for a in ctx.arenas], [a.page_table() for a in gen.arenas])
    tables = [a.page_table() for a in gen.arenas]
    whole = gen.receive_request(1, "r", "g", len(PROMPT))
    for request in (whole, attrs.evolve(whole, token_start=9)):
        source = prepare_source(peer_map, range(ctx_tp), ctx.blocks("c"), ctx.slot("c"), len(PROMPT))
        prepared = len(source._source)
        # per writing pair its unit addresses, and the ids of the indexed writes (shared where they agree)
        assert prepared > sum(peer_map.pair(s, d).writes for s in range(ctx_tp) for d in peer_map.targets(s))
        got = plan_transfer(peer_map, range(ctx_tp), source, None, request, tables)
        # the whole prompt: planned from what was prepared (a peer without a drafter reads the same ids: its
        # layout has no draft groups whatever the range says of them)
        expect_hit = request is whole
        assert (len(source._source) == prepared) is expect_hit
        expected = plan_transfer(peer_map, range(ctx_tp), ctx.blocks("c"), ctx.slot("c"), request, tables)
        assert got.keys() == expected.keys()
        for w, chunks in expected.items():
            assert len(got[w]) == len(chunks)
            for a, b in zip(got[w], chunks, strict=True):
                assert all(map(np.array_equal, a.fragments(), b.fragments()))


def test_ids_off_the_wire_are_checked_once() -> None:
    """A receive request's ids are checked when it is decoded (unique, positive) and against the receiver's
    pools (check_request); the mapping takes them as they are, with the plan of the same request built in
    process (whose ids the mapping checks itself: repeated ones are refused there)."""
    ctx, gen = make_side(tiny_spec(), 1), make_side(tiny_spec(), 2)
    ctx.fake_prefill("c", PROMPT, seed=11)
    gen.create("g", PROMPT)
    peer_map = PeerMap.build([a.page_table() for a in ctx.arenas], [a.page_table() for a in gen.arenas])
    tables = [a.page_table() for a in gen.arenas]
    request = gen.receive_request(1, "r", "g", len(PROMPT))
    decoded = decode_control(encode_control(request))
    assert isinstance(decoded, ReceiveRequest) and all(
        type(b.block_ids) is PackedInts for b in decoded.blocks
    )
    assert set(_dst_cache(decoded, tables[0])._trusted) == {b.group for b in request.blocks}
    assert not _dst_cache(request, tables[0])._trusted
    plans = [
        plan_transfer(peer_map, range(1), ctx.blocks("c"), ctx.slot("c"), r, tables)
        for r in (request, decoded)
    ]
    assert plans[0].keys() == plans[1].keys()
    for w, chunks in plans[0].items():
        for a, b in zip(chunks, plans[1][w], strict=True):
            assert all(len(f) for f in a.fragments())
            assert all(map(np.array_equal, a.fragments(), b.fragments()))
    ids = request.blocks[0].block_ids
    repeated = attrs.evolve(
        request, blocks=(attrs.evolve(request.blocks[0], block_ids=(ids[1], *ids[1:])), *request.blocks[1:])
    )
    with pytest.raises(ConfigError, match="repeat"):
        plan_transfer(peer_map, range(1), ctx.blocks("c"), ctx.slot("c"), repeated, tables)
    with pytest.raises(WireFormatError, match="repeat"):
        decode_control(encode_control(repeated))


def writers(ctx: Side, gen: Side) -> tuple[int, ...]:
    return expected_writers(
        PeerMap.build([a.page_table() for a in ctx.arenas], [a.page_table() for a in gen.arenas])
    )


def receiver_for(ctx: Side, gen: Side, peer: Peer, stall_timeout: float = 10) -> Receiver:
    """The generation side's receiver from ``ctx``: it grants each request's destinations (as the roles do)."""
    assert gen.transport is not None
    peer_map = PeerMap.build([a.page_table() for a in ctx.arenas], [a.page_table() for a in gen.arenas])
    return Receiver(
        gen.transport,
        peer,
        expected_writers(peer_map),
        stall_timeout=stall_timeout,
        destinations=partial(destinations, peer_map),
    )


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
            m_arena.fill_garbage("mamba2", [m.slot_id("g")], seed=97)
        session = receiver.new_session("r", ManagerHold(gen.managers, "g"))
        request, plan = plan_for(ctx, gen, session.session_id, max_chunk_bytes=chunk_bytes)  # type: ignore[arg-type]
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
                await send_when_asked(ctx.transport, to_gen, SendSession(session.session_id, plan))  # type: ignore[arg-type]

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
        request, plan = plan_for(ctx, gen, session.session_id, max_chunk_bytes=None)  # type: ignore[arg-type]
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


async def run_pair(ctx: Side, gen: Side, body: Any, *, gated: bool = False, stall: float = 10.0) -> Any:
    """Run ``body(receiver, sender transport, ctx's peer, task group)`` with the receiver's pump running; at
    the end the context side drops the connection and the pump settles what is left (peer gone)."""
    async with connected(ctx, gen) as (to_gen, to_ctx):
        assert gen.transport is not None and ctx.transport is not None
        sender_transport: Any = GatedTransport(ctx.transport) if gated else ctx.transport
        receiver = receiver_for(ctx, gen, to_ctx, stall)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump, gen.transport, to_ctx, receiver)
            result = await body(receiver, sender_transport, to_gen, tg)
            await to_gen.aclose()
        assert receiver.lost
        return result


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


def attention_rows(side: Side, ids: list[int]) -> torch.Tensor:
    arena = side.arenas[0]
    pool = arena.pool_tensor("attention")
    return pool.view(arena.layout.pool_group("attention").num_slots, -1)[ids].clone()


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
                    tg.start_soon(_cancel_when, scope, lambda: gated.posted >= 1)
                    await receiver.receive(session, request)
            else:
                # every write lands (notifications queue up unread), then the receiver is cancelled
                gated.gate.set()
                with anyio.CancelScope() as scope:
                    tg.start_soon(_cancel_when, scope, lambda: send_session.finished)
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


async def _cancel_when(scope: anyio.CancelScope, condition: Any) -> None:
    while not condition():  # noqa: ASYNC110 (polls state no event exposes)
        await anyio.sleep(0.002)
    scope.cancel()


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


# --- ordering: reports that overtake the receive request ------------------------------------------------------


def test_reports_recorded_before_requested_settle_it() -> None:
    s = ReceiveSession(5, "k", (0, 1))
    s.on_result(ok(5, 0, 0, 1))
    s.on_result(ok(5, 1, 0, 1))
    assert s.state is ReceiveState.ALLOCATED  # nothing was asked yet: nothing settles
    s.requested()
    assert s.state is ReceiveState.COMPLETE and s.statistics().nbytes == 16


class _CountingHold:
    def __init__(self) -> None:
        self.freed = self.quarantined = self.released = 0

    def free(self) -> None:
        self.freed += 1

    def quarantine(self) -> Any:
        self.quarantined += 1

        def release() -> None:
            self.released += 1

        return release


class _ReportsFirst:
    """A control channel where every writer's reports arrive before ``send_message`` of the receive request
    returns (a fast context side): they are delivered into the receiver from inside the send."""

    name = "fake"

    def __init__(self, reports: list[ChunkResult], *, refuse: bool = False) -> None:
        self.receiver: Receiver | None = None
        self.reports = reports
        self.refuse = refuse
        self.sent: list[bytes] = []

    async def send_message(self, peer: Any, data: bytes) -> None:
        from kvferry.errors import MessageTooLarge

        if self.refuse:
            raise MessageTooLarge("too big")
        self.sent.append(data)
        assert self.receiver is not None
        for report in self.reports:
            self.receiver.on_result(report)
        await anyio.lowlevel.checkpoint()  # the send resumes only after a scheduling point


@pytest.mark.parametrize("status", [ChunkStatus.OK, ChunkStatus.FAILED])
@pytest.mark.anyio
async def test_every_report_before_the_send_returns_still_settles(status: ChunkStatus) -> None:
    reports = [ok(1, 0, 0, 2), ok(1, 1, 0, 1, status), ok(1, 0, 1, 2)]
    transport = _ReportsFirst(reports)
    receiver = Receiver(transport, object(), (0, 1), stall_timeout=5)  # type: ignore[arg-type]
    transport.receiver = receiver
    hold = _CountingHold()
    session = receiver.new_session("k", hold)
    request = ReceiveRequest(session.session_id, "k", 0, 4, (BlockIds("attention", (1,)),), 1)
    with anyio.fail_after(2):  # before the fix: TransferInDoubt after stall_timeout ("0 writers out")
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
    transport = _ReportsFirst([], refuse=True)
    receiver = Receiver(transport, object(), (0,), stall_timeout=5)  # type: ignore[arg-type]
    hold = _CountingHold()
    session = receiver.new_session("k", hold)
    request = ReceiveRequest(session.session_id, "k", 0, 4, (BlockIds("attention", (1,)),), 1)
    with anyio.fail_after(2), pytest.raises(TransferError, match="refused"):
        await receiver.receive(session, request)
    assert (hold.freed, hold.quarantined) == (1, 0) and session.state is ReceiveState.FAILED


def test_chunk_results_travel_together_and_are_checked_one_by_one() -> None:
    """Several writers' reports in one message decode to the same reports; a batch that is empty, mixes
    sessions or holds a malformed report is refused whole (WireFormatError), before any report is used."""
    reports = (ok(5, 0, 0, 1), ok(5, 1, 0, 2), ok(5, 1, 1, 2, ChunkStatus.FAILED))
    decoded = decode_control(encode_control(ChunkResults(reports)))
    assert isinstance(decoded, ChunkResults) and decoded.results == reports
    assert reports_of(decoded) == reports and reports_of(reports[0]) == (reports[0],)
    assert reports_of(CancelAck(5)) == ()
    for bad in (
        ChunkResults(()),
        ChunkResults((ok(5, 0, 0, 1), ok(6, 0, 0, 1))),
        ChunkResults((ok(5, 0, 0, 1), ChunkResult(5, 1, 3, 2, ChunkStatus.OK))),  # chunk past its count
    ):
        with pytest.raises(WireFormatError):
            decode_control(encode_control(bad))
