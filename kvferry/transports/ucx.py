"""``ucx``: UCXX (asyncio), two-sided. A write is announced on the control channel, checked by the receiver, then
either read by the receiver itself (a peer on this host, host memory) or sent as tagged messages that the
receiving transport places into its registered memory.

How a write travels:

1. the writer sends a ``WriteRequest`` (destination fragments, how they are cut, the notification, and, to a
   peer on this host with host memory on both sides, its source fragments);
2. the receiver checks that every destination range lies inside memory it registered and inside what it granted
   *that* writer (:meth:`~kvferry.transports.Transport.grant`), *before* anything is copied or posted, whatever
   the writer checked itself; a range outside is refused (``RegionError``, ``NotGranted`` outside the grants,
   at the writer; counted in the receiver's ``incoming_refused``) and nothing is written;
3. with source fragments offered, the receiver answers PULLING and copies them out of the writer's process with
   batched ``process_vm_readv`` calls (:mod:`~kvferry.transports._cma`; PROGRESS answers meanwhile); a short
   read (:func:`~kvferry.transports._cma.inline`) it makes at once and answers DONE without PULLING first. Where
   the kernel will not let it attach, it answers READY instead and the write goes on as in 4;
4. otherwise it answers READY with a tag base, and posts receives: fragments of at least ``zero_copy_bytes`` go
   straight into their destination (UCX rendezvous, zero-copy), shorter ones arrive packed in messages of at
   most ``pack_bytes`` and are scattered (:mod:`~kvferry.transports._ucx_messages`);
5. when every byte has landed, the receiver queues the notification and answers DONE; only then does the
   writer's ``write`` return.

Endpoints are made from worker addresses with UCX error handling off, which is what lets UCX use shared memory
instead of the listener's TCP. In that mode a receive from a dead peer never ends by itself, so every wait here
is raced against the peer's control connection (the kernel closes a dead process's sockets) and against a stall
deadline.

Why host memory of this host is read by the receiver itself: with error handling off, UCX cannot lose a peer
cleanly on the host paths.

- With its CMA transport, a receiver reads the writer's memory by ``process_vm_readv`` for every rendezvous
  message, and if the writer has died that failed call aborts the whole process (``cma_ep.c``). So the UCX
  context this transport starts leaves CMA out (``cma=False``: ``TLS=^cma``, unless ``UCX_TLS`` is set).
- Without CMA, large messages go through the shared-memory FIFOs: a peer that dies in the middle of one leaves
  this process's UCX worker with work it retries for ever, which would keep a core busy and starve the event
  loop's arming task; :mod:`~kvferry.transports._ucx_progress` polls such a worker every 10 ms instead, and
  later writes through it are slower.
- Our own ``process_vm_readv`` fails with an error instead, moves up to 1024 fragments per call, and keeps UCX
  out of the host path. CUDA memory and peers on other hosts still go through UCX, and so does host memory where
  the kernel refuses to attach (``ptrace`` policy), with the FIFO caveat above. A peer counts as one of this
  host only once it has proven its pid in the handshake (:mod:`~kvferry.transports.handshake`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import time
from collections.abc import Coroutine
from contextlib import suppress
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import ucxx
import ucxx.exceptions as ucx_errors
from anyio.streams.memory import MemoryObjectReceiveStream

from kvferry import wire
from kvferry.errors import (
    ConfigError,
    NotGranted,
    PeerDisconnected,
    RegionError,
    TransferTimeout,
    TransportError,
    WireFormatError,
)
from kvferry.transports import _cma
from kvferry.transports._memory import synchronize_cuda
from kvferry.transports._ucx_messages import (
    MAX_PACK_BYTES,
    MAX_WRITE_FRAGMENTS,
    MessagePlan,
    Views,
    plan_messages,
    windowed,
)
from kvferry.transports._ucx_progress import WorkerEvents
from kvferry.transports.base import Capabilities, Fragments, TransportAttribute
from kvferry.transports.channel import ChannelTransport
from kvferry.transports.datapath import DataPath
from kvferry.transports.messages import (
    FrameKind,
    WriteAbort,
    WriteReply,
    WriteRequest,
    WriteStatus,
    fragments_bytes,
    fragments_from_bytes,
)
from kvferry.transports.peers import ChannelPeer
from kvferry.transports.writes import CheckedRows

__all__ = [
    "MAX_WRITE_FRAGMENTS",
    "MessagePlan",
    "UcxDataPath",
    "UcxTransport",
    "plan_messages",
    "transport_class",
]

log = logging.getLogger("kvferry.transports.ucx")

#: a row of a write request's ``dst`` (and ``src``): address and length, u64 each
_ROW_BYTES = 16
#: a pulling receiver tells the writer about progress at most this often
_PULL_PROGRESS_SECONDS = 0.05
#: how a REGION reply's detail starts when the write reached outside what the receiver granted the writer
_NOT_GRANTED = "not granted: "


def translate(exc: BaseException, what: str) -> TransportError:
    """A UCXX exception as one of ours."""
    if isinstance(
        exc,
        ucx_errors.UCXConnectionResetError
        | ucx_errors.UCXShmemSegmentError
        | ucx_errors.UCXCanceledError
        | ucx_errors.UCXCloseError
        | ucx_errors.UCXNotConnectedError
        | ucx_errors.UCXUnreachableError
        | ucx_errors.UCXEndpointTimeoutError,
    ):
        return PeerDisconnected(f"{what}: {type(exc).__name__}: {exc}")
    return TransportError(f"{what}: {type(exc).__name__}: {exc}")


class UcxDataPath(DataPath):
    """UCXX endpoints between processes, two-sided: the writer announces, the receiver checks and places every
    write (see the module docstring); its options are :class:`UcxTransport`'s."""

    def __init__(
        self,
        transport: ChannelTransport[Any],
        *,
        endpoint_error_handling: bool,
        host_cma: bool,
        cma: bool,
        progress_mode: str | None,
        zero_copy_bytes: int,
        pack_bytes: int,
        window: int,
        packed_window: int,
    ) -> None:
        super().__init__(transport)
        #: the tag prefix our receives are posted under (high bits of every tag of data for us)
        self.tag_prefix = secrets.randbits(24)
        self._endpoint_error_handling = endpoint_error_handling
        self._host_cma = host_cma and _cma.available()
        self._pull_refused: set[ChannelPeer] = set()
        #: writes of ours that the receiver read itself; writes we read ourselves
        self.pulled_writes = 0
        self.cma_reads = 0
        self._cma = cma
        self._progress_mode = progress_mode or os.environ.get("UCXPY_PROGRESS_MODE", "blocking")
        self._zero_copy_bytes = zero_copy_bytes
        self._pack_bytes = pack_bytes
        self._window = window
        self._packed_window = packed_window
        self._worker_address = b""
        self._worker_events: WorkerEvents | None = None
        self._next_incoming = 0
        self._endpoints = 0
        #: the destination rows of each write being received, by (peer, write id): a revoke stops the ones
        #: that no longer lie inside the peer's grants
        self._incoming_dst: dict[tuple[ChannelPeer, int], Fragments] = {}
        #: writes being received that a revoke stopped (answered REGION)
        self._revoked_writes: set[tuple[ChannelPeer, int]] = set()

    async def open(self) -> None:
        keep_transports = self._cma or self._endpoint_error_handling or "UCX_TLS" in os.environ
        with suppress(
            RuntimeError
        ):  # already initialised in this process (by us or the application): share it
            ucxx.init(progress_mode=self._progress_mode, options={} if keep_transports else {"TLS": "^cma"})
        try:
            ucxx.continuous_ucx_progress()
            self._worker_events = WorkerEvents.install(asyncio.get_running_loop())
            self._worker_address = bytes(ucxx.get_worker_address())
        except ucx_errors.UCXError as exc:
            raise translate(exc, "starting UCXX") from exc

    def _kick(self) -> None:
        if self._worker_events is not None:
            self._worker_events.kick()

    def hello(self) -> bytes:
        return self._worker_address

    def _ucx_peer(self, peer: ChannelPeer) -> bool:
        return not (peer.same_process and self.transport.same_process_copy)

    async def peer_connected(self, peer: ChannelPeer) -> None:
        if not self._ucx_peer(peer):
            return
        try:
            address = ucxx.get_ucx_address_from_buffer(peer.hello.backend)
        except (ucx_errors.UCXError, IndexError, ValueError, TypeError) as exc:
            raise WireFormatError(f"{peer.address} sent no valid UCX worker address: {exc}") from exc
        try:
            with anyio.fail_after(self.transport.connect_timeout):
                peer.backend = await ucxx.create_endpoint_from_worker_address(
                    address, endpoint_error_handling=self._endpoint_error_handling
                )
        except TimeoutError as exc:
            raise PeerDisconnected(
                f"no UCX endpoint to {peer.address} within {self.transport.connect_timeout} s"
            ) from exc
        except ucx_errors.UCXError as exc:
            raise WireFormatError(f"cannot reach the UCX worker address of {peer.address}: {exc}") from exc
        self._endpoints += 1

    async def peer_lost(self, peer: ChannelPeer) -> None:
        self._pull_refused.discard(peer)
        endpoint, peer.backend = peer.backend, None
        if endpoint is None:
            return
        self._endpoints -= 1
        try:
            # abort, not close: close waits for the peer, which may be dead (error handling is off)
            endpoint.abort()
        except ucx_errors.UCXError as exc:
            log.debug("aborting the endpoint to %s: %s", peer.address, exc)

    # --- writer --------------------------------------------------------------------------------------

    async def write(self, peer: ChannelPeer, rows: CheckedRows, notify: bytes | None, stall: float) -> None:
        """One write request, or (more than :data:`MAX_WRITE_FRAGMENTS` rows) several in turn, the notification
        with the last: when a later one fails, the earlier ones have landed."""
        starts = range(0, len(rows.src), MAX_WRITE_FRAGMENTS)
        if len(starts) <= 1:
            await self._write_request(peer, rows, notify, stall)
            return
        for first in starts:
            part = slice(first, first + MAX_WRITE_FRAGMENTS)
            part_rows = CheckedRows(
                rows.src[part], rows.dst[part], rows.src_index[part], rows.dst_index[part]
            )
            await self._write_request(peer, part_rows, notify if first == starts[-1] else None, stall)

    async def _write_request(
        self, peer: ChannelPeer, rows: CheckedRows, notify: bytes | None, stall: float
    ) -> None:
        endpoint = peer.backend
        if endpoint is None:
            raise peer.error
        src, dst = rows.src, rows.dst
        views = Views(self.transport.own_regions, src, "source", index=rows.src_index)
        if views.table.devices(views.index) - {"cpu"}:
            # UCX reads CUDA sources outside any stream: what the caller queued on its stream must be done
            await synchronize_cuda()
        write_id = self.transport.writes.new_write_id()
        replies_out, replies_in = anyio.create_memory_object_stream[WriteReply](4)
        peer.pending[write_id] = replies_out
        offer = self._pull_offer(peer, rows)
        request = WriteRequest(
            write_id, fragments_bytes(dst), self._zero_copy_bytes, self._pack_bytes, notify, offer
        )
        announced = finished = False
        try:
            async with self.transport.writes.guard(peer, stall) as guard:

                async def reply() -> WriteReply:
                    try:
                        return await replies_in.receive()
                    except anyio.EndOfStream:
                        raise peer.error from None

                await self.transport.control.send_frame(peer, FrameKind.WRITE_REQUEST, wire.encode(request))
                announced = True
                answer = await reply()
                if answer.status is WriteStatus.DONE and offer is not None:
                    # a short write the receiver read at once, without PULLING first
                    finished = True
                    self.pulled_writes += 1
                    return
                if answer.status is WriteStatus.PULLING:
                    # the receiver reads our memory itself and says how far it got; READY: it could not after all
                    guard.progress()
                    while (answer := await reply()).status is WriteStatus.PROGRESS:
                        guard.progress()
                    if answer.status is not WriteStatus.READY:
                        finished = True
                        _raise_for(answer, peer, WriteStatus.DONE)
                        self.pulled_writes += 1
                        return
                if offer is not None and answer.status is WriteStatus.READY:
                    self._pull_refused.add(peer)  # it could not: do not offer again
                _raise_for(answer, peer, WriteStatus.READY)
                guard.progress()
                # cut into messages only now: a write the receiver reads itself sends none
                plan = plan_messages(src[:, 1], self._zero_copy_bytes, self._pack_bytes)

                async def start(k: int) -> tuple[Coroutine[Any, Any, Any], Any]:
                    first, end, packed = plan[k]
                    # packing copies (and faults in) megabytes: off the event loop
                    buffer = (
                        await anyio.to_thread.run_sync(views.gather, first, end)
                        if packed
                        else views.row(first)
                    )
                    send = endpoint.send(buffer, tag=answer.tag + k, force_tag=True)
                    self._kick()
                    return send, buffer

                async def sent(k: int, buffer: Any) -> None:
                    guard.progress()

                try:
                    await windowed(
                        len(plan), self._window, start, sent, lambda k: plan[k][2], self._packed_window
                    )
                except ucx_errors.UCXError as exc:
                    raise translate(exc, f"sending to {peer.address}") from exc
                answer = await reply()
                finished = True
                _raise_for(answer, peer, WriteStatus.DONE)
        finally:
            try:
                if announced and not finished and peer.lost.is_set() is False:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                        await self._abort_write(peer, write_id, replies_in, offer is not None)
            finally:
                peer.pending.pop(write_id, None)
                replies_out.close()
                replies_in.close()

    async def _abort_write(
        self,
        peer: ChannelPeer,
        write_id: int,
        replies: MemoryObjectReceiveStream[WriteReply],
        offered: bool,
    ) -> None:
        """Tell the receiver to drop a write we leave early. If we offered it our source, wait for its last answer
        too: it may be reading our memory (a slice at most), and the caller may free that memory once we return."""
        try:
            abort = wire.encode(WriteAbort(write_id))
            await self.transport.control.send_frame(peer, FrameKind.WRITE_ABORT, abort)
            if offered:
                ongoing = (WriteStatus.PULLING, WriteStatus.PROGRESS, WriteStatus.READY)
                while (await replies.receive()).status in ongoing:
                    pass
        except (TransportError, anyio.EndOfStream, anyio.ClosedResourceError):
            pass

    def _pulls_with(self, peer: ChannelPeer) -> bool:
        """Host-memory writes with ``peer`` may be read by their receiver: it has shown it is a process of this
        host, neither side turned the path off, and no read from it has been refused by the kernel."""
        return self._host_cma and peer.same_host and peer not in self._pull_refused

    def _pull_offer(self, peer: ChannelPeer, rows: CheckedRows) -> bytes | None:
        """Our source fragments for the receiver to read itself, or None (send them as UCX messages): offered to
        peers of this host, for host memory on both sides."""
        if not self._pulls_with(peer) or not len(rows.src):
            return None
        if self.transport.own_regions.devices(rows.src_index) != {"cpu"} or peer.regions.devices(
            rows.dst_index
        ) != {"cpu"}:
            return None
        return fragments_bytes(rows.src)

    # --- receiver ------------------------------------------------------------------------------------

    async def frame(self, peer: ChannelPeer, kind: int, body: bytes) -> None:
        if kind == FrameKind.WRITE_ABORT:
            abort = wire.decode(body, WriteAbort)
            scope = peer.incoming.get(abort.write_id)
            if scope is not None:
                scope.cancel()
            return
        request = wire.decode(body, WriteRequest)
        what = f"destination of a write from {peer.address}"
        try:
            # from the length alone, before a row is parsed: a longer write comes as several requests
            if len(request.dst) > MAX_WRITE_FRAGMENTS * _ROW_BYTES:
                raise ValueError(
                    f"a write request of {len(request.dst) // _ROW_BYTES} fragments "
                    f"(at most {MAX_WRITE_FRAGMENTS} per request)"
                )
            if not 1 <= request.pack_bytes <= MAX_PACK_BYTES:
                raise ValueError(f"packed messages of {request.pack_bytes} bytes")
            dst = fragments_from_bytes(request.dst)
            # Every destination range is checked before anything is posted: a refused write writes nothing.
            # Inside our registered memory, and inside what we granted this peer (whatever the writer checked).
            views = Views(self.transport.own_regions, dst, what)
            peer.granted.check(dst, what)
        except WireFormatError:
            raise  # malformed fragments: the peer is dropped
        except NotGranted as exc:
            self.transport.writes.count_incoming_refused(peer, exc)
            reply = WriteReply(request.write_id, WriteStatus.REGION, _NOT_GRANTED + str(exc))
            await self._reply(peer, reply)
            return
        except (RegionError, ValueError) as exc:
            status = WriteStatus.REGION if isinstance(exc, RegionError) else WriteStatus.FAILED
            await self._reply(peer, WriteReply(request.write_id, status, str(exc)))
            return
        if request.write_id in peer.incoming:
            raise WireFormatError(f"{peer.address} reused write id {request.write_id}")
        source = self._pull_source(peer, request, views)
        scope = anyio.CancelScope()
        peer.incoming[request.write_id] = scope
        self._incoming_dst[peer, request.write_id] = dst
        if source is not None:
            # no message plan: a pulled write sends none (it is cut into messages only if the read is refused)
            self.transport.spawn(self._pull, peer, request, source, views, scope)
        else:
            self.transport.spawn(self._receive, peer, request, views, _plan_of(request, views), scope)

    def _pull_source(self, peer: ChannelPeer, request: WriteRequest, views: Views) -> Fragments | None:
        """The offered source fragments when we read them ourselves: a peer of this host that we may attach to,
        host memory here, and an offer that pairs with the destination row for row; otherwise None (the writer
        sends messages; a malformed offer is ignored, like an absent one)."""
        if request.src is None or not self._pulls_with(peer):
            return None
        if views.table.devices(views.index) != {"cpu"}:
            return None
        if len(request.src) != len(request.dst):
            log.warning("%s offered source fragments that do not pair with its destination", peer.address)
            return None
        try:
            src = fragments_from_bytes(request.src)
        except WireFormatError as exc:
            log.warning("%s offered malformed source fragments (%s); receiving messages", peer.address, exc)
            return None
        if src.shape != views.fragments.shape or not np.array_equal(src[:, 1], views.fragments[:, 1]):
            log.warning("%s offered source fragments that do not pair with its destination", peer.address)
            return None
        if bool((src[:, 0] + src[:, 1] < src[:, 0]).any()):
            log.warning("%s offered source fragments that wrap around", peer.address)
            return None
        return src

    async def _pull(
        self,
        peer: ChannelPeer,
        request: WriteRequest,
        src: Fragments,
        views: Views,
        scope: anyio.CancelScope,
    ) -> None:
        """Read the writer's source into our destination with ``process_vm_readv`` (slices in worker threads, a
        cancel or a stall seen between them), then notify and answer DONE. If the kernel will not let us attach
        (``EPERM`` and the like) the write goes on as messages (what was copied is written again) and later writes
        from this peer are not pulled; a writer whose process is gone (``ESRCH``) or whose memory is (``EFAULT``)
        fails the write. A cancel leaves the destination partly written."""
        status, detail = WriteStatus.FAILED, "cancelled"
        try:
            with scope:
                # stopped before it started (its grant revoked, an abort): ends here, nothing read
                await anyio.lowlevel.checkpoint_if_cancelled()
                scope.deadline = anyio.current_time() + self.transport.stall_timeout
                if not _cma.inline(src):
                    # the writer waits for DONE (PROGRESS meanwhile); a short read is done before any
                    # reply could be sent, and DONE comes first (one frame less on the request's way)
                    await self._reply(peer, WriteReply(request.write_id, WriteStatus.PULLING))
                status, detail = await self._pull_slices(peer, request.write_id, src, views.fragments, scope)
                if status is WriteStatus.DONE and request.notify is not None:
                    with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        peer.notifications_out.send_nowait(request.notify)
            if scope.cancelled_caught:
                status, detail = self._cancelled_status(peer, request.write_id, scope, status, detail)
        finally:
            if status is not WriteStatus.READY:
                self._end_incoming(peer, request.write_id)
                with anyio.CancelScope(shield=True):
                    if peer.state.value == "connected":
                        await self._reply(peer, WriteReply(request.write_id, status, detail))
        if status is WriteStatus.READY:
            # we may not read the writer's memory: it sends the data as messages (it waits for READY)
            scope = peer.incoming[request.write_id] = anyio.CancelScope()
            await self._receive(peer, request, views, _plan_of(request, views), scope)

    async def _pull_slices(
        self, peer: ChannelPeer, write_id: int, src: Fragments, dst: Fragments, scope: anyio.CancelScope
    ) -> tuple[WriteStatus, str]:
        """The copies of :meth:`_pull`: DONE, FAILED (the writer or its memory is gone) or READY (we may not
        attach: receive messages instead)."""
        told = time.monotonic()

        async def after_slice() -> None:
            nonlocal told
            await anyio.lowlevel.checkpoint()
            scope.deadline = anyio.current_time() + self.transport.stall_timeout
            if time.monotonic() - told >= _PULL_PROGRESS_SECONDS:
                told = time.monotonic()
                await self._reply(peer, WriteReply(write_id, WriteStatus.PROGRESS))

        try:
            await _cma.copy_slices(_cma.read, peer.hello.pid, src, dst, after_slice=after_slice)
        except OSError as exc:
            if exc.errno in (errno.ESRCH, errno.EFAULT):
                return WriteStatus.FAILED, f"reading the writer's memory: {exc}"
            log.info("cannot read %s by process_vm_readv (%s); receiving messages", peer.address, exc)
            self._pull_refused.add(peer)
            return WriteStatus.READY, ""
        self.cma_reads += 1
        return WriteStatus.DONE, ""

    def _cancelled_status(
        self,
        peer: ChannelPeer,
        write_id: int,
        scope: anyio.CancelScope,
        status: WriteStatus,
        detail: str,
    ) -> tuple[WriteStatus, str]:
        """Why a write being received was stopped: a revoke of its grant (REGION), its stall deadline
        (TIMEOUT), or else as it was (an abort, the peer's loss)."""
        if (peer, write_id) in self._revoked_writes:
            return WriteStatus.REGION, (
                f"{_NOT_GRANTED}the grant of a write from {peer.address} was revoked while it was received"
            )
        if scope.deadline <= anyio.current_time():
            return WriteStatus.TIMEOUT, f"no data for {self.transport.stall_timeout} s"
        return status, detail

    def _end_incoming(self, peer: ChannelPeer, write_id: int) -> None:
        peer.incoming.pop(write_id, None)
        self._incoming_dst.pop((peer, write_id), None)
        self._revoked_writes.discard((peer, write_id))

    def revoked(self, peer: ChannelPeer) -> None:
        """Stop every write of ``peer`` being received that reaches outside its live grants now: it posts no more
        receives, pulls no more slices and answers REGION. Receives already posted (ucxx cannot cancel one
        request) and the slice being pulled may still land."""
        if not peer.incoming:
            return
        for write_id, scope in list(peer.incoming.items()):
            dst = self._incoming_dst.get((peer, write_id))
            if dst is not None and not peer.granted.holds(dst):
                log.warning(
                    "%s: stopping a write from %s: its grant was revoked",
                    self.transport.instance_id,
                    peer.address,
                )
                self._revoked_writes.add((peer, write_id))
                scope.cancel()

    async def _reply(self, peer: ChannelPeer, reply: WriteReply) -> None:
        with suppress(TransportError):  # the peer is gone; its writer learns that from the control channel
            await self.transport.control.send_frame(peer, FrameKind.WRITE_REPLY, wire.encode(reply))

    async def _receive(
        self,
        peer: ChannelPeer,
        request: WriteRequest,
        views: Views,
        plan: MessagePlan,
        scope: anyio.CancelScope,
    ) -> None:
        tag = (self.tag_prefix << 40) | ((self._next_incoming & 0xFFFFF) << 20)
        self._next_incoming += 1
        status, detail = WriteStatus.FAILED, "cancelled"
        try:
            with scope:
                # stopped before it started (its grant revoked, an abort): ends here, nothing posted
                await anyio.lowlevel.checkpoint_if_cancelled()
                scope.deadline = anyio.current_time() + self.transport.stall_timeout
                await self._reply(peer, WriteReply(request.write_id, WriteStatus.READY, tag=tag))

                async def start(k: int) -> tuple[Coroutine[Any, Any, Any], Any]:
                    first, end, packed = plan[k]
                    buffer = views.staging(first, end) if packed else views.row(first)
                    receive = ucxx.recv(buffer, tag + k)
                    self._kick()
                    return receive, buffer

                async def done(k: int, buffer: Any) -> None:
                    scope.deadline = anyio.current_time() + self.transport.stall_timeout
                    first, end, packed = plan[k]
                    if packed:
                        await anyio.to_thread.run_sync(views.scatter, buffer, first, end)

                try:
                    await windowed(
                        len(plan), self._window, start, done, lambda k: plan[k][2], self._packed_window
                    )
                except ucx_errors.UCXError as exc:
                    status, detail = WriteStatus.FAILED, str(translate(exc, "receiving"))
                else:
                    if any(v.device != "cpu" for v in views.table.regions):
                        import torch

                        await anyio.to_thread.run_sync(torch.cuda.synchronize)
                    if request.notify is not None:
                        with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                            peer.notifications_out.send_nowait(request.notify)
                    status, detail = WriteStatus.DONE, ""
            if scope.cancelled_caught:
                status, detail = self._cancelled_status(peer, request.write_id, scope, status, detail)
        finally:
            self._end_incoming(peer, request.write_id)
            with anyio.CancelScope(shield=True):
                if peer.state.value == "connected":
                    await self._reply(peer, WriteReply(request.write_id, status, detail))

    def handles(self) -> int:
        return self._endpoints

    def extra_attributes(self) -> dict[Any, Any]:
        return {TransportAttribute.ucx_worker_address: lambda: self._worker_address}


