"""What nixl peers export and how it is mapped (``kvferry.transports._nixl_exports``): the backend blob's
decoding is fuzzed in tests/fuzz; here, the CUDA IPC mapping's bookkeeping, without a device."""

from __future__ import annotations

import numpy as np

from kvferry.transports._memory import RegionTable
from kvferry.transports._nixl_exports import IpcExport, IpcPeer
from kvferry.transports.messages import RegionInfo
from kvferry.transports.writes import CheckedRows


def _peer_regions() -> RegionTable:
    return RegionTable(
        [
            RegionInfo(9000, 100, "cuda:0"),
            RegionInfo(1000, 500, "cpu"),
            RegionInfo(5000, 1000, "cuda:0"),
            RegionInfo(5100, 100, "cuda:0"),  # inside the one above
        ]
    )


def _mapped() -> IpcPeer:
    """A peer exporting its regions at 5000 and 9000, as if mapped here at 70000 and 80000 (no device)."""
    ipc = IpcPeer([IpcExport(5000, 1000, 0, ()), IpcExport(9000, 100, 0, ())])
    ipc.table = RegionTable([RegionInfo(5000, 1000, "cuda:0"), RegionInfo(9000, 100, "cuda:0")])
    ipc.local = np.array([70000, 80000], dtype=np.uint64)
    ipc.starts = np.array([5000, 9000], dtype=np.uint64)
    ipc.shift = ipc.local - ipc.starts
    ipc.local_table = RegionTable([RegionInfo(70000, 1000, "cuda:0"), RegionInfo(80000, 100, "cuda:0")])
    ipc.dirty = False
    return ipc


def test_ipc_route_maps_the_peers_ranges_to_its_mapped_regions() -> None:
    """A CUDA IPC write finds the mapped region of each destination row from the range the write check found
    it in (the peer's registered ranges, in any order; host ranges map to none), and notices a new mapping."""
    peer_regions = _peer_regions()
    ipc = IpcPeer()
    ipc.table = RegionTable([RegionInfo(5000, 1000, "cuda:0"), RegionInfo(9000, 100, "cuda:0")])
    assert ipc.exported_of(peer_regions).tolist() == [1, -1, 0, 0]
    assert ipc.exported_of(peer_regions) is ipc.exported_of(peer_regions)  # kept while nothing changed
    ipc.table = RegionTable([RegionInfo(9000, 100, "cuda:0")])  # remapped: the peer exports less now
    assert ipc.exported_of(peer_regions).tolist() == [0, -1, -1, -1]
    assert IpcPeer().exported_of(RegionTable([])).tolist() == []


def test_a_route_translates_destinations_into_the_mapping_or_declines() -> None:
    """Rows in exported regions move by the mapped region's shift; a row in memory the peer did not export
    (host memory), a peer that exports nothing, or a mapping that failed: no route (the write goes through NIXL)."""
    peer_regions = _peer_regions()
    ipc = _mapped()
    src = np.array([[1, 10], [2, 10]], dtype=np.uint64)
    dst = np.array([[5100, 10], [9050, 10]], dtype=np.uint64)
    rows = CheckedRows(src, dst, np.zeros(2, dtype=np.int64), peer_regions.locate(dst, "x"))
    route = ipc.route(peer_regions, rows)
    assert route is not None and route.dst.tolist() == [[70100, 10], [80050, 10]]
    assert route.dst_index.tolist() == [0, 1] and route.table is ipc.local_table
    host = CheckedRows(
        src[:1], np.array([[1000, 10]], dtype=np.uint64), np.zeros(1, np.int64), np.ones(1, np.int64)
    )
    assert ipc.route(peer_regions, host) is None
    assert IpcPeer().route(peer_regions, rows) is None  # exports nothing
    ipc.failed = True
    assert ipc.route(peer_regions, rows) is None


def test_device_destinations_are_kept_until_the_regions_change() -> None:
    """Indexed writes find the peer's regions in the mapping: the same answer while neither the peer's regions
    nor the mapping change, a new one when they do, none once the mapping failed."""
    peer_regions = _peer_regions()
    ipc = _mapped()
    found = ipc.device_destinations(peer_regions)
    assert found is not None and found.exported.tolist() == [1, -1, 0, 0]
    assert found.table is ipc.local_table and found.shift.tolist() == [65000, 71000]
    assert ipc.device_destinations(peer_regions) is found
    assert ipc.device_destinations(_peer_regions()) is not found  # the peer sent a new region table
    ipc.failed = True
    assert ipc.device_destinations(peer_regions) is None
