"""What transports say to each other on the control channel: frozen attrs classes and one msgpack converter.

A control connection carries frames: a 9-byte header (``kind: u8``, ``length: u64``, big endian) and a body.
User messages travel as raw bytes (``MESSAGE``); every other body is one of the classes below, encoded by
:func:`make_converter`'s converter.

The handshake is six ``HANDSHAKE`` frames (see :mod:`kvferry.transports.handshake`): the connector's
:class:`Greeting`, the acceptor's :class:`Challenge`, the connector's :class:`Credentials` and :class:`Hello`, the
acceptor's :class:`Welcome` and :class:`Hello`. All but the hellos are a few dozen bytes, and say nothing about
either side but its wire version, a nonce, a proof and a compatibility hash; a :class:`Hello` (with registration
metadata) is only sent once the other side has proven it holds the shared secret, and only read once its sender
has. Either side may answer any step with a :class:`Refusal` instead.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, TypeVar, get_args, get_origin

import attrs
import cattrs
from attrs import field, frozen
from attrs.validators import ge, le, max_len, min_len
from cattrs.preconf.msgpack import MsgpackConverter
from cattrs.preconf.msgpack import make_converter as _make_msgpack_converter
from cattrs.v import format_exception

from kvferry.errors import WireFormatError

__all__ = [
    "FRAME_HEADER",
    "MAX_GRANT_FRAGMENTS",
    "MAX_LIVE_GRANTS",
    "WIRE_VERSION",
    "Challenge",
    "Credentials",
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
    "decode",
    "encode",
    "make_converter",
]

# Increment whenever a change below cannot be read by the previous version.
# History:
#   1: handshake envelope + hello, regions, messages, notifications, two-sided writes
#   2: a two-sided write may offer its source ranges for the receiver to read (same host): WriteRequest.src,
#      WriteStatus.PULLING and PROGRESS; Hello.pid_proof and pid_proof_address
#   3: the handshake authenticates both sides by challenge-response (Greeting, Challenge, Credentials, Welcome);
#      the pid proof is derived from the handshake, not sent (Hello.pid_proof is gone)
#   4: grants: a peer writes only into ranges granted to it (GRANT / REVOKE frames, WriteGrant, WriteRevoke)
WIRE_VERSION = 4

#: bytes of each side's handshake nonce
NONCE_BYTES = 32

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


_MAC = 64


@frozen
class Greeting:
    """The connector's first frame: its version and nonce, and whether it will authenticate."""

    wire_version: int = field(validator=[ge(0), le(_U64)])
    nonce: bytes = field(validator=[min_len(NONCE_BYTES), max_len(NONCE_BYTES)])
    #: the connector holds a shared secret and expects the acceptor to prove it holds it too
    authenticated: bool


@frozen
class Challenge:
    """The acceptor's answer: its nonce and, with a secret, its proof over both nonces."""

    wire_version: int = field(validator=[ge(0), le(_U64)])
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


def _in_address_space(instance: RegionInfo, _attribute: Any, length: int) -> None:
    if instance.address + length > 1 << 64:
        raise ValueError(f"region [{instance.address:#x}, +{length:#x}) ends past the address space (2**64)")


@frozen
class RegionInfo:
    """A registered range of memory: ``[address, address + length)`` on ``device`` (``"cpu"``, ``"cuda:0"``),
    inside the address space (``address + length <= 2**64``)."""

    address: int = field(validator=[ge(0), le(_U64)])
    length: int = field(validator=[ge(1), le(_U64), _in_address_space])
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
    regions: tuple[RegionInfo, ...] = field(validator=max_len(1 << 14))  # the converter's array cap
    #: backend specific: NIXL agent metadata, UCX worker address
    backend: bytes = field(validator=max_len(_BLOB))
    #: where the sender keeps, for this connection only, the proof of its pid that the handshake derives (see
    #: :mod:`kvferry.transports.handshake`): a peer on the same host reads it there (``process_vm_readv`` of
    #: ``pid``) before it believes ``pid``, and so before it copies into or out of that process's memory itself;
    #: 0 where the sender offers no proof
    pid_proof_address: int = field(default=0, validator=[ge(0), le(_U64)])


