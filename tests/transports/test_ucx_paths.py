"""ucx: how a write travels. Between peers of one host with host memory on both sides the receiver reads the
writer's memory itself (``process_vm_readv``); it falls back to UCX messages where the kernel will not let it
attach, fails the write where the writer's memory is gone, tells the writer about progress so that a long read
does not trip its stall deadline, and ignores an offer that does not pair with the destination. And kvferry's
driver of the UCX worker: a connected, idle transport costs no CPU, a worker that stays busy is polled at
intervals, not on every turn of the loop. (Same-process pairs: the transports still talk through UCX.)"""

from __future__ import annotations

import asyncio
import errno
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry import wire
from kvferry.errors import PeerDisconnected, TransferTimeout, TransportError
from kvferry.transports import Peer, Transport, _cma, get_transport, messages
from kvferry.transports.messages import fragments_bytes

pytest.importorskip("ucxx")

from kvferry.transports import ucx as ucx_module  # (imports ucxx: after the skip)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

MiB = 1 << 20


@asynccontextmanager
async def pair(
    size: int, **options: Any
) -> AsyncIterator[tuple[Transport, Transport, Peer, Peer, torch.Tensor, torch.Tensor]]:
    """Writer ``a`` and receiver ``b`` in this process, connected, with ``size`` bytes registered on each side
    (random at the writer, zeros at the receiver)."""
    factory = get_transport("ucx")
    async with factory(same_process="transport", **options) as a, factory(same_process="transport") as b:
        pa = await a.connect(b.address)
        pb = await b.accept()
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
        dst = torch.zeros(size, dtype=torch.uint8)
        await a.register(src)
        await b.grant(pb, await b.register(dst))
        await b.send_message(pb, b"registered")
        await a.receive_message(pa)
        yield a, b, pa, pb, src, dst
        assert a.statistics().writes_in_flight == 0
        assert b.statistics().incoming_writes == 0


async def write_all(a: Transport, pa: Peer, src: torch.Tensor, dst: torch.Tensor, **options: Any) -> None:
    await a.write(pa, [[src.data_ptr(), src.numel()]], [[dst.data_ptr(), dst.numel()]], b"n", **options)


async def test_a_peer_of_this_host_reads_host_memory_itself() -> None:
    async with pair(3 * MiB + 5) as (a, b, pa, pb, src, dst):
        await write_all(a, pa, src, dst)
        assert await b.receive_notification(pb) == b"n"
        assert torch.equal(src, dst)
        assert (a.pulled_writes, b.cma_reads) == (1, 1)  # type: ignore[attr-defined]
    async with pair(MiB, host_cma=False) as (a, b, pa, pb, src, dst):  # the writer does not offer
        await write_all(a, pa, src, dst)
        assert await b.receive_notification(pb) == b"n"
        assert torch.equal(src, dst)
        assert (a.pulled_writes, b.cma_reads) == (0, 0)  # type: ignore[attr-defined]


