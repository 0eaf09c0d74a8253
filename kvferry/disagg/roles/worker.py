"""What both engine roles share: an engine whose cache is swapped for a :class:`~.handoff_cache.HandoffCache`,
a bounded staging pool, memory registered once for the worker's life, the peer-facing description of both,
and the deadlines every wait on the peer is bounded by.

Memory registration: each worker registers its arenas and its staging buffer with its transport exactly once
(:meth:`Worker.register`, called by ``serve`` / ``connect`` before the handshake) and never deregisters them
while the transport lives: NIXL refuses the metadata of a region registered at device addresses that an earlier,
deregistered region used on the same live connection.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
from attrs import define

from kvferry.disagg.mapping import BouncePolicy
from kvferry.disagg.protocol import PeerInfo, PeerRole
from kvferry.disagg.roles.handoff_cache import HandoffCache, install
from kvferry.disagg.staging import StagingPool
from kvferry.engine.engine import Engine
from kvferry.engine.runner import BuiltEngine
from kvferry.errors import ConfigError
from kvferry.pools.pagetable import PageTable
from kvferry.transports import Registration, Transport

__all__ = [
    "DEFAULT_CONTROL_TIMEOUT",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_PREFILL_TIMEOUT",
    "DEFAULT_STAGING_BYTES",
    "Worker",
    "positive",
]

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

    def __attrs_post_init__(self) -> None:
        self.staging = _staging_pool(self.built, self.staging_bytes)
        self.cache = install(self.built)
        # peers write into (or read from) the arenas registered here, by the page tables of the handshake
        self.built.engine.rebalance_forbidden = "a disaggregated engine's memory is registered with its peers; it cannot be replaced while it serves"

    @property
    def engine(self) -> Engine:
        return self.built.engine

    async def register(self) -> None:
        """Register the arenas and the staging buffer with the transport; once for the worker's life (later
        calls do nothing; nothing is ever deregistered: the transport's close does it)."""
        if self.registrations:
            return
        built = self.built
        out = [await self.transport.register([t for a in built.arenas for t in a.pool_tensors().values()])]
        if self.staging is not None:
            out.append(await self.transport.register(self.staging.buffer))
        self.registrations = tuple(out)

    def page_tables(self) -> tuple[PageTable, ...]:
        """Every rank's page table (one arena per rank)."""
        return tuple(arena.page_table() for arena in self.built.arenas)

    def pool_tensors(self) -> list[Any]:
        """Every rank's pool tensors (``CacheArena.pool_tensors()``), by rank."""
        return [a.pool_tensors() for a in self.built.arenas]

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
