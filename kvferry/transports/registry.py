"""Transports by name, imported only when asked for: importing kvferry never imports nixl or ucxx."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvferry.errors import MissingExtraError
from kvferry.transports.base import Transport

__all__ = ["TRANSPORT_NAMES", "TransportFactory", "available_transports", "get_transport"]

#: name -> (module, the optional library it needs, the extra that installs it)
_MODULES: dict[str, tuple[str, str | None, str | None]] = {
    "nixl": ("kvferry.transports.nixl", "nixl_cu13", "nixl"),
    "ucx": ("kvferry.transports.ucx", "ucxx", "ucx"),
    "local": ("kvferry.transports.local", None, None),
}
TRANSPORT_NAMES = ("nixl", "ucx", "local", "auto")

TransportFactory = Callable[..., Transport]


def get_transport(name: str) -> TransportFactory:
    """The transport class called ``name`` (``"nixl"``, ``"ucx"``, ``"local"``), or ``"auto"``.

    ``"auto"`` returns a factory that builds the first cross-process transport installed (nixl, then ucx),
    else ``local``. Every transport copies plainly to peers in its own process (``same_process="copy"``), so
    ``auto`` uses the library only for peers in other processes.

    :raises ~kvferry.errors.MissingExtraError: if the library the transport needs is not installed; the
        message names the extra to install.
    :raises LookupError: for an unknown name.
    """
    if name == "auto":
        return _auto
    try:
        module_name, library, extra = _MODULES[name]
    except KeyError:
        raise LookupError(
            f"no transport called {name!r}; choose one of {', '.join(TRANSPORT_NAMES)}"
        ) from None
    if library is not None:
        try:
            importlib.import_module(library)
        except ImportError as exc:
            assert extra is not None
            raise MissingExtraError(library, extra) from exc
    module = importlib.import_module(module_name)
    cls: type[Transport] = module.transport_class
    return cls


def available_transports() -> dict[str, str | None]:
    """name -> None if it loads, else why not (the MissingExtraError message)."""
    result: dict[str, str | None] = {}
    for name in _MODULES:
        try:
            get_transport(name)
            result[name] = None
        except MissingExtraError as exc:
            result[name] = str(exc)
    return result


def _auto(**options: Any) -> Transport:
    for name in ("nixl", "ucx"):
        try:
            return get_transport(name)(**options)
        except MissingExtraError:
            continue
    return get_transport("local")(**options)
