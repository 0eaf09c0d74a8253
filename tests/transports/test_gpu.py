"""CUDA regions in two processes on one GPU (nixl and ucx); skipped without CUDA."""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest
import torch
from conftest import PeerProcess
from test_transports import asha, remote_buffer

from kvferry.errors import MissingExtraError
from kvferry.transports import get_transport, page_fragments

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.anyio,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MiB = 1 << 20


@pytest.mark.parametrize("transport_name", ["nixl", "ucx"])
async def test_cuda_regions_across_processes(transport_name: str) -> None:
    try:
        get_transport(transport_name)
    except MissingExtraError as exc:
        pytest.skip(str(exc))
    proc = await anyio.to_thread.run_sync(lambda: PeerProcess(transport_name, device="cuda"))
    try:
        async with get_transport(transport_name)() as transport:
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
                reply = await proc.call(op="wait_notify", name="gpu", fragments=[[int(p) * page, page] for p in perm])
                assert reply["sha"] == expected
                print(f"{transport_name} cuda {page >> 10} KiB pages: {size / seconds / 1e9:.1f} GB/s")
    finally:
        proc.close()
