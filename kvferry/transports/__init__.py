"""Moving bytes between processes and hosts: one interface, loaded by name (``get_transport("nixl")``).

Importing this package imports neither nixl nor ucxx; :func:`get_transport` imports a library when its
transport is asked for.
"""

from __future__ import annotations

from kvferry.transports.base import *  # noqa: F403
from kvferry.transports.base import __all__ as _base_all
from kvferry.transports.handshake import TlsConfig as TlsConfig
from kvferry.transports.handshake import load_secret as load_secret
from kvferry.transports.handshake import new_secret as new_secret
from kvferry.transports.limits import ChannelLimits as ChannelLimits
from kvferry.transports.registry import TRANSPORT_NAMES as TRANSPORT_NAMES
from kvferry.transports.registry import available_transports as available_transports
from kvferry.transports.registry import get_transport as get_transport

__all__ = [
    *_base_all,
    "TRANSPORT_NAMES",
    "ChannelLimits",
    "TlsConfig",
    "available_transports",
    "get_transport",
    "load_secret",
    "new_secret",
]
