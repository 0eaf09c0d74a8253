"""``local``: peers in the same process; a write is a plain copy (numpy on the host, torch on CUDA).

It keeps the control channel, handshake and checks of the other transports, so code written against it runs
unchanged over ``nixl`` or ``ucx``; only the data path differs: there is none, since every write is one the
transport copies itself (:mod:`~kvferry.transports.writes`).
"""

from __future__ import annotations

from typing import Any

from kvferry.errors import PeerIncompatible
from kvferry.transports.base import Capabilities
from kvferry.transports.channel import ChannelTransport
from kvferry.transports.datapath import DataPath
from kvferry.transports.peers import ChannelPeer
from kvferry.transports.writes import CheckedRows

__all__ = ["LocalTransport", "SameProcessOnly", "transport_class"]


class SameProcessOnly(DataPath):
    """No library: peers of other processes are refused at the handshake."""

    def admit(self, peer: ChannelPeer) -> None:
        if not peer.same_process:
            raise PeerIncompatible(
                f"the local transport reaches only its own process; {peer.address} is pid {peer.hello.pid} "
                "(use 'nixl', 'ucx' or 'auto')"
            )

    async def write(self, peer: ChannelPeer, rows: CheckedRows, notify: bytes | None, stall: float) -> None:
        raise PeerIncompatible(f"{self.transport.name} transport cannot write to another process")


class LocalTransport(ChannelTransport[SameProcessOnly]):
    """Writes between transports of one process, as device copies. Accepts the :class:`ChannelTransport` options."""

    name = "local"
    capabilities = Capabilities(
        one_sided_write=True, device_memory=True, cross_process=False, cross_host=False
    )

    def __init__(self, **options: Any) -> None:
        super().__init__(SameProcessOnly, **options)


transport_class = LocalTransport
