"""Engine roles: a context worker prefills and hands off; a generation worker receives and decodes.

Both wrap an :class:`~kvferry.engine.engine.Engine` built by :func:`~kvferry.engine.runner.build_engine` and
change nothing inside it. Each swaps the engine's cache for a :class:`HandoffCache` adapter:

- context: the prompt runs as ``generate(prompt, max_tokens=1)``; when the engine then closes the request, the
  adapter *holds* it instead (suspended with ``Offload.NEVER``: a transfer reads its pages) until the push is
  done or the router releases it;
- generation: the transferred request is *adopted*: the engine's ``create``/``resume`` of it report the whole
  prompt committed, and its :class:`~kvferry.engine.request.Request` already holds the first token, so the
  engine's first step for it is exactly the decode (or verify) step an aggregated engine would take.

The generation side allocates (pages for the whole prompt, a state slot, draft pages), zero-fills the draft pages
when draft KV is not transferred (stale bytes must never reach the drafter), and sends the receive request; the
generation side starts with ``num_accepted = 0`` and empty replay buffers (the manager's first resume).

Memory registration: each worker registers its arenas and its staging buffer with its transport exactly once
(:meth:`ContextWorker.register` / :meth:`GenerationWorker.register`, called by ``serve`` / ``connect`` before
the handshake) and never deregisters them while the transport lives: NIXL refuses the metadata of a region
registered at device addresses that an earlier, deregistered region used on the same live connection.
Registered is not writable: the generation side grants its context peer, per transfer, only the bytes that
transfer writes (:func:`~.transfer.destinations`, granted by the :class:`~.session.Receiver` before the receive
request and revoked when the pages go back), so nobody else connected to its transport writes its pools.

Deadlines: every wait on the peer is bounded and ends in a typed error. The generation side waits at most
``prefill_timeout`` for a prefill's answer (:class:`~kvferry.errors.PrefillTimeout`; the context side is then
told to drop the request, which stops its prefill or frees its held cache), ``stall_timeout`` between a
transfer's reports, ``handshake_timeout`` for the handshake (both sides, :class:`~kvferry.errors.PeerTimeout`),
``control_timeout`` for a best-effort control message; the context side holds a prefilled cache at most
``hold_timeout`` for its receive request. Sends and writes are bounded by the transport's stall deadline.

Cancelling a prefill at any point (before its first step, during a step, between a step and its commit, during
the push) ends the request's stream first; :meth:`HandoffCache.release` then frees the cache once the engine no
longer has the request (the engine frees it at its next step boundary), never under a step it may still run.

Bounce: each worker owns one bounded :class:`~.staging.StagingPool` (``staging_bytes``, on the arenas' device).
The generation side offers staging areas in its receive requests to writers whose bytes land fragmented (by its
``bounce`` policy) while its pool has room; a context writer bounces when it was offered an area, its own
``bounce`` policy finds its plan fragmented and its own pool has room. Anything short of that is a direct write:
a full pool costs speed, never a transfer, and the tokens are the same either way.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import anyio
import attrs
from attrs import define

from kvferry.disagg.link import exchange_hello, pump
from kvferry.disagg.mapping import BouncePolicy, PeerMap, RequestCache
from kvferry.disagg.protocol import (
    BlockIds,
    CancelAck,
    CancelTransfer,
    ChunkStatus,
    ContextDone,
    ContextRequest,
    ControlBody,
    PeerInfo,
    PeerRole,
    ReceiveRequest,
    ReleaseContext,
    check_pairing,
    encode_control,
)
from kvferry.disagg.session import Receiver, SendSession, TransferStatistics, send
from kvferry.disagg.staging import ReceiveStaging, StagingPool
from kvferry.disagg.transfer import (
    ManagerHold,
    destinations,
    expected_writers,
    offer_staging,
    plan_transfer,
    prepare_source,
)
from kvferry.engine.engine import Engine
from kvferry.engine.runner import BuiltEngine, LockstepCache
from kvferry.errors import (
    ConfigError,
    KvferryError,
    PeerDisconnected,
    PrefillTimeout,
    TransferError,
    TransportError,
)
from kvferry.pools.manager import CacheState, Offload, Resumed
from kvferry.transports import Peer, Registration, Transport

__all__ = [
    "DEFAULT_CONTROL_TIMEOUT",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_PREFILL_TIMEOUT",
    "DEFAULT_STAGING_BYTES",
    "ContextWorker",
    "GenerationWorker",
    "Handoff",
    "HandoffCache",
]

#: Bytes of each worker's staging pool (bounced transfers), on the arenas' device; 0 turns bouncing off.
DEFAULT_STAGING_BYTES = 64 << 20

#: Seconds the generation side waits for the context side's answer to a prefill (ContextRequest to
#: ContextDone: queueing behind other prefills on the context engine included). Generous for any prompt a
#: context engine takes (a long prompt under load prefills in seconds), finite so that a context engine that
#: stopped answering (stopped, wedged, partitioned with the connection up) fails its requests with
#: :class:`~kvferry.errors.PrefillTimeout` instead of holding them for ever. The same as the context side's
#: ``hold_timeout``.
DEFAULT_PREFILL_TIMEOUT = 60.0
#: Seconds the handshake may take (both sides send their PeerInfo right after connecting).
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
#: Seconds a best-effort control message may take (ReleaseContext, CancelTransfer, CancelAck): it is given up
#: after that (the peer's own deadlines free what it held).
DEFAULT_CONTROL_TIMEOUT = 1.0

log = logging.getLogger("kvferry.disagg")


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0 seconds, got {value}")


# --- the cache adapter --------------------------------------------------------------------------------------


@define(eq=False)
class HandoffCache:
    """The engine's cache operations over a :class:`~kvferry.engine.runner.LockstepCache`, plus hand-off.

    ``hold(rid, callback)``: the engine's close of ``rid`` once its whole prompt is committed keeps the request
    (suspended, never offloaded) and calls ``callback(rid)`` instead. ``release(rid)`` closes it for good (see
    there: never under a step the engine may still run). ``adopt(rid, n)``: the request exists (transferred,
    ``n`` tokens committed, suspended); the engine's ``create`` skips it and its first ``resume`` reports ``n``
    tokens as reused.
    """

    inner: LockstepCache
    _hold: dict[int, Callable[[int], None]] = attrs.field(factory=dict, init=False)
    _adopted: dict[int, int] = attrs.field(factory=dict, init=False)
    #: requests the engine created and has not closed (it may still step them and commit their tokens), with
    #: their prompt lengths
    _engine_owned: dict[int, int] = attrs.field(factory=dict, init=False)

    @property
    def managers(self) -> tuple[Any, ...]:
        return self.inner.managers

    def hold(self, request_id: int, callback: Callable[[int], None]) -> None:
        self._hold[request_id] = callback

    def adopt(self, request_id: int, num_tokens: int) -> None:
        self._adopted[request_id] = num_tokens

    def create(self, request_id: int, prompt_token_ids: Sequence[int]) -> None:
        if request_id not in self._adopted:
            self.inner.create(request_id, prompt_token_ids)
        self._engine_owned[request_id] = len(prompt_token_ids)

    def resume(self, request_id: int) -> Resumed:
        info = self.inner.resume(request_id)
        adopted = self._adopted.pop(request_id, None)
        if adopted is not None:
            return attrs.evolve(info, reused_tokens=adopted, num_committed_tokens=adopted, first=True)
        return info

    def close(self, request_id: int) -> None:
        prompt = self._engine_owned.pop(request_id, None)
        self._adopted.pop(request_id, None)
        manager = self.inner.primary
        if (
            request_id in self._hold
            and request_id in manager.request_ids()
            and prompt is not None
            and manager.num_committed_tokens(request_id) >= prompt
        ):
            # only a request whose prompt is all committed is held: the scheduler also closes a request whose
            # admission did not fit (it creates it again later) and one cancelled before its prefill ended
            callback = self._hold.pop(request_id)
            if manager.state(request_id) is CacheState.ACTIVE:
                for m in self.inner.managers:
                    m.suspend(request_id, offload=Offload.NEVER)
            callback(request_id)
            return
        self.inner.close(request_id)

    def release(self, request_id: int) -> None:
        """Close request ``request_id`` for good: now if the engine is done with it (held, or never created),
        else when the engine closes it.

        The engine still has a request whose stream ended before its prefill did (a cancel): it frees it at its
        next step boundary, and until then may run a step that writes its pages and commit that step's tokens.
        Closing it here would free the pages under that step and make the engine's commit fail
        (:class:`~kvferry.errors.UnknownRequest` in its step loop), so the hold is dropped instead and the
        engine's own close frees it. The caller must have ended the request's stream (the engine then closes
        it at its next step boundary)."""
        self._hold.pop(request_id, None)
        if request_id not in self._engine_owned:
            self.inner.close(request_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _install(built: BuiltEngine) -> HandoffCache:
    """Swap the engine's (and its scheduler's) cache for a :class:`HandoffCache`, before the engine starts."""
    cache = HandoffCache(built.cache)
    built.engine.cache = cache
    built.engine.scheduler.cache = cache
    return cache


def _page_tables(built: BuiltEngine) -> tuple[Any, ...]:
    return tuple(arena.page_table() for arena in built.arenas)


def _staging_pool(built: BuiltEngine, nbytes: int) -> StagingPool | None:
    if nbytes < 0:
        raise ConfigError(f"staging_bytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return None
    device = next(iter(built.arenas[0].pool_tensors().values())).device
    return StagingPool.allocate(nbytes, device)


async def _register(
    transport: Transport, built: BuiltEngine, staging: StagingPool | None
) -> tuple[Registration, ...]:
    """Register every arena's pools and the staging buffer (one registration each, kept for life)."""
    out = [await transport.register([t for a in built.arenas for t in a.pool_tensors().values()])]
    if staging is not None:
        out.append(await transport.register(staging.buffer))
    return tuple(out)


