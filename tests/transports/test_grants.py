"""Grants, not regions: a peer writes only into memory granted to it, on every transport; a write outside its
grants is refused (NotGranted, nothing written) and counted. ucx checks in the receiver too, whatever the writer
checked; the wire refuses malformed grants; a deregistration revokes what it covered."""

from __future__ import annotations

import itertools
import struct
from typing import Any

import anyio
import msgpack
import numpy as np
import pytest
import torch

from kvferry import wire
from kvferry.errors import NotGranted, PeerDisconnected, RegionError, TransportError, WireFormatError
from kvferry.transports import PeerState, Transport, as_fragments, get_transport, messages
from kvferry.transports._memory import Grants, GrantTable, union_of
from kvferry.transports.indexed import IndexedRows, IndexedWrite
from kvferry.transports.writes import WritePipeline
from tests.support.transports import TRANSPORTS, Remote, connected, random_tensor, remote_buffer, sha, variant

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

PAGE = 4096


async def stats_of(remote: Remote) -> dict[str, Any]:
    stats: dict[str, Any] = (await remote.call(op="stats"))["stats"]
    return stats


async def untouched(remote: Remote, name: str, size: int) -> bool:
    digest = await remote.call(op="digest", name=name, fragments=[[0, size]])
    return bool(digest["sha"] == sha(bytes(size)))


@pytest.mark.parametrize("transport_name", [*TRANSPORTS, "ucx-messages"])
async def test_a_peer_granted_nothing_writes_nothing(transport_name: str, remote: Remote) -> None:
    """Deny by default: the peer registered the memory (we know its regions) but granted us nothing. Every
    write, write_many and write_indexed into it is refused with NotGranted before any byte moves, each is
    counted and the memory stays zero."""
    size = 4 * PAGE
    async with connected(transport_name, remote) as (transport, peer):
        dst = (await remote.call(op="alloc", name="ungranted", size=size, guard=PAGE, grant=False))["address"]
        assert b"registered" in await transport.receive_message(peer)
        src = random_tensor(size, seed=1)
        await transport.register(src)
        before = transport.statistics()
        with pytest.raises(NotGranted, match="nothing is granted"):
            await transport.write(peer, [[src.data_ptr(), size]], [[dst, size]], b"never")
        outcomes = await transport.write_many(
            peer, [([[src.data_ptr(), PAGE]], [[dst + k * PAGE, PAGE]], b"never") for k in range(3)]
        )
        assert all(isinstance(o, NotGranted) for o in outcomes), outcomes
        rows = IndexedRows(
            src_slot=[0],
            src_base=[src.data_ptr()],
            src_stride=[PAGE],
            dst_slot=[0],
            dst_base=[dst],
            dst_stride=[PAGE],
            length=[PAGE],
            src_limit=[4],
            dst_limit=[4],
        )
        (indexed,) = await transport.write_indexed(peer, [IndexedWrite(rows, [1], [2], b"never")])
        assert isinstance(indexed, NotGranted), indexed
        after = transport.statistics()
        assert after.writes_refused - before.writes_refused == 5
        assert (
            after.writes_completed == before.writes_completed and after.writes_failed == before.writes_failed
        )
        assert await untouched(remote, "ungranted", size)
        # the channel is fine: messages still go both ways
        await transport.send_message(peer, b"still talking")
        assert (await remote.call(op="recv"))["data"] == b"still talking".hex()


