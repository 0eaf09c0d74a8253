"""Region lookups, device copies and cross-memory attach (``_memory``, ``_cma``): no peers needed."""

from __future__ import annotations

import itertools
import subprocess
import sys

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.errors import RegionError, WireFormatError
from kvferry.transports import _cma, as_fragments
from kvferry.transports._memory import RegionTable
from kvferry.transports.messages import RegionInfo


def test_region_table_with_overlaps() -> None:
    table = RegionTable([RegionInfo(100, 50, "cpu"), RegionInfo(120, 10, "cpu"), RegionInfo(400, 10, "cpu")])
    assert table.locate(as_fragments([[100, 50], [125, 20], [400, 10]]), "x").tolist() == [0, 0, 2]
    for bad in ([[99, 2]], [[149, 2]], [[405, 6]], [[200, 1]]):
        with pytest.raises(RegionError):
            table.locate(as_fragments(bad), "x")
    with pytest.raises(RegionError):
        RegionTable([]).locate(as_fragments([[1, 1]]), "x")


def test_region_table_answers_rows_in_one_range_at_once() -> None:
    """Rows that all lie in one range get its index without a search per row; any other mix is searched row by
    row, and the answers are what a search of each row alone gives."""
    table = RegionTable(
        [RegionInfo(1000, 100, "cpu"), RegionInfo(5000, 1000, "cpu"), RegionInfo(5200, 50, "cpu")]
    )
    one = as_fragments([[5900, 100], [5000, 8], [5210, 20], [5500, 1]])
    located = table.locate(one, "x")
    assert located.tolist() == [1, 1, 1, 1]
    assert located.tolist() == [int(table.locate(one[i : i + 1], "x")[0]) for i in range(len(one))]
    mixed = as_fragments([[1000, 10], [5000, 10], [1090, 10]])
    assert table.locate(mixed, "x").tolist() == [0, 1, 0]
    # the lowest row's range does not reach the highest end: searched row by row, the bad row named
    with pytest.raises(RegionError, match="fragment 2"):
        table.locate(as_fragments([[5000, 10], [5100, 10], [5990, 11]]), "x")
    assert table.holding(as_fragments([[5000, 10], [999, 2], [1099, 1]])).tolist() == [1, -1, 0]
    assert table.holding(as_fragments([[1, 1]])).tolist() == [-1]
    assert RegionTable([]).holding(as_fragments([[1, 1], [2, 1]])).tolist() == [-1, -1]


@given(
    st.lists(st.tuples(st.integers(0, 7000), st.integers(1, 1200)), min_size=2, max_size=40),
    st.integers(0, 7000),
    st.integers(0, 1200),
)
def test_region_table_bounds_answer_as_the_rows_do(rows: list[tuple[int, int]], low: int, extra: int) -> None:
    """Given bounds (the rows' lowest address, a bound on their highest end) answer as the rows alone do: one
    range holding the span answers every row at once; otherwise the rows are searched one by one (the same
    answers, the same refusal naming the same row)."""
    table = RegionTable(
        [RegionInfo(1000, 100, "cpu"), RegionInfo(5000, 1000, "cpu"), RegionInfo(5200, 50, "cpu")]
    )
    fragments = as_fragments(rows)
    lowest = int(fragments[:, 0].min())
    highest = int((fragments[:, 0] + fragments[:, 1]).max())
    exact = table.holding(fragments).tolist()
    # tight bounds, and a looser high bound (as write_rows gives: highest address plus longest length)
    for bounds in ((lowest, highest), (lowest, highest + extra)):
        assert table.holding(fragments, bounds).tolist() == exact
        try:
            expected: object = table.locate(fragments, "x").tolist()
        except RegionError as exc:
            expected = str(exc)
        try:
            got: object = table.locate(fragments, "x", bounds).tolist()
        except RegionError as exc:
            got = str(exc)
        assert got == expected
    # bounds in one range answer every row of that range at once
    inside = as_fragments([[5000 + low % 900, 1 + extra % 100], [5000, 1]])
    assert table.locate(inside, "x", (5000, 5000 + low % 900 + 1 + extra % 100)).tolist() == [1, 1]


