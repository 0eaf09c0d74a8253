"""The generation side's async edge: a :class:`Receiver` runs every transfer from one context peer.

Per request it grants the peer the transfer's destinations, sends the receive request, scatters staged chunks
as they land, and waits until every writer reported every chunk (:meth:`Receiver.receive`). It keeps the pages
of a cancelled or in-doubt transfer quarantined until no write can land any more: every writer reported, the
sender acknowledged the cancel (:meth:`Receiver.on_cancel_ack`), or the peer is gone
(:meth:`Receiver.peer_lost`), which may be long after :meth:`Receiver.receive` returned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import anyio
import anyio.lowlevel
import attrs
from attrs import define

from kvferry.disagg.protocol import CancelAck, CancelTransfer, ChunkResult, ReceiveRequest, encode_control
from kvferry.disagg.session.receive_session import (
    CancelAction,
    ReceiveSession,
    ReceiveState,
    TransferStatistics,
)
from kvferry.disagg.staging import ReceiveStaging
from kvferry.errors import (
    ClosedResourceError,
    ConfigError,
    KvferryError,
    MessageTooLarge,
    PeerDisconnected,
    TransferCancelled,
    TransferError,
    TransferInDoubt,
    TransportError,
    WireFormatError,
)
from kvferry.transports import Fragments, Grant, Peer, Transport

__all__ = ["PageHold", "Receiver"]

log = logging.getLogger("kvferry.disagg")


class PageHold(Protocol):
    """What the receiver holds for one transfer (a manager request's pages, draft pages and slot)."""

    def free(self) -> None:
        """Return everything to the pools now (nothing can land any more)."""
        ...

    def quarantine(self) -> Callable[[], None]:
        """Take everything out of the pools (never reallocated); the returned callable returns it."""
        ...


@define(eq=False)
class _Live:
    """One session the receiver runs: its core, what it holds, and what wakes :meth:`Receiver.receive`."""

    session: ReceiveSession
    hold: PageHold
    staging: ReceiveStaging | None = None
    changed: anyio.Event = attrs.field(factory=anyio.Event)
    #: set once the pages are quarantined: returns them to the pools
    release: Callable[[], None] | None = None
    #: what the context peer may write for this session (revoked when the pages go back)
    grant: Grant | None = None


@define(eq=False)
class Receiver:
    """The generation side's transfers from one context peer.

    Feed it the peer's reports (:meth:`on_result`, from the link's reader tasks) and the peer's loss
    (:meth:`peer_lost`) and its answers to our cancels (:meth:`on_cancel_ack`); call :meth:`receive` once per
    request. Quarantined pages of cancelled or in-doubt transfers are released here when their writers report,
    the peer acknowledges a cancel, or the peer is gone, so they outlive :meth:`receive`.

    ``destinations``: the byte ranges the writers of a receive request may write
    (:func:`~kvferry.disagg.transfer.destinations`); each session grants them to the peer before its request is sent and
    revokes them when the session is over (see :meth:`receive`). None: nothing is granted here (the caller
    grants, or its transport needs none); the peer's writes are then refused unless granted otherwise.
    """

    transport: Transport
    peer: Peer
    writers: tuple[int, ...]
    stall_timeout: float = 30.0
    #: seconds the CancelTransfer of a cancelled transfer may take (best effort)
    control_timeout: float = 1.0
    destinations: Callable[[ReceiveRequest], Fragments] | None = None
    _sessions: dict[int, _Live] = attrs.field(factory=dict, init=False)
    _next_id: int = attrs.field(default=1, init=False)
    _lost: str | None = attrs.field(default=None, init=False)
    _counts: dict[str, int] = attrs.field(
        factory=lambda: dict.fromkeys(("complete", "failed", "cancelled", "in_doubt", "bytes"), 0), init=False
    )

    def new_session(self, key: str, hold: PageHold, staging: ReceiveStaging | None = None) -> ReceiveSession:
        """A session for ``key``, holding ``hold`` (freed or quarantined as the transfer ends) and ``staging``
        (the areas offered to bouncing writers: released when the pages are, kept while they are quarantined).
        The receive request must carry ``staging.areas()``."""
        offered = staging.writers if staging is not None else frozenset()
        session = ReceiveSession(self._next_id, key, self.writers, offered)
        self._next_id += 1
        self._sessions[session.session_id] = _Live(session, hold, staging)
        return session

    async def receive(self, session: ReceiveSession, request: ReceiveRequest) -> TransferStatistics:
        """Grant the peer the request's destinations, send ``request`` and wait until every writer has reported
        every chunk.

        On success the pages hold the request's cache and stay with the caller. Otherwise the hold is freed
        (everyone reported, or the peer is gone) or quarantined (writers still out) before this raises.

        The grant (:attr:`destinations`) is made before the request is sent, and travels with it in one send
        (the control channel is ordered: the peer knows it before it reads the request), and lasts exactly as
        long as writes may land: it is revoked on success before this returns, and otherwise when the pages go
        back to the pools (freed, or released from quarantine), never later. Our own checks refuse at once (a
        two-sided receiver's too); the revoke goes out without delaying the result, ahead of anything we send
        the peer afterwards (a receive request that reuses the pages comes after it), and the peer's check
        follows when it arrives: no writer of the session writes by then (it has reported, acknowledged a
        cancel, or is gone). A grant the transport refuses fails the transfer before the request is sent.

        A cancel before the request is sent frees the pages at once. A later one sends
        :class:`~kvferry.disagg.protocol.CancelTransfer` (best effort) and leaves the pages quarantined until no write can
        land any more: every writer reported (the sender was pushing), the sender answered
        :class:`~kvferry.disagg.protocol.CancelAck` (it never got the request, called the push off before it started, or had
        finished it), or the peer is gone. Only a lost CancelTransfer or acknowledgement on a connection that
        stays up keeps them quarantined for the connection's life.

        :raises ~kvferry.errors.TransferError: a chunk failed, or the peer went away.
        :raises ~kvferry.errors.TransferCancelled: the sender cancelled.
        :raises ~kvferry.errors.TransferInDoubt: no report within ``stall_timeout`` seconds while writers are
            still out; the pages stay quarantined.
        """
        live = self._sessions[session.session_id]
        started = time.perf_counter()
        scattered: dict[tuple[int, int], str] = {}
        try:
            await self._request(live, request)
            await self._wait(live, scattered)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._abandon(live)
            raise
        return self._conclude(live, scattered, time.perf_counter() - started)

    async def _request(self, live: _Live, request: ReceiveRequest) -> None:
        """Grant the request's destinations and send it (or settle the session at once: peer gone, grant or
        request refused)."""
        session = live.session
        if self._lost is not None:
            session.peer_lost(self._lost)
            return
        # a cancel that comes before anything is sent frees the pages (ALLOCATED); no turn of the loop
        await anyio.lowlevel.checkpoint_if_cancelled()
        # REQUESTED before the send: every writer may report before send_message returns (a fast context
        # side), and a report must find the session waiting for it. A failed send then takes the cancel path
        # (quarantine until the writers report or the peer is gone: the request may have left before the
        # failure).
        session.requested()
        refused = await self._grant(live, request)
        if refused is not None:
            session.not_sent(refused)
            return
        try:
            await self.transport.send_message(self.peer, encode_control(request))
        except MessageTooLarge as exc:
            session.not_sent(f"receive request refused by the transport: {exc}")

    async def _wait(self, live: _Live, scattered: dict[tuple[int, int], str]) -> None:
        """Wait until the session settles, scattering staged chunks as they land.

        :raises ~kvferry.errors.TransferInDoubt: no report for ``stall_timeout`` seconds with writers out (the
            session is IN_DOUBT and its pages quarantined).
        """
        session = live.session
        while True:
            # unpack each staged chunk as soon as it landed (overlaps the chunks still being written)
            await self._scatter(live, scattered)
            if session.settled:
                # reports that arrived during the scatter above may have completed other writers
                await self._scatter(live, scattered)
                return
            live.changed = anyio.Event()
            with anyio.move_on_after(self.stall_timeout):
                await live.changed.wait()
            if not live.changed.is_set() and not session.settled:
                session.stalled()
                self._counts["in_doubt"] += 1
                self._quarantine(live, notify=False)
                raise TransferInDoubt(
                    f"transfer {session.session_id} ({session.key}): no report for {self.stall_timeout}s "
                    f"with {session.outstanding} writers out; its pages stay quarantined"
                )

    def _conclude(
        self, live: _Live, scattered: dict[tuple[int, int], str], seconds: float
    ) -> TransferStatistics:
        """A settled session's outcome: its statistics when COMPLETE and every scatter succeeded (the pages stay
        with the caller), else its pages go back and this raises."""
        session = live.session
        failures = [detail for detail in scattered.values() if detail]
        if session.state is ReceiveState.COMPLETE and failures:
            self._finish(live)  # everyone reported: nothing can land, free the pages and the staging
            self._counts["failed"] += 1
            raise TransferError(f"transfer {session.session_id} ({session.key}) failed: {failures[0]}")
        if session.state is ReceiveState.COMPLETE:
            self._sessions.pop(session.session_id, None)
            if live.grant is not None:  # every writer reported: nothing more may land
                grant, live.grant = live.grant, None
                grant.revoke_nowait()  # our side refuses now; the peer's before anything we send it next
            if live.staging is not None:
                live.staging.release()
            self._counts["complete"] += 1
            stats = session.statistics(seconds)
            self._counts["bytes"] += stats.nbytes
            return stats
        self._finish(live)
        if session.state is ReceiveState.CANCELLED:
            raise TransferCancelled(
                f"transfer {session.session_id} ({session.key}) cancelled: {session.detail}"
            )
        raise TransferError(f"transfer {session.session_id} ({session.key}) failed: {session.detail}")

    async def _scatter(self, live: _Live, scattered: dict[tuple[int, int], str]) -> None:
        """Scatter every staged chunk that landed OK (once each, its byte range of its writer's area; in a worker
        thread: a kernel plus a device wait). A failure is recorded in ``scattered`` (the transfer fails once
        every writer reported; until then the pages stay as they are)."""
        if live.staging is None or live.session.state not in (ReceiveState.REQUESTED, ReceiveState.COMPLETE):
            return
        for report in live.session.staged_landed():
            key = (report.writer, report.chunk)
            if key in scattered:
                continue
            scattered[key] = ""
            end = report.offset + report.nbytes
            try:
                await anyio.to_thread.run_sync(live.staging.scatter, report.writer, report.offset, end)
            except ConfigError as exc:
                scattered[key] = f"scatter of writer {report.writer}'s staging failed: {exc}"

    async def _abandon(self, live: _Live) -> None:
        session = live.session
        if live.release is not None or session.session_id not in self._sessions:
            return  # already quarantined (in doubt) or already finished
        action = session.cancel()
        if action is CancelAction.QUARANTINE:
            self._quarantine(live, notify=True)
            with anyio.move_on_after(self.control_timeout), _suppress_transport():
                await self.transport.send_message(
                    self.peer, encode_control(CancelTransfer(session.session_id, "receiver cancelled"))
                )
        else:
            self._finish(live)

    def _quarantine(self, live: _Live, *, notify: bool) -> None:
        if live.release is None:
            live.release = live.hold.quarantine()

    async def _grant(self, live: _Live, request: ReceiveRequest) -> str | None:
        """Grant the peer ``request``'s destinations (:attr:`destinations`); why it could not, or None.

        :raises ~kvferry.errors.PeerDisconnected: the peer is gone (nothing was granted).
        """
        if self.destinations is None:
            return None
        try:
            # deferred: it goes out with the request, in one send
            live.grant = await self.transport.grant(self.peer, self.destinations(request), defer=True)
        except (PeerDisconnected, ClosedResourceError):
            raise
        except (TransportError, KvferryError, ValueError) as exc:  # RegionError, too many grants, bad ids
            return f"granting the receive request's destinations failed: {type(exc).__name__}: {exc}"
        return None

    def _finish(self, live: _Live) -> None:
        """The session is over and nothing can land: revoke its grant, give its pages back and forget it."""
        if live.grant is not None:
            grant, live.grant = live.grant, None
            grant.revoke_nowait()  # before the pages go back: our side refuses at once
        self._sessions.pop(live.session.session_id, None)
        state = live.session.state
        if state is ReceiveState.FAILED:
            self._counts["failed"] += 1
        elif state is ReceiveState.CANCELLED:
            self._counts["cancelled"] += 1
        if live.release is not None:
            live.release()
        else:
            live.hold.free()
        if live.staging is not None:
            live.staging.release()

    def on_result(self, report: ChunkResult) -> None:
        """A writer's report (a notification or a control message) arrived."""
        live = self._sessions.get(report.session_id)
        if live is None:
            log.debug("report for unknown or finished session %s", report.session_id)
            return
        try:
            live.session.on_result(report)
        except WireFormatError as exc:
            log.warning("bad report from the context peer: %s", exc)
            live.session.peer_lost(f"bad report: {exc}")  # no longer trusted: fail the session
        live.changed.set()
        if live.session.settled and live.release is not None:
            self._finish(live)  # a cancelled / in-doubt session: its writers are done, release the pages

    def on_cancel_ack(self, ack: CancelAck) -> None:
        """The peer answered a :class:`~kvferry.disagg.protocol.CancelTransfer`: no write of ``ack.session_id`` can land any
        more. A session quarantined after a cancel is released now (pages and staging), as when its last writer
        reports; an unknown, finished or not cancelled session is left as it is (a stale or stray answer).
        Reports of the released session that arrive later are ignored (its id is never reused)."""
        live = self._sessions.get(ack.session_id)
        if live is None or not live.session.cancel_acknowledged():
            state = "unknown or finished" if live is None else live.session.state.name
            log.debug("cancel acknowledgement for %s session %s ignored", state, ack.session_id)
            return
        live.session.detail = live.session.detail or f"cancelled; the peer acknowledged: {ack.reason}"
        live.changed.set()
        self._finish(live)

    def peer_lost(self, reason: str) -> None:
        """The transport says the peer is gone: every session settles and quarantines are released."""
        self._lost = reason
        for live in list(self._sessions.values()):
            live.session.peer_lost(reason)
            live.changed.set()
            if live.release is not None:
                self._finish(live)

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def statistics(self) -> dict[str, int]:
        quarantined = sum(1 for live in self._sessions.values() if live.release is not None)
        staging = sum(live.staging.nbytes for live in self._sessions.values() if live.staging is not None)
        return {
            **self._counts,
            "sessions": len(self._sessions),
            "quarantined": quarantined,
            "staging_bytes": staging,
        }

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<Receiver {len(self.writers)} writers [{s['sessions']} sessions, {s['quarantined']} quarantined"
            f"{', peer lost' if self._lost else ''} | {s['complete']} complete, {s['failed']} failed]>"
        )


class _suppress_transport:
    """Swallow transport errors of a best-effort message (the peer may be gone)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        return exc_type is not None and issubclass(exc_type, (TransportError, KvferryError))
