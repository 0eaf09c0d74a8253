"""The context side's async edge: :func:`send` pushes every writer's chunks of one session over a transport.

Every writer reports every chunk: an OK report travels as its write's notification (the transport delivers it
only after the bytes landed), a failed write is reported FAILED on the control channel, a chunk never posted
because of a cancel CANCELLED, and a writer with nothing to write reports one empty chunk.
"""

from __future__ import annotations

import anyio
import attrs
from attrs import define

from kvferry.disagg.protocol import ChunkResult, ChunkResults, ChunkStatus, encode_control
from kvferry.disagg.session.chunks import Chunk
from kvferry.disagg.session.send_session import SendSession
from kvferry.errors import ClosedResourceError, ConfigError, PeerDisconnected, TransferError, TransportError
from kvferry.transports import Peer, Transport
from kvferry.transports.indexed import IndexedWrite

__all__ = ["send"]

#: what a chunk's write or pack may fail with (the chunk is reported FAILED; the others go on)
_CHUNK_ERRORS = (
    PeerDisconnected,
    ClosedResourceError,
    TransportError,
    TransferError,
    ConfigError,
    ValueError,
)


async def send(
    transport: Transport,
    peer: Peer,
    session: SendSession,
    *,
    stall_timeout: float | None = None,
    max_in_flight: int = 4,
) -> None:
    """Push every writer's chunks of ``session`` (writers concurrently, each with up to ``max_in_flight``
    chunks posted at once, in order of posting). The writers that write directly (not packed) in one chunk
    (the default for direct writers) post it first, together, in one
    :meth:`~kvferry.transports.Transport.write_indexed` (indexed chunks) or
    :meth:`~kvferry.transports.Transport.write_many` (plain ones): one copy where the transport can; then the
    rest.

    Each chunk is one ``transport.write`` (``write_indexed`` for an indexed chunk) whose notify is the chunk's OK
    report; the indexed chunks posted together send no notification each: their OK reports go in one
    :class:`~kvferry.disagg.protocol.ChunkResults` message once the call returned (their bytes landed). A failed
    write is reported FAILED on the control channel; after a cancel (:meth:`~kvferry.disagg.session.SendSession.cancel`) the unposted
    chunks are reported CANCELLED. A packed chunk packs its own bytes into the writer's staging (in a worker
    thread, one chunk at a time over all writers) right before it is posted; a failed pack fails that chunk.
    Returns when every posted write has ended and every report was sent (or the peer is gone): then the source
    pages may be freed, and the writers' staging leases have been released. A cancel of the caller stops the
    posting: the writes already posted have ended when it returns (a write returns only then) and the leases
    are released, but chunks not yet reported stay unreported (:meth:`~kvferry.disagg.session.SendSession.cancel` instead has them
    reported CANCELLED). Never raises for a failed chunk (it is reported instead).

    :raises ~kvferry.errors.PeerDisconnected: the peer went away (nothing more can be reported).
    """
    push = _Push(transport, peer, session, stall_timeout)
    try:
        await push.together()
        await push.the_rest(max_in_flight)
    finally:
        # every posted write has ended (a write returns only then, cancel included): nothing reads the leases
        session.release_staging()
    if push.lost is not None:
        raise PeerDisconnected(f"transfer {session.session_id}: {push.lost}")


