"""What transports say to each other on the control channel: frozen attrs classes and one msgpack converter.

A control connection carries frames: an 9-byte header (``kind: u8``, ``length: u64``, big endian) and a body.
User messages travel as raw bytes (``MESSAGE``); every other body is one of the classes below, encoded by
:func:`make_converter`'s converter. The first frame each way is a :class:`Handshake` envelope whose
``wire_version`` and ``compat_hash`` are compared before its ``body`` (a :class:`Hello`) is decoded at all.

Kept small on purpose, so it can merge into the project's converter (pools/pagetable.py) later.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, TypeVar

import attrs
import cattrs
import msgpack
from attrs import field, frozen
from attrs.validators import ge, le, max_len
from cattrs.preconf.msgpack import MsgpackConverter
from cattrs.preconf.msgpack import make_converter as _make_msgpack_converter

from kvferry.errors import WireFormatError

__all__ = [
    "FRAME_HEADER",
    "MAX_GRANT_FRAGMENTS",
    "MAX_LIVE_GRANTS",
    "WIRE_VERSION",
    "FrameKind",
    "Handshake",
    "Hello",
    "Refusal",
    "RegionInfo",
    "RegionsUpdate",
    "WriteAbort",
    "WriteGrant",
    "WriteReply",
    "WriteRequest",
    "WriteRevoke",
    "WriteStatus",
    "decode",
    "encode",
    "make_converter",
]

# Increment whenever a change below cannot be read by the previous version.
# History:
#   1: handshake envelope + hello, regions, messages, notifications, two-sided writes
#   2: a two-sided write may offer its source ranges for the receiver to read (same host): WriteRequest.src,
#      WriteStatus.PULLING and PROGRESS; Hello.pid_proof and pid_proof_address
#   3: grants: a peer writes only into ranges granted to it (GRANT / REVOKE frames, WriteGrant, WriteRevoke)
WIRE_VERSION = 3

#: kind (u8), body length (u64)
FRAME_HEADER = struct.Struct("!BQ")

_U64 = (1 << 64) - 1
_NAME = 256
_BLOB = 64 << 20

T = TypeVar("T")


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


@frozen
class Handshake:
    """The envelope: decoded first, compared, and only then is ``body`` decoded."""

    wire_version: int = field(validator=[ge(0), le(_U64)])
    compat_hash: bytes = field(validator=max_len(_NAME))
    body: bytes = field(validator=max_len(_BLOB))


@frozen
class RegionInfo:
    """A registered range of memory: ``[address, address + length)`` on ``device`` (``"cpu"``, ``"cuda:0"``)."""

    address: int = field(validator=[ge(0), le(_U64)])
    length: int = field(validator=[ge(1), le(_U64)])
    device: str = field(validator=max_len(32))


@frozen
class Hello:
    """Who a transport is, what it has registered, and what its backend needs to reach it."""

    transport: str = field(validator=max_len(32))
    instance_id: str = field(validator=max_len(_NAME))
    address: str = field(validator=max_len(_NAME))
    hostname: str = field(validator=max_len(_NAME))
    pid: int = field(validator=[ge(0), le(_U64)])
    pid_namespace: int = field(validator=[ge(0), le(_U64)])
    max_message_bytes: int = field(validator=[ge(0), le(_U64)])
    #: the tag prefix the receiver wants on two-sided data for it (ucx)
    tag_prefix: int = field(validator=[ge(0), le(_U64)])
    regions: tuple[RegionInfo, ...] = field(validator=max_len(1 << 20))
    #: backend specific: NIXL agent metadata, UCX worker address
    backend: bytes = field(validator=max_len(_BLOB))
    #: random bytes the sender keeps at ``pid_proof_address`` in its memory: a peer on the same host reads them
    #: there (``process_vm_readv`` of ``pid``) before it believes ``pid``, and so before it copies into or out of
    #: that process's memory itself
    pid_proof: bytes = field(default=b"", validator=max_len(64))
    pid_proof_address: int = field(default=0, validator=[ge(0), le(_U64)])


@frozen
class Refusal:
    """Sent instead of a Hello when the handshake is refused."""

    reason: str = field(validator=max_len(4096))


@frozen
class RegionsUpdate:
    """The sender's whole set of registered regions now, plus backend metadata for the new ones."""

    regions: tuple[RegionInfo, ...] = field(validator=max_len(1 << 20))
    backend: bytes = field(validator=max_len(_BLOB))


