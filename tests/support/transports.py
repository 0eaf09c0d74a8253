"""What the transport suites share: the transports under test, a peer to talk to (another process for nixl and
ucx, this process for local), buffers with known contents, and a loop-lag monitor."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import torch

from kvferry.tools import peer_process
from kvferry.transports import (
    Peer,
    Transport,
    get_transport,
)
from kvferry.transports.indexed import IndexedRows
from tests.support import SUPPORT
from tests.support.transport_peer import PeerServer

TRANSPORTS = ["nixl", "ucx", "local"]


#: variants some tests also run: (transport, options of the test's own transport)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # ucx between processes of one host, through UCX messages instead of reading the writer's memory
    "ucx-messages": ("ucx", {"host_cma": False}),
}


def variant(name: str) -> tuple[str, dict[str, Any]]:
    """The transport a test parameter names, and the options its own side is started with."""
    return VARIANTS.get(name, (name, {}))


class PeerProcess(peer_process.PeerProcess):
    """A transport in another process, driven over stdin/stdout (tests/support/transport_peer.py: the
    library's peer protocol with the test operations); error replies come back as they are."""

    def __init__(self, name: str, *args: str, device: str = "cpu") -> None:
        program = [sys.executable, str(SUPPORT / "transport_peer.py"), name, "--device", device, *args]
        super().__init__(name, device=device, argv=program, cwd=str(SUPPORT.parents[1]))
        self.pid: int = self.info["pid"]

    def _result(self, result: dict[str, Any]) -> dict[str, Any]:
        return result  # the tests read {"error": ...} replies themselves

    async def call(self, **cmd: Any) -> dict[str, Any]:
        with anyio.fail_after(60):
            return await super().call(**cmd)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class InProcessPeer:
    """The same commands, served by a second transport in this process (for ``local``)."""

    def __init__(self, transport: Transport, server: PeerServer) -> None:
        self.transport = transport
        self.server = server
        self.address = transport.address

    async def call(self, **cmd: Any) -> dict[str, Any]:
        with anyio.fail_after(60):
            return await self.server.handle(cmd)


Remote = PeerProcess | InProcessPeer


class LoopLag:
    """Measures how long the event loop stays away from a task that sleeps ``interval`` seconds at a time.

    Two figures: ``max_blocked`` counts the CPU time the loop's thread spent in one such gap (code running on
    the loop instead of yielding), ``max_lag`` the wall time. On this 2-core VM the OS deschedules the whole
    process for tens of ms whenever the peer process and worker threads are busy, which is not the loop being
    blocked; so the 50 ms bound applies to ``max_blocked``, and wall time only has to stay under 0.5 s (which
    catches a blocking wait on I/O, where the thread sleeps).
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.max_lag = 0.0
        self.max_blocked = 0.0

    def reset(self) -> None:
        """Start measuring now (setup, such as starting a transport and importing a library, is not counted)."""
        self.max_lag = self.max_blocked = 0.0

    async def run(self) -> None:
        while True:
            start, cpu = time.perf_counter(), time.thread_time()
            await anyio.sleep(self.interval)
            self.max_lag = max(self.max_lag, time.perf_counter() - start - self.interval)
            self.max_blocked = max(self.max_blocked, time.thread_time() - cpu)


def our_tasks() -> set[asyncio.Task[Any]]:
    """Tasks still alive that are not the test's own and not UCXX's per-loop progress tasks."""
    current = asyncio.current_task()
    return {
        t
        for t in asyncio.all_tasks()
        if t is not current and not any(s in repr(t.get_coro()) for s in ("ucxx", "_progress", "TestRunner"))
    }


def sha(data: bytes | np.ndarray) -> str:
    return hashlib.sha256(data if isinstance(data, bytes) else np.ascontiguousarray(data).data).hexdigest()


@asynccontextmanager
async def connected(name: str, remote: Remote, **options: object) -> AsyncIterator[tuple[Transport, Peer]]:
    """A transport of ``name`` (or of a variant's, with its options) connected to ``remote``."""
    name, defaults = variant(name)
    async with get_transport(name)(**{**defaults, **options}) as transport:
        peer = await transport.connect(remote.address)
        yield transport, peer
        assert transport.statistics().writes_in_flight == 0


async def remote_buffer(
    transport: Transport, peer: Peer, remote: Remote, name: str, size: int, guard: int = 0
) -> int:
    """A zeroed buffer of the peer, registered (``guard`` unregistered bytes on each side), and its address."""
    address: int = (await remote.call(op="alloc", name=name, size=size, guard=guard))["address"]
    # The peer announces the region on the control channel after registering it: ordered with its regions.
    assert b"registered" in await transport.receive_message(peer)
    return address


def random_tensor(size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


async def arandom(size: int, seed: int = 0) -> torch.Tensor:
    """Off the event loop: making 64 MiB of random bytes takes longer than the loop may be blocked."""
    return await anyio.to_thread.run_sync(random_tensor, size, seed)


async def asha(data: bytes | np.ndarray) -> str:
    return await anyio.to_thread.run_sync(sha, data)


def swapped_halves(src: int, dst: int, page: int, positions: int, dst_limit: int) -> IndexedRows:
    """A template of two rows per position: the first half of source page ``src_ids[j]`` to the second half of
    destination page ``dst_ids[j]``, and the second half to the first."""
    half = page // 2
    j = np.repeat(np.arange(positions), 2)
    first = np.tile([0, half], positions)
    return IndexedRows(
        src_slot=j,
        src_base=src + first,
        src_stride=np.full(2 * positions, page),
        dst_slot=j,
        dst_base=dst + (half - first),
        dst_stride=np.full(2 * positions, page),
        length=np.full(2 * positions, half),
        src_limit=np.full(positions, positions),
        dst_limit=np.full(positions, dst_limit),
    )


def swap_halves(data: np.ndarray, page: int) -> np.ndarray:
    pages = data.reshape(-1, 2, page // 2)
    return np.ascontiguousarray(pages[:, ::-1]).reshape(-1)


@asynccontextmanager
async def local_pair(
    size: int,
) -> AsyncIterator[tuple[Transport, Peer, Transport, torch.Tensor, torch.Tensor]]:
    """Two local transports, ``a`` connected to ``b``; ``size`` random bytes registered on ``a`` and zeros on
    ``b``, which ``a`` knows of. Yields (a, a's peer, b, source, destination)."""
    async with get_transport("local")() as a, get_transport("local")() as b:
        pa = await a.connect(b.address)
        pb = await b.accept()
        src, dst = random_tensor(size), torch.zeros(size, dtype=torch.uint8)
        await a.register(src)
        await b.grant(pb, await b.register(dst))
        await b.send_message(pb, b"registered")
        await a.receive_message(pa)
        yield a, pa, b, src, dst
