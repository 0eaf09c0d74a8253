"""The data path of a channel transport: what moves a checked write's bytes to a peer in another process.

A :class:`~kvferry.transports.channel.ChannelTransport` does everything a transport does except that: it
listens, handshakes, keeps its peers, carries messages, notifications and grants on its control channel
(:mod:`~kvferry.transports.control`), checks every write against registered memory and the peer's grants, and
copies to peers of its own process itself (:mod:`~kvferry.transports.writes`). The bytes of a write to a peer in
another process move through its :class:`DataPath`: NIXL (:mod:`~kvferry.transports.nixl`), UCX
(:mod:`~kvferry.transports.ucx`), or none at all (:mod:`~kvferry.transports.local`: it reaches only its own
process).

The transport calls its data path at these points of its own life and of each peer's::

    start():      open() ──> (listener, task group) ──> start_tasks()
    handshake:    hello() is sent; admit(peer), then peer_connected(peer): raise to refuse the peer
    connected:    register / deregister (ours) · regions_updated (the peer's) · frame (two-sided control frames)
                  write · write_together · device_destinations · revoked (a grant of ours ended)
    peer lost:    peer_lost(peer)                 (also for a peer refused after peer_connected)
    aclose():     deregister(each registration) ──> close()

Everything a data path is handed has been checked: a write's rows lie in registered memory on both sides and,
for the destination, in what the peer granted us (:class:`~kvferry.transports.writes.CheckedRows`). What a data
path may use of its transport: ``spawn`` (background tasks that end with the transport), ``writes.guard`` (a
write's stall deadline and the peer's loss), ``control.send_frame`` (frames and notifications on the peer's
control channel), ``own_regions``, ``registrations`` and the transport's options (``stall_timeout``,
``connect_timeout``, ``same_process_copy``, ``coalesce``).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from kvferry.errors import WireFormatError

if TYPE_CHECKING:
    from kvferry.transports._indexed_copy import DeviceDestinations
    from kvferry.transports._memory import TensorRegistration
    from kvferry.transports.channel import ChannelTransport
    from kvferry.transports.peers import ChannelPeer
    from kvferry.transports.writes import CheckedRows

__all__ = ["DataPath"]


class DataPath(metaclass=ABCMeta):
    """How a :class:`~kvferry.transports.channel.ChannelTransport` reaches peers in other processes.

    A backend implements :meth:`write` and overrides the other points its library takes part in; each has a
    default that does nothing (or declines), so a backend names only those.
    """

    #: the tag prefix two-sided data to this transport carries
    #: (:attr:`~kvferry.transports.messages.Hello.tag_prefix`); 0 where the data path does not tag its data
    tag_prefix: int = 0

    def __init__(self, transport: ChannelTransport[DataPath]) -> None:
        self.transport = transport

    # --- lifecycle ---------------------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the library; the first thing :meth:`~kvferry.transports.Transport.start` does.

        A failure (or a cancel) fails the start, and :meth:`close` follows.

        :raises ~kvferry.errors.TransportError: the library cannot start.
        """
        return

    async def start_tasks(self) -> None:
        """Start background tasks (polling, say) with the transport's ``spawn``, once its task group runs; they
        are cancelled by the transport's aclose."""
        return

    async def close(self) -> None:
        """Close the library: the last thing aclose does, after every peer and registration is released.
        Shielded from cancellation by the caller."""
        return

    # --- peers -------------------------------------------------------------------------------------------

    def hello(self) -> bytes:
        """What peers need to reach us through the library (:attr:`~kvferry.transports.messages.Hello.backend`:
        NIXL agent metadata, a UCX worker address); empty without a library."""
        return b""

    def admit(self, peer: ChannelPeer) -> None:
        """Refuse a peer this data path cannot reach, before anything is set up for it (the handshake answers
        the peer with the refusal).

        :raises ~kvferry.errors.PeerIncompatible: the peer is out of reach.
        """
        return

    async def peer_connected(self, peer: ChannelPeer) -> None:
        """Set up what writes to ``peer`` need (a NIXL remote agent, a UCX endpoint), once the handshake holds.
        Whatever it raises refuses the peer (a cancel too), and :meth:`peer_lost` then releases what was set up.

        :raises ~kvferry.errors.WireFormatError: the peer's :meth:`hello` bytes are malformed.
        :raises ~kvferry.errors.PeerIncompatible: the peer cannot be reached through the library.
        """
        return

    async def peer_lost(self, peer: ChannelPeer) -> None:
        """Release what is held for ``peer``; called once per peer, shielded, when it is lost or closed (or
        refused after :meth:`peer_connected`). A failure here is logged, never raised to the caller of aclose."""
        return

    # --- memory ------------------------------------------------------------------------------------------

    async def register(self, registration: TensorRegistration) -> bytes:
        """Register memory with the library; returns what peers need for it (sent with the new region table,
        may be empty). A cancel or failure registers nothing.

        :raises ~kvferry.errors.TransportError: the library refuses it.
        """
        return b""

    async def deregister(self, registration: TensorRegistration) -> None:
        """Deregister from the library; shielded by the caller, never raises."""
        return

    async def regions_updated(self, peer: ChannelPeer, blob: bytes) -> None:
        """``peer`` registered memory; ``blob`` is what its data path's :meth:`register` returned.

        :raises ~kvferry.errors.WireFormatError: the blob is malformed (the peer is dropped).
        """
        return

    # --- control frames ----------------------------------------------------------------------------------

    async def frame(self, peer: ChannelPeer, kind: int, body: bytes) -> None:
        """A control frame for the data path (``WRITE_REQUEST``, ``WRITE_ABORT``: two-sided writes), read by the
        peer's reader task; what it starts runs in tasks of its own.

        :raises ~kvferry.errors.WireFormatError: a frame this data path does not expect, or a malformed one (the
            peer is dropped).
        """
        raise WireFormatError(f"{self.transport.name} transport does not expect frame kind {kind}")

    def revoked(self, peer: ChannelPeer) -> None:
        """Grants of ours to ``peer`` ended (``peer.granted`` holds the live ones): a receiver that moves the
        peer's writes itself stops those that now reach outside them."""
        return

    # --- writes ------------------------------------------------------------------------------------------

    @abstractmethod
    async def write(self, peer: ChannelPeer, rows: CheckedRows, notify: bytes | None, stall: float) -> None:
        """Write checked ``rows`` (ours to the peer's) to ``peer``, then deliver ``notify`` after every byte
        landed. Bounded by ``stall`` without progress (``writes.guard``) and by the peer's loss.

        A cancel leaves some, all or none of the bytes written and the notification undelivered.

        :raises ~kvferry.errors.PeerDisconnected: the peer is gone or dies during the write.
        :raises ~kvferry.errors.TransferTimeout: no progress within ``stall``.
        :raises ~kvferry.errors.NotGranted: a two-sided receiver refused a destination outside its grants.
        :raises ~kvferry.errors.PeerIncompatible: this data path reaches no other process.
        """

    def may_write_together(self, peer: ChannelPeer) -> bool:
        """Several writes to ``peer`` may move as one (:meth:`write_together` may still decline)."""
        return False

    async def write_together(self, peer: ChannelPeer, rows: CheckedRows, stall: float) -> bool:
        """Write checked rows (several writes' together, no notification) if this data path can finish them as
        one copy whose end means every byte landed; False, with nothing written, otherwise. A cancel as
        :meth:`write`."""
        return False

    def device_destinations(self, peer: ChannelPeer) -> DeviceDestinations | None:
        """Where ``peer``'s registered regions are mapped in this process for indexed device copies (nixl: CUDA
        IPC), or None: no device path to it."""
        return None

    @asynccontextmanager
    async def waiting(self) -> AsyncIterator[None]:
        """Held while someone waits for a notification (NIXL polls faster then)."""
        yield

    # --- state -------------------------------------------------------------------------------------------

    def handles(self) -> int:
        """Library handles held now (:attr:`~kvferry.transports.TransportStatistics.backend_handles`)."""
        return 0

    def extra_attributes(self) -> dict[Any, Any]:
        """Typed attributes of the library (:class:`~kvferry.transports.TransportAttribute`)."""
        return {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self.transport.name} [{self.handles()} library handles]>"