@frozen
class Refusal:
    """Sent instead of a Hello when the handshake is refused."""

    reason: str = field(validator=max_len(4096))


@frozen
class RegionsUpdate:
    """The sender's whole set of registered regions now, plus backend metadata for the new ones."""

    regions: tuple[RegionInfo, ...] = field(validator=max_len(1 << 14))  # the converter's array cap
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


#: most items of any array a message may carry, checked before any item is structured: a peer's regions cost
#: ~10 us each to structure and check, so 2**14 of them stay within ~0.25 s of the event loop (the fields' own
#: ``max_len`` may be larger; this is the bound that holds)
_MAX_ITEMS = 1 << 14


def _exactly(kind: type) -> Any:
    """A structure hook that takes values of exactly type ``kind`` (no conversion: ``bytes(2**60)`` would
    allocate, ``int("12")`` parse, ``str(b"x")`` invent text)."""

    def structure(value: Any, _cls: type) -> Any:
        if type(value) is not kind:
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return structure


def _is_array(cls: Any) -> bool:
    return get_origin(cls) is tuple and len(get_args(cls)) == 2 and get_args(cls)[1] is Ellipsis


def _is_row(cls: Any) -> bool:
    return get_origin(cls) is tuple and not _is_array(cls)


def make_converter() -> MsgpackConverter:
    """The converter for everything above; strict on receipt: unknown keys are refused, scalars must be of their
    field's exact type, arrays are msgpack arrays of at most ``2**14`` items (a fixed-length tuple: an array
    of exactly its length)."""
    converter = _make_msgpack_converter(forbid_extra_keys=True)
    for kind in (int, bytes, str, bool):
        converter.register_structure_hook(kind, _exactly(kind))

    def array_hook(cls: Any) -> Any:
        item_type = get_args(cls)[0]
        item = converter.get_structure_hook(item_type)

        def structure(value: Any, _cls: type) -> tuple[Any, ...]:
            if type(value) is not list:
                raise TypeError(f"expected an array, got {type(value).__name__}")
            if len(value) > _MAX_ITEMS:
                raise ValueError(f"an array of {len(value)} items (at most {_MAX_ITEMS})")
            return tuple(item(v, item_type) for v in value)

        return structure

    def row_hook(cls: Any) -> Any:
        item_types = get_args(cls)
        items = [converter.get_structure_hook(t) for t in item_types]

        def structure(value: Any, _cls: type) -> tuple[Any, ...]:
            if type(value) is not list or len(value) != len(items):
                raise TypeError(f"expected an array of {len(items)} items")
            return tuple(hook(v, t) for hook, v, t in zip(items, value, item_types, strict=True))

        return structure

    converter.register_structure_hook_factory(_is_array, array_hook)
    converter.register_structure_hook_factory(_is_row, row_hook)
    return converter


def encode(converter: MsgpackConverter, obj: Any) -> bytes:
    return converter.dumps(obj)


def decode(converter: MsgpackConverter, data: bytes, cls: type[T]) -> T:
    """Decode ``data`` as ``cls``.

    :raises ~kvferry.errors.WireFormatError: if it does not decode or does not validate; no other exception
        escapes.
    """
    try:
        return converter.loads(data, cls)
    except Exception as exc:  # whatever the bytes make msgpack, cattrs or a validator raise
        raise WireFormatError(f"malformed {cls.__name__}: {_describe(exc)}") from exc


def _describe(exc: Exception) -> str:
    """What failed where (``$.regions``), and why (the validator's or hook's own words)."""
    if isinstance(exc, cattrs.BaseValidationError):
        try:
            return "; ".join(cattrs.transform_error(exc, format_exception=_format_exception))
        except Exception:  # the report itself must not fail the decode
            pass
    return f"{type(exc).__name__}: {exc}"


def _format_exception(exc: BaseException, cls: type | None) -> str:
    described = format_exception(exc, cls)
    return f"{described} ({exc})" if isinstance(exc, ValueError | TypeError) else described


# --- grants (wire version 4) ------------------------------------------------------------------------------

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
