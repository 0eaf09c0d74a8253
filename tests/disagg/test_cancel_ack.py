"""A cancelled transfer whose push never starts costs its pages one round trip, not the connection's life.

The receiver quarantines its pages when it is cancelled after asking and sends CancelTransfer; the context side
answers CancelAck for any session it is not pushing (request never received, received but not pushed yet: the
push is called off, or already pushed), and the receiver releases the pages at once. A push in progress is
still stopped by the cancel and answered by its writers' reports. Checked on the cores, and end to end through
the engine roles with transports that lose or delay the receive request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import anyio.lowlevel
import pytest
import torch

from kvferry.disagg.protocol import (
    BlockIds,
    CancelAck,
    CancelTransfer,
    ChunkResult,
    ChunkStatus,
    ReceiveRequest,
    decode_control,
    encode_control,
)
from kvferry.disagg.roles import ContextWorker, GenerationWorker
from kvferry.disagg.router import RoutedGeneration, Router
from kvferry.disagg.serve import _options
from kvferry.disagg.session import Receiver, ReceiveSession, ReceiveState
from kvferry.engine.runner import BuiltEngine, build_engine
from kvferry.errors import KvferryError, WireFormatError
from kvferry.transports import Peer, Transport, get_transport
from tests.support.disagg_pair import counts, until
from tests.support.disagg_reference import MAX_TOKENS, PROMPTS, SPEC_K, Result, aggregated
from tests.support.disagg_session import state_of

pytestmark = pytest.mark.timeout(120)


# --- the cores ----------------------------------------------------------------------------------------------


def test_cancel_ack_round_trips_and_bounds_its_text() -> None:
    ack = CancelAck(7, "no push in progress")
    assert decode_control(encode_control(ack)) == ack
    assert decode_control(encode_control(CancelTransfer(7, "x"))) == CancelTransfer(7, "x")
    with pytest.raises(WireFormatError):
        decode_control(encode_control(CancelAck(7, "x" * 5000)))


def test_only_a_cancelling_session_accepts_the_acknowledgement() -> None:
    fresh = ReceiveSession(1, "k", (0,))
    assert not fresh.cancel_acknowledged() and fresh.state is ReceiveState.ALLOCATED
    asked = ReceiveSession(2, "k", (0,))
    asked.requested()
    assert not asked.cancel_acknowledged() and asked.state is ReceiveState.REQUESTED  # writers may be writing
    assert asked.stalled() and not asked.cancel_acknowledged()
    assert state_of(asked) is ReceiveState.IN_DOUBT
    cancelling = ReceiveSession(3, "k", (0,))
    cancelling.requested()
    cancelling.cancel()
    assert cancelling.cancel_acknowledged() and cancelling.state is ReceiveState.CANCELLED
    assert not cancelling.cancel_acknowledged()  # once


class _CountingHold:
    def __init__(self) -> None:
        self.freed = self.quarantined = self.released = 0

    def free(self) -> None:
        self.freed += 1

    def quarantine(self) -> Callable[[], None]:
        self.quarantined += 1

        def release() -> None:
            self.released += 1

        return release


class _Silent:
    """A control channel that records what is sent and never answers."""

    name = "fake"

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def send_message(self, peer: Any, data: bytes) -> None:
        self.sent.append(decode_control(data))
        await anyio.lowlevel.checkpoint()


@pytest.mark.anyio
async def test_receiver_releases_on_the_acknowledgement_and_ignores_the_rest() -> None:
    transport = _Silent()
    receiver = Receiver(transport, object(), (0, 1), stall_timeout=30)  # type: ignore[arg-type]
    hold, idle_hold = _CountingHold(), _CountingHold()
    session = receiver.new_session("k", hold)
    idle = receiver.new_session("idle", idle_hold)  # ALLOCATED, never asked
    request = ReceiveRequest(session.session_id, "k", 0, 4, (BlockIds("attention", (1,)),), 1)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver.receive, session, request)
            while not transport.sent:  # noqa: ASYNC110
                await anyio.sleep(0.001)
            # asked and not cancelled: writers may be writing, an acknowledgement must not free anything
            receiver.on_cancel_ack(CancelAck(session.session_id))
            assert session.state is ReceiveState.REQUESTED and (hold.freed, hold.quarantined) == (0, 0)
            tg.cancel_scope.cancel()
    assert session.state is ReceiveState.CANCELLING
    assert (hold.freed, hold.quarantined, hold.released) == (0, 1, 0)
    assert transport.sent[-1] == CancelTransfer(session.session_id, "receiver cancelled")
    receiver.on_cancel_ack(CancelAck(999))  # unknown
    receiver.on_cancel_ack(CancelAck(idle.session_id))  # not cancelled
    assert receiver.statistics()["quarantined"] == 1 and idle_hold.freed == 0
    receiver.on_cancel_ack(CancelAck(session.session_id, "no push in progress"))
    assert state_of(session) is ReceiveState.CANCELLED and (hold.freed, hold.released) == (0, 1)
    s = receiver.statistics()
    assert (s["quarantined"], s["sessions"], s["cancelled"]) == (0, 1, 1)
    # late reports and a repeated acknowledgement of the released session change nothing
    receiver.on_result(ChunkResult(session.session_id, 0, 0, 1, ChunkStatus.OK, 8, 1))
    receiver.on_cancel_ack(CancelAck(session.session_id))
    assert (hold.freed, hold.quarantined, hold.released) == (0, 1, 1)
    assert receiver.statistics()["cancelled"] == 1 and receiver.statistics()["sessions"] == 1


# --- end to end through the roles -------------------------------------------------------------------------


class _Tap:
    """The generation side's transport: records every receive request it sends; swallows them while
    ``swallow`` (the request is lost on the way and the send says nothing)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.requests: list[ReceiveRequest] = []
        self.swallow = False
        #: seconds a receive request waits before it goes out
        self.delay = 0.0

    async def send_message(self, peer: Peer, data: bytes) -> None:
        try:
            message = decode_control(data)
        except WireFormatError:  # the handshake
            message = None
        if isinstance(message, ReceiveRequest):
            self.requests.append(message)
            if self.swallow:
                await anyio.lowlevel.checkpoint()
                return
            await anyio.sleep(self.delay)
        await self.inner.send_message(peer, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Paired:
    """The context side's transport: while ``armed``, a receive request is handed to the reader only together
    with the message after it, with no scheduling point between the two: the context side sees the request,
    then the next message before its push can start."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.armed = False
        self.holding = False
        self._pending: list[bytes] = []

    async def receive_message(self, peer: Peer) -> bytes:
        if self._pending:
            return self._pending.pop(0)
        data = await self.inner.receive_message(peer)
        try:
            message = decode_control(data)
        except WireFormatError:  # the handshake
            return data
        if self.armed and isinstance(message, ReceiveRequest):
            self.holding = True
            self._pending.append(await self.inner.receive_message(peer))
            self.holding = False
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@asynccontextmanager
async def serving(
    *, write_delay: float = 0.0, max_chunk_bytes: int | None = None, hold_timeout: float = 60.0
) -> AsyncIterator[tuple[Router, GenerationWorker, ContextWorker, _Tap, _Paired]]:
    """Both roles in this process over the local transport, each behind a test wrapper."""
    gen = build_engine("tiny", _options(1, SPEC_K, 0, "float64"))
    ctx = build_engine("tiny", _options(1, SPEC_K, 0, "float64"))
    factory = get_transport("local")
    async with factory() as gen_transport, gen.engine, anyio.create_task_group() as tg:
        tap = _Tap(gen_transport)
        # the wrappers stand in for a Transport: what they do not override goes to the real one
        worker = GenerationWorker(gen, cast(Transport, tap))
        async with factory() as ctx_transport, ctx.engine:
            paired = _Paired(ctx_transport)
            context = ContextWorker(
                ctx,
                cast(Transport, paired),
                write_delay=write_delay,
                max_chunk_bytes=max_chunk_bytes,
                hold_timeout=hold_timeout,
            )
            peer = await gen_transport.connect(ctx_transport.address)
            ctx_peer = await ctx_transport.accept()
            tg.start_soon(context.serve, ctx_peer)
            await worker.connect(peer, tg)
            yield Router(worker), worker, context, tap, paired
            await peer.aclose()
        tg.cancel_scope.cancel()


_expected: list[Result] = []


async def expected() -> Result:
    if not _expected:
        _expected.append(await aggregated(PROMPTS))
    return _expected[0]


async def cancel_when(routed: RoutedGeneration, condition: Callable[[], bool]) -> None:
    """Iterate ``routed`` and cancel it once ``condition`` holds (it must not end before)."""
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await until(condition, 10, lambda: "the cancel condition")
                scope.cancel()

            tg.start_soon(watch)
            await routed.collect()
            pytest.fail("the request ended before it was cancelled")
    assert scope.cancelled_caught


async def serves_on(router: Router, worker: GenerationWorker) -> None:
    """The same connection serves the next requests with aggregated serving's tokens."""
    tokens, _ = await expected()
    for i in (0, 1):
        assert await router.generate(PROMPTS[i], max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect() == tokens[i]
    assert worker.receiver is not None and not worker.receiver.lost


@pytest.mark.anyio
async def test_a_request_that_never_reaches_the_context_side_releases_its_pages() -> None:
    await expected()
    async with serving() as (router, worker, context, tap, _):
        gen = worker.built
        before = counts(gen)
        tap.swallow = True
        routed = router.generate(PROMPTS[0], max_tokens=MAX_TOKENS, spec_k=SPEC_K)
        await cancel_when(routed, lambda: bool(tap.requests))
        assert worker.receiver is not None
        # before the acknowledgement this stayed quarantined until the connection dropped
        await until(lambda: counts(gen) == before, 5, lambda: (counts(gen), before, worker.receiver))
        await until(lambda: not context.statistics()["held"], 5, context.statistics)
        s = worker.receiver.statistics()
        assert (s["quarantined"], s["sessions"], s["cancelled"], s["complete"]) == (0, 0, 1, 0)
        assert not worker.receiver.lost
        assert context.statistics()["pushed"] == 0  # the context side never heard of the session
        tap.swallow = False
        await serves_on(router, worker)
        await gen.engine.wait_idle()
        assert counts(gen) == before


def rows(built: BuiltEngine, group: str, ids: list[int]) -> list[torch.Tensor]:
    """The bytes of pages / slots ``ids`` of ``group`` (every pool of the group: mamba2 has conv and ssm)."""
    arena = built.arenas[0]
    num_slots = arena.layout.pool_group(group).num_slots
    pools = [t for name, t in arena.pool_tensors().items() if name.split(".")[0] == group]
    assert pools, group
    return [pool.view(num_slots, -1)[ids].clone() for pool in pools]


@pytest.mark.anyio
async def test_a_cancel_before_the_push_starts_calls_it_off_and_nothing_lands() -> None:
    await expected()
    # a push that did start would hold the pages quarantined for write_delay seconds, then write them
    async with serving(write_delay=30.0) as (router, worker, context, tap, paired):
        gen = worker.built
        before = counts(gen)
        paired.armed = True
        routed = router.generate(PROMPTS[2], max_tokens=MAX_TOKENS, spec_k=SPEC_K)
        # the context side has the receive request in hand (not yet read) when the receiver is cancelled
        await cancel_when(routed, lambda: paired.holding)
        paired.armed = False
        assert worker.receiver is not None
        await until(lambda: counts(gen) == before, 5, lambda: (counts(gen), before, worker.receiver))
        # the released pages, slot included: poison them; no write of the cancelled session may change them
        (request,) = tap.requests
        targets = {b.group: list(b.block_ids) for b in request.blocks}
        targets["mamba2"] = [request.slot]
        for group, ids in targets.items():
            gen.arenas[0].fill_garbage(group, ids, seed=13)
        poisoned = {group: rows(gen, group, ids) for group, ids in targets.items()}
        # the context side got the request, called the push off and let the cache go: nothing can write now
        await until(lambda: not context.statistics()["held"], 5, context.statistics)
        s = context.statistics()
        assert (s["pushed"], s["cancelled"], s["sending"], s["bytes"]) == (0, 1, 0, 0)
        await anyio.sleep(0.2)
        for group, ids in targets.items():
            now = rows(gen, group, ids)
            assert all(torch.equal(a, b) for a, b in zip(now, poisoned[group], strict=True)), group
        r = worker.receiver.statistics()
        assert (r["quarantined"], r["sessions"], r["cancelled"]) == (0, 0, 1)
        context.write_delay = 0.0
        await serves_on(router, worker)
        await gen.engine.wait_idle()
        assert counts(gen) == before


@pytest.mark.anyio
async def test_a_cancel_during_the_push_is_answered_by_the_writers_reports() -> None:
    await expected()
    async with serving(write_delay=0.05, max_chunk_bytes=2048) as (router, worker, context, _, _p):
        gen = worker.built
        before = counts(gen)
        routed = router.generate(PROMPTS[2], max_tokens=MAX_TOKENS, spec_k=SPEC_K)
        await cancel_when(routed, lambda: context.statistics()["sending"] == 1)
        assert worker.receiver is not None
        await until(lambda: counts(gen) == before, 10, lambda: (counts(gen), before, worker.receiver))
        await until(lambda: not context.statistics()["held"], 5, context.statistics)
        s = context.statistics()
        # the push was stopped, not called off: its writers reported CANCELLED chunks, no acknowledgement
        assert (s["pushed"], s["cancelled"]) == (1, 0)
        assert worker.receiver.statistics()["cancelled"] == 1
        context.write_delay = 0.0
        await serves_on(router, worker)


@pytest.mark.anyio
async def test_a_receive_request_after_the_hold_ran_out_fails_at_once_and_frees_the_pages() -> None:
    """The context side no longer holds the prompt's cache when the receive request comes: every writer
    reports a failure, so the receiver frees its pages at once (not in doubt after the stall deadline, with the
    pages quarantined until the connection drops)."""
    await expected()
    async with serving(hold_timeout=0.05) as (router, worker, context, tap, _):
        gen = worker.built
        before = counts(gen)
        tap.delay = 0.5  # the request leaves after the context side let the cache go
        with anyio.fail_after(10), pytest.raises(KvferryError, match="no cache held"):
            await router.generate(PROMPTS[0], max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
        tap.delay = 0.0
        context.hold_timeout = 60.0  # the next requests must not race a short hold on a loaded machine
        assert worker.receiver is not None
        await until(lambda: counts(gen) == before, 5, lambda: (counts(gen), before, worker.receiver))
        s = worker.receiver.statistics()
        assert (s["quarantined"], s["in_doubt"], s["failed"]) == (0, 0, 1)
        assert context.statistics()["pushed"] == 0
        await serves_on(router, worker)
