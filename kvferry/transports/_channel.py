"""The part every transport shares: a TCP control channel per peer, the handshake, regions, messages,
notifications, peer loss, and plain copies to peers in the same process.

Each peer has one TCP connection (framed by :data:`~kvferry.transports.FRAME_HEADER`) read by one reader
task. The connection is also how a dead peer is noticed: the kernel closes a killed process's sockets, the reader
sees the end of the stream and every wait involving that peer ends with :class:`~kvferry.errors.PeerDisconnected`.
That is what lets the library data paths (NIXL, UCX) run with their cheaper, hang-prone settings (error handling
off, shared memory) and still fail within a deadline.

Subclasses supply the data path through the ``_backend_*`` hooks.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import anyio
import anyio.streams.stapled
import numpy as np
import numpy.typing as npt
from anyio.abc import ByteStream, SocketAttribute, TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from anyio.streams.tls import TLSStream
from attrs import define

from kvferry import wire
from kvferry.errors import (
    ClosedResourceError,
    ConfigError,
    KvferryError,
    MessageTooLarge,
    NotGranted,
    PeerDisconnected,
    PeerIncompatible,
    RegionError,
    TransferTimeout,
    TransportError,
    WireFormatError,
)
from kvferry.transports import messages
from kvferry.transports._framing import FrameReader, close_quietly, discard, frame, tune
from kvferry.transports._indexed_copy import DeviceDestinations, IndexedCopies
from kvferry.transports._memory import CopyPlan, Grants, RegionTable, TensorRegistration, union_of
from kvferry.transports.base import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Fragments,
    Grant,
    Peer,
    PeerAttribute,
    PeerState,
    Registration,
    Transport,
    TransportAttribute,
    TransportStatistics,
    WriteRows,
    as_fragments,
    joined_rows,
    outcomes_of,
    total_bytes,
    write_rows,
)
from kvferry.transports.handshake import (
    Handshake,
    Introduction,
    TlsConfig,
    check_listen_address,
    pid_namespace,
)
from kvferry.transports.limits import BufferBudget, ChannelLimits
from kvferry.transports.messages import (
    FRAME_HEADER,
    FrameKind,
    Hello,
    RegionsUpdate,
    WriteGrant,
    WriteReply,
    WriteRevoke,
    fragments_bytes,
    fragments_from_bytes,
)

if TYPE_CHECKING:
    import torch

    from kvferry.transports.indexed import IndexedWrite

__all__ = ["ChannelGrant", "ChannelPeer", "ChannelTransport", "CheckedRows", "Guard"]

log = logging.getLogger("kvferry.transports")


class CheckedRows(NamedTuple):
    """A write's rows once checked: every row lies in registered memory (``src_index``: the range of ours
    holding each source row; ``dst_index``: the range of the peer's :attr:`ChannelPeer.regions` holding each
    destination row)."""

    src: Fragments
    dst: Fragments
    src_index: npt.NDArray[np.int64]
    dst_index: npt.NDArray[np.int64]

    @classmethod
    def joined(cls, parts: Sequence[CheckedRows]) -> CheckedRows:
        """Several writes' checked rows as one write's, in order."""
        return cls(*(np.concatenate(column) for column in zip(*parts, strict=True)))


#: the first wait after an accept fails (out of descriptors), doubling up to the second
_ACCEPT_BACKOFF = 0.05
_ACCEPT_BACKOFF_MAX = 1.0


def _one_line(exc: BaseException) -> str:
    """An exception as one short line (type and first line of its message) for a log."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def parse_address(address: str) -> tuple[str, str, int]:
    """``"name://host:port"`` -> (name, host, port)."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or not colon or not port.isdigit():
        raise ValueError(f"not a transport address: {address!r} (expected name://host:port)")
    return scheme, host.strip("[]"), int(port)


@define(eq=False)
class Guard:
    """Bounds one write: cancelled when the peer is lost, or when no progress is reported for ``stall`` seconds."""

    scope: anyio.CancelScope
    stall: float
    reason: BaseException | None = None

    def progress(self) -> None:
        """Record progress: the stall deadline starts again."""
        self.scope.deadline = anyio.current_time() + self.stall


class ChannelPeer(Peer):
    """A peer handle of a :class:`ChannelTransport`."""

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

    def __init__(self, transport: ChannelTransport, stream: ByteStream, introduction: Introduction) -> None:
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
        #: what the backend keeps per peer (NIXL agent name, UCX endpoint)
        self.backend: Any = None
        #: templates of indexed writes to this peer checked for its device path
        self.indexed = IndexedCopies()
        #: what this peer granted us (its GRANT frames): our writes to it must land inside
        self.grants = Grants()
        #: what we granted this peer (:meth:`ChannelTransport.grant`): its writes we receive must land inside
        self.granted = Grants()
        #: frames that go out ahead of the next ones sent (deferred grants, revokes; see
        #: :meth:`ChannelTransport.send_frames`), and what wakes the task that sends them when nothing else does
        #: (None until the first is queued)
        self.outbox: list[tuple[FrameKind, bytes]] = []
        self.wake: anyio.Event | None = None

    @property
    def state(self) -> PeerState:
        return self._state

    @property
    def address(self) -> str:
        return self.hello.address

    async def aclose(self) -> None:
        await self.transport._lose(
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


class ChannelGrant(Grant):
    """A grant of a :class:`ChannelTransport`: one or more wire grants (ids) to one peer."""

    __slots__ = ("_active", "_fragments", "_peer", "frames", "ids", "transport")

    def __init__(
        self,
        transport: ChannelTransport,
        peer: ChannelPeer,
        ids: tuple[int, ...],
        fragments: Fragments,
        frames: Sequence[tuple[FrameKind, bytes]] = (),
    ) -> None:
        self.transport = transport
        self._peer = peer
        self.ids = ids
        self._fragments = fragments
        #: its GRANT frames (the very objects: a deferred grant's may still wait in the peer's outbox)
        self.frames = tuple(frames)
        self._active = True

    @property
    def peer(self) -> Peer:
        return self._peer

    @property
    def fragments(self) -> Fragments:
        return self._fragments

    @property
    def active(self) -> bool:
        return self._active and self._peer.state is PeerState.CONNECTED

    async def revoke(self) -> None:
        if self._active:
            self._active = False
            await self.transport._revoke(self)

    def revoke_nowait(self) -> None:
        if self._active:
            self._active = False
            self.transport._revoke_nowait(self)

    def __repr__(self) -> str:
        state = "active" if self.active else "revoked"
        return f"<Grant to {self._peer.address} [{len(self._fragments)} ranges | {state}]>"


class ChannelTransport(Transport):
    """A transport whose control channel is TCP (framed, handshaken) and whose data path is a backend's.

    :param host: interface to listen on (``"127.0.0.1"`` by default; ``"0.0.0.0"`` for other hosts)
    :param port: port to listen on (0: any free port)
    :param advertise_host: the host put into :attr:`address` (default: ``host``, or the hostname for 0.0.0.0)
    :param compat_hash: compared at the handshake; peers with another hash are refused
    :param max_message_bytes: limit of one incoming control message
    :param connect_timeout: deadline of :meth:`connect` (TCP connect plus handshake)
    :param stall_timeout: default stall deadline of writes
    :param same_process: ``"copy"``: writes to a peer in this process are plain copies (never through the
        library; NIXL inside one process on a GPU runs at 0.4 GB/s); ``"transport"``: use the library anyway
    :param coalesce: merge fragments that are contiguous on both sides before writing, where at least one in
        :data:`~kvferry.transports.base.MERGE_SHARE` is (fewer save less than merging costs)
    :param secret: the secret shared with the peers (see :mod:`~kvferry.transports.handshake`); None: peers are
        not authenticated, which is only allowed when ``host`` is a loopback address
    :param tls: wrap the control connections in TLS (both ways)
    :param limits: caps on what peers may cost (pending handshakes, held bytes; :class:`ChannelLimits`)

    :raises ~kvferry.errors.ConfigError: no secret for a non-loopback ``host``, or contradictory limits.
    """

    _uses_tag_prefix: ClassVar[bool] = False

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        compat_hash: bytes = b"",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        connect_timeout: float = 10.0,
        stall_timeout: float = 30.0,
        same_process: str = "copy",
        coalesce: bool = True,
        secret: bytes | None = None,
        tls: TlsConfig | None = None,
        limits: ChannelLimits | None = None,
    ) -> None:
        if same_process not in ("copy", "transport"):
            raise ValueError("same_process must be 'copy' or 'transport'")
        check_listen_address(host, secret)
        self.limits = limits or ChannelLimits()
        if max_message_bytes > self.limits.max_handshake_bytes << 8:
            raise ConfigError(f"max_message_bytes of {max_message_bytes} is beyond any sane control message")
        self._tls = tls
        self._host = host
        self._port = port
        self._advertise_host = advertise_host
        self._compat_hash = bytes(compat_hash)
        self._max_message_bytes = max_message_bytes
        self._connect_timeout = connect_timeout
        self._stall_timeout = stall_timeout
        self._same_process_copy = same_process == "copy"
        self._coalesce = coalesce
        self.instance_id = f"{self.name}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"
        self.tag_prefix = secrets.randbits(24) if self._uses_tag_prefix else 0
        self._handshake = Handshake(
            name=self.name,
            secret=None if secret is None else bytes(secret),
            compat_hash=self._compat_hash,
            max_bytes=self.limits.max_handshake_bytes,
        )
        self._budget = BufferBudget(
            per_holder=self.limits.max_peer_buffered_bytes, total=self.limits.max_buffered_bytes
        )
        self._handshakes = 0  # in progress now
        self._state = "new"
        self._address = ""
        self._stack = AsyncExitStack()
        self._owner = 0
        self._tg: TaskGroup | None = None
        self._task_scopes: set[anyio.CancelScope] = set()
        self._listener: anyio.streams.stapled.MultiListener[anyio.abc.SocketStream] | None = None
        self._peers: set[ChannelPeer] = set()
        # bounded by max_unaccepted_peers through _unaccepted (a full queue refuses the handshake)
        self._accepted_out, self._accepted_in = anyio.create_memory_object_stream[ChannelPeer](
            self.limits.max_unaccepted_peers
        )
        self._dropped = 0  # peers dropped for what they sent (malformed frames, failures while serving them)
        self._accept_errors = 0
        self._registrations: list[TensorRegistration] = []
        self._own = RegionTable(())
        self._next_write_id = 1
        self._writes_in_flight = 0
        self._writes_completed = 0
        self._writes_combined = 0
        self._writes_indexed = 0
        self._writes_failed = 0
        self._bytes_written = 0
        self._messages_sent = 0
        self._messages_received = 0
        self._refused = 0
        self._next_grant_id = 1
        #: our live grants, per peer (peers lost since are dropped at the next grant)
        self._grants: dict[ChannelPeer, set[ChannelGrant]] = {}
        self._writes_refused = 0
        self._incoming_refused = 0

    # --- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._state != "new":
            raise ClosedResourceError(f"{self.name} transport was already started")
        self._state = "starting"
        self._owner = anyio.get_current_task().id
        try:
            await self._backend_open()
            try:
                self._listener = await anyio.create_tcp_listener(local_host=self._host, local_port=self._port)
            except OSError as exc:
                raise TransportError(f"cannot listen on {self._host}:{self._port}: {exc}") from exc
            self._tg = await self._stack.enter_async_context(anyio.create_task_group())
            self.spawn(self._serve)
            await self._backend_start_tasks()
            local: Any = self._listener.extra(SocketAttribute.local_address)
            port = local[1]
            host = self._advertise_host or (
                socket.gethostname() if self._host in ("0.0.0.0", "::") else self._host
            )
            self._address = f"{self.name}://{host}:{port}"
            self._state = "open"
        except BaseException:
            await self._shutdown()
            raise
        log.debug("%s started at %s", self.instance_id, self._address)

    async def aclose(self) -> None:
        """See :meth:`Transport.aclose`.

        Called from another task than the one that started the transport, it releases everything and cancels
        the background tasks; the task group itself is left by the starting task (its ``async with`` exit or its
        own ``aclose()``), since anyio task groups are exited where they were entered.
        """
        if self._state == "closed" and self._tg is not None and anyio.get_current_task().id == self._owner:
            await self._exit_task_group()
            return
        if self._state in ("closed", "closing"):
            return
        self._state = "closing"
        await self._shutdown()

    async def _shutdown(self) -> None:
        with anyio.CancelScope(shield=True):
            for peer in list(self._peers):
                await self._lose(peer, ClosedResourceError("transport was closed"), state=PeerState.CLOSED)
        # Each background task is cancelled through its own scope: cancelling the task group's scope would also
        # cancel the code of whoever entered it (the body of ``async with transport``).
        for scope in list(self._task_scopes):
            scope.cancel()
        try:
            if anyio.get_current_task().id == self._owner:
                await self._exit_task_group()
        finally:
            with anyio.CancelScope(shield=True):
                await self._release()

    async def _exit_task_group(self) -> None:
        # Outside any other cancel scope: a task group must be exited where it was entered.
        try:
            await self._stack.aclose()
        finally:
            self._tg = None
            if self._listener is not None and self._state == "closed":
                with anyio.CancelScope(shield=True):
                    await self._listener.aclose()
                self._listener = None

    async def _release(self) -> None:
        if self._listener is not None and self._tg is None:
            await self._listener.aclose()
            self._listener = None
        self._accepted_out.close()
        for registration in self._registrations:
            with suppress(Exception):
                await self._backend_deregister(registration)
            registration.deactivate()
        self._registrations.clear()
        self._own = RegionTable(())
        await self._backend_close()
        self._state = "closed"

    def spawn(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``function(*args)`` in the transport's task group, under a scope that aclose() cancels."""
        if self._tg is None:
            raise ClosedResourceError(f"{self.name} transport is {self._state}")
        self._tg.start_soon(self._scoped, function, args, name=getattr(function, "__qualname__", None))

    async def _scoped(self, function: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        with anyio.CancelScope() as scope:
            if self._state in ("closing", "closed"):
                # started after aclose() cancelled the scopes it knew of (a close right after start): end now,
                # or the task group would wait for it forever
                scope.cancel()
            self._task_scopes.add(scope)
            try:
                await function(*args)
            finally:
                self._task_scopes.discard(scope)

    def _check_open(self) -> None:
        if self._state != "open":
            raise ClosedResourceError(f"{self.name} transport is {self._state}, not open")

    @property
    def address(self) -> str:
        self._check_open()
        return self._address

    # --- connections -------------------------------------------------------------------------------------

    def _hello(self, proof_address: int) -> Hello:
        return Hello(
            transport=self.name,
            instance_id=self.instance_id,
            address=self._address,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            pid_namespace=pid_namespace(),
            max_message_bytes=self._max_message_bytes,
            tag_prefix=self.tag_prefix,
            regions=self._own.regions,
            backend=self._backend_hello(),
            pid_proof_address=proof_address,
        )

    async def connect(self, address: str, *, timeout: float | None = None) -> Peer:  # noqa: ASYNC109
        """See :meth:`Transport.connect`. The handshake authenticates both sides when this transport has a secret
        (:mod:`~kvferry.transports.handshake`); a cancel closes the half-open connection and leaves nothing."""
        self._check_open()
        _, host, port = parse_address(address)
        deadline = self._connect_timeout if timeout is None else timeout
        stream: ByteStream | None = None
        try:
            with anyio.fail_after(deadline):
                try:
                    stream = await anyio.connect_tcp(host, port)
                except OSError as exc:
                    raise PeerDisconnected(f"nobody listens at {address}: {exc}") from exc
                tune(stream)
                if self._tls is not None:
                    stream = await TLSStream.wrap(
                        stream, hostname=host, ssl_context=self._tls.client, standard_compatible=False
                    )
                reader = FrameReader(stream)
                introduction = await self._handshake.connector(stream, reader, self._hello)
                peer = ChannelPeer(self, stream, introduction)
                self._check_peer_allowed(peer)
                await self._backend_peer_connected(peer)
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
        self._peers.add(peer)
        self.spawn(self._run_peer, peer, reader)
        return peer

    def _check_peer_allowed(self, peer: ChannelPeer) -> None:
        """Subclasses refuse peers they cannot reach (local: other processes)."""

    async def _serve(self) -> None:
        assert self._listener is not None
        async with anyio.create_task_group() as tg:
            for listener in self._listener.listeners:
                tg.start_soon(self._accept_loop, listener)  # one socket per address family

    async def _accept_loop(self, listener: anyio.abc.Listener[anyio.abc.SocketStream]) -> None:
        """Accept connections for ever; each is handshaken in a task of its own, and nothing one of them does
        (or an accept that fails: out of descriptors) ends this loop."""
        backoff = _ACCEPT_BACKOFF
        while True:
            try:
                stream: ByteStream = await listener.accept()  # type: ignore[attr-defined]
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return  # closed by aclose()
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED: the listener stays
                self._accept_errors += 1
                log.warning(
                    "%s: accepting a connection failed (%s); retrying in %.2f s",
                    self.instance_id,
                    exc,
                    backoff,
                )
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, _ACCEPT_BACKOFF_MAX)
                continue
            backoff = _ACCEPT_BACKOFF
            if self._handshakes >= self.limits.max_pending_handshakes:
                self._refused += 1
                if self._refused & (self._refused - 1) == 0:  # 1st, 2nd, 4th, 8th ...: a flood logs little
                    log.warning(
                        "%s: %d handshakes in progress; closed a connection at once (%d so far)",
                        self.instance_id,
                        self._handshakes,
                        self._refused,
                    )
                await close_quietly(stream)
                continue
            self._handshakes += 1
            self.spawn(self._accept_one, stream)

    async def _accept_one(self, stream: ByteStream) -> None:
        """Handshake one incoming connection, then serve it. Whatever goes wrong drops this connection only:
        its socket is closed, what it held is freed, a line is logged and it is counted."""
        try:
            handshaken = await self._handshake_incoming(stream)
        finally:
            self._handshakes -= 1
        if handshaken is not None:
            await self._run_peer(*handshaken)

    async def _handshake_incoming(self, stream: ByteStream) -> tuple[ChannelPeer, FrameReader] | None:
        """The peer and its reader once handshaken and queued for :meth:`accept`; None (stream closed) if not."""
        tune(stream)
        handed_over = False
        peer: ChannelPeer | None = None
        try:
            with anyio.fail_after(self._connect_timeout):
                if self._tls is not None:
                    stream = await TLSStream.wrap(
                        stream, server_side=True, ssl_context=self._tls.server, standard_compatible=False
                    )
                reader = FrameReader(stream)

                async def admit(introduction: Introduction) -> None:
                    nonlocal peer
                    peer = ChannelPeer(self, stream, introduction)
                    self._check_peer_allowed(peer)
                    if (
                        self._accepted_out.statistics().current_buffer_used
                        >= self.limits.max_unaccepted_peers
                    ):
                        raise PeerIncompatible(
                            f"{self.limits.max_unaccepted_peers} peers are waiting to be accepted already"
                        )
                    await self._backend_peer_connected(peer)

                await self._handshake.acceptor(stream, reader, self._hello, admit)
                assert peer is not None
                self._peers.add(peer)
                self._accepted_out.send_nowait(peer)
                handed_over = True
                return peer, reader
        except (
            Exception
        ) as exc:  # this connection only: whatever it sent, whatever broke while handshaking it
            self._refused += 1
            level = logging.WARNING if isinstance(exc, KvferryError | TimeoutError) else logging.ERROR
            log.log(
                level,
                "%s refused an incoming connection: %s",
                self.instance_id,
                _one_line(exc),
                exc_info=level == logging.ERROR,
            )
            return None
        finally:
            if not handed_over:
                if peer is not None:
                    with anyio.CancelScope(shield=True):
                        await self._backend_release_unaccepted(peer)
                await close_quietly(stream)

    async def _backend_release_unaccepted(self, peer: ChannelPeer) -> None:
        """Release what the backend set up for a peer whose handshake then failed."""
        try:
            await self._backend_peer_lost(peer)
        except Exception:
            log.exception("%s: releasing refused peer %s failed", self.instance_id, peer.address)

    async def accept(self) -> Peer:
        """See :meth:`Transport.accept`; a peer that went away before it was accepted is skipped."""
        self._check_open()
        while True:
            try:
                peer = await self._accepted_in.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError) as exc:
                raise ClosedResourceError(f"{self.name} transport was closed") from exc
            if peer.state is PeerState.CONNECTED:
                return peer

    async def _run_peer(self, peer: ChannelPeer, reader: FrameReader) -> None:
        """The peer's reader: dispatches frames until the connection ends. Whatever the peer sends or whatever
        breaks while serving it ends this peer only (LOST, with a logged, counted reason)."""
        error: TransportError | None = None
        try:
            while True:
                header = await reader.receive_exactly(FRAME_HEADER.size)
                kind, length = FRAME_HEADER.unpack(header)
                if kind == FrameKind.MESSAGE:
                    await self._message_in(peer, reader, length)
                    continue
                if length > self.limits.max_handshake_bytes:
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
            self._dropped += 1
            level = logging.WARNING if isinstance(exc, KvferryError) else logging.ERROR
            log.log(
                level,
                "%s dropped peer %s: %s",
                self.instance_id,
                peer.address,
                _one_line(exc),
                exc_info=level == logging.ERROR,
            )
            error = PeerDisconnected(f"dropped {peer.address}: {_one_line(exc)}")
        finally:
            with anyio.CancelScope(shield=True):
                await self._lose(peer, error or PeerDisconnected(f"peer {peer.address} disconnected"))

    async def _message_in(self, peer: ChannelPeer, reader: FrameReader, length: int) -> None:
        """Read one message (or skip one over the limit) and hold it for the application, within the budget."""
        if length > self._max_message_bytes:
            await discard(reader, length)
            item: bytes | MessageTooLarge = MessageTooLarge(
                f"message of {length} bytes exceeds the limit of {self._max_message_bytes}"
            )
            await peer.messages_out.send(item)
            return
        if not self._budget.try_take(peer, length):
            await self._budget.take(
                peer, length
            )  # backpressure: this peer's connection is not read meanwhile
        try:
            body = await reader.receive_exactly(length) if length else b""
            self._messages_received += 1
            try:
                peer.messages_out.send_nowait(body)  # no extra turn of the loop when there is room
            except anyio.WouldBlock:
                await peer.messages_out.send(body)
        except BaseException:
            self._budget.give(peer, length)
            raise

    async def _dispatch(self, peer: ChannelPeer, kind: int, body: bytes) -> None:
        if kind == FrameKind.NOTIFY:
            if not self._budget.try_take(peer, len(body)):
                await self._budget.take(peer, len(body))
            try:
                try:
                    peer.notifications_out.send_nowait(body)
                except anyio.WouldBlock:
                    await peer.notifications_out.send(body)
            except BaseException:
                self._budget.give(peer, len(body))
                raise
        elif kind == FrameKind.REGIONS:
            update = wire.decode(body, RegionsUpdate)
            peer.regions = RegionTable(update.regions)
            if update.backend:
                await self._backend_regions_updated(peer, update.backend)
        elif kind == FrameKind.WRITE_REPLY:
            reply = wire.decode(body, WriteReply)
            waiter = peer.pending.get(reply.write_id)
            if waiter is not None:
                with suppress(anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    waiter.send_nowait(reply)
        elif kind == FrameKind.GOODBYE:
            raise PeerDisconnected(f"peer {peer.address} closed the connection")
        elif kind in (FrameKind.GRANT, FrameKind.REVOKE):
            self._granted_to_us(peer, kind, body)
        elif kind in (FrameKind.WRITE_REQUEST, FrameKind.WRITE_ABORT):
            await self._backend_frame(peer, kind, body)
        else:
            raise WireFormatError(f"unexpected frame kind {kind}")

    async def _lose(
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
            self._budget.give_all(peer)  # what it left queued is no longer counted (the queues drop with it)
            if state is PeerState.CLOSED:
                with anyio.move_on_after(1.0), suppress(Exception):
                    async with peer.send_lock:
                        await peer.stream.send(frame(FrameKind.GOODBYE, b""))
            await close_quietly(peer.stream)
            try:
                await self._backend_peer_lost(peer)
            except Exception:
                log.exception("%s: releasing peer %s failed", self.instance_id, peer.address)
            peer.indexed.clear()  # the device tables (a write still in flight holds its own)
            self._peers.discard(peer)

    def _peer(self, peer: Peer) -> ChannelPeer:
        if not isinstance(peer, ChannelPeer) or peer.transport is not self:
            raise ValueError(f"{peer!r} is not a peer of this transport")
        return peer

    def _live_peer(self, peer: Peer) -> ChannelPeer:
        self._check_open()
        p = self._peer(peer)
        if p.state is not PeerState.CONNECTED:
            raise p.error
        return p

    async def send_frame(self, peer: ChannelPeer, kind: FrameKind, body: bytes) -> None:
        """Send one frame; a frame cut midway (cancel, error) makes the peer LOST."""
        await self.send_frames(peer, [(kind, body)])

    async def send_frames(self, peer: ChannelPeer, frames: Sequence[tuple[FrameKind, bytes]]) -> None:
        """Send ``frames`` in order, back to back (small ones in one send); a frame cut midway (cancel, error)
        makes the peer LOST, and which of the frames arrived is then unknown.

        The frames waiting in the peer's outbox (deferred grants, revokes: :meth:`_queue`) go first, in the
        same send: whatever is sent after a frame was queued arrives after it."""
        if peer.state is not PeerState.CONNECTED:
            raise peer.error
        async with peer.send_lock:
            if peer.outbox:
                frames = [*peer.outbox, *frames]
                peer.outbox.clear()
            try:
                with anyio.CancelScope(shield=True), anyio.fail_after(self._stall_timeout):
                    pending = b""
                    for kind, body in frames:
                        header = FRAME_HEADER.pack(kind, len(body))
                        if len(body) <= 1 << 16:  # one send (one segment, one wakeup) for the small frames
                            pending += header + body
                            continue
                        await peer.stream.send(pending + header)
                        await peer.stream.send(body)
                        pending = b""
                    if pending:
                        await peer.stream.send(pending)
            except (TimeoutError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                error = PeerDisconnected(f"sending to {peer.address} failed: {exc!r}")
                await self._lose(peer, error)
                raise error from exc

    # --- messages and notifications ------------------------------------------------------------------

    async def send_message(self, peer: Peer, data: bytes) -> None:
        p = self._live_peer(peer)
        if len(data) > p.hello.max_message_bytes:
            raise MessageTooLarge(
                f"message of {len(data)} bytes exceeds the peer's limit of {p.hello.max_message_bytes}"
            )
        await self.send_frame(p, FrameKind.MESSAGE, bytes(data))
        self._messages_sent += 1

    async def receive_message(self, peer: Peer) -> bytes:
        self._check_open()
        p = self._peer(peer)
        try:
            try:
                item = p.messages_in.receive_nowait()  # already here: no extra turn of the event loop
            except anyio.WouldBlock:
                item = await p.messages_in.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise p.error from None
        if isinstance(item, MessageTooLarge):
            raise item
        self._budget.give(p, len(item))
        return item

    async def receive_notification(self, peer: Peer) -> bytes:
        self._check_open()
        p = self._peer(peer)
        try:
            try:
                # already here (several writes notified at once): no turn of the event loop, no backend wakeup
                item = p.notifications_in.receive_nowait()
            except anyio.WouldBlock:
                async with self._backend_waiting():
                    item = await p.notifications_in.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise p.error from None
        self._budget.give(p, len(item))
        return item

    # --- registration --------------------------------------------------------------------------------

    async def register(self, regions: torch.Tensor | Sequence[torch.Tensor]) -> Registration:
        self._check_open()
        tensors = [regions] if not isinstance(regions, Sequence) else list(regions)
        registration = TensorRegistration(tensors)
        for info in registration.infos:
            if info.device != "cpu" and not self.capabilities.device_memory:
                raise ValueError(f"{self.name} transport cannot register device memory ({info.device})")
        blob = await self._backend_register(registration)
        self._registrations.append(registration)
        self._own = RegionTable([i for r in self._registrations for i in r.infos])
        await self._publish_regions(blob)
        return registration

    async def deregister(self, registration: Registration) -> None:
        if not isinstance(registration, TensorRegistration) or registration not in self._registrations:
            return
        with anyio.CancelScope(shield=True):
            self._registrations.remove(registration)
            self._own = RegionTable([i for r in self._registrations for i in r.infos])
            registration.deactivate()
            if self._state == "open":
                await self._publish_regions(b"")
                await self._revoke_unregistered()
            await self._backend_deregister(registration)

    async def _publish_regions(self, blob: bytes) -> None:
        update = wire.encode(RegionsUpdate(self._own.regions, blob))
        for peer in list(self._peers):
            with suppress(TransportError):
                await self.send_frame(peer, FrameKind.REGIONS, update)

    # --- grants --------------------------------------------------------------------------------------

    async def grant(
        self, peer: Peer, fragments: npt.ArrayLike | Registration, *, defer: bool = False
    ) -> Grant:
        p = self._live_peer(peer)
        if isinstance(fragments, Registration):
            if not fragments.active:
                raise RegionError("cannot grant a deregistered registration")
            rows = fragments.fragments()
        else:
            rows = as_fragments(fragments)
        # what travels (and what is checked) is the union: rows that overlap or touch merged, in address order
        merged = union_of(rows)
        what = f"memory granted to {p.address}"
        try:  # the merged ranges first (fewer rows)
            self._own.locate(merged, what)
        except RegionError:  # names the first row outside; or each lies in a region, a merged one across two
            self._own.locate(rows, what)
        step = messages.MAX_GRANT_FRAGMENTS
        pieces = [merged[i : i + step] for i in range(0, len(merged), step)] or [merged]
        if len(p.granted) + len(pieces) > messages.MAX_LIVE_GRANTS:
            raise TransportError(
                f"{p.address} holds {len(p.granted)} grants from us, at most {messages.MAX_LIVE_GRANTS} may be "
                "live: revoke some first"
            )
        ids = tuple(range(self._next_grant_id, self._next_grant_id + len(pieces)))
        self._next_grant_id += len(pieces)
        # ours first: a two-sided receiver checks the peer's writes against these, and the peer may write as
        # soon as the frame is out
        for grant_id, piece in zip(ids, pieces, strict=True):
            p.granted.add(grant_id, piece)
        frames = [
            (FrameKind.GRANT, wire.encode(WriteGrant(i, fragments_bytes(piece))))
            for i, piece in zip(ids, pieces, strict=True)
        ]
        if defer:  # ahead of the next frame we send the peer (the caller's message), or by a task right after
            self._queue(p, frames)
        else:
            try:
                # whole or not at all: a cancel waiting for the channel sends nothing, a frame cut midway loses
                # the peer
                await self.send_frames(p, frames)
            except BaseException:
                for grant_id in ids:
                    p.granted.remove(grant_id)
                raise
        grant = ChannelGrant(self, p, ids, rows, frames)
        for other in [q for q in self._grants if q.state is not PeerState.CONNECTED]:
            del self._grants[other]
        self._grants.setdefault(p, set()).add(grant)
        return grant

    def _forget(self, grant: ChannelGrant) -> bool:
        """Drop ``grant`` on our side (our checks refuse from now on); True when its peer is to be told."""
        p = grant._peer
        self._grants.get(p, set()).discard(grant)
        for grant_id in grant.ids:
            p.granted.remove(grant_id)
        self._backend_revoked(p)
        return p.state is PeerState.CONNECTED and self._state == "open"

    def _revoke_frames(self, grant: ChannelGrant) -> list[tuple[FrameKind, bytes]]:
        return [(FrameKind.REVOKE, wire.encode(WriteRevoke(i))) for i in grant.ids]

    async def _revoke(self, grant: ChannelGrant) -> None:
        with anyio.CancelScope(shield=True):
            if self._forget(grant) and not self._withdraw(grant):
                with suppress(TransportError):  # the peer is gone: its grants went with it
                    await self.send_frames(grant._peer, self._revoke_frames(grant))

    def _revoke_nowait(self, grant: ChannelGrant) -> None:
        if self._forget(grant) and not self._withdraw(grant):
            self._queue(grant._peer, self._revoke_frames(grant))

    def _withdraw(self, grant: ChannelGrant) -> bool:
        """Take a deferred grant's GRANT frames back out of its peer's outbox if they still wait there (the peer
        never learns of the grant: nothing to revoke); True if they did."""
        outbox = grant._peer.outbox
        if not grant.frames or not any(f is grant.frames[0] for f in outbox):
            return False  # sent (frames leave the outbox all at once, under the send lock)
        mine = {id(f) for f in grant.frames}
        outbox[:] = [f for f in outbox if id(f) not in mine]
        return True

    def _queue(self, p: ChannelPeer, frames: Sequence[tuple[FrameKind, bytes]]) -> None:
        """Send ``frames`` without waiting: they go out ahead of the next frames sent to ``p``
        (:meth:`send_frames`), in the same send, or by ``p``'s flusher right after, whichever comes first."""
        p.outbox.extend(frames)
        if p.wake is None:  # the first: start its flusher (one task for the peer's life, not one per frame)
            p.wake = anyio.Event()
            try:
                self.spawn(self._flusher, p)
            except ClosedResourceError:  # closing: the peer goes with it
                p.wake = None
                return
        p.wake.set()

    async def _flusher(self, p: ChannelPeer) -> None:
        """Send what waits in ``p``'s outbox each time frames were queued, unless a send took them first; ends
        with the peer (:meth:`_lose` wakes it)."""
        while p.state is PeerState.CONNECTED and p.wake is not None:
            await p.wake.wait()
            p.wake = anyio.Event()  # frames queued from now on wake it again
            if p.outbox and p.state is PeerState.CONNECTED:
                with suppress(TransportError):  # the peer is gone: what was queued for it went with it
                    await self.send_frames(p, ())

    async def _revoke_unregistered(self) -> None:
        """Revoke our grants that are no longer inside registered memory (a registration at the same addresses
        later must not revive them)."""
        for grants in list(self._grants.values()):
            for grant in list(grants):
                rows = grant.fragments
                if len(rows) and int(self._own.holding(rows).min()) < 0:
                    log.debug("%s: revoking %r: its memory was deregistered", self.instance_id, grant)
                    await grant.revoke()

    def _granted_to_us(self, peer: ChannelPeer, kind: int, body: bytes) -> None:
        """A GRANT or REVOKE frame of ``peer``: what our writes to it may write into."""
        if kind == FrameKind.GRANT:
            grant = wire.decode(body, WriteGrant)
            rows = fragments_from_bytes(grant.fragments)
            if grant.grant_id in peer.grants:
                raise WireFormatError(f"{peer.address} reused grant id {grant.grant_id}")
            if len(peer.grants) >= messages.MAX_LIVE_GRANTS:
                raise WireFormatError(
                    f"{peer.address} holds more than {messages.MAX_LIVE_GRANTS} live grants"
                )
            peer.grants.add(grant.grant_id, rows)
            return
        revoke = wire.decode(body, WriteRevoke)
        if not peer.grants.remove(revoke.grant_id):
            raise WireFormatError(f"{peer.address} revoked grant {revoke.grant_id}, which is not live")

    def _count_refused(self, p: ChannelPeer, exc: NotGranted) -> None:
        """Count and log a write of ours refused for a destination outside ``p``'s grants."""
        self._writes_refused += 1
        log.warning("%s: refused a write to %s: %s", self.instance_id, p.address, exc)

    def count_incoming_refused(self, p: ChannelPeer, exc: NotGranted) -> None:
        """Count and log a write of ``p``'s into our memory refused (two-sided receivers)."""
        self._incoming_refused += 1
        log.warning("%s: refused a write from %s: %s", self.instance_id, p.address, exc)

    # --- writes --------------------------------------------------------------------------------------

    def new_write_id(self) -> int:
        write_id = self._next_write_id
        self._next_write_id += 1
        return write_id

    @asynccontextmanager
    async def guard(self, peer: ChannelPeer, stall: float) -> AsyncIterator[Guard]:
        """Run the body until done, the peer is lost (its error is raised) or it stalls (TransferTimeout)."""
        if peer.state is not PeerState.CONNECTED:
            raise peer.error
        with anyio.CancelScope(deadline=anyio.current_time() + stall) as scope:
            guard = Guard(scope, stall)
            peer.guards.add(guard)
            try:
                yield guard
            finally:
                peer.guards.discard(guard)
        if scope.cancelled_caught:
            if guard.reason is not None:
                raise guard.reason
            raise TransferTimeout(f"write to {peer.address} made no progress for {stall} s")

    async def write(
        self,
        peer: Peer,
        src: npt.ArrayLike,
        dst: npt.ArrayLike,
        notify: bytes | None = None,
        *,
        stall_timeout: float | None = None,
    ) -> None:
        p = self._live_peer(peer)
        try:
            checked = self._checked(p, write_rows(src, dst, merge=self._coalesce))
        except NotGranted as exc:
            self._count_refused(p, exc)
            raise
        await self._write_checked(p, checked, notify, self._stall(stall_timeout))

    async def write_many(
        self,
        peer: Peer,
        writes: Sequence[tuple[npt.ArrayLike, npt.ArrayLike, bytes | None]],
        *,
        stall_timeout: float | None = None,
    ) -> list[Exception | None]:
        """As :meth:`Transport.write_many`: every write is checked on its own (a refused one is left out); the
        rest move together, as one write and then their notifications in order, when this transport copies
        them itself (same process) or the backend can (:meth:`_backend_write_together`: nixl's CUDA IPC
        mapping); else each is written on its own, concurrently."""
        outcomes: list[Exception | None] = [None] * len(writes)
        try:
            p = self._live_peer(peer)
        except Exception as exc:  # the same error for every write
            return [exc] * len(writes)
        stall = self._stall(stall_timeout)
        together = len(writes) > 1 and self._may_write_together(p)
        if together:
            # all of them checked as one write first (one pass over the rows, not one per write): when every
            # row is fine, so is every write on its own
            try:
                rows, sizes = joined_rows(writes, merge=self._coalesce)
                joined = self._checked(p, rows)
            except (RegionError, ValueError):
                pass  # one of them is refused: each is checked on its own below
            else:
                parts = [(i, sizes[i], notify) for i, (_, _, notify) in enumerate(writes)]
                if await self._write_together(
                    p, partial(self._move_together, p, joined, stall), parts, outcomes
                ):
                    return outcomes
                together = False  # the backend cannot move these together
        checked: list[tuple[int, CheckedRows, bytes | None]] = []
        for i, (src, dst, notify) in enumerate(writes):
            try:
                checked.append((i, self._checked(p, write_rows(src, dst, merge=self._coalesce)), notify))
            except (RegionError, ValueError) as exc:
                if isinstance(exc, NotGranted):
                    self._count_refused(p, exc)
                outcomes[i] = exc
        if together and len(checked) > 1:
            joined = CheckedRows.joined([c for _, c, _ in checked])
            parts = [(i, total_bytes(c.src), notify) for i, c, notify in checked]
            if await self._write_together(p, partial(self._move_together, p, joined, stall), parts, outcomes):
                return outcomes
        alone = await outcomes_of(
            [partial(self._write_checked, p, c, notify, stall) for _, c, notify in checked]
        )
        for (i, _, _), outcome in zip(checked, alone, strict=True):
            outcomes[i] = outcome
        return outcomes

    def _may_write_together(self, p: ChannelPeer) -> bool:
        """Several writes to ``p`` may move as one (:meth:`_write_together` may still decline)."""
        return self._copies_itself(p) or self._backend_may_write_together(p)

    def _stall(self, stall_timeout: float | None) -> float:
        return self._stall_timeout if stall_timeout is None else stall_timeout

    def _copies_itself(self, p: ChannelPeer) -> bool:
        """Writes to ``p`` are copies in this process (not through the backend)."""
        return p.same_process and (self._same_process_copy or not self.capabilities.cross_process)

    async def _copy_here(self, p: ChannelPeer, rows: CheckedRows, stall: float) -> None:
        """Copy checked rows in this process (a same-process peer), under the stall guard."""
        async with self.guard(p, stall):
            plan = CopyPlan(
                rows.src, self._own, rows.dst, p.regions, src_index=rows.src_index, dst_index=rows.dst_index
            )
            await plan.run(poll=self.writes_in_flight == 1)

    async def _write_checked(
        self, p: ChannelPeer, rows: CheckedRows, notify: bytes | None, stall: float
    ) -> None:
        self._writes_in_flight += 1
        try:
            if self._copies_itself(p):
                await self._copy_here(p, rows, stall)
                if notify is not None:
                    await self.send_frame(p, FrameKind.NOTIFY, notify)
            else:
                await self._backend_write(p, rows, notify, stall)
        except NotGranted as exc:  # a two-sided receiver refused it: nothing was written
            self._count_refused(p, exc)
            raise
        except BaseException:
            self._writes_failed += 1
            raise
        finally:
            self._writes_in_flight -= 1
        self._writes_completed += 1
        self._bytes_written += total_bytes(rows.src)

    async def _move_together(self, p: ChannelPeer, combined: CheckedRows, stall: float) -> bool:
        """Copy several writes' checked rows as one; False (nothing written) when the backend cannot."""
        if self._copies_itself(p):
            await self._copy_here(p, combined, stall)
            return True
        return await self._backend_write_together(p, combined, stall)

    async def _write_together(
        self,
        p: ChannelPeer,
        move: Callable[[], Awaitable[bool]],
        parts: Sequence[tuple[int, int, bytes | None]],
        outcomes: list[Exception | None],
    ) -> bool:
        """Move the bytes of several writes at once (``move``; ``parts``: each one's index, bytes and
        notification), then send their notifications in order, filling ``outcomes``; False (nothing written)
        when ``move`` cannot write them together."""
        self._writes_in_flight += 1
        try:
            if not await move():
                return False
        except Exception as exc:  # the writes failed together
            self._writes_failed += len(parts)
            for i, _, _ in parts:
                outcomes[i] = exc
            return True
        except BaseException:
            self._writes_failed += len(parts)
            raise
        finally:
            self._writes_in_flight -= 1
        # every byte of every part landed: now the notifications, in order, in one send
        try:
            await self.send_frames(
                p, [(FrameKind.NOTIFY, notify) for _, _, notify in parts if notify is not None]
            )
        except Exception as exc:  # the peer is lost: which notifications arrived is unknown
            failed: Exception | None = exc
        else:
            failed = None
        for i, nbytes, notify in parts:
            if failed is not None and notify is not None:
                outcomes[i] = failed
                self._writes_failed += 1
                continue
            self._writes_completed += 1
            self._writes_combined += 1
            self._bytes_written += nbytes
        return True

    async def write_indexed(
        self,
        peer: Peer,
        writes: Sequence[IndexedWrite],
        *,
        stall_timeout: float | None = None,
    ) -> list[Exception | None]:
        """As :meth:`Transport.write_indexed`. Where this transport copies device memory to ``peer`` itself (a
        peer of this process; nixl's CUDA IPC mapping), each template is checked against both sides' registered
        memory once (:class:`~kvferry.transports._indexed_copy.IndexedCopies`), the writes' ids every time, and
        the writes move as one indexed device copy (one launch, one wait), then their notifications in order.
        Anything else (host memory, templates over several devices) goes as plain fragments."""
        try:
            p = self._live_peer(peer)
        except Exception as exc:  # the same error for every write
            return [exc] * len(writes)
        destinations = self._device_destinations(p) if writes else None
        if destinations is None:
            return await super().write_indexed(peer, writes, stall_timeout=stall_timeout)
        outcomes: list[Exception | None] = [None] * len(writes)
        on_device: list[tuple[int, Any]] = []
        plain: list[int] = []
        for i, w in enumerate(writes):
            try:
                template = p.indexed.template(w.rows, self._own, p.regions, destinations, p.address)
                if template is not None:
                    # the template lies in registered memory; the rows these ids name must lie in the grants
                    w.check()
                    self._check_granted(p, w.rows.destination_runs(w.dst_ids))
            except RegionError as exc:  # refused before anything is written
                if isinstance(exc, NotGranted):
                    self._count_refused(p, exc)
                outcomes[i] = exc
                continue
            if template is None or (on_device and template.device != on_device[0][1].device):
                plain.append(i)
            else:
                on_device.append((i, template))
        if on_device:
            prepared: tuple[Any, Any] | None
            try:
                prepared = p.indexed.prepare([writes[i] for i, _ in on_device], [t for _, t in on_device])
            except RegionError:  # an id outside its limit: each write on its own says which
                good = []
                for i, template in on_device:
                    try:
                        writes[i].check()
                    except RegionError as exc:
                        outcomes[i] = exc
                    else:
                        good.append((i, template))
                on_device = good
                prepared = (
                    p.indexed.prepare([writes[i] for i, _ in good], [t for _, t in good]) if good else None
                )
            if prepared is not None:
                move = partial(self._indexed_here, p, len(on_device), *prepared, self._stall(stall_timeout))
                parts = [(i, writes[i].nbytes, writes[i].notify) for i, _ in on_device]
                if not await self._write_together(p, move, parts, outcomes):
                    plain += [i for i, _ in on_device]  # no kernel: as plain fragments
        if plain:
            plain.sort()
            done = await super().write_indexed(peer, [writes[i] for i in plain], stall_timeout=stall_timeout)
            for i, outcome in zip(plain, done, strict=True):
                outcomes[i] = outcome
        return outcomes

    async def _indexed_here(self, p: ChannelPeer, count: int, launch: Any, ids: Any, stall: float) -> bool:
        async with self.guard(p, stall):
            moved = await p.indexed.copy(launch, ids, poll=self.writes_in_flight == 1)
        if moved:
            self._writes_indexed += count
        return moved

    def _device_destinations(self, p: ChannelPeer) -> DeviceDestinations | None:
        """Where ``p``'s registered regions lie in this process for a device copy, or None (no device path)."""
        if self._copies_itself(p):
            return DeviceDestinations.same_process(p.regions)
        return self._backend_device_destinations(p)

    def _checked(self, p: ChannelPeer, rows: WriteRows) -> CheckedRows:
        """The rows to write (merged if they merge) and the registered ranges (of ours, of the peer's) that hold
        each, once every row is known to lie in registered memory, and every destination row in what the peer
        granted us (else :class:`~kvferry.errors.NotGranted`, a RegionError).

        Merged rows are checked first (fewer rows: a merged row inside one registered range holds every row it
        merged); only when one is not, the rows as given are checked, which names the first bad one, or, when
        each lies in a range but a merged one spans two adjacent ranges, are written unmerged.
        """
        src, dst = rows.src, rows.dst
        # where write_rows saw the rows lie (many rows; the same bytes merged or not)
        b = rows.bounds
        src_bounds, dst_bounds = (None, None) if b is None else ((b[0], b[1]), (b[2], b[3]))
        if rows.merged_src is not None and rows.merged_dst is not None:
            try:
                src_index = self._own.locate(rows.merged_src, "source", src_bounds)
                dst_index = p.regions.locate(rows.merged_dst, f"destination at {p.address}", dst_bounds)
            except RegionError:
                pass
            else:
                # merged rows are unions of rows as given: inside the grants' union iff those are
                self._check_granted(p, rows.merged_dst, dst_bounds)
                return CheckedRows(rows.merged_src, rows.merged_dst, src_index, dst_index)
            # the wrap-around check ran on the merged rows: the rows as given get it row by row now
            src, dst = as_fragments(src), as_fragments(dst)
        src_index = self._own.locate(src, "source", src_bounds)
        dst_index = p.regions.locate(dst, f"destination at {p.address}", dst_bounds)
        self._check_granted(p, dst, dst_bounds)
        return CheckedRows(src, dst, src_index, dst_index)

    def _check_granted(self, p: ChannelPeer, dst: Fragments, bounds: tuple[int, int] | None = None) -> None:
        """:raises ~kvferry.errors.NotGranted: a destination row outside what ``p`` granted us."""
        p.grants.check(dst, f"destination at {p.address}", bounds)

    @property
    def writes_in_flight(self) -> int:
        """Writes of this transport that have not returned yet."""
        return self._writes_in_flight

    @property
    def own_regions(self) -> RegionTable:
        return self._own

    # --- state ---------------------------------------------------------------------------------------

    def statistics(self) -> TransportStatistics:
        return TransportStatistics(
            peers=len(self._peers),
            registrations=len(self._registrations),
            registered_bytes=sum(r.nbytes for r in self._registrations),
            writes_in_flight=self._writes_in_flight,
            incoming_writes=sum(len(p.incoming) for p in self._peers),
            writes_completed=self._writes_completed,
            writes_failed=self._writes_failed,
            bytes_written=self._bytes_written,
            messages_sent=self._messages_sent,
            messages_received=self._messages_received,
            refused_connections=self._refused,
            backend_handles=self._backend_handles(),
            writes_combined=self._writes_combined,
            writes_indexed=self._writes_indexed,
            dropped_peers=self._dropped,
            accept_errors=self._accept_errors,
            pending_handshakes=self._handshakes,
            buffered_bytes=self._budget.held,
            writes_refused=self._writes_refused,
            incoming_refused=self._incoming_refused,
            grants=sum(len(g) for p, g in self._grants.items() if p.state is PeerState.CONNECTED),
        )

    def __repr__(self) -> str:
        s = self.statistics()
        where = self._address or "-"
        return (
            f"<{type(self).__name__} {where} [{self._state} | {s.peers} peers | {s.registrations} registrations, "
            f"{s.registered_bytes} bytes | writes: {s.writes_in_flight} in flight, {s.incoming_writes} incoming, "
            f"{s.writes_completed} done ({s.writes_combined} combined), {s.writes_failed} failed | "
            f"{s.backend_handles} library handles]>"
        )

    @property
    def extra_attributes(self) -> Mapping[Any, Any]:
        return {
            TransportAttribute.name: lambda: self.name,
            TransportAttribute.address: lambda: self.address,
            TransportAttribute.instance_id: lambda: self.instance_id,
            **self._backend_extra(),
        }

    # --- backend hooks (defaults: no library) --------------------------------------------------------

    async def _backend_open(self) -> None:
        """Open the library (called first in start)."""

    async def _backend_start_tasks(self) -> None:
        """Start background tasks (e.g. NIXL polling) with :meth:`spawn`."""

    async def _backend_close(self) -> None:
        """Close the library (called last in aclose, after every peer and registration is released)."""

    def _backend_hello(self) -> bytes:
        return b""

    async def _backend_peer_connected(self, peer: ChannelPeer) -> None:
        """A peer passed the handshake; raise to refuse it."""

    async def _backend_peer_lost(self, peer: ChannelPeer) -> None:
        """Release what the backend holds for ``peer``."""

    async def _backend_register(self, registration: TensorRegistration) -> bytes:
        """Register with the library; return metadata peers need for it (may be empty)."""
        return b""

    async def _backend_deregister(self, registration: TensorRegistration) -> None:
        """Deregister from the library."""

    async def _backend_regions_updated(self, peer: ChannelPeer, blob: bytes) -> None:
        """The peer registered memory; ``blob`` is what its backend published for it."""

    async def _backend_frame(self, peer: ChannelPeer, kind: int, body: bytes) -> None:
        raise WireFormatError(f"{self.name} transport does not expect frame kind {kind}")

    def _backend_revoked(self, peer: ChannelPeer) -> None:
        """Grants of ours to ``peer`` ended (``peer.granted`` holds the live ones): a receiver that moves the
        peer's writes itself stops those that now reach outside them."""

    def _backend_device_destinations(self, peer: ChannelPeer) -> DeviceDestinations | None:
        """Where ``peer``'s regions are mapped in this process for device copies (nixl: CUDA IPC), or None."""
        return None

    def _backend_may_write_together(self, peer: ChannelPeer) -> bool:
        """The backend may write several writes to ``peer`` as one (:meth:`_backend_write_together`)."""
        return False

    async def _backend_write_together(self, peer: ChannelPeer, rows: CheckedRows, stall: float) -> bool:
        """Write checked rows (several writes' together, no notification), if the backend can finish them as
        one copy whose end means every byte landed; False (nothing written) otherwise."""
        return False

    async def _backend_write(
        self, peer: ChannelPeer, rows: CheckedRows, notify: bytes | None, stall: float
    ) -> None:
        """Write checked ``rows`` (ours to the peer's) to ``peer``, then deliver ``notify``."""
        raise PeerIncompatible(f"{self.name} transport cannot write to another process")

    @asynccontextmanager
    async def _backend_waiting(self) -> AsyncIterator[None]:
        """Held while someone waits for a notification (NIXL polls faster then)."""
        yield

    def _backend_handles(self) -> int:
        return 0

    def _backend_extra(self) -> dict[Any, Any]:
        return {}