@pytest.mark.parametrize("transport_name", [*TRANSPORTS, "ucx-messages"])
async def test_grant_write_inside_outside_revoke(transport_name: str, remote: Remote) -> None:
    """A grant of the buffer's first two pages: a write inside lands; one outside, or across its end, is
    refused and writes nothing; after the revoke the same write inside is refused too."""
    size = 4 * PAGE
    async with connected(transport_name, remote) as (transport, peer):
        dst = (await remote.call(op="alloc", name="part", size=size, guard=PAGE, grant=False))["address"]
        assert b"registered" in await transport.receive_message(peer)
        # two rows that touch: the union holds a write across both
        assert (await remote.call(op="grant", name="part", fragments=[[0, PAGE], [PAGE, PAGE]]))["ok"]
        assert await transport.receive_message(peer) == b"granted"
        assert (await stats_of(remote))["grants"] == 1
        src = random_tensor(size, seed=2)
        await transport.register(src)
        await transport.write(peer, [[src.data_ptr(), 2 * PAGE]], [[dst, 2 * PAGE]], b"inside")
        reply = await remote.call(op="wait_notify", name="part", fragments=[[0, 2 * PAGE]])
        assert bytes.fromhex(reply["notify"]) == b"inside"
        assert reply["sha"] == sha(src.numpy()[: 2 * PAGE].tobytes())
        refused = transport.statistics().writes_refused
        for src_f, dst_f in [
            ([[src.data_ptr(), PAGE]], [[dst + 2 * PAGE, PAGE]]),  # outside
            ([[src.data_ptr(), 2 * PAGE]], [[dst + PAGE, 2 * PAGE]]),  # across the end of the grant
            ([[src.data_ptr(), 16], [src.data_ptr() + 16, 16]], [[dst, 16], [dst + 3 * PAGE, 16]]),  # one row
        ]:
            with pytest.raises(NotGranted):
                await transport.write(peer, src_f, dst_f, b"never")
        assert transport.statistics().writes_refused - refused == 3
        tail = await remote.call(op="digest", name="part", fragments=[[2 * PAGE, 2 * PAGE]])
        assert tail["sha"] == sha(bytes(2 * PAGE))
        assert (await remote.call(op="revoke", name="part"))["ok"]
        assert await transport.receive_message(peer) == b"revoked"
        assert (await stats_of(remote))["grants"] == 0
        with pytest.raises(NotGranted):
            await transport.write(peer, [[src.data_ptr() + PAGE, PAGE]], [[dst, PAGE]], b"never")
        head = await remote.call(op="digest", name="part", fragments=[[0, 2 * PAGE]])
        assert head["sha"] == sha(src.numpy()[: 2 * PAGE].tobytes())  # as the granted write left it


