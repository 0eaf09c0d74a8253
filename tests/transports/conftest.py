"""Fixtures for the transport suite: a peer to talk to (another process for nixl/ucx, the same process for
local), a loop-lag monitor, and a leak check."""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest

from kvferry.tools import peer_process
from kvferry.transports import Transport, available_transports, get_transport
from tests.support import SUPPORT
from tests.support.transport_peer import PeerServer, set_ucx_test_env

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


@pytest.fixture(scope="module")
def peer_processes() -> Iterator[dict[str, PeerProcess]]:
    """One peer process per cross-process transport, shared by a module's tests (starting one costs seconds)."""
    started: dict[str, PeerProcess] = {}
    yield started
    for proc in started.values():
        proc.close()


@pytest.fixture(params=TRANSPORTS)
def transport_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
async def remote(transport_name: str, peer_processes: dict[str, PeerProcess]) -> AsyncIterator[Remote]:
    transport_name = variant(transport_name)[0]
    if transport_name == "local":
        async with get_transport("local")() as transport, anyio.create_task_group() as tg:
            server = PeerServer(transport, "cpu")
            tg.start_soon(server.accept_forever)
            yield InProcessPeer(transport, server)
            tg.cancel_scope.cancel()
        return
    missing = available_transports()[transport_name]
    if missing is not None:
        pytest.skip(missing)
    proc = peer_processes.get(transport_name)
    if proc is None or proc.proc.poll() is not None:
        proc = peer_processes[transport_name] = await anyio.to_thread.run_sync(PeerProcess, transport_name)
    yield proc


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


@pytest.fixture
async def loop_lag() -> AsyncIterator[LoopLag]:
    """Fails the test if the event loop was blocked for more than 50 ms after the test called ``reset()``."""
    lag = LoopLag()
    # A full collection of pytest's and torch's heap takes ~100 ms here and may fall on any allocation; that is
    # not the transport blocking the loop, so the long-lived heap is frozen out of collection meanwhile.
    gc.collect()
    gc.freeze()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lag.run)
        yield lag
        tg.cancel_scope.cancel()
    gc.unfreeze()
    assert lag.max_blocked < 0.05, f"event loop blocked for {lag.max_blocked * 1e3:.1f} ms of CPU"
    assert lag.max_lag < 0.5, f"event loop away for {lag.max_lag * 1e3:.1f} ms"


def our_tasks() -> set[asyncio.Task[Any]]:
    """Tasks still alive that are not the test's own and not UCXX's per-loop progress tasks."""
    current = asyncio.current_task()
    return {
        t
        for t in asyncio.all_tasks()
        if t is not current and not any(s in repr(t.get_coro()) for s in ("ucxx", "_progress", "TestRunner"))
    }


@pytest.fixture(autouse=True)
def _ucx_env() -> None:
    set_ucx_test_env()
