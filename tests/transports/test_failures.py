"""Transports when things go wrong: a peer killed or closed mid-write, stalls past the deadline, writes to a gone
process, use after close, and a clean shutdown (nixl and ucx across processes, local in one)."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
import torch

from kvferry.errors import (
    ClosedResourceError,
    PeerDisconnected,
    TransferTimeout,
)
from kvferry.transports import (
    PeerState,
    TransportAttribute,
    get_transport,
    page_fragments,
)
from tests.support.transports import (
    PeerProcess,
    Remote,
    connected,
    local_pair,
    our_tasks,
    random_tensor,
    remote_buffer,
    sha,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

MiB = 1 << 20


# --- data ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport_name", ["nixl", "ucx"])
async def test_peer_killed_mid_write_then_restarted(transport_name: str) -> None:
    threads_before = set(threading.enumerate())
    proc = await anyio.to_thread.run_sync(PeerProcess, transport_name)
    restarted: PeerProcess | None = None
    try:
        async with get_transport(transport_name)() as transport:
            peer = await transport.connect(proc.address)
            size = 64 * MiB
            dst = await remote_buffer(transport, peer, proc, "big", size)
            src = random_tensor(size)
            await transport.register(src)
            frags = page_fragments(src.data_ptr(), 64 << 10, np.arange(size >> 16))
            dst_frags = page_fragments(dst, 64 << 10, np.random.default_rng(0).permutation(size >> 16))
            await transport.write(peer, frags, dst_frags)
            old_address = proc.address

            async def kill_soon() -> None:
                await anyio.sleep(0.05)
                await anyio.to_thread.run_sync(proc.kill)

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(kill_soon)
                    with pytest.raises(PeerDisconnected):
                        while True:
                            await transport.write(peer, frags, dst_frags, b"n")
                assert peer.state is PeerState.LOST
                with pytest.raises(PeerDisconnected):
                    await transport.write(peer, frags, dst_frags)
                with pytest.raises(PeerDisconnected):
                    await transport.send_message(peer, b"anyone?")
            stats = transport.statistics()
            assert (stats.peers, stats.writes_in_flight, stats.backend_handles) == (0, 0, 0), stats

            restarted = await anyio.to_thread.run_sync(PeerProcess, transport_name)
            assert restarted.address != old_address
            with anyio.fail_after(10), pytest.raises(PeerDisconnected):
                await transport.connect(old_address, timeout=2)
            peer = await transport.connect(restarted.address)
            dst = await remote_buffer(transport, peer, restarted, "big", size)
            await transport.write(peer, [[src.data_ptr(), MiB]], [[dst, MiB]], b"again")
            reply = await restarted.call(op="wait_notify", name="big", fragments=[[0, MiB]])
            assert reply["sha"] == sha(src.numpy()[:MiB].tobytes())
        assert not our_tasks()
    finally:
        proc.close()
        if restarted is not None:
            restarted.close()
    await anyio.sleep(0.1)
    leftover = {t for t in set(threading.enumerate()) - threads_before if t.is_alive()}
    assert not {t for t in leftover if not t.name.startswith(("AnyIO worker", "asyncio_"))}, leftover


async def test_local_peer_closed_mid_write() -> None:
    async with local_pair(64 * MiB) as (a, pa, b, src, dst):
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.aclose)
                with pytest.raises(PeerDisconnected):
                    while True:
                        await a.write(pa, [[src.data_ptr(), 64 * MiB]], [[dst.data_ptr(), 64 * MiB]], b"n")
        assert a.statistics().peers == 0


async def test_local_peer_closed_mid_write_many() -> None:
    """The peer goes away while combined writes run: the writes end with PeerDisconnected (none hangs; one
    whose notification went out before is reported landed), nothing stays in flight."""
    async with local_pair(64 * MiB) as (a, pa, b, src, dst):
        half = 32 * MiB
        writes = [
            ([[src.data_ptr(), half]], [[dst.data_ptr() + half, half]], b"1"),
            ([[src.data_ptr() + half, half]], [[dst.data_ptr(), half]], b"2"),
        ]
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.aclose)
                while True:
                    outcomes = await a.write_many(pa, writes)
                    if any(o is not None for o in outcomes):
                        break
        # the copy or a notification failed: every write it reached ends with the peer's error
        failed = [o for o in outcomes if o is not None]
        assert failed and all(isinstance(o, PeerDisconnected) for o in failed), outcomes
        assert a.statistics().writes_in_flight == 0 and a.statistics().peers == 0


async def test_stall_deadline(transport_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that makes no progress ends with TransferTimeout at its stall deadline, leaving nothing behind."""
    options: dict[str, object] = {} if transport_name == "local" else {"same_process": "transport"}
    if transport_name == "nixl":
        options["host_cma"] = False  # the NIXL path stalls here; test_stall_deadline_cma covers the other one
    async with get_transport(transport_name)(**options) as a, get_transport(transport_name)(**options) as b:
        pa = await a.connect(b.address)
        pb = await b.accept()
        src, dst = random_tensor(MiB), torch.zeros(MiB, dtype=torch.uint8)
        await a.register(src)
        await b.grant(pb, await b.register(dst))
        await b.send_message(pb, b"registered")
        await a.receive_message(pa)
        if transport_name == "ucx":

            async def swallow(peer: object, kind: int, body: bytes) -> None:
                pass  # the receiver never answers

            monkeypatch.setattr(b.data_path, "frame", swallow)  # type: ignore[attr-defined]
        elif transport_name == "nixl":
            monkeypatch.setattr(a.data_path._agent, "transfer", lambda handle, *args: "PROC")  # type: ignore[attr-defined]
            monkeypatch.setattr(a.data_path._agent, "check_xfer_state", lambda handle: "PROC")  # type: ignore[attr-defined]
        else:
            from kvferry.transports import _memory

            async def never(self: object, **options: object) -> None:
                await anyio.sleep_forever()

            monkeypatch.setattr(_memory.CopyPlan, "run", never)
        with anyio.fail_after(10), pytest.raises(TransferTimeout):
            await a.write(pa, [[src.data_ptr(), MiB]], [[dst.data_ptr(), MiB]], b"n", stall_timeout=0.3)
        monkeypatch.undo()
        assert a.statistics().writes_in_flight == 0
        if transport_name == "nixl":
            assert a.statistics().backend_handles in (
                1,
                4,
            )  # the remote agent (+ handles NIXL would not release)


