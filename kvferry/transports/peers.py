"""A peer of a channel transport, and everything the transport keeps for it.

:class:`ChannelPeer` is the handle :meth:`~kvferry.transports.Transport.connect` and
:meth:`~kvferry.transports.Transport.accept` return, and the one place a peer's state lives: its connection,
hello and region table, and its queues (the control channel's, :mod:`~kvferry.transports.control`), its grants
both ways (the grant ledger's, :mod:`~kvferry.transports.grants`), its writes in flight (the write pipeline's,
:mod:`~kvferry.transports.writes`, and the data path's). Its life (:class:`~kvferry.transports.base.PeerState`)::

    handshaken ──> CONNECTED ──the connection ends, or it sent something malformed──> LOST
                       └──────peer.aclose(), or the transport's aclose()──────────────> CLOSED

Once it is not CONNECTED every call involving it raises :attr:`ChannelPeer.error`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import ByteStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvferry.errors import ClosedResourceError, MessageTooLarge, PeerDisconnected, TransportError
from kvferry.transports._indexed_copy import IndexedCopies
from kvferry.transports._memory import Grants, RegionTable
from kvferry.transports.base import Peer, PeerAttribute, PeerState
from kvferry.transports.handshake import Introduction
from kvferry.transports.messages import Frame, WriteReply

if TYPE_CHECKING:
    from kvferry.transports.channel import ChannelTransport
    from kvferry.transports.datapath import DataPath
    from kvferry.transports.writes import Guard

__all__ = ["ChannelPeer"]


class ChannelPeer(Peer):
    """A peer handle of a :class:`~kvferry.transports.channel.ChannelTransport`, and everything the transport keeps
    for that peer: its connection and queues (the control channel's), its grants (the grant ledger's), its
    writes in flight (the write pipeline's and the data path's)."""

    __slots__ = (
        "_state",
        "backend",
        "error",
        "granted",
        "grants",
        "guards",
        "held_bytes",
        "hello",
        "incoming",
        "indexed",
        "lost",
        "messages_in",
        "messages_out",
        "notifications_in",
        "notifications_out",
        "outbox",
        "pending",
        "proof",
        "regions",
        "same_host",
        "same_process",
        "send_lock",
        "stream",
        "transport",
        "wake",
    )

    def __init__(
        self, transport: ChannelTransport[DataPath], stream: ByteStream, introduction: Introduction
    ) -> None:
        hello = introduction.hello
        self.transport = transport
        self.stream = stream
        self.hello = hello
        #: on this host, in this pid namespace (its pid names it here), and shown to be that pid
        self.same_host = introduction.same_host
        self.same_process = self.same_host and hello.pid == os.getpid()
        #: our pid proof for this connection (the peer may read it while the connection lasts)
        self.proof = introduction.proof
        #: bytes of its messages and notifications held for the application (the transport's BufferBudget)
        self.held_bytes = 0
        self.regions = RegionTable(hello.regions)
        self._state = PeerState.CONNECTED
        self.error: TransportError = PeerDisconnected(f"peer {hello.address} disconnected")
        self.lost = anyio.Event()
        self.send_lock = anyio.Lock(fast_acquire=True)  # an uncontended frame goes out without a loop turn
        self.messages_out: MemoryObjectSendStream[bytes | MessageTooLarge]
        self.messages_in: MemoryObjectReceiveStream[bytes | MessageTooLarge]
        limits = transport.limits
        self.messages_out, self.messages_in = anyio.create_memory_object_stream[bytes | MessageTooLarge](
            limits.max_queued_messages
        )
        self.notifications_out: MemoryObjectSendStream[bytes]
        self.notifications_in: MemoryObjectReceiveStream[bytes]
        self.notifications_out, self.notifications_in = anyio.create_memory_object_stream[bytes](
            limits.max_queued_notifications
        )
        #: writes of ours waiting for the peer's reply, by write id
        self.pending: dict[int, MemoryObjectSendStream[WriteReply]] = {}
        #: writes of the peer's being received into our memory, by write id
        self.incoming: dict[int, anyio.CancelScope] = {}
        self.guards: set[Guard] = set()
        #: what the data path keeps per peer (NIXL agent name, UCX endpoint)
        self.backend: Any = None
        #: templates of indexed writes to this peer checked for its device path
        self.indexed = IndexedCopies()
        #: what this peer granted us (its GRANT frames): our writes to it must land inside
        self.grants = Grants()
        #: what we granted this peer (:meth:`ChannelTransport.grant`): its writes we receive must land inside
        self.granted = Grants()
        #: frames that go out ahead of the next ones sent (deferred grants, revokes; see
        #: :meth:`~kvferry.transports.control.ControlChannel.send_frames`), and what wakes the task that sends
        #: them when nothing else does (None until the first is queued)
        self.outbox: list[Frame] = []
        self.wake: anyio.Event | None = None

    @property
    def state(self) -> PeerState:
        return self._state

    @property
    def address(self) -> str:
        return self.hello.address

    async def aclose(self) -> None:
        await self.transport.control.lose(
            self, ClosedResourceError("peer handle was closed"), state=PeerState.CLOSED
        )

    @property
    def extra_attributes(self) -> Mapping[Any, Any]:
        return {
            PeerAttribute.address: lambda: self.hello.address,
            PeerAttribute.instance_id: lambda: self.hello.instance_id,
            PeerAttribute.same_process: lambda: self.same_process,
            PeerAttribute.pid: lambda: self.hello.pid,
        }

    def __repr__(self) -> str:
        where = "same process" if self.same_process else f"pid {self.hello.pid}"
        return (
            f"<Peer {self.hello.address} [{self._state.value} | {where} | {len(self.regions)} regions, "
            f"{len(self.pending)} writes out, {len(self.incoming)} in]>"
        )