@pytest.mark.parametrize(
    "layout", ["both scattered", "source in order", "destination in order", "one fragment"]
)
@given(seed=st.integers(0, 2**16), unit=st.sampled_from([1, 2, 8, 64, 4096]), runs=st.integers(1, 12))
def test_device_copy_moves_exactly_the_fragments(layout: str, seed: int, unit: int, runs: int) -> None:
    """The batched copy of the CUDA paths (local on CUDA, nixl by CUDA IPC) cuts rows at the gcd granularity and
    picks a plain, an index_copy, an index_select or a staged copy; on CPU tensors it must move the same bytes."""
    import torch

    from kvferry.transports._memory import device_copy

    rng = np.random.default_rng(seed)
    if layout == "one fragment":
        runs = 1
    lengths = rng.integers(1, 4, runs) * unit
    if layout in ("source in order", "destination in order"):
        lengths[:] = unit * 2  # runs that touch each other, so the in-order side is one run of rows
    slots = int(lengths.max())
    size = slots * runs + unit
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    dst = torch.zeros(size, dtype=torch.uint8)
    order_s = np.arange(runs) if layout in ("source in order", "one fragment") else rng.permutation(runs)
    order_d = np.arange(runs) if layout == "destination in order" else rng.permutation(runs)
    base_s, base_d = src.data_ptr(), dst.data_ptr()
    s_off = order_s * slots if layout != "source in order" else np.arange(runs) * unit * 2
    d_off = order_d * slots if layout != "destination in order" else np.arange(runs) * unit * 2
    src_f = np.stack([base_s + s_off, lengths], axis=1).astype(np.uint64)
    dst_f = np.stack([base_d + d_off, lengths], axis=1).astype(np.uint64)
    device_copy(src, base_s, src_f, dst, base_d, dst_f)
    expected = np.zeros(size, dtype=np.uint8)
    source = src.numpy()
    for (a, n), (b, _) in zip(src_f - [base_s, 0], dst_f - [base_d, 0], strict=True):
        expected[int(b) : int(b) + int(n)] = source[int(a) : int(a) + int(n)]
    assert np.array_equal(dst.numpy(), expected)


def test_granularity_and_row_indices() -> None:
    from kvferry.transports._memory import granularity, row_indices

    assert granularity(np.array([4096, 8192]), np.array([0, 12288]), np.array([4096])) == 4096
    assert granularity(np.array([64, 96])) == 32
    rows = row_indices(np.array([5, 0, 9], dtype=np.int64), np.array([2, 1, 3], dtype=np.int64))
    assert rows.tolist() == [5, 6, 0, 9, 10, 11]