@define(eq=False)
class _Push:
    """One call of :func:`send`: posts chunks, records how each ended, sends the reports.

    ``lost``: the first sign that the peer is gone (then nothing more is posted or reported).
    """

    transport: Transport
    peer: Peer
    session: SendSession
    stall_timeout: float | None
    lost: BaseException | None = None
    #: one chunk packed at a time, in posting order: packing the next chunk overlaps writing this one (several
    #: packs at once would only fight over the cores and memory the writes need)
    packing: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))

    def _lose(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc

    async def _send(self, message: bytes) -> None:
        if self.lost is not None:
            return
        try:
            await self.transport.send_message(self.peer, message)
        except (PeerDisconnected, ClosedResourceError) as exc:
            self._lose(exc)

    async def report(self, result: ChunkResult) -> None:
        """Send one chunk's report on the control channel (nothing once the peer is gone)."""
        await self._send(encode_control(result))

    async def report_all(self, results: list[ChunkResult]) -> None:
        """Send several chunks' reports in one message."""
        if len(results) == 1:
            await self.report(results[0])
        elif results:
            await self._send(encode_control(ChunkResults(tuple(results))))

    async def ended(self, w: int, index: int, ok: ChunkResult, error: Exception | None) -> None:
        """Record how a posted chunk ended: OK (its report travelled as the write's notification), FAILED and
        reported, or FAILED with the peer gone (nothing more can be reported). Anything else is not a chunk's
        failure and is raised."""
        session = self.session
        if error is None:
            session.finish_post(w, index, ok)
        elif isinstance(error, PeerDisconnected | ClosedResourceError):
            session.finish_post(w, index, session.result(w, index, ChunkStatus.FAILED, str(error)))
            self._lose(error)
        elif isinstance(error, _CHUNK_ERRORS):
            failed = session.result(w, index, ChunkStatus.FAILED, f"{type(error).__name__}: {error}")
            session.finish_post(w, index, failed)
            await self.report(failed)
        else:
            raise error

    async def post(self, w: int, chunk_index: int, chunk: Chunk, ok: ChunkResult) -> None:
        """Post one chunk (packing it first if it is packed) and record how it ended."""
        try:
            if chunk.indexed is not None:
                (outcome,) = await self.transport.write_indexed(
                    self.peer, [_notifying(chunk.indexed, ok)], stall_timeout=self.stall_timeout
                )
                await self.ended(w, chunk_index, ok, outcome)
                return
            if chunk.staged is not None:  # pack this chunk's bytes (overlaps the writes in flight)
                await anyio.to_thread.run_sync(chunk.staged.pack_chunk, chunk.src, limiter=self.packing)
            await self.transport.write(
                self.peer, chunk.src, chunk.dst, encode_control(ok), stall_timeout=self.stall_timeout
            )
        except _CHUNK_ERRORS as exc:
            await self.ended(w, chunk_index, ok, exc)
        else:
            await self.ended(w, chunk_index, ok, None)

    async def writer(self, w: int) -> None:
        """Post ``w``'s next chunks in order until none is left, then report the unposted ones CANCELLED."""
        session = self.session
        while self.lost is None and (item := session.next_post(w)) is not None:
            index, chunk = item
            ok = session.result(w, index, ChunkStatus.OK)
            if chunk is None:  # a writer with nothing to write: its one empty report
                session.finish_post(w, index, ok)
                await self.report(ok)
                continue
            await self.post(w, index, chunk, ok)
        if self.lost is not None:
            session.unposted(w)
            return
        for cancelled in session.unposted(w):
            await self.report(cancelled)

    async def together(self) -> None:
        """Post the only chunk of every writer that writes its pages directly in one chunk (a direct writer's,
        by default) in one call: the transport may move them as one copy (one launch, one wait)."""
        session = self.session
        batch = [
            w for w in session.writers if len(session.plan[w]) == 1 and session.plan[w][0].staged is None
        ]
        if len(batch) < 2 or session.cancelled:
            return
        for w in batch:
            session.next_post(w)  # chunk 0
        oks = [session.result(w, 0, ChunkStatus.OK) for w in batch]
        chunks = [session.plan[w][0] for w in batch]
        # indexed writes (the default of direct writers) in one call, plain ones in another
        indexed = [(i, c.indexed) for i, c in enumerate(chunks) if c.indexed is not None]
        plain = [i for i, c in enumerate(chunks) if c.indexed is None]
        outcomes: list[Exception | None] = [None] * len(batch)
        if indexed:
            # no notification each: the OK reports of the writes that landed go in one message once the call
            # returned (it returns when their bytes have landed)
            done = await self.transport.write_indexed(
                self.peer, [write for _, write in indexed], stall_timeout=self.stall_timeout
            )
            for (i, _), outcome in zip(indexed, done, strict=True):
                outcomes[i] = outcome
            await self.report_all(
                [oks[i] for (i, _), outcome in zip(indexed, done, strict=True) if outcome is None]
            )
        if plain:
            done = await self.transport.write_many(
                self.peer,
                [(chunks[i].src, chunks[i].dst, encode_control(oks[i])) for i in plain],
                stall_timeout=self.stall_timeout,
            )
            for i, outcome in zip(plain, done, strict=True):
                outcomes[i] = outcome
        for w, ok, outcome in zip(batch, oks, outcomes, strict=True):
            await self.ended(w, 0, ok, outcome)

    async def the_rest(self, max_in_flight: int) -> None:
        """Post every chunk not posted together: as many posting tasks per writer as it has chunks left, up to
        ``max_in_flight`` (each posts, or after a cancel reports unposted, that writer's chunks in order)."""
        session = self.session
        tasks = [
            w for w in session.writers for _ in range(min(max(1, max_in_flight), session.unposted_count(w)))
        ]
        if len(tasks) == 1:  # one writer with one chunk left, say: no task group to set up
            await self.writer(tasks[0])
        elif tasks:
            async with anyio.create_task_group() as tg:
                for w in tasks:
                    tg.start_soon(self.writer, w)


def _notifying(write: IndexedWrite, ok: ChunkResult) -> IndexedWrite:
    """``write`` with its chunk's OK report as the notification."""
    return IndexedWrite(write.rows, write.src_ids, write.dst_ids, encode_control(ok))
