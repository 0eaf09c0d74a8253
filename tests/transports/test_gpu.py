"""CUDA regions in two processes on one GPU (nixl and ucx); skipped without CUDA."""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest
import torch

from kvferry.errors import MissingExtraError, RegionError
from kvferry.transports import get_transport, page_fragments
from kvferry.transports.indexed import IndexedWrite
from tests.support.transports import PeerProcess, asha, remote_buffer, swap_halves, swapped_halves

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.anyio,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MiB = 1 << 20


@pytest.mark.parametrize(
    ("transport_name", "options"), [("nixl", {}), ("nixl", {"cuda_ipc": False}), ("ucx", {}), ("local", {})]
)
async def test_cuda_regions_across_processes(transport_name: str, options: dict[str, bool]) -> None:
    """Bytes verified and the notification after them; nixl goes by CUDA IPC unless told not to, local copies on
    the device between two transports of this process."""
    try:
        get_transport(transport_name)
    except MissingExtraError as exc:
        pytest.skip(str(exc))
    if transport_name == "local":
        await _local_cuda()
        return
    proc = await anyio.to_thread.run_sync(lambda: PeerProcess(transport_name, device="cuda"))
    try:
        async with get_transport(transport_name)(**options) as transport:
            peer = await transport.connect(proc.address)
            size = 256 * MiB
            dst = await remote_buffer(transport, peer, proc, "gpu", size)
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
            await transport.register(src)
            expected = await asha(src.cpu().numpy())
            for page in (64 << 10, 1 * MiB, 16 * MiB):
                n = size // page
                perm = np.random.default_rng(page).permutation(n)
                src_f = page_fragments(src.data_ptr(), page, np.arange(n))
                dst_f = page_fragments(dst, page, perm)
                start = time.perf_counter()
                await transport.write(peer, src_f, dst_f, b"gpu")
                seconds = time.perf_counter() - start
                reply = await proc.call(
                    op="wait_notify", name="gpu", fragments=[[int(p) * page, page] for p in perm]
                )
                assert reply["sha"] == expected
                print(
                    f"{transport_name} {options} cuda {page >> 10} KiB pages: {size / seconds / 1e9:.1f} GB/s"
                )
            # both sides scattered: the staged (gather, then scatter) copy
            page = 64 << 10
            n = size // page
            perm_s, perm_d = np.random.default_rng(1).permutation(n), np.random.default_rng(2).permutation(n)
            await transport.write(
                peer, page_fragments(src.data_ptr(), page, perm_s), page_fragments(dst, page, perm_d), b"gpu"
            )
            fragments = [[int(d) * page, page] for d in perm_d[np.argsort(perm_s)]]
            reply = await proc.call(op="wait_notify", name="gpu", fragments=fragments)
            assert reply["sha"] == expected
            if transport_name == "nixl":
                assert (transport.ipc_writes > 0) == options.get("cuda_ipc", True)  # type: ignore[attr-defined]
            # several writes in one call: over CUDA IPC they move as one copy, then the notifications
            page, parts = 1 * MiB, 4
            n = size // page
            perm = np.random.default_rng(3).permutation(n)
            chunks = np.array_split(np.arange(n), parts)
            before = transport.statistics().writes_combined
            ipc_before = getattr(transport, "ipc_writes", 0)
            outcomes = await transport.write_many(
                peer,
                [
                    (page_fragments(src.data_ptr(), page, c), page_fragments(dst, page, perm[c]), b"part")
                    for c in chunks
                ],
            )
            assert outcomes == [None] * parts
            for _ in range(parts):
                reply = await proc.call(op="wait_notify", name="gpu", fragments=[[0, 1]])
            reply = await proc.call(op="digest", name="gpu", fragments=[[int(p) * page, page] for p in perm])
            assert reply["sha"] == expected
            via_ipc = transport_name == "nixl" and options.get("cuda_ipc", True)
            assert transport.statistics().writes_combined - before == (parts if via_ipc else 0)
            if via_ipc:
                assert transport.ipc_writes == ipc_before + 1  # type: ignore[attr-defined]
    finally:
        proc.close()


async def _local_cuda() -> None:
    size = 64 * MiB
    async with get_transport("local")() as a, get_transport("local")() as b:
        peer = await a.connect(b.address)
        remote = await b.accept()
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        await a.register(src)
        await b.grant(remote, await b.register(dst))
        await b.send_message(remote, b"registered")
        await a.receive_message(peer)
        page = 64 << 10
        n = size // page
        perm_s, perm_d = np.random.default_rng(3).permutation(n), np.random.default_rng(4).permutation(n)
        await a.write(
            peer,
            page_fragments(src.data_ptr(), page, perm_s),
            page_fragments(dst.data_ptr(), page, perm_d),
            b"x",
        )
        assert await b.receive_notification(remote) == b"x"
        view_s, view_d = src.view(n, page), dst.view(n, page)
        assert torch.equal(view_d[torch.from_numpy(perm_d).cuda()], view_s[torch.from_numpy(perm_s).cuda()])


