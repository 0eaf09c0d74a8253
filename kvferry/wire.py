"""The one wire format of kvferry: frozen attrs classes, serialised by one cattrs converter to msgpack.

:func:`encode` turns a message into bytes; :func:`decode` turns bytes from a peer back into a message of the
class you expect, or raises :class:`~kvferry.errors.WireFormatError` -- for *every* failure: truncated or
trailing bytes, msgpack errors, unknown or missing keys, wrong types (a bool where an int belongs, a string
where a list belongs), integers outside int64, deep recursion, and whatever the message's own ``validate()``
refuses. No other exception escapes :func:`decode`.

Messages need no registration: any ``@frozen`` attrs class whose fields are ints, floats, strs, bools, bytes,
enums, tuples / lists / dicts of those, ``X | None`` or other such classes works. A class with a
``validate(self) -> None`` method gets it called after structuring; it raises ``WireFormatError`` when the
fields are individually well typed but inconsistent (overlapping ranges, counts that disagree).

Tuples of ints (``tuple[int, ...]``: page ids, token ids) travel packed, as msgpack binary of little-endian
int64 values: one buffer to copy where a list costs a msgpack item and a type check per value (a receive request
of an 8K-token prompt decodes in a fifth of the time). Lists of ints travel as msgpack arrays.

Version history (``WIRE_VERSION``):
  1 -- first version: page tables.
  2 -- tuples of ints packed as little-endian int64 binary.
  3 -- control kind ``chunk_results``: several writers' reports in one message.
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Callable
from typing import Any, TypeVar, get_args, get_origin

import cattrs
import msgpack

from kvferry.errors import WireFormatError

__all__ = ["INT64_MAX", "INT64_MIN", "WIRE_VERSION", "PackedInts", "decode", "encode", "make_converter"]

#: Bumped on every incompatible change of any message; peers compare it before decoding anything else.
WIRE_VERSION = 3

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

T = TypeVar("T")


def _type_name(value: object) -> str:
    return type(value).__name__


def _structure_int(value: Any, _cls: type) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an int, got {_type_name(value)}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"int {value} outside int64")
    return value


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


def make_converter() -> cattrs.Converter:
    """A strict converter: exact scalar types, int64 range, lists for sequences, no extra keys."""
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
            items = [converter.structure(v, item_type) for v in value]
            return tuple(items) if origin is tuple else items

        return structure_sequence

    converter.register_structure_hook_factory(_is_container, container_hook)
    return converter


# The one converter: hooks are registered once, here; messages never add any (see the module docstring).
_CONVERTER = make_converter()


def _describe(exc: Exception) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        try:
            return "; ".join(cattrs.transform_error(exc))
        except Exception:  # the error report itself must not fail the decode
            pass
    return f"{type(exc).__name__}: {exc}"


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