class _FakeEvent:
    """A recorded device event that passes after ``polls`` queries, or only when synchronised (``polls`` None)."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.queries = 0
        self.synchronized = False
        self.thread: int | None = None

    def query(self) -> bool:
        self.queries += 1
        return self.polls is not None and self.queries > self.polls

    def synchronize(self) -> None:
        import threading
        import time

        time.sleep(0.05)
        self.thread = threading.get_ident()
        self.synchronized = True


@pytest.mark.anyio
async def test_device_waits_poll_briefly_then_use_a_thread() -> None:
    import threading

    from kvferry.transports._memory import POLL_SECONDS, wait_event

    quick = _FakeEvent(polls=3)  # ends within the poll budget: no worker thread
    await wait_event(quick, 1 << 20)
    assert quick.queries == 4 and not quick.synchronized
    slow = _FakeEvent(polls=None)  # never ends by polling: the thread waits, after at most the budget
    await wait_event(slow, 1 << 30)
    assert slow.synchronized and slow.thread != threading.get_ident() and slow.queries > 1
    unpolled = _FakeEvent(polls=3)  # another write is in flight: straight to the thread
    await wait_event(unpolled, 1 << 20, poll=False)
    assert unpolled.synchronized and unpolled.queries == 1
    assert POLL_SECONDS <= 2e-3  # a bounded poll, not a spinning wait


@pytest.mark.anyio
async def test_a_cancelled_device_wait_returns_only_after_the_event() -> None:
    """What was queued reads and writes memory the caller may free once the wait returns: a cancel waits."""
    import anyio

    from kvferry.transports._memory import wait_event

    event = _FakeEvent(polls=None)
    with anyio.move_on_after(0.001) as scope:
        await wait_event(event, 1 << 30)
    assert event.synchronized
    assert scope.cancel_called


# --- cross-memory attach ---------------------------------------------------------------------------------


@pytest.mark.skipif(not _cma.available(), reason="needs process_vm_readv/writev")
def test_cma_read_and_write_copy_rows_and_fail_with_errors() -> None:
    import errno
    import os

    here = np.arange(64, dtype=np.uint8)
    there = np.zeros(64, dtype=np.uint8)
    base, other = here.ctypes.data, there.ctypes.data
    rows_here = np.array([[base + 8, 8], [base, 8], [base + 32, 16]], dtype=np.uint64)
    rows_there = np.array([[other, 8], [other + 16, 8], [other + 40, 16]], dtype=np.uint64)
    _cma.write(os.getpid(), rows_here, rows_there)  # into "another process": ourselves
    assert there[:8].tolist() == list(range(8, 16)) and there[16:24].tolist() == list(range(8))
    assert there[40:56].tolist() == list(range(32, 48)) and not there[8:16].any()
    back = np.zeros(64, dtype=np.uint8)
    _cma.read(
        os.getpid(), rows_there, np.array([[back.ctypes.data, 8], [back.ctypes.data + 8, 8]], np.uint64)
    )
    assert back[:16].tolist() == [*range(8, 16), *range(8)]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(ProcessLookupError):
        _cma.read(gone.pid, rows_there, rows_here)
    with pytest.raises(OSError) as unmapped:
        _cma.read(os.getpid(), np.array([[8, 8]], dtype=np.uint64), rows_there[:1])
    assert unmapped.value.errno == errno.EFAULT


def test_cma_slices_cut_runs_of_about_the_slice_size() -> None:
    lengths = np.array([3, 3, 3, 3, 10, 1], dtype=np.uint64)
    assert _cma.slices(lengths, 6) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert _cma.slices(lengths, 1000) == [(0, 6)]
    assert _cma.slices(np.zeros(0, dtype=np.uint64), 6) == []
    for cut in (1, 4, 7, 23):
        runs = _cma.slices(lengths, cut)
        assert runs[0][0] == 0 and runs[-1][1] == len(lengths)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))


@pytest.mark.anyio
async def test_copy_slices_runs_slices_in_threads_and_stops_at_the_first_error() -> None:
    import threading
    import time

    mib = 1 << 20
    rows = np.array([[i * mib, mib] for i in range(64)], dtype=np.uint64)  # 64 MiB in 1 MiB rows
    seen: list[tuple[int, int]] = []
    running, most = 0, 0
    lock = threading.Lock()

    def copy(pid: int, src: np.ndarray, dst: np.ndarray) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1
            seen.append((int(src[0, 0]) // mib, len(src)))
        if int(src[0, 0]) // mib == 16:
            raise ProcessLookupError(3, "No such process")

    slices_done = 0

    async def after() -> None:
        nonlocal slices_done
        slices_done += 1

    # 64 MiB over 4 threads: slices of 16 MiB (per thread), the one at row 16 fails
    with pytest.raises(ProcessLookupError):
        await _cma.copy_slices(copy, 1, rows, rows, slice_bytes=64 * mib, threads=4, after_slice=after)
    assert sorted(seen) == [(0, 16), (16, 16), (32, 16), (48, 16)] and most == 4
    assert slices_done == 3
    # a slice that fails stops the workers from taking more
    seen.clear()
    most = 0
    with pytest.raises(ProcessLookupError):
        await _cma.copy_slices(
            copy, 1, rows[16:], rows[16:], slice_bytes=64 * mib, threads=2, after_slice=after
        )
    assert len(seen) <= 2 and most <= 2
    seen.clear()
    await _cma.copy_slices(
        copy, 1, rows[17:25], rows[17:25], slice_bytes=64 * mib, threads=4, after_slice=after
    )
    assert seen == [(17, 8)]  # 8 MiB: one slice, copied inline
    seen.clear()
    await _cma.copy_slices(copy, 1, rows[32:], rows[32:], slice_bytes=4 * mib, threads=32, after_slice=after)
    assert sorted(seen) == [(32 + 4 * i, 4) for i in range(8)]  # slice_bytes bounds the slices from above
    seen.clear()
    await _cma.copy_slices(copy, 1, rows[32:], rows[32:], slice_bytes=64 * mib, threads=32, after_slice=after)
    assert sorted(seen) == [(32 + 8 * i, 8) for i in range(4)]  # and MIN_PARALLEL_SLICE from below
    assert 2 <= _cma.copy_threads() <= 8


@given(st.lists(st.integers(1, 40), min_size=1, max_size=20), st.integers(1, 16))
def test_split_rows_moves_the_same_bytes_in_pieces(lengths: list[int], longest: int) -> None:
    src_off = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    dst_off = 1000 + src_off[::-1].copy()  # another layout on the other side
    src = np.stack([src_off, lengths], axis=1).astype(np.uint64)
    dst = np.stack([dst_off, lengths], axis=1).astype(np.uint64)
    cut_src, cut_dst = _cma.split_rows(src, dst, longest)
    assert int(cut_src[:, 1].max()) <= max(longest, 0) and np.array_equal(cut_src[:, 1], cut_dst[:, 1])

    def pairs(s: np.ndarray, d: np.ndarray) -> list[tuple[int, int]]:
        return [(int(a) + k, int(b) + k) for (a, n), (b, _) in zip(s, d, strict=True) for k in range(int(n))]

    assert pairs(cut_src, cut_dst) == pairs(src, dst)  # byte for byte, in order


# --- what a peer's bytes may hold: exact types, ranges inside the address space ------------------------------


def test_a_region_table_refuses_ranges_outside_the_address_space() -> None:
    """RegionTable itself (whatever built its ranges): WireFormatError, a ValueError, never OverflowError."""
    with attrs.validators.disabled():
        bad = [
            RegionInfo(2**64 - 1, 2, "cpu"),
            RegionInfo(2**64, 1, "cpu"),
            RegionInfo(-1, 10, "cpu"),
            RegionInfo(0, 2**70, "cpu"),
            RegionInfo(10, 0, "cpu"),
        ]
    for region in bad:
        with pytest.raises(WireFormatError, match="region"):
            RegionTable([RegionInfo(4096, 10, "cpu"), region])


@given(
    st.lists(st.tuples(st.integers(0, 300), st.integers(1, 80)), max_size=12),
    st.lists(st.tuples(st.integers(0, 400), st.integers(1, 60)), min_size=1, max_size=12),
)
def test_a_region_table_answers_as_a_search_of_every_range(
    ranges: list[tuple[int, int]], rows: list[tuple[int, int]]
) -> None:
    """A row is held iff some range holds it; the range named holds it."""
    regions = [RegionInfo(a, n, "cpu") for a, n in ranges]
    table = RegionTable(regions)
    held = table.holding(as_fragments(rows)).tolist()
    for (address, length), index in zip(rows, held, strict=True):
        inside = [r.address <= address and address + length <= r.address + r.length for r in regions]
        assert (index >= 0) == any(inside)
        if index >= 0:
            assert inside[index]
