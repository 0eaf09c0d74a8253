"""The control channel's handshake: wire version, mutual authentication, compatibility and the pid proof.

Six frames, each bounded before it is read::

    connector                                               acceptor
      Greeting(version, Nc, authenticated)          -->                          (a few dozen bytes)
                                                    <--  Challenge(version, Na, Pa)
      checks Pa = MAC(K, "acceptor", Nc, Na)
      Credentials(Pc, compat hash), Hello_c         -->
                                                         checks Pc = MAC(K, "connector", Nc, Na), then the
                                                         compat hash; only then reads and decodes Hello_c
                                                         and reads the connector's pid proof
                                                    <--  Welcome(compat hash), Hello_a
      checks the compat hash, reads and decodes
      Hello_a and reads the acceptor's pid proof

``K`` is the shared secret (HMAC-SHA256; the secret itself never crosses the wire, and since both nonces are fresh
per connection no proof can be replayed). Either side refuses a peer that does not hold the secret, or that does
not authenticate while it does; a hello, and with it every piece of registration metadata (NIXL agent metadata,
region tables, UCX worker addresses), goes only to a peer that has proven it holds the secret. Without a secret
(allowed only on loopback addresses, see :func:`check_listen_address`) the MACs are empty and any local process
may connect: then the transport's grants and checks are what stand between a peer and our memory.

The pid proof. A peer of this host may be written by the kernel's ``process_vm_writev``/``process_vm_readv`` by pid
instead of through NIXL or UCX, which is only safe if the peer is the process it names. Each side writes, in a
buffer of its own kept for this connection alone, ``MAC(K, "pid <role>", Nc, Na, endpoints, hello)`` (the hello
it sends, whose ``pid_proof_address`` names the buffer; the connection's two TCP endpoints), and the other side
reads it there. A peer cannot know that value in another process's memory: a process only writes proofs of its own
connections, whose nonces include a fresh one of its own, whose endpoints are its own sockets and whose hello is
its own. So a relayed or replayed handshake never proves a pid. A peer whose proof does not hold is treated as
another host's, and its writes go through the library.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import ssl
import stat
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgpack
import numpy as np
import numpy.typing as npt
from anyio.abc import ByteStream, SocketAttribute
from attrs import frozen

from kvferry import wire
from kvferry.errors import AuthenticationFailed, ConfigError, PeerIncompatible, WireFormatError
from kvferry.transports import _cma
from kvferry.transports._framing import FrameReader, frame, read_frame
from kvferry.transports.messages import (
    NONCE_BYTES,
    Challenge,
    Credentials,
    FrameKind,
    Greeting,
    Hello,
    Refusal,
    Welcome,
)

__all__ = [
    "MIN_SECRET_BYTES",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "STEP_BYTES",
    "Handshake",
    "Introduction",
    "TlsConfig",
    "check_listen_address",
    "is_loopback",
    "load_secret",
    "new_secret",
    "pid_namespace",
]

log = logging.getLogger("kvferry.transports")

T = TypeVar("T")

#: the environment variable holding the shared secret itself (its UTF-8 bytes)
SECRET_ENV = "KVFERRY_SECRET"
#: the environment variable naming a file that holds the shared secret
SECRET_FILE_ENV = "KVFERRY_SECRET_FILE"
#: a shorter secret is refused
MIN_SECRET_BYTES = 16
#: the Greeting and the Challenge frames are at most this long (they carry two small fields each)
STEP_BYTES = 1024
#: how long a refusal may take to send before the connection is simply closed
REFUSAL_SECONDS = 1.0

_LABEL = b"kvferry/3 "
_AUTHENTICATION_FAILED = "authentication failed"
_PROOF_BYTES = 32


def new_secret() -> bytes:
    """A fresh random secret of 256 bits, as 64 hex digits (so it can travel in ``$KVFERRY_SECRET`` to engines
    started together, e.g. a context engine the CLI starts itself)."""
    return secrets.token_hex(32).encode()


def load_secret(
    path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None
) -> bytes | None:
    """The shared secret: the file ``path`` (``--secret-file``), else the file named by ``$KVFERRY_SECRET_FILE``,
    else ``$KVFERRY_SECRET``; None when none is given. A file's trailing newline is not part of the secret.

    :raises ~kvferry.errors.ConfigError: the file cannot be read, or the secret is shorter than
        :data:`MIN_SECRET_BYTES`.
    """
    env = os.environ if environ is None else environ
    where: str
    if path is None and env.get(SECRET_FILE_ENV):
        path = env[SECRET_FILE_ENV]
    if path is not None:
        where = f"secret file {os.fspath(path)}"
        try:
            info = os.stat(path)
            secret = Path(path).read_bytes().rstrip(b"\r\n")
        except OSError as exc:
            raise ConfigError(f"cannot read the {where}: {exc.strerror or exc}") from exc
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("the %s is readable by other users (chmod 600 it)", where)
    elif env.get(SECRET_ENV):
        where, secret = f"${SECRET_ENV}", env[SECRET_ENV].encode()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the {where} holds {len(secret)} bytes; a secret needs at least {MIN_SECRET_BYTES}"
        )
    return secret


def is_loopback(host: str) -> bool:
    """``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen_address(host: str, secret: bytes | None) -> None:
    """Refuse to listen beyond loopback without a secret: anyone who can reach the port could connect.

    :raises ~kvferry.errors.ConfigError: ``host`` is not a loopback address and there is no secret.
    """
    if secret is None and not is_loopback(host):
        raise ConfigError(
            f"refusing to listen on {host} without a shared secret: give one (--secret-file, ${SECRET_FILE_ENV} "
            f"or ${SECRET_ENV}), or listen on 127.0.0.1"
        )


