"""The control channel of a channel transport: one TCP connection per peer, its handshake, its frames.

Each peer has one connection (framed by :data:`~kvferry.transports.messages.FRAME_HEADER`, handshaken by
:mod:`~kvferry.transports.handshake`) and one reader task, which dispatches what arrives: messages and
notifications are held for the application within a :class:`~kvferry.transports.limits.BufferBudget`, region
tables and grants are recorded, two-sided write frames go to the data path. The connection is also how a dead peer
is noticed: the kernel closes a killed process's sockets, the reader sees the end of the stream, and every wait
involving that peer ends with :class:`~kvferry.errors.PeerDisconnected`. That is what lets the library data
paths (NIXL, UCX) run with their cheaper, hang-prone settings (error handling off, shared memory) and still fail
within a deadline.

A peer's life is drawn in :mod:`~kvferry.transports.peers`. Whatever a peer sends, or whatever breaks while
serving it, ends that peer only: it is LOST with a logged, counted reason, and every other peer goes on. Frames go
out under the peer's send lock; a frame cut midway (a cancel, an error) loses the peer, since the stream can no
longer be framed.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from collections.abc import Sequence
from contextlib import suppress
from typing import TYPE_CHECKING

import anyio
from anyio.abc import ByteStream, Listener, SocketStream
from anyio.streams.stapled import MultiListener
from anyio.streams.tls import TLSStream

from kvferry import wire
from kvferry.errors import (
    ClosedResourceError,
    KvferryError,
    MessageTooLarge,
    PeerDisconnected,
    PeerIncompatible,
    TransportError,
    WireFormatError,
)
from kvferry.transports._framing import FrameReader, close_quietly, discard, frame, tune
from kvferry.transports._memory import RegionTable
from kvferry.transports.base import Peer, PeerState
from kvferry.transports.handshake import Handshake, Introduction, pid_namespace
from kvferry.transports.limits import BufferBudget
from kvferry.transports.messages import FRAME_HEADER, Frame, FrameKind, Hello, RegionsUpdate, WriteReply
from kvferry.transports.peers import ChannelPeer

if TYPE_CHECKING:
    from kvferry.transports.channel import ChannelTransport
    from kvferry.transports.datapath import DataPath

__all__ = ["ControlChannel", "parse_address"]

log = logging.getLogger("kvferry.transports")

#: the first wait after an accept fails (out of descriptors), doubling up to the second
_ACCEPT_BACKOFF = 0.05
_ACCEPT_BACKOFF_MAX = 1.0
#: frames up to this long go out together in one send (one segment, one wakeup)
_SMALL_FRAME = 1 << 16


def parse_address(address: str) -> tuple[str, str, int]:
    """``"name://host:port"`` -> (name, host, port)."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or not colon or not port.isdigit():
        raise ValueError(f"not a transport address: {address!r} (expected name://host:port)")
    return scheme, host.strip("[]"), int(port)


