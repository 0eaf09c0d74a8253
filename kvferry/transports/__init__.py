"""Moving bytes between processes and hosts: one interface, loaded by name (``get_transport("nixl")``).

Importing this package imports neither nixl nor ucxx; :func:`get_transport` imports a library when its
transport is asked for.
"""

from __future__ import annotations

from kvferry.transports.base import DEFAULT_MAX_MESSAGE_BYTES as DEFAULT_MAX_MESSAGE_BYTES
from kvferry.transports.base import Capabilities as Capabilities
from kvferry.transports.base import Fragments as Fragments
from kvferry.transports.base import Peer as Peer
from kvferry.transports.base import PeerAttribute as PeerAttribute
from kvferry.transports.base import PeerState as PeerState
from kvferry.transports.base import Registration as Registration
from kvferry.transports.base import Transport as Transport
from kvferry.transports.base import TransportAttribute as TransportAttribute
from kvferry.transports.base import TransportStatistics as TransportStatistics
from kvferry.transports.base import as_fragments as as_fragments
from kvferry.transports.base import coalesce as coalesce
from kvferry.transports.base import page_fragments as page_fragments
from kvferry.transports.base import tensor_fragments as tensor_fragments
from kvferry.transports.base import total_bytes as total_bytes
from kvferry.transports.registry import TRANSPORT_NAMES as TRANSPORT_NAMES
from kvferry.transports.registry import available_transports as available_transports
from kvferry.transports.registry import get_transport as get_transport

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "TRANSPORT_NAMES",
    "Capabilities",
    "Fragments",
    "Peer",
    "PeerAttribute",
    "PeerState",
    "Registration",
    "Transport",
    "TransportAttribute",
    "TransportStatistics",
    "as_fragments",
    "available_transports",
    "coalesce",
    "get_transport",
    "page_fragments",
    "tensor_fragments",
    "total_bytes",
]