@pytest.mark.parametrize("transport_name", ["ucx", "ucx-messages"])
async def test_the_ucx_receiver_refuses_outside_the_grant_when_the_writer_does_not_check(
    transport_name: str, remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's own grant check is off (a confused or hostile writer): the receiver, which moves the bytes
    itself, refuses a write request outside what it granted this peer, answers REGION, writes nothing and counts
    it; a write inside still lands."""
    size = 2 * PAGE
    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(
            transport, peer, remote, "receiver-checks", size, guard=PAGE
        )  # granted whole
        other = (await remote.call(op="alloc", name="not-granted", size=size, guard=PAGE, grant=False))[
            "address"
        ]
        assert b"registered" in await transport.receive_message(peer)
        src = random_tensor(size, seed=3)
        await transport.register(src)
        monkeypatch.setattr(WritePipeline, "_check_granted", lambda self, p, dst, bounds=None: None)
        before = (await stats_of(remote))["incoming_refused"]
        with pytest.raises(NotGranted, match="refused the write: not granted"):
            await transport.write(peer, [[src.data_ptr(), size]], [[other, size]], b"never")
        assert (await stats_of(remote))["incoming_refused"] - before == 1
        assert await untouched(remote, "not-granted", size)
        await transport.write(peer, [[src.data_ptr(), size]], [[dst, size]], b"granted")
        reply = await remote.call(op="wait_notify", name="receiver-checks", fragments=[[0, size]])
        assert reply["sha"] == sha(src.numpy().tobytes())


async def test_a_ucx_write_being_received_stops_when_its_grant_is_revoked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ucx: a revoke stops a write the receiver accepted and has not started receiving: it posts nothing,
    answers REGION and the writer gets NotGranted; nothing is written."""
    pytest.importorskip("ucxx")
    from kvferry.transports import ucx

    factory = get_transport("ucx")
    async with factory(same_process="transport") as a, factory(same_process="transport") as b:
        pa = await a.connect(b.address)
        pb = await b.accept()
        src, dst = random_tensor(PAGE, seed=4), torch.zeros(PAGE, dtype=torch.uint8)
        await a.register(src)
        grant = await b.grant(pb, await b.register(dst))
        await b.send_message(pb, b"registered")
        await a.receive_message(pa)
        go = anyio.Event()
        receive, pull = ucx.UcxDataPath._receive, ucx.UcxDataPath._pull

        async def held_receive(self: Any, *args: Any) -> None:
            await go.wait()
            await receive(self, *args)

        async def held_pull(self: Any, *args: Any) -> None:
            await go.wait()
            await pull(self, *args)

        monkeypatch.setattr(ucx.UcxDataPath, "_receive", held_receive)
        monkeypatch.setattr(ucx.UcxDataPath, "_pull", held_pull)
        outcome: list[BaseException] = []

        async def write() -> None:
            try:
                await a.write(pa, [[src.data_ptr(), PAGE]], [[dst.data_ptr(), PAGE]], b"never")
            except NotGranted as exc:
                outcome.append(exc)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(write)
                while not b.statistics().incoming_writes:  # noqa: ASYNC110
                    await anyio.sleep(0.005)
                await grant.revoke()
                go.set()
        assert outcome and "revoked" in str(outcome[0])
        assert not bool(dst.any())
        assert b.statistics().incoming_writes == 0 and a.statistics().writes_refused == 1


async def test_deregistering_revokes_the_grants_it_covered() -> None:
    """A grant does not outlive its memory: memory registered again at the same addresses is not granted (a
    freed and reallocated buffer must not inherit a grant); a new grant makes it writable."""
    async with get_transport("local")() as a, get_transport("local")() as b:
        pa = await a.connect(b.address)
        pb = await b.accept()
        src, dst = random_tensor(PAGE, seed=5), torch.zeros(2 * PAGE, dtype=torch.uint8)
        await a.register(src)
        registration = await b.register(dst)
        whole = await b.grant(pb, registration)
        kept = await b.register(torch.zeros(PAGE, dtype=torch.uint8))
        other = await b.grant(pb, kept)
        assert b.statistics().grants == 2 and whole.active
        await b.deregister(registration)
        assert not whole.active and other.active and b.statistics().grants == 1
        again = await b.register(dst[:PAGE])
        await b.send_message(pb, b"registered again")
        assert await a.receive_message(pa) == b"registered again"
        with pytest.raises(NotGranted):
            await a.write(pa, [[src.data_ptr(), PAGE]], [[dst.data_ptr(), PAGE]])
        assert not bool(dst.any())
        async with await b.grant(pb, again):
            await b.send_message(pb, b"granted")
            assert await a.receive_message(pa) == b"granted"
            await a.write(pa, [[src.data_ptr(), PAGE]], [[dst.data_ptr(), PAGE]])
        assert torch.equal(dst[:PAGE], src)
        with pytest.raises(RegionError):  # a grant lies inside our registered memory
            await b.grant(pb, [[dst.data_ptr() + PAGE, PAGE]])
        with pytest.raises(RegionError):
            await b.grant(pb, registration)


async def test_a_grant_is_known_before_the_message_after_it_and_revoke_nowait_follows() -> None:
    """The channel is ordered: a grant made before a message is known to the writer once the message arrived;
    revoke_nowait refuses on our side at once and reaches the writer in the background."""
    async with get_transport("local")() as a, get_transport("local")() as b:
        pa = await a.connect(b.address)
        pb = await b.accept()
        src, dst = random_tensor(PAGE, seed=6), torch.zeros(PAGE, dtype=torch.uint8)
        await a.register(src)
        registration = await b.register(dst)
        for _ in range(3):
            grant = await b.grant(pb, registration)
            await b.send_message(pb, b"write")
            assert await a.receive_message(pa) == b"write"
            await a.write(pa, [[src.data_ptr(), PAGE]], [[dst.data_ptr(), PAGE]])
            grant.revoke_nowait()
            assert not grant.active and b.statistics().grants == 0
            await b.send_message(pb, b"revoked")
            with anyio.fail_after(5):
                while pa.grants:  # type: ignore[attr-defined]  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            with pytest.raises(NotGranted):
                await a.write(pa, [[src.data_ptr(), PAGE]], [[dst.data_ptr(), PAGE]])
            assert await a.receive_message(pa) == b"revoked"
        grant.revoke_nowait()  # idempotent
        await grant.revoke()


async def test_deferred_grants_and_revokes_go_out_ahead_of_the_next_message() -> None:
    """grant(defer=True) and revoke_nowait wait for no send: what they queue goes out ahead of the next message, in
    the same send (the writer knows the grant, or its end, as soon as it read the message), or on its own right
    after when nothing else is sent. A deferred grant revoked before it went out never reaches the peer (neither
    does its revoke: a revoke of a grant it never knew would cost us the connection)."""
    async with get_transport("local")() as a, get_transport("local")() as b:
        pa = await a.connect(b.address)
        pb = await b.accept()
        src, dst = random_tensor(PAGE, seed=6), torch.zeros(PAGE, dtype=torch.uint8)
        await a.register(src)
        registration = await b.register(dst)
        sent = b.statistics().messages_sent
        for _ in range(3):
            grant = await b.grant(pb, registration, defer=True)
            assert grant.active and b.statistics().grants == 1
            await b.send_message(pb, b"write")
            assert await a.receive_message(pa) == b"write"
            assert len(pa.grants) == 1  # type: ignore[attr-defined]  # with the message, not after it
            await a.write(pa, [[src.data_ptr(), PAGE]], [[dst.data_ptr(), PAGE]])
            grant.revoke_nowait()
            await b.send_message(pb, b"done")
            assert await a.receive_message(pa) == b"done"
            assert not pa.grants  # type: ignore[attr-defined]
            with pytest.raises(NotGranted):
                await a.write(pa, [[src.data_ptr(), PAGE]], [[dst.data_ptr(), PAGE]])
        # nothing sent after it: a task sends it (and the revoke) on its own
        grant = await b.grant(pb, registration, defer=True)
        with anyio.fail_after(5):
            while not pa.grants:  # type: ignore[attr-defined]  # noqa: ASYNC110
                await anyio.sleep(0.005)
        grant.revoke_nowait()
        with anyio.fail_after(5):
            while pa.grants:  # type: ignore[attr-defined]  # noqa: ASYNC110
                await anyio.sleep(0.005)
        # revoked before it went out: neither frame is sent, the connection is fine
        for revoke in ("nowait", "await"):
            grant = await b.grant(pb, registration, defer=True)
            if revoke == "nowait":
                grant.revoke_nowait()
            else:
                await grant.revoke()
            assert not grant.active and not pb.outbox  # type: ignore[attr-defined]
            await b.send_message(pb, b"never granted")
            assert await a.receive_message(pa) == b"never granted"
            assert not pa.grants and pa.state is PeerState.CONNECTED  # type: ignore[attr-defined]
        assert b.statistics().messages_sent - sent == 8 and b.statistics().grants == 0


@pytest.mark.parametrize(
    "frames",
    [
        "the same id twice",
        "a revoke of an unknown id",
        "malformed rows",
        "too many live grants",
    ],
)
async def test_malformed_grants_cost_the_peer_its_connection(
    frames: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grants are decoded strictly: an id granted twice, a revoke of an id that is not live, rows that are not
    fragments, or one grant past the cap of live grants drop the connection of the peer that sent them."""
    async with get_transport("local")() as a, get_transport("local")() as b:
        pa = await a.connect(b.address)
        pb = await b.accept()
        row = np.array([[0x1000, 16]], dtype="<u8").tobytes()

        def grant(grant_id: int, rows: bytes = row) -> tuple[messages.FrameKind, bytes]:
            return messages.FrameKind.GRANT, wire.encode(messages.WriteGrant(grant_id, rows))

        if frames == "the same id twice":
            sent = [grant(1), grant(1)]
        elif frames == "a revoke of an unknown id":
            sent = [grant(1), (messages.FrameKind.REVOKE, wire.encode(messages.WriteRevoke(2)))]
        elif frames == "malformed rows":
            sent = [grant(1, struct.pack("<QQ", 0x1000, 0))]  # a zero-length row
        else:
            monkeypatch.setattr(messages, "MAX_LIVE_GRANTS", 2)
            sent = [grant(1), grant(2)]
        await b.control.send_frames(pb, sent)  # type: ignore[attr-defined]
        if frames == "too many live grants":
            await b.send_message(pb, b"two are fine")
            assert await a.receive_message(pa) == b"two are fine"
            await b.control.send_frames(pb, [grant(3)])  # type: ignore[attr-defined]
        with anyio.fail_after(5), pytest.raises(PeerDisconnected, match="dropped"):
            while True:
                await a.receive_message(pa)
        assert pa.state is PeerState.LOST


async def test_grant_refuses_past_the_cap_and_splits_large_grants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(messages, "MAX_GRANT_FRAGMENTS", 2)
    monkeypatch.setattr(messages, "MAX_LIVE_GRANTS", 4)
    async with get_transport("local")() as a, get_transport("local")() as b:
        pa = await a.connect(b.address)
        pb = await b.accept()
        dst = torch.zeros(16 * PAGE, dtype=torch.uint8)
        await b.register(dst)
        pages = [[dst.data_ptr() + 2 * k * PAGE, PAGE] for k in range(5)]  # five rows, none touching
        grant = await b.grant(pb, pages)  # three wire grants of at most two rows
        assert len(grant.ids) == 3 and len(grant.fragments) == 5  # type: ignore[attr-defined]
        with pytest.raises(TransportError, match="at most 4"):
            await b.grant(pb, pages)
        await b.grant(pb, pages[:1])
        await b.send_message(pb, b"granted")
        assert await a.receive_message(pa) == b"granted"
        assert len(pa.grants) == 4  # type: ignore[attr-defined]
        assert pa.grants.table.nbytes == 5 * PAGE  # type: ignore[attr-defined]


def test_the_grant_check_is_vectorised() -> None:
    """A write of 16384 rows scattered over a grant of as many scattered pages (none touching: the worst case,
    16384 ranges to search): the check is one search over the rows, nowhere
    near a Python loop's microseconds a row; so are the union's construction and the per-write check of an
    indexed write's ids."""
    import time

    n, page, base = 16384, 256, 1 << 40
    rng = np.random.default_rng(0)
    dst = np.stack([base + 2 * rng.permutation(n) * page, np.full(n, page)], axis=1).astype(np.uint64)

    def best(call: Any) -> float:
        times = []
        for _ in range(10):
            began = time.perf_counter()
            call()
            times.append(time.perf_counter() - began)
        return min(times)

    table = GrantTable(dst)
    assert len(table) == n
    assert best(lambda: table.check(dst, "d")) < n * 1e-6
    assert best(lambda: GrantTable(dst)) < n * 1e-6
    outside = dst.copy()
    outside[-1, 0] += np.uint64(page)  # the page after the last one: not granted
    with pytest.raises(NotGranted, match=f"fragment {n - 1}"):
        table.check(outside, "d")


# --- units ---------------------------------------------------------------------------------------------


def test_grant_table_is_the_union_of_its_rows() -> None:
    table = GrantTable(as_fragments([[300, 10], [100, 50], [150, 20], [120, 5], [400, 1]]))
    assert table.ranges.tolist() == [[100, 70], [300, 10], [400, 1]] and table.nbytes == 81
    assert table.holds(as_fragments([[100, 70], [305, 5], [400, 1]]))  # across two rows that touch
    assert not table.holds(as_fragments([[160, 11]]))
    with pytest.raises(NotGranted, match=r"fragment 1 \[0x136"):
        table.check(as_fragments([[100, 1], [310, 1]]), "here")
    with pytest.raises(NotGranted, match="nothing is granted"):
        GrantTable(np.zeros((0, 2), dtype=np.uint64)).check(as_fragments([[1, 1]]), "here")
    GrantTable(np.zeros((0, 2), dtype=np.uint64)).check(np.zeros((0, 2), dtype=np.uint64), "nothing to check")
    grants = Grants()
    grants.add(1, as_fragments([[0, 10]]))
    grants.add(2, as_fragments([[5, 10]]))  # overlapping grants: revoking one keeps the other's bytes
    assert grants.table.ranges.tolist() == [[0, 15]]
    assert grants.remove(1) and not grants.remove(1)
    assert grants.table.ranges.tolist() == [[5, 10]] and 2 in grants and len(grants) == 1


def test_grant_frames_decode_strictly() -> None:
    good = messages.WriteGrant(7, np.array([[4096, 16]], dtype="<u8").tobytes())
    assert wire.decode(wire.encode(good), messages.WriteGrant) == good
    for bad in (
        {"grant_id": 0, "fragments": b""},
        {"grant_id": -1, "fragments": b""},
        {"grant_id": 1, "fragments": bytes(16 * messages.MAX_GRANT_FRAGMENTS + 16)},
        {"grant_id": 1, "fragments": b"", "extra": 1},
    ):
        with pytest.raises(WireFormatError):
            wire.decode(msgpack.packb(bad), messages.WriteGrant)
    for bad_revoke in ({"grant_id": 0}, {"grant_id": -5}, {}):
        with pytest.raises(WireFormatError):
            wire.decode(msgpack.packb(bad_revoke), messages.WriteRevoke)


def test_every_transport_implements_grant() -> None:
    for name in TRANSPORTS:
        try:
            cls = get_transport(variant(name)[0])
        except Exception:
            continue
        assert (
            isinstance(cls, type)
            and issubclass(cls, Transport)
            and "grant" not in getattr(cls, "__abstractmethods__", ())
        )


def test_an_indexed_writes_destinations_are_the_rows_it_expands_to() -> None:
    """What the device path of write_indexed checks against the grants (the rows the ids name) is what the
    write writes: the rows of :meth:`IndexedRows.expand` (merged there), byte for byte."""
    from tests.support.transports import swapped_halves

    rows = swapped_halves(1 << 30, 1 << 40, PAGE, 16, 64)
    ids, dst_ids = np.arange(16), np.random.default_rng(2).permutation(64)[:16]
    destinations = rows.destinations(dst_ids)
    assert len(destinations) == len(rows)
    _, expanded = rows.expand(ids, dst_ids)
    assert GrantTable(destinations).ranges.tolist() == GrantTable(expanded).ranges.tolist()
    assert int(destinations[:, 1].sum()) == rows.nbytes


def test_grants_hold_exactly_the_union_of_the_live_grants() -> None:
    """Whatever the grants' rows (unsorted, overlapping, touching, over several grants) and whichever grant a
    write's rows fall in, a check passes exactly when every row lies inside the union of the live grants: the
    one-grant checks tried first never pass more than the union, and a write across grants still passes."""
    rng = np.random.default_rng(7)
    space = 512
    seen = {True: 0, False: 0}
    for _ in range(60):
        grants, covered = Grants(), np.zeros(space, dtype=bool)
        live: dict[int, list[tuple[int, int]]] = {}
        for grant_id in range(1, int(rng.integers(1, 8)) + 1):
            starts = rng.integers(1, space - 32, size=int(rng.integers(1, 6)))
            rows = [(int(a), int(rng.integers(1, 32))) for a in starts]
            live[grant_id] = rows
            # as a granting transport sends them (merged, in address order) or as they came
            grants.add(grant_id, union_of(as_fragments(rows)) if grant_id % 2 else as_fragments(rows))
        for grant_id in list(live)[: int(rng.integers(0, len(live)))]:  # some revoked again
            assert grants.remove(grant_id)
            del live[grant_id]
        for rows in live.values():
            for a, n in rows:
                covered[a : a + n] = True
        union = GrantTable(
            np.array([r for rows in live.values() for r in rows], dtype=np.uint64).reshape(-1, 2)
        )
        assert union.nbytes == int(covered.sum())
        granted = np.flatnonzero(covered)
        for _ in range(30):
            # half the writes start on granted bytes (inside or running past a grant's end), half anywhere
            near = len(granted) and rng.random() < 0.5
            starts = rng.choice(granted, 3) if near else rng.integers(1, space - 16, 3)
            write = as_fragments([(int(a), int(rng.integers(1, 8))) for a in starts])
            inside = all(covered[a : a + n].all() for a, n in write.tolist())
            seen[inside] += 1
            assert grants.holds(write) is inside and union.holds(write) is inside
            ends = write[:, 0] + write[:, 1]
            bounds = (int(write[:, 0].min()), int(ends.max())) if rng.random() < 0.5 else None
            if inside:
                grants.check(write, "w", bounds)
            else:
                with pytest.raises(NotGranted):
                    grants.check(write, "w", bounds)
    assert min(seen.values()) > 300, seen


def test_an_indexed_writes_destination_runs_are_the_bytes_of_its_rows() -> None:
    """What the device path checks (runs merged where the template makes rows contiguous whatever the ids) is
    exactly the bytes of the rows the ids name, in fewer rows; rows at other id positions, of another stride or
    with a gap between them are never merged."""
    rng = np.random.default_rng(3)
    page, positions = 4096, 8
    merged = 0
    for _ in range(50):
        # per position, cuts of one page (some pieces left out, so some neighbours do not touch); two groups of
        # positions with their own strides and bases
        slot, base, stride, length = [], [], [], []
        for j in range(positions):
            cuts = np.sort(rng.choice(np.arange(1, page // 64), 4, replace=False)) * 64
            edges = [0, *cuts.tolist(), page]
            for a, b in itertools.pairwise(edges):
                if rng.random() < 0.8:
                    slot.append(j)
                    base.append((1 << 30) * (1 + j % 2) + a)
                    stride.append(page * (1 + j % 2))
                    length.append(b - a)
        rows = IndexedRows(
            src_slot=np.zeros(len(slot), dtype=np.int64),
            src_base=np.zeros(len(slot), dtype=np.int64) + (1 << 40),
            src_stride=np.full(len(slot), page),
            dst_slot=slot,
            dst_base=base,
            dst_stride=stride,
            length=length,
            src_limit=[1],
            dst_limit=np.full(positions, 64),
        )
        dst_ids = rng.permutation(64)[:positions]
        every, runs = rows.destinations(dst_ids), rows.destination_runs(dst_ids)
        assert len(runs) <= len(every) and int(runs[:, 1].sum()) == rows.nbytes
        assert GrantTable(runs).ranges.tolist() == GrantTable(every).ranges.tolist()
        merged += len(every) - len(runs)
    assert merged > 100  # neighbours at one position that touch do merge
