"""Batched copies between arena rows and a host buffer (kvferry.kernels.host_copy): every layout of ids lands
byte for byte, both ways, on the host and on CUDA; ``stop`` ends a copy between chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.kernels import host_copy
from kvferry.kernels.copy import block_view
from kvferry.kernels.host_copy import RowSection, from_host, to_host

DEVICES = [
    "cpu",
    pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]

#: ids in runs (one long run, runs of 3), scattered (every other, descending, shuffled) and one row
LAYOUTS = {
    "one run": np.arange(2, 30),
    "runs of 3": np.concatenate([np.arange(s, s + 3) for s in (1, 10, 20, 5)]),
    "every other": np.arange(1, 40, 2),
    "descending": np.arange(39, 9, -1),
    "shuffled": np.random.default_rng(0).permutation(40)[:25],
    "one row": np.array([7]),
}


def arena_rows(device: str, count: int = 40, row_bytes: int = 4096, stride: int = 4096) -> torch.Tensor:
    arena = torch.randint(
        0, 256, (count * stride,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    return block_view(arena.to(device), count=count, stride=stride, block_bytes=row_bytes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("stride", [4096, 4160])
@pytest.mark.parametrize("staging", ["packed", "chunked"])
def test_rows_go_to_the_host_and_back_byte_for_byte(
    device: str, layout: str, stride: int, staging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA: through one staging buffer for the whole host span (packed), or section by section in chunks
    of 3 rows (a staging buffer smaller than the span)."""
    if staging == "chunked":
        monkeypatch.setattr(host_copy, "DEVICE_CHUNK_BYTES", 3 * 4096)
    rows = arena_rows(device, stride=stride)
    ids = LAYOUTS[layout].astype(np.int64)
    host = torch.empty((ids.size, rows.shape[1]), dtype=torch.uint8)
    assert to_host([RowSection(rows, ids, host)])
    if device != "cpu":
        torch.cuda.synchronize()
    expected = rows.index_select(0, torch.from_numpy(ids).to(rows.device)).cpu()
    assert torch.equal(host, expected)
    # back into other rows: a reversed set of destinations
    dst = np.arange(39, 39 - ids.size, -1).astype(np.int64)
    before = rows.clone()
    host.add_(1)
    assert from_host([RowSection(rows, dst, host)])
    if device != "cpu":
        torch.cuda.synchronize()
    after = rows.cpu()
    assert torch.equal(after[torch.from_numpy(dst)], host)
    untouched = np.setdiff1d(np.arange(40), dst)
    assert torch.equal(after[torch.from_numpy(untouched)], before.cpu()[torch.from_numpy(untouched)])


@pytest.mark.parametrize("device", DEVICES)
def test_several_sections_pack_into_one_buffer_and_back(device: str) -> None:
    """Sections of one host buffer with a gap between them (as an offload lays them out), scattered and single
    rows and a run: one staging span on CUDA."""
    a, b = arena_rows(device, row_bytes=1024, stride=1024), arena_rows(device, row_bytes=64, stride=128)
    buffer = torch.zeros(5 * 1024 + 64 + 3 * 64 + 64 + 1024, dtype=torch.uint8)
    ids_a, ids_b, ids_c, ids_d = np.array([3, 1, 4, 0, 2]), np.array([9, 8, 7]), np.array([6]), np.array([20])
    views = [
        buffer[:5120].view(5, 1024),
        buffer[5184:5376].view(3, 64),  # 64 bytes apart from the first
        buffer[5376:5440].view(1, 64),
        buffer[5440:].view(1, 1024),
    ]
    sections = [
        RowSection(a, ids_a, views[0]),
        RowSection(b, ids_b, views[1]),
        RowSection(b, ids_c, views[2]),
        RowSection(a, ids_d, views[3]),
    ]
    assert to_host(sections)
    if device != "cpu":
        torch.cuda.synchronize()
    expected = [
        rows.cpu()[torch.from_numpy(ids)] for rows, ids in ((a, ids_a), (b, ids_b), (b, ids_c), (a, ids_d))
    ]
    assert all(torch.equal(view, e) for view, e in zip(views, expected, strict=True))
    # and back into other rows
    for view in views:
        view.add_(3)
    back = [
        RowSection(a, ids_a + 5, views[0]),
        RowSection(b, ids_b + 10, views[1]),
        RowSection(a, ids_d + 1, views[3]),
    ]
    assert from_host(back)
    if device != "cpu":
        torch.cuda.synchronize()
    assert torch.equal(a.cpu()[torch.from_numpy(ids_a + 5)], views[0])
    assert torch.equal(b.cpu()[torch.from_numpy(ids_b + 10)], views[1])
    assert torch.equal(a.cpu()[torch.from_numpy(ids_d + 1)], views[3])


@pytest.mark.parametrize(("layout", "run_bytes"), [("one run", 4096), ("every other", 1 << 20)])
def test_stop_ends_a_copy_between_chunks(
    monkeypatch: pytest.MonkeyPatch, layout: str, run_bytes: int
) -> None:
    """Run by run (a run in chunks) or by index in chunks: two chunks of 4 rows land, then the copy stops."""
    monkeypatch.setattr(host_copy, "HOST_CHUNK_BYTES", 4 * 4096)
    monkeypatch.setattr(host_copy, "HOST_RUN_CHUNK_BYTES", 4 * 4096)
    monkeypatch.setattr(host_copy, "RUN_BYTES", run_bytes)
    rows = arena_rows("cpu")
    ids = LAYOUTS[layout].astype(np.int64)
    host = torch.zeros((ids.size, 4096), dtype=torch.uint8)
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 2  # two chunks, then stop

    assert not to_host([RowSection(rows, ids, host)], stop=stop)
    copied = rows[torch.from_numpy(ids[:8])]
    assert torch.equal(host[:8], copied)
    assert not host[8:].any()
    # an empty section and a stop that never fires: done
    assert to_host([RowSection(rows, ids[:0], host[:0]), RowSection(rows, ids, host)], stop=lambda: False)
    assert torch.equal(host, rows[torch.from_numpy(ids)])
