"""Fixtures for the transport suite: a peer to talk to (another process for nixl/ucx, the same process for
local), a loop-lag monitor, and a leak check."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest

from kvferry.transports import available_transports, get_transport
from tests.support.transport_peer import PeerServer, set_ucx_test_env
from tests.support.transports import (
    TRANSPORTS,
    InProcessPeer,
    LoopLag,
    PeerProcess,
    Remote,
    variant,
)


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


@pytest.fixture(autouse=True)
def _ucx_env() -> None:
    set_ucx_test_env()
