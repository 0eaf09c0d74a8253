"""What transports say to each other on the control channel: the frames and the messages they carry.

A control connection carries frames: a 9-byte header (:data:`FRAME_HEADER`: ``kind: u8``, ``length: u64``, big
endian) and a body. User messages travel as raw bytes (``MESSAGE``), notifications too (``NOTIFY``); every
other body is one of the classes below, encoded by :mod:`kvferry.wire` (the peer protocol's version is
:data:`~kvferry.wire.TRANSPORT_PROTOCOL_VERSION`).

The handshake is six ``HANDSHAKE`` frames (see :mod:`kvferry.transports.handshake`): the connector's
:class:`Greeting`, the acceptor's :class:`Challenge`, the connector's :class:`Credentials` and :class:`Hello`, the
acceptor's :class:`Welcome` and :class:`Hello`. All but the hellos are a few dozen bytes, and say nothing about
either side but its protocol version, a nonce, a proof and a compatibility hash; a :class:`Hello` (with
registration metadata) is only sent once the other side has proven it holds the shared secret, and only read
once its sender has. Either side may answer any step with a :class:`Refusal` instead.

After the handshake: ``REGIONS`` (:class:`RegionsUpdate`) whenever the sender's registrations change; ``GRANT``
and ``REVOKE`` (:class:`WriteGrant`, :class:`WriteRevoke`) for what the receiver may write into the sender's
memory; ``WRITE_REQUEST``, ``WRITE_REPLY`` and ``WRITE_ABORT`` for two-sided writes (``ucx``); ``GOODBYE``
before a peer closes the connection on purpose.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import attrs
import numpy as np
from attrs import field, frozen
from attrs.validators import ge, le, max_len, min_len

from kvferry.errors import WireFormatError
from kvferry.transports.base import Fragments, as_fragments
from kvferry.wire import MAX_ARRAY_ITEMS, U64, UINT64_MAX, Capped

__all__ = [
    "FRAME_HEADER",
    "MAX_GRANT_FRAGMENTS",
    "MAX_LIVE_GRANTS",
    "NONCE_BYTES",
    "Challenge",
    "Credentials",
    "Frame",
    "FrameKind",
    "Greeting",
    "Hello",
    "Refusal",
    "RegionInfo",
    "RegionsUpdate",
    "Welcome",
    "WriteAbort",
    "WriteGrant",
    "WriteReply",
    "WriteRequest",
    "WriteRevoke",
    "WriteStatus",
    "fragments_bytes",
    "fragments_from_bytes",
]

#: bytes of each side's handshake nonce
NONCE_BYTES = 32

#: kind (u8), body length (u64)
FRAME_HEADER = struct.Struct("!BQ")

#: most fragments one :class:`WriteGrant` carries (a larger grant travels as several)
MAX_GRANT_FRAGMENTS = 1 << 20
#: most grants a peer may hold from one transport at once (one more is a protocol violation: the connection is
#: dropped); :meth:`~kvferry.transports.Transport.grant` refuses to go past it
MAX_LIVE_GRANTS = 1 << 16

_NAME = 256
_BLOB = 64 << 20
_MAC = 64
_IN_U64 = [ge(0), le(UINT64_MAX)]


class FrameKind(enum.IntEnum):
    HANDSHAKE = 1
    REFUSAL = 2
    MESSAGE = 3
    REGIONS = 4
    WRITE_REQUEST = 5
    WRITE_REPLY = 6
    WRITE_ABORT = 7
    NOTIFY = 8
    GOODBYE = 9
    #: a :class:`WriteGrant`: ranges of the sender's memory the receiver may now write into
    GRANT = 10
    #: a :class:`WriteRevoke`: a grant ends
    REVOKE = 11


#: one frame to send: its kind and body
Frame = tuple[FrameKind, bytes]


# --- handshake ------------------------------------------------------------------------------------------


@frozen
class Greeting:
    """The connector's first frame: its protocol version and nonce, and whether it will authenticate."""

    wire_version: U64 = field(validator=_IN_U64)
    nonce: bytes = field(validator=[min_len(NONCE_BYTES), max_len(NONCE_BYTES)])
    #: the connector holds a shared secret and expects the acceptor to prove it holds it too
    authenticated: bool


@frozen
class Challenge:
    """The acceptor's answer: its nonce and, with a secret, its proof over both nonces."""

    wire_version: U64 = field(validator=_IN_U64)
    nonce: bytes = field(validator=[min_len(NONCE_BYTES), max_len(NONCE_BYTES)])
    #: HMAC of the handshake transcript under the shared secret; empty without a secret
    proof: bytes = field(validator=max_len(_MAC))


@frozen
class Credentials:
    """The connector's proof and compatibility hash. Its hello follows in a frame of its own, which the acceptor
    reads only once these hold (an unauthenticated peer can make it read no more than this small frame)."""

    proof: bytes = field(validator=max_len(_MAC))
    compat_hash: bytes = field(validator=max_len(_NAME))


@frozen
class Welcome:
    """The acceptor's compatibility hash; its hello follows in a frame of its own."""

    compat_hash: bytes = field(validator=max_len(_NAME))


@frozen
class Refusal:
    """Sent instead of the next step when the handshake is refused."""

    reason: str = field(validator=max_len(4096))


def _in_address_space(instance: RegionInfo, _attribute: Any, length: int) -> None:
    if instance.address + length > 1 << 64:
        raise ValueError(f"region [{instance.address:#x}, +{length:#x}) ends past the address space (2**64)")


