"""The generation role: a :class:`GenerationWorker` asks its context peer to prefill, receives the cache and
leaves the request for its engine to decode.

Admission: the generation engine's scheduler admits the transferred request in arrival order with every other
request (:meth:`Engine.admit_transfer <kvferry.engine.engine.Engine.admit_transfer>`): pages for the whole prompt,
a state slot, draft pages and a batch row, or it waits; only then is the receive request sent, so the context
side keeps the prefilled cache until this side can take it. When the cache landed, the request's prompt is
committed and the context side's first token becomes its first output, so the engine's first step for it is
exactly the decode (or verify) step an aggregated engine would take. The draft pages are zero-filled when
draft KV is not transferred (stale bytes must never reach the drafter); the request starts with
``num_accepted = 0`` and empty replay buffers (the manager's first resume).

Registered is not writable: the generation side grants its context peer, per transfer, only the bytes that
transfer writes (:func:`~kvferry.disagg.transfer.destinations`, granted by the
:class:`~kvferry.disagg.session.Receiver` before the receive request and revoked when the pages go back), so
nobody else connected to its transport writes its pools.

Bounce: the generation side offers staging areas in its receive requests to writers whose bytes land
fragmented (by its ``bounce`` policy) while its staging pool has room.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from functools import partial
from typing import ClassVar

import anyio
import anyio.abc
import attrs
from attrs import define

from kvferry.disagg.link import exchange_hello, pump
from kvferry.disagg.mapping import PeerMap
from kvferry.disagg.protocol import (
    BlockIds,
    CancelAck,
    ContextDone,
    ContextRequest,
    ControlBody,
    PeerInfo,
    PeerRole,
    ReceiveRequest,
    ReleaseContext,
    TablesUpdate,
    check_pairing,
    encode_control,
)
from kvferry.disagg.roles.worker import DEFAULT_PREFILL_TIMEOUT, Worker, positive
from kvferry.disagg.session import Receiver, TransferStatistics
from kvferry.disagg.staging import ReceiveStaging
from kvferry.disagg.transfer import ManagerHold, destinations, expected_writers, offer_staging
from kvferry.errors import KvferryError, PeerDisconnected, PrefillTimeout, TransferError
from kvferry.transports import Peer

__all__ = ["ContextLink", "GenerationWorker", "Handoff"]


@define(eq=False)
class Handoff:
    """What the router learned from the context side for one request."""

    key: str
    first_token: int
    held: bool
    host_state: bytes


@define(eq=False)
class ContextLink:
    """One context peer of a :class:`GenerationWorker`: its connection, its handshake, the rank mapping to it, the
    receiver of its transfers and the prefills waiting for its answers."""

    peer: Peer
    remote: PeerInfo
    peer_map: PeerMap
    receiver: Receiver
    #: the pairing allows transferring the draft KV
    draft: bool
    waiting: dict[str, tuple[anyio.Event, list[ContextDone]]] = attrs.field(factory=dict)
    #: the reader ended: the peer is gone
    gone: bool = False
    #: requests the router gave it and it is not done with (the router spreads requests by it)
    in_flight: int = 0
    #: ``time.perf_counter()`` of its last answer to a prefill (of the connection, before the first)
    last_answer: float = attrs.field(factory=time.perf_counter)
    #: the task group its reader runs in (best-effort messages to the peer go out from it)
    tasks: anyio.abc.TaskGroup | None = None
    #: the epoch of the peer's last page-table update applied (0: its handshake's tables)
    epoch: int = 0

    def __repr__(self) -> str:
        state = "gone" if self.gone else "up"
        return f"<ContextLink {self.remote.transport_address} {state} in_flight={self.in_flight}>"


@define(eq=False)
class GenerationWorker(Worker):
    """Receives transferred caches from its context peers and decodes them on its engine.

    Use :meth:`connect` once per context peer (handshake + reader), then per request :meth:`prefill_remote`, the
    engine's admission and :meth:`receive` on one of its :attr:`links` (the :class:`~kvferry.disagg.router.Router`
    does it).

    Every wait on a context peer has a deadline: the handshake (``handshake_timeout``), a prefill's answer
    (``prefill_timeout``: :class:`~kvferry.errors.PrefillTimeout`), each transfer's reports (``stall_timeout``:
    :class:`~kvferry.errors.TransferInDoubt`), best-effort control messages (``control_timeout``; a release of
    the context side's cache: ``stall_timeout``, in the background); control messages and writes are bounded by
    the transport's own stall deadline.
    """

    ROLE: ClassVar[PeerRole] = PeerRole.GENERATION

    #: seconds without a report while a transfer's writers are still out (then in doubt, pages quarantined)
    stall_timeout: float = attrs.field(default=30.0, validator=positive)
    #: transfer the draft KV (where the pairing allows it; False: the drafter starts from zeros)
    transfer_draft: bool = True
    #: seconds from sending a prefill to its answer (see :data:`~.worker.DEFAULT_PREFILL_TIMEOUT`)
    prefill_timeout: float = attrs.field(default=DEFAULT_PREFILL_TIMEOUT, validator=positive)
    links: list[ContextLink] = attrs.field(factory=list, init=False)
    _transfers: list[TransferStatistics] = attrs.field(factory=list, init=False)
    #: prompt tokens the transfers did not send (the cache held them), and the bytes that saved
    _counts: dict[str, int] = attrs.field(factory=lambda: {"reused_tokens": 0, "saved_bytes": 0}, init=False)
    _windows: list[tuple[float, float]] = attrs.field(factory=list, init=False)

    # the first peer's parts (one context peer is the common case)
    @property
    def peer(self) -> Peer | None:
        return self.links[0].peer if self.links else None

    @property
    def remote(self) -> PeerInfo | None:
        return self.links[0].remote if self.links else None

    @property
    def peer_map(self) -> PeerMap | None:
        return self.links[0].peer_map if self.links else None

    @property
    def receiver(self) -> Receiver | None:
        return self.links[0].receiver if self.links else None

    def link(self, link: ContextLink | None = None) -> ContextLink:
        """``link``, or the first one; :class:`~kvferry.errors.TransferError` when not connected."""
        if link is not None:
            return link
        if not self.links:
            raise TransferError("not connected to a context peer")
        return self.links[0]

    def prune(self) -> None:
        """Forget the context peers that went away and have nothing left here (no request in flight, no transfer
        session): a restarted context engine is a new link, the old one's receiver goes with it."""
        self.links = [
            link
            for link in self.links
            if not link.gone or link.in_flight or link.receiver.statistics()["sessions"]
        ]

    async def connect(self, peer: Peer, task_group: anyio.abc.TaskGroup) -> PeerInfo:
        """Handshake with a context peer (one more of them) and start reading from it in ``task_group``.

        :raises ~kvferry.errors.PeerIncompatible: another model / wire version (only this peer is affected).
        """
        await self.register()
        await self.publish_tables()  # a rebalance before this peer: the peers known so far are told first
        told, info = self.epoch, self.info()
        remote = await exchange_hello(self.transport, peer, info, within=self.handshake_timeout)
        pairing = check_pairing(remote, info)
        peer_map = PeerMap.build(list(remote.page_tables), list(info.page_tables))
        receiver = Receiver(
            self.transport,
            peer,
            expected_writers(peer_map),
            self.stall_timeout,
            control_timeout=self.control_timeout,
            destinations=partial(destinations, peer_map),
        )
        link = ContextLink(peer, remote, peer_map, receiver, pairing.draft, tasks=task_group)
        # from here every publish tells this peer; one during its hello catches up
        async with self.tables_lock:
            self.links.append(link)
            try:
                with anyio.CancelScope(shield=True):
                    await self.joined(peer, told, partial(self._remap, link))
            except BaseException:
                link.gone = True  # no reader will run for it
                raise
        task_group.start_soon(self._read, link)
        return remote

    def _peers(self) -> list[Peer]:
        return [link.peer for link in self.links if not link.gone]

    def _task_group(self) -> anyio.abc.TaskGroup | None:
        return next((link.tasks for link in self.links if not link.gone and link.tasks is not None), None)

    def _tables_applied(self) -> None:
        for link in self.links:
            self._remap(link)

    def _peer_map(self, remote: PeerInfo) -> PeerMap:
        return PeerMap.build(list(remote.page_tables), list(self.info().page_tables))

    def _remap(self, link: ContextLink, peer_map: PeerMap | None = None) -> None:
        """Map the link's ranks with ``peer_map`` (None: again from both sides' current tables)."""
        link.peer_map = self._peer_map(link.remote) if peer_map is None else peer_map
        link.receiver.destinations = partial(destinations, link.peer_map)

    def _apply_update(self, link: ContextLink, update: TablesUpdate) -> None:
        """The context peer's pools were rebalanced: map to its new tables (an update that changes more than a
        rebalance can, or does not map, is refused: the link keeps the tables it had)."""
        peer_map = self._updated_map(link.remote, link.epoch, update)
        if peer_map is None:
            return
        link.remote, link.epoch = update.info, update.epoch
        self._remap(link, peer_map)

    async def _read(self, link: ContextLink) -> None:
        receiver = link.receiver

        async def on_message(message: ControlBody) -> None:
            if isinstance(message, ContextDone):
                link.last_answer = time.perf_counter()
                waiting = link.waiting.get(message.key)
                if waiting is not None:
                    waiting[1].append(message)
                    waiting[0].set()
            elif isinstance(message, CancelAck):
                receiver.on_cancel_ack(message)  # no write of that session can land: release its pages
            elif isinstance(message, TablesUpdate):
                self._apply_update(link, message)

        try:
            await pump(self.transport, link.peer, receiver, on_message=on_message)
        finally:
            link.gone = True
            for event, _ in link.waiting.values():
                event.set()  # the peer is gone (or we stopped reading): wake every waiter

    async def prefill_remote(self, request: ContextRequest, link: ContextLink | None = None) -> Handoff:
        """Ask a context peer (``link``, default the first) to prefill; returns its first token (and whether it
        holds the cache).

        Waits for the answer while the context peer makes progress: it fails when ``prefill_timeout`` seconds pass
        with no answer to this prefill nor to any other (a long queue on a working engine is waited for; a
        stopped one is not). Whenever this ends without an answer (the deadline, a cancel, a failed send) the
        context side is told to drop the request (best effort, see :meth:`release_remote`): it stops the
        prefill, or frees the cache it holds for it; nothing stays
        allocated here.

        :raises ~kvferry.errors.PrefillTimeout: no answer from the peer to any prefill for ``prefill_timeout`` s.
        :raises ~kvferry.errors.TransferError: the context side failed or went away.
        """
        if not self.links:
            raise TransferError(f"request {request.key}: not connected to a context peer")
        link = self.link(link)
        if link.gone:
            raise TransferError(f"request {request.key}: the context peer went away before prefilling it")
        event = anyio.Event()
        answers: list[ContextDone] = []
        link.waiting[request.key] = (event, answers)
        sent = time.perf_counter()
        try:
            with anyio.move_on_after(self.prefill_timeout):
                await self.transport.send_message(link.peer, encode_control(request))
            while not event.is_set():
                # a deadline without progress: the engine answering other prefills is alive and working through
                # its queue; one that answers nobody for prefill_timeout seconds has stopped
                left = max(sent, link.last_answer) + self.prefill_timeout - time.perf_counter()
                if left <= 0:
                    break
                with anyio.move_on_after(left):
                    await event.wait()
        except BaseException:
            link.waiting.pop(request.key, None)
            if not answers or answers[0].held:  # nobody will take the cache it prefills or holds
                with anyio.CancelScope(shield=True):
                    await self.release_remote(request.key, link)
            raise
        link.waiting.pop(request.key, None)
        if not event.is_set():
            with anyio.CancelScope(shield=True):
                await self.release_remote(request.key, link)
            raise PrefillTimeout(
                f"request {request.key}: no answer from the context peer, and no answer to any other prefill, "
                f"within {self.prefill_timeout} s"
            )
        if not answers:
            raise TransferError(f"request {request.key}: the context peer went away before prefilling it")
        done = answers[0]
        if done.error:
            raise TransferError(f"request {request.key}: the context side failed: {done.error}")
        return Handoff(done.key, done.first_token, done.held, done.host_state)

    async def release_remote(self, key: str, link: ContextLink | None = None) -> None:
        """Tell the context side to drop a held cache, or to stop a prefill it has not answered (best effort).

        The message goes out from the link's task group and may wait up to ``stall_timeout`` seconds to be sent,
        not ``control_timeout``: on a busy event loop the messages to one peer queue behind each other for
        longer, and a release given up holds the context side's cache until its ``hold_timeout``."""
        if not self.links:
            return
        link = self.link(link)
        if link.gone:
            return
        if link.tasks is None:
            await self._send_release(key, link)
        else:
            link.tasks.start_soon(self._send_release, key, link)

    async def _send_release(self, key: str, link: ContextLink) -> None:
        with (
            anyio.move_on_after(self.stall_timeout),
            contextlib.suppress(PeerDisconnected, KvferryError),
        ):
            await self.transport.send_message(link.peer, encode_control(ReleaseContext(key)))

    def install_drafter_state(self, rid: int, prompt: Sequence[int], handoff: Handoff, spec_k: int) -> None:
        """Give the local drafter the context side's hand-off of ``rid`` (the prompt's last hidden state); call
        before :meth:`receive`, undo with ``built.runner.release(rid)``. No-op without speculation.

        :raises ~kvferry.errors.WireFormatError: a malformed hand-off, or one of another sequence.
        :raises ~kvferry.errors.TransferError: the request speculates but the context side sent no drafter state.
        """
        if spec_k <= 0:
            return
        if not handoff.host_state:
            raise TransferError(
                f"request {handoff.key}: speculates (spec_k={spec_k}) but the context side sent no drafter state"
            )
        self.built.runner.import_handoff(
            rid, handoff.host_state, prompt=prompt, pending_token=handoff.first_token
        )

    async def receive(
        self, rid: int, prompt: Sequence[int], key: str, link: ContextLink | None = None
    ) -> TransferStatistics:
        """Receive ``rid``'s cache into the pages its engine admitted it with (:meth:`Engine.admit_transfer
        <kvferry.engine.engine.Engine.admit_transfer>`: TRANSFERRING, the whole prompt's pages, a slot). Writers
        whose bytes land fragmented are offered staging areas (see the module docstring).

        On success the pages stay the request's (land it with ``Engine.transfer_landed``). On any failure or
        cancel the receiver has freed them, or quarantined them until the writers report, before this raises;
        the caller then cancels the request, whose close finds nothing left to free.
        """
        link = self.link(link)
        # a rebalance since the last transfer: the peer learns the new pages first
        await self.publish_tables()
        managers = self.cache.managers
        rx_staging: ReceiveStaging | None = None
        primary = managers[0]
        draft = self.transfer_draft and link.draft
        # what the cache holds already (a prefix its admission matched, a kept turn) is not sent again: the
        # transfer starts at the block boundary at or before it (that block is the request's own)
        tokens_per_block = primary.config.tokens_per_block
        start = primary.num_committed_tokens(rid) // tokens_per_block * tokens_per_block
        if primary.config.has_draft and not draft:
            # stale bytes from recycled pages must never reach the drafter (the blocks before the draft match's
            # end are shared or zeroed already)
            first = start // primary.config.draft_tokens_per_block
            for m, arena in zip(managers, self.arenas, strict=True):
                arena.zero_pages("draft", list(m.draft_block_table(rid))[first:])
        blocks = [BlockIds("attention", tuple(primary.block_table(rid)))]
        if primary.config.has_draft and draft:
            blocks.append(BlockIds("draft", tuple(primary.draft_block_table(rid))))
        slot = primary.slot_id(rid)
        request = ReceiveRequest(0, key, start, len(prompt), tuple(blocks), 0 if slot is None else slot)
        try:
            if self.staging is not None:
                # areas for the writers whose bytes land fragmented, while the pool has room
                request, rx_staging = offer_staging(
                    link.peer_map, request, self.pool_tensors(), self.staging, policy=self.bounce
                )
            session = link.receiver.new_session(key, ManagerHold(managers, rid), rx_staging)
        except BaseException:
            if rx_staging is not None:
                rx_staging.release()
            raise
        # from here the receiver owns the pages and the staging: freed or quarantined as the transfer ends
        request = attrs.evolve(request, session_id=session.session_id)
        stats = await link.receiver.receive(session, request)
        self._transfers.append(stats)
        self._counts["reused_tokens"] += start
        self._counts["saved_bytes"] += self._saved_bytes(start)
        now = time.perf_counter()
        self._windows.append((now - stats.seconds, now))
        return stats

    def _saved_bytes(self, start: int) -> int:
        """Bytes a transfer from token ``start`` did not move: the pages before it, on every rank."""
        if not start:
            return 0
        total = 0
        for arena in self.arenas:
            layout = arena.layout
            for group in ("attention", "draft"):
                if layout.has_group(group):
                    per_block = layout.layer_group(group).tokens_per_block
                    total += start // per_block * layout.page_bytes(group)
        return total

    def transfers(self) -> list[TransferStatistics]:
        return list(self._transfers)

    def statistics(self) -> dict[str, int]:
        """Completed transfers, writers that bounced over them, staging bytes in use, and the receiver's counts."""
        receiver: dict[str, int] = {}
        for link in self.links:
            for name, value in link.receiver.statistics().items():
                receiver[name] = receiver.get(name, 0) + value
        return {
            **receiver,
            **self._counts,
            "transfers": len(self._transfers),
            "bounced": sum(t.bounced for t in self._transfers),
            "staging_used": 0 if self.staging is None else self.staging.used,
        }

    def transfer_seconds(self, first: int = 0) -> float:
        """Wall seconds during which at least one of the completed transfers ``first..`` was in flight
        (overlapping transfers counted once; from each receive request to its last report)."""
        busy, end = 0.0, -math.inf
        for a, b in sorted(self._windows[first:]):
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        return busy

    def __repr__(self) -> str:
        return f"<GenerationWorker links={self.links!r} transfers={len(self._transfers)}>"
