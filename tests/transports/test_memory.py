"""Region lookups and device waits (``_memory``): no peers needed."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.errors import RegionError, WireFormatError
from kvferry.transports import as_fragments
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


@pytest.mark.anyio
@pytest.mark.parametrize("rows", [4, 300])
async def test_host_copies_land_inline_or_in_worker_threads_by_size(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short host copies run on the loop's thread, long ones in worker threads in slices; the same bytes land."""
    import threading

    import numpy as np
    import torch

    from kvferry.transports import _memory

    monkeypatch.setattr(_memory, "HOST_INLINE_BYTES", 64 << 10)
    monkeypatch.setattr(_memory, "HOST_SLICE_BYTES", 100 << 10)  # several slices, a row cut across two
    threads: list[int] = []
    memmove = _memory._memmove_rows

    def recording(*args: list[int]) -> None:
        threads.append(threading.get_ident())
        memmove(*args)

    monkeypatch.setattr(_memory, "_memmove_rows", recording)
    page = 3 << 10
    src = torch.randint(0, 256, (rows * page,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    src_table = RegionTable([RegionInfo(src.data_ptr(), src.numel(), "cpu")])
    dst_table = RegionTable([RegionInfo(dst.data_ptr(), dst.numel(), "cpu")])
    order = np.random.default_rng(rows).permutation(rows)
    src_rows = np.array([[src.data_ptr() + i * page, page] for i in range(rows)], dtype=np.uint64)
    dst_rows = np.array([[dst.data_ptr() + int(j) * page, page] for j in order], dtype=np.uint64)
    await _memory.CopyPlan(src_rows, src_table, dst_rows, dst_table).run()
    assert torch.equal(dst.view(rows, page)[torch.from_numpy(order)], src.view(rows, page))
    if rows * page <= 64 << 10:
        assert threads == [threading.get_ident()]
    else:
        assert len(threads) == -(-rows * page // (100 << 10)) and threading.get_ident() not in threads
