"""The control channel's messages (``kvferry.transports.messages``) through the one wire converter: round
trips, exact types, ranges inside the address space, arrays over their cap."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry import wire
from kvferry.errors import WireFormatError
from kvferry.transports import as_fragments, messages
from kvferry.transports._memory import RegionTable
from kvferry.transports.messages import RegionInfo


@given(st.binary(max_size=64), st.binary(max_size=256), st.integers(0, 2**64 - 1))
def test_handshake_round_trip(compat: bytes, body: bytes, version: int) -> None:
    for message in (
        messages.Credentials(body[:64], compat),
        messages.Welcome(compat),
        messages.Challenge(version, bytes(messages.NONCE_BYTES), body[:64]),
        messages.Greeting(version, bytes(range(messages.NONCE_BYTES)), bool(version % 2)),
    ):
        assert wire.decode(wire.encode(message), type(message)) == message


def test_malformed_messages_are_refused() -> None:
    for data in (
        b"",
        b"\xc1",
        b"\x93\x01\x02\x03",
        msgpack.packb({"wire_version": -1, "nonce": bytes(32), "authenticated": True}),
        msgpack.packb({"wire_version": 3, "nonce": bytes(31), "authenticated": True}),
        msgpack.packb({"wire_version": 3, "nonce": bytes(33), "authenticated": True}),
    ):
        with pytest.raises(WireFormatError):
            wire.decode(data, messages.Greeting)
    extra = msgpack.packb({"wire_version": 3, "nonce": bytes(32), "authenticated": True, "surprise": 1})
    with pytest.raises(WireFormatError):
        wire.decode(extra, messages.Greeting)
    with pytest.raises(WireFormatError):
        wire.decode(msgpack.packb({"address": 1, "length": 0, "device": "cpu"}), RegionInfo)


def test_a_region_ends_inside_the_address_space() -> None:
    """A RegionInfo of address + length > 2**64 is refused at decode: in RegionTable it would raise
    OverflowError and end the peer's task."""
    top = RegionInfo(2**64 - 4096, 4096, "cpu")  # ends at 2**64 exactly
    table = RegionTable([RegionInfo(4096, 4096, "cpu"), top])
    rows = np.array([[2**64 - 4096, 4095], [2**64 - 2, 1], [8000, 192]], dtype=np.uint64)
    assert table.holding(as_fragments(rows)).tolist() == [1, 1, 0]
    with pytest.raises(ValueError, match="ends past"):
        RegionInfo(2**64 - 1, 2, "cpu")
    for regions in ([[2**64 - 1, 2]], [[2**63, 2**63 + 1]], [[4096, 8], [2, 2**64 - 1]]):
        update = {
            "regions": [{"address": a, "length": n, "device": "cpu"} for a, n in regions],
            "backend": b"",
        }
        with pytest.raises(WireFormatError):
            wire.decode(msgpack.packb(update), messages.RegionsUpdate)


def test_messages_take_exact_types() -> None:
    """The converter takes exact types only: a lax one turns an int into bytes (``bytes(2**60)`` allocates it), a
    str or a float into an int, bytes into a str. Each is refused, as is an array over its cap."""
    good = {"wire_version": 1, "nonce": bytes(32), "proof": b""}
    assert wire.decode(msgpack.packb(good), messages.Challenge) == messages.Challenge(1, bytes(32), b"")
    for key, value in (
        ("proof", 2**60),
        ("proof", [1, 2]),
        ("proof", "text"),
        ("nonce", 5),
        ("wire_version", True),
        ("wire_version", "1"),
        ("wire_version", 1.5),
        ("wire_version", b"1"),
    ):
        with pytest.raises(WireFormatError, match=key):
            wire.decode(msgpack.packb({**good, key: value}), messages.Challenge)
    with pytest.raises(WireFormatError):
        wire.decode(msgpack.packb({"reason": b"bytes"}), messages.Refusal)
    region = {"address": 4096, "length": 1, "device": "cpu"}
    many = {"regions": [region] * (wire.MAX_ARRAY_ITEMS + 1), "backend": b""}
    with pytest.raises(WireFormatError, match="at most"):
        wire.decode(msgpack.packb(many), messages.RegionsUpdate)


def test_messages_travel_as_plain_msgpack_maps() -> None:
    """The wire format of the peer protocol: each message is a msgpack map of its fields, in order; enums as
    their values, u64 fields as msgpack integers (up to 2**64 - 1), arrays of classes as arrays of maps."""
    region = RegionInfo(2**64 - 4096, 4096, "cuda:0")
    hello = messages.Hello("ucx", "i", "ucx://h:1", "h", 7, 8, 1 << 20, 2**64 - 1, (region,), b"w", 5)
    assert wire.encode(hello) == msgpack.packb(
        {
            "transport": "ucx",
            "instance_id": "i",
            "address": "ucx://h:1",
            "hostname": "h",
            "pid": 7,
            "pid_namespace": 8,
            "max_message_bytes": 1 << 20,
            "tag_prefix": 2**64 - 1,
            "regions": [{"address": 2**64 - 4096, "length": 4096, "device": "cuda:0"}],
            "backend": b"w",
            "pid_proof_address": 5,
        },
        use_bin_type=True,
    )
    reply = messages.WriteReply(3, messages.WriteStatus.PULLING)
    assert wire.encode(reply) == msgpack.packb(
        {"write_id": 3, "status": "pulling", "detail": "", "tag": 0}, use_bin_type=True
    )
    assert wire.decode(wire.encode(hello), messages.Hello) == hello


def test_fragments_travel_as_little_endian_rows() -> None:
    rows = as_fragments(np.array([[4096, 16], [2**64 - 2, 1]], dtype=np.uint64))
    data = messages.fragments_bytes(rows)
    assert data == np.array([[4096, 16], [2**64 - 2, 1]], dtype="<u8").tobytes()
    assert messages.fragments_from_bytes(data).tolist() == rows.tolist()
    for bad in (
        data[:-1],
        np.array([[4096, 0]], dtype="<u8").tobytes(),
        np.array([[2**64 - 1, 2]], "<u8").tobytes(),
    ):
        with pytest.raises(WireFormatError):
            messages.fragments_from_bytes(bad)