async def test_a_short_read_is_answered_done_without_pulling_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read short enough to be made at once on the receiver's thread costs one reply (DONE), a longer one
    PULLING first."""
    replies: list[messages.WriteStatus] = []
    reply = ucx_module.UcxDataPath._reply

    async def recording(self: Any, peer: Any, answer: messages.WriteReply) -> None:
        replies.append(answer.status)
        await reply(self, peer, answer)

    monkeypatch.setattr(ucx_module.UcxDataPath, "_reply", recording)
    for size, expected in (
        (_cma.INLINE_BYTES, [messages.WriteStatus.DONE]),
        (_cma.INLINE_BYTES + 1, [messages.WriteStatus.PULLING, messages.WriteStatus.DONE]),
    ):
        replies.clear()
        async with pair(size) as (a, b, pa, pb, src, dst):
            await write_all(a, pa, src, dst)
            assert await b.receive_notification(pb) == b"n"
            assert torch.equal(src, dst)
            assert (a.pulled_writes, b.cma_reads) == (1, 1)  # type: ignore[attr-defined]
        assert replies == expected


async def test_refused_attach_falls_back_to_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """EPERM (ptrace policy): the write lands through UCX messages, the peer is not offered reads again."""
    calls = []

    def refused(pid: int, src: object, dst: object) -> None:
        calls.append(pid)
        raise PermissionError(errno.EPERM, "Operation not permitted")

    async with pair(2 * MiB) as (a, b, pa, pb, src, dst):
        monkeypatch.setattr(
            _cma, "read", refused
        )  # (after the handshakes, which read each other's pid proof)
        for _ in range(2):
            dst.zero_()
            await write_all(a, pa, src, dst)
            assert await b.receive_notification(pb) == b"n"
            assert torch.equal(src, dst)
        assert len(calls) == 1
        assert (a.pulled_writes, b.cma_reads) == (0, 0)  # type: ignore[attr-defined]


async def test_writer_memory_gone_fails_the_write_and_nothing_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def gone(pid: int, src: object, dst: object) -> None:
        raise OSError(errno.EFAULT, f"process_vm_readv with pid {pid} copied 0 of 4096 bytes")

    async with pair(MiB) as (a, b, pa, pb, src, dst):
        monkeypatch.setattr(_cma, "read", gone)
        with anyio.fail_after(10), pytest.raises(TransportError, match="writer's memory"):
            await write_all(a, pa, src, dst)
        monkeypatch.undo()
        await write_all(a, pa, src, dst)  # the next write is read again: EFAULT is not a refusal
        assert await b.receive_notification(pb) == b"n"
        assert torch.equal(src, dst)
        assert b.cma_reads == 1  # type: ignore[attr-defined]


async def test_a_long_read_reports_progress_within_the_stall_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four slices of 0.15 s each: 0.6 s in all, with a stall deadline of 0.3 s that each PROGRESS restarts."""
    read = _cma.read
    slices = []

    def slow(pid: int, src: Any, dst: Any) -> None:
        time.sleep(0.15)
        slices.append(len(src))
        read(pid, src, dst)

    async with pair(4 * MiB) as (a, b, pa, pb, src, dst):
        monkeypatch.setattr(_cma, "read", slow)
        monkeypatch.setattr(_cma, "SLICE_BYTES", MiB)
        monkeypatch.setattr(ucx_module, "_PULL_PROGRESS_SECONDS", 0.0)
        pages = [[src.data_ptr() + i * MiB, MiB] for i in range(4)]
        reversed_pages = [[dst.data_ptr() + (3 - i) * MiB, MiB] for i in range(4)]  # rows that do not merge
        await a.write(pa, pages, reversed_pages, b"n", stall_timeout=0.3)
        assert await b.receive_notification(pb) == b"n"
        assert torch.equal(src.view(4, MiB).flip(0), dst.view(4, MiB))
        assert len(slices) == 4


async def test_a_stalled_read_times_out_and_the_next_write_goes_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TransferTimeout at the writer's stall deadline; the write returns only once the receiver has stopped
    reading the writer's memory (which the caller may free then)."""
    read = _cma.read
    done = []

    def stuck(pid: int, src: Any, dst: Any) -> None:
        time.sleep(0.6)
        read(pid, src, dst)
        done.append(len(src))

    async with pair(MiB) as (a, b, pa, pb, src, dst):
        monkeypatch.setattr(_cma, "read", stuck)
        with anyio.fail_after(10), pytest.raises(TransferTimeout):
            await write_all(a, pa, src, dst, stall_timeout=0.3)
        assert done == [1]  # the slice it was reading had ended
        assert b.statistics().incoming_writes == 0
        monkeypatch.undo()
        dst.zero_()
        await write_all(a, pa, src, dst)
        assert await b.receive_notification(pb) == b"n"
        assert torch.equal(src, dst)


