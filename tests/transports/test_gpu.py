"""CUDA regions in two processes on one GPU (nixl and ucx); skipped without CUDA."""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest
import torch
from conftest import PeerProcess
from test_transports import asha, remote_buffer

from kvferry.errors import MissingExtraError, RegionError
from kvferry.transports import get_transport, page_fragments

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
        await b.register(dst)
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
