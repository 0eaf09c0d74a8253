"""What a transport lets its peers cost it: the caps, and the budget of bytes held for the application.

A peer's messages and notifications are read off its connection as they come and held until the application
takes them (``receive_message``, ``receive_notification``). :class:`BufferBudget` bounds what is held, per peer
and in total: a peer's reader that would go over waits, which stops reading that connection, so the peer's
sends block once its TCP window fills (backpressure) while every other peer goes on. Nothing is dropped.
"""

from __future__ import annotations

from typing import Protocol

import anyio
from attrs import field, frozen
from attrs.validators import ge

from kvferry.errors import ConfigError

__all__ = ["BufferBudget", "ChannelLimits", "Holder"]


@frozen
class ChannelLimits:
    """Caps on what peers may cost a transport; each has a default, each can be set.

    Deadlines are the transport's own options (``connect_timeout`` bounds a handshake either way).
    """

    #: handshakes in progress at once; further connections are closed at once, before a byte is read
    max_pending_handshakes: int = field(default=64, validator=ge(1))
    #: peers handshaken and not yet taken by ``accept()``; further connections are refused
    max_unaccepted_peers: int = field(default=64, validator=ge(1))
    #: the largest handshake frame (a hello: region table, backend metadata) and any other control frame
    max_handshake_bytes: int = field(default=16 << 20, validator=ge(1 << 16))
    #: bytes of messages and notifications held for the application, per peer ...
    max_peer_buffered_bytes: int = field(default=64 << 20, validator=ge(1 << 16))
    #: ... and over every peer together
    max_buffered_bytes: int = field(default=256 << 20, validator=ge(1 << 16))
    #: messages held per peer (each also counts its bytes)
    max_queued_messages: int = field(default=1024, validator=ge(1))
    #: notifications held per peer
    max_queued_notifications: int = field(default=65536, validator=ge(1))

    def __attrs_post_init__(self) -> None:
        if self.max_peer_buffered_bytes > self.max_buffered_bytes:
            raise ConfigError(
                f"max_peer_buffered_bytes ({self.max_peer_buffered_bytes}) exceeds max_buffered_bytes "
                f"({self.max_buffered_bytes})"
            )


class Holder(Protocol):
    """Whoever bytes are held for (a peer): its count of held bytes."""

    held_bytes: int


class BufferBudget:
    """Bytes held for the application, per holder and in total (see the module docstring).

    One item larger than a holder's share is still taken when that holder holds nothing, so a message the
    transport accepts (``max_message_bytes``) can always get through; the total is only exceeded by one item
    taken when nothing at all is held.
    """

    __slots__ = ("_changed", "held", "per_holder", "total")

    def __init__(self, *, per_holder: int, total: int) -> None:
        self.per_holder = per_holder
        self.total = total
        self.held = 0
        self._changed = anyio.Event()

    def _fits(self, holder: Holder, nbytes: int) -> bool:
        if holder.held_bytes == 0:  # one item always fits a holder that holds nothing, within the total
            return self.held == 0 or self.held + nbytes <= self.total
        return holder.held_bytes + nbytes <= self.per_holder and self.held + nbytes <= self.total

    def try_take(self, holder: Holder, nbytes: int) -> bool:
        """Take ``nbytes`` for ``holder`` if they fit now."""
        if not self._fits(holder, nbytes):
            return False
        holder.held_bytes += nbytes
        self.held += nbytes
        return True

    async def take(self, holder: Holder, nbytes: int) -> None:
        """Take ``nbytes`` for ``holder``, waiting until they fit. A cancel takes nothing."""
        while not self.try_take(holder, nbytes):
            changed = self._changed
            await changed.wait()

    def give(self, holder: Holder, nbytes: int) -> None:
        """Give back ``nbytes`` of ``holder``'s (the application took them, or the holder is gone)."""
        nbytes = min(nbytes, holder.held_bytes)
        holder.held_bytes -= nbytes
        self.held -= nbytes
        self._changed.set()
        self._changed = anyio.Event()

    def give_all(self, holder: Holder) -> None:
        """Give back everything ``holder`` holds (it is gone; what it left is no longer counted)."""
        self.give(holder, holder.held_bytes)

    def __repr__(self) -> str:
        return f"<BufferBudget {self.held} of {self.total} bytes held (at most {self.per_holder} per peer)>"
