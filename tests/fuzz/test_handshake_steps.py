"""Fuzz targets, one per step of the handshake: each side is driven through the steps before with valid frames
and then given arbitrary bytes (and arbitrary msgpack) for that step; the only errors that may escape are the
handshake's own (PeerIncompatible, of which AuthenticationFailed is one, and WireFormatError) or the end of the
stream. A smoke run of each is in every suite, a long one in the slow suite."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import anyio
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry import wire
from kvferry.errors import PeerIncompatible, WireFormatError
from kvferry.transports import messages
from kvferry.transports._framing import FrameReader, frame
from kvferry.transports.handshake import Handshake, Introduction

SMOKE, LONG = 40, 1500


class ScriptedStream:
    """A byte stream that hands out scripted bytes and keeps what is sent to it."""

    def __init__(self, incoming: bytes) -> None:
        self.incoming = bytearray(incoming)
        self.sent: list[bytes] = []

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint()
        if not self.incoming:
            raise anyio.EndOfStream
        data = bytes(self.incoming[:max_bytes])
        del self.incoming[:max_bytes]
        return data

    async def send(self, data: bytes) -> None:
        await anyio.lowlevel.checkpoint()
        self.sent.append(data)

    def extra(self, attribute: Any, default: Any = None) -> Any:
        return default


def _hello(address: int) -> messages.Hello:
    return messages.Hello(
        "local", "fuzz", "local://127.0.0.1:1", "elsewhere", 1, 1, 1 << 20, 0, (), b"", address
    )


def _handshake(secret: bytes | None) -> Handshake:
    return Handshake(name="local", secret=secret, compat_hash=b"", max_bytes=1 << 20)


def _step(body: bytes) -> bytes:
    return frame(messages.FrameKind.HANDSHAKE, body)


VALID_ACCEPTOR_STEPS = [
    _step(wire.encode(messages.Greeting(wire.TRANSPORT_PROTOCOL_VERSION, bytes(32), False))),
    _step(wire.encode(messages.Credentials(b"", b""))),
    _step(wire.encode(_hello(0))),
]
VALID_CONNECTOR_STEPS = [
    _step(wire.encode(messages.Challenge(wire.TRANSPORT_PROTOCOL_VERSION, bytes(32), b""))),
    _step(wire.encode(messages.Welcome(b""))),
    _step(wire.encode(_hello(0))),
]


async def _admit(_: Introduction) -> None:
    pass


def _run(side: str, steps: list[bytes], secret: bytes | None) -> None:
    stream = ScriptedStream(b"".join(steps))

    async def go() -> None:
        handshake = _handshake(secret)
        with anyio.fail_after(10):
            if side == "acceptor":
                await handshake.acceptor(stream, FrameReader(stream), _hello, _admit)  # type: ignore[arg-type]
            else:
                await handshake.connector(stream, FrameReader(stream), _hello)  # type: ignore[arg-type]

    with contextlib.suppress(PeerIncompatible, WireFormatError, anyio.EndOfStream):
        anyio.run(go)


_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.binary(max_size=80)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=12,
)
_FIELDS = [
    "wire_version",
    "nonce",
    "authenticated",
    "proof",
    "compat_hash",
    "transport",
    "regions",
    "backend",
]
BODIES = st.one_of(
    st.binary(max_size=300),
    st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=6).map(
        lambda d: msgpack.packb(d, use_bin_type=True)
    ),
)
#: a frame of another kind, or a header announcing more than any step may be
FRAMES = st.one_of(
    BODIES.map(_step),
    st.tuples(st.integers(0, 255), BODIES).map(
        lambda kb: messages.FRAME_HEADER.pack(kb[0], len(kb[1])) + kb[1]
    ),
    st.integers(0, 2**64 - 1).map(lambda n: messages.FRAME_HEADER.pack(messages.FrameKind.HANDSHAKE, n)),
)


def _target(side: str, step: int, examples: int) -> Callable[..., None]:
    valid = VALID_ACCEPTOR_STEPS if side == "acceptor" else VALID_CONNECTOR_STEPS

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(fuzzed=FRAMES, secret=st.sampled_from([None, b"s" * 32]))
    def test(fuzzed: bytes, secret: bytes | None) -> None:
        _run(side, [*valid[:step], fuzzed, *valid[step + 1 :]], secret)

    return test


STEPS = [("acceptor", i) for i in range(3)] + [("connector", i) for i in range(3)]


@pytest.mark.parametrize(("side", "step"), STEPS)
def test_a_fuzzed_step(side: str, step: int) -> None:
    _target(side, step, SMOKE)()


@pytest.mark.slow
@pytest.mark.parametrize(("side", "step"), STEPS)
def test_a_fuzzed_step_long(side: str, step: int) -> None:
    _target(side, step, LONG)()


def test_the_valid_steps_complete_a_handshake() -> None:
    """The scripts are valid: unfuzzed, each side completes (so each fuzzed step is reached)."""
    for side, steps in (("acceptor", VALID_ACCEPTOR_STEPS), ("connector", VALID_CONNECTOR_STEPS)):
        stream = ScriptedStream(b"".join(steps))

        async def go(side: str = side, stream: ScriptedStream = stream) -> Introduction:
            handshake = _handshake(None)
            if side == "acceptor":
                return await handshake.acceptor(stream, FrameReader(stream), _hello, _admit)  # type: ignore[arg-type]
            return await handshake.connector(stream, FrameReader(stream), _hello)  # type: ignore[arg-type]

        introduction = anyio.run(go)
        assert introduction.hello.instance_id == "fuzz" and not introduction.same_host