def _pools(built: BuiltEngine) -> list[Any]:
    return [a.pool_tensors() for a in built.arenas]


def _info(role: PeerRole, transport: Transport, built: BuiltEngine) -> PeerInfo:
    tables = _page_tables(built)
    return PeerInfo(
        role,
        str(getattr(transport, "instance_id", "")),
        transport.name,
        transport.address,
        len(tables),
        tables,
    )


# --- context ----------------------------------------------------------------------------------------------


@define(eq=False)
class _Held:
    """One context request, from its arrival until its cache is freed."""

    ready: anyio.Event = attrs.field(factory=anyio.Event)
    #: the prefill (until it is answered): a ReleaseContext before the answer cancels it
    prefill: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    answered: bool = False
    request: ReceiveRequest | None = None
    released: bool = False
    #: the receiver cancelled the transfer before its push started: it never starts
    cancelled: bool = False


@define(eq=False)
class ContextWorker:
    """Serves one generation peer: prefills each :class:`~.protocol.ContextRequest` on its engine, answers
    :class:`~.protocol.ContextDone`, then pushes the request's cache when the receive request comes.

    A held cache is freed after its push (every posted write ended), on :class:`~.protocol.ReleaseContext`,
    when the peer goes away, or after ``hold_timeout`` seconds without a receive request. A
    :class:`~.protocol.ReleaseContext` that comes before the prefill was answered (the receiver stopped
    waiting for it: its ``prefill_timeout`` ran out) stops the prefill; it is never answered.

    A :class:`~.protocol.CancelTransfer` stops a push in progress (its writers then report every chunk, which
    releases the receiver's pages); for any other session (receive request never seen, seen but the push not
    started: it never starts, or push finished) it is answered with :class:`~.protocol.CancelAck`, on which
    the receiver releases its pages at once.
    """

    built: BuiltEngine
    transport: Transport
    #: seconds a prefilled cache is held for its receive request
    hold_timeout: float = attrs.field(default=60.0, validator=_positive)
    #: seconds the handshake with the generation peer may take (:func:`~.link.exchange_hello`)
    handshake_timeout: float = attrs.field(default=DEFAULT_HANDSHAKE_TIMEOUT, validator=_positive)
    #: seconds a best-effort control message may take (the CancelAck)
    control_timeout: float = attrs.field(default=DEFAULT_CONTROL_TIMEOUT, validator=_positive)
    #: bytes per chunk (None: one write per direct writer, default_chunk_bytes(memory) per bounced chunk)
    max_chunk_bytes: int | None = None
    #: seconds to wait before posting each chunk (0: none). Only for tests that need a transfer to last.
    write_delay: float = 0.0
    #: bytes of this worker's staging pool (0: never bounce)
    staging_bytes: int = DEFAULT_STAGING_BYTES
    #: when a writer that was offered a staging area bounces (its plan must look this fragmented)
    bounce: BouncePolicy = attrs.field(factory=BouncePolicy)
    cache: HandoffCache = attrs.field(init=False)
    staging: StagingPool | None = attrs.field(init=False)
    registrations: tuple[Registration, ...] = attrs.field(default=(), init=False)
    _held: dict[str, _Held] = attrs.field(factory=dict, init=False)
    _sending: dict[int, SendSession] = attrs.field(factory=dict, init=False)
    _counts: dict[str, int] = attrs.field(
        factory=lambda: dict.fromkeys(
            ("prefilled", "pushed", "released", "cancelled", "failed", "bytes", "fragments", "bounced"), 0
        ),
        init=False,
    )

    def __attrs_post_init__(self) -> None:
        self.staging = _staging_pool(self.built, self.staging_bytes)
        self.cache = _install(self.built)

    async def register(self) -> None:
        """Register the arenas and the staging buffer with the transport; once for the worker's life (later
        calls do nothing; nothing is ever deregistered: the transport's close does it)."""
        if not self.registrations:
            self.registrations = await _register(self.transport, self.built, self.staging)

    @property
    def engine(self) -> Engine:
        return self.built.engine

    def info(self) -> PeerInfo:
        return _info(PeerRole.CONTEXT, self.transport, self.built)

    async def serve(self, peer: Peer) -> None:
        """Handshake with the generation peer and serve it until it goes away (then free what it left).

        :raises ~kvferry.errors.PeerIncompatible: the peer serves another model / wire version.
        """
        await self.register()
        remote = await exchange_hello(self.transport, peer, self.info(), within=self.handshake_timeout)
        check_pairing(self.info(), remote)
        peer_map = PeerMap.build(list(self.info().page_tables), list(remote.page_tables))
        async with anyio.create_task_group() as tg:

            async def on_message(message: ControlBody) -> None:
                if isinstance(message, ContextRequest):
                    # known from now on: a ReleaseContext read before the task below first runs finds it
                    entry = self._held[message.key] = _Held()
                    tg.start_soon(self._prefill_and_push, peer, peer_map, remote, message, entry)
                elif isinstance(message, ReceiveRequest):
                    held = self._held.get(message.key)
                    if held is None:
                        # nothing is held for it (released, or its hold ran out): every writer fails it at
                        # once, so the receiver frees its pages instead of waiting into doubt
                        log.warning("receive request for unknown key %r", message.key)
                        tg.start_soon(
                            self._fail_request, peer, peer_map, message, f"no cache held for {message.key!r}"
                        )
                    else:
                        held.request = message
                        held.ready.set()
                elif isinstance(message, ReleaseContext):
                    held = self._held.get(message.key)
                    if held is not None:
                        held.released = True
                        held.ready.set()
                        if not held.answered:
                            held.prefill.cancel()  # nobody waits for its answer any more
                elif isinstance(message, CancelTransfer):
                    await self._cancel(peer, message)

            await pump(self.transport, peer, on_message=on_message)
            tg.cancel_scope.cancel()  # the peer is gone: stop prefills and pushes

    async def _cancel(self, peer: Peer, message: CancelTransfer) -> None:
        """The receiver cancelled session ``message.session_id``: stop its push, or say none can write."""
        session = self._sending.get(message.session_id)
        if session is not None:
            session.cancel()  # its writers report every chunk: the receiver releases its pages on the last one
            return
        for held in self._held.values():
            if held.request is not None and held.request.session_id == message.session_id:
                # received, push not started: _prefill_and_push checks this flag and, with no await between
                # the check and the session's registration in _sending, never pushes once it is set
                held.cancelled = True
                held.ready.set()
                reason = "the push was called off before it started"
                break
        else:
            # never received (the control channel is ordered: it never will be) or already pushed (every write
            # returned before the reports were sent)
            reason = "no push in progress"
        with anyio.move_on_after(self.control_timeout), contextlib.suppress(PeerDisconnected, KvferryError):
            await self.transport.send_message(peer, encode_control(CancelAck(message.session_id, reason)))

    async def _prefill_and_push(
        self, peer: Peer, peer_map: PeerMap, remote: PeerInfo, req: ContextRequest, held: _Held
    ) -> None:
        """Prefill ``req``, answer it, hold its cache and push it when asked.

        A cancel may come at any point (the peer went away, the receiver released the request, the worker
        stops): the request's stream then ends first (the engine frees the request at its next step boundary)
        and :meth:`HandoffCache.release` frees the cache only once the engine is done with it.
        """
        if held.released:  # released before this task first ran: nobody waits for its answer
            self._forget(req.key, held)
            self._counts["released"] += 1
            return
        try:
            # spec_k makes the runner keep the prompt's hidden states for the drafter (one token: nothing drafted)
            generation = self.engine.generate(
                req.prompt, max_tokens=1, seed=req.seed, temperature=req.temperature, spec_k=req.spec_k
            )
        except KvferryError as exc:  # a prompt the engine refuses (a token outside its vocabulary, say)
            self._forget(req.key, held)
            self._counts["failed"] += 1
            await self._answer(peer, ContextDone(req.key, 0, False, 0, error=f"{type(exc).__name__}: {exc}"))
            return
        rid = generation.request.request_id
        host_state = b""
        export_error: KvferryError | None = None
        runner = self.built.runner

        def on_hold(request_id: int) -> None:
            # runs when the engine ends the prefilled request, before anything else touches its pages: the
            # drafter catches up on the prompt here (its draft KV lands in the held draft pages)
            nonlocal host_state, export_error
            if req.spec_k > 0:
                try:
                    host_state = runner.export_handoff(request_id, generation.request.output_ids[-1])
                except KvferryError as exc:
                    export_error = exc

        wants_more = req.max_tokens > 1
        if wants_more:
            self.cache.hold(rid, on_hold)
        try:
            tokens: list[int] = []
            try:
                with held.prefill:
                    tokens = await generation.collect()
                if export_error is not None:
                    raise export_error
            except KvferryError as exc:
                held.answered = True
                self._counts["failed"] += 1
                await self._answer(
                    peer, ContextDone(req.key, 0, False, 0, error=f"{type(exc).__name__}: {exc}")
                )
                return
            if held.prefill.cancelled_caught:  # released before the answer: the receiver waits for none
                self._counts["released"] += 1
                return
            held.answered = True
            first = tokens[0]
            keep = wants_more and first not in req.stop_ids
            self._counts["prefilled"] += 1
            if not keep:
                self.cache.release(rid)
            await self._answer(
                peer, ContextDone(req.key, first, keep, len(req.prompt), host_state if keep else b"")
            )
            if not keep:
                return
            # the sender's side of the transfer, worked out while the receive request is on its way
            source = self._source(peer_map, rid, len(req.prompt))
            with anyio.move_on_after(self.hold_timeout):
                await held.ready.wait()
            if held.cancelled:
                self._counts["cancelled"] += 1
                return
            if held.request is None or held.released:
                self._counts["released"] += 1
                return
            # no await from the check above until _push registers the session in _sending: a CancelTransfer
            # finds the session either here (cancelled before the push) or sending (cancelled during it)
            await self._push(peer, peer_map, remote, rid, held.request, source)
        finally:
            self._forget(req.key, held)
            # synchronous: no cancel can interrupt it. The stream has ended (collect returned or raised), so the
            # engine has closed the request or will at its next step boundary: release frees it accordingly
            self.cache.release(rid)

    def _forget(self, key: str, held: _Held) -> None:
        if self._held.get(key) is held:  # not a later request that reuses the key
            del self._held[key]

    async def _fail_request(self, peer: Peer, peer_map: PeerMap, request: ReceiveRequest, why: str) -> None:
        """A receive request we cannot serve: every writer reports a failure (nothing is written), so the
        receiver completes it as failed and frees its pages."""
        session = SendSession(request.session_id, {w: [] for w in expected_writers(peer_map)})
        with contextlib.suppress(TransportError):
            for w in session.writers:
                await self.transport.send_message(
                    peer, encode_control(session.result(w, 0, ChunkStatus.FAILED, why))
                )
        self._counts["failed"] += 1

    def _blocks(self, rid: int) -> dict[str, list[int]]:
        manager = self.cache.inner.primary
        blocks = {"attention": list(manager.block_table(rid))}
        if manager.config.has_draft:
            blocks["draft"] = list(manager.draft_block_table(rid))
        return blocks

    def _source(self, peer_map: PeerMap, rid: int, prompt_tokens: int) -> RequestCache | None:
        """Request ``rid``'s cache with our side of a whole-prompt transfer mapped (None: it does not map; the
        push plans it again and fails the request as any unplannable one)."""
        manager = self.cache.inner.primary
        try:
            return prepare_source(
                peer_map,
                range(len(self.built.arenas)),
                self._blocks(rid),
                manager.slot_id(rid),
                prompt_tokens,
            )
        except KvferryError as exc:
            log.warning("cannot map request %d's side of its transfer ahead: %s", rid, exc)
            return None

    async def _push(
        self,
        peer: Peer,
        peer_map: PeerMap,
        remote: PeerInfo,
        rid: int,
        request: ReceiveRequest,
        source: RequestCache | None = None,
    ) -> None:
        """Plan and push request ``rid``'s transfer (``source``: its cache from :meth:`_source`, or None)."""
        # synchronous until the session is in _sending (see _prefill_and_push): keep it so
        manager = self.cache.inner.primary
        try:
            plan = plan_transfer(
                peer_map,
                range(len(self.built.arenas)),
                self._blocks(rid) if source is None else source,
                manager.slot_id(rid),
                request,
                list(remote.page_tables),
                max_chunk_bytes=self.max_chunk_bytes,
                policy=self.bounce,
                src_pools=_pools(self.built),
                staging=self.staging,
            )
        except KvferryError as exc:
            # a request we cannot serve: every writer reports a failure, so the receiver completes (failed)
            log.warning("cannot plan transfer %s: %s", request.session_id, exc)
            await self._fail_request(peer, peer_map, request, str(exc))
            return
        session = SendSession(request.session_id, plan)
        self._sending[request.session_id] = session
        transport = self.transport if self.write_delay <= 0 else _Paced(self.transport, self.write_delay)
        try:
            await send(cast(Transport, transport), peer, session)
        finally:
            self._sending.pop(request.session_id, None)
            session.release_staging()  # send() did (idempotent); here too if it never started
        stats = session.statistics()
        self._counts["bounced"] += sum(
            1 for chunks in plan.values() if chunks and chunks[0].staged is not None
        )
        self._counts["pushed"] += 1
        self._counts["bytes"] += stats["bytes"]
        self._counts["fragments"] += stats["fragments"]

    async def _answer(self, peer: Peer, message: ContextDone) -> None:
        await self.transport.send_message(peer, encode_control(message))

    def statistics(self) -> dict[str, int]:
        """Counts (``bounced``: writers that packed their bytes, bounce or half-bounce), held caches, sessions
        sending, staging bytes in use."""
        return {
            **self._counts,
            "held": len(self._held),
            "sending": len(self._sending),
            "staging_used": 0 if self.staging is None else self.staging.used,
        }

    def __repr__(self) -> str:
        return f"<ContextWorker {self.statistics()}>"