@pytest.mark.parametrize("transport_name", ["nixl"])
async def test_stall_deadline_cma(
    transport_name: str, remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process_vm_writev slice that takes longer than the stall deadline: TransferTimeout once it returns (a
    system call is not abandoned), nothing in flight after; the next write goes through."""
    import time

    from kvferry.transports import _cma

    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(transport, peer, remote, "slow", MiB)
        src = random_tensor(MiB, seed=11)
        await transport.register(src)
        write = _cma.write

        def slow(pid: int, s: object, d: object) -> None:
            time.sleep(0.6)
            write(pid, s, d)  # type: ignore[arg-type]

        monkeypatch.setattr(_cma, "write", slow)
        with anyio.fail_after(10), pytest.raises(TransferTimeout):
            await transport.write(peer, [[src.data_ptr(), MiB]], [[dst, MiB]], b"n", stall_timeout=0.3)
        monkeypatch.undo()
        assert transport.statistics().writes_in_flight == 0
        before = transport.cma_writes  # type: ignore[attr-defined]
        await transport.write(peer, [[src.data_ptr(), MiB]], [[dst, MiB]], b"n")
        assert transport.cma_writes == before + 1  # type: ignore[attr-defined]
        digest = await remote.call(op="digest", name="slow", fragments=[[0, MiB]])
        assert digest["sha"] == sha(src.numpy().tobytes())


@pytest.mark.parametrize("transport_name", ["nixl"])
async def test_cma_write_to_a_gone_process(
    transport_name: str, remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """process_vm_writev finds no such process (the peer died): PeerDisconnected, not a retry through NIXL's
    own path, whose CMA (error handling off) would abort this process on the same call."""
    import errno

    from kvferry.transports import _cma

    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(transport, peer, remote, "gone", MiB)
        src = random_tensor(MiB, seed=12)
        await transport.register(src)

        def gone(pid: int, s: object, d: object) -> None:
            raise OSError(errno.ESRCH, f"process_vm_writev to pid {pid}: No such process")

        def through_nixl(*args: object) -> str:
            raise AssertionError("the write went on through NIXL")

        monkeypatch.setattr(_cma, "write", gone)
        monkeypatch.setattr(transport.data_path._agent, "transfer", through_nixl)  # type: ignore[attr-defined]
        with anyio.fail_after(10), pytest.raises(PeerDisconnected, match="is gone"):
            await transport.write(peer, [[src.data_ptr(), MiB]], [[dst, MiB]], b"n")
        assert not transport.data_path._cma_refused  # type: ignore[attr-defined]
        assert transport.statistics().writes_in_flight == 0


async def test_closed_right_after_start(transport_name: str) -> None:
    """A transport closed before its background tasks first ran (nothing awaited in between) closes: a task that
    starts after aclose() cancelled the others ends at once instead of keeping the task group open forever."""
    with anyio.fail_after(10):
        async with get_transport(transport_name)():
            pass
        async with get_transport(transport_name)() as transport:
            await transport.aclose()
    assert not our_tasks()


async def test_use_after_aclose(transport_name: str, remote: Remote) -> None:
    transport = get_transport(transport_name)()
    with pytest.raises(ClosedResourceError):
        _ = transport.address
    async with transport:
        peer = await transport.connect(remote.address)
        src = random_tensor(4096)
        registration = await transport.register(src)
        await peer.aclose()
        with pytest.raises(ClosedResourceError):
            await transport.send_message(peer, b"x")
        with pytest.raises(ClosedResourceError):
            await transport.write(peer, [[src.data_ptr(), 16]], [[src.data_ptr(), 16]])
        # write_many reports the error for every write (it raises nothing of its own)
        outcomes = await transport.write_many(
            peer, [([[src.data_ptr(), 16]], [[src.data_ptr(), 16]], None)] * 2
        )
        assert len(outcomes) == 2 and all(isinstance(o, ClosedResourceError) for o in outcomes)
        peer = await transport.connect(remote.address)
    assert not registration.active
    for call in (
        lambda: transport.connect(remote.address),
        lambda: transport.register(src),
        lambda: transport.send_message(peer, b"x"),
        lambda: transport.write(peer, [[src.data_ptr(), 16]], [[src.data_ptr(), 16]]),
        lambda: transport.receive_message(peer),
        lambda: transport.receive_notification(peer),
        transport.accept,
    ):
        with pytest.raises(ClosedResourceError):
            await call()
    with pytest.raises(ClosedResourceError):
        _ = transport.address
    await transport.aclose()  # idempotent


async def test_clean_shutdown(transport_name: str, remote: Remote) -> None:
    before = set(threading.enumerate())
    tasks_before = our_tasks()
    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(transport, peer, remote, "shutdown", MiB)
        src = random_tensor(MiB)
        await transport.register(src)
        await transport.write(peer, [[src.data_ptr(), MiB]], [[dst, MiB]], b"x")
        assert transport.extra(TransportAttribute.name) == transport_name
        assert repr(transport).startswith(f"<{type(transport).__name__} {transport_name}://")
        assert "connected" in repr(peer)
        waiter_done = anyio.Event()

        async def wait_forever() -> None:
            with pytest.raises(ClosedResourceError):
                await transport.receive_message(peer)
            waiter_done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_forever)
            await anyio.sleep(0.05)
            tg.start_soon(transport.aclose)  # from another task: releases everything at once
            with anyio.fail_after(2):
                await waiter_done.wait()
        assert transport.statistics().peers == 0
    stats = transport.statistics()
    assert stats._replace(writes_completed=0, bytes_written=0, messages_sent=0, messages_received=0) == type(
        stats
    )(*([0] * len(stats)))
    assert our_tasks() <= tasks_before
    await anyio.sleep(0.05)
    new_threads = {t for t in set(threading.enumerate()) - before if t.is_alive()}
    # the event loop's own worker pools (anyio's, asyncio's default executor) park idle threads for reuse
    assert not {t for t in new_threads if not t.name.startswith(("AnyIO worker", "asyncio_"))}, new_threads
