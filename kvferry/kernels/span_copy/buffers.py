"""Where the span copy's tables and ids live: blocks of pinned host memory kept for reuse (:class:`PinnedTables`),
one device buffer per stream and thread the tables are uploaded into (:class:`DeviceTables`), and the uploads.

Pinned memory, like the compiled kernels, is per process: each of the two keepers has one instance per process
(:data:`pinned_tables`, :data:`device_tables`). Allocating either kind of memory per write costs far more host
time than taking a kept block.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from kvferry.kernels.span_copy.cuda import upload_async

__all__ = [
    "POOLED_ROWS",
    "DeviceTables",
    "PinnedTables",
    "device_tables",
    "pinned_ids",
    "pinned_table",
    "pinned_tables",
    "pinned_words",
    "upload",
    "upload_held",
]

#: The largest table block kept for reuse (1.5 MiB).
POOLED_ROWS = 1 << 16


class PinnedTables:
    """Tables in pinned host memory, which the kernel reads directly (under unified addressing a pinned block's
    host address is also its device address), kept for reuse: a table is a view of a block of the next power of
    two rows, and the block goes back to the free blocks when the last view of the table is gone (so not before
    the caller let go of ``keep``, after the copy ran). Taking a free block costs a few microseconds, where a
    pinned allocation from torch costs tens.

    Blocks of more than :data:`POOLED_ROWS` rows are not kept (torch's caching host allocator has them)."""

    __slots__ = ("_free", "_lock", "allocated")

    def __init__(self) -> None:
        self._free: dict[int, list[Any]] = {}
        self._lock = threading.Lock()
        #: blocks allocated (each kept for reuse once free)
        self.allocated = 0

    def take(self, rows: int) -> npt.NDArray[np.int64]:
        """An empty ``[rows, 3]`` int64 table in pinned memory, not handed out again while it (or a view of it)
        lives."""
        import torch

        capacity = 1 << max(rows - 1, 63).bit_length()
        if capacity > POOLED_ROWS:
            return torch.empty((rows, 3), dtype=torch.int64, pin_memory=True).numpy()
        with self._lock:
            free = self._free.get(capacity)
            block = free.pop() if free else None
        if block is None:
            block = torch.empty((capacity, 3), dtype=torch.int64, pin_memory=True)
            self.allocated += 1
        # a new array over the block for each table: the base of the table and of every view made of it (numpy
        # refers a view to the array that holds the memory), so it dies with the last of them
        owner = block.numpy()
        weakref.finalize(owner, self._give_back, capacity, block)
        table: npt.NDArray[np.int64] = owner[:rows]
        return table

    def _give_back(self, capacity: int, block: Any) -> None:
        with self._lock:
            self._free.setdefault(capacity, []).append(block)

    def __repr__(self) -> str:
        with self._lock:
            free = sum(len(blocks) for blocks in self._free.values())
        return f"<PinnedTables allocated={self.allocated} free={free}>"


#: this process's pinned tables
pinned_tables = PinnedTables()


def pinned_table(pieces: int) -> npt.NDArray[np.int64]:
    """An empty table in pinned host memory, which the kernel reads directly; not handed out again while the
    returned array (or a view of it) lives."""
    return pinned_tables.take(pieces)


def pinned_words(words: int) -> npt.NDArray[np.int64]:
    """An empty int64 vector of ``words`` in pinned host memory (a view of a pinned block of 3-word rows)."""
    return pinned_table(-(-words // 3)).reshape(-1)[:words]


def pinned_ids(count: int) -> npt.NDArray[np.int64]:
    """An int64 vector of ``count`` values in pinned host memory, which
    :func:`~kvferry.kernels.span_copy.copy_indexed` reads directly."""
    import torch

    vector: npt.NDArray[np.int64] = torch.empty(max(count, 1), dtype=torch.int64, pin_memory=True).numpy()
    return vector[:count]


class DeviceTables:
    """One device buffer per (device, stream, thread) that the grid form's tables are uploaded into, kept: a
    device allocation per write costs more host time than the rest of the launch.

    Safe without waiting because every use of a buffer is on its one stream, by its one thread, which queues
    the upload and the kernel that reads it in one call: the upload of the next table is queued after the
    kernel that read the last, so it runs only once that kernel is done (two threads sharing a buffer could
    queue both uploads before either kernel). A buffer outgrown goes back to torch's caching allocator, which
    hands it out again only in that stream's order."""

    __slots__ = ("_buffers", "_lock", "allocated")

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int, int], Any] = {}
        self._lock = threading.Lock()
        #: buffers allocated (a stream's first, and each time one grows)
        self.allocated = 0

    def take(self, ordinal: int, stream: int, words: int) -> Any:
        """The calling thread's buffer of ``stream`` on device ``ordinal``, at least ``words`` int64 long."""
        import torch

        key = (ordinal, stream, threading.get_ident())
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < words:
                capacity = 1 << max(words - 1, 1023).bit_length()
                buffer = torch.empty(capacity, dtype=torch.int64, device=torch.device("cuda", ordinal))
                self._buffers[key] = buffer
                self.allocated += 1
            return buffer

    def __repr__(self) -> str:
        with self._lock:
            return f"<DeviceTables {len(self._buffers)} buffers, {self.allocated} allocated>"


#: this process's device table buffers
device_tables = DeviceTables()


def upload_held(table: npt.NDArray[np.int64], ordinal: int, stream: int, held: list[Any]) -> int:
    """The device address of a copy of ``table`` (pinned host memory) queued on ``stream``, the current stream of
    device ``ordinal`` (the current device: :func:`~kvferry.kernels.span_copy.cuda.on_ordinal`), in that
    stream's table buffer (:class:`DeviceTables`); ``held`` gets the table and the buffer, to hold until the
    stream has passed what reads them."""
    import torch

    held.append(table)
    buffer = device_tables.take(ordinal, stream, table.size)
    held.append(buffer)
    if not upload_async(buffer.data_ptr(), table.ctypes.data, table.nbytes, stream):
        buffer[: table.size].copy_(torch.from_numpy(table.reshape(-1)), non_blocking=True)
    return int(buffer.data_ptr())


def upload(table: npt.NDArray[np.int64], device: Any) -> Any:
    """``table`` on ``device``, copied on its current stream from pinned host memory.

    The driver may stage a copy from pageable memory synchronously with the work queued on the stream before it
    (a write that first queued ``copy_`` of its long rows would wait for them on the host). The pinned block
    comes from torch's caching host allocator, which does not hand it out again before the copy from it ran."""
    import torch

    host = torch.empty(table.shape, dtype=torch.int64, pin_memory=True)
    host.numpy()[...] = table
    return host.to(device, non_blocking=True)
