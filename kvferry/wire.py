"""The one wire format of kvferry: frozen attrs classes, serialised by one cattrs converter to msgpack.

Two protocols travel in it, versioned apart:

- the transports' peer protocol (:mod:`kvferry.transports.messages`: handshake, regions, two-sided writes,
  grants), versioned by :data:`TRANSPORT_PROTOCOL_VERSION` and compared in the handshake's first frames;
- the disaggregation protocol (:mod:`kvferry.disagg.protocol`, :mod:`kvferry.pools.pagetable`: page tables,
  hellos, control messages), versioned by :data:`DISAGG_PROTOCOL_VERSION` and compared in its hello.

:func:`encode` turns a message into bytes; :func:`decode` turns bytes from a peer back into a message of the
class you expect, or raises :class:`~kvferry.errors.WireFormatError` -- for *every* failure: truncated or
trailing bytes, msgpack errors, unknown or missing keys, wrong types (a bool where an int belongs, a string
where a list belongs), integers outside their range, arrays over their cap, deep recursion, and whatever the
message's own validators or ``validate()`` refuse. No other exception escapes :func:`decode`.

Messages need no registration: any ``@frozen`` attrs class whose fields are ints, floats, strs, bools, bytes,
enums, tuples / lists / dicts of those, ``X | None`` or other such classes works. A class with a
``validate(self) -> None`` method gets it called after structuring; it raises ``WireFormatError`` when the
fields are individually well typed but inconsistent (overlapping ranges, counts that disagree).

Scalars are taken as their exact type only (no conversion: ``bytes(2**60)`` would allocate, ``int("12")``
parse, ``str(b"x")`` invent text); a float field also takes an int. A plain ``int`` is an int64; a field
annotated :data:`U64` (addresses, lengths, ids, tags) is an unsigned 64-bit int instead. An array annotated
:class:`MaxItems` (or :data:`Capped`) is refused on its length before any of its items is structured, which
bounds what a peer's message costs to decode.

Tuples of ints (``tuple[int, ...]``: page ids, token ids) travel packed, as msgpack binary of little-endian
int64 values: one buffer to copy where a list costs a msgpack item and a type check per value. Lists of ints
travel as msgpack arrays.

Versions of the transports' peer protocol (:data:`TRANSPORT_PROTOCOL_VERSION`):
  1 -- handshake envelope and hello, regions, messages, notifications, two-sided writes.
  2 -- a two-sided write may offer its source ranges for the receiver to read (same host): ``WriteRequest.src``,
       ``WriteStatus.PULLING`` and ``PROGRESS``; ``Hello.pid_proof`` and ``pid_proof_address``.
  3 -- the handshake authenticates both sides by challenge-response (``Greeting``, ``Challenge``,
       ``Credentials``, ``Welcome``); the pid proof is derived from the handshake, not sent.
  4 -- grants: a peer writes only into ranges granted to it (``GRANT`` / ``REVOKE`` frames, ``WriteGrant``,
       ``WriteRevoke``).
  5 -- a receiver may answer a short pulled write DONE at once, without ``PULLING`` first.

Versions of the disaggregation protocol (:data:`DISAGG_PROTOCOL_VERSION`):
  1 -- page tables.
  2 -- tuples of ints packed as little-endian int64 binary.
  3 -- control kind ``chunk_results``: several writers' reports in one message.
  4 -- page tables may hold MLA latent pages (a paged group of role ``latent``, replicated on every rank).
  5 -- control kind ``tables_update``: a peer's new page tables after a pool rebalance.
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Callable
from typing import Annotated, Any, TypeVar, get_args, get_origin

import cattrs
import msgpack
from attrs import frozen
from cattrs.v import format_exception

from kvferry.errors import WireFormatError

__all__ = [
    "DISAGG_PROTOCOL_VERSION",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_ARRAY_ITEMS",
    "TRANSPORT_PROTOCOL_VERSION",
    "U64",
    "UINT64_MAX",
    "WIRE_VERSION",
    "Capped",
    "MaxItems",
    "PackedInts",
    "decode",
    "encode",
    "make_converter",
]

#: The transports' peer protocol (:mod:`kvferry.transports.messages`); bumped on every change the previous
#: version cannot read. Peers compare it in the handshake before anything else is decoded.
TRANSPORT_PROTOCOL_VERSION = 5
#: The disaggregation protocol (page tables, disagg hellos and control messages); bumped on every change the
#: previous version cannot read. Peers compare it in the disagg hello before anything else is decoded.
DISAGG_PROTOCOL_VERSION = 5
#: The disaggregation protocol's version under the name page tables carry it as (``PageTable.wire_version``).
WIRE_VERSION = DISAGG_PROTOCOL_VERSION

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1

T = TypeVar("T")


class _Unsigned64:
    """The mark :data:`U64` carries."""

    def __repr__(self) -> str:
        return "U64"


#: An unsigned 64-bit int field (addresses, lengths, ids, tags): taken in ``[0, 2**64)``, where a plain ``int``
#: field is an int64.
U64 = Annotated[int, _Unsigned64()]


@frozen
class MaxItems:
    """``Annotated[tuple[X, ...], MaxItems(n)]``: an array of at most ``n`` items, refused on its length before
    any item is structured (a peer's array of classes costs microseconds per item to structure and check)."""

    count: int


#: most items of a :data:`Capped` array: bounds what structuring a peer's array of classes costs the event loop
MAX_ARRAY_ITEMS = 1 << 14

#: ``Capped[X]``: a tuple of ``X`` of at most :data:`MAX_ARRAY_ITEMS` items (see :class:`MaxItems`).
Capped = Annotated[tuple[T, ...], MaxItems(MAX_ARRAY_ITEMS)]


def _type_name(value: object) -> str:
    return type(value).__name__


def _int_hook(low: int, high: int, kind: str) -> Callable[[Any, type], int]:
    """A structure hook taking exactly an ``int`` in ``[low, high]`` (``kind`` names the range in errors)."""

    def structure(value: Any, _cls: type) -> int:
        if type(value) is not int:
            raise TypeError(f"expected an int, got {_type_name(value)}")
        if not low <= value <= high:
            raise ValueError(f"int {value} outside {kind}")
        return value

    return structure


_structure_int = _int_hook(INT64_MIN, INT64_MAX, "int64")
_structure_u64 = _int_hook(0, UINT64_MAX, "uint64")


def _check_ints(values: list[Any] | tuple[Any, ...]) -> None:
    """What :func:`_structure_int` checks, for every item at once (the first bad item is named)."""
    if not values:
        return
    if set(map(type, values)) != {int}:
        _structure_int(next(v for v in values if type(v) is not int), int)
    if min(values) < INT64_MIN or max(values) > INT64_MAX:
        _structure_int(next(v for v in values if not INT64_MIN <= v <= INT64_MAX), int)


class PackedInts(tuple[int, ...]):
    """A tuple of ints as decoded from the wire, which keeps the little-endian int64 bytes it came as in
    :attr:`packed`: a reader that wants an array views them (``numpy.frombuffer``) instead of converting every
    value again. Equal to, and usable as, the plain tuple."""

    packed: bytes


def _pack_ints(values: tuple[int, ...]) -> bytes:
    """``values`` as little-endian int64 bytes. :raises OverflowError, TypeError: a value is not one."""
    if type(values) is PackedInts:
        return values.packed
    packed = array("q", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _unpack_ints(value: Any, _cls: type) -> tuple[int, ...]:
    if type(value) is not bytes:
        raise TypeError(f"expected packed int64 values (bytes), got {_type_name(value)}")
    if len(value) % 8:
        raise ValueError(f"packed int64 values of {len(value)} bytes (not a multiple of 8)")
    unpacked = array("q")
    unpacked.frombytes(value)
    if sys.byteorder != "little":
        unpacked.byteswap()
    ints = PackedInts(unpacked)
    ints.packed = value
    return ints


def _is_int_tuple(cls: Any) -> bool:
    return get_origin(cls) is tuple and get_args(cls) == (int, Ellipsis)


def _structure_float(value: Any, _cls: type) -> float:
    if type(value) is float:
        return value
    if type(value) is int and INT64_MIN <= value <= INT64_MAX:
        return float(value)
    raise TypeError(f"expected a float, got {_type_name(value)}")


def _structure_str(value: Any, _cls: type) -> str:
    if type(value) is not str:
        raise TypeError(f"expected a str, got {_type_name(value)}")
    return value


def _structure_bool(value: Any, _cls: type) -> bool:
    if type(value) is not bool:
        raise TypeError(f"expected a bool, got {_type_name(value)}")
    return value


def _structure_bytes(value: Any, _cls: type) -> bytes:
    if type(value) is not bytes:
        raise TypeError(f"expected bytes, got {_type_name(value)}")
    return value


def _is_container(cls: Any) -> bool:
    return get_origin(cls) in (tuple, list, dict)


def _is_annotated(cls: Any) -> bool:
    return get_origin(cls) is Annotated


def make_converter() -> cattrs.Converter:
    """A strict converter: exact scalar types, int64 (or :data:`U64`) range, arrays for sequences (capped where
    a field says so), no extra keys."""
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    # Scalars dispatch by class and so would also catch subclasses (a StrEnum is a str, an IntEnum an int):
    # enums get a hook of their own, registered on each enum base that sits before str/int in the MRO.
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(bytes, _structure_bytes)
    # per enum class: its members by (type, value) of their values (an exact type: 1 is not True)
    members: dict[type[enum.Enum], dict[tuple[type, Any], enum.Enum]] = {}

    def structure_enum(value: Any, cls: type[enum.Enum]) -> enum.Enum:
        by_value = members.get(cls)
        if by_value is None:
            by_value = members[cls] = {(type(m.value), m.value): m for m in cls}
        try:
            return by_value[type(value), value]
        except (KeyError, TypeError):  # TypeError: an unhashable value (a list, a map)
            raise ValueError(f"{value!r} is not a {cls.__name__}") from None

    for base in (enum.Enum, enum.StrEnum, enum.IntEnum, enum.IntFlag):
        converter.register_structure_hook(base, structure_enum)

    converter.register_unstructure_hook_func(_is_int_tuple, _pack_ints)

    def container_hook(cls: Any) -> Callable[[Any, type], Any]:
        origin, args = get_origin(cls), get_args(cls)
        if _is_int_tuple(cls):
            return _unpack_ints
        if origin is dict:
            key_type, value_type = args or (Any, Any)

            def structure_dict(value: Any, _cls: type) -> dict[Any, Any]:
                if type(value) is not dict:
                    raise TypeError(f"expected a map, got {_type_name(value)}")
                return {
                    converter.structure(k, key_type): converter.structure(v, value_type)
                    for k, v in value.items()
                }

            return structure_dict
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            item_types: tuple[Any, ...] | None = None
            item_type = args[0]
        elif origin is tuple:
            item_types, item_type = args, None
        else:
            item_types, item_type = None, args[0] if args else Any

        def structure_sequence(value: Any, _cls: type) -> Any:
            if type(value) not in (list, tuple):
                raise TypeError(f"expected an array, got {_type_name(value)}")
            if item_types is not None:
                if len(value) != len(item_types):
                    raise ValueError(f"expected {len(item_types)} items, got {len(value)}")
                return tuple(converter.structure(v, t) for v, t in zip(value, item_types, strict=True))
            if item_type is int:  # page ids and the like: one pass over the types, not a hook call per item
                _check_ints(value)
                return tuple(value) if origin is tuple else list(value)
            structure_item = converter.get_structure_hook(item_type)  # once per array, not once per item
            items = [structure_item(v, item_type) for v in value]
            return tuple(items) if origin is tuple else items

        return structure_sequence

    def annotated_hook(cls: Any) -> Callable[[Any, type], Any]:
        base, *marks = get_args(cls)
        if any(isinstance(mark, _Unsigned64) for mark in marks):
            return _structure_u64
        cap = next((mark.count for mark in marks if isinstance(mark, MaxItems)), None)
        if cap is None:
            return converter.get_structure_hook(base)
        structure_base = converter.get_structure_hook(base)

        def structure_capped(value: Any, _cls: type) -> Any:
            if type(value) not in (list, tuple):
                raise TypeError(f"expected an array, got {_type_name(value)}")
            if len(value) > cap:
                raise ValueError(f"an array of {len(value)} items (at most {cap})")
            return structure_base(value, base)

        return structure_capped

    converter.register_structure_hook_factory(_is_container, container_hook)
    converter.register_structure_hook_factory(_is_annotated, annotated_hook)
    return converter


# The one converter: hooks are registered once, here; messages never add any (see the module docstring).
_CONVERTER = make_converter()


def _describe(exc: Exception) -> str:
    """What failed where (``$.regions``), and why (the hook's or validator's own words)."""
    if isinstance(exc, cattrs.BaseValidationError):
        try:
            return "; ".join(cattrs.transform_error(exc, format_exception=_format_exception))
        except Exception:  # the error report itself must not fail the decode
            pass
    return f"{type(exc).__name__}: {exc}"


def _format_exception(exc: BaseException, cls: type | None) -> str:
    if cls is not None and _is_annotated(cls):
        cls = get_args(cls)[0]  # name the annotated type (``int``), not ``Annotated``
    described = format_exception(exc, cls)
    return f"{described} ({exc})" if isinstance(exc, ValueError | TypeError) else described


def encode(obj: object) -> bytes:
    """Serialise a message to msgpack bytes.

    :raises ~kvferry.errors.WireFormatError: if ``obj`` holds something the wire cannot carry.
    """
    try:
        return msgpack.packb(_CONVERTER.unstructure(obj), use_bin_type=True)  # type: ignore[no-any-return]
    except Exception as exc:  # an unencodable message is a bug, but still a typed one
        raise WireFormatError(f"cannot encode {type(obj).__name__}: {exc}") from exc


def decode(data: bytes | bytearray | memoryview, cls: type[T]) -> T:
    """Decode bytes from a peer into a ``cls``, checked field by field and then by ``cls.validate()``.

    :raises ~kvferry.errors.WireFormatError: on any malformed, mistyped, truncated or inconsistent input; no
        other exception escapes.
    """
    try:
        raw = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise WireFormatError(f"not a msgpack message: {type(exc).__name__}: {exc}") from None
    try:
        obj = _CONVERTER.structure(raw, cls)
    except Exception as exc:
        raise WireFormatError(f"invalid {cls.__name__}: {_describe(exc)}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except WireFormatError:
            raise
        except Exception as exc:
            raise WireFormatError(f"inconsistent {cls.__name__}: {type(exc).__name__}: {exc}") from None
    return obj