class _VersionMismatch(PeerIncompatible):
    """Another wire version: said to any peer (it helps whoever upgrades one side and reveals nothing)."""


@frozen
class TlsConfig:
    """TLS for the control channel (the standard library's :mod:`ssl`): ``server`` wraps the connections we
    accept, ``client`` those we open. The handshake still authenticates by the shared secret inside TLS; TLS adds
    confidentiality and integrity for everything after it (a MAC'd handshake alone does not protect the frames
    that follow from a party on the network path)."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def from_files(cls, certificate: str, key: str, ca: str) -> TlsConfig:
        """Both sides from PEM files: our certificate and key, and the CA that signed the peers' (each side
        presents its certificate and checks the other's).

        :raises ~kvferry.errors.ConfigError: a file cannot be read or does not hold what it should.
        """
        try:
            server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
            server.load_cert_chain(certificate, key)
            server.verify_mode = ssl.CERT_REQUIRED
            client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
            client.load_cert_chain(certificate, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot set up TLS from {certificate}, {key} and {ca}: {exc}") from exc
        return cls(server, client)


@frozen
class Introduction:
    """What a handshake established about the peer."""

    hello: Hello
    #: on this host, in this pid namespace, and shown to be process ``hello.pid``
    same_host: bool
    #: our pid proof for this connection: keep it alive as long as the connection
    proof: npt.NDArray[np.uint8]
    #: the peer proved it holds our secret (False: we have none)
    authenticated: bool


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, _LABEL + label, hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def _endpoint(value: Any) -> bytes:
    """A socket address as bytes (``host:port``)."""
    if isinstance(value, tuple) and len(value) >= 2:
        return f"{value[0]}:{value[1]}".encode()
    return str(value).encode()


def pid_namespace() -> int:
    """This process's pid namespace (0 where it cannot be known)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class Handshake:
    """One transport's side of every handshake: its secret, compatibility hash and limits.

    :param name: the transport's name; a peer of another transport is refused
    :param secret: the shared secret, or None (no authentication; loopback only)
    :param compat_hash: compared with the peer's; another is refused
    :param max_bytes: limit of the hello frames (region table, backend metadata)
    """

    def __init__(
        self,
        *,
        name: str,
        secret: bytes | None,
        compat_hash: bytes,
        max_bytes: int,
    ) -> None:
        self.name = name
        self._secret = secret
        self._key = secret or b""
        self._compat_hash = compat_hash
        self.max_bytes = max_bytes

    @property
    def authenticates(self) -> bool:
        return self._secret is not None

    # --- the two sides ---------------------------------------------------------------------------------

    async def connector(
        self, stream: ByteStream, reader: FrameReader, hello_at: Callable[[int], Hello]
    ) -> Introduction:
        """Run the connector's side. ``hello_at(address)`` builds our hello with our pid proof at ``address``.

        :raises ~kvferry.errors.AuthenticationFailed: the peer does not hold our secret, or we lack its.
        :raises ~kvferry.errors.PeerIncompatible: the peer refused us, or speaks another version, transport or
            model.
        :raises ~kvferry.errors.WireFormatError: the peer sent something that is not a step of the handshake.
        """
        nc = secrets.token_bytes(NONCE_BYTES)
        greeting = Greeting(wire.TRANSPORT_PROTOCOL_VERSION, nc, self.authenticates)
        await stream.send(frame(FrameKind.HANDSHAKE, wire.encode(greeting)))
        challenge = await self._step(reader, Challenge, STEP_BYTES)
        if challenge.wire_version != wire.TRANSPORT_PROTOCOL_VERSION:
            raise _VersionMismatch(
                f"peer speaks wire version {challenge.wire_version}, we speak {wire.TRANSPORT_PROTOCOL_VERSION}"
            )
        na = challenge.nonce
        if self._secret is not None:
            if not challenge.proof:
                raise AuthenticationFailed("the peer does not authenticate, and we hold a secret")
            if not hmac.compare_digest(challenge.proof, _mac(self._key, b"acceptor", nc, na)):
                raise AuthenticationFailed("the peer does not hold our secret")
        endpoints = self._endpoints(stream, connector=True)
        proof, hello_bytes = self._hello(hello_at, b"pid connector", nc, na, endpoints)
        credentials = Credentials(
            _mac(self._key, b"connector", nc, na) if self._secret is not None else b"", self._compat_hash
        )
        await stream.send(
            frame(FrameKind.HANDSHAKE, wire.encode(credentials)) + frame(FrameKind.HANDSHAKE, hello_bytes)
        )
        welcome = await self._step(reader, Welcome, STEP_BYTES)
        self._check_compat(welcome.compat_hash)
        peer_hello = await self._hello_frame(reader)
        hello = self._peer_hello(peer_hello)
        same_host = self._proves_pid(hello, _mac(self._key, b"pid acceptor", nc, na, endpoints, peer_hello))
        return Introduction(hello, same_host, proof, self._secret is not None)

    async def acceptor(
        self,
        stream: ByteStream,
        reader: FrameReader,
        hello_at: Callable[[int], Hello],
        admit: Callable[[Introduction], Awaitable[None]],
    ) -> Introduction:
        """Run the acceptor's side; ``admit`` may refuse the peer (raise PeerIncompatible) before our hello is sent.
        Whatever is refused is answered with a :class:`~kvferry.transports.Refusal` (bounded in time) and
        raised; a peer that has not authenticated learns only that it was refused.

        :raises ~kvferry.errors.AuthenticationFailed: the peer does not hold our secret, or does not authenticate.
        :raises ~kvferry.errors.PeerIncompatible: another version, transport or model, or ``admit`` refused it.
        :raises ~kvferry.errors.WireFormatError: a step that does not decode, or is larger than allowed.
        """
        authenticated = False
        try:
            greeting = await self._step(reader, Greeting, STEP_BYTES, first=True)
            if greeting.wire_version != wire.TRANSPORT_PROTOCOL_VERSION:
                raise _VersionMismatch(
                    f"peer speaks wire version {greeting.wire_version}, we speak {wire.TRANSPORT_PROTOCOL_VERSION}"
                )
            if self._secret is not None and not greeting.authenticated:
                raise AuthenticationFailed("the peer does not authenticate, and we require it")
            nc, na = greeting.nonce, secrets.token_bytes(NONCE_BYTES)
            proof_a = _mac(self._key, b"acceptor", nc, na) if self._secret is not None else b""
            challenge = Challenge(wire.TRANSPORT_PROTOCOL_VERSION, na, proof_a)
            await stream.send(frame(FrameKind.HANDSHAKE, wire.encode(challenge)))
            credentials = await self._step(reader, Credentials, STEP_BYTES)
            if self._secret is not None:
                if not hmac.compare_digest(credentials.proof, _mac(self._key, b"connector", nc, na)):
                    raise AuthenticationFailed("the peer does not hold our secret")
                authenticated = True
            self._check_compat(credentials.compat_hash)
            peer_hello = await self._hello_frame(reader)
            hello = self._peer_hello(peer_hello)
            endpoints = self._endpoints(stream, connector=False)
            same_host = self._proves_pid(
                hello, _mac(self._key, b"pid connector", nc, na, endpoints, peer_hello)
            )
            proof, hello_bytes = self._hello(hello_at, b"pid acceptor", nc, na, endpoints)
            introduction = Introduction(hello, same_host, proof, authenticated)
            await admit(introduction)
        except (PeerIncompatible, WireFormatError) as exc:
            await self._refuse(stream, exc, authenticated)
            raise
        welcome = Welcome(self._compat_hash)
        await stream.send(
            frame(FrameKind.HANDSHAKE, wire.encode(welcome)) + frame(FrameKind.HANDSHAKE, hello_bytes)
        )
        return introduction

    # --- steps ---------------------------------------------------------------------------------------------

    async def _step(self, reader: FrameReader, cls: type[T], limit: int, *, first: bool = False) -> T:
        kind, body = await read_frame(reader, limit)
        if kind == FrameKind.REFUSAL and not first:
            refusal = wire.decode(body, Refusal)
            if refusal.reason == _AUTHENTICATION_FAILED:
                raise AuthenticationFailed(
                    "refused by the peer: authentication failed (do both sides hold the same secret?)"
                )
            raise PeerIncompatible(f"refused by the peer: {refusal.reason}")
        if kind != FrameKind.HANDSHAKE:
            raise WireFormatError(f"expected a {cls.__name__} (handshake), got frame kind {kind}")
        try:
            return wire.decode(body, cls)
        except WireFormatError:
            version = _peek_version(body)
            if version is not None and version != wire.TRANSPORT_PROTOCOL_VERSION:
                raise _VersionMismatch(
                    f"peer speaks wire version {version}, we speak {wire.TRANSPORT_PROTOCOL_VERSION}"
                ) from None
            raise

    async def _hello_frame(self, reader: FrameReader) -> bytes:
        kind, body = await read_frame(reader, self.max_bytes)
        if kind != FrameKind.HANDSHAKE:
            raise WireFormatError(f"expected a hello (handshake), got frame kind {kind}")
        return body

    def _check_compat(self, theirs: bytes) -> None:
        # ours is not named: the peer may not have authenticated
        if theirs != self._compat_hash:
            raise PeerIncompatible(f"compatibility hash differs (the peer's: {theirs.hex() or 'empty'})")

    def _peer_hello(self, data: bytes) -> Hello:
        hello = wire.decode(data, Hello)
        if hello.transport != self.name:
            raise PeerIncompatible(f"peer is a {hello.transport!r} transport, we are {self.name!r}")
        return hello

    def _hello(
        self, hello_at: Callable[[int], Hello], label: bytes, nc: bytes, na: bytes, endpoints: bytes
    ) -> tuple[npt.NDArray[np.uint8], bytes]:
        """Our hello with our pid proof for this connection, and the proof's buffer (written after the hello is
        encoded: the proof covers the hello, which names the buffer)."""
        proof = np.zeros(_PROOF_BYTES, dtype=np.uint8)
        hello_bytes = wire.encode(hello_at(int(proof.ctypes.data)))
        proof[:] = np.frombuffer(_mac(self._key, label, nc, na, endpoints, hello_bytes), dtype=np.uint8)
        return proof, hello_bytes

    @staticmethod
    def _endpoints(stream: ByteStream, *, connector: bool) -> bytes:
        """The connection's two endpoints, connector's first (each side sees the same pair on one host)."""
        local = _endpoint(stream.extra(SocketAttribute.local_address, ""))
        remote = _endpoint(stream.extra(SocketAttribute.remote_address, ""))
        return local + b"|" + remote if connector else remote + b"|" + local

    @staticmethod
    def _proves_pid(hello: Hello, expected: bytes) -> bool:
        """True when process ``hello.pid`` of this host, in our pid namespace, holds ``expected`` at
        ``hello.pid_proof_address``. False where it does not, or where the kernel will not let us look."""
        if hello.hostname != socket.gethostname() or hello.pid_namespace != pid_namespace():
            return False
        if not hello.pid_proof_address or not _cma.available():
            return False
        found = np.zeros(len(expected), dtype=np.uint8)
        try:
            _cma.read(
                hello.pid,
                np.array([[hello.pid_proof_address, len(expected)]], dtype=np.uint64),
                np.array([[found.ctypes.data, len(expected)]], dtype=np.uint64),
            )
        except (OSError, ValueError, OverflowError) as exc:
            log.info(
                "cannot check that %s is pid %d (%s): treated as another host's",
                hello.address,
                hello.pid,
                exc,
            )
            return False
        if not hmac.compare_digest(found.tobytes(), expected):
            log.warning("%s says it is pid %d of this host, which it did not prove", hello.address, hello.pid)
            return False
        return True

    async def _refuse(self, stream: ByteStream, exc: Exception, authenticated: bool) -> None:
        public = authenticated or not self.authenticates or isinstance(exc, _VersionMismatch)
        reason = str(exc) if public else "refused"
        if isinstance(exc, AuthenticationFailed):
            reason = _AUTHENTICATION_FAILED
        body = wire.encode(Refusal(reason[:4096]))
        with (
            anyio.move_on_after(REFUSAL_SECONDS),
            anyio.CancelScope(shield=True),
            suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError),
        ):
            await stream.send(frame(FrameKind.REFUSAL, body))


def _peek_version(body: bytes) -> int | None:
    """The ``wire_version`` of a handshake body that is not ours, if it has one (for a useful refusal)."""
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=STEP_BYTES)
    except Exception:
        return None
    version = value.get("wire_version") if isinstance(value, dict) else None
    return version if isinstance(version, int) and 0 <= version < 1 << 32 else None