@pytest.mark.parametrize("offer", ["short", "lengths", "garbage"])
async def test_an_offer_that_does_not_pair_is_ignored(offer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver reads nothing of a malformed offer and takes the write as UCX messages."""
    async with pair(MiB) as (a, b, pa, pb, src, dst):
        base = src.data_ptr()
        bad = {
            "short": wire_fragments([[base, MiB // 2]]),
            "lengths": wire_fragments([[base, MiB // 2], [base + MiB // 2, MiB // 2]]),
            "garbage": b"\x01\x02\x03",
        }[offer]
        monkeypatch.setattr(a.data_path, "_pull_offer", lambda peer, rows: bad)  # type: ignore[attr-defined]
        await write_all(a, pa, src, dst)
        assert await b.receive_notification(pb) == b"n"
        assert torch.equal(src, dst)
        assert b.cma_reads == 0  # type: ignore[attr-defined]


def wire_fragments(rows: list[list[int]]) -> bytes:
    return fragments_bytes(np.array(rows, dtype=np.uint64))


async def test_a_connected_idle_transport_costs_no_cpu() -> None:
    """Through UCX messages (TCP lanes are among them without CMA): ucxx 0.52 alone never re-armed its worker,
    and the loop ran its reader on every turn (a core at 100%)."""
    async with pair(MiB, host_cma=False) as (a, b, pa, pb, src, dst):
        await write_all(a, pa, src, dst)
        assert await b.receive_notification(pb) == b"n"
        await anyio.sleep(0.2)  # what the write left to do
        cpu = time.thread_time()
        await anyio.sleep(1.0)
        assert time.thread_time() - cpu < 0.2
        events = a.data_path._worker_events  # type: ignore[attr-defined]
        assert events is not None and events.wakeups > 0, events


async def test_a_busy_worker_is_polled_at_intervals() -> None:
    """A worker that says busy on every arm (as after a peer died in the middle of a shared-memory message):
    progressed on the next turns at first, then at growing intervals up to LONGEST_WAIT; a kick brings the
    next turns back."""
    from kvferry.transports._ucx_progress import BUSY_TURNS, LONGEST_WAIT, WorkerEvents

    wake, _ = socket.socketpair()

    class Busy:
        epoll_file_descriptor = wake.fileno()
        calls = 0

        def progress(self) -> None:
            self.calls += 1

        def arm(self) -> bool:
            return False

    class Mode:
        worker = Busy()

    mode = Mode()
    try:
        events = WorkerEvents(asyncio.get_running_loop(), mode)
        events.kick()
        await anyio.sleep(1.0)
        ramp = 17  # intervals from 50 us, doubling, until LONGEST_WAIT
        assert BUSY_TURNS < mode.worker.calls <= BUSY_TURNS + ramp + 1.0 / LONGEST_WAIT + 2, events
        before = mode.worker.calls
        events.kick()
        await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
        assert mode.worker.calls >= before + 1
        mode.worker = None  # type: ignore[assignment]  # ucxx dropped its worker: the driver stops
        await anyio.sleep(0.05)
        assert events.progress_calls <= before + BUSY_TURNS + 2
    finally:
        asyncio.get_running_loop().remove_reader(wake.fileno())
        wake.close()


async def test_the_driver_replaces_ucxx_arming_task() -> None:
    import ucxx._lib_async.application_context as application

    async with get_transport("ucx")() as transport:
        mode = application.ProgressTasks[asyncio.get_running_loop()]
        await anyio.lowlevel.checkpoint()
        assert mode.arm_task.cancelled()
        assert transport.data_path._worker_events is mode._kvferry_events  # type: ignore[attr-defined]
        async with get_transport("ucx")() as second:  # one driver per loop
            assert second.data_path._worker_events is transport.data_path._worker_events  # type: ignore[attr-defined]


def test_write_status_values_are_wire_version_2() -> None:
    assert wire.TRANSPORT_PROTOCOL_VERSION >= 2
    assert {s.value for s in messages.WriteStatus} >= {"pulling", "progress"}


# --- caps on a write request: refused from its length, split by the writer; the plan of its messages ---------


def _reference_plan(lengths: list[int], zero_copy_bytes: int, pack_bytes: int) -> list[tuple[int, int, bool]]:
    """The plan as the loop over rows that plan_messages replaced cut it."""
    plan: list[tuple[int, int, bool]] = []
    start, packed_bytes = -1, 0
    for row, length in enumerate(lengths):
        if length >= zero_copy_bytes:
            if start >= 0:
                plan.append((start, row, True))
                start = -1
            plan.append((row, row + 1, False))
            continue
        if start >= 0 and packed_bytes + length > pack_bytes:
            plan.append((start, row, True))
            start = -1
        if start < 0:
            start, packed_bytes = row, 0
        packed_bytes += length
    if start >= 0:
        plan.append((start, len(lengths), True))
    return plan


_LENGTHS = st.one_of(st.integers(1, 40), st.sampled_from([64, 1 << 20, 2**40, 2**63, 2**64 - 2]))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_LENGTHS, max_size=60),
    st.one_of(st.integers(1, 100), st.sampled_from([2**63, 2**64 - 1])),
    st.one_of(st.integers(1, 120), st.just(1 << 30)),
)
def test_the_plan_is_the_greedy_cut_of_the_rows(lengths: list[int], zero_copy: int, pack: int) -> None:
    rows = np.array(lengths, dtype=np.uint64)
    plan = ucx_module.plan_messages(rows, zero_copy, pack)
    assert list(plan) == _reference_plan(lengths, zero_copy, pack)
    assert [plan[k] for k in range(len(plan))] == list(plan)


def test_the_plan_refuses_more_fragments_than_the_cap() -> None:
    cap = ucx_module.MAX_WRITE_FRAGMENTS
    assert len(ucx_module.plan_messages(np.ones(cap, dtype=np.uint64), 1 << 20, 1)) == cap
    with pytest.raises(ValueError, match="at most"):
        ucx_module.plan_messages(np.ones(cap + 1, dtype=np.uint64), 1 << 20, 4 << 20)
    with pytest.raises(ValueError, match="packed messages"):
        ucx_module.plan_messages(np.ones(4, dtype=np.uint64), 1 << 20, (1 << 30) + 1)


async def test_a_request_of_4m_fragments_is_refused_from_its_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """A WriteRequest of millions of tiny fragments must not hold the receiver's event loop (parsed, located,
    planned) before it is refused: a request over the fragment cap is answered FAILED from the length of ``dst``
    alone, nothing of it parsed, and the connection serves the next write; the 4M-fragment request itself (64 MiB)
    is past the control-frame cap, so its sender is dropped before a byte of it is read, and the receiver serves
    on."""
    parsed: list[int] = []
    parse = messages.fragments_from_bytes  # what ucx imported

    def spy(data: bytes) -> Any:
        parsed.append(len(data))
        return parse(data)

    async with pair(MiB) as (a, b, pa, pb, src, dst):
        monkeypatch.setattr(ucx_module, "fragments_from_bytes", spy)
        count = ucx_module.MAX_WRITE_FRAGMENTS + 1
        rows = np.stack([dst.data_ptr() + np.arange(count) % MiB, np.ones(count, dtype=np.int64)], axis=1)
        channel = a.control.peer(pa)  # type: ignore[attr-defined]
        replies_out, replies_in = anyio.create_memory_object_stream[messages.WriteReply](1)
        write_id = a.writes.new_write_id()  # type: ignore[attr-defined]
        channel.pending[write_id] = replies_out
        request = messages.WriteRequest(
            write_id, fragments_bytes(rows.astype(np.uint64)), 1 << 20, 4 << 20, b"x"
        )
        try:
            body = wire.encode(request)
            await a.control.send_frame(channel, messages.FrameKind.WRITE_REQUEST, body)  # type: ignore[attr-defined]
            with anyio.fail_after(30):
                reply = await replies_in.receive()
        finally:
            channel.pending.pop(write_id, None)
        assert reply.write_id == write_id
        assert reply.status is messages.WriteStatus.FAILED
        assert f"{count} fragments (at most {ucx_module.MAX_WRITE_FRAGMENTS} per request)" in reply.detail
        assert parsed == []
        await write_all(a, pa, src, dst)
        assert await b.receive_notification(pb) == b"n"
        assert torch.equal(src, dst)
        huge = np.zeros((4 << 20, 2), dtype=np.uint64)
        request = messages.WriteRequest(
            a.writes.new_write_id(),  # type: ignore[attr-defined]
            fragments_bytes(huge),
            1 << 20,
            4 << 20,
            b"x",
        )
        with anyio.fail_after(30), pytest.raises(PeerDisconnected):
            await a.control.send_frame(channel, messages.FrameKind.WRITE_REQUEST, wire.encode(request))  # type: ignore[attr-defined]
            await pa.lost.wait()  # type: ignore[attr-defined]
            raise pa.error  # type: ignore[attr-defined]
        assert b.statistics().dropped_peers == 1


@pytest.mark.parametrize("host_cma", [True, False])
async def test_a_write_over_the_cap_goes_as_several_requests(
    host_cma: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten rows with a cap of four: three requests in turn, the notification with the last, every byte in
    place (read by the receiver, or sent as UCX messages)."""
    monkeypatch.setattr(ucx_module, "MAX_WRITE_FRAGMENTS", 4)
    page = 64 << 10
    async with pair(10 * page, host_cma=host_cma) as (a, b, pa, pb, src, dst):
        notifies: list[bytes | None] = []
        write_request = a.data_path._write_request  # type: ignore[attr-defined]

        async def spy(peer: Any, rows: Any, notify: bytes | None, stall: float) -> None:
            notifies.append(notify)
            assert len(rows.src) <= 4
            await write_request(peer, rows, notify, stall)

        monkeypatch.setattr(a.data_path, "_write_request", spy)  # type: ignore[attr-defined]
        # rows that do not merge: page i goes to page 9 - i
        src_rows = [[src.data_ptr() + i * page, page] for i in range(10)]
        dst_rows = [[dst.data_ptr() + (9 - i) * page, page] for i in range(10)]
        await a.write(pa, src_rows, dst_rows, b"n")
        assert await b.receive_notification(pb) == b"n"
        assert torch.equal(src.view(10, page).flip(0), dst.view(10, page))
        assert notifies == [None, None, b"n"]
        assert a.pulled_writes == (3 if host_cma else 0)  # type: ignore[attr-defined]
