"""Frames on a control connection: the header, a reader that hands out exact byte counts, and socket tuning.

A frame is :data:`~kvferry.transports.FRAME_HEADER` (kind, body length) followed by the body. Every read
takes a limit: a header announcing more than the caller allows is refused before a byte of its body is read.
"""

from __future__ import annotations

import socket
from contextlib import suppress

import anyio
from anyio.abc import ByteStream, SocketAttribute

from kvferry.errors import WireFormatError
from kvferry.transports.messages import FRAME_HEADER, FrameKind

__all__ = ["FrameReader", "close_quietly", "discard", "frame", "read_frame", "tune"]

#: bytes asked of the socket per read: whatever arrived together (a header, its body, the next frames) is taken
#: in one turn of the event loop
READ_CHUNK = 1 << 16
_DISCARD_CHUNK = 1 << 20


def frame(kind: FrameKind, body: bytes) -> bytes:
    return FRAME_HEADER.pack(kind, len(body)) + body


class FrameReader:
    """The bytes of one connection, read in chunks and handed out exactly.

    :raises anyio.EndOfStream: (from :meth:`receive_exactly`) the connection ended, also in the middle of a frame.
    """

    __slots__ = ("_buffer", "_stream")

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def receive_exactly(self, nbytes: int) -> bytes:
        while len(self._buffer) < nbytes:
            self._buffer += await self._stream.receive(max(READ_CHUNK, nbytes - len(self._buffer)))
        data = bytes(self._buffer[:nbytes])
        del self._buffer[:nbytes]
        return data

    @property
    def buffered(self) -> int:
        """Bytes read from the socket and not handed out yet."""
        return len(self._buffer)


async def read_frame(reader: FrameReader, limit: int) -> tuple[int, bytes]:
    """The next frame's kind and body.

    :raises ~kvferry.errors.WireFormatError: its header announces more than ``limit`` bytes (nothing more is read).
    """
    kind, length = FRAME_HEADER.unpack(await reader.receive_exactly(FRAME_HEADER.size))
    if length > limit:
        raise WireFormatError(f"frame of {length} bytes exceeds {limit}")
    return kind, (await reader.receive_exactly(length) if length else b"")


async def discard(reader: FrameReader, length: int) -> None:
    """Skip ``length`` bytes without holding more than one chunk."""
    while length:
        n = min(length, _DISCARD_CHUNK)
        await reader.receive_exactly(n)
        length -= n


def tune(stream: ByteStream) -> None:
    """Notice a silently vanished host within ~10 s (a killed process is noticed at once: its socket closes)."""
    raw = stream.extra(SocketAttribute.raw_socket, None)
    if raw is None:
        return
    with suppress(OSError, AttributeError):
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 5)


async def close_quietly(stream: ByteStream) -> None:
    with anyio.CancelScope(shield=True), suppress(Exception):
        await stream.aclose()
