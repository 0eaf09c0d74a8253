"""One connected peer as the disaggregation protocol uses it: the handshake, and the reader that routes
what the peer sends (control messages, write notifications) to whoever handles them."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio

from kvferry import wire
from kvferry.disagg.protocol import (
    ControlBody,
    PeerInfo,
    decode_control,
    decode_hello,
    encode_hello,
    reports_of,
)
from kvferry.disagg.session import Receiver
from kvferry.errors import (
    ClosedResourceError,
    PeerDisconnected,
    PeerTimeout,
    TransportError,
    WireFormatError,
)
from kvferry.transports import Peer, Transport

__all__ = ["exchange_hello", "pump"]

log = logging.getLogger("kvferry.disagg")

MessageHandler = Callable[[ControlBody], Awaitable[None]]


async def exchange_hello(
    transport: Transport, peer: Peer, local: PeerInfo, *, within: float = 10.0
) -> PeerInfo:
    """Send our :class:`~.protocol.PeerInfo` and decode the peer's (wire version and hash compared first).

    Both sides call this right after connecting; neither waits for the other before sending. The whole
    exchange (our send included) takes at most ``within`` seconds.

    :raises ~kvferry.errors.PeerIncompatible: another wire version or model (only this peer is affected:
        the caller closes it).
    :raises ~kvferry.errors.WireFormatError: the peer's handshake is malformed.
    :raises ~kvferry.errors.PeerTimeout: the exchange did not end within ``within`` seconds (a
        :class:`~kvferry.errors.PeerDisconnected`: the peer is treated as gone).
    :raises ~kvferry.errors.PeerDisconnected: the peer went away.
    """
    data = b""
    with anyio.move_on_after(within) as scope:
        await transport.send_message(peer, encode_hello(local))
        data = await transport.receive_message(peer)
    if scope.cancelled_caught:
        raise PeerTimeout(f"no handshake with the peer within {within} s")
    return decode_hello(data, wire_version=wire.WIRE_VERSION, compat_hash=local.compat_hash, local=local)


async def pump(
    transport: Transport,
    peer: Peer,
    receiver: Receiver | None = None,
    *,
    on_message: MessageHandler | None = None,
) -> str:
    """Read everything the peer sends until it is gone; return why it is gone.

    Write notifications and :class:`~.protocol.ChunkResult` messages go to ``receiver``; every other control
    message to ``on_message`` (awaited in order). A malformed message is logged and dropped (it costs the
    peer that message only). When the peer is gone, ``receiver.peer_lost`` settles its sessions. A cancel
    leaves the receiver's sessions as they are (quarantines stay).
    """
    reason = "peer closed"

    async def notifications() -> None:
        nonlocal reason
        try:
            while True:
                data = await transport.receive_notification(peer)
                try:
                    report = decode_control(data)
                except WireFormatError as exc:
                    log.warning("malformed notification dropped: %s", exc)
                    continue
                if receiver is not None:
                    for result in reports_of(report):
                        receiver.on_result(result)
        except (PeerDisconnected, ClosedResourceError, TransportError) as exc:
            reason = str(exc)

    async def messages() -> None:
        nonlocal reason
        try:
            while True:
                data = await transport.receive_message(peer)
                try:
                    message = decode_control(data)
                except WireFormatError as exc:
                    log.warning("malformed control message dropped: %s", exc)
                    continue
                reports = reports_of(message)
                if reports:
                    if receiver is not None:
                        for result in reports:
                            receiver.on_result(result)
                elif on_message is not None:
                    await on_message(message)
        except (PeerDisconnected, ClosedResourceError, TransportError) as exc:
            reason = str(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(notifications)
        tg.start_soon(messages)
    # Both readers ended because the transport says the peer is gone (not on our cancel: then the peer may
    # still be writing, and quarantined pages must stay quarantined).
    if receiver is not None:
        receiver.peer_lost(reason)
    return reason
