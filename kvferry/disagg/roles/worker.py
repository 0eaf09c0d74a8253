"""What both engine roles share: an engine whose cache is swapped for a :class:`~.handoff_cache.HandoffCache`,
a bounded staging pool, its memory's registration and the page tables its peers know (kept current across
rebalances), the peer-facing description of both, and the deadlines every wait on the peer is bounded by.

Memory registration: each worker registers its arenas and its staging buffer with its transport
(:meth:`Worker.register`, called by ``serve`` / ``connect`` before the handshake).

Rebalance: the engine may replace its pools while serving (:meth:`Worker.rebalance`, or
:meth:`Engine.rebalance <kvferry.engine.engine.Engine.rebalance>` directly). The new arenas are then registered
and every connected peer is sent a :class:`~kvferry.disagg.protocol.TablesUpdate` with the new page tables
(:meth:`Worker.publish_tables`) before this side sends anything that refers to the new memory: the generation
side before its next receive request, the context side before its next push (the control channel is ordered, so
the peer has applied the update before it reads that message). The old arenas are deregistered once the update
is out; no transfer touches them then, since the engine refuses a rebalance while one may. On CUDA, NIXL may refuse
the metadata of a later region registered at a device address a deregistered one used (``cudaMalloc`` reuses
addresses): NIXL writes into that region then fail with :class:`~kvferry.errors.RegionError` (CUDA IPC and host
paths are not affected; see :mod:`kvferry.transports.nixl`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import anyio
import anyio.abc
import attrs
from attrs import define

from kvferry.disagg.mapping import BouncePolicy, PeerMap
from kvferry.disagg.protocol import (
    PeerInfo,
    PeerRole,
    TablesUpdate,
    check_update,
    encode_control,
)
from kvferry.disagg.roles.handoff_cache import HandoffCache, install
from kvferry.disagg.staging import StagingPool
from kvferry.engine.engine import Engine
from kvferry.engine.runner import BuiltEngine
from kvferry.errors import ConfigError, KvferryError, PeerDisconnected, PeerIncompatible
from kvferry.pools.arena import CacheArena
from kvferry.pools.pagetable import PageTable
from kvferry.transports import Peer, Registration, Transport

__all__ = [
    "DEFAULT_CONTROL_TIMEOUT",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_PREFILL_TIMEOUT",
    "DEFAULT_STAGING_BYTES",
    "Worker",
    "positive",
]

log = logging.getLogger("kvferry.disagg")

#: Bytes of each worker's staging pool (bounced transfers), on the arenas' device; 0 turns bouncing off.
DEFAULT_STAGING_BYTES = 64 << 20

#: Seconds the generation side waits for a prefill's answer without any answer from that context engine (to this
#: prefill or another): a queue on a working engine is waited for however long, and a context engine that stopped
#: answering (stopped, wedged, partitioned with the connection up) fails its requests with
#: :class:`~kvferry.errors.PrefillTimeout` instead of holding them for ever.
DEFAULT_PREFILL_TIMEOUT = 60.0
#: Seconds the handshake may take (both sides send their PeerInfo right after connecting).
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
#: Seconds a best-effort control message may take (ReleaseContext, CancelTransfer, CancelAck): it is given up
#: after that (the peer's own deadlines free what it held).
DEFAULT_CONTROL_TIMEOUT = 1.0


def positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    """attrs validator: a deadline of more than 0 seconds."""
    if not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0 seconds, got {value}")


def _tensors(arenas: Sequence[CacheArena]) -> list[Any]:
    """Every pool tensor of ``arenas``, rank by rank."""
    return [t for a in arenas for t in a.pool_tensors().values()]


def _staging_pool(built: BuiltEngine, nbytes: int) -> StagingPool | None:
    if nbytes < 0:
        raise ConfigError(f"staging_bytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return None
    device = next(iter(built.arenas[0].pool_tensors().values())).device
    return StagingPool.allocate(nbytes, device)


@define(eq=False)
class Worker:
    """An engine role's engine, transport, staging pool and registrations (see the module docstring).

    Construct a :class:`~.context.ContextWorker` or a :class:`~.generation.GenerationWorker`; construction swaps
    the engine's cache (do it before the engine starts) and allocates the staging pool.
    """

    #: the role this worker plays (what the handshake says)
    ROLE: ClassVar[PeerRole]

    built: BuiltEngine
    transport: Transport
    #: seconds the handshake with the peer may take (:func:`~kvferry.disagg.link.exchange_hello`)
    handshake_timeout: float = attrs.field(default=DEFAULT_HANDSHAKE_TIMEOUT, validator=positive)
    #: seconds a best-effort control message may take
    control_timeout: float = attrs.field(default=DEFAULT_CONTROL_TIMEOUT, validator=positive)
    #: bytes of this worker's staging pool (0: never bounce)
    staging_bytes: int = DEFAULT_STAGING_BYTES
    #: when a transfer is fragmented enough to bounce: the context side's writers bounce by it (when offered an
    #: area), the generation side offers areas by it (judged on its own fragments)
    bounce: BouncePolicy = attrs.field(factory=BouncePolicy)
    cache: HandoffCache = attrs.field(init=False)
    staging: StagingPool | None = attrs.field(init=False)
    #: the registration of the arenas the peers know (None: not registered yet), and those arenas
    _arena_registration: Registration | None = attrs.field(default=None, init=False)
    _registered: tuple[CacheArena, ...] = attrs.field(default=(), init=False)
    _staging_registration: Registration | None = attrs.field(default=None, init=False)
    #: publishes so far (the epoch of the last TablesUpdate sent)
    epoch: int = attrs.field(default=0, init=False)
    #: held while the registration or the peers' tables change, and while a new peer joins the peers told
    tables_lock: anyio.Lock = attrs.field(factory=anyio.Lock, init=False)
    #: a publish is under way (the new arenas may be registered before every peer was told)
    _publishing: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        self.staging = _staging_pool(self.built, self.staging_bytes)
        self.cache = install(self.built)
        self.engine.on_rebalance(self._pools_replaced)

    def _pools_replaced(self, arenas: Sequence[CacheArena]) -> None:
        """(The engine's rebalance callback, at its step boundary.) Publish the new tables soon, in a task group
        of a peer's (the next transfer would publish them anyway; this frees the old arenas sooner and keeps
        the peers' view current)."""
        tasks = self._task_group()
        if tasks is not None:
            tasks.start_soon(self._publish_soon)

    async def _publish_soon(self) -> None:
        try:
            await self.publish_tables()
        except KvferryError as exc:  # the publish before the next transfer tries again
            log.warning("publishing the page tables after a rebalance failed: %s", exc)

    def _task_group(self) -> anyio.abc.TaskGroup | None:
        """A task group that lives as long as a connected peer (None: no peer)."""
        return None

    @property
    def engine(self) -> Engine:
        return self.built.engine

    @property
    def arenas(self) -> tuple[CacheArena, ...]:
        """The arenas the engine's pools live in now, one per rank (a rebalance replaces them)."""
        arenas = tuple(m.arena for m in self.cache.managers)
        return arenas if all(a is not None for a in arenas) else self.built.arenas

    @property
    def registrations(self) -> tuple[Registration, ...]:
        """The registrations held: the arenas the peers know, and the staging buffer."""
        return tuple(r for r in (self._arena_registration, self._staging_registration) if r is not None)

    async def register(self) -> None:
        """Register the arenas in use and the staging buffer with the transport (what is registered already is
        left as it is: arenas a rebalance puts in place are registered by :meth:`publish_tables`). A cancel
        leaves registered what was."""
        if self._arena_registration is None:
            arenas = self.arenas
            self._arena_registration = await self.transport.register(_tensors(arenas))
            self._registered = arenas
        if self.staging is not None and self._staging_registration is None:
            self._staging_registration = await self.transport.register(self.staging.buffer)

    def _current(self) -> bool:
        """Whether the registered arenas are the ones in use."""
        arenas = self.arenas
        return len(arenas) == len(self._registered) and all(
            a is b for a, b in zip(arenas, self._registered, strict=True)
        )

    def _peers(self) -> Sequence[Peer]:
        """The connected peers that must hear of new page tables."""
        return ()

    def _tables_applied(self) -> None:
        """This side's tables changed: rebuild what was derived from them (the rank maps to each peer)."""

    def _peer_map(self, remote: PeerInfo) -> PeerMap:
        """The rank map between this side's tables and a peer's (senders first)."""
        raise NotImplementedError

    def _updated_map(self, remote: PeerInfo, epoch: int, update: TablesUpdate) -> PeerMap | None:
        """The rank map to a peer's new tables, where its update applies: its epoch is above ``epoch`` (the last
        applied), it changes only what a rebalance can (:func:`~kvferry.disagg.protocol.check_update` against
        ``remote``, its tables now) and the new tables map. None otherwise (a stale update is ignored, a refusal
        is logged); the caller then keeps the old tables."""
        if update.epoch <= epoch:
            return None
        try:
            check_update(remote, update.info)
            return self._peer_map(update.info)
        except (PeerIncompatible, ConfigError) as exc:
            log.warning("page-table update of %s refused: %s", remote.transport_address, exc)
            return None

    async def publish_tables(self) -> bool:
        """If a rebalance replaced the engine's pools since the last call, register the new memory, send every
        connected peer a :class:`~kvferry.disagg.protocol.TablesUpdate`, rebuild this side's maps to them and
        deregister the old arenas; whether anything was published. Both roles call it before they send anything
        that refers to their pools; :meth:`rebalance` calls it at once, and a rebalance of the engine starts it.

        A publish under way is waited for. A cancel while waiting leaves nothing changed; the publish itself is
        shielded (a half-published update would leave the peers' tables undefined). A peer that cannot be told
        within ``handshake_timeout`` is closed (its link is gone; it would otherwise write by old tables).
        """
        if self._arena_registration is None or (self._current() and not self._publishing):
            return False
        published = False
        async with self.tables_lock:
            with anyio.CancelScope(shield=True):
                published = await self._publish_locked()
        return published

    async def _publish_locked(self) -> bool:
        """:meth:`publish_tables` for a caller that holds :attr:`tables_lock`."""
        if self._arena_registration is None or self._current():
            return False
        self._publishing = True
        try:
            arenas = self.arenas
            registration = await self.transport.register(_tensors(arenas))
            old, self._arena_registration, self._registered = self._arena_registration, registration, arenas
            self.epoch += 1
            message = encode_control(TablesUpdate(self.epoch, self.info()))
            peers = self._peers()
            for peer in peers:
                await self._tell(peer, message)
            self._tables_applied()
            # nothing refers to the old arenas any more: the engine refused the rebalance while a transfer could
            # touch them, and the peers learnt the new tables before anything that refers to those
            await self.transport.deregister(old)
        finally:
            self._publishing = False
        log.info("published the page tables of epoch %d to %d peers", self.epoch, len(peers))
        return True

    async def _tell(self, peer: Peer, message: bytes) -> None:
        """Send a peer a page-table update; close it where that fails (it is gone, or would write by old tables)."""
        with anyio.move_on_after(self.handshake_timeout) as scope:
            try:
                await self.transport.send_message(peer, message)
                return
            except PeerDisconnected:
                return
            except KvferryError as exc:
                log.warning("cannot send new page tables to %s (%s): closing it", peer, exc)
        if scope.cancelled_caught:
            log.warning("no new page tables sent to %s within %s s: closing it", peer, self.handshake_timeout)
        with contextlib.suppress(KvferryError, OSError):
            await peer.aclose()

    async def joined(self, peer: Peer, told: int, remap: Callable[[], None]) -> None:
        """(Under :attr:`tables_lock`, once a new peer is among :meth:`_peers`.) Where a publish ran during its
        handshake (its hello held the tables of epoch ``told``), send it the tables since, and ``remap``."""
        if self.epoch != told:
            await self._tell(peer, encode_control(TablesUpdate(self.epoch, self.info())))
            remap()

    async def rebalance(
        self,
        *,
        num_pages: int | None = None,
        num_slots: int | None = None,
        num_draft_pages: int | None = None,
    ) -> None:
        """Resize the engine's pools while it serves (:meth:`Engine.rebalance
        <kvferry.engine.engine.Engine.rebalance>`: refused with :class:`~kvferry.errors.RebalanceRefused` while
        a transfer may touch them), then publish the new tables to every peer (:meth:`publish_tables`).

        A cancel while waiting for the step boundary leaves the rebalance asked for; the tables are then
        published before this side next sends anything that refers to its pools.
        """
        await self.engine.rebalance(num_pages=num_pages, num_slots=num_slots, num_draft_pages=num_draft_pages)
        await self.publish_tables()

    def page_tables(self) -> tuple[PageTable, ...]:
        """Every rank's page table (one arena per rank) as the peers know them: of the registered arenas (the
        arenas in use until the first registration)."""
        return tuple(arena.page_table() for arena in (self._registered or self.arenas))

    def pool_tensors(self) -> list[Any]:
        """Every rank's pool tensors (``CacheArena.pool_tensors()``), by rank."""
        return [a.pool_tensors() for a in self.arenas]

    def info(self) -> PeerInfo:
        """What the handshake tells the peer about this worker."""
        tables = self.page_tables()
        return PeerInfo(
            self.ROLE,
            str(getattr(self.transport, "instance_id", "")),
            self.transport.name,
            self.transport.address,
            len(tables),
            tables,
        )
