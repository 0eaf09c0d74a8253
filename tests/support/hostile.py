"""A hostile peer: ``python hostile.py ATTACK ADDRESS [--secret-env] [options]`` runs one attack against the
transport listening at ADDRESS, from this process, and prints one JSON line of what it saw.

Every wait has a deadline. The attacks are the ones found against kvferry's listeners; what each expects of the
target is asserted by the tests (test_hostile_peers.py), not here.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import socket
import time
from typing import Any

import anyio
import attrs
import msgpack
import numpy as np
from anyio.abc import ByteStream

from kvferry import wire
from kvferry.errors import PeerIncompatible
from kvferry.transports import get_transport, messages
from kvferry.transports._framing import FrameReader, frame, read_frame
from kvferry.transports.control import parse_address
from kvferry.transports.handshake import SECRET_ENV, Handshake, pid_namespace

HEADER = messages.FRAME_HEADER
DEADLINE = 20.0


def _hello(args: argparse.Namespace, proof_address: int, **fields: Any) -> messages.Hello:
    base: dict[str, Any] = dict(
        transport=args.transport,
        instance_id="hostile",
        address="hostile://127.0.0.1:1",
        hostname=socket.gethostname(),
        pid=os.getpid(),
        pid_namespace=pid_namespace(),
        max_message_bytes=16 << 20,
        tag_prefix=0,
        regions=(),
        backend=b"",
        pid_proof_address=proof_address,
    )
    base.update(fields)
    return messages.Hello(**base)


async def _connect(address: str) -> ByteStream:
    _, host, port = parse_address(address)
    return await anyio.connect_tcp(host, port)


async def _outcome(stream: ByteStream, seconds: float = 5.0) -> str:
    """What the target did next: sent a refusal, sent something else, or closed (or nothing, in time)."""
    reader = FrameReader(stream)
    with anyio.move_on_after(seconds):
        try:
            kind, body = await read_frame(reader, 1 << 20)
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return "closed"
        if kind == messages.FrameKind.REFUSAL:
            return "refused: " + wire.decode(body, messages.Refusal).reason
        return f"frame {kind}"
    return "silent"


def _handshake(args: argparse.Namespace, secret: bytes | None) -> Handshake:
    return Handshake(name=args.transport, secret=secret, compat_hash=b"", max_bytes=16 << 20)


async def _raw(address: str, data: bytes) -> dict[str, Any]:
    stream = await _connect(address)
    await stream.send(data)
    return {"outcome": await _outcome(stream)}


async def _handshaken(args: argparse.Namespace, **hello: Any) -> tuple[ByteStream, str]:
    """A whole handshake, with our secret if we were given one, and a hello of our making on top of a real
    transport's (so its backend part, NIXL metadata or a UCX worker address, is valid)."""
    stream = await _connect(args.address)
    real = get_transport(args.transport)(secret=_secret(args))
    await real.start()
    try:
        await _handshake(args, _secret(args)).connector(
            stream,
            FrameReader(stream),
            lambda address: attrs.evolve(real.control.hello(address), **hello),  # type: ignore[attr-defined]
        )
    except Exception as exc:
        return stream, f"refused: {type(exc).__name__}: {exc}"
    finally:
        await real.aclose()
    return stream, "accepted"


def _secret(args: argparse.Namespace) -> bytes | None:
    return os.environ[SECRET_ENV].encode() if args.secret_env else None


async def _flood(args: argparse.Namespace, kind: messages.FrameKind, piece: int) -> dict[str, Any]:
    """Send ``args.megabytes`` MiB of frames of ``kind`` for at most ``args.seconds``; how much went out."""
    stream, outcome = await _handshaken(args)
    if outcome != "accepted":
        return {"outcome": outcome, "sent_bytes": 0}
    body = bytes(piece)
    chunk = frame(kind, body)
    sent = 0
    with anyio.move_on_after(args.seconds):
        while sent < args.megabytes << 20:
            await stream.send(chunk)
            sent += len(chunk)
    return {"outcome": "accepted", "sent_bytes": sent}


