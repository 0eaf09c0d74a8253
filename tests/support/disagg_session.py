"""The session tests' shared setup: a prompt, reports, a gated transport, a context side's reader, a plan and a
receiver between two :class:`~tests.support.disagg_harness.Side` objects, and fakes of a page hold and of a
control channel whose reports overtake the receive request."""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import torch

from kvferry.disagg.link import pump
from kvferry.disagg.mapping import PeerMap
from kvferry.disagg.protocol import CancelTransfer, ChunkResult, ChunkStatus, ReceiveRequest, decode_control
from kvferry.disagg.session import Receiver, ReceiveSession, ReceiveState, SendSession, send
from kvferry.disagg.transfer import destinations, expected_writers, plan_transfer
from kvferry.transports import Peer, Transport
from tests.support.disagg_harness import Side, connected

PROMPT = list(range(3, 40))  # 37 tokens: 10 attention blocks of 4, 5 draft blocks of 8


def ok(session: int, writer: int, chunk: int, n: int, status: ChunkStatus = ChunkStatus.OK) -> ChunkResult:
    """Writer ``writer``'s report of chunk ``chunk`` of ``n`` (8 bytes, 1 fragment)."""
    return ChunkResult(session, writer, chunk, n, status, 8, 1)


def state_of(session: ReceiveSession) -> ReceiveState:
    """``session.state``, read anew (a call mypy does not narrow across)."""
    return session.state


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


def plan_for(ctx: Side, gen: Side, sid: int, max_chunk_bytes: int | None = 1 << 20) -> Any:
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


def attention_rows(side: Side, ids: list[int]) -> torch.Tensor:
    """A copy of rank 0's attention pages ``ids``."""
    arena = side.arenas[0]
    pool = arena.pool_tensor("attention")
    return pool.view(arena.layout.pool_group("attention").num_slots, -1)[ids].clone()


async def cancel_when(scope: anyio.CancelScope, condition: Any) -> None:
    """Cancel ``scope`` once ``condition()`` holds."""
    while not condition():  # noqa: ASYNC110 (polls state no event exposes)
        await anyio.sleep(0.002)
    scope.cancel()


class CountingHold:
    """A page hold that counts what the receiver did with it."""

    def __init__(self) -> None:
        self.freed = self.quarantined = self.released = 0

    def free(self) -> None:
        self.freed += 1

    def quarantine(self) -> Any:
        self.quarantined += 1

        def release() -> None:
            self.released += 1

        return release


class ReportsFirst:
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