@frozen
class WriteRequest:
    """Announces a two-sided write: where the data goes, how it is cut into messages, and its notification."""

    write_id: int = field(validator=[ge(0), le(_U64)])
    #: destination fragments: (n, 2) uint64 little-endian, as bytes
    dst: bytes = field(validator=max_len(_BLOB))
    #: fragments at least this long travel as their own message, shorter ones are packed
    zero_copy_bytes: int = field(validator=[ge(1), le(_U64)])
    #: packed messages are at most this long
    pack_bytes: int = field(validator=[ge(1), le(1 << 40)])
    notify: bytes | None = field(validator=attrs.validators.optional(max_len(_BLOB)))
    #: the writer's source fragments, in its own process, as ``dst`` (pairing with it row for row), when the
    #: receiver may read them itself (a peer on the same host, host memory on both sides); None: send them
    src: bytes | None = field(default=None, validator=attrs.validators.optional(max_len(_BLOB)))


class WriteStatus(enum.Enum):
    #: send the data (tagged messages from ``tag`` on)
    READY = "ready"
    #: the receiver reads the offered source itself: wait for DONE, PROGRESS meanwhile
    PULLING = "pulling"
    #: (while PULLING) more of the data has landed
    PROGRESS = "progress"
    DONE = "done"
    REGION = "region"
    FAILED = "failed"
    TIMEOUT = "timeout"


@frozen
class WriteReply:
    write_id: int = field(validator=[ge(0), le(_U64)])
    status: WriteStatus
    detail: str = field(default="", validator=max_len(4096))
    #: READY only: the tag base the receiver posted its receives under (two-sided data)
    tag: int = field(default=0, validator=[ge(0), le(_U64)])


@frozen
class WriteAbort:
    write_id: int = field(validator=[ge(0), le(_U64)])


def make_converter() -> MsgpackConverter:
    """The converter for everything above; strict on receipt (unknown keys are refused)."""
    return _make_msgpack_converter(forbid_extra_keys=True)


def encode(converter: MsgpackConverter, obj: Any) -> bytes:
    return converter.dumps(obj)


def decode(converter: MsgpackConverter, data: bytes, cls: type[T]) -> T:
    """Decode ``data`` as ``cls``.

    :raises ~kvferry.errors.WireFormatError: if it does not decode or does not validate.
    """
    try:
        return converter.loads(data, cls)
    except (
        cattrs.BaseValidationError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
    ) as exc:
        raise WireFormatError(f"malformed {cls.__name__}: {exc}") from exc


# --- grants (wire version 3) ------------------------------------------------------------------------------

#: most fragments one :class:`WriteGrant` carries (a larger grant travels as several)
MAX_GRANT_FRAGMENTS = 1 << 20
#: most grants a peer may hold from one transport at once (one more is a protocol violation: the connection is
#: dropped); :meth:`~kvferry.transports.Transport.grant` refuses to go past it
MAX_LIVE_GRANTS = 1 << 16


@frozen
class WriteGrant:
    """The sender grants the receiver the right to write into ``fragments`` of the sender's memory, until a
    :class:`WriteRevoke` of ``grant_id``. Ids are the sender's, never reused on one connection."""

    grant_id: int = field(validator=[ge(1), le(_U64)])
    #: (n, 2) uint64 little-endian ``(address, length)`` rows, as bytes (at most :data:`MAX_GRANT_FRAGMENTS`)
    fragments: bytes = field(validator=max_len(MAX_GRANT_FRAGMENTS * 16))


@frozen
class WriteRevoke:
    """The grant ``grant_id`` (a live one of the sender's) ends: the receiver writes nothing more into it."""

    grant_id: int = field(validator=[ge(1), le(_U64)])
