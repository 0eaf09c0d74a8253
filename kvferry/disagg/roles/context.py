"""The context role: a :class:`ContextWorker` prefills each request its generation peer sends, answers with the
first token, holds the prefilled cache and pushes it when the receive request comes.

The prompt runs as ``generate(prompt, max_tokens=1)``; when the engine then closes the request, the
:class:`~.handoff_cache.HandoffCache` *holds* it instead until the push is done or the generation side releases
it. A held cache waits while the generation side has no room for it (its receive request comes when its engine
admitted the request), at most ``hold_timeout`` seconds; meanwhile the engine may move it to the host to make room
for the next prompts. When its receive request comes it is pinned (``CacheManager.pin``: brought back to
the device if needed, then ``Offload.NEVER``, the transfer reads its pages; no batch row) for the push.

Cancelling a prefill at any point (before its first step, during a step, between a step and its commit, during
the push) ends the request's stream first; :meth:`~.handoff_cache.HandoffCache.release` then frees the cache
once the engine no longer has the request (the engine frees it at its next step boundary), never under a step
it may still run.

Bounce: a context writer bounces when the receive request offered it a staging area, its own ``bounce`` policy
finds its plan fragmented and its own staging pool has room. Anything short of that is a direct write: a full
pool costs speed, never a transfer.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from functools import partial
from typing import Any, ClassVar, cast

import anyio
import anyio.abc
import attrs
from attrs import define

from kvferry.disagg.link import exchange_hello, pump
from kvferry.disagg.mapping import PeerMap, RequestCache
from kvferry.disagg.protocol import (
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
    TablesUpdate,
    check_pairing,
    encode_control,
)
from kvferry.disagg.roles.worker import Worker, positive
from kvferry.disagg.session import SendSession, send
from kvferry.disagg.transfer import expected_writers, plan_transfer, prepare_source
from kvferry.engine.generation import Generation
from kvferry.engine.runner import PagedRunner
from kvferry.errors import ClosedResourceError, KvferryError, PeerDisconnected, PoolExhausted, TransportError
from kvferry.pools.manager import CacheState
from kvferry.transports import Peer, Transport

__all__ = ["ContextWorker"]

log = logging.getLogger("kvferry.disagg")

#: Seconds a prefilled cache is held for its receive request. The generation side sends it once its engine
#: admitted the request, which under load waits for earlier requests to finish decoding: generous, finite so that
#: a peer that stays connected but never pulls does not hold caches for ever (a peer that goes away frees them).
DEFAULT_HOLD_TIMEOUT = 600.0

#: Seconds between attempts to bring a held cache back to the device for its push while the room is taken.
PIN_RETRY_SECONDS = 0.005


class _HoldEnd(enum.Enum):
    """How the hold of a prefilled cache ends, once its receive request, a release or a cancel came (or the
    hold ran out)."""

    #: the receive request is in hand: push the cache
    PUSH = "push"
    #: the generation side released it, or no receive request came within ``hold_timeout``
    RELEASED = "released"
    #: the receiver cancelled the transfer before its push started: it never starts
    CANCELLED = "cancelled"


@define(eq=False)
class _Held:
    """One context request, from its arrival until its cache is freed: what the generation side said about it.

    The peer's messages may come in any order (a hostile or confused peer), so each is recorded as it comes
    and :meth:`end` decides once the prefill task looks: a cancel wins over a release, a release over a
    receive request.
    """

    ready: anyio.Event = attrs.field(factory=anyio.Event)
    #: the prefill (until it is answered): a ReleaseContext before the answer cancels it
    prefill: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    answered: bool = False
    request: ReceiveRequest | None = None
    released: bool = False
    #: the receiver cancelled the transfer before its push started: it never starts
    cancelled: bool = False

    def requested(self, request: ReceiveRequest) -> None:
        """The receive request came (a later one replaces it)."""
        self.request = request
        self.ready.set()

    def release(self) -> None:
        """The generation side let go: nothing is pushed, and a prefill not yet answered stops."""
        self.released = True
        self.ready.set()
        if not self.answered:
            self.prefill.cancel()  # nobody waits for its answer any more

    def call_off(self) -> None:
        """The receiver cancelled the transfer of :attr:`request` before its push started."""
        self.cancelled = True
        self.ready.set()

    def end(self) -> _HoldEnd:
        """How the hold ends, from what came so far."""
        if self.cancelled:
            return _HoldEnd.CANCELLED
        if self.request is None or self.released:
            return _HoldEnd.RELEASED
        return _HoldEnd.PUSH


@define(eq=False)
class _Served:
    """The generation peer being served: its connection, the rank mapping to it, its handshake (its tables as
    last updated, and that update's epoch), and the task group its requests run in (cancelled when the peer is
    gone)."""

    peer: Peer
    peer_map: PeerMap
    remote: PeerInfo
    tasks: anyio.abc.TaskGroup = attrs.field(init=False)
    epoch: int = 0


@define(eq=False)
class _DrafterExport:
    """The drafter's hand-off of a prefilled request, exported when the engine ends the request (the cache's
    hold callback): before anything else touches its pages, so the drafter's catch-up on the prompt lands in the
    held draft pages."""

    runner: PagedRunner
    generation: Generation
    spec_k: int
    host_state: bytes = b""
    error: KvferryError | None = None

    def __call__(self, request_id: int) -> None:
        if self.spec_k > 0:
            try:
                self.host_state = self.runner.export_handoff(
                    request_id, self.generation.request.output_ids[-1]
                )
            except KvferryError as exc:
                self.error = exc


@define(eq=False)
class ContextWorker(Worker):
    """Serves one generation peer: prefills each :class:`~kvferry.disagg.protocol.ContextRequest` on its engine,
    answers :class:`~kvferry.disagg.protocol.ContextDone`, then pushes the request's cache when the receive
    request comes.

    A held cache is freed after its push (every posted write ended), on
    :class:`~kvferry.disagg.protocol.ReleaseContext`, when the peer goes away, or after ``hold_timeout`` seconds
    without a receive request. A ReleaseContext that comes before the prefill was answered (the receiver stopped
    waiting for it: its ``prefill_timeout`` ran out) stops the prefill; it is never answered.

    A :class:`~kvferry.disagg.protocol.CancelTransfer` stops a push in progress (its writers then report every
    chunk, which releases the receiver's pages); for any other session (receive request never seen, seen but the
    push not started: it never starts, or push finished) it is answered with
    :class:`~kvferry.disagg.protocol.CancelAck`, on which the receiver releases its pages at once.
    """

    ROLE: ClassVar[PeerRole] = PeerRole.CONTEXT

    #: seconds a prefilled cache is held for its receive request
    hold_timeout: float = attrs.field(default=DEFAULT_HOLD_TIMEOUT, validator=positive)
    #: bytes per chunk (None: one write per direct writer, default_chunk_bytes(memory) per bounced chunk)
    max_chunk_bytes: int | None = None
    #: seconds to wait before posting each chunk (0: none). Only for tests that need a transfer to last.
    write_delay: float = 0.0
    #: by (peer, request key) and (peer, session id): each generation peer names its own requests and sessions,
    #: and may touch only those
    _held: dict[tuple[Peer, str], _Held] = attrs.field(factory=dict, init=False)
    _sending: dict[tuple[Peer, int], SendSession] = attrs.field(factory=dict, init=False)
    #: the peers served now
    _served: list[_Served] = attrs.field(factory=list, init=False)
    _counts: dict[str, int] = attrs.field(
        factory=lambda: dict.fromkeys(
            ("prefilled", "pushed", "released", "cancelled", "failed", "bytes", "fragments", "bounced"), 0
        ),
        init=False,
    )

    async def serve(self, peer: Peer) -> None:
        """Handshake with the generation peer and serve it until it goes away (then free what it left: its
        prefills and pushes are cancelled, and every held cache is freed once the engine is done with it).

        :raises ~kvferry.errors.PeerIncompatible: the peer serves another model / wire version.
        """
        await self.register()
        await self.publish_tables()  # a rebalance before this peer: the peers known so far are told first
        told, info = self.epoch, self.info()
        remote = await exchange_hello(self.transport, peer, info, within=self.handshake_timeout)
        check_pairing(info, remote)
        served = _Served(peer, PeerMap.build(list(info.page_tables), list(remote.page_tables)), remote)
        try:
            # from here every publish tells this peer; one during its hello catches up
            async with self.tables_lock:
                self._served.append(served)
                with anyio.CancelScope(shield=True):
                    await self.joined(peer, told, partial(self._remap, served))
            async with anyio.create_task_group() as tg:
                served.tasks = tg
                await pump(self.transport, peer, on_message=partial(self._on_message, served))
                tg.cancel_scope.cancel()  # the peer is gone: stop prefills and pushes
        finally:
            if served in self._served:
                self._served.remove(served)

    def _peers(self) -> list[Peer]:
        return [served.peer for served in self._served]

    def _task_group(self) -> anyio.abc.TaskGroup | None:
        # a peer's requests' group: cancelled when it goes away (the next peer's publish covers this one)
        return next((served.tasks for served in self._served if hasattr(served, "tasks")), None)

    def _tables_applied(self) -> None:
        for served in self._served:
            self._remap(served)

    def _peer_map(self, remote: PeerInfo) -> PeerMap:
        return PeerMap.build(list(self.info().page_tables), list(remote.page_tables))

    def _remap(self, served: _Served) -> None:
        served.peer_map = self._peer_map(served.remote)

    def _apply_update(self, served: _Served, update: TablesUpdate) -> None:
        """The generation peer's pools were rebalanced: map to its new tables (an update that changes more than
        a rebalance can, or does not map, is refused: the peer keeps the tables it had here, and its receive
        requests into pages those do not hold fail)."""
        peer_map = self._updated_map(served.remote, served.epoch, update)
        if peer_map is not None:
            served.remote, served.epoch, served.peer_map = update.info, update.epoch, peer_map

    async def _on_message(self, served: _Served, message: ControlBody) -> None:
        """One control message from the peer (in the order they came; reports never come here)."""
        if isinstance(message, ContextRequest):
            # known from now on: a ReleaseContext read before the task below first runs finds it
            entry = self._held[served.peer, message.key] = _Held()
            served.tasks.start_soon(self._serve_request, served, message, entry)
        elif isinstance(message, ReceiveRequest):
            held = self._held.get((served.peer, message.key))
            if held is None:
                # nothing is held for it (released, or its hold ran out): every writer fails it at once, so the
                # receiver frees its pages instead of waiting into doubt
                log.warning("receive request for unknown key %r", message.key)
                served.tasks.start_soon(
                    self._fail_request, served, message, f"no cache held for {message.key!r}"
                )
            else:
                held.requested(message)
        elif isinstance(message, ReleaseContext):
            held = self._held.get((served.peer, message.key))
            if held is not None:
                held.release()
        elif isinstance(message, CancelTransfer):
            await self._cancel(served.peer, message)
        elif isinstance(message, TablesUpdate):
            self._apply_update(served, message)

    async def _cancel(self, peer: Peer, message: CancelTransfer) -> None:
        """The receiver cancelled session ``message.session_id``: stop its push, or say none can write."""
        session = self._sending.get((peer, message.session_id))
        if session is not None:
            session.cancel()  # its writers report every chunk: the receiver releases its pages on the last one
            return
        for (owner, _), held in self._held.items():
            if owner is peer and held.request is not None and held.request.session_id == message.session_id:
                # received, push not started: _hold_and_push checks this and, with no await between the check
                # and the session's registration in _sending, never pushes once it is set
                held.call_off()
                reason = "the push was called off before it started"
                break
        else:
            # never received (the control channel is ordered: it never will be) or already pushed (every write
            # returned before the reports were sent)
            reason = "no push in progress"
        with anyio.move_on_after(self.control_timeout), contextlib.suppress(PeerDisconnected, KvferryError):
            await self.transport.send_message(peer, encode_control(CancelAck(message.session_id, reason)))

    async def _serve_request(self, served: _Served, req: ContextRequest, held: _Held) -> None:
        """:meth:`_prefill_and_push`, in the peer's task group. The peer going away (an answer or a push that
        finds it gone) ends this request only: :meth:`serve` sees it too and stops the peer's other work."""
        with contextlib.suppress(PeerDisconnected, ClosedResourceError):
            await self._prefill_and_push(served, req, held)

    async def _prefill_and_push(self, served: _Served, req: ContextRequest, held: _Held) -> None:
        """Prefill ``req``, answer it, hold its cache and push it when asked.

        A cancel may come at any point (the peer went away, the receiver released the request, the worker
        stops): the request's stream then ends first (the engine frees the request at its next step boundary)
        and :meth:`~.handoff_cache.HandoffCache.release` frees the cache only once the engine is done with it.
        """
        if held.released:  # released before this task first ran: nobody waits for its answer
            self._forget(served.peer, req.key, held)
            self._counts["released"] += 1
            return
        try:
            # spec_k makes the runner keep the prompt's hidden states for the drafter (one token: nothing drafted)
            generation = self.engine.generate(
                req.prompt, max_tokens=1, seed=req.seed, temperature=req.temperature, spec_k=req.spec_k
            )
        except KvferryError as exc:  # a prompt the engine refuses (a token outside its vocabulary, say)
            self._forget(served.peer, req.key, held)
            self._counts["failed"] += 1
            await self._answer(
                served.peer, ContextDone(req.key, 0, False, 0, error=f"{type(exc).__name__}: {exc}")
            )
            return
        rid = generation.request.request_id
        try:
            if await self._prefill(served, req, held, generation):
                await self._hold_and_push(served, req, held, rid)
        finally:
            self._forget(served.peer, req.key, held)
            # synchronous: no cancel can interrupt it. The stream has ended (collect returned or raised), so the
            # engine has closed the request or will at its next step boundary: release frees it accordingly
            self.cache.release(rid)

    async def _prefill(
        self, served: _Served, req: ContextRequest, held: _Held, generation: Generation
    ) -> bool:
        """Run the prompt and answer it; whether the cache is kept for a push (the answer says ``held``)."""
        rid = generation.request.request_id
        export = _DrafterExport(self.built.runner, generation, req.spec_k)
        wants_more = req.max_tokens > 1
        if wants_more:
            self.cache.hold(rid, export)
        tokens: list[int] = []
        try:
            with held.prefill:
                tokens = await generation.collect()
            if export.error is not None:
                raise export.error
        except KvferryError as exc:
            held.answered = True
            self._counts["failed"] += 1
            await self._answer(
                served.peer, ContextDone(req.key, 0, False, 0, error=f"{type(exc).__name__}: {exc}")
            )
            return False
        if held.prefill.cancelled_caught:  # released before the answer: the receiver waits for none
            self._counts["released"] += 1
            return False
        held.answered = True
        first = tokens[0]
        keep = wants_more and first not in req.stop_ids
        self._counts["prefilled"] += 1
        if not keep:
            self.cache.release(rid)
        await self._answer(
            served.peer,
            ContextDone(req.key, first, keep, len(req.prompt), export.host_state if keep else b""),
        )
        return keep

    async def _hold_and_push(self, served: _Served, req: ContextRequest, held: _Held, rid: int) -> None:
        """Hold the prefilled cache until its receive request, a release or a cancel comes (at most
        ``hold_timeout`` seconds), then push it if it is still wanted."""
        # the sender's side of the transfer, worked out while the receive request is on its way
        source = self._source(served.peer_map, rid, len(req.prompt))
        ahead, ahead_map = self._placement(rid), served.peer_map
        with anyio.move_on_after(self.hold_timeout):
            await held.ready.wait()
        end = held.end()
        if end is _HoldEnd.CANCELLED:
            self._counts["cancelled"] += 1
            return
        if end is _HoldEnd.RELEASED or held.request is None:
            self._counts["released"] += 1
            return
        if not await self._pin(rid, held):
            self._counts["failed"] += 1
            await self._fail_request(
                served, held.request, f"request {req.key}: no room to bring its cache back"
            )
            return
        # pinned: no rebalance from here to the push's end. One before it: the peer learns the new tables first
        await self.publish_tables()
        if held.end() is not _HoldEnd.PUSH:  # cancelled or released while its cache came back
            self._counts["cancelled" if held.cancelled else "released"] += 1
            return
        if self._placement(rid) != ahead or served.peer_map is not ahead_map:
            # moved to the host and back (other pages, another slot), or either side's tables changed
            source = self._source(served.peer_map, rid, len(req.prompt))
        # no await from the check above until _push registers the session in _sending: a CancelTransfer finds
        # the session either here (cancelled before the push) or sending (cancelled during it)
        await self._push(served, rid, held.request, source)

    def _placement(self, rid: int) -> tuple[object, ...]:
        manager = self.cache.inner.primary
        if manager.state(rid) is not CacheState.SUSPENDED or manager.is_offloaded(rid):
            return ()
        return (
            tuple(manager.block_table(rid)),
            tuple(self._blocks(rid).get("draft", ())),
            manager.slot_id(rid),
        )

    async def _pin(self, rid: int, held: _Held) -> bool:
        """Keep the held cache of ``rid`` on the device for its push (brought back first if the engine moved it
        to the host for room): False when no room came within ``hold_timeout`` seconds."""
        primary, *others = self.cache.inner.managers
        pausing = False
        with anyio.move_on_after(self.hold_timeout), contextlib.ExitStack() as paused:
            while True:
                try:
                    primary.pin(rid)  # restores from the host if it was moved there
                except PoolExhausted:
                    # the engine's running prefills hold the room: they end (and are held, movable) soon. Until
                    # the pin succeeds the engine admits no new prefill, which would take that room first (a
                    # long queue would starve the push into its receiver's stall deadline)
                    if not pausing:
                        paused.enter_context(self.engine.admissions_paused())
                        pausing = True
                    await anyio.sleep(PIN_RETRY_SECONDS)
                    continue
                for m in others:  # the same bookkeeping on every rank: the same outcome
                    m.pin(rid)
                return True
        return False

    def _forget(self, peer: Peer, key: str, held: _Held) -> None:
        if self._held.get((peer, key)) is held:  # not a later request that reuses the key
            del self._held[peer, key]

    async def _fail_request(self, served: _Served, request: ReceiveRequest, why: str) -> None:
        """A receive request we cannot serve: every writer reports a failure (nothing is written), so the
        receiver completes it as failed and frees its pages."""
        session = SendSession(request.session_id, {w: [] for w in expected_writers(served.peer_map)})
        with contextlib.suppress(TransportError):
            for w in session.writers:
                await self.transport.send_message(
                    served.peer, encode_control(session.result(w, 0, ChunkStatus.FAILED, why))
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
                range(len(self.arenas)),
                self._blocks(rid),
                manager.slot_id(rid),
                prompt_tokens,
            )
        except KvferryError as exc:
            log.warning("cannot map request %d's side of its transfer ahead: %s", rid, exc)
            return None

    async def _push(
        self, served: _Served, rid: int, request: ReceiveRequest, source: RequestCache | None = None
    ) -> None:
        """Plan and push request ``rid``'s transfer (``source``: its cache from :meth:`_source`, or None).

        A cancel stops the push: the writes already posted have ended when this returns, and chunks not yet
        reported stay unreported (the peer is gone, or the worker stops)."""
        # synchronous until the session is in _sending (see _hold_and_push): keep it so
        manager = self.cache.inner.primary
        try:
            plan = plan_transfer(
                served.peer_map,
                range(len(self.arenas)),
                self._blocks(rid) if source is None else source,
                manager.slot_id(rid),
                request,
                list(served.remote.page_tables),
                max_chunk_bytes=self.max_chunk_bytes,
                policy=self.bounce,
                src_pools=self.pool_tensors(),
                staging=self.staging,
            )
        except KvferryError as exc:
            # a request we cannot serve: every writer reports a failure, so the receiver completes (failed)
            log.warning("cannot plan transfer %s: %s", request.session_id, exc)
            await self._fail_request(served, request, str(exc))
            return
        session = SendSession(request.session_id, plan)
        self._sending[served.peer, request.session_id] = session
        transport = self.transport if self.write_delay <= 0 else _Paced(self.transport, self.write_delay)
        try:
            await send(cast(Transport, transport), served.peer, session)
        finally:
            self._sending.pop((served.peer, request.session_id), None)
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
