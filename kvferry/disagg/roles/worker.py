"""What both engine roles share: an engine whose cache is swapped for a :class:`~.handoff_cache.HandoffCache`,
a bounded staging pool, memory registered once for the worker's life, the peer-facing description of both,
and the deadlines every wait on the peer is bounded by.

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
from collections.abc import Sequence
from typing import Any, ClassVar

import anyio
import anyio.abc
import attrs
from attrs import define

from kvferry.disagg.mapping import BouncePolicy
from kvferry.disagg.protocol import (
    PeerInfo,
    PeerRole,
    TablesUpdate,
    check_pairing,
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
    registrations: tuple[Registration, ...] = attrs.field(default=(), init=False)
    #: the registration of the arenas in use and the arenas it covers (None: not registered yet)
    _arena_registration: Registration | None = attrs.field(default=None, init=False)
    _registered: tuple[CacheArena, ...] = attrs.field(default=(), init=False)
    #: rebalances published to the peers (the epoch of the last TablesUpdate sent)
    epoch: int = attrs.field(default=0, init=False)
    #: held while the registration or the peers' tables change (a handshake holds it too: no update is missed)
    tables_lock: anyio.Lock = attrs.field(factory=anyio.Lock, init=False)

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
            tasks.start_soon(self.publish_tables)

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

    async def register(self) -> None:
        """Register the arenas in use and the staging buffer with the transport; once (later calls do nothing:
        memory a rebalance puts in place is registered by :meth:`publish_tables`)."""
        if self._arena_registration is not None:
            return
        await self._register_arenas()
        if self.staging is not None:
            self.registrations = (*self.registrations, await self.transport.register(self.staging.buffer))

    async def _register_arenas(self) -> Registration | None:
        """Register the arenas in use; the registration of the arenas they replace (None the first time)."""
        arenas = self.arenas
        registration = await self.transport.register([t for a in arenas for t in a.pool_tensors().values()])
        old = self._arena_registration
        self._arena_registration, self._registered = registration, arenas
        self.registrations = (registration, *self.registrations[1:])
        return old

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

    def accepts(self, remote: PeerInfo, epoch: int, update: TablesUpdate) -> bool:
        """Whether a peer's page-table update applies: its epoch is above ``epoch`` (the last applied), it
        changes only what a rebalance can (:func:`~kvferry.disagg.protocol.check_update` against ``remote``,
        the peer's tables now) and the peers still pair. A refusal is logged; the caller keeps the old tables."""
        if update.epoch <= epoch:
            return False
        try:
            check_update(remote, update.info)
            if self.ROLE is PeerRole.CONTEXT:
                check_pairing(self.info(), update.info)
            else:
                check_pairing(update.info, self.info())
        except PeerIncompatible as exc:
            log.warning("page-table update of %s refused: %s", remote.transport_address, exc)
            return False
        return True

    async def publish_tables(self) -> bool:
        """If a rebalance replaced the engine's pools since the last call, register the new memory, send every
        connected peer a :class:`~kvferry.disagg.protocol.TablesUpdate` and rebuild this side's maps to them;
        whether anything was published. Both roles call it before they send anything that refers to their
        pools; :meth:`rebalance` calls it at once.

        A peer that cannot be told (it went away, its send timed out) is skipped: it is gone, or its transfers
        fail on the old tables with typed errors. Shielded from cancellation (a half-published update would
        leave the peers' tables undefined).
        """
        if self._arena_registration is None or (self._current() and not self.tables_lock.locked()):
            return False
        # a publish under way (the arenas registered, the update not yet sent) is waited for
        with anyio.CancelScope(shield=True):
            async with self.tables_lock:
                published = await self.publish_locked()
        return published

    async def publish_locked(self) -> bool:
        """:meth:`publish_tables` for a caller that holds :attr:`tables_lock` (a handshake)."""
        if self._arena_registration is None or self._current():
            return False
        old = await self._register_arenas()
        self.epoch += 1
        message = encode_control(TablesUpdate(self.epoch, self.info()))
        peers = self._peers()
        for peer in peers:
            with (
                anyio.move_on_after(self.handshake_timeout),
                contextlib.suppress(PeerDisconnected, KvferryError),
            ):
                await self.transport.send_message(peer, message)
        self._tables_applied()
        if old is not None:
            # nothing refers to the old arenas any more: the engine refused the rebalance while a transfer
            # could touch them, and the peers learnt the new tables before anything that refers to those
            await self.transport.deregister(old)
        log.info("published the page tables of epoch %d to %d peers", self.epoch, len(peers))
        return True

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
        """Every rank's page table (one arena per rank)."""
        return tuple(arena.page_table() for arena in self.arenas)

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
