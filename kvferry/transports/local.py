"""``local``: peers in the same process; a write is a plain copy (numpy on the host, torch on CUDA).

It keeps the control channel, handshake and checks of the other transports, so code written against it runs
unchanged over ``nixl`` or ``ucx``; only the data path differs.
"""

from __future__ import annotations

from kvferry.errors import PeerIncompatible
from kvferry.transports._channel import ChannelPeer, ChannelTransport
from kvferry.transports.base import Capabilities

__all__ = ["LocalTransport", "transport_class"]


class LocalTransport(ChannelTransport):
    """Writes between transports of one process, as device copies. Accepts the :class:`ChannelTransport` options."""

    name = "local"
    capabilities = Capabilities(
        one_sided_write=True, device_memory=True, cross_process=False, cross_host=False
    )

    def _check_peer_allowed(self, peer: ChannelPeer) -> None:
        if not peer.same_process:
            raise PeerIncompatible(
                f"the local transport reaches only its own process; {peer.address} is pid {peer.hello.pid} "
                "(use 'nixl', 'ucx' or 'auto')"
            )


transport_class = LocalTransport
