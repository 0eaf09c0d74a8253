"""``nixl``: one-sided WRITE through a NIXL agent with the UCX backend, the notification after the data.

How NIXL is driven:

- NIXL's progress thread busy-spins (its delay is fixed at 0), so it is off. Both sides are polled from the event
  loop with a growing delay: the initiator polls its transfer, and every agent runs one pump task that collects
  notifications. The pump also progresses the passive side, without which the first transfer to a peer would
  stay in progress for ever.
- On host memory UCX does the whole copy inside ``transfer()``, which releases the GIL: large writes are posted
  from a worker thread, so that the event loop is never blocked for long.
- Completion is awaited in a worker thread that polls with microsecond sleeps, :data:`_POLL_SLICE` at a time:
  ``anyio.sleep`` on the event loop rounds every wait up to a millisecond, which a large device write would feel.
- The UCX backend runs with ``ucx_error_handling_mode=none`` by default (shared memory for active messages); a
  dead peer is still noticed within a deadline, through the control channel.

Peers on this host take paths that cost less than NIXL's descriptors (one library call per fragment):

- their CUDA regions by CUDA IPC (``cuda_ipc``, on by default): each side exports its registered CUDA regions
  (torch IPC handles, carried in its backend blob: :mod:`~kvferry.transports._nixl_exports`); the writer maps the
  peer's and copies with batched indexed copies on its current stream, then sends the notification over the
  control channel once the stream has passed the copies. A bounce through one large NIXL write would move every
  byte through device memory three times instead.
- their host memory by batched ``process_vm_writev`` calls (``host_cma``, on by default;
  :mod:`~kvferry.transports._cma`): up to 1024 fragments per call, a long write in slices on several worker
  threads at once (one kernel copy is bound by one core). Destinations are checked against the host regions the
  peer's blob lists as well as the channel's table (the kernel would write anywhere the peer maps), and only a
  peer that has proven its pid in the handshake is written this way; a refusal (no ``ptrace`` permission) turns
  the path off for that peer, and its writes go through NIXL.

Other peers (other hosts, host memory of a peer we may not attach to, a peer whose IPC handles cannot be opened)
go through NIXL.

Re-registration at a freed device address on a live connection: once a peer deregistered a VRAM region and
registered a new one at the same address (``cudaMalloc`` reuses addresses), NIXL may refuse the new regions'
metadata (``NIXL_ERR_NOT_ALLOWED``), and removing the agent and loading its whole metadata afresh fails too;
host memory is not affected. So peers merge only the new regions' partial metadata, and when NIXL refuses it the
connection stays up (messages, other regions, CUDA IPC writes): only NIXL writes into those regions fail, with a
:class:`~kvferry.errors.RegionError` naming the cause, until the peer registers them again and NIXL accepts it.
Keep VRAM registered for a connection's lifetime where possible.

Grants (:meth:`~kvferry.transports.Transport.grant`) are checked by the writer only: before any byte moves,
every destination row of a write, whatever its path (NIXL, ``process_vm_writev``, CUDA IPC), must lie inside
what the peer granted us, else :class:`~kvferry.errors.NotGranted`. The receiver cannot check: its CPU takes no
part in a one-sided write, and its NIXL agent accepts a WRITE from any agent that loaded its metadata, into any
memory registered with it (NIXL knows registrations, not peers' rights); likewise the kernel lets any process of
this host that may ``ptrace`` it write its memory, and a process holding a CUDA IPC handle it exported can write
the whole region. So a grant holds against a confused writer running this code, not against a hostile one: what
bounds that is giving the NIXL metadata (and the IPC handles) only to peers that authenticated themselves, which
is the handshake's job. ``ucx`` checks in the receiver as well.

``nixl_cu13`` is imported directly (not the ``nixl`` meta package, which imports torch and picks a variant by
import order) so that it pairs with ``ucxx-cu13``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import nixl_cu13._api as nixl_api
import nixl_cu13._bindings as nixl_bindings
import numpy as np

from kvferry.errors import PeerDisconnected, PeerIncompatible, RegionError, TransportError, WireFormatError
from kvferry.transports import _cma
from kvferry.transports._indexed_copy import DeviceDestinations
from kvferry.transports._memory import CopyPlan, RegionTable, TensorRegistration
from kvferry.transports._nixl_exports import IpcExport, IpcPeer, IpcRoute, export_cuda, pack_blob, unpack_blob
from kvferry.transports.base import Capabilities, Fragments, TransportAttribute, total_bytes
from kvferry.transports.channel import ChannelTransport
from kvferry.transports.datapath import DataPath
from kvferry.transports.messages import FrameKind, RegionInfo
from kvferry.transports.peers import ChannelPeer
from kvferry.transports.writes import CheckedRows

__all__ = ["NixlDataPath", "NixlTransport", "transport_class"]

log = logging.getLogger("kvferry.transports.nixl")

#: prefix of every notification we send, so that an empty ``notify`` still arrives (NIXL drops empty ones)
_NOTIFY_MARK = b"\x01"
#: longest a worker thread polls one write before handing back to the event loop (cancel, stall, peer loss)
_POLL_SLICE = 5e-3


def translate(exc: BaseException, what: str) -> TransportError:
    """A NIXL exception as one of ours."""
    if isinstance(exc, nixl_bindings.nixlRemoteDisconnectError):
        return PeerDisconnected(f"{what}: peer disconnected ({exc})")
    if isinstance(exc, nixl_bindings.nixlNotFoundError):
        return RegionError(f"{what}: NIXL found no registered memory or agent for it ({exc})")
    return TransportError(f"{what}: {type(exc).__name__}: {exc}")


_NIXL_ERRORS: tuple[type[BaseException], ...] = (
    nixl_bindings.nixlBackendError,
    nixl_bindings.nixlCancelledError,
    nixl_bindings.nixlInvalidParamError,
    nixl_bindings.nixlMismatchError,
    nixl_bindings.nixlNotAllowedError,
    nixl_bindings.nixlNotFoundError,
    nixl_bindings.nixlNotPostedError,
    nixl_bindings.nixlNotSupportedError,
    nixl_bindings.nixlRemoteDisconnectError,
    nixl_bindings.nixlRepostActiveError,
    nixl_bindings.nixlUnknownError,
    RuntimeError,
)


def _mem_type(devices: set[str]) -> tuple[str, int]:
    if len(devices) != 1:
        raise ValueError(f"one NIXL write moves one kind of memory, these fragments span {sorted(devices)}")
    device = devices.pop()
    if device == "cpu":
        return "DRAM", 0
    return "VRAM", int(device.partition(":")[2] or 0)


def _descs(fragments: Fragments, table: RegionTable, what: str) -> tuple[np.ndarray[Any, Any], str]:
    index = table.locate(fragments, what)
    mem, device_id = _mem_type({table.regions[int(i)].device for i in np.unique(index)})
    rows = np.empty((len(fragments), 3), dtype=np.uint64)
    rows[:, :2] = fragments
    rows[:, 2] = device_id
    return rows, mem


class NixlDataPath(DataPath):
    """A NIXL agent with the UCX backend, and the same-host paths beside it (see the module docstring); its
    options are :class:`NixlTransport`'s."""

    def __init__(
        self,
        transport: ChannelTransport[Any],
        *,
        error_handling: str = "none",
        thread_bytes: int = 1 << 20,
        thread_fragments: int = 256,
        poll_min: float = 20e-6,
        poll_busy: float = 1e-3,
        poll_idle: float = 20e-3,
        cuda_ipc: bool = True,
        host_cma: bool = True,
    ) -> None:
        super().__init__(transport)
        self._error_handling = error_handling
        self._thread_bytes = thread_bytes
        self._thread_fragments = thread_fragments
        self._poll_min, self._poll_busy, self._poll_idle = poll_min, poll_busy, poll_idle
        self._cuda_ipc = cuda_ipc
        self._ipc: dict[ChannelPeer, IpcPeer] = {}
        self._host_cma = host_cma and _cma.available()
        #: peers whose memory this process may not attach to (the first refusal turns the path off for them)
        self._cma_refused: set[ChannelPeer] = set()
        #: per peer: its host regions as its NIXL blob lists them (checked again before a process_vm_writev)
        self._cma_tables: dict[ChannelPeer, RegionTable] = {}
        #: writes that went by process_vm_writev (not through NIXL) since start
        self.cma_writes = 0
        #: per peer: regions whose NIXL metadata NIXL refused to merge (why), refused as write destinations
        self._refused_regions: dict[ChannelPeer, dict[RegionInfo, str]] = {}
        #: writes that went by CUDA IPC (not through NIXL) since start
        self.ipc_writes = 0
        self._agent: Any = None
        self._busy = 0
        self._wake = anyio.Event()
        #: how long the pump sleeps now (between polls)
        self._pump_delay = poll_min
        self._by_agent: dict[str, ChannelPeer] = {}
        self._handles = 0
        #: xfer handles NIXL refused to release (still active); retried at aclose
        self._stuck: list[Any] = []
        # One NIXL call at a time: writes from worker threads must not overlap the pump's polling.
        self._lock = anyio.Lock()

    # --- lifecycle -------------------------------------------------------------------------------------

    async def open(self) -> None:
        config = nixl_api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=nixl_api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )

        def create() -> Any:
            agent = nixl_api.nixl_agent(self.transport.instance_id, config)
            agent.create_backend("UCX", {"ucx_error_handling_mode": self._error_handling})
            return agent

        try:
            self._agent = await anyio.to_thread.run_sync(create)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "creating the NIXL agent") from exc

    async def start_tasks(self) -> None:
        self.transport.spawn(self._pump)

    async def close(self) -> None:
        for handle in self._stuck:
            with suppress(*_NIXL_ERRORS):
                handle.release()
                self._handles -= 1
        self._stuck.clear()
        # The C++ agent is destroyed with its last reference; nothing of it may outlive the transport.
        self._agent = None

    def _registered(self, extra: TensorRegistration | None = None) -> list[TensorRegistration]:
        return [*self.transport.registrations, *([extra] if extra is not None else [])]

    def _exports(self, extra: TensorRegistration | None = None) -> list[IpcExport]:
        return [e for r in self._registered(extra) for e in (r.backend[1] if r.backend else ())]

    def _host_regions(self, extra: TensorRegistration | None = None) -> list[RegionInfo]:
        return [i for r in self._registered(extra) for i in r.infos if i.device == "cpu"]

    def hello(self) -> bytes:
        return pack_blob(self._agent.get_agent_metadata(), self._exports(), host=self._host_regions())

    def _nixl_peer(self, peer: ChannelPeer) -> bool:
        return not (peer.same_process and self.transport.same_process_copy)

    async def peer_connected(self, peer: ChannelPeer) -> None:
        if not self._nixl_peer(peer):
            return
        metadata, exports, _, _, host = unpack_blob(peer.hello.backend)
        self._cma_tables[peer] = RegionTable(host)
        try:
            name = self._agent.add_remote_agent(metadata)
        except _NIXL_ERRORS as exc:
            raise WireFormatError(f"NIXL refused the metadata of {peer.address}: {exc}") from exc
        if isinstance(name, bytes):
            name = name.decode()
        if name != peer.hello.instance_id:
            with suppress(*_NIXL_ERRORS):
                self._agent.remove_remote_agent(name)
            raise PeerIncompatible(f"{peer.address} sent NIXL metadata of agent {name!r}, not its own")
        peer.backend = name
        self._by_agent[name] = peer
        if self._cuda_ipc and peer.hello.hostname == socket.gethostname():
            self._ipc[peer] = IpcPeer(exports)
        # Otherwise the first transfer wires up the UCX connection itself, on the event loop.
        async with self._lock:
            try:
                await anyio.to_thread.run_sync(self._agent.make_connection, name)
            except _NIXL_ERRORS as exc:
                log.debug("make_connection to %s: %s (the first transfer will connect)", peer.address, exc)

    async def peer_lost(self, peer: ChannelPeer) -> None:
        self._refused_regions.pop(peer, None)
        self._cma_tables.pop(peer, None)
        self._cma_refused.discard(peer)
        ipc = self._ipc.pop(peer, None)
        if ipc is not None and ipc.mapped:
            import torch

            # nothing of ours may still be queued on the mapping when its handles close
            await anyio.to_thread.run_sync(torch.cuda.synchronize)
            ipc.mapped.clear()
        name = peer.backend
        if name is None or self._agent is None:
            return
        peer.backend = None
        self._by_agent.pop(name, None)
        async with self._lock:
            with suppress(*_NIXL_ERRORS):
                self._agent.remove_remote_agent(name)

    async def register(self, registration: TensorRegistration) -> bytes:
        dlists = []
        try:
            async with self._lock:
                for info in registration.infos:
                    mem, device_id = _mem_type({info.device})
                    dlists.append(
                        self._agent.register_memory([(info.address, info.length, device_id, "")], mem)
                    )
        except _NIXL_ERRORS as exc:
            for dlist in dlists:
                with suppress(*_NIXL_ERRORS):
                    self._agent.deregister_memory(dlist)
            raise translate(exc, "registering memory with NIXL") from exc
        exports: list[IpcExport] = []
        if self._cuda_ipc:
            shared = (export_cuda(t) for t in registration.tensors if t.device.type == "cuda")
            exports.extend(e for e in shared if e is not None)
        registration.backend = (dlists, exports)
        # Peers merge the metadata of the new regions only: NIXL refuses to reload our whole metadata
        # (connection info included) once a region was deregistered (NIXL_ERR_NOT_ALLOWED).
        async with self._lock:
            try:
                partial = [self._agent.get_partial_agent_metadata(d, False) for d in dlists]
            except _NIXL_ERRORS as exc:
                raise translate(exc, "reading NIXL metadata of new regions") from exc
        return pack_blob(
            b"", self._exports(registration), partial, registration.infos, self._host_regions(registration)
        )

    async def deregister(self, registration: TensorRegistration) -> None:
        if self._agent is None:
            return
        async with self._lock:
            for dlist in registration.backend[0] if registration.backend else ():
                with suppress(*_NIXL_ERRORS):
                    self._agent.deregister_memory(dlist)
        registration.backend = None

    async def regions_updated(self, peer: ChannelPeer, blob: bytes) -> None:
        if peer.backend is None:
            return
        metadata, exports, partial, new, host = unpack_blob(blob)
        self._cma_tables[peer] = RegionTable(host)
        if peer in self._ipc:
            self._ipc[peer].exports = exports
            self._ipc[peer].dirty = True
        current = set(peer.regions.regions)
        refused = {
            r: why for r, why in self._refused_regions.get(peer, {}).items() if r in current and r not in new
        }
        async with self._lock:
            try:
                for md in partial or [metadata]:
                    self._agent.add_remote_agent(md)
            except _NIXL_ERRORS as exc:
                # VRAM re-registered at an address a deregistered region had (cudaMalloc reuses addresses): the
                # connection stays up, only these regions cannot be written through NIXL.
                why = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "%s: NIXL refused the metadata of %s's new regions (%s)",
                    self.transport.instance_id,
                    peer,
                    why,
                )
                refused.update((r, why) for r in new)
        if refused:
            self._refused_regions[peer] = refused
        else:
            self._refused_regions.pop(peer, None)

    def _check_refused(self, peer: ChannelPeer, dst: Fragments) -> None:
        """RegionError if ``dst`` touches a region of ``peer`` whose NIXL metadata NIXL refused."""
        refused = self._refused_regions.get(peer)
        if not refused:
            return
        table = peer.regions
        for i in np.unique(table.locate(dst, f"destination at {peer.address}")):
            region = table.regions[int(i)]
            if region in refused:
                raise RegionError(
                    f"{peer.address} registered [{region.address:#x}, +{region.length}) on {region.device} "
                    "again on a live NIXL connection and NIXL refused its metadata "
                    f"({refused[region]}): re-registration at a freed device address on a live NIXL "
                    "connection; reconnect to write to it"
                )

    # --- progress ------------------------------------------------------------------------------------

    @asynccontextmanager
    async def waiting(self) -> AsyncIterator[None]:
        self._busy += 1
        if self._pump_delay > self._poll_busy:  # asleep for the idle delay: poll now, then at the busy pace
            self._wake.set()
        try:
            yield
        finally:
            self._busy -= 1

    async def _pump(self) -> None:
        """Collect notifications (and so progress the passive side) with a growing delay; never spins.

        A waiter (a write in flight, someone waiting for a notification) wakes the pump only when it sleeps
        for the idle delay; else the pump keeps its pace (a waiter that comes when the previous one got its
        notification, the common case, would otherwise cost a poll and a turn of the event loop each time)."""
        delay = self._poll_min
        while True:
            async with self._lock:
                notifications = self._agent.get_new_notifs()
            if notifications:
                delay = self._poll_min
                for name, messages in notifications.items():
                    peer = self._by_agent.get(name.decode() if isinstance(name, bytes) else name)
                    if peer is None:
                        continue
                    for message in messages:
                        if message.startswith(_NOTIFY_MARK):
                            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                                peer.notifications_out.send_nowait(bytes(message[1:]))
            else:
                delay = min(delay * 2, self._poll_busy if self._busy else self._poll_idle)
            if self._wake.is_set():
                self._wake = anyio.Event()
            self._pump_delay = delay
            with anyio.move_on_after(delay):
                await self._wake.wait()
                delay = self._poll_min

    # --- writes --------------------------------------------------------------------------------------

    async def write(self, peer: ChannelPeer, rows: CheckedRows, notify: bytes | None, stall: float) -> None:
        name = peer.backend
        if name is None:
            raise peer.error
        src, dst = rows.src, rows.dst
        src_devices = self.transport.own_regions.devices(rows.src_index)
        route = self._ipc_route(peer, rows, src_devices)
        if route is not None:
            await self._ipc_write(peer, src, route, notify, stall)
            return
        if (
            src_devices == {"cpu"}
            and self._cma_route(peer, dst)
            and await self._cma_write(peer, src, dst, notify, stall)
        ):
            return
        self._check_refused(peer, dst)
        local, local_mem = _descs(src, self.transport.own_regions, "source")
        remote, remote_mem = _descs(dst, peer.regions, f"destination at {peer.address}")
        indices = np.arange(len(src), dtype=np.int32)
        message = b"" if notify is None else _NOTIFY_MARK + notify
        agent = self._agent
        handles: list[Any] = []
        self._busy += 1
        self._wake.set()
        try:
            async with self._lock:
                try:
                    local_dlist = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, local_mem)
                    handles.append(local_dlist)
                    remote_dlist = agent.prep_xfer_dlist(name, remote, remote_mem)
                    handles.append(remote_dlist)
                    xfer = agent.make_prepped_xfer(
                        "WRITE",
                        local_dlist,
                        indices,
                        remote_dlist,
                        indices,
                        message,
                        skip_desc_merge=not self.transport.coalesce,
                    )
                    handles.append(xfer)
                except _NIXL_ERRORS as exc:
                    raise translate(exc, f"preparing a write to {peer.address}") from exc
                finally:
                    self._handles += len(handles)
            async with self.transport.writes.guard(peer, stall):
                state = await self._post(
                    xfer, total_bytes(src) >= self._thread_bytes or len(src) >= self._thread_fragments
                )
                while state == "PROC":
                    async with self._lock:
                        # Not abandoned on cancel: a slice ends within _POLL_SLICE, then the cancel is seen.
                        state = await anyio.to_thread.run_sync(self._poll_slice, xfer, False)
                if state != "DONE":
                    if peer.lost.is_set():
                        raise peer.error
                    raise TransportError(f"NIXL write to {peer.address} failed ({state})")
        finally:
            self._busy -= 1
            with anyio.CancelScope(shield=True):
                await self._release_handles(handles)

    async def _post(self, xfer: Any, in_thread: bool) -> str:
        try:
            async with self._lock:
                if in_thread:
                    # Not abandoned on cancel: the handle must not be released while the thread posts it.
                    state: str = await anyio.to_thread.run_sync(self._poll_slice, xfer, True)
                else:
                    state = self._agent.transfer(xfer)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "posting a NIXL write") from exc
        return state

    def _poll_slice(self, xfer: Any, post: bool) -> str:
        """(In a worker thread) post ``xfer`` if asked, then poll it with growing microsecond sleeps for at most
        :data:`_POLL_SLICE` seconds; returns its state."""
        agent = self._agent
        try:
            state: str = agent.transfer(xfer) if post else agent.check_xfer_state(xfer)
            end = time.monotonic() + _POLL_SLICE
            delay = 2e-6
            while state == "PROC" and time.monotonic() < end:
                time.sleep(delay)
                delay = min(delay * 2, 100e-6)
                state = agent.check_xfer_state(xfer)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "polling a NIXL write") from exc
        return state

    # --- host memory by process_vm_writev ------------------------------------------------------------

    def _cma_route(self, peer: ChannelPeer, dst: Fragments) -> bool:
        """(For host-memory sources.) True when the peer is a process of this host we may attach to (as far as we
        know) and every destination lies in a host region its NIXL blob lists: checked apart from the channel's
        check, as NIXL checks its own metadata (the kernel would write anywhere the peer maps)."""
        table = self._cma_tables.get(peer)
        if not self._host_cma or not peer.same_host or peer in self._cma_refused or table is None:
            return False
        try:
            table.locate(dst, "destination")
        except RegionError:
            return False  # NIXL decides (and refuses what its metadata does not hold)
        return True

    async def _cma_write(
        self, peer: ChannelPeer, src: Fragments, dst: Fragments, notify: bytes | None, stall: float
    ) -> bool:
        """Write by ``process_vm_writev`` (:func:`~kvferry.transports._cma.copy_slices`: slices on several worker
        threads, a cancel or a stall seen between them), then notify over the control channel. False (the caller
        writes through NIXL; what was written is written again) when the kernel refuses: the path stays off for
        this peer."""
        async with self.transport.writes.guard(peer, stall) as guard:

            async def after_slice() -> None:
                # a slice that outlasted the stall deadline ends the write here
                await anyio.lowlevel.checkpoint()
                guard.progress()

            try:
                await _cma.copy_slices(_cma.write, peer.hello.pid, src, dst, after_slice=after_slice)
            except ProcessLookupError as exc:
                # the peer's process is gone: NIXL's own path (UCX's CMA, error handling off) would abort
                # this process on the same call
                raise PeerDisconnected(f"the process of {peer.address} is gone ({exc})") from exc
            except OSError as exc:
                log.info("cannot write %s by process_vm_writev (%s); writing through NIXL", peer.address, exc)
                self._cma_refused.add(peer)
                return False
        self.cma_writes += 1
        if notify is not None:
            await self.transport.control.send_frame(peer, FrameKind.NOTIFY, notify)
        return True

    def device_destinations(self, peer: ChannelPeer) -> DeviceDestinations | None:
        """Our mapping of the peer's CUDA regions (CUDA IPC), for indexed writes: templates into memory it did not
        export (host memory) go through NIXL as plain fragments."""
        ipc = self._ipc.get(peer)
        if peer.backend is None or ipc is None:
            return None
        return ipc.device_destinations(peer.regions)

    def may_write_together(self, peer: ChannelPeer) -> bool:
        ipc = self._ipc.get(peer)
        return ipc is not None and ipc.usable

    async def write_together(self, peer: ChannelPeer, rows: CheckedRows, stall: float) -> bool:
        """Through our mapping of the peer's CUDA memory: one launch and one wait, after which every byte is in
        place. Host memory (``process_vm_writev`` copies in worker threads, several at once when the writes
        go on their own) and NIXL's own path write each on its own."""
        if peer.backend is None:
            raise peer.error
        route = self._ipc_route(peer, rows, self.transport.own_regions.devices(rows.src_index))
        if route is None:
            return False
        await self._ipc_write(peer, rows.src, route, None, stall)
        return True

    # --- CUDA IPC ------------------------------------------------------------------------------------

    def _ipc_route(self, peer: ChannelPeer, rows: CheckedRows, src_devices: set[str]) -> IpcRoute | None:
        """``rows.dst`` translated into our mapping of the peer's CUDA regions, or None (the write goes through
        NIXL). ``src_devices``: the devices of our source ranges."""
        ipc = self._ipc.get(peer)
        if ipc is None or "cpu" in src_devices:
            return None
        return ipc.route(peer.regions, rows)

    async def _ipc_write(
        self,
        peer: ChannelPeer,
        src: Fragments,
        route: IpcRoute,
        notify: bytes | None,
        stall: float,
    ) -> None:
        plan = CopyPlan(
            src,
            self.transport.own_regions,
            route.dst,
            route.table,
            src_index=route.src_index,
            dst_index=route.dst_index,
        )
        async with self.transport.writes.guard(peer, stall):
            # polled on the loop only when it is our one write in flight (pollers slow each other down)
            await plan.run(poll=self.transport.writes.in_flight == 1)
        self.ipc_writes += 1
        if notify is not None:
            await self.transport.control.send_frame(peer, FrameKind.NOTIFY, notify)

    async def _release_handles(self, handles: list[Any]) -> None:
        async with self._lock:
            for handle in reversed(handles):
                try:
                    handle.release()
                    self._handles -= 1
                except _NIXL_ERRORS:
                    # Still active (a cancelled write NIXL could not abort): keep it, retry at aclose.
                    self._stuck.append(handle)

    def handles(self) -> int:
        return self._handles + len(self._by_agent)

    def extra_attributes(self) -> dict[Any, Any]:
        return {
            TransportAttribute.nixl_agent_name: lambda: self.transport.instance_id,
            TransportAttribute.nixl_error_handling: lambda: self._error_handling,
            TransportAttribute.nixl_cuda_ipc: lambda: self._cuda_ipc,
        }


