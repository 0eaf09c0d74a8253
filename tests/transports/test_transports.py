"""The parametrised suite: every transport, the same behaviour (nixl and ucx across processes, local in one)."""

from __future__ import annotations

import os
import socket
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from kvferry import wire
from kvferry.errors import (
    MessageTooLarge,
    PeerDisconnected,
    PeerIncompatible,
    RegionError,
)
from kvferry.transports import (
    PeerAttribute,
    TransportAttribute,
    get_transport,
    page_fragments,
)
from kvferry.transports.indexed import IndexedWrite
from kvferry.transports.writes import WritePipeline
from tests.support.transports import (
    TRANSPORTS,
    LoopLag,
    Remote,
    arandom,
    asha,
    connected,
    local_pair,
    random_tensor,
    remote_buffer,
    sha,
    swap_halves,
    swapped_halves,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

MiB = 1 << 20


# --- data ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 4097, MiB + 3, 64 * MiB])
@pytest.mark.parametrize("transport_name", [*TRANSPORTS, "ucx-messages"])
async def test_round_trip_bytes_verified(
    transport_name: str, remote: Remote, loop_lag: LoopLag, size: int
) -> None:
    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(transport, peer, remote, "rt", size + 64)
        src = await arandom(size + 7, seed=size)
        await transport.register(src)
        expected = await asha(src.numpy()[7:])
        pulled = getattr(transport, "pulled_writes", 0)
        loop_lag.reset()
        await transport.write(peer, [[src.data_ptr() + 7, size]], [[dst + 64, size]], b"done")
        # ucx: the receiver read our memory itself (a peer of this host), unless told to use UCX messages
        assert getattr(transport, "pulled_writes", 0) == pulled + (transport_name == "ucx")
        reply = await remote.call(op="wait_notify", name="rt", fragments=[[64, size]])
        assert bytes.fromhex(reply["notify"]) == b"done"
        assert reply["sha"] == expected
        untouched = await remote.call(op="digest", name="rt", fragments=[[0, 64]])
        assert untouched["sha"] == sha(bytes(64))


@pytest.mark.parametrize("transport_name", [*TRANSPORTS, "ucx-messages"])
async def test_many_fragments_scattered(transport_name: str, remote: Remote, loop_lag: LoopLag) -> None:
    page, pages = 4096, 4096
    rng = np.random.default_rng(1)
    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(transport, peer, remote, "pages", page * pages)
        src = await arandom(page * pages, seed=2)
        await transport.register(src)
        loop_lag.reset()
        perm = rng.permutation(pages)
        await transport.write(
            peer,
            page_fragments(src.data_ptr(), page, np.arange(pages)),
            page_fragments(dst, page, perm),
            b"p",
        )
        reply = await remote.call(
            op="wait_notify", name="pages", fragments=[[int(p) * page, page] for p in perm]
        )
        assert reply["sha"] == await asha(src.numpy())

        # irregular lengths, both sides scattered, some rows contiguous on both sides (coalesced)
        lengths = rng.integers(1, 3 * page, size=500)
        src_off = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        order = rng.permutation(len(lengths))  # the order rows are laid out in at the destination
        dst_off = np.empty_like(src_off)
        dst_off[order] = np.concatenate(([0], np.cumsum(lengths[order])[:-1]))
        src_f = np.stack([src.data_ptr() + src_off, lengths], axis=1).astype(np.uint64)
        dst_f = np.stack([dst + dst_off, lengths], axis=1).astype(np.uint64)
        await transport.write(peer, src_f, dst_f, b"irregular")
        frags = [[int(o), int(n)] for o, n in zip(dst_off, lengths, strict=True)]
        reply = await remote.call(op="wait_notify", name="pages", fragments=frags)
        expected = b"".join(src.numpy()[o : o + n].tobytes() for o, n in zip(src_off, lengths, strict=True))
        assert bytes.fromhex(reply["notify"]) == b"irregular"
        assert reply["sha"] == await asha(expected)


@pytest.mark.parametrize("transport_name", [*TRANSPORTS, "ucx-messages"])
async def test_notification_only_after_data(transport_name: str, remote: Remote) -> None:
    """Each notification is checked against the bytes present the moment it arrives."""
    size = 8 * MiB
    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(transport, peer, remote, "order", size)
        sources = [random_tensor(size, seed=s) for s in range(3)]
        for t in sources:
            await transport.register(t)
        for i, t in enumerate(sources):
            await transport.write(peer, [[t.data_ptr(), size]], [[dst, size]], f"write-{i}".encode())
            reply = await remote.call(op="wait_notify", name="order", fragments=[[0, size]])
            assert bytes.fromhex(reply["notify"]) == f"write-{i}".encode()
            assert reply["sha"] == sha(t.numpy().tobytes())
        # no notification when none is asked for; an empty one arrives
        await transport.write(peer, [[sources[0].data_ptr(), 16]], [[dst, 16]], None)
        await transport.write(peer, [[sources[0].data_ptr(), 16]], [[dst, 16]], b"")
        reply = await remote.call(op="wait_notify", name="order", fragments=[[0, 16]])
        assert reply["notify"] == ""


@pytest.mark.parametrize("transport_name", [*TRANSPORTS, "ucx-messages"])
async def test_write_many_lands_each_write_and_refuses_only_the_bad_ones(
    transport_name: str, remote: Remote
) -> None:
    """Three scattered writes and two bad ones in one call: the good ones land (each notification after its own
    bytes at least), the bad ones are refused with nothing of them written; where the transport copies
    itself (local) the good ones move as one write (nixl over CUDA IPC too: tests/transports/test_gpu.py)."""
    page, per_part, parts = 4096, 64, 3
    size = page * per_part * parts
    rng = np.random.default_rng(7)
    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(transport, peer, remote, "many", size + page, guard=page)
        src = await arandom(size, seed=9)
        await transport.register(src)
        unregistered = random_tensor(64)
        perm = rng.permutation(per_part * parts)
        good = []
        for k in range(parts):
            pages = np.arange(k * per_part, (k + 1) * per_part)
            good.append(
                (
                    page_fragments(src.data_ptr(), page, pages),
                    page_fragments(dst, page, perm[pages]),
                    f"part-{k}".encode(),
                )
            )
        bad_source = ([[unregistered.data_ptr(), 64]], [[dst + size, 64]], b"never")
        past_the_end = ([[src.data_ptr(), 64]], [[dst + size + page - 32, 64]], b"never")
        before = transport.statistics()
        outcomes = await transport.write_many(peer, [good[0], bad_source, good[1], past_the_end, good[2]])
        assert [o is None for o in outcomes] == [True, False, True, False, True], outcomes
        assert isinstance(outcomes[1], RegionError) and isinstance(outcomes[3], RegionError)
        after = transport.statistics()
        assert after.writes_completed - before.writes_completed == parts
        # local copies them itself, as one; host memory across processes goes write by write (in parallel)
        combined = after.writes_combined - before.writes_combined
        assert combined == (parts if transport_name == "local" else 0)
        notified = set()
        for _ in range(parts):
            reply = await remote.call(op="wait_notify", name="many", fragments=[[0, 1]])
            notified.add(bytes.fromhex(reply["notify"]))
        assert notified == {f"part-{k}".encode() for k in range(parts)}
        landed = await remote.call(op="digest", name="many", fragments=[[int(p) * page, page] for p in perm])
        assert landed["sha"] == await asha(src.numpy())
        # the bad writes wrote nothing: the page after the good ones is still zero
        untouched = await remote.call(op="digest", name="many", fragments=[[size, page]])
        assert untouched["sha"] == sha(bytes(page))
        # an empty call does nothing
        assert await transport.write_many(peer, []) == []


@pytest.mark.parametrize("transport_name", [*TRANSPORTS, "ucx-messages"])
async def test_write_indexed_lands_and_refuses_bad_ids_and_templates(
    transport_name: str, remote: Remote
) -> None:
    """Indexed writes (a template and ids): the good ones land where their ids say, each notified; one with a
    destination id at its limit, one with a negative source id, one with too few ids and one whose template
    reaches past the peer's registered memory are refused (RegionError) with nothing of them written, and
    cost the others nothing. (The device path of nixl and local: tests/transports/test_gpu.py.)"""
    page, positions = 4096, 64
    size = page * positions
    rng = np.random.default_rng(11)
    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(transport, peer, remote, "indexed", 2 * size, guard=page)
        src = await arandom(size, seed=12)
        await transport.register(src)
        rows = swapped_halves(src.data_ptr(), dst, page, positions, 2 * positions)
        perms = [rng.permutation(positions), positions + rng.permutation(positions)]
        ids = np.arange(positions)
        good = [IndexedWrite(rows, ids, perm, f"indexed-{k}".encode()) for k, perm in enumerate(perms)]
        at_limit = IndexedWrite(rows, ids, np.full(positions, 2 * positions), b"never")
        negative = IndexedWrite(rows, np.concatenate(([-1], ids[1:])), perms[0], b"never")
        short = IndexedWrite(rows, ids[1:], perms[0], b"never")
        # a template one page longer than the peer registered, its last page named
        past = swapped_halves(src.data_ptr(), dst, page, positions, 2 * positions + 1)
        past_the_end = IndexedWrite(past, ids, np.full(positions, 2 * positions), b"never")
        before = transport.statistics()
        outcomes = await transport.write_indexed(
            peer, [good[0], at_limit, negative, good[1], short, past_the_end]
        )
        assert [o is None for o in outcomes] == [True, False, False, True, False, False], outcomes
        assert all(isinstance(o, RegionError) for o in outcomes if o is not None), outcomes
        after = transport.statistics()
        assert after.writes_completed - before.writes_completed == 2
        notified = set()
        for _ in good:
            reply = await remote.call(op="wait_notify", name="indexed", fragments=[[0, 1]])
            notified.add(bytes.fromhex(reply["notify"]))
        assert notified == {b"indexed-0", b"indexed-1"}
        expected = await asha(swap_halves(src.numpy(), page))
        for perm in perms:
            landed = await remote.call(
                op="digest", name="indexed", fragments=[[int(p) * page, page] for p in perm]
            )
            assert landed["sha"] == expected
        assert await transport.write_indexed(peer, []) == []


# --- control channel -----------------------------------------------------------------------------------


async def test_messages_and_size_limit(transport_name: str, remote: Remote) -> None:
    async with connected(transport_name, remote, max_message_bytes=4096) as (transport, peer):
        assert peer.extra(PeerAttribute.same_process) is (transport_name == "local")
        await transport.send_message(peer, b"ping")
        assert (await remote.call(op="recv"))["data"] == b"ping".hex()
        await remote.call(op="send", data=b"pong".hex())
        assert await transport.receive_message(peer) == b"pong"
        # over the peer's limit (16 MiB): refused here, nothing sent
        with pytest.raises(MessageTooLarge):
            await transport.send_message(peer, bytes((16 << 20) + 1))
        # over our limit: refused without being read into memory; the channel stays usable
        await remote.call(op="send_raw", size=1 << 20)
        await remote.call(op="send", data=b"after".hex())
        with pytest.raises(MessageTooLarge):
            await transport.receive_message(peer)
        assert await transport.receive_message(peer) == b"after"


async def test_handshake_refused_before_body(
    transport_name: str, remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with get_transport(transport_name)(compat_hash=b"another model") as transport:
        with pytest.raises(PeerIncompatible, match="compatibility hash"):
            await transport.connect(remote.address)
    if transport_name == "local":
        return  # the in-process peer shares the wire module: a patched version would change both sides
    monkeypatch.setattr(wire, "TRANSPORT_PROTOCOL_VERSION", wire.TRANSPORT_PROTOCOL_VERSION + 1)
    encode = wire.encode
    async with get_transport(transport_name)() as transport:
        # a future peer's body would not decode; it must be refused by version before anyone tries
        monkeypatch.setattr(transport.control, "hello", lambda: b"not a hello at all")  # type: ignore[attr-defined]
        monkeypatch.setattr(wire, "encode", lambda obj: obj if isinstance(obj, bytes) else encode(obj))
        with pytest.raises(PeerIncompatible, match="wire version"):
            await transport.connect(remote.address)
    monkeypatch.undo()
    other = "ucx" if transport_name == "nixl" else "nixl"
    async with get_transport(other)() as transport:
        with pytest.raises(PeerIncompatible, match="transport"):
            await transport.connect(remote.address)


# --- failures ------------------------------------------------------------------------------------------


async def test_connect_to_nobody(transport_name: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with get_transport(transport_name)() as transport:
        with anyio.fail_after(5), pytest.raises(PeerDisconnected):
            await transport.connect(f"{transport_name}://127.0.0.1:{port}")
        # a listener that never answers the handshake
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            address = f"{transport_name}://127.0.0.1:{s.getsockname()[1]}"
            with anyio.fail_after(5), pytest.raises(PeerDisconnected):
                await transport.connect(address, timeout=0.5)
        assert transport.statistics().peers == 0


@pytest.mark.parametrize("transport_name", [*TRANSPORTS, "ucx-messages"])
async def test_write_outside_registered_memory(transport_name: str, remote: Remote) -> None:
    async with connected(transport_name, remote) as (transport, peer):
        # the peer's other buffers (of earlier tests) must not lie next to this one
        dst = await remote_buffer(transport, peer, remote, "guarded", 4096, guard=8192)
        src = random_tensor(8192)
        await transport.register(src)
        unregistered = random_tensor(4096)
        for src_f, dst_f in [
            ([[src.data_ptr(), 4096]], [[dst + 1, 4096]]),  # one byte past the end
            ([[src.data_ptr(), 8192]], [[dst, 8192]]),  # too long
            ([[unregistered.data_ptr(), 16]], [[dst, 16]]),  # source not registered
            ([[src.data_ptr(), 16]], [[dst - 4096, 16]]),  # before the region
        ]:
            with pytest.raises(RegionError):
                await transport.write(peer, src_f, dst_f, b"never")
        assert (await remote.call(op="digest", name="guarded", fragments=[[0, 4096]]))["sha"] == sha(
            bytes(4096)
        )
        with pytest.raises(ValueError):
            await transport.write(peer, [[src.data_ptr(), 16]], [[dst, 8]])


@pytest.mark.parametrize("transport_name", ["ucx", "ucx-messages", "nixl"])
async def test_receiver_refuses_what_it_did_not_register(transport_name: str, remote: Remote) -> None:
    """The writer's own check is bypassed: the receiver (ucx) or NIXL must refuse, and write nothing."""
    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(transport, peer, remote, "victim", 4096, guard=8192)
        src = random_tensor(4096)
        await transport.register(src)
        from kvferry.transports._memory import RegionTable
        from kvferry.transports.messages import RegionInfo

        peer.regions = RegionTable([RegionInfo(dst, 1 << 40, "cpu")])  # type: ignore[attr-defined]
        with pytest.raises(RegionError):
            await transport.write(peer, [[src.data_ptr(), 4096]], [[dst + 4096, 4096]], b"x")
        assert (await remote.call(op="digest", name="victim", fragments=[[0, 4096]]))["sha"] == sha(
            bytes(4096)
        )
        await transport.write(peer, [[src.data_ptr(), 4096]], [[dst, 4096]], b"still fine")
        assert (await remote.call(op="digest", name="victim", fragments=[[0, 4096]]))["sha"] == sha(
            src.numpy().tobytes()
        )


async def test_reregistration_at_the_same_address(transport_name: str, remote: Remote) -> None:
    """A peer deregisters a region and registers memory at the same address again (what a freed and
    reallocated CUDA buffer looks like) on a live connection: writes in between are refused, writes after it
    land (on the H200 NIXL refused this for VRAM: see the nixl module docstring)."""
    async with connected(transport_name, remote) as (transport, peer):
        dst = await remote_buffer(transport, peer, remote, "reused", 8192)
        src = random_tensor(8192, seed=3)
        await transport.register(src)
        await transport.write(peer, [[src.data_ptr(), 4096]], [[dst, 4096]], b"before")
        await remote.call(op="deregister", name="reused")
        assert b"deregistered" in await transport.receive_message(peer)
        with pytest.raises(RegionError):
            await transport.write(peer, [[src.data_ptr(), 16]], [[dst, 16]], b"refused")
        for length, seed in ((8192, 4), (4096, 5), (8192, 6)):  # same address: same length, shorter, longer
            assert (await remote.call(op="reregister", name="reused", length=length))["address"] == dst
            assert b"registered" in await transport.receive_message(peer)
            data = random_tensor(length, seed=seed)
            await transport.register(data)
            await transport.write(peer, [[data.data_ptr(), length]], [[dst, length]], b"after")
            digest = await remote.call(op="digest", name="reused", fragments=[[0, length]])
            assert digest["sha"] == sha(data.numpy().tobytes())
            await remote.call(op="deregister", name="reused")
            assert b"deregistered" in await transport.receive_message(peer)


@pytest.mark.parametrize("transport_name", ["nixl", "ucx"])
async def test_a_peer_that_cannot_show_its_pid_gets_no_same_host_copies(
    transport_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer whose hello names this host and a pid, but whose proof is not in that pid's memory, is treated as
    another host's: our own process_vm_writev (nixl) or the receiver's read (ucx) would otherwise copy into or
    out of whatever process that pid is. Its writes still land, through NIXL or UCX messages."""
    import attrs

    factory = get_transport(transport_name)
    decoy = np.frombuffer(os.urandom(64), dtype=np.uint8).copy()  # b's memory, but not its proof
    async with factory(same_process="transport") as a, factory(same_process="transport") as b:
        honest = b.control.hello  # type: ignore[attr-defined]
        monkeypatch.setattr(
            b.control,  # type: ignore[attr-defined]
            "hello",
            lambda address: attrs.evolve(honest(address), pid_proof_address=decoy.ctypes.data),
        )
        pa = await a.connect(b.address)
        pb = await b.accept()
        assert not pa.same_host and not pa.same_process  # type: ignore[attr-defined]
        assert pb.same_host  # type: ignore[attr-defined]  # a's own proof holds
        src, dst = random_tensor(MiB, seed=3), torch.zeros(MiB, dtype=torch.uint8)
        await a.register(src)
        await b.grant(pb, await b.register(dst))
        await b.send_message(pb, b"registered")
        await a.receive_message(pa)
        await a.write(pa, [[src.data_ptr(), MiB]], [[dst.data_ptr(), MiB]], b"n")
        assert await b.receive_notification(pb) == b"n"
        assert torch.equal(src, dst)
        counter = "cma_writes" if transport_name == "nixl" else "pulled_writes"
        assert getattr(a, counter) == 0


@pytest.mark.parametrize("transport_name", ["nixl"])
async def test_nixl_refused_region_metadata(
    transport_name: str, remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When NIXL refuses to merge the metadata of a peer's new regions (NIXL_ERR_NOT_ALLOWED on the H200 for
    VRAM re-registered at a freed address; simulated here), writes into those regions raise a RegionError that
    names the cause, the connection stays up for everything else, and a later accepted registration heals.
    (Through NIXL: process_vm_writev, which does not need NIXL's metadata, is off.)"""
    import nixl_cu13._bindings as nixl_bindings

    async with connected(transport_name, remote, host_cma=False) as (transport, peer):
        kept = await remote_buffer(transport, peer, remote, "kept", 4096)
        src = random_tensor(4096, seed=7)
        await transport.register(src)
        agent = transport.data_path._agent  # type: ignore[attr-defined]

        def refuse(metadata: bytes) -> str:
            raise nixl_bindings.nixlNotAllowedError("NIXL_ERR_NOT_ALLOWED")

        monkeypatch.setattr(agent, "add_remote_agent", refuse)
        fresh = await remote_buffer(transport, peer, remote, "fresh", 4096)
        with pytest.raises(RegionError, match=r"re-registration at a freed device address.*reconnect"):
            await transport.write(peer, [[src.data_ptr(), 16]], [[fresh, 16]], b"refused")
        assert (await remote.call(op="digest", name="fresh", fragments=[[0, 4096]]))["sha"] == sha(
            bytes(4096)
        )
        await transport.write(peer, [[src.data_ptr(), 4096]], [[kept, 4096]], b"kept")
        assert (await remote.call(op="digest", name="kept", fragments=[[0, 4096]]))["sha"] == sha(
            src.numpy().tobytes()
        )
        await transport.send_message(peer, b"still talking")
        monkeypatch.undo()
        await remote.call(op="deregister", name="fresh")
        assert b"deregistered" in await transport.receive_message(peer)
        assert (await remote.call(op="reregister", name="fresh"))["address"] == fresh
        assert b"registered" in await transport.receive_message(peer)
        await transport.write(peer, [[src.data_ptr(), 4096]], [[fresh, 4096]], b"healed")
        assert (await remote.call(op="digest", name="fresh", fragments=[[0, 4096]]))["sha"] == sha(
            src.numpy().tobytes()
        )


async def test_write_many_checks_good_writes_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes that may move together are checked as one write first (one pass over all their rows); only when
    that refuses something is each checked on its own, and then only the bad one is refused."""
    async with local_pair(4 * MiB) as (a, pa, _, src, dst):
        checks: list[int] = []
        checked = WritePipeline.checked

        def counting(self: Any, p: Any, rows: Any) -> Any:
            checks.append(len(rows.src))
            return checked(self, p, rows)

        monkeypatch.setattr(WritePipeline, "checked", counting)
        quarter = MiB
        writes = [
            (
                [[src.data_ptr() + k * quarter, quarter]],
                [[dst.data_ptr() + (3 - k) * quarter, quarter]],
                b"%d" % k,
            )
            for k in range(4)
        ]
        before = a.statistics()
        assert await a.write_many(pa, writes) == [None] * 4
        assert checks == [4]  # one check of the four writes' rows
        for k in range(4):
            assert torch.equal(
                dst[(3 - k) * quarter : (4 - k) * quarter], src[k * quarter : (k + 1) * quarter]
            )
        after = a.statistics()
        assert after.writes_combined - before.writes_combined == 4
        assert after.bytes_written - before.bytes_written == 4 * quarter
        checks.clear()
        bad = ([[src.data_ptr(), 64]], [[dst.data_ptr() + 4 * MiB - 32, 64]], b"never")  # past the end
        outcomes = await a.write_many(pa, [writes[0], bad, writes[1]])
        assert outcomes[0] is None and isinstance(outcomes[1], RegionError) and outcomes[2] is None
        assert checks == [3, 1, 1, 1]  # the joined check refused: each on its own


@pytest.mark.parametrize("count", [4, 128])
async def test_rows_across_adjacent_registrations_are_written_unmerged(count: int) -> None:
    """Rows contiguous on both sides whose merge would span two adjacent registered ranges are each inside one
    range: the write goes through, unmerged, and rows outside every range are still refused by index; with
    few rows (checked row by row) and many (checked against the bounds write_rows worked out, which span both
    ranges)."""
    async with get_transport("local")() as a, get_transport("local")() as b:
        pa = await a.connect(b.address)
        pb = await b.accept()
        src, dst = random_tensor(2 * MiB), torch.zeros(2 * MiB, dtype=torch.uint8)
        await a.register([src[:MiB], src[MiB:]])
        await b.grant(pb, await b.register([dst[:MiB], dst[MiB:]]))
        await b.send_message(pb, b"registered")
        await a.receive_message(pa)
        part = 2 * MiB // count
        rows = [[src.data_ptr() + part * i, part] for i in range(count)]
        into = [[dst.data_ptr() + part * i, part] for i in range(count)]
        await a.write(pa, rows, into)
        assert torch.equal(dst, src)
        outside = [*into[:-1], [dst.data_ptr() + 2 * MiB, part]]
        with pytest.raises(RegionError, match=f"fragment {count - 1}"):
            await a.write(pa, rows, outside)


async def test_auto_picks_by_process(remote: Remote, transport_name: str) -> None:
    if transport_name != "nixl":
        pytest.skip("once is enough")
    factory = get_transport("auto")
    async with factory() as a, factory() as b:
        assert a.extra(TransportAttribute.name) == "nixl"
        pa = await a.connect(b.address)
        assert pa.extra(PeerAttribute.same_process)
        pr = await a.connect(remote.address)
        assert not pr.extra(PeerAttribute.same_process)