async def attack(args: argparse.Namespace) -> dict[str, Any]:
    name = args.attack
    if name == "message-first":
        return await _raw(args.address, HEADER.pack(messages.FrameKind.MESSAGE, 0))
    if name == "huge-handshake":
        return await _raw(args.address, HEADER.pack(messages.FrameKind.HANDSHAKE, 1 << 40))
    if name == "garbage":
        return await _raw(args.address, np.random.default_rng(7).bytes(4096))
    if name == "old-version":  # a wire-2 envelope
        envelope = msgpack.packb({"wire_version": 2, "compat_hash": b"", "body": b""})
        return await _raw(args.address, frame(messages.FrameKind.HANDSHAKE, envelope))
    if name == "no-secret":
        stream = await _connect(args.address)
        try:
            await _handshake(args, None).connector(
                stream, FrameReader(stream), lambda address: _hello(args, address)
            )
        except Exception as exc:
            return {"outcome": f"refused: {type(exc).__name__}: {exc}"}
        return {"outcome": "accepted"}
    if name == "wrong-secret":  # a proof under another key, sent without checking the target's
        stream = await _connect(args.address)
        reader = FrameReader(stream)
        nonce = os.urandom(messages.NONCE_BYTES)
        await stream.send(
            frame(
                messages.FrameKind.HANDSHAKE,
                wire.encode(messages.Greeting(wire.TRANSPORT_PROTOCOL_VERSION, nonce, True)),
            )
        )
        _kind, body = await read_frame(reader, 1 << 20)
        challenge = wire.decode(body, messages.Challenge)
        proof = hmac.new(b"not the secret", nonce + challenge.nonce, hashlib.sha256).digest()
        hello = wire.encode(_hello(args, 0))
        await stream.send(
            frame(messages.FrameKind.HANDSHAKE, wire.encode(messages.Credentials(proof, b"")))
            + frame(messages.FrameKind.HANDSHAKE, hello)
        )
        return {"outcome": await _outcome(stream)}
    if name == "replay":
        return await _replay(args)
    if name == "region-overflow":
        region = messages.RegionInfo.__new__(
            messages.RegionInfo
        )  # past the validator, as a peer's bytes would be
        object.__setattr__(region, "address", (1 << 64) - 16)
        object.__setattr__(region, "length", 1 << 20)
        object.__setattr__(region, "device", "cpu")
        stream, outcome = await _handshaken(args, regions=(region,))
        return {"outcome": outcome if outcome != "accepted" else await _outcome(stream)}
    if name == "nixl-blob":
        blob = b"KVFN1" + msgpack.packb({"nixl": 1 << 60, "ipc": [], "host": [[1 << 63, 1 << 63]]})
        stream, outcome = await _handshaken(args, backend=blob)
        return {"outcome": outcome if outcome != "accepted" else await _outcome(stream)}
    if name == "pid-replay":  # claim the target's pid, pointing at a proof of another connection of its
        stream, outcome = await _handshaken(args, pid=args.claim_pid, pid_proof_address=args.claim_address)
        print(json.dumps({"outcome": outcome}), flush=True)
        await anyio.sleep(args.seconds)  # connected while the target looks at us
        return {"outcome": outcome}
    if name == "flood-notify":
        return await _flood(args, messages.FrameKind.NOTIFY, 1 << 20)
    if name == "flood-messages":
        return await _flood(args, messages.FrameKind.MESSAGE, 8 << 20)
    if name == "many-refusals":
        outcomes: dict[str, int] = {}
        for _ in range(args.count):
            stream = await _connect(args.address)
            await stream.send(frame(messages.FrameKind.HANDSHAKE, b"\xc1"))
            got = (await _outcome(stream)).split(":")[0]
            outcomes[got] = outcomes.get(got, 0) + 1
            await stream.aclose()
        return {"outcome": "done", "outcomes": outcomes}
    if name == "hold-connections":  # open many, say nothing, hold them
        streams = []
        for _ in range(args.count):
            try:
                streams.append(await _connect(args.address))
            except OSError as exc:
                return {"outcome": f"connect failed: {exc}", "opened": len(streams)}
        closed = 0
        with anyio.move_on_after(args.seconds):
            for stream in streams:
                if await _outcome(stream, 0.05) == "closed":
                    closed += 1
            await anyio.sleep(args.seconds)
        return {"outcome": "held", "opened": len(streams), "closed_at_once": closed}
    raise SystemExit(f"unknown attack {name}")


async def _replay(args: argparse.Namespace) -> dict[str, Any]:
    """Record a handshake made with the secret, then send its frames again on a new connection."""
    recorded: list[bytes] = []

    class Recorder:
        def __init__(self, stream: ByteStream) -> None:
            self.stream = stream

        async def send(self, data: bytes) -> None:
            recorded.append(data)
            await self.stream.send(data)

        def extra(self, attribute: Any, default: Any = None) -> Any:
            return self.stream.extra(attribute, default)

    stream = await _connect(args.address)
    recorder = Recorder(stream)
    with contextlib.suppress(PeerIncompatible):  # (local refuses other processes, after the proofs)
        await _handshake(args, _secret(args)).connector(
            recorder,  # type: ignore[arg-type]
            FrameReader(stream),
            lambda address: _hello(args, address),
        )
    await stream.aclose()
    again = await _connect(args.address)
    reader = FrameReader(again)
    await again.send(recorded[0])  # the old greeting
    with anyio.fail_after(5):
        await read_frame(reader, 1 << 20)  # a new challenge
    await again.send(recorded[1])  # the old credentials and hello
    return {"outcome": await _outcome(again), "recorded": len(recorded)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("attack")
    parser.add_argument("address")
    parser.add_argument("--transport", default="nixl")
    parser.add_argument("--secret-env", action="store_true", help=f"authenticate with ${SECRET_ENV}")
    parser.add_argument("--megabytes", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--claim-pid", type=int, default=0)
    parser.add_argument("--claim-address", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()

    async def run() -> dict[str, Any]:
        with anyio.fail_after(DEADLINE):
            return await attack(args)

    result = anyio.run(run)
    result.update(attack=args.attack, seconds=round(time.perf_counter() - started, 3))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
