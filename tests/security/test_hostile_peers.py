"""Hostile peers against a bare listening transport: each attack runs in a process of its own
(tests/support/hostile.py); afterwards the transport still serves an honest peer (handshake, messages both
ways, a write that lands byte for byte), its descriptors are back where they were, and what the attack could
make it hold stayed under its caps."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from anyio.abc import ByteReceiveStream

from kvferry.errors import AuthenticationFailed, ConfigError
from kvferry.transports import PeerAttribute, Transport, get_transport
from kvferry.transports.handshake import SECRET_ENV, load_secret, new_secret
from kvferry.transports.limits import ChannelLimits
from tests.support import SUPPORT
from tests.support.attacks import SECRET, hostile, hostile_argv, hostile_env, rss_bytes, seen_by

pytestmark = pytest.mark.anyio

TRANSPORTS = ["nixl", "ucx", "local"]
#: small caps, so that a flood shows them
LIMITS = ChannelLimits(
    max_pending_handshakes=8,
    max_unaccepted_peers=4,
    max_peer_buffered_bytes=8 << 20,
    max_buffered_bytes=32 << 20,
)
MiB = 1 << 20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def limit_leaving(free: int) -> int:
    """The descriptor limit under which exactly ``free`` numbers are unused (a new descriptor takes the lowest)."""
    in_use = {int(name) for name in os.listdir("/proc/self/fd")}
    limit = 0
    while limit - len([fd for fd in in_use if fd < limit]) < free:
        limit += 1
    return limit


async def read_all(stream: ByteReceiveStream | None, into: dict[str, bytes], key: str) -> None:
    assert stream is not None
    chunks = [chunk async for chunk in stream]
    into[key] = b"".join(chunks)


@asynccontextmanager
async def target(name: str, *, secret: bytes | None = SECRET, **options: Any) -> AsyncIterator[Transport]:
    async with get_transport(name)(secret=secret, limits=LIMITS, **options) as transport:
        yield transport


async def serves_an_honest_peer(transport: Transport, name: str, secret: bytes | None = SECRET) -> None:
    """An honest peer (this process) connects, talks both ways and writes 1 MiB that lands byte for byte."""
    with anyio.fail_after(30):
        async with get_transport(name)(secret=secret) as honest:
            peer = await honest.connect(transport.address)
            accepted = await transport.accept()
            while accepted.extra(PeerAttribute.instance_id) != honest.instance_id:  # type: ignore[attr-defined]
                await accepted.aclose()  # an attacker's peer that is still connected (it authenticated)
                accepted = await transport.accept()
            src = torch.arange(MiB, dtype=torch.uint8)
            dst = torch.zeros(MiB, dtype=torch.uint8)
            await honest.register(src)
            await transport.grant(accepted, await transport.register(dst))
            await transport.send_message(accepted, b"ready")
            assert await honest.receive_message(peer) == b"ready"
            await honest.write(peer, [[src.data_ptr(), MiB]], [[dst.data_ptr(), MiB]], b"landed")
            assert await transport.receive_notification(accepted) == b"landed"
            assert torch.equal(src, dst)
            await peer.aclose()
            await accepted.aclose()


ATTACKS = {
    # attack: (the outcome the hostile peer must see, whether it holds the secret)
    "message-first": (("refused", "closed"), False),
    "huge-handshake": (("refused", "closed"), False),
    "garbage": (("refused", "closed"), False),
    "old-version": (("refused: peer speaks wire version 2",), False),
    "no-secret": (("refused: AuthenticationFailed",), False),
    "wrong-secret": (("refused: authentication failed",), False),
    "replay": (("refused: authentication failed",), True),
    "region-overflow": (("refused",), True),
}


@pytest.mark.parametrize("name", TRANSPORTS)
@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_an_attack_costs_only_its_own_connection(name: str, attack: str) -> None:
    expected, with_secret = ATTACKS[attack]
    async with target(name) as transport:
        before = open_fds()
        seen = await hostile(attack, transport.address, secret=with_secret)
        assert seen["outcome"].startswith(expected), seen
        stats = transport.statistics()
        assert stats.refused_connections >= 1 and stats.peers == 0 and stats.pending_handshakes == 0
        await serves_an_honest_peer(transport, name)
        assert open_fds() <= before


async def test_a_nixl_blob_with_huge_numbers_is_refused() -> None:
    async with target("nixl") as transport:
        seen = await hostile("nixl-blob", transport.address, secret=True)
        assert seen["outcome"].startswith("refused"), seen
        await serves_an_honest_peer(transport, "nixl")


@pytest.mark.parametrize("name", ["nixl", "ucx"])
async def test_a_claimed_pid_is_not_believed_on_a_proof_of_another_connection(name: str) -> None:
    """A peer claims to be this process and points at this process's own pid proof of another connection:
    the proof is bound to its connection (nonces, endpoints, hello), so the claim fails, and the peer gets no
    same-host copies. Without a secret, where nothing else vouches for a peer."""
    async with target(name, secret=None) as transport, get_transport(name)() as honest:
        peer = await honest.connect(transport.address)
        accepted = await transport.accept()
        # its proof holds
        assert accepted.same_host  # type: ignore[attr-defined]
        for proof in (peer.proof, accepted.proof):  # type: ignore[attr-defined]
            liars: list[Any] = []

            async def accept_the_liar(into: list[Any]) -> None:
                with anyio.fail_after(30):
                    into.append(await transport.accept())

            async with anyio.create_task_group() as tg:
                tg.start_soon(accept_the_liar, liars)
                seen = await hostile(
                    "pid-replay",
                    transport.address,
                    *("--claim-pid", str(os.getpid()), "--claim-address", str(proof.ctypes.data)),
                    *("--seconds", "2"),
                )
            assert seen["outcome"] == "accepted", seen
            assert not liars[0].same_host and not liars[0].same_process


@pytest.mark.parametrize("name", ["nixl", "ucx"])
@pytest.mark.parametrize("attack", ["flood-notify", "flood-messages"])
async def test_a_flood_from_a_peer_nobody_accepts_stays_under_the_caps(name: str, attack: str) -> None:
    """An authenticated peer that nobody accepts sends 256 MiB of notifications or messages: the transport
    holds at most its per-peer cap (plus one item), the peer is slowed down (backpressure) instead, and
    memory does not grow by the flood."""
    async with target(name) as transport:
        rss = rss_bytes()
        seen = await hostile(attack, transport.address, "--megabytes", "256", "--seconds", "3", secret=True)
        assert seen["outcome"] == "accepted", seen
        stats = transport.statistics()
        assert stats.buffered_bytes <= LIMITS.max_peer_buffered_bytes + 8 * MiB
        assert seen["sent_bytes"] < 128 * MiB  # the socket stopped taking bytes long before
        assert rss_bytes() - rss < LIMITS.max_buffered_bytes + 64 * MiB
        await serves_an_honest_peer(transport, name)


@pytest.mark.parametrize("name", TRANSPORTS)
async def test_refused_handshakes_leak_no_descriptor(name: str) -> None:
    async with target(name) as transport:
        before = open_fds()
        seen = await hostile("many-refusals", transport.address, "--count", "300")
        assert sum(seen["outcomes"].values()) == 300, seen
        with anyio.fail_after(5):
            while open_fds() > before:  # noqa: ASYNC110  (the last sockets close as their tasks end)
                await anyio.sleep(0.01)
        assert transport.statistics().refused_connections >= 300
        await serves_an_honest_peer(transport, name)


async def test_handshakes_beyond_the_cap_are_closed_at_once() -> None:
    async with target("local") as transport:
        seen = await hostile("hold-connections", transport.address, "--count", "40", "--seconds", "1")
        assert seen["opened"] == 40 and seen["closed_at_once"] >= 40 - LIMITS.max_pending_handshakes, seen
        with anyio.fail_after(5):
            while transport.statistics().pending_handshakes:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        await serves_an_honest_peer(transport, "local")


async def test_running_out_of_descriptors_does_not_end_the_listener() -> None:
    """With the descriptor limit just above what is open, a peer opening many connections makes accept fail
    (EMFILE); the listener waits and goes on, and serves once descriptors are free again."""
    async with target("local") as transport:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        argv = hostile_argv("hold-connections", transport.address, "--count", "30", "--seconds", "1")
        # the attacker starts first (spawning needs descriptors of its own); the limit drops before it connects
        async with await anyio.open_process(argv, env=hostile_env()) as process:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit_leaving(3), hard))
            try:
                with anyio.fail_after(60):
                    output: dict[str, bytes] = {}
                    async with anyio.create_task_group() as group:
                        group.start_soon(read_all, process.stdout, output, "stdout")
                        group.start_soon(read_all, process.stderr, output, "stderr")
                    await process.wait()
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        seen = seen_by(process.returncode, output["stdout"], output["stderr"])
        assert seen["opened"] == 30, seen
        assert transport.statistics().accept_errors >= 1
        await serves_an_honest_peer(transport, "local")


@pytest.mark.parametrize("name", ["nixl", "ucx"])
async def test_a_peer_without_the_secret_or_with_another_is_refused(name: str) -> None:
    async with target(name) as transport:
        for secret in (None, new_secret()):
            async with get_transport(name)(secret=secret) as other:
                with pytest.raises(AuthenticationFailed):
                    await other.connect(transport.address)
        assert transport.statistics().peers == 0
        await serves_an_honest_peer(transport, name)


async def test_an_unauthenticated_transport_may_not_listen_beyond_loopback() -> None:
    with pytest.raises(ConfigError, match="without a shared secret"):
        get_transport("local")(host="0.0.0.0")
    get_transport("local")(host="0.0.0.0", secret=SECRET)  # with one it may
    get_transport("local")(host="::1")


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"a" * 32 + b"\n")
    path.chmod(0o600)
    assert load_secret(path, environ={}) == b"a" * 32
    assert load_secret(environ={"KVFERRY_SECRET_FILE": str(path)}) == b"a" * 32
    assert load_secret(environ={SECRET_ENV: "b" * 20}) == b"b" * 20
    assert load_secret(environ={}) is None
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(environ={SECRET_ENV: "short"})
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret(tmp_path / "missing", environ={})


def test_hostile_program_runs() -> None:
    """The hostile peer imports nothing it should not need (a quick check that it starts)."""
    done = subprocess.run(
        [sys.executable, str(SUPPORT / "hostile.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "attack" in done.stdout