class _Paced:
    """A transport whose writes each start ``delay`` seconds late (everything else passes through)."""

    def __init__(self, transport: Transport, delay: float) -> None:
        self._transport = transport
        self._delay = delay

    async def write(self, *args: Any, **kwargs: Any) -> Any:
        await anyio.sleep(self._delay)
        return await self._transport.write(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# --- generation -------------------------------------------------------------------------------------------


@define(eq=False)
class Handoff:
    """What the router learned from the context side for one request."""

    key: str
    first_token: int
    held: bool
    host_state: bytes


@define(eq=False)
class GenerationWorker:
    """Receives transferred caches from one context peer and decodes them on its engine.

    Use :meth:`connect` (handshake + reader), then :meth:`prefill_remote` and :meth:`decode` per request.

    Every wait on the context peer has a deadline: the handshake (``handshake_timeout``), a prefill's answer
    (``prefill_timeout``: :class:`~kvferry.errors.PrefillTimeout`), each transfer's reports (``stall_timeout``:
    :class:`~kvferry.errors.TransferInDoubt`), best-effort control messages (``control_timeout``); control
    messages and writes are bounded by the transport's own stall deadline.
    """

    built: BuiltEngine
    transport: Transport
    #: seconds without a report while a transfer's writers are still out (then in doubt, pages quarantined)
    stall_timeout: float = attrs.field(default=30.0, validator=_positive)
    transfer_draft: bool = True
    #: bytes of this worker's staging pool (0: never offer staging)
    staging_bytes: int = DEFAULT_STAGING_BYTES
    #: which writers are offered a staging area (judged on the receiver's own fragments)
    bounce: BouncePolicy = attrs.field(factory=BouncePolicy)
    #: seconds from sending a prefill to its answer (see :data:`DEFAULT_PREFILL_TIMEOUT`)
    prefill_timeout: float = attrs.field(default=DEFAULT_PREFILL_TIMEOUT, validator=_positive)
    #: seconds the handshake with the context peer may take (:func:`~.link.exchange_hello`)
    handshake_timeout: float = attrs.field(default=DEFAULT_HANDSHAKE_TIMEOUT, validator=_positive)
    #: seconds a best-effort control message may take (ReleaseContext, CancelTransfer)
    control_timeout: float = attrs.field(default=DEFAULT_CONTROL_TIMEOUT, validator=_positive)
    cache: HandoffCache = attrs.field(init=False)
    staging: StagingPool | None = attrs.field(init=False)
    registrations: tuple[Registration, ...] = attrs.field(default=(), init=False)
    peer: Peer | None = attrs.field(default=None, init=False)
    remote: PeerInfo | None = attrs.field(default=None, init=False)
    peer_map: PeerMap | None = attrs.field(default=None, init=False)
    receiver: Receiver | None = attrs.field(default=None, init=False)
    _waiting: dict[str, tuple[anyio.Event, list[ContextDone]]] = attrs.field(factory=dict, init=False)
    #: the reader ended: the peer is gone
    _gone: bool = attrs.field(default=False, init=False)
    _transfers: list[TransferStatistics] = attrs.field(factory=list, init=False)
    _windows: list[tuple[float, float]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        self.staging = _staging_pool(self.built, self.staging_bytes)
        self.cache = _install(self.built)

    @property
    def engine(self) -> Engine:
        return self.built.engine

    def info(self) -> PeerInfo:
        return _info(PeerRole.GENERATION, self.transport, self.built)

    async def register(self) -> None:
        """Register the arenas and the staging buffer with the transport; once for the worker's life (later
        calls do nothing; nothing is ever deregistered: the transport's close does it)."""
        if not self.registrations:
            self.registrations = await _register(self.transport, self.built, self.staging)

    async def connect(self, peer: Peer, task_group: anyio.abc.TaskGroup) -> PeerInfo:
        """Handshake with the context peer and start reading from it in ``task_group``.

        :raises ~kvferry.errors.PeerIncompatible: another model / wire version (only this peer is affected).
        """
        await self.register()
        remote = await exchange_hello(self.transport, peer, self.info(), within=self.handshake_timeout)
        pairing = check_pairing(remote, self.info())
        if not pairing.draft:
            self.transfer_draft = False
        peer_map = PeerMap.build(list(remote.page_tables), list(self.info().page_tables))
        self.peer, self.remote, self.peer_map = peer, remote, peer_map
        self.receiver = Receiver(
            self.transport,
            peer,
            expected_writers(peer_map),
            self.stall_timeout,
            control_timeout=self.control_timeout,
            destinations=partial(destinations, peer_map),
        )
        self._gone = False
        task_group.start_soon(self._read)
        return remote

    async def _read(self) -> None:
        assert self.peer is not None and self.receiver is not None

        receiver = self.receiver

        async def on_message(message: ControlBody) -> None:
            if isinstance(message, ContextDone):
                waiting = self._waiting.get(message.key)
                if waiting is not None:
                    waiting[1].append(message)
                    waiting[0].set()
            elif isinstance(message, CancelAck):
                receiver.on_cancel_ack(message)  # no write of that session can land: release its pages

        try:
            await pump(self.transport, self.peer, self.receiver, on_message=on_message)
        finally:
            self._gone = True
            for event, _ in self._waiting.values():
                event.set()  # the peer is gone (or we stopped reading): wake every waiter

    async def prefill_remote(self, request: ContextRequest) -> Handoff:
        """Ask the context peer to prefill; returns its first token (and whether it holds the cache).

        Waits at most ``prefill_timeout`` seconds for the answer. Whenever this ends without an answer (the
        deadline, a cancel, a failed send) the context side is told to drop the request (best effort, at most
        ``control_timeout`` seconds): it stops the prefill, or frees the cache it holds for it; nothing stays
        allocated here.

        :raises ~kvferry.errors.PrefillTimeout: no answer within ``prefill_timeout`` seconds.
        :raises ~kvferry.errors.TransferError: the context side failed or went away.
        """
        if self.peer is None:
            raise TransferError(f"request {request.key}: not connected to a context peer")
        if self._gone:
            raise TransferError(f"request {request.key}: the context peer went away before prefilling it")
        event = anyio.Event()
        answers: list[ContextDone] = []
        self._waiting[request.key] = (event, answers)
        try:
            with anyio.move_on_after(self.prefill_timeout):
                await self.transport.send_message(self.peer, encode_control(request))
                await event.wait()
        except BaseException:
            self._waiting.pop(request.key, None)
            if not answers or answers[0].held:  # nobody will take the cache it prefills or holds
                with anyio.CancelScope(shield=True):
                    await self.release_remote(request.key)
            raise
        self._waiting.pop(request.key, None)
        if not event.is_set():
            with anyio.CancelScope(shield=True):
                await self.release_remote(request.key)
            raise PrefillTimeout(
                f"request {request.key}: no answer from the context peer within {self.prefill_timeout} s"
            )
        if not answers:
            raise TransferError(f"request {request.key}: the context peer went away before prefilling it")
        done = answers[0]
        if done.error:
            raise TransferError(f"request {request.key}: the context side failed: {done.error}")
        return Handoff(done.key, done.first_token, done.held, done.host_state)

    async def release_remote(self, key: str) -> None:
        """Tell the context side to drop a held cache, or to stop a prefill it has not answered (best effort,
        at most ``control_timeout`` seconds)."""
        if self.peer is not None and not self._gone:
            with (
                anyio.move_on_after(self.control_timeout),
                contextlib.suppress(PeerDisconnected, KvferryError),
            ):
                await self.transport.send_message(self.peer, encode_control(ReleaseContext(key)))

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

    async def receive(self, rid: int, prompt: Sequence[int], key: str) -> TransferStatistics:
        """Allocate ``rid``'s cache for the whole prompt, receive it, commit it and leave it suspended for the
        engine to adopt. Writers whose bytes land fragmented are offered staging areas (see the module
        docstring). On any failure or cancel the allocation and the staging areas are freed (or quarantined
        until the writers report) and nothing is left behind.
        """
        assert self.receiver is not None
        managers = self.cache.managers
        created: list[Any] = []
        try:
            for m in managers:
                m.create(rid, prompt, reuse=False)
                created.append(m)
                m.resume(rid)
        except BaseException:
            for m in created:
                m.close(rid)
            raise
        rx_staging: ReceiveStaging | None = None
        try:
            primary = managers[0]
            if primary.config.has_draft and not self.transfer_draft:
                # stale bytes from recycled pages must never reach the drafter
                for m, arena in zip(managers, self.built.arenas, strict=True):
                    arena.zero_pages("draft", list(m.draft_block_table(rid)))
            blocks = [BlockIds("attention", tuple(primary.block_table(rid)))]
            if primary.config.has_draft and self.transfer_draft:
                blocks.append(BlockIds("draft", tuple(primary.draft_block_table(rid))))
            slot = primary.slot_id(rid)
            request = ReceiveRequest(0, key, 0, len(prompt), tuple(blocks), 0 if slot is None else slot)
            if self.staging is not None and self.peer_map is not None:
                # areas for the writers whose bytes land fragmented, while the pool has room
                request, rx_staging = offer_staging(
                    self.peer_map, request, _pools(self.built), self.staging, policy=self.bounce
                )
            session = self.receiver.new_session(key, ManagerHold(managers, rid), rx_staging)
        except BaseException:
            if rx_staging is not None:
                rx_staging.release()
            for m in managers:
                m.close(rid)
            raise
        # from here the receiver owns the pages and the staging: freed or quarantined as the transfer ends
        request = attrs.evolve(request, session_id=session.session_id)
        stats = await self.receiver.receive(session, request)
        for m in managers:
            m.commit(rid, prompt)
            m.suspend(rid)
        self.cache.adopt(rid, len(prompt))
        self._transfers.append(stats)
        now = time.perf_counter()
        self._windows.append((now - stats.seconds, now))
        return stats

    def transfers(self) -> list[TransferStatistics]:
        return list(self._transfers)

    def statistics(self) -> dict[str, int]:
        """Completed transfers, writers that bounced over them, staging bytes in use, and the receiver's counts."""
        receiver = {} if self.receiver is None else self.receiver.statistics()
        return {
            **receiver,
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
        return f"<GenerationWorker receiver={self.receiver!r} transfers={len(self._transfers)}>"
