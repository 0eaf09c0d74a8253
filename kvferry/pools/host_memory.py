"""Host memory that offloaded requests' bytes live in: buffers sized on demand, kept for reuse, freed on close.

One :class:`HostMemory` per cache manager. For an arena on CUDA its blocks are **pinned** (page-locked and
registered with CUDA, so copies to and from the device run at full speed and asynchronously); for an arena on
the host they are plain host memory. Pinning needs CUDA, and costs time in proportion to the size (the pages
are faulted in and locked): a block is allocated once and reused by later offloads, and the allocation itself
runs where the copy runs (:meth:`HostBuffer.materialize`, called from the copy's worker thread), never in the
caller's event loop.

Blocks come in size classes (eight per power of two, so a buffer wastes at most an eighth of its size); a
released block waits in its class for the next buffer of that class. :meth:`HostMemory.trim` frees the waiting
blocks; :meth:`HostMemory.close` frees them too, and every block released after it is freed at once.
Thread-safe: buffers are taken and released on the event loop's thread, materialized in worker threads.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["MIN_BLOCK_BYTES", "HostBuffer", "HostMemory", "size_class"]

#: The smallest block: small requests share one class.
MIN_BLOCK_BYTES = 64 << 10

#: ``cudaHostRegisterPortable``: pinned for every CUDA context of the process (every rank's device)
_REGISTER_PORTABLE = 1


def size_class(nbytes: int) -> int:
    """The block size a buffer of ``nbytes`` gets: ``nbytes`` rounded up to an eighth of its power of two (at
    least :data:`MIN_BLOCK_BYTES`)."""
    if nbytes <= MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


class _Block:
    """One allocation: ``capacity`` bytes of host memory, registered with CUDA when ``pinned``."""

    __slots__ = ("__weakref__", "array", "capacity", "pinned", "tensor")

    def __init__(self, capacity: int, pin: bool) -> None:
        self.capacity = capacity
        self.array = np.empty(capacity, dtype=np.uint8)
        self.pinned = pin and _register(self.array)
        if self.pinned:
            # unregister when the last view of the memory is gone, before numpy frees it
            weakref.finalize(self.array, _unregister, self.array.ctypes.data)
        self.tensor = torch.from_numpy(self.array)


def _register(array: np.ndarray) -> bool:
    """Page-lock ``array`` for CUDA; False where that fails (the copies still work, unpinned)."""
    try:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        return int(cudart.cudaHostRegister(array.ctypes.data, array.nbytes, _REGISTER_PORTABLE)) == 0
    except (RuntimeError, AttributeError, AssertionError):
        return False


def _unregister(address: int) -> None:
    # at interpreter shutdown CUDA may be gone already: the process frees it all then
    with contextlib.suppress(RuntimeError, AttributeError, AssertionError):
        torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]


class HostBuffer:
    """``nbytes`` of host memory for one offloaded request, from a :class:`HostMemory` block.

    The block is taken when the buffer is reserved if one waits in its class, else allocated by
    :meth:`materialize` (in the copy's thread). Give it back with :meth:`HostMemory.release` once nothing
    reads or writes it any more.
    """

    __slots__ = ("_block", "_owner", "nbytes")

    def __init__(self, owner: HostMemory, nbytes: int, block: _Block | None) -> None:
        self._owner = owner
        self.nbytes = nbytes
        self._block = block

    @property
    def materialized(self) -> bool:
        return self._block is not None

    @property
    def pinned(self) -> bool:
        return self._block is not None and self._block.pinned

    def materialize(self) -> torch.Tensor:
        """The buffer's ``[nbytes]`` uint8 tensor, allocating (and pinning) its block first if needed.

        :raises MemoryError: (or torch's error) when the host has no memory left; nothing is held then.
        """
        if self._block is None:
            self._block = self._owner.allocate(size_class(self.nbytes))
        return self._block.tensor[: self.nbytes]

    @property
    def tensor(self) -> torch.Tensor:
        """The materialized buffer (:meth:`materialize` first)."""
        assert self._block is not None, "the host buffer was not materialized"
        return self._block.tensor[: self.nbytes]

    def _take_block(self) -> _Block | None:
        block, self._block = self._block, None
        return block

    def __repr__(self) -> str:
        where = "pinned" if self.pinned else "host" if self.materialized else "reserved"
        return f"<HostBuffer {self.nbytes} B {where}>"


class HostMemory:
    """Host buffers for offloaded requests, pinned when ``pinned`` (an arena on CUDA), kept for reuse."""

    def __init__(self, *, pinned: bool) -> None:
        self.pinned = pinned
        self._lock = threading.Lock()
        self._free: dict[int, list[_Block]] = {}
        self._closed = False
        #: bytes of every block allocated and not freed (held by buffers or waiting for reuse)
        self.allocated_bytes = 0
        #: blocks allocated since construction (a reused block is not counted again)
        self.allocations = 0

    def reserve(self, nbytes: int) -> HostBuffer:
        """A buffer of ``nbytes``: a waiting block of its class now if there is one, else allocated later by
        :meth:`HostBuffer.materialize`."""
        capacity = size_class(nbytes)
        with self._lock:
            waiting = self._free.get(capacity)
            block = waiting.pop() if waiting else None
        return HostBuffer(self, nbytes, block)

    def allocate(self, capacity: int) -> _Block:
        """A new block of ``capacity`` bytes (pinned when this memory is). Thread-safe."""
        block = _Block(capacity, self.pinned)
        with self._lock:
            self.allocated_bytes += capacity
            self.allocations += 1
        return block

    def release(self, buffer: HostBuffer) -> None:
        """Give the buffer's block back: kept for the next buffer of its class, freed after :meth:`close`.
        Idempotent."""
        block = buffer._take_block()
        if block is None:
            return
        with self._lock:
            if not self._closed:
                self._free.setdefault(block.capacity, []).append(block)
                return
            self.allocated_bytes -= block.capacity

    def trim(self) -> int:
        """Free every block waiting for reuse; blocks held by buffers stay. Returns the bytes freed."""
        with self._lock:
            blocks = [b for waiting in self._free.values() for b in waiting]
            self._free.clear()
            freed = sum(b.capacity for b in blocks)
            self.allocated_bytes -= freed
        return freed

    def close(self) -> None:
        """Free the waiting blocks, and from now on every block released. Idempotent."""
        with self._lock:
            self._closed = True
        self.trim()

    @property
    def waiting_bytes(self) -> int:
        """Bytes of the blocks waiting for reuse."""
        with self._lock:
            return sum(b.capacity for waiting in self._free.values() for b in waiting)

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "host"
        return f"<HostMemory {kind}: {self.allocated_bytes} B allocated, {self.waiting_bytes} B waiting>"
