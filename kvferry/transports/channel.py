"""The transport every backend shares: a TCP control channel per peer, and a data path that moves the bytes.

:class:`ChannelTransport` is a facade over four parts, each in its own module:

- :class:`~kvferry.transports.control.ControlChannel` (:mod:`~kvferry.transports.control`): the listener,
  connect and accept, the handshake, each peer's reader, frames out, messages and notifications, peer loss
  (each peer's state: :class:`~kvferry.transports.peers.ChannelPeer`);
- :class:`~kvferry.transports.grants.GrantLedger` (:mod:`~kvferry.transports.grants`): our grants to each peer,
  and each peer's to us;
- :class:`~kvferry.transports.writes.WritePipeline` (:mod:`~kvferry.transports.writes`): every write's checks,
  copies to peers of this process, writes moved together;
- a :class:`~kvferry.transports.datapath.DataPath` (:mod:`~kvferry.transports.datapath`): what moves a checked
  write's bytes to a peer in another process (NIXL, UCX; none for ``local``).

The transport's own life (:class:`TransportState`, every change checked against :data:`TRANSITIONS`)::

    NEW ──start()──> STARTING ──listening, tasks running──> OPEN ──aclose()──> CLOSING ──released──> CLOSED
     │                  │  └──────────────start failed (all released again)──────────────────────────^
     └──aclose()────────┴──> CLOSING

Background tasks (accept loops, peer readers, flushers, the data path's pollers) run in a task group the
transport enters in :meth:`~ChannelTransport.start`, each under a scope of its own that aclose cancels.
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, suppress
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import numpy.typing as npt
from anyio.abc import SocketAttribute, SocketStream, TaskGroup
from anyio.streams.stapled import MultiListener

from kvferry.errors import ClosedResourceError, ConfigError, InvalidTransition, TransportError
from kvferry.transports._memory import RegionTable, TensorRegistration
from kvferry.transports.base import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Grant,
    Peer,
    PeerState,
    Registration,
    Transport,
    TransportAttribute,
    TransportStatistics,
)
from kvferry.transports.control import ControlChannel
from kvferry.transports.datapath import DataPath
from kvferry.transports.grants import ChannelGrant, GrantLedger
from kvferry.transports.handshake import Handshake, TlsConfig, check_listen_address
from kvferry.transports.limits import ChannelLimits
from kvferry.transports.peers import ChannelPeer
from kvferry.transports.writes import CheckedRows, Guard, WritePipeline

if TYPE_CHECKING:
    import torch

    from kvferry.transports.indexed import IndexedWrite

__all__ = [
    "TRANSITIONS",
    "ChannelGrant",
    "ChannelPeer",
    "ChannelTransport",
    "CheckedRows",
    "Guard",
    "TransportState",
]

log = logging.getLogger("kvferry.transports")

#: the data path of a ChannelTransport (covariant: a ChannelTransport[NixlDataPath] is a
#: ChannelTransport[DataPath])
P = TypeVar("P", bound=DataPath, covariant=True)


class TransportState(enum.Enum):
    """Where a :class:`ChannelTransport` stands. CLOSED is terminal."""

    NEW = "new"
    STARTING = "starting"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


#: The one table of allowed transitions: ``TRANSITIONS[src]`` is the set of states ``src`` may move to.
TRANSITIONS: dict[TransportState, frozenset[TransportState]] = {
    TransportState.NEW: frozenset({TransportState.STARTING, TransportState.CLOSING}),
    # a start that fails releases what it opened and ends CLOSED; an aclose from another task meanwhile: CLOSING
    TransportState.STARTING: frozenset({TransportState.OPEN, TransportState.CLOSING, TransportState.CLOSED}),
    TransportState.OPEN: frozenset({TransportState.CLOSING}),
    TransportState.CLOSING: frozenset({TransportState.CLOSED}),
    TransportState.CLOSED: frozenset(),
}


class ChannelTransport(Transport, Generic[P]):
    """A transport whose control channel is TCP (framed, handshaken) and whose data path is a backend's.

    :param data_path: makes this transport's data path (given the transport)
    :param host: interface to listen on (``"127.0.0.1"`` by default; ``"0.0.0.0"`` for other hosts)
    :param port: port to listen on (0: any free port)
    :param advertise_host: the host put into :attr:`address` (default: ``host``, or the hostname for 0.0.0.0)
    :param compat_hash: compared at the handshake; peers with another hash are refused
    :param max_message_bytes: limit of one incoming control message
    :param connect_timeout: deadline of :meth:`connect` (TCP connect plus handshake)
    :param stall_timeout: default stall deadline of writes
    :param same_process: ``"copy"``: writes to a peer in this process are plain copies (never through the
        library; NIXL inside one process on a GPU is far slower than a device copy); ``"transport"``: use the
        library anyway
    :param coalesce: merge fragments that are contiguous on both sides before writing, where at least one in
        :data:`~kvferry.transports.base.MERGE_SHARE` is (fewer save less than merging costs)
    :param secret: the secret shared with the peers (see :mod:`~kvferry.transports.handshake`); None: peers are
        not authenticated, which is only allowed when ``host`` is a loopback address
    :param tls: wrap the control connections in TLS (both ways)
    :param limits: caps on what peers may cost (pending handshakes, held bytes; :class:`ChannelLimits`)

    :raises ~kvferry.errors.ConfigError: no secret for a non-loopback ``host``, or contradictory limits.
    """

    def __init__(
        self,
        data_path: Callable[[ChannelTransport[P]], P],
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
        #: caps on what peers may cost
        self.limits = limits or ChannelLimits()
        if max_message_bytes > self.limits.max_handshake_bytes << 8:
            raise ConfigError(f"max_message_bytes of {max_message_bytes} is beyond any sane control message")
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self.connect_timeout = connect_timeout
        self.stall_timeout = stall_timeout
        #: writes to a peer of this process are copies here, not through the data path
        self.same_process_copy = same_process == "copy"
        self.coalesce = coalesce
        self.instance_id = f"{self.name}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"
        #: the address peers connect to, once listening ("" before)
        self.local_address = ""
        self._host = host
        self._port = port
        self._advertise_host = advertise_host
        self._state = TransportState.NEW
        self._stack = AsyncExitStack()
        self._owner = 0
        self._tg: TaskGroup | None = None
        self._task_scopes: set[anyio.CancelScope] = set()
        self._listener: MultiListener[SocketStream] | None = None
        #: what we registered, in order
        self.registrations: list[TensorRegistration] = []
        self._own = RegionTable(())
        handshake = Handshake(
            name=self.name,
            secret=None if secret is None else bytes(secret),
            compat_hash=bytes(compat_hash),
            max_bytes=self.limits.max_handshake_bytes,
        )
        self.control = ControlChannel(self, handshake)
        self.grants = GrantLedger(self)
        self.writes = WritePipeline(self)
        self.data_path: P = data_path(self)

    # --- lifecycle ---------------------------------------------------------------------------------------

    @property
    def state(self) -> TransportState:
        return self._state

    @property
    def is_open(self) -> bool:
        return self._state is TransportState.OPEN

    def _move(self, to: TransportState) -> None:
        if to not in TRANSITIONS[self._state]:
            raise InvalidTransition(f"{self.name} transport {self._state.name} -> {to.name} is not allowed")
        self._state = to

    async def start(self) -> None:
        if self._state is not TransportState.NEW:
            raise ClosedResourceError(f"{self.name} transport was already started")
        self._move(TransportState.STARTING)
        self._owner = anyio.get_current_task().id
        try:
            await self.data_path.open()
            try:
                self._listener = await anyio.create_tcp_listener(local_host=self._host, local_port=self._port)
            except OSError as exc:
                raise TransportError(f"cannot listen on {self._host}:{self._port}: {exc}") from exc
            self._tg = await self._stack.enter_async_context(anyio.create_task_group())
            self.spawn(self.control.serve, self._listener)
            await self.data_path.start_tasks()
            local: Any = self._listener.extra(SocketAttribute.local_address)
            port = local[1]
            host = self._advertise_host or (
                socket.gethostname() if self._host in ("0.0.0.0", "::") else self._host
            )
            self.local_address = f"{self.name}://{host}:{port}"
            if self.state is not TransportState.STARTING:  # an aclose from another task meanwhile
                raise ClosedResourceError(f"{self.name} transport was closed while it started")
            self._move(TransportState.OPEN)
        except BaseException:
            await self._shutdown()
            raise
        log.debug("%s started at %s", self.instance_id, self.local_address)

    async def aclose(self) -> None:
        """See :meth:`Transport.aclose`.

        Called from another task than the one that started the transport, it releases everything and cancels
        the background tasks; the task group itself is left by the starting task (its ``async with`` exit or its
        own ``aclose()``), since anyio task groups are exited where they were entered.
        """
        if (
            self._state is TransportState.CLOSED
            and self._tg is not None
            and anyio.get_current_task().id == self._owner
        ):
            await self._exit_task_group()
            return
        if self._state in (TransportState.CLOSED, TransportState.CLOSING):
            return
        self._move(TransportState.CLOSING)
        await self._shutdown()

    async def _shutdown(self) -> None:
        await self.control.close()
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
            if self._listener is not None and self._state is TransportState.CLOSED:
                with anyio.CancelScope(shield=True):
                    await self._listener.aclose()
                self._listener = None

    async def _release(self) -> None:
        if self._listener is not None and self._tg is None:
            await self._listener.aclose()
            self._listener = None
        self.control.stop_accepting()
        for registration in self.registrations:
            with suppress(Exception):
                await self.data_path.deregister(registration)
            registration.deactivate()
        self.registrations.clear()
        self._own = RegionTable(())
        await self.data_path.close()
        if self._state is not TransportState.CLOSED:
            self._move(TransportState.CLOSED)

    def spawn(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``function(*args)`` in the transport's task group, under a scope that aclose() cancels.

        :raises ~kvferry.errors.ClosedResourceError: the task group is not running (before start, after aclose).
        """
        if self._tg is None:
            raise ClosedResourceError(f"{self.name} transport is {self._state.value}")
        self._tg.start_soon(self._scoped, function, args, name=getattr(function, "__qualname__", None))

    async def _scoped(self, function: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        with anyio.CancelScope() as scope:
            if self._state in (TransportState.CLOSING, TransportState.CLOSED):
                # started after aclose() cancelled the scopes it knew of (a close right after start): end now,
                # or the task group would wait for it forever
                scope.cancel()
            self._task_scopes.add(scope)
            try:
                await function(*args)
            finally:
                self._task_scopes.discard(scope)

    def _check_open(self) -> None:
        if self._state is not TransportState.OPEN:
            raise ClosedResourceError(f"{self.name} transport is {self._state.value}, not open")

    @property
    def address(self) -> str:
        self._check_open()
        return self.local_address

    def stall(self, stall_timeout: float | None) -> float:
        """A write's stall deadline: ``stall_timeout``, or the transport's default."""
        return self.stall_timeout if stall_timeout is None else stall_timeout

    # --- peers -------------------------------------------------------------------------------------------

    async def connect(self, address: str, *, timeout: float | None = None) -> Peer:  # noqa: ASYNC109
        """See :meth:`Transport.connect`. The handshake authenticates both sides when this transport has a secret
        (:mod:`~kvferry.transports.handshake`); a cancel closes the half-open connection and leaves nothing."""
        self._check_open()
        return await self.control.connect(address, self.connect_timeout if timeout is None else timeout)

    async def accept(self) -> Peer:
        """See :meth:`Transport.accept`; a peer that went away before it was accepted is skipped."""
        self._check_open()
        return await self.control.accept()

    def _live_peer(self, peer: Peer) -> ChannelPeer:
        self._check_open()
        p = self.control.peer(peer)
        if p.state is not PeerState.CONNECTED:
            raise p.error
        return p

    # --- messages and notifications ----------------------------------------------------------------------

    async def send_message(self, peer: Peer, data: bytes) -> None:
        await self.control.send_message(self._live_peer(peer), data)

    async def receive_message(self, peer: Peer) -> bytes:
        self._check_open()
        return await self.control.receive_message(self.control.peer(peer))

    async def receive_notification(self, peer: Peer) -> bytes:
        self._check_open()
        return await self.control.receive_notification(self.control.peer(peer))

    # --- registration ------------------------------------------------------------------------------------

    @property
    def own_regions(self) -> RegionTable:
        """Our registered memory now."""
        return self._own

    async def register(self, regions: torch.Tensor | Sequence[torch.Tensor]) -> Registration:
        self._check_open()
        tensors = [regions] if not isinstance(regions, Sequence) else list(regions)
        registration = TensorRegistration(tensors)
        for info in registration.infos:
            if info.device != "cpu" and not self.capabilities.device_memory:
                raise ValueError(f"{self.name} transport cannot register device memory ({info.device})")
        blob = await self.data_path.register(registration)
        self.registrations.append(registration)
        self._own = RegionTable([i for r in self.registrations for i in r.infos])
        await self.control.publish_regions(blob)
        return registration

    async def deregister(self, registration: Registration) -> None:
        if not isinstance(registration, TensorRegistration) or registration not in self.registrations:
            return
        with anyio.CancelScope(shield=True):
            self.registrations.remove(registration)
            self._own = RegionTable([i for r in self.registrations for i in r.infos])
            registration.deactivate()
            if self.is_open:
                await self.control.publish_regions(b"")
                await self.grants.revoke_unregistered()
            await self.data_path.deregister(registration)

    # --- grants and writes -------------------------------------------------------------------------------

    async def grant(
        self, peer: Peer, fragments: npt.ArrayLike | Registration, *, defer: bool = False
    ) -> Grant:
        return await self.grants.grant(self._live_peer(peer), fragments, defer=defer)

    async def write(
        self,
        peer: Peer,
        src: npt.ArrayLike,
        dst: npt.ArrayLike,
        notify: bytes | None = None,
        *,
        stall_timeout: float | None = None,
    ) -> None:
        await self.writes.write(self._live_peer(peer), src, dst, notify, self.stall(stall_timeout))

    async def write_many(
        self,
        peer: Peer,
        writes: Sequence[tuple[npt.ArrayLike, npt.ArrayLike, bytes | None]],
        *,
        stall_timeout: float | None = None,
    ) -> list[Exception | None]:
        """As :meth:`Transport.write_many`: every write is checked on its own (a refused one is left out); the
        rest move together, as one write and then their notifications in order, when this transport copies
        them itself (same process) or the data path can
        (:meth:`~kvferry.transports.datapath.DataPath.write_together`: nixl's CUDA IPC mapping); else each is
        written on its own, concurrently."""
        try:
            p = self._live_peer(peer)
        except Exception as exc:  # the same error for every write
            return [exc] * len(writes)
        return await self.writes.write_many(p, writes, self.stall(stall_timeout))

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
        return await self.writes.write_indexed(p, writes, stall_timeout)

    # --- state -------------------------------------------------------------------------------------------

    def statistics(self) -> TransportStatistics:
        control, writes = self.control, self.writes
        return TransportStatistics(
            peers=len(control.peers),
            registrations=len(self.registrations),
            registered_bytes=sum(r.nbytes for r in self.registrations),
            writes_in_flight=writes.in_flight,
            incoming_writes=sum(len(p.incoming) for p in control.peers),
            writes_completed=writes.completed,
            writes_failed=writes.failed,
            bytes_written=writes.bytes_written,
            messages_sent=control.messages_sent,
            messages_received=control.messages_received,
            refused_connections=control.refused,
            backend_handles=self.data_path.handles(),
            writes_combined=writes.combined,
            writes_indexed=writes.indexed,
            dropped_peers=control.dropped,
            accept_errors=control.accept_errors,
            pending_handshakes=control.handshakes,
            buffered_bytes=control.budget.held,
            writes_refused=writes.refused,
            incoming_refused=writes.incoming_refused,
            grants=self.grants.live,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        where = self.local_address or "-"
        return (
            f"<{type(self).__name__} {where} [{self._state.value} | {s.peers} peers | {s.registrations} "
            f"registrations, {s.registered_bytes} bytes | writes: {s.writes_in_flight} in flight, "
            f"{s.incoming_writes} incoming, {s.writes_completed} done ({s.writes_combined} combined), "
            f"{s.writes_failed} failed | {s.backend_handles} library handles]>"
        )

    @property
    def extra_attributes(self) -> Mapping[Any, Any]:
        return {
            TransportAttribute.name: lambda: self.name,
            TransportAttribute.address: lambda: self.address,
            TransportAttribute.instance_id: lambda: self.instance_id,
            **self.data_path.extra_attributes(),
        }
