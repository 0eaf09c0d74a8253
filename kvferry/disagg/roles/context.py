"""The context role: a :class:`ContextWorker` prefills each request its generation peer sends, answers with the
first token, holds the prefilled cache and pushes it when the receive request comes.

The prompt runs as ``generate(prompt, max_tokens=1)``; when the engine then closes the request, the
:class:`~.handoff_cache.HandoffCache` *holds* it instead (suspended with ``Offload.NEVER``: a transfer reads its
pages) until the push is done or the generation side releases it. A held cache is held at most
``hold_timeout`` seconds for its receive request.

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
import logging
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
    check_pairing,
    encode_control,
)
from kvferry.disagg.roles.worker import Worker, positive
from kvferry.disagg.session import SendSession, send
from kvferry.disagg.transfer import expected_writers, plan_transfer, prepare_source
from kvferry.errors import KvferryError, PeerDisconnected, TransportError
from kvferry.transports import Peer, Transport

__all__ = ["ContextWorker"]

log = logging.getLogger("kvferry.disagg")


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
class ContextWorker(Worker):
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

    ROLE: ClassVar[PeerRole] = PeerRole.CONTEXT

    #: seconds a prefilled cache is held for its receive request
    hold_timeout: float = attrs.field(default=60.0, validator=positive)
    #: bytes per chunk (None: one write per direct writer, default_chunk_bytes(memory) per bounced chunk)
    max_chunk_bytes: int | None = None
    #: seconds to wait before posting each chunk (0: none). Only for tests that need a transfer to last.
    write_delay: float = 0.0
    _held: dict[str, _Held] = attrs.field(factory=dict, init=False)
    _sending: dict[int, SendSession] = attrs.field(factory=dict, init=False)
    _counts: dict[str, int] = attrs.field(
        factory=lambda: dict.fromkeys(
            ("prefilled", "pushed", "released", "cancelled", "failed", "bytes", "fragments", "bounced"), 0
        ),
        init=False,
    )

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
                src_pools=self.pool_tensors(),
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