def _one_line(exc: BaseException) -> str:
    """An exception as one short line (type and first line of its message) for a log."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


class ControlChannel:
    """The peers of one transport: the listener's accept loops, connect, each peer's reader, the frames sent to
    each peer and the budget of bytes held for the application.

    :param handshake: our side of every handshake (secret, compatibility hash, limits)
    """

    def __init__(self, transport: ChannelTransport[DataPath], handshake: Handshake) -> None:
        self.transport = transport
        self.handshake = handshake
        limits = transport.limits
        self.budget = BufferBudget(per_holder=limits.max_peer_buffered_bytes, total=limits.max_buffered_bytes)
        self.peers: set[ChannelPeer] = set()
        # bounded by max_unaccepted_peers through admit (a full queue refuses the handshake)
        self._accepted_out, self._accepted_in = anyio.create_memory_object_stream[ChannelPeer](
            limits.max_unaccepted_peers
        )
        #: handshakes in progress now
        self.handshakes = 0
        #: incoming connections refused since start
        self.refused = 0
        #: peers dropped for what they sent (malformed frames, failures while serving them)
        self.dropped = 0
        self.accept_errors = 0
        self.messages_sent = 0
        self.messages_received = 0

    # --- our hello ---------------------------------------------------------------------------------------

    def hello(self, proof_address: int) -> Hello:
        """Our hello, with our pid proof for the connection at ``proof_address``."""
        transport = self.transport
        return Hello(
            transport=transport.name,
            instance_id=transport.instance_id,
            address=transport.local_address,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            pid_namespace=pid_namespace(),
            max_message_bytes=transport.max_message_bytes,
            tag_prefix=transport.data_path.tag_prefix,
            regions=transport.own_regions.regions,
            backend=transport.data_path.hello(),
            pid_proof_address=proof_address,
        )

    # --- connecting --------------------------------------------------------------------------------------

    async def connect(self, address: str, deadline: float) -> ChannelPeer:
        """:meth:`~kvferry.transports.Transport.connect`: TCP, TLS if configured, the handshake (which
        authenticates both sides when the transport has a secret) and the data path's set-up, all within
        ``deadline`` seconds; a cancel closes the half-open connection and leaves nothing."""
        transport = self.transport
        _, host, port = parse_address(address)
        stream: ByteStream | None = None
        try:
            with anyio.fail_after(deadline):
                try:
                    stream = await anyio.connect_tcp(host, port)
                except OSError as exc:
                    raise PeerDisconnected(f"nobody listens at {address}: {exc}") from exc
                tune(stream)
                if transport.tls is not None:
                    stream = await TLSStream.wrap(
                        stream, hostname=host, ssl_context=transport.tls.client, standard_compatible=False
                    )
                reader = FrameReader(stream)
                introduction = await self.handshake.connector(stream, reader, self.hello)
                peer = ChannelPeer(transport, stream, introduction)
                transport.data_path.admit(peer)
                await transport.data_path.peer_connected(peer)
        except TimeoutError as exc:
            if stream is not None:
                await close_quietly(stream)
            raise PeerDisconnected(f"no handshake from {address} within {deadline} s") from exc
        except (
            anyio.EndOfStream,
            anyio.IncompleteRead,
            anyio.BrokenResourceError,
            ssl.SSLError,
            OSError,
        ) as exc:
            if stream is not None:
                await close_quietly(stream)
            raise PeerDisconnected(f"{address} closed the connection during the handshake ({exc!r})") from exc
        except BaseException:
            if stream is not None:
                await close_quietly(stream)
            raise
        self.peers.add(peer)
        transport.spawn(self._run_peer, peer, reader)
        return peer

    async def serve(self, listener: MultiListener[SocketStream]) -> None:
        """Accept connections on ``listener`` until it is closed: one loop per socket (address family)."""
        async with anyio.create_task_group() as tg:
            for each in listener.listeners:
                tg.start_soon(self._accept_loop, each)

    async def _accept_loop(self, listener: Listener[SocketStream]) -> None:
        """Accept connections for ever; each is handshaken in a task of its own, and nothing one of them does
        (or an accept that fails: out of descriptors) ends this loop."""
        transport = self.transport
        backoff = _ACCEPT_BACKOFF
        while True:
            try:
                stream: ByteStream = await listener.accept()  # type: ignore[attr-defined]
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return  # closed by aclose()
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED: the listener stays
                self.accept_errors += 1
                log.warning(
                    "%s: accepting a connection failed (%s); retrying in %.2f s",
                    transport.instance_id,
                    exc,
                    backoff,
                )
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, _ACCEPT_BACKOFF_MAX)
                continue
            backoff = _ACCEPT_BACKOFF
            if self.handshakes >= transport.limits.max_pending_handshakes:
                self.refused += 1
                if self.refused & (self.refused - 1) == 0:  # 1st, 2nd, 4th, 8th ...: a flood logs little
                    log.warning(
                        "%s: %d handshakes in progress; closed a connection at once (%d so far)",
                        transport.instance_id,
                        self.handshakes,
                        self.refused,
                    )
                await close_quietly(stream)
                continue
            self.handshakes += 1
            transport.spawn(self._accept_one, stream)

    async def _accept_one(self, stream: ByteStream) -> None:
        """Handshake one incoming connection, then serve it. Whatever goes wrong drops this connection only:
        its socket is closed, what it held is freed, a line is logged and it is counted."""
        try:
            handshaken = await self._handshake_incoming(stream)
        finally:
            self.handshakes -= 1
        if handshaken is not None:
            await self._run_peer(*handshaken)

    async def _handshake_incoming(self, stream: ByteStream) -> tuple[ChannelPeer, FrameReader] | None:
        """The peer and its reader once handshaken and queued for :meth:`accept`; None (stream closed) if not."""
        transport = self.transport
        tune(stream)
        handed_over = False
        peer: ChannelPeer | None = None
        try:
            with anyio.fail_after(transport.connect_timeout):
                if transport.tls is not None:
                    stream = await TLSStream.wrap(
                        stream, server_side=True, ssl_context=transport.tls.server, standard_compatible=False
                    )
                reader = FrameReader(stream)

                async def admit(introduction: Introduction) -> None:
                    nonlocal peer
                    peer = ChannelPeer(transport, stream, introduction)
                    transport.data_path.admit(peer)
                    unaccepted = transport.limits.max_unaccepted_peers
                    if self._accepted_out.statistics().current_buffer_used >= unaccepted:
                        raise PeerIncompatible(f"{unaccepted} peers are waiting to be accepted already")
                    await transport.data_path.peer_connected(peer)

                await self.handshake.acceptor(stream, reader, self.hello, admit)
                assert peer is not None
                self.peers.add(peer)
                self._accepted_out.send_nowait(peer)
                handed_over = True
                return peer, reader
        except (
            Exception
        ) as exc:  # this connection only: whatever it sent, whatever broke while handshaking it
            self.refused += 1
            level = logging.WARNING if isinstance(exc, KvferryError | TimeoutError) else logging.ERROR
            log.log(
                level,
                "%s refused an incoming connection: %s",
                transport.instance_id,
                _one_line(exc),
                exc_info=level == logging.ERROR,
            )
            return None
        finally:
            if not handed_over:
                if peer is not None:
                    with anyio.CancelScope(shield=True):
                        await self._release_refused(peer)
                await close_quietly(stream)

    async def _release_refused(self, peer: ChannelPeer) -> None:
        """Release what the data path set up for a peer whose handshake then failed."""
        try:
            await self.transport.data_path.peer_lost(peer)
        except Exception:
            log.exception("%s: releasing refused peer %s failed", self.transport.instance_id, peer.address)

    async def accept(self) -> ChannelPeer:
        """:meth:`~kvferry.transports.Transport.accept`; a peer that went away before it was accepted is
        skipped."""
        while True:
            try:
                peer = await self._accepted_in.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError) as exc:
                raise ClosedResourceError(f"{self.transport.name} transport was closed") from exc
            if peer.state is PeerState.CONNECTED:
                return peer

    # --- reading -----------------------------------------------------------------------------------------

    async def _run_peer(self, peer: ChannelPeer, reader: FrameReader) -> None:
        """The peer's reader: dispatches frames until the connection ends. Whatever the peer sends or whatever
        breaks while serving it ends this peer only (LOST, with a logged, counted reason)."""
        error: TransportError | None = None
        max_frame = self.transport.limits.max_handshake_bytes
        try:
            while True:
                header = await reader.receive_exactly(FRAME_HEADER.size)
                kind, length = FRAME_HEADER.unpack(header)
                if kind == FrameKind.MESSAGE:
                    await self._message_in(peer, reader, length)
                    continue
                if length > max_frame:
                    raise WireFormatError(f"control frame of {length} bytes")
                body = await reader.receive_exactly(length) if length else b""
                await self._dispatch(peer, kind, body)
        except (
            anyio.EndOfStream,
            anyio.IncompleteRead,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
            ssl.SSLError,
            OSError,
        ):
            error = PeerDisconnected(f"peer {peer.address} disconnected")
        except PeerDisconnected as exc:
            error = exc
        except Exception as exc:  # what it sent (malformed: WireFormatError), or a failure serving it
            self.dropped += 1
            level = logging.WARNING if isinstance(exc, KvferryError) else logging.ERROR
            log.log(
                level,
                "%s dropped peer %s: %s",
                self.transport.instance_id,
                peer.address,
                _one_line(exc),
                exc_info=level == logging.ERROR,
            )
            error = PeerDisconnected(f"dropped {peer.address}: {_one_line(exc)}")
        finally:
            with anyio.CancelScope(shield=True):
                await self.lose(peer, error or PeerDisconnected(f"peer {peer.address} disconnected"))

    async def _message_in(self, peer: ChannelPeer, reader: FrameReader, length: int) -> None:
        """Read one message (or skip one over the limit) and hold it for the application, within the budget."""
        limit = self.transport.max_message_bytes
        if length > limit:
            await discard(reader, length)
            item: bytes | MessageTooLarge = MessageTooLarge(
                f"message of {length} bytes exceeds the limit of {limit}"
            )
            await peer.messages_out.send(item)
            return
        if not self.budget.try_take(peer, length):
            await self.budget.take(peer, length)  # backpressure: this peer's connection is not read meanwhile
        try:
            body = await reader.receive_exactly(length) if length else b""
            self.messages_received += 1
            try:
                peer.messages_out.send_nowait(body)  # no extra turn of the loop when there is room
            except anyio.WouldBlock:
                await peer.messages_out.send(body)
        except BaseException:
            self.budget.give(peer, length)
            raise

    async def _dispatch(self, peer: ChannelPeer, kind: int, body: bytes) -> None:
        if kind == FrameKind.NOTIFY:
            if not self.budget.try_take(peer, len(body)):
                await self.budget.take(peer, len(body))
            try:
                try:
                    peer.notifications_out.send_nowait(body)
                except anyio.WouldBlock:
                    await peer.notifications_out.send(body)
            except BaseException:
                self.budget.give(peer, len(body))
                raise
        elif kind == FrameKind.REGIONS:
            update = wire.decode(body, RegionsUpdate)
            peer.regions = RegionTable(update.regions)
            if update.backend:
                await self.transport.data_path.regions_updated(peer, update.backend)
        elif kind == FrameKind.WRITE_REPLY:
            reply = wire.decode(body, WriteReply)
            waiter = peer.pending.get(reply.write_id)
            if waiter is not None:
                with suppress(anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    waiter.send_nowait(reply)
        elif kind == FrameKind.GOODBYE:
            raise PeerDisconnected(f"peer {peer.address} closed the connection")
        elif kind in (FrameKind.GRANT, FrameKind.REVOKE):
            self.transport.grants.received(peer, kind, body)
        elif kind in (FrameKind.WRITE_REQUEST, FrameKind.WRITE_ABORT):
            await self.transport.data_path.frame(peer, kind, body)
        else:
            raise WireFormatError(f"unexpected frame kind {kind}")

    # --- messages and notifications for the application -------------------------------------------------

    async def send_message(self, p: ChannelPeer, data: bytes) -> None:
        """:meth:`~kvferry.transports.Transport.send_message` to a live peer."""
        if len(data) > p.hello.max_message_bytes:
            raise MessageTooLarge(
                f"message of {len(data)} bytes exceeds the peer's limit of {p.hello.max_message_bytes}"
            )
        await self.send_frame(p, FrameKind.MESSAGE, bytes(data))
        self.messages_sent += 1

    async def receive_message(self, p: ChannelPeer) -> bytes:
        """:meth:`~kvferry.transports.Transport.receive_message`."""
        try:
            try:
                item = p.messages_in.receive_nowait()  # already here: no extra turn of the event loop
            except anyio.WouldBlock:
                item = await p.messages_in.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise p.error from None
        if isinstance(item, MessageTooLarge):
            raise item
        self.budget.give(p, len(item))
        return item

    async def receive_notification(self, p: ChannelPeer) -> bytes:
        """:meth:`~kvferry.transports.Transport.receive_notification`."""
        try:
            try:
                # already here (several writes notified at once): no turn of the event loop, no backend wakeup
                item = p.notifications_in.receive_nowait()
            except anyio.WouldBlock:
                async with self.transport.data_path.waiting():
                    item = await p.notifications_in.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise p.error from None
        self.budget.give(p, len(item))
        return item

    # --- sending -----------------------------------------------------------------------------------------

    async def send_frame(self, peer: ChannelPeer, kind: FrameKind, body: bytes) -> None:
        """Send one frame; a frame cut midway (cancel, error) makes the peer LOST."""
        await self.send_frames(peer, [(kind, body)])

    async def send_frames(self, peer: ChannelPeer, frames: Sequence[Frame]) -> None:
        """Send ``frames`` in order, back to back (small ones in one send); a frame cut midway (cancel, error)
        makes the peer LOST, and which of the frames arrived is then unknown.

        The frames waiting in the peer's outbox (deferred grants, revokes: :meth:`queue`) go first, in the
        same send: whatever is sent after a frame was queued arrives after it.

        :raises ~kvferry.errors.PeerDisconnected: the peer is gone, or the send failed (it is now LOST).
        """
        if peer.state is not PeerState.CONNECTED:
            raise peer.error
        async with peer.send_lock:
            if peer.outbox:
                frames = [*peer.outbox, *frames]
                peer.outbox.clear()
            try:
                with anyio.CancelScope(shield=True), anyio.fail_after(self.transport.stall_timeout):
                    pending = b""
                    for kind, body in frames:
                        header = FRAME_HEADER.pack(kind, len(body))
                        if len(body) <= _SMALL_FRAME:
                            pending += header + body
                            continue
                        await peer.stream.send(pending + header)
                        await peer.stream.send(body)
                        pending = b""
                    if pending:
                        await peer.stream.send(pending)
            except (TimeoutError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                error = PeerDisconnected(f"sending to {peer.address} failed: {exc!r}")
                await self.lose(peer, error)
                raise error from exc

    def queue(self, p: ChannelPeer, frames: Sequence[Frame]) -> None:
        """Send ``frames`` without waiting: they go out ahead of the next frames sent to ``p``
        (:meth:`send_frames`), in the same send, or by ``p``'s flusher right after, whichever comes first."""
        p.outbox.extend(frames)
        if p.wake is None:  # the first: start its flusher (one task for the peer's life, not one per frame)
            p.wake = anyio.Event()
            try:
                self.transport.spawn(self._flusher, p)
            except ClosedResourceError:  # closing: the peer goes with it
                p.wake = None
                return
        p.wake.set()

    async def _flusher(self, p: ChannelPeer) -> None:
        """Send what waits in ``p``'s outbox each time frames were queued, unless a send took them first; ends
        with the peer (:meth:`lose` wakes it)."""
        while p.state is PeerState.CONNECTED and p.wake is not None:
            await p.wake.wait()
            p.wake = anyio.Event()  # frames queued from now on wake it again
            if p.outbox and p.state is PeerState.CONNECTED:
                with suppress(TransportError):  # the peer is gone: what was queued for it went with it
                    await self.send_frames(p, ())

    async def publish_regions(self, blob: bytes) -> None:
        """Tell every peer our registered regions now (``blob``: the data path's metadata for new ones)."""
        update = wire.encode(RegionsUpdate(self.transport.own_regions.regions, blob))
        for peer in list(self.peers):
            with suppress(TransportError):
                await self.send_frame(peer, FrameKind.REGIONS, update)

    # --- losing peers ------------------------------------------------------------------------------------

    async def lose(
        self, peer: ChannelPeer, error: TransportError, *, state: PeerState = PeerState.LOST
    ) -> None:
        """Mark ``peer`` gone, wake everything waiting on it, release what we hold for it. Idempotent."""
        if peer._state is not PeerState.CONNECTED:
            return
        peer._state = state
        peer.error = error
        peer.lost.set()
        if peer.wake is not None:
            peer.wake.set()  # its flusher ends
        with anyio.CancelScope(shield=True):
            for guard in list(peer.guards):
                guard.reason = error
                guard.scope.cancel()
            for scope in peer.incoming.values():
                scope.cancel()
            for waiter in peer.pending.values():
                waiter.close()
            peer.messages_out.close()
            peer.notifications_out.close()
            self.budget.give_all(peer)  # what it left queued is no longer counted (the queues drop with it)
            if state is PeerState.CLOSED:
                with anyio.move_on_after(1.0), suppress(Exception):
                    async with peer.send_lock:
                        await peer.stream.send(frame(FrameKind.GOODBYE, b""))
            await close_quietly(peer.stream)
            try:
                await self.transport.data_path.peer_lost(peer)
            except Exception:
                log.exception("%s: releasing peer %s failed", self.transport.instance_id, peer.address)
            peer.indexed.clear()  # the device tables (a write still in flight holds its own)
            self.peers.discard(peer)

    async def close(self) -> None:
        """Close every peer (shielded) and stop handing out accepted ones."""
        with anyio.CancelScope(shield=True):
            for peer in list(self.peers):
                await self.lose(peer, ClosedResourceError("transport was closed"), state=PeerState.CLOSED)

    def stop_accepting(self) -> None:
        """End :meth:`accept` waits (the transport is closing)."""
        self._accepted_out.close()

    def peer(self, peer: Peer) -> ChannelPeer:
        """``peer`` as a peer of this transport.

        :raises ValueError: it is another transport's.
        """
        if not isinstance(peer, ChannelPeer) or peer.transport is not self.transport:
            raise ValueError(f"{peer!r} is not a peer of this transport")
        return peer

    def __repr__(self) -> str:
        return (
            f"<ControlChannel [{len(self.peers)} peers | {self.handshakes} handshakes | {self.refused} refused, "
            f"{self.dropped} dropped | {self.budget.held} bytes held]>"
        )
