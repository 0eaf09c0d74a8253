"""Moving bytes between processes and hosts: one interface, loaded by name (``get_transport("nixl")``).

Importing this package imports neither nixl nor ucxx; :func:`get_transport` imports a library when its
transport is asked for. Writing a backend: a :class:`~kvferry.transports.channel.ChannelTransport` with a
:class:`~kvferry.transports.datapath.DataPath` of its own (both re-exported here, imported on first use).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvferry.transports.base import *  # noqa: F403
from kvferry.transports.base import __all__ as _base_all
from kvferry.transports.handshake import TlsConfig as TlsConfig
from kvferry.transports.handshake import load_secret as load_secret
from kvferry.transports.handshake import new_secret as new_secret
from kvferry.transports.limits import ChannelLimits as ChannelLimits
from kvferry.transports.registry import TRANSPORT_NAMES as TRANSPORT_NAMES
from kvferry.transports.registry import available_transports as available_transports
from kvferry.transports.registry import get_transport as get_transport

if TYPE_CHECKING:
    from kvferry.transports.channel import ChannelTransport as ChannelTransport
    from kvferry.transports.channel import TransportState as TransportState
    from kvferry.transports.datapath import DataPath as DataPath
    from kvferry.transports.peers import ChannelPeer as ChannelPeer
    from kvferry.transports.writes import CheckedRows as CheckedRows

#: public name -> module that defines it (the backend interface: imported on first use)
_LAZY: dict[str, str] = {
    "ChannelTransport": "kvferry.transports.channel",
    "TransportState": "kvferry.transports.channel",
    "DataPath": "kvferry.transports.datapath",
    "ChannelPeer": "kvferry.transports.peers",
    "CheckedRows": "kvferry.transports.writes",
}

__all__ = [
    *_base_all,
    "TRANSPORT_NAMES",
    "ChannelLimits",
    "TlsConfig",
    "available_transports",
    "get_transport",
    "load_secret",
    "new_secret",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvferry.transports' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