class NixlTransport(ChannelTransport[NixlDataPath]):
    """NIXL agent, UCX backend, one-sided WRITE with notifications.

    Takes the :class:`~kvferry.transports.channel.ChannelTransport` options, and:

    :param error_handling: the UCX backend's ``ucx_error_handling_mode`` (``"none"``: shared memory allowed;
        ``"peer"``: UCX watches peers too, at some cost)
    :param thread_bytes: writes of at least this many bytes (or :attr:`thread_fragments` fragments) are posted
        from a worker thread, because UCX copies host memory inside the call
    :param poll_min: first polling delay (seconds) of the notification pump; it doubles up to ``poll_busy``
        while a write or a notification is awaited, and up to ``poll_idle`` otherwise
    :param cuda_ipc: write CUDA regions of peers on this host by CUDA IPC and batched device copies instead of
        NIXL descriptors (see the module docstring); False: everything goes through NIXL
    :param host_cma: write host memory of peers on this host with batched ``process_vm_writev`` calls (up to
        1024 fragments per call; see :mod:`~kvferry.transports._cma`) instead of NIXL descriptors (one call each)
    """

    name = "nixl"
    capabilities = Capabilities(one_sided_write=True, device_memory=True, cross_process=True, cross_host=True)

    def __init__(
        self,
        *,
        error_handling: str = "none",
        thread_bytes: int = 1 << 20,
        thread_fragments: int = 256,
        poll_min: float = 20e-6,
        poll_busy: float = 1e-3,
        poll_idle: float = 20e-3,
        cuda_ipc: bool = True,
        host_cma: bool = True,
        **options: Any,
    ) -> None:
        data_path = partial(
            NixlDataPath,
            error_handling=error_handling,
            thread_bytes=thread_bytes,
            thread_fragments=thread_fragments,
            poll_min=poll_min,
            poll_busy=poll_busy,
            poll_idle=poll_idle,
            cuda_ipc=cuda_ipc,
            host_cma=host_cma,
        )
        super().__init__(data_path, **options)

    @property
    def cma_writes(self) -> int:
        """Writes that went by ``process_vm_writev`` (not through NIXL) since start."""
        return self.data_path.cma_writes

    @property
    def ipc_writes(self) -> int:
        """Writes that went by CUDA IPC (not through NIXL) since start."""
        return self.data_path.ipc_writes


transport_class = NixlTransport
