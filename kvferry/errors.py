"""The one exception tree of kvferry.

Every error kvferry raises on purpose derives from :class:`KvferryError`, branched by cause. Errors from
NIXL, UCX, msgpack and cattrs are translated into these at the boundary where they occur, so callers never
have to import an optional library to catch a failure.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationFailed",
    "CacheMoving",
    "ClosedResourceError",
    "ConfigError",
    "EngineClosed",
    "InvalidTransition",
    "KvferryError",
    "MessageTooLarge",
    "MissingExtraError",
    "NotGranted",
    "PeerDisconnected",
    "PeerIncompatible",
    "PeerTimeout",
    "PoolExhausted",
    "PrefillTimeout",
    "RebalanceRefused",
    "RegionError",
    "RequestAborted",
    "RequestTooLarge",
    "ServiceOverloaded",
    "StaleGeneration",
    "TransferCancelled",
    "TransferError",
    "TransferInDoubt",
    "TransferTimeout",
    "TransportError",
    "UnknownRequest",
    "WireFormatError",
]


class KvferryError(Exception):
    """Root of every error kvferry raises on purpose."""


class ConfigError(KvferryError, ValueError):
    """A model spec, pool size or option that cannot work (raised before anything is allocated)."""


class MissingExtraError(KvferryError, ImportError):
    """An optional library is not installed; the message names the extra that brings it."""

    def __init__(self, library: str, extra: str) -> None:
        super().__init__(f"{library} is not installed: pip install 'kvferry[{extra}]'")
        self.library = library
        self.extra = extra


# --- pools ---------------------------------------------------------------------------------------------


class PoolExhausted(KvferryError):
    """An operation needs more pages or slots than are free; nothing was changed."""


class UnknownRequest(KvferryError, KeyError):
    """A request id the manager does not hold (never created, or already closed)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message
        return str(self.args[0]) if self.args else ""


class InvalidTransition(KvferryError):
    """A lifecycle or request-state transition that is not allowed from the current state."""


class CacheMoving(InvalidTransition):
    """The request's cache is being copied to the host or back (a two-phase offload or restore was started and
    not finished): finish the move first. Nothing was changed."""


class StaleGeneration(KvferryError):
    """A handle refers to a page, slot or session that has since been freed and reused."""


class RebalanceRefused(KvferryError):
    """A pool rebalance was refused: caches are live, a transfer touches the pools, or buffers cannot grow."""


# --- wire ----------------------------------------------------------------------------------------------


class WireFormatError(KvferryError, ValueError):
    """Bytes from a peer that do not decode to a valid, self-consistent message."""


class PeerIncompatible(KvferryError):
    """A peer speaks another wire version or serves an incompatible model (compatibility hash differs)."""


class AuthenticationFailed(PeerIncompatible):
    """The handshake's challenge-response failed: the peer does not hold our shared secret, holds none while we
    do, or asks for one we lack. Refused before any registration metadata was exchanged."""


# --- transports ----------------------------------------------------------------------------------------


class TransportError(KvferryError):
    """A transport failed; the message says which library call and why."""


class ClosedResourceError(TransportError):
    """The transport (or a peer handle) was used after aclose()."""


class PeerDisconnected(TransportError):
    """The peer went away (process died, connection reset) or nobody listens at its address."""


class PeerTimeout(PeerDisconnected, TimeoutError):
    """A peer did not answer within its deadline (handshake, start-up): it is treated as gone."""


class RegionError(TransportError):
    """A source or destination range lies outside the memory registered for it; nothing was written."""


class NotGranted(RegionError):
    """A destination range lies outside every range the peer granted to the writer
    (:meth:`~kvferry.transports.Transport.grant`); nothing of the write was written."""


class MessageTooLarge(TransportError):
    """A control message exceeds the size limit; it was refused before it was read in full."""


class TransferError(KvferryError):
    """A KV transfer failed."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer made no progress within its stall deadline."""


class PrefillTimeout(TransferTimeout):
    """The context peer did not answer a prefill within its deadline; it was told to drop the request."""


class TransferCancelled(TransferError):
    """A transfer was cancelled by one side before it completed."""


class TransferInDoubt(TransferError):
    """A peer stopped reporting while writes may still be in flight: the destination pages stay quarantined."""


# --- engine --------------------------------------------------------------------------------------------


class EngineClosed(KvferryError):
    """The engine is not running (used outside its ``async with`` block, or entered twice)."""


class RequestAborted(KvferryError):
    """A request ended before it finished: the engine closed, or a model step failed; its cache was freed."""


# --- serving -------------------------------------------------------------------------------------------


class RequestTooLarge(ConfigError):
    """A request that can never fit the engines' pools, refused at submission: the message names its sizes and
    the option that would make it fit."""


class ServiceOverloaded(KvferryError):
    """The service's queue of requests not yet admitted is full: retry later (HTTP 503)."""
