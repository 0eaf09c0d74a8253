"""``nixl``: one-sided WRITE through a NIXL agent with the UCX backend, notifications after the data.

Measured behaviour this follows (../shared/reference/feasibility.md):

- NIXL's progress thread busy-spins (its delay is hard-coded to 0), so it is off. Both sides are polled from the
  event loop with a growing ``anyio.sleep``: the initiator polls its transfer, and every agent runs one pump task
  that collects notifications. The pump is also what progresses the passive side, without which the first
  transfer to a peer stays ``PROC`` forever.
- On host memory UCX does the whole copy (CMA ``process_vm_writev``) inside ``transfer()``, which releases the
  GIL: large transfers are posted from a worker thread so the event loop is never blocked for long.
- The UCX backend runs with ``ucx_error_handling_mode=none`` by default (shared memory for active messages); a
  dead peer is still noticed within a deadline through the control channel.
- nixl_cu13 is imported directly (not the ``nixl`` meta package, which imports torch and picks a variant by
  import order) so it pairs with ucxx-cu13.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import anyio
import nixl_cu13._api as nixl_api
import nixl_cu13._bindings as nixl_bindings
import numpy as np

from kvferry.errors import PeerDisconnected, PeerIncompatible, RegionError, TransportError, WireFormatError
from kvferry.transports._channel import ChannelPeer, ChannelTransport
from kvferry.transports._memory import RegionTable, TensorRegistration
from kvferry.transports.base import Capabilities, Fragments, TransportAttribute, total_bytes

__all__ = ["NixlTransport", "transport_class"]

log = logging.getLogger("kvferry.transports.nixl")

#: prefix of every notification we send, so that an empty ``notify`` still arrives (NIXL drops empty ones)
_NOTIFY_MARK = b"\x01"


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


class NixlTransport(ChannelTransport):
    """NIXL agent, UCX backend, one-sided WRITE with notifications.

    Takes the :class:`~kvferry.transports._channel.ChannelTransport` options, and:

    :param error_handling: the UCX backend's ``ucx_error_handling_mode`` (``"none"``: shared memory allowed;
        ``"peer"``: UCX watches peers too, at some cost)
    :param thread_bytes: writes of at least this many bytes (or :attr:`thread_fragments` fragments) are posted
        from a worker thread, because UCX copies host memory inside the call
    :param poll_min: first polling delay (seconds); it doubles up to ``poll_busy`` while a write or a
        notification is awaited, and up to ``poll_idle`` otherwise
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
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self._error_handling = error_handling
        self._thread_bytes = thread_bytes
        self._thread_fragments = thread_fragments
        self._poll_min, self._poll_busy, self._poll_idle = poll_min, poll_busy, poll_idle
        self._agent: Any = None
        self._busy = 0
        self._wake = anyio.Event()
        self._by_agent: dict[str, ChannelPeer] = {}
        self._handles = 0
        #: xfer handles NIXL refused to release (still active); retried at aclose
        self._stuck: list[Any] = []
        # One NIXL call at a time: writes from worker threads must not overlap the pump's polling.
        self._lock = anyio.Lock()

    # --- lifecycle -------------------------------------------------------------------------------------

    async def _backend_open(self) -> None:
        config = nixl_api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=nixl_api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )

        def create() -> Any:
            agent = nixl_api.nixl_agent(self.instance_id, config)
            agent.create_backend("UCX", {"ucx_error_handling_mode": self._error_handling})
            return agent

        try:
            self._agent = await anyio.to_thread.run_sync(create)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "creating the NIXL agent") from exc

    async def _backend_start_tasks(self) -> None:
        self.spawn(self._pump)

    async def _backend_close(self) -> None:
        for handle in self._stuck:
            with suppress(*_NIXL_ERRORS):
                handle.release()
                self._handles -= 1
        self._stuck.clear()
        # The C++ agent is destroyed with its last reference; nothing of it may outlive the transport.
        self._agent = None

    def _backend_hello(self) -> bytes:
        metadata: bytes = self._agent.get_agent_metadata()
        return metadata

    def _nixl_peer(self, peer: ChannelPeer) -> bool:
        return not (peer.same_process and self._same_process_copy)

    async def _backend_peer_connected(self, peer: ChannelPeer) -> None:
        if not self._nixl_peer(peer):
            return
        try:
            name = self._agent.add_remote_agent(peer.hello.backend)
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
        # Wiring up the UCX connection takes ~0.2 s inside the first transfer otherwise, on the event loop.
        async with self._lock:
            try:
                await anyio.to_thread.run_sync(self._agent.make_connection, name)
            except _NIXL_ERRORS as exc:
                log.debug("make_connection to %s: %s (the first transfer will connect)", peer.address, exc)

    async def _backend_peer_lost(self, peer: ChannelPeer) -> None:
        name = peer.backend
        if name is None or self._agent is None:
            return
        peer.backend = None
        self._by_agent.pop(name, None)
        async with self._lock:
            with suppress(*_NIXL_ERRORS):
                self._agent.remove_remote_agent(name)

    async def _backend_register(self, registration: TensorRegistration) -> bytes:
        dlists = []
        try:
            async with self._lock:
                for info in registration.infos:
                    mem, device_id = _mem_type({info.device})
                    dlists.append(self._agent.register_memory([(info.address, info.length, device_id, "")], mem))
        except _NIXL_ERRORS as exc:
            for dlist in dlists:
                with suppress(*_NIXL_ERRORS):
                    self._agent.deregister_memory(dlist)
            raise translate(exc, "registering memory with NIXL") from exc
        registration.backend = dlists
        # Peers reload our whole metadata: NIXL merges what it already knows of us with the new regions.
        metadata: bytes = self._agent.get_agent_metadata()
        return metadata

    async def _backend_deregister(self, registration: TensorRegistration) -> None:
        if self._agent is None:
            return
        async with self._lock:
            for dlist in registration.backend or ():
                with suppress(*_NIXL_ERRORS):
                    self._agent.deregister_memory(dlist)
        registration.backend = None

    async def _backend_regions_updated(self, peer: ChannelPeer, blob: bytes) -> None:
        if peer.backend is None:
            return
        async with self._lock:
            try:
                self._agent.add_remote_agent(blob)
            except _NIXL_ERRORS as exc:
                raise WireFormatError(f"NIXL refused the updated metadata of {peer.address}: {exc}") from exc

    # --- progress ------------------------------------------------------------------------------------

    @asynccontextmanager
    async def _backend_waiting(self) -> AsyncIterator[None]:
        self._busy += 1
        self._wake.set()
        try:
            yield
        finally:
            self._busy -= 1

    async def _pump(self) -> None:
        """Collect notifications (and so progress the passive side) with a growing delay; never spins."""
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
            with anyio.move_on_after(delay):
                await self._wake.wait()
                delay = self._poll_min

    # --- writes --------------------------------------------------------------------------------------

    async def _backend_write(
        self, peer: ChannelPeer, src: Fragments, dst: Fragments, notify: bytes | None, stall: float
    ) -> None:
        name = peer.backend
        if name is None:
            raise peer.error
        local, local_mem = _descs(src, self.own_regions, "source")
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
                        "WRITE", local_dlist, indices, remote_dlist, indices, message, skip_desc_merge=not self._coalesce
                    )
                    handles.append(xfer)
                except _NIXL_ERRORS as exc:
                    raise translate(exc, f"preparing a write to {peer.address}") from exc
                finally:
                    self._handles += len(handles)
            async with self.guard(peer, stall):
                state = await self._post(xfer, total_bytes(src) >= self._thread_bytes or len(src) >= self._thread_fragments)
                delay = self._poll_min
                while state == "PROC":
                    await anyio.sleep(delay)
                    delay = min(delay * 2, self._poll_busy)
                    async with self._lock:
                        state = agent.check_xfer_state(xfer)
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
                    state: str = await anyio.to_thread.run_sync(self._agent.transfer, xfer)
                else:
                    state = self._agent.transfer(xfer)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "posting a NIXL write") from exc
        return state

    async def _release_handles(self, handles: list[Any]) -> None:
        async with self._lock:
            for handle in reversed(handles):
                try:
                    handle.release()
                    self._handles -= 1
                except _NIXL_ERRORS:
                    # Still active (a cancelled write NIXL could not abort): keep it, retry at aclose.
                    self._stuck.append(handle)

    def _backend_handles(self) -> int:
        return self._handles + len(self._by_agent)

    def _backend_extra(self) -> dict[Any, Any]:
        return {
            TransportAttribute.nixl_agent_name: lambda: self.instance_id,
            TransportAttribute.nixl_error_handling: lambda: self._error_handling,
        }


transport_class = NixlTransport