@pytest.mark.parametrize("cuda_ipc", [True, False])
async def test_cuda_reregistration_at_the_same_address(cuda_ipc: bool) -> None:
    """A peer deregisters a CUDA region and registers it again at the same address on a live connection. By CUDA
    IPC the write lands (the peer re-exports its handles). Through NIXL alone, NIXL 1.5.1 on the H200 refuses the
    new metadata: then the write raises a RegionError that says to reconnect, nothing lands, and the connection
    and the peer's other regions keep working. Either way: no hang and no wrong bytes."""
    try:
        get_transport("nixl")
    except MissingExtraError as exc:
        pytest.skip(str(exc))
    proc = await anyio.to_thread.run_sync(lambda: PeerProcess("nixl", device="cuda"))
    try:
        async with get_transport("nixl")(cuda_ipc=cuda_ipc) as transport:
            peer = await transport.connect(proc.address)
            kept = await remote_buffer(transport, peer, proc, "kept", MiB)
            reused = await remote_buffer(transport, peer, proc, "reused", MiB)
            src = torch.randint(0, 256, (MiB,), dtype=torch.uint8, device="cuda")
            await transport.register(src)
            whole = [[src.data_ptr(), MiB]]
            expected = await asha(src.cpu().numpy())
            await transport.write(peer, whole, [[reused, MiB]], b"before")
            await proc.call(op="deregister", name="reused")
            assert b"deregistered" in await transport.receive_message(peer)
            assert (await proc.call(op="reregister", name="reused"))["address"] == reused
            assert b"registered" in await transport.receive_message(peer)
            src.random_(0, 256)
            expected = await asha(src.cpu().numpy())
            with anyio.fail_after(60):
                try:
                    await transport.write(peer, whole, [[reused, MiB]], b"after")
                except RegionError as exc:
                    assert not cuda_ipc, exc
                    assert "reconnect" in str(exc)
                    landed = False
                else:
                    landed = True
            digest = (await proc.call(op="digest", name="reused", fragments=[[0, MiB]]))["sha"]
            assert (digest == expected) == landed
            print(f"nixl cuda_ipc={cuda_ipc}: re-registered region written: {landed}")
            await transport.write(peer, whole, [[kept, MiB]], b"kept")
            assert (await proc.call(op="digest", name="kept", fragments=[[0, MiB]]))["sha"] == expected
            await transport.send_message(peer, b"still talking")
    finally:
        proc.close()


@pytest.mark.parametrize("transport_name", ["nixl", "local"])
async def test_cuda_indexed_writes_on_the_device(transport_name: str) -> None:
    """Indexed writes into CUDA memory go by the device path (nixl: over CUDA IPC to another process; local: in
    this process): the template is checked once, two writes move in one launch with their ids checked, bytes
    verified; bad ids and a template past the registered memory are refused with nothing written; the same
    template's next writes are not checked again."""
    try:
        get_transport(transport_name)
    except MissingExtraError as exc:
        pytest.skip(str(exc))
    page, positions = 64 << 10, 256
    size = page * positions
    rng = np.random.default_rng(21)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    expected = await asha(swap_halves(src.cpu().numpy(), page))
    ids = np.arange(positions)
    proc = None
    async with get_transport(transport_name)() as transport, get_transport("local")() as here:
        if transport_name == "local":
            peer = await transport.connect(here.address)
            remote_peer = await here.accept()
            pool = torch.zeros(2 * size + 2 * page, dtype=torch.uint8, device="cuda")
            await here.grant(remote_peer, await here.register(pool[page : page + 2 * size]))
            await here.send_message(remote_peer, b"registered")
            await transport.receive_message(peer)
            dst = pool.data_ptr() + page

            async def landed(perm: np.ndarray) -> str:
                view = pool[page : page + 2 * size].view(-1, page)
                return await asha(view[torch.from_numpy(perm).cuda()].cpu().numpy())

            async def untouched() -> bool:
                return bool((pool[:page] == 0).all() and (pool[page + 2 * size :] == 0).all())
        else:
            proc = await anyio.to_thread.run_sync(lambda: PeerProcess(transport_name, device="cuda"))
            peer = await transport.connect(proc.address)
            dst = await remote_buffer(transport, peer, proc, "indexed", 2 * size, guard=page)

            async def landed(perm: np.ndarray) -> str:
                fragments = [[int(p) * page, page] for p in perm]
                return str((await proc.call(op="digest", name="indexed", fragments=fragments))["sha"])

            async def untouched() -> bool:
                return True  # the guard pages are not registered: the digest of the pages says enough

        try:
            await transport.register(src)
            rows = swapped_halves(src.data_ptr(), dst, page, positions, 2 * positions)
            perms = [rng.permutation(positions), positions + rng.permutation(positions)]
            before = transport.statistics()
            outcomes = await transport.write_indexed(
                peer,
                [
                    IndexedWrite(rows, ids, perms[0], b"a"),
                    IndexedWrite(rows, ids, np.full(positions, 2 * positions), b"never"),
                    IndexedWrite(rows, ids, perms[1], b"b"),
                ],
            )
            assert outcomes[0] is None and outcomes[2] is None, outcomes
            assert isinstance(outcomes[1], RegionError)
            after = transport.statistics()
            assert after.writes_indexed - before.writes_indexed == 2
            assert after.writes_combined - before.writes_combined == 2
            for perm in perms:
                assert await landed(perm) == expected
            past = swapped_halves(src.data_ptr(), dst, page, positions, 2 * positions + 1)
            (refused,) = await transport.write_indexed(peer, [IndexedWrite(past, ids, perms[0], b"never")])
            assert isinstance(refused, RegionError), refused
            assert await untouched()
            # the same template again, other ids: no new check, one more launch
            p_internal = transport.control.peer(peer)  # type: ignore[attr-defined]
            checked = p_internal.indexed.templates_checked
            src.random_(0, 256)
            expected = await asha(swap_halves(src.cpu().numpy(), page))
            again = rng.permutation(2 * positions)[:positions]
            assert await transport.write_indexed(peer, [IndexedWrite(rows, ids, again, b"c")]) == [None]
            assert await landed(again) == expected
            assert p_internal.indexed.templates_checked == checked
            assert transport.statistics().writes_indexed - before.writes_indexed == 3
        finally:
            if proc is not None:
                proc.close()
