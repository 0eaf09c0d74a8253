"""Cross-memory attach (:mod:`kvferry.transports._cma`): batched ``process_vm_readv`` / ``process_vm_writev``
copies of rows, their slices and their worker threads."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.transports import _cma


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


@pytest.mark.anyio
async def test_a_short_copy_runs_on_the_callers_thread() -> None:
    import threading

    threads: list[int] = []

    def copy(pid: int, src: np.ndarray, dst: np.ndarray) -> None:
        threads.append(threading.get_ident())

    async def after() -> None:
        pass

    kib = 1 << 10
    short = np.array([[i * 4 * kib, 4 * kib] for i in range(_cma.INLINE_BYTES // (4 * kib))], dtype=np.uint64)
    await _cma.copy_slices(copy, 1, short, short, after_slice=after)
    assert threads == [threading.get_ident()] and _cma.inline(short)
    # one byte more, or more rows than one system call takes: a worker thread
    longer = np.concatenate([short, [[1 << 30, 1]]]).astype(np.uint64)
    many = np.array([[i * 8, 1] for i in range(_cma.IOV_MAX + 1)], dtype=np.uint64)
    for rows in (longer, many):
        threads.clear()
        await _cma.copy_slices(copy, 1, rows, rows, after_slice=after)
        assert threads and threading.get_ident() not in threads and not _cma.inline(rows)


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