class UcxTransport(ChannelTransport[UcxDataPath]):
    """UCXX between processes, two-sided; the receiver checks and places every write.

    Takes the :class:`~kvferry.transports.channel.ChannelTransport` options, and:

    :param endpoint_error_handling: UCX endpoint error handling. Off (default) allows shared memory; dead peers
        are noticed through the control channel either way.
    :param host_cma: between peers of this host, a receiver reads host-memory writes out of the writer's process
        itself (``process_vm_readv``, see the module docstring) when both sides allow it (default). False: this
        transport neither offers its sources nor reads offered ones; everything goes through UCX
    :param cma: let UCX itself read the memory of peers on this host by CMA where this transport starts UCXX and
        ``UCX_TLS`` is not set. Off by default: a peer dying in the middle of such a read aborts this process
    :param progress_mode: UCXX progress mode if this transport initialises UCXX (default: ``UCXPY_PROGRESS_MODE``
        or ``"blocking"``, which costs no CPU while idle)
    :param zero_copy_bytes: fragments at least this long travel as their own message, straight into place
    :param pack_bytes: shorter fragments are packed into messages of at most this size
    :param window: messages in flight per write
    :param packed_window: packed messages in flight per write (each costs a gather and a scatter in worker threads,
        and ucxx polls every pending request on the event loop: a few at once keep the loop free)
    """

    name = "ucx"
    capabilities = Capabilities(
        one_sided_write=False, device_memory=True, cross_process=True, cross_host=True
    )

    def __init__(
        self,
        *,
        endpoint_error_handling: bool = False,
        host_cma: bool = True,
        cma: bool = False,
        progress_mode: str | None = None,
        zero_copy_bytes: int = 256 << 10,
        pack_bytes: int = 4 << 20,
        window: int = 32,
        packed_window: int = 4,
        **options: Any,
    ) -> None:
        if not 1 <= pack_bytes <= MAX_PACK_BYTES or zero_copy_bytes < 1:
            raise ConfigError(
                f"pack_bytes must be in [1, {MAX_PACK_BYTES}] and zero_copy_bytes positive, got "
                f"{pack_bytes} and {zero_copy_bytes}"
            )
        data_path = partial(
            UcxDataPath,
            endpoint_error_handling=endpoint_error_handling,
            host_cma=host_cma,
            cma=cma,
            progress_mode=progress_mode,
            zero_copy_bytes=zero_copy_bytes,
            pack_bytes=pack_bytes,
            window=window,
            packed_window=packed_window,
        )
        super().__init__(data_path, **options)

    @property
    def pulled_writes(self) -> int:
        """Writes of ours that the receiver read itself (``process_vm_readv``) since start."""
        return self.data_path.pulled_writes

    @property
    def cma_reads(self) -> int:
        """Writes of peers that we read ourselves (``process_vm_readv``) since start."""
        return self.data_path.cma_reads


def _plan_of(request: WriteRequest, views: Views) -> MessagePlan:
    """How the writer cuts ``request`` into messages (both sides compute the same plan; its bounds, the rows and
    ``pack_bytes``, were checked when the request came)."""
    return plan_messages(views.fragments[:, 1], request.zero_copy_bytes, request.pack_bytes)


def _raise_for(reply: WriteReply, peer: ChannelPeer, expected: WriteStatus) -> None:
    if reply.status is expected:
        return
    if reply.status is WriteStatus.REGION:
        if reply.detail.startswith(_NOT_GRANTED):
            raise NotGranted(f"{peer.address} refused the write: {reply.detail}")
        raise RegionError(f"{peer.address} refused the write: {reply.detail}")
    if reply.status is WriteStatus.TIMEOUT:
        raise TransferTimeout(f"{peer.address} received nothing for its stall deadline: {reply.detail}")
    raise TransportError(f"{peer.address} failed the write ({reply.status.value}): {reply.detail}")


transport_class = UcxTransport