@frozen
class RegionInfo:
    """A registered range of memory: ``[address, address + length)`` on ``device`` (``"cpu"``, ``"cuda:0"``),
    inside the address space (``address + length <= 2**64``)."""

    address: U64 = field(validator=_IN_U64)
    length: U64 = field(validator=[ge(1), le(UINT64_MAX), _in_address_space])
    device: str = field(validator=max_len(32))


@frozen
class Hello:
    """Who a transport is, what it has registered, and what its backend needs to reach it."""

    transport: str = field(validator=max_len(32))
    instance_id: str = field(validator=max_len(_NAME))
    address: str = field(validator=max_len(_NAME))
    hostname: str = field(validator=max_len(_NAME))
    pid: U64 = field(validator=_IN_U64)
    pid_namespace: U64 = field(validator=_IN_U64)
    max_message_bytes: U64 = field(validator=_IN_U64)
    #: the tag prefix the receiver wants on two-sided data for it (ucx)
    tag_prefix: U64 = field(validator=_IN_U64)
    regions: Capped[RegionInfo] = field(validator=max_len(MAX_ARRAY_ITEMS))
    #: backend specific: NIXL agent metadata and CUDA IPC exports, UCX worker address
    backend: bytes = field(validator=max_len(_BLOB))
    #: where the sender keeps, for this connection only, the proof of its pid that the handshake derives (see
    #: :mod:`kvferry.transports.handshake`): a peer on the same host reads it there (``process_vm_readv`` of
    #: ``pid``) before it believes ``pid``, and so before it copies into or out of that process's memory itself;
    #: 0 where the sender offers no proof
    pid_proof_address: U64 = field(default=0, validator=_IN_U64)


# --- after the handshake --------------------------------------------------------------------------------


@frozen
class RegionsUpdate:
    """The sender's whole set of registered regions now, plus backend metadata for the new ones."""

    regions: Capped[RegionInfo] = field(validator=max_len(MAX_ARRAY_ITEMS))
    backend: bytes = field(validator=max_len(_BLOB))


@frozen
class WriteGrant:
    """The sender grants the receiver the right to write into ``fragments`` of the sender's memory, until a
    :class:`WriteRevoke` of ``grant_id``. Ids are the sender's, never reused on one connection."""

    grant_id: U64 = field(validator=[ge(1), le(UINT64_MAX)])
    #: (n, 2) uint64 little-endian ``(address, length)`` rows, as bytes (at most :data:`MAX_GRANT_FRAGMENTS`)
    fragments: bytes = field(validator=max_len(MAX_GRANT_FRAGMENTS * 16))


@frozen
class WriteRevoke:
    """The grant ``grant_id`` (a live one of the sender's) ends: the receiver writes nothing more into it."""

    grant_id: U64 = field(validator=[ge(1), le(UINT64_MAX)])


@frozen
class WriteRequest:
    """Announces a two-sided write: where the data goes, how it is cut into messages, and its notification."""

    write_id: U64 = field(validator=_IN_U64)
    #: destination fragments: (n, 2) uint64 little-endian, as bytes
    dst: bytes = field(validator=max_len(_BLOB))
    #: fragments at least this long travel as their own message, shorter ones are packed
    zero_copy_bytes: U64 = field(validator=[ge(1), le(UINT64_MAX)])
    #: packed messages are at most this long
    pack_bytes: U64 = field(validator=[ge(1), le(1 << 40)])
    notify: bytes | None = field(validator=attrs.validators.optional(max_len(_BLOB)))
    #: the writer's source fragments, in its own process, as ``dst`` (pairing with it row for row), when the
    #: receiver may read them itself (a peer on the same host, host memory on both sides); None: send them
    src: bytes | None = field(default=None, validator=attrs.validators.optional(max_len(_BLOB)))


class WriteStatus(enum.Enum):
    #: send the data (tagged messages from ``tag`` on)
    READY = "ready"
    #: the receiver reads the offered source itself: wait for DONE, PROGRESS meanwhile (a short read may be
    #: answered DONE at once, without PULLING)
    PULLING = "pulling"
    #: (while PULLING) more of the data has landed
    PROGRESS = "progress"
    DONE = "done"
    REGION = "region"
    FAILED = "failed"
    TIMEOUT = "timeout"


@frozen
class WriteReply:
    """The receiver's answer to a :class:`WriteRequest` (several while it pulls)."""

    write_id: U64 = field(validator=_IN_U64)
    status: WriteStatus
    detail: str = field(default="", validator=max_len(4096))
    #: READY only: the tag base the receiver posted its receives under (two-sided data)
    tag: U64 = field(default=0, validator=_IN_U64)


@frozen
class WriteAbort:
    """The writer leaves write ``write_id`` early: the receiver stops receiving it."""

    write_id: U64 = field(validator=_IN_U64)


# --- fragments in messages ------------------------------------------------------------------------------


def fragments_bytes(fragments: Fragments) -> bytes:
    """Fragments as they travel in a message (:attr:`WriteGrant.fragments`, :attr:`WriteRequest.dst`): ``(n, 2)``
    little-endian u64 ``(address, length)`` rows."""
    return np.ascontiguousarray(fragments, dtype="<u8").tobytes()


def fragments_from_bytes(data: bytes) -> Fragments:
    """Fragments from a peer's message, checked as :func:`~kvferry.transports.base.as_fragments` checks them.

    :raises ~kvferry.errors.WireFormatError: not whole rows, a zero-length row, or a row that wraps around.
    """
    if len(data) % 16:
        raise WireFormatError("fragment bytes are not a whole number of (address, length) rows")
    rows = np.frombuffer(data, dtype="<u8").reshape(-1, 2).astype(np.uint64)
    try:
        return as_fragments(rows)
    except ValueError as exc:
        raise WireFormatError(f"malformed fragments: {exc}") from exc
