from __future__ import annotations

import contextlib
import enum

import msgpack
import numpy as np
import pytest
from attrs import frozen
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry import wire
from kvferry.disagg.mapping import RequestCache
from kvferry.errors import WireFormatError


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@frozen
class Inner:
    size: int
    ratio: float
    flag: bool
    data: bytes


@frozen
class Ids:
    ids: tuple[int, ...]
    more: list[int]


@frozen
class Message:
    name: str
    color: Color
    pair: tuple[int, str]
    items: tuple[Inner, ...]
    table: dict[str, int]
    maybe: int | None = None

    def validate(self) -> None:
        if self.pair[0] > 100:
            raise WireFormatError("pair[0] too big")
        if self.name == "boom":
            raise IndexError("a bug in a validator must still become WireFormatError")


def _message() -> Message:
    return Message(
        name="m",
        color=Color.BLUE,
        pair=(3, "x"),
        items=(Inner(size=1, ratio=0.5, flag=True, data=b"\x00\x01"), Inner(2, 2.0, False, b"")),
        table={"a": 1},
    )


def _raw() -> dict[str, object]:
    return msgpack.unpackb(wire.encode(_message()), raw=False)  # type: ignore[no-any-return]


def test_round_trip() -> None:
    message = _message()
    assert wire.decode(wire.encode(message), Message) == message
    assert wire.decode(bytearray(wire.encode(message)), Message) == message
    assert wire.WIRE_VERSION >= 1


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("items", 0, "size"), True),  # bool for int
        (("items", 0, "size"), 1.0),
        (("items", 0, "size"), "1"),
        (("items", 0, "size"), 1 << 63),  # outside int64
        (("items", 0, "flag"), 1),  # int for bool
        (("items", 0, "ratio"), "0.5"),
        (("items", 0, "data"), "text"),
        (("name",), 5),
        (("color",), "green"),
        (("color",), 0),
        (("pair",), [1, "x", 2]),
        (("pair",), "ab"),
        (("items",), {"size": 1}),
        (("table",), [["a", 1]]),
        (("table",), {"a": "1"}),
        (("maybe",), "x"),
        (("pair",), [101, "x"]),  # validate() refuses
        (("name",), "boom"),  # validate() raises a bug: still WireFormatError
    ],
)
def test_strict_types(path: tuple[object, ...], value: object) -> None:
    raw = _raw()
    target: object = raw
    for key in path[:-1]:
        target = target[key]  # type: ignore[index]
    target[path[-1]] = value  # type: ignore[index]
    with pytest.raises(WireFormatError):
        wire.decode(msgpack.packb(raw), Message)


@pytest.mark.parametrize("bad", [True, 1.0, "7", None, 1 << 63, (1 << 64) - 1])
def test_int_sequences_are_checked_item_by_item(bad: object) -> None:
    """Lists of ints decode in one pass; a bad item anywhere (a bool, a float, a str, None, outside int64) is
    refused, naming the field. A tuple of ints (packed on the wire) refuses any array."""
    ids = list(range(1, 600))
    assert wire.decode(wire.encode(Ids(tuple(ids), ids)), Ids) == Ids(tuple(ids), ids)
    assert wire.decode(wire.encode(Ids((), [])), Ids) == Ids((), [])
    for field in ("ids", "more"):
        for where in (0, 300, len(ids) - 1):
            raw: dict[str, list[object]] = {"ids": list(ids), "more": list(ids)}
            raw[field][where] = bad
            with pytest.raises(WireFormatError, match=rf"\$\.{field}"):
                wire.decode(msgpack.packb(raw), Ids)
    decoded = wire.decode(wire.encode(Ids((wire.INT64_MIN, wire.INT64_MAX), [0])), Ids)
    assert decoded.ids == (wire.INT64_MIN, wire.INT64_MAX) and isinstance(decoded.ids, tuple)
    assert type(decoded.more) is list


def test_int_tuples_travel_packed() -> None:
    """A tuple of ints is one binary of little-endian int64 values on the wire (lists stay msgpack arrays); a
    buffer that is not whole int64 values, or an array where the packed values belong, is refused."""
    raw = msgpack.unpackb(wire.encode(Ids((1, -2, wire.INT64_MAX), [3])))
    assert raw == {
        "ids": (1).to_bytes(8, "little") + (-2).to_bytes(8, "little", signed=True) + bytes([255] * 7 + [127]),
        "more": [3],
    }
    for bad in (b"\x01" * 7, b"\x01" * 17, [1, 2], "12345678", None):
        with pytest.raises(WireFormatError, match=r"\$\.ids"):
            wire.decode(msgpack.packb({"ids": bad, "more": []}), Ids)
    with pytest.raises(WireFormatError):
        wire.encode(Ids((1 << 63,), []))  # outside int64: not encodable


def test_decoded_int_tuples_keep_their_bytes() -> None:
    """A decoded tuple of ints is a PackedInts: equal to the plain tuple, its wire bytes kept (encoded again as
    they came); a block table built from one views those bytes instead of converting each id."""
    sent = Ids((5, 1, 9), [])
    got = wire.decode(wire.encode(sent), Ids)
    assert (
        type(got.ids) is wire.PackedInts
        and got == sent
        and got.ids == (5, 1, 9)
        and hash(got.ids) == hash((5, 1, 9))
    )
    assert wire.encode(got) == wire.encode(sent)
    cache = RequestCache({"attention": got.ids}, slot=None)
    ids = cache.blocks["attention"]
    assert ids.tolist() == [5, 1, 9] and ids.dtype == np.int64 and not ids.flags.writeable


def test_optional_and_default() -> None:
    raw = _raw()
    raw["maybe"] = 7
    assert wire.decode(msgpack.packb(raw), Message).maybe == 7
    del raw["maybe"]
    assert wire.decode(msgpack.packb(raw), Message).maybe is None
    raw["items"][0]["ratio"] = 2  # type: ignore[index]
    assert wire.decode(msgpack.packb(raw), Message).items[0].ratio == 2.0


def test_extra_and_missing_keys() -> None:
    raw = _raw()
    raw["surprise"] = 1
    with pytest.raises(WireFormatError):
        wire.decode(msgpack.packb(raw), Message)
    raw = _raw()
    del raw["name"]
    with pytest.raises(WireFormatError):
        wire.decode(msgpack.packb(raw), Message)


def test_encode_failure_is_typed() -> None:
    with pytest.raises(WireFormatError):
        wire.encode(object())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_escape(data: bytes) -> None:
    with contextlib.suppress(WireFormatError):
        wire.decode(data, Message)
